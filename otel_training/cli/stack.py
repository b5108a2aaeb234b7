"""``otel-training stack``: the Collector, Prometheus, Alertmanager, Tempo and Grafana
files, shipped inside the package.

``stack init DIR`` writes docker-compose.yml and every configuration it mounts into
DIR; ``stack check DIR`` validates such a directory (``cli/stack_check.py``);
``stack up DIR``, ``stack status DIR`` and ``stack down DIR`` run the compose file's
services without Docker (``cli/stack_plan.py``, ``cli/stack_procs.py``). The
package's copies are the repository's top-level files (``otel_training/stack_files``
links to them and the build copies what they point to), so there is one source.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from importlib.resources import files
from importlib.resources.abc import Traversable
from pathlib import Path

from otel_training.diagnosis.words import plural

PROG = "otel-training stack"
PASSWORD_HINT = "GRAFANA_ADMIN_PASSWORD='choose-one' docker compose up -d"


def _walk(node: Traversable, prefix: str) -> dict[str, bytes]:
    out: dict[str, bytes] = {}
    for child in node.iterdir():
        rel = f"{prefix}{child.name}"
        if child.is_dir():
            out.update(_walk(child, rel + "/"))
        elif child.name != "__pycache__":
            out[rel] = child.read_bytes()
    return out


def stack_files() -> dict[str, bytes]:
    """Every file of the stack, by path relative to the stack directory (``/``-separated)."""
    return dict(sorted(_walk(files("otel_training") / "stack_files", "").items()))


def _write(path: Path, data: bytes) -> None:
    """Write through a temporary file and a rename: never a half-written config."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
        os.chmod(tmp, 0o644)  # mkstemp's 0600 would hide the configs from the containers' users
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _short(names: list[str], limit: int = 4) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")


def init(directory: Path, force: bool = False) -> int:
    """Write the stack into ``directory``; refuse (exit 1, nothing written) where a file
    there differs from this version's, unless ``force``."""
    out, err = sys.stdout, sys.stderr
    if directory.exists() and not directory.is_dir():
        print(f"{PROG} init: {directory} is a file, not a directory: give a new or existing directory", file=err)
        return 2
    wanted = stack_files()
    blocked, changed, same = [], [], 0
    for rel, data in wanted.items():
        target = directory / rel
        if target.is_dir() or any(p.is_file() for p in list(target.parents)[: rel.count("/")]):
            blocked.append(rel)
        elif not target.exists():
            changed.append(rel)
        elif target.read_bytes() == data:
            same += 1
        else:
            changed.append(rel)
    if blocked:
        print(f"{PROG} init: {directory}: a file and a directory clash at {_short(blocked)}: move them away", file=err)
        return 2
    differing = [rel for rel in changed if (directory / rel).exists()]
    if differing and not force:
        print(
            f"{PROG} init: {plural(len(differing), 'file')} in {directory} "
            f"{'differs' if len(differing) == 1 else 'differ'} from otel-training's "
            f"({_short(differing)}); nothing written: keep your changes, or overwrite them with --force",
            file=err,
        )
        return 1
    for rel in changed:
        _write(directory / rel, wanted[rel])
    note = f", {same} already up to date" if same else ""
    overwritten = f", {len(differing)} overwritten" if differing else ""
    print(f"otel-training: wrote {plural(len(changed), 'stack file')} to {directory}{overwritten}{note}", file=out)
    print(f"next: cd {directory} && {PASSWORD_HINT}   (then http://127.0.0.1:3000, user admin)", file=out)
    return 0


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG,
        description="The Collector, Prometheus, Alertmanager, Tempo and Grafana files, from the package, "
        "and the stack run without Docker.",
    )
    sub = parser.add_subparsers(dest="action", metavar="{init,check,up,status,down}", required=True)
    p_init = sub.add_parser("init", help="write docker-compose.yml and every config into DIR")
    p_init.add_argument("directory", metavar="DIR", type=Path, help="where to write (made if missing)")
    p_init.add_argument("--force", action="store_true", help="overwrite files that differ from otel-training's")
    p_check = sub.add_parser("check", help="validate the stack files in DIR (YAML/JSON, promtool, uids, names)")
    p_check.add_argument("directory", metavar="DIR", type=Path, help="a directory written by `stack init`")
    p_up = sub.add_parser(
        "up", help="run the compose file's services without Docker (Jaeger in Tempo's place; no Grafana)"
    )
    p_up.add_argument("directory", metavar="DIR", type=Path, help="the stack files (written here first if missing)")
    p_up.add_argument(
        "--bin-dir", type=Path, help="folder with otelcol, prometheus, alertmanager and jaeger (default: PATH)"
    )
    p_status = sub.add_parser("status", help="each service's state and URL")
    p_status.add_argument("directory", metavar="DIR", type=Path, help="a directory run by `stack up`")
    p_status.add_argument("--json", action="store_true", help="as JSON: services -> state, url, pid, log")
    p_down = sub.add_parser("down", help="stop what `stack up DIR` started")
    p_down.add_argument("directory", metavar="DIR", type=Path, help="a directory run by `stack up`")
    return parser


def _run(args: argparse.Namespace) -> int:
    from otel_training.cli import stack_plan, stack_procs

    directory: Path = args.directory
    if args.action == "up" and not (directory / stack_plan.COMPOSE).exists():
        code = init(directory)
        if code:
            return code
    if not (directory / stack_plan.COMPOSE).exists():
        print(
            f"{PROG} {args.action}: no {stack_plan.COMPOSE} in {directory} (otel-training stack init DIR)",
            file=sys.stderr,
        )
        return 2
    try:
        plan = stack_plan.plan(directory)
        if args.action == "up":
            stack_procs.up(plan, args.bin_dir, print)
            urls = {s.name: s.url for s in plan.services}
            print(
                f"otel-training: the stack runs from {plan.directory}\n"
                f"  train with:  OTEL_EXPORTER_OTLP_ENDPOINT={plan.otlp_endpoint}\n"
                f"  Prometheus:  {urls['prometheus']}   traces (Jaeger): {urls['tempo']}\n"
                f"  stop it:     otel-training stack down {directory}"
            )
            return 0
        if args.action == "down":
            stopped = stack_procs.down(plan, print)
            print(f"otel-training: {plural(stopped, 'service')} stopped")
            return 0
        report = stack_procs.status(plan)
        if args.json:
            print(json.dumps(report, indent=2))
        else:
            for name, svc in report["services"].items():
                where = svc["url"] or ""
                note = f"  ({svc['note']})" if svc.get("note") else ""
                print(f"{name:16} {svc['state']:12} {where}{note}")
        return 0 if all(s["state"] in ("healthy", "not started") for s in report["services"].values()) else 1
    except (stack_plan.PlanError, stack_procs.StackError) as exc:
        print(f"{PROG} {args.action}: {exc}", file=sys.stderr)
        return 1


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.action == "init":
        return init(args.directory, args.force)
    if args.action in ("up", "status", "down"):
        return _run(args)
    from otel_training.cli.stack_check import main_check

    return main_check(args.directory)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())

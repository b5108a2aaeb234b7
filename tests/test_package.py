"""The package as a user gets it: ``python -m build`` makes the sdist and, from
it, the wheel; ``twine check`` passes; the wheel, installed with the pinned torch into
a fresh virtual environment that does not see this repository, instruments an unmodified
script under ``opentelemetry-instrument`` (spans and metrics arrive at a loopback OTLP
receiver), runs the demo with no warning line, and writes and checks the stack. torch
and its CUDA wheels come from this machine's shared installation of that release
(scripts/torch-shared.sh, as in every venv of the test run: pip finds them already
satisfied and resolves and installs everything else the wheel asks for); with
OTEL_TRAINING_SHARED_TORCH=0 they are installed into the venv like the rest. The
README's demo set-up (``scripts/setup.sh`` on a fresh copy of the repository) runs the
demo with no warning line either."""

from __future__ import annotations

import email
import os
import re
import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

from tests.otlp_receiver import OTLPReceiver, attributes, data_points
from tests.stack.test_stack_cli import repository_stack

ROOT = Path(__file__).resolve().parents[1]
CONSTRAINTS = ROOT / "constraints.txt"
STEPS = 12
WARNING = re.compile(r"warning", re.IGNORECASE)

# Installs and builds take minutes on a 2-core machine; the module fixtures count toward
# the first test that uses them.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(1500)]


def _clean_env(**extra: str) -> dict:
    """The environment of a user's shell: nothing pointing at this repository or its venv."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("OTEL_", "PYTHON", "VIRTUAL_ENV", "PIP_REQUIRE"))}
    env["PATH"] = os.pathsep.join(p for p in env.get("PATH", "").split(os.pathsep)
                                  if p and not p.startswith(str(ROOT / ".venv")))
    env.update(extra)
    return env


# scripts/torch-shared.sh's settings: where the shared torch lives, or not to use it. Not
# the package's configuration: kept in the user's environment below.
SHARED_TORCH_VARS = ("OTEL_TRAINING_CACHE_DIR", "OTEL_TRAINING_SHARED_TORCH")


def _shared_torch_env() -> dict:
    return {k: os.environ[k] for k in SHARED_TORCH_VARS if k in os.environ}


def _run(argv, cwd, timeout=900, env=None, check=True) -> subprocess.CompletedProcess:
    proc = subprocess.run([str(a) for a in argv], cwd=cwd, env=env or _clean_env(), capture_output=True,
                          text=True, timeout=timeout)
    if check:
        assert proc.returncode == 0, f"{argv}: exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc


# torch's own, in any environment without numpy (the wheel's venv has none: neither torch
# nor otel-training needs it); the source line the warning module prints follows it.
TORCH_NO_NUMPY = "Failed to initialize NumPy"


def _warnings(text: str) -> list:
    lines = text.splitlines()
    torch_own = {i + d for i, line in enumerate(lines) if TORCH_NO_NUMPY in line for d in (0, 1)}
    return [line for i, line in enumerate(lines) if WARNING.search(line) and i not in torch_own]


# --- the distributions ----------------------------------------------------------------

@pytest.fixture(scope="module")
def dist(tmp_path_factory):
    out = tmp_path_factory.mktemp("dist")
    # No --sdist/--wheel: build makes the sdist, then the wheel from the unpacked sdist,
    # so the wheel also proves the sdist complete.
    _run([sys.executable, "-m", "build", "--outdir", out, ROOT], cwd=out, env=dict(os.environ))
    (wheel,) = out.glob("*.whl")
    (sdist,) = out.glob("*.tar.gz")
    return wheel, sdist


def test_twine_check_passes(dist):
    proc = _run([sys.executable, "-m", "twine", "check", "--strict", *dist], cwd=dist[0].parent,
                env=dict(os.environ))
    assert proc.stdout.count("PASSED") == 2, proc.stdout


def _metadata(wheel):
    with zipfile.ZipFile(wheel) as zf:
        (name,) = [n for n in zf.namelist() if n.endswith(".dist-info/METADATA")]
        return email.message_from_bytes(zf.read(name)), zf.namelist()


def test_metadata_claims_only_what_is_tested(dist):
    import trove_classifiers
    from packaging.requirements import Requirement

    from otel_training.package import _instruments
    from otel_training.version import __version__

    meta, names = _metadata(dist[0])
    assert meta["Version"] == __version__ and dist[0].name.startswith(f"otel_training-{__version__}-")
    classifiers = meta.get_all("Classifier")
    assert set(classifiers) <= trove_classifiers.classifiers, set(classifiers) - trove_classifiers.classifiers
    # Python: the versions claimed are the one CI runs (this interpreter), and no other.
    python = re.compile(r"Programming Language :: Python :: (3\.\d+)")
    versions = {m.group(1) for m in map(python.fullmatch, classifiers) if m}
    running = f"{sys.version_info[0]}.{sys.version_info[1]}"
    assert versions == {running} and meta["Requires-Python"] == f">={running}"
    # torch: the instruments extra is torch alone (no numpy), from the floor the core tests run
    # on (constraints-torch-floor.txt), and the instrumentor declares the same requirement.
    from otel_training.package import TORCH_FLOOR

    extras = [Requirement(r) for r in meta.get_all("Requires-Dist") if 'extra == "instruments"' in r]
    assert [r.name for r in extras] == ["torch"]
    assert str(extras[0].specifier) == f">={TORCH_FLOOR}"
    assert tuple(str(Requirement(r)).replace(" ", "") for r in _instruments) == (f"torch>={TORCH_FLOOR}",)
    floor, below = (_pinned_torch(ROOT / f"constraints-torch-{end}.txt") for end in ("floor", "below"))
    assert floor.rsplit(".", 1)[0] == TORCH_FLOOR and not extras[0].specifier.contains(below)
    assert meta["License-Expression"] == "Apache-2.0" and meta["License-File"] == "LICENSE"
    assert any(n.endswith(".dist-info/licenses/LICENSE") for n in names)
    assert "otel_training/py.typed" in names


def _pinned_torch(constraints: Path) -> str:
    (pin,) = [line.split("==", 1)[1].strip() for line in constraints.read_text().splitlines()
              if line.startswith("torch==")]
    return pin


def test_wheel_holds_the_repository_stack_and_contract(dist):
    with zipfile.ZipFile(dist[0]) as zf:
        prefix = "otel_training/stack_files/"
        shipped = {n[len(prefix):]: zf.read(n) for n in zf.namelist() if n.startswith(prefix) and not n.endswith("/")}
        assert zf.read("otel_training/telemetry.md") == (ROOT / "docs" / "telemetry.md").read_bytes()
        schema = "otel_training/aggregate/summary.schema.json"
        assert zf.read(schema) == (ROOT / schema).read_bytes()
    assert shipped == repository_stack()


def test_sdist_holds_real_files_and_no_half_test_suite(dist):
    with tarfile.open(dist[1]) as tf:
        members = tf.getmembers()
    assert not [m.name for m in members if m.issym() or m.islnk()]
    names = {m.name.split("/", 1)[1] for m in members if "/" in m.name}
    assert {"LICENSE", "README.md", "pyproject.toml", "otel_training/stack_files/docker-compose.yml"} <= names
    assert not [n for n in names if n.startswith("tests/")]


# --- installed in a fresh virtual environment ------------------------------------------

@pytest.fixture(scope="module")
def venv(dist, tmp_path_factory):
    """bin/ of a new venv holding the wheel with its instruments extra, torch pinned to the
    release this suite runs on (each end of the supported range under
    scripts/test-torch-range.sh), everything else to constraints.txt."""
    from importlib.metadata import version

    home = tmp_path_factory.mktemp("user")
    torch_release = version("torch").split("+")[0]
    pins = home / "constraints.txt"
    pins.write_text("".join(line + "\n" for line in CONSTRAINTS.read_text().splitlines()
                            if not line.startswith("torch==")) + f"torch=={torch_release}\n")
    env = _clean_env()
    if torch_release != _pinned_torch(CONSTRAINTS):
        env["PIP_CONSTRAINT"] = "/dev/null"  # a machine-wide pip constraint may cap torch lower
    _run([sys.executable, "-m", "venv", home / "venv"], cwd=home)
    bindir = home / "venv" / "bin"
    _run(["bash", ROOT / "scripts" / "torch-shared.sh", home / "venv", pins], cwd=home,
         env={**env, **_shared_torch_env()})
    _run([bindir / "python", "-m", "pip", "install", "--quiet", "--disable-pip-version-check",
          "-c", pins, f"{dist[0]}[instruments]"], cwd=home, env=env)
    yield bindir
    shutil.rmtree(home / "venv", ignore_errors=True)  # several GB with a CUDA build of torch


def test_the_installed_package_is_the_wheel_not_the_repository(venv, tmp_path):
    proc = _run([venv / "python", "-c", "import otel_training, sys; print(otel_training.__file__); print(sys.path)"],
                cwd=tmp_path)
    location, path = proc.stdout.splitlines()
    assert location.startswith(str(venv.parent / "lib")) and str(ROOT) not in path


def test_torch_is_the_shared_installation_not_a_copy(venv, tmp_path):
    """pip found torch already satisfied (scripts/torch-shared.sh): no copy of its ~4.6 GB in
    the venv, and its console scripts there."""
    if os.environ.get("OTEL_TRAINING_SHARED_TORCH", "1").strip().lower() in ("0", "false", "no", "off"):
        pytest.skip("OTEL_TRAINING_SHARED_TORCH=0: torch is installed into the venv")
    proc = _run([venv / "python", "-c", "import sysconfig, torch; print(torch.__file__); "
                 "print(sysconfig.get_paths()['purelib'])"], cwd=tmp_path)
    torch_file, site = proc.stdout.splitlines()
    assert not torch_file.startswith(site) and not (Path(site) / "torch").exists(), proc.stdout
    assert (venv / "torchrun").is_file()


@pytest.mark.core
def test_opentelemetry_instrument_exports_spans_and_metrics(venv, tmp_path):
    """Every step exported from the wheel, on this suite's torch and with no numpy (torch
    does not need it, and neither do we)."""
    probe = _run([venv / "python", "-c", "import importlib.util as u, torch; "
                  "print(torch.__version__, u.find_spec('numpy') is None)"], cwd=tmp_path)
    assert probe.stdout.split()[1] == "True", probe.stdout
    script = tmp_path / "train_basic.py"
    shutil.copy(ROOT / "examples" / "train_basic.py", script)
    with OTLPReceiver() as receiver:
        env = _clean_env(OTEL_EXPORTER_OTLP_ENDPOINT=receiver.endpoint, OTEL_SERVICE_NAME="from-the-wheel",
                         OTEL_TRAINING_TRACE_EVERY_N="1", OTEL_TRAINING_TRACE_MAX_PER_SECOND="1000")
        proc = _run([venv / "opentelemetry-instrument", venv / "python", script, "--steps", STEPS], cwd=tmp_path,
                    env=env, timeout=300)
        assert "done" in proc.stdout
        assert not _warnings(proc.stderr), proc.stderr
        assert receiver.wait_for(lambda r: any(m.name == "training.step.duration" for _, m in r.metrics()))
        spans = receiver.spans()
    steps = [s for _, s in spans if s.name == "step"]
    assert len(steps) == STEPS
    assert {"dataloader_next", "forward", "backward", "optimizer_step"} <= {s.name for _, s in spans}
    assert {res["service.name"] for res, _ in spans} == {"from-the-wheel"}
    found = [m for _, m in receiver.metrics() if m.name == "training.step.duration"]
    assert sum(p.count for p in data_points(found[-1])) == STEPS
    assert attributes(steps[0].attributes)["training.mode"] == "train"


def test_the_demo_prints_no_warning(venv, tmp_path):
    proc = _run([venv / "otel-training", "demo"], cwd=tmp_path, timeout=300)
    assert "\nverdict: " in proc.stdout + proc.stderr  # which one depends on the load of the machine
    assert not _warnings(proc.stdout + proc.stderr), proc.stderr


def test_stack_init_and_check_from_the_wheel(venv, tmp_path):
    tools = ROOT / ".tools" / "bin"  # promtool and amtool, where scripts/test.sh installed them
    env = _clean_env(PATH=f"{tools}{os.pathsep}{os.environ.get('PATH', '')}")
    _run([venv / "otel-training", "stack", "init", "./stack"], cwd=tmp_path, env=env)  # the README's command
    stack = tmp_path / "stack"
    assert {p.relative_to(stack).as_posix(): p.read_bytes() for p in stack.rglob("*") if p.is_file()} \
        == repository_stack()
    proc = _run([venv / "otel-training", "stack", "check", "stack"], cwd=tmp_path, env=env, timeout=300)
    assert "YAML/JSON files valid" in proc.stdout and proc.stderr == ""


# --- the README's demo command on a fresh copy of the repository ------------------------

def _fresh_copy(dest: Path) -> None:
    """What a clone of this tree would hold: tracked and unignored files (links kept)."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                            capture_output=True, check=True).stdout.decode().split("\0")
    for rel in filter(None, listed):
        src, dst = ROOT / rel, dest / rel
        if not src.is_symlink() and not src.exists():
            continue  # deleted in the work tree, not yet committed
        dst.parent.mkdir(parents=True, exist_ok=True)
        if src.is_symlink():
            dst.symlink_to(os.readlink(src))
        else:
            shutil.copy2(src, dst)


def test_demo_setup_on_a_fresh_copy_prints_no_warning(tmp_path):
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("not a git checkout: no way to tell what a fresh clone holds")
    clone = tmp_path / "clone"
    _fresh_copy(clone)
    assert not (clone / ".venv").exists()
    # scripts/demo.sh is these two steps; pip's own notes about this machine's index
    # configuration are not our set-up's, so only the demo's output is held to it.
    _run(["bash", "scripts/setup.sh"], cwd=clone, env=_clean_env(**_shared_torch_env()), timeout=1200)
    proc = _run([clone / ".venv" / "bin" / "otel-training", "demo"], cwd=clone, timeout=300)
    assert "\nverdict: " in proc.stdout + proc.stderr  # which one depends on the load of the machine
    assert not _warnings(proc.stdout + proc.stderr), proc.stderr

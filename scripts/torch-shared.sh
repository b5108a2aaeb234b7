#!/usr/bin/env bash
# One installation of each torch release for every virtualenv and every clone on this
# machine, instead of a copy in each venv (torch's CUDA build with its nvidia-*, cuda-* and
# triton wheels is ~4.6 GB installed, and the test run makes five venvs and more).
#
# Usage: scripts/torch-shared.sh VENV CONSTRAINTS
#   VENV: an existing virtualenv (VENV/bin/python). CONSTRAINTS: a pip constraints file
#   with an exact torch==X pin. Run it before the venv's own `pip install`: that install
#   then finds torch (and its CUDA wheels) already satisfied and installs only the rest.
#
# What it does:
# 1. Resolves torch==X (with CONSTRAINTS; `pip install --dry-run --report`, the venv's pip
#    and interpreter) and takes from the result torch and the wheels that come with it:
#    triton, nvidia-*, cuda-*. Torch's pure-Python dependencies (sympy, networkx, jinja2,
#    fsspec, filelock, ...) stay out: each venv installs them as its constraints say.
#    The answer is kept in CACHE/resolved/ (keyed by the torch pin, any pins of those
#    wheels in CONSTRAINTS or $PIP_CONSTRAINT, the interpreter, the platform and pip's
#    index settings), so later set-ups need no resolve; delete that folder to re-resolve.
# 2. Installs that set, if this machine does not have it yet, with
#    `pip install --no-deps --target` into CACHE/<key>/, where <key> names the torch
#    release, the interpreter and platform, and a hash of the exact set (every
#    name==version and wheel file). The build holds an flock on CACHE/.<key>.lock, installs
#    into a temporary folder beside it and renames it into place with a .complete record
#    inside, so two clones building the same key at once wait for one another and a
#    half-built key (an interrupted build) is never used: the next build removes it.
#    A file a key already built holds byte for byte (the same path and RECORD hash: the
#    nvidia-*-cu12 wheels two releases share, unchanged parts of triton) becomes a hard
#    link to it, so `du -sh CACHE` counts it once (du on one key alone counts it in full).
# 3. Links it into VENV: a .pth file in VENV's site-packages puts CACHE/<key> on sys.path
#    (after site-packages), so `import torch` and pip's resolver both find it; torch loads
#    the nvidia libraries from CACHE/<key>/nvidia/ by the RPATH its libraries carry
#    ($ORIGIN/../../nvidia/...), the same layout as in a site-packages. The console scripts
#    of the set (torchrun, ...) are written into VENV/bin. A copy of any of these packages
#    in VENV's own site-packages (a venv made before) is uninstalled first.
#
# CACHE: ${OTEL_TRAINING_CACHE_DIR:-${XDG_CACHE_HOME:-~/.cache}/otel-training}/torch.
# Nothing there is ever changed once built, and nothing is removed automatically: a venv
# points into it. `rm -rf CACHE` is safe between runs; each script that calls this one
# rebuilds what its venv needs (a venv whose key was removed has no torch until then).
# OTEL_TRAINING_SHARED_TORCH=0: do nothing, so the venv's pip installs torch into the venv.
set -euo pipefail
if [ $# -ne 2 ]; then
  echo "usage: $0 VENV CONSTRAINTS" >&2
  exit 2
fi
case "${OTEL_TRAINING_SHARED_TORCH:-1}" in
  0 | false | no | off) exit 0 ;;
esac
venv=$1
constraints=$2
cache="${OTEL_TRAINING_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/otel-training}/torch"
if [ ! -x "$venv/bin/python" ]; then
  echo "torch-shared: $venv/bin/python: no such virtualenv" >&2
  exit 2
fi
exec "$venv/bin/python" - "$cache" "$constraints" <<'PY'
import base64
import csv
import fcntl
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import time
from importlib.metadata import distributions
from pathlib import Path

cache, constraints = Path(sys.argv[1]), Path(sys.argv[2])
PIP = [sys.executable, "-m", "pip", "--disable-pip-version-check"]
SHARED = re.compile(r"torch|triton|nvidia-.+|cuda-.+")  # canonical names: torch and the wheels it brings
PTH = "otel-training-shared-torch.pth"


def say(text):
    print(f"torch-shared: {text}", flush=True)


def pip(*args, **kwargs):
    try:
        subprocess.run(PIP + list(args), check=True, **kwargs)
    except subprocess.CalledProcessError as e:
        sys.exit(f"torch-shared: pip {args[0]} failed (exit {e.returncode}; --report needs pip >= 22.2); "
                 "OTEL_TRAINING_SHARED_TORCH=0 leaves torch to the venv's own pip install")


def record_hash(path):
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return "sha256=" + base64.urlsafe_b64encode(digest.digest()).rstrip(b"=").decode()


def records(home):
    """(path, hash) of every file the dist-infos in `home` list with a hash (not the .pyc)."""
    for record in home.glob("*.dist-info/RECORD"):
        with open(record, newline="") as f:
            for row in csv.reader(f):
                if len(row) >= 2 and row[1] and ".." not in Path(row[0]).parts and not Path(row[0]).is_absolute():
                    yield row[0], row[1]


def link_identical(part):
    """Each file of `part` that a complete key already holds byte for byte (the same path and
    hash: the same wheel's file, often across releases) becomes a hard link to that file. The
    files are never written to again, so the keys stay independent: removing one leaves the
    other whole. Returns the bytes saved."""
    theirs = {}
    for other in cache.glob("torch-*"):
        if (other / ".complete").is_file():
            for rel, digest in records(other):
                theirs.setdefault((rel, digest), other / rel)
    saved = 0
    for rel, digest in records(part):
        other = theirs.get((rel, digest))
        if other is None:
            continue
        mine = part / rel
        try:
            a, b = os.lstat(mine), os.lstat(other)
            if (a.st_size, a.st_mode) != (b.st_size, b.st_mode) or not os.path.isfile(other) \
                    or os.path.islink(other) or record_hash(other) != digest:
                continue
            link = mine.with_name(f".{mine.name}.link-{os.getpid()}")
            os.link(other, link)
            os.replace(link, mine)
            saved += a.st_size
        except OSError:
            continue  # another file system, a key being removed: keep the copy
    return saved


def canon(name):
    return re.sub(r"[-_.]+", "-", name).lower()


def pins(path):
    """name -> 'name==version' for the exact pins in a constraints file."""
    found = {}
    for line in path.read_text().splitlines():
        m = re.fullmatch(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)\s*==\s*([^\s;#]+)\s*(#.*)?", line)
        if m:
            found[canon(m.group(1))] = f"{canon(m.group(1))}=={m.group(2)}"
    return found


if sys.prefix == sys.base_prefix:
    sys.exit(f"torch-shared: {sys.executable} is not a virtualenv's interpreter")
pinned = pins(constraints)
if "torch" not in pinned:
    say(f"{constraints} pins no torch==: the venv's pip installs torch itself")
    sys.exit(0)

# -- 1. the set: torch==X and its triton, nvidia-*, cuda-* wheels -------------------------
machine_pins = {}
if os.environ.get("PIP_CONSTRAINT") and Path(os.environ["PIP_CONSTRAINT"]).is_file():
    machine_pins = pins(Path(os.environ["PIP_CONSTRAINT"]))
index = {k: v for k, v in sorted(os.environ.items())
         if k in ("PIP_INDEX_URL", "PIP_EXTRA_INDEX_URL", "PIP_FIND_LINKS", "PIP_NO_INDEX")}
config = subprocess.run(PIP + ["config", "list"], capture_output=True, text=True).stdout
index["config"] = sorted(line for line in config.splitlines() if re.search(r"index|find-links", line))
interpreter = f"{sys.implementation.cache_tag}-{sysconfig.get_platform()}"
question = {
    "pins": sorted(v for k, v in {**machine_pins, **pinned}.items() if SHARED.fullmatch(k)),
    "interpreter": interpreter,
    "index": index,
}
memo = cache / "resolved" / (hashlib.sha256(json.dumps(question, sort_keys=True).encode()).hexdigest()[:16] + ".json")
try:
    answer = json.loads(memo.read_text())
except (OSError, ValueError):
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.json"
        pip("install", "--quiet", "--dry-run", "--ignore-installed", "--report", str(report),
            "-c", str(constraints), pinned["torch"])
        chosen = [item for item in json.loads(report.read_text())["install"]
                  if SHARED.fullmatch(canon(item["metadata"]["name"]))]
    packages = sorted(f"{canon(i['metadata']['name'])}=={i['metadata']['version']}" for i in chosen)
    files = sorted(i["download_info"]["url"].rsplit("/", 1)[-1] for i in chosen)
    digest = hashlib.sha256(json.dumps([packages, files, interpreter]).encode()).hexdigest()[:12]
    torch_version = next(p for p in packages if p.startswith("torch==")).split("==", 1)[1]
    answer = {"key": f"torch-{torch_version}-{interpreter}-{digest}", "packages": packages, "files": files,
              "question": question}
    memo.parent.mkdir(parents=True, exist_ok=True)
    part = memo.with_name(f".{memo.name}.{os.getpid()}")
    part.write_text(json.dumps(answer, indent=1) + "\n")
    part.rename(memo)
    say(f"resolved {pinned['torch']}: {len(packages)} packages ({time.monotonic() - t0:.0f} s)")
key, packages = answer["key"], answer["packages"]
home = cache / key

# -- 2. the shared installation ---------------------------------------------------------
if not (home / ".complete").is_file():
    cache.mkdir(parents=True, exist_ok=True)
    with open(cache / f".{key}.lock", "w") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            say(f"waiting for another build of {key}")
            fcntl.flock(lock, fcntl.LOCK_EX)
        if not (home / ".complete").is_file():
            t0 = time.monotonic()
            # Whatever is left of an earlier build of this key was interrupted: the lock is ours.
            for stale in [*cache.glob(f".{key}.tmp-*"), *([home] if home.exists() else [])]:
                shutil.rmtree(stale)
            part = cache / f".{key}.tmp-{os.getpid()}"
            (part / ".pip-tmp").mkdir(parents=True)
            say(f"installing {len(packages)} packages into {home}")
            # TMPDIR on the cache's file system: pip unpacks there and moves the result into
            # --target, a rename instead of a copy of several GB.
            # pass_fds: pip holds the lock too, should this process die before it.
            pip("install", "--quiet", "--no-deps", "--target", str(part), *packages,
                env={**os.environ, "TMPDIR": str(part / ".pip-tmp")}, pass_fds=(lock.fileno(),))
            shutil.rmtree(part / ".pip-tmp")
            # Console scripts with this interpreter's path: each venv gets its own (step 3).
            shutil.rmtree(part / "bin", ignore_errors=True)
            found = sorted(f"{canon(d.metadata['Name'])}=={d.version}" for d in distributions(path=[str(part)]))
            if found != packages:
                sys.exit(f"torch-shared: {part} holds {found}, not {packages}")
            saved = link_identical(part)
            record = {"packages": packages, "files": answer["files"], "interpreter": interpreter,
                      "built_by": sys.executable, "built_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
            (part / ".complete").write_text(json.dumps(record, indent=1) + "\n")
            part.rename(home)
            say(f"built {key} ({time.monotonic() - t0:.0f} s; {saved / 1e9:.1f} GB of it hard links"
                " to the same files in other keys)")

# -- 3. the venv sees it ----------------------------------------------------------------
paths = sysconfig.get_paths()
site, scripts = Path(paths["purelib"]), Path(paths["scripts"])
# A plain path line, or, should the set ship .pth files of its own, one that reads them too.
if any(home.glob("*.pth")):
    line = f"import site; site.addsitedir({str(home)!r})\n"
else:
    line = f"{home}\n"
part = site / f".{PTH}.{os.getpid()}"
part.write_text(line)
part.rename(site / PTH)
# The venv's own copies go after the link is in place, torch first: from then on a process
# that starts finds the shared torch, which loads the nvidia libraries beside it.
names = {p.split("==", 1)[0] for p in packages}
local = {canon(d.metadata["Name"]) for d in distributions(path=[str(site)])}
own = sorted(local & names, key=lambda n: (n != "torch", n))
if own:
    say(f"removing the venv's own copies: {' '.join(own)}")
    pip("uninstall", "--quiet", "--yes", *own)
for dist in distributions(path=[str(home)]):
    for ep in dist.entry_points:
        if ep.group != "console_scripts":
            continue
        module, _, attr = ep.value.partition(":")
        attr = attr.strip() or "main"
        script = scripts / ep.name
        script.write_text(
            f"#!{sys.executable}\n"
            "import re\nimport sys\n"
            f"from {module.strip()} import {attr.split('.')[0]}\n"
            "if __name__ == '__main__':\n"
            "    sys.argv[0] = re.sub(r'(-script\\.pyw|\\.exe)?$', '', sys.argv[0])\n"
            f"    sys.exit({attr}())\n")
        script.chmod(0o755)
say(f"{site / PTH} -> {home}")
PY

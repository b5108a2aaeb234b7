#!/usr/bin/env bash
# Every GPU check in one command, on a CUDA machine: the gpu-marked tests, the GPU timing
# benchmark, the per-step costs (CUDA allocator reads), the ~1 ms overhead ratio and the demo
# on CUDA. Logs go to $OUT (default ./gpu-checks); the last lines are a short summary.
#
#     bash scripts/gpu-checks.sh            # uses .venv/bin/python when there, else python3
#     PY=python3 bash scripts/gpu-checks.sh tests benchmarks   # a subset: tests timing costs overhead demo
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-$([ -x .venv/bin/python ] && echo .venv/bin/python || echo python3)}
OUT=${OUT:-$PWD/gpu-checks}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
steps=${*:-tests timing costs overhead demo}
declare -A rc

{
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv,noheader || true
  "$PY" -c 'import sys, torch; print("python", sys.version.split()[0], "torch", torch.__version__,
"cuda", torch.version.cuda, "device", torch.cuda.get_device_name() if torch.cuda.is_available() else None)'
} 2>&1 | tee "$OUT/env.txt"

run() {  # run NAME SECONDS CMD...: logged to $OUT/NAME.log, exit status kept
  local name=$1 limit=$2; shift 2
  echo "== $name: $*"
  timeout "$limit" "$@" >"$OUT/$name.log" 2>&1
  rc[$name]=$?
  tail -n 40 "$OUT/$name.log"
}

for step in $steps; do
  case $step in
    tests) run tests 240 "$PY" -m pytest -m gpu -q -rs -p no:cacheprovider tests ;;
    timing) run timing 240 "$PY" benchmarks/gpu_timing.py ${TIMING_ARGS:-} ;;
    costs) run costs 60 "$PY" benchmarks/step_costs.py ;;
    overhead) run overhead 300 "$PY" benchmarks/overhead.py ;;
    demo) run demo 180 "$PY" -m otel_training.cli demo --device cuda --html "$OUT/demo.html" ;;
    *) echo "unknown step: $step (tests timing costs overhead demo)" >&2; exit 2 ;;
  esac
done

echo "== exit statuses"
status=0
for name in "${!rc[@]}"; do
  echo "$name: ${rc[$name]}"
  [ "${rc[$name]}" = 0 ] || status=1
done
exit "$status"

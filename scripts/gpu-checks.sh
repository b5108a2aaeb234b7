#!/usr/bin/env bash
# Every GPU check in one command, on a CUDA machine: the gpu-marked tests, the GPU timing
# benchmark, each timing mode against the kernel timeline (profiler), the per-step costs
# (CUDA allocator reads), the ~1 ms overhead ratio and the demo on CUDA. Logs go to $OUT
# (default ./gpu-checks); the last lines are a short summary.
#
#     bash scripts/gpu-checks.sh            # uses .venv/bin/python when there, else python3
#     PY=python3 bash scripts/gpu-checks.sh tests timing   # a subset: tests timing profiler costs overhead profile demo
#
# Each step has a time limit in seconds (TESTS_S, TIMING_S, PROFILER_S, COSTS_S, OVERHEAD_S, PROFILE_S, DEMO_S) so
# that one slow step cannot take a GPU machine's whole time slot; TIMING_ARGS goes to
# benchmarks/gpu_timing.py (e.g. "--rounds 10 --loops gpt,gpt-compiled").
# The image's own torch is used as it is: any release from otel_training/package.py's
# TORCH_FLOOR on (below it, the run says "otel-training: not instrumenting: ...").
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-$([ -x .venv/bin/python ] && echo .venv/bin/python || echo python3)}
OUT=${OUT:-$PWD/gpu-checks}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
steps=${*:-tests timing profiler costs overhead demo}
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
    tests) run tests "${TESTS_S:-300}" "$PY" -m pytest -m gpu -q -rsfP --durations=8 -p no:cacheprovider tests ;;
    timing) run timing "${TIMING_S:-300}" "$PY" benchmarks/gpu_timing.py --json "$OUT/timing.json" ${TIMING_ARGS:-} ;;
    profiler) run profiler "${PROFILER_S:-120}" "$PY" benchmarks/gpu_timing_profiler.py --json "$OUT/profiler.json" ;;
    costs) run costs "${COSTS_S:-60}" "$PY" benchmarks/step_costs.py ;;
    overhead) run overhead "${OVERHEAD_S:-300}" "$PY" benchmarks/overhead.py ;;
    profile) run profile "${PROFILE_S:-300}" "$PY" -m pytest -m gpu -q -rsfP -p no:cacheprovider tests/test_profiles.py ;;
    demo) run demo "${DEMO_S:-180}" "$PY" -m otel_training.cli demo --device cuda --html "$OUT/demo.html" ;;
    *) echo "unknown step: $step (tests timing profiler costs overhead profile demo)" >&2; exit 2 ;;
  esac
done

echo "== exit statuses"
status=0
for name in "${!rc[@]}"; do
  echo "$name: ${rc[$name]}"
  [ "${rc[$name]}" = 0 ] || status=1
done
exit "$status"

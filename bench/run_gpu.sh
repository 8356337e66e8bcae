#!/usr/bin/env bash
# Run the GPU test suite and every benchmark with its defaults, on one GPU
# machine; the steps' default time limits add up to 23 minutes. Kernel configs are fixed
# (FLASHFUSE_AUTOTUNE=0, the first candidate that fits) unless the caller sets
# FLASHFUSE_AUTOTUNE=1: autotuning times every candidate of every kernel key,
# which multiplies the compile time of the sweeps.
#
#   bash bench/run_gpu.sh OUTDIR
#
# OUTDIR receives (flat): run.log (everything printed), attention.csv,
# attention_tflops.png, host_overhead.csv, long_context.csv,
# long_context_memory.png, models.csv, convergence.csv, convergence.png. The
# short tables of every step are printed again at the end.
#
# Each step runs under `timeout` and a failing step never stops the others.
# Environment knobs:
#   SKIP_TESTS=1 SKIP_ATTENTION=1 SKIP_HOST=1 SKIP_LONG=1 SKIP_MODELS=1 SKIP_CONVERGENCE=1
#   TESTS_ARGS, ATTENTION_ARGS, HOST_ARGS, LONG_ARGS, MODELS_ARGS, CONVERGENCE_ARGS  extra arguments
#   T_TESTS=300 T_ATTENTION=230 T_HOST=90 T_LONG=90 T_MODELS=600 T_CONVERGENCE=75  time limits (s)
#   PYTHON=python3
set -u

if [ $# -ne 1 ]; then
    echo "usage: bash bench/run_gpu.sh OUTDIR" >&2
    exit 2
fi
mkdir -p "$1"
OUT="$(cd "$1" && pwd)"
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
export FLASHFUSE_AUTOTUNE="${FLASHFUSE_AUTOTUNE:-0}"
LOG="$OUT/run.log"
TMP="$(mktemp -d)"
trap 'rm -rf "$TMP"' EXIT
: > "$LOG"
STATUS=()

# step NAME SECONDS COMMAND...: run under timeout (SIGINT, then SIGKILL 20 s
# later: interrupted, pytest still prints which tests failed and why),
# output to the log and to $TMP/NAME.out for the final summary.
step() {
    local name="$1" limit="$2"
    shift 2
    echo "===== $name: $* (limit ${limit}s) =====" | tee -a "$LOG"
    local t0=$SECONDS
    timeout -s INT -k 20 "$limit" "$@" > "$TMP/$name.out" 2>&1
    local rc=$?
    cat "$TMP/$name.out" >> "$LOG"
    local how="rc=$rc"
    if [ $rc -eq 124 ] || [ $rc -eq 137 ] || [ $rc -eq 130 ]; then how="timed out (rc=$rc)"; fi
    echo "===== $name: $how after $((SECONDS - t0)) s =====" | tee -a "$LOG"
    STATUS+=("$name: $how, $((SECONDS - t0)) s")
}

{
    echo "date: $(date -u '+%Y-%m-%d %H:%M UTC')"
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null || echo "nvidia-smi: not available"
    "$PY" -c "import torch, triton; print('torch', torch.__version__, '| triton', triton.__version__, '| cuda', torch.version.cuda)" 2>&1
    echo "FLASHFUSE_AUTOTUNE=$FLASHFUSE_AUTOTUNE"
} | tee -a "$LOG"

# shellcheck disable=SC2086  # *_ARGS are meant to split into words
[ "${SKIP_TESTS:-0}" = 1 ] || step tests "${T_TESTS:-300}" \
    "$PY" -m pytest -m gpu -q -rfE --tb=short -p no:cacheprovider ${TESTS_ARGS:-}
[ "${SKIP_ATTENTION:-0}" = 1 ] || step attention "${T_ATTENTION:-230}" \
    "$PY" bench/bench_attention.py --out "$OUT" ${ATTENTION_ARGS:-}
[ "${SKIP_HOST:-0}" = 1 ] || step host_overhead "${T_HOST:-90}" \
    "$PY" bench/host_overhead.py --out "$OUT" ${HOST_ARGS:-}
[ "${SKIP_LONG:-0}" = 1 ] || step long_context "${T_LONG:-90}" \
    "$PY" bench/bench_long_context.py --out "$OUT" ${LONG_ARGS:-}
[ "${SKIP_MODELS:-0}" = 1 ] || step models "${T_MODELS:-600}" \
    "$PY" bench/bench_models.py --out "$OUT" ${MODELS_ARGS:-}
[ "${SKIP_CONVERGENCE:-0}" = 1 ] || step convergence "${T_CONVERGENCE:-75}" \
    "$PY" bench/bench_convergence.py --out "$OUT" ${CONVERGENCE_ARGS:-}

# Summary: the last lines of the tests, the tables of each benchmark (they
# follow the line "N rows in ... ->" / the last table title).
echo
echo "################ SUMMARY ################"
for name in tests attention host_overhead long_context models convergence; do
    f="$TMP/$name.out"
    [ -f "$f" ] || continue
    echo
    echo "---- $name ----"
    if [ "$name" = tests ]; then
        tail -n 3 "$f"
    elif grep -q "^===== TABLES" "$f"; then
        sed -n '/^===== TABLES/,$p' "$f" | tail -n +2
    else
        tail -n 15 "$f"
    fi
done
echo
printf '%s\n' "${STATUS[@]}"
echo "outputs: $(ls "$OUT" | tr '\n' ' ')"

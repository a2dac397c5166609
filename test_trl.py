"""Equality with TRL on identical tensors: our losses against GRPOTrainer's own loss code.

Skipped when trl is not installed; `make test-trl` installs requirements-trl.txt and runs this file.
TRL's number comes from a real `GRPOTrainer` (built on our tiny model, so every attribute its loss
reads is set by TRL itself from a `GRPOConfig`), whose `_compute_loss` is called on inputs we choose;
only its forward pass is replaced, by a function that returns our log-probs. That is the smallest
seam that leaves TRL's whole loss computation, clipping and aggregation in play. The last tests run
the whole trainer instead, on one and on two processes (studies/two_process.py).
"""
import json
import math
import os
import signal
import subprocess
import sys

import pytest
import torch

trl = pytest.importorskip("trl")
pytestmark = pytest.mark.extra          # make test deselects it; make test-trl runs it

import gspo_lab as g  # noqa: E402  the lab: relatives, aggregations, corrections
import gspo_minimal as minimal  # noqa: E402  the algorithm's own three losses

F64 = torch.float64


def make_trainer(tmp_path, **config):
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer
    tok = g.build_char_tokenizer()
    model = g.build_tiny_model(tok)
    args = GRPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=8, num_generations=8,
                      max_completion_length=6, report_to="none", use_cpu=True, beta=0.0,
                      logging_steps=1, save_strategy="no", **config)
    trainer = GRPOTrainer(model=model, reward_funcs=lambda completions, **kw: [0.0] * len(completions),
                          args=args, train_dataset=Dataset.from_dict({"prompt": ["07+45="] * 8}),
                          processing_class=tok)
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1
    return trainer


def batch(seed=0, B=8, T=6):
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.tensor([1, 2, 3, 6, 4, 5, 6, 2])[:B]
    mask = torch.arange(T) < lengths[:, None]
    old = torch.log_softmax(torch.randn(B, T, 5, generator=gen, dtype=F64), -1)[..., 0]
    new = old + torch.randn(B, T, generator=gen, dtype=F64) * 3e-4 * torch.tensor(
        [0.5, 3.0, -2.0, 1.0, -0.2, 2.5, 0.1, -4.0])[:B, None]              # some in the band, some out
    adv = torch.randn(B, generator=gen, dtype=F64)
    return new, old, adv, mask


def trl_loss_and_grad(trainer, new, old, adv, mask, num_items=None):
    new = new.clone().requires_grad_(True)
    trainer._get_per_token_logps_and_entropies = lambda *a, **k: (new, torch.zeros_like(new), None)
    B, T = new.shape
    inputs = {"prompt_ids": torch.zeros(B, 1, dtype=torch.long),
              "prompt_mask": torch.ones(B, 1, dtype=torch.long),
              "completion_ids": torch.zeros(B, T, dtype=torch.long),
              "completion_mask": mask.long(),                # TRL's completion_mask is 0/1 integers
              "old_per_token_logps": old, "advantages": adv,
              "num_items_in_batch": mask.sum() if num_items is None else num_items}
    loss = trainer._compute_loss(trainer.model, inputs)
    loss.backward()
    return loss.detach(), new.grad


def ours(fn, new, old, adv, mask, **eps):
    new = new.clone().requires_grad_(True)
    loss = fn(new, old, adv, mask, **eps)
    loss.backward()
    return loss.detach(), new.grad


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_gspo_loss_equals_trl_sequence_level_with_loss_type_grpo(tmp_path, seed):
    trainer = make_trainer(tmp_path, importance_sampling_level="sequence", loss_type="grpo",
                           epsilon=3e-4, epsilon_high=4e-4)
    new, old, adv, mask = batch(seed)
    v_trl, g_trl = trl_loss_and_grad(trainer, new, old, adv, mask)
    v_ours, g_ours = ours(minimal.gspo_loss, new, old, adv, mask)
    assert abs(v_trl.item() - v_ours.item()) <= 1e-10
    assert (g_trl - g_ours).abs().max().item() <= 1e-10


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_grpo_loss_equals_trl_token_level_with_loss_type_grpo(tmp_path, seed):
    trainer = make_trainer(tmp_path, importance_sampling_level="token", loss_type="grpo",
                           epsilon=0.2, epsilon_high=0.27)
    new, old, adv, mask = batch(seed)
    new = old + (new - old) * 1000                          # token ratios around GRPO's band
    v_trl, g_trl = trl_loss_and_grad(trainer, new, old, adv, mask)
    v_ours, g_ours = ours(minimal.grpo_loss, new, old, adv, mask)
    assert abs(v_trl.item() - v_ours.item()) <= 1e-10
    assert (g_trl - g_ours).abs().max().item() <= 1e-10


@pytest.mark.parametrize("mode", ["token_truncate", "token_mask", "sequence_truncate", "sequence_mask"])
@pytest.mark.parametrize("loss", ["gspo", "grpo"])
def test_a_correction_weight_enters_the_loss_as_trl_applies_its_importance_sampling_ratio(tmp_path, loss, mode):
    """--is-correction's weight, handed to TRL as the `importance_sampling_ratio` its generation step
    would have put in the inputs (with use_vllm and the correction switched on after building): the
    same loss value and gradient as ours, for GSPO (sequence level) and GRPO (token level), loss_type
    grpo. TRL's own computation of that ratio runs only inside its vLLM generation path; here the
    ratio is ours, computed with TRL's bounds (clip_min 0.5, clip_max 3.0)."""
    level, eps, fn = (("sequence", (3e-4, 4e-4), g.gspo_loss) if loss == "gspo" else      # the lab's: with
                      ("token", (0.2, 0.27), g.grpo_loss))                                # --is-correction's weight
    trainer = make_trainer(tmp_path, importance_sampling_level=level, loss_type="grpo", epsilon=eps[0],
                           epsilon_high=eps[1])
    trainer.use_vllm = trainer.vllm_importance_sampling_correction = True
    new, old, adv, mask = batch(0)
    if loss == "grpo":
        new = old + (new - old) * 1000
    gen = torch.Generator().manual_seed(1)
    sampler = old - torch.randn(old.shape, generator=gen, dtype=F64) * 0.5        # a wide engine gap
    weight = g.correction_weight(old, sampler, mask, mode, 0.5, 3.0)
    assert (weight[mask] == 0).any() if mode.endswith("mask") else (weight[mask] != 1).any()
    ratio = weight if mode.startswith("token") else weight[:, :1]                  # TRL's (B, 1) for sequences
    trl_inputs = {"importance_sampling_ratio": ratio}
    original = trainer._compute_loss
    trainer._compute_loss = lambda model, inputs: original(model, {**inputs, **trl_inputs})
    v_trl, g_trl = trl_loss_and_grad(trainer, new, old, adv, mask)
    v_ours, g_ours = ours(fn, new, old, adv, mask, eps_low=eps[0], eps_high=eps[1], weight=weight)
    assert abs(v_trl.item() - v_ours.item()) <= 1e-10
    assert (g_trl - g_ours).abs().max().item() <= 1e-10


@pytest.mark.parametrize("mode, clip_min", [("token_truncate", 0.5), ("token_mask", 0.5), ("sequence_truncate", None),
                                            ("sequence_mask", 0.5), ("sequence_mask", None)])
def test_trls_own_importance_sampling_ratio_is_our_correction_weight(tmp_path, mode, clip_min):
    """TRL 1.16 computes its correction inside `_generate_and_score_completions`, only with
    use_vllm. The seam: build without vLLM, with a `rollout_func` that returns completions and the
    sampler's record as their log-probs; switch use_vllm and the mode on afterwards, with the weight
    sync stubbed and the trainer's log-prob pass replaced by our trainer-side log-probs. TRL's own
    code then turns the two into `importance_sampling_ratio`: it equals our `correction_weight` at
    the same bounds (the loss it weights: the test above)."""
    from types import SimpleNamespace
    gen = torch.Generator().manual_seed(3)
    lengths = [1, 2, 3, 6, 4, 5, 6, 2]
    B, T = len(lengths), max(lengths)
    mask = torch.arange(T) < torch.tensor(lengths)[:, None]
    trainer_lp = torch.log_softmax(torch.randn(B, T, 5, generator=gen), -1)[..., 0] * mask     # pi_old
    sampler_lp = (trainer_lp - torch.randn(B, T, generator=gen) * 0.8) * mask                   # the engine's record

    def rollout_func(prompts, trainer):
        return {"prompt_ids": [[5, 6, 7]] * len(prompts),
                "completion_ids": [[1] * n for n in lengths[:len(prompts)]],
                "logprobs": [sampler_lp[i, :n].tolist() for i, n in enumerate(lengths[:len(prompts)])]}
    trainer = make_trainer(tmp_path, importance_sampling_level="sequence", loss_type="grpo", epsilon=3e-4,
                           epsilon_high=4e-4, vllm_importance_sampling_mode=mode,
                           vllm_importance_sampling_clip_max=3.0, vllm_importance_sampling_clip_min=clip_min)
    trainer.rollout_func, trainer.use_vllm = rollout_func, True
    trainer.vllm_generation = SimpleNamespace(sync_weights=lambda: None)
    trainer._last_loaded_step = trainer.state.global_step
    trainer._get_per_token_logps_and_entropies = lambda *a, **k: (trainer_lp.clone(), None, None)
    out = trainer._generate_and_score_completions([{"prompt": "07+45="}] * B)
    theirs = out["importance_sampling_ratio"]
    ours_w = g.correction_weight(trainer_lp, sampler_lp, mask, mode, clip_min, 3.0)
    assert theirs.shape == ((B, T) if mode.startswith("token") else (B, 1))
    assert (ours_w == 0).any() if mode.endswith("mask") else (ours_w[mask] != 1).any()
    if mode.startswith("token"):
        assert torch.allclose(theirs[mask], ours_w[mask], rtol=1e-6, atol=0)
    else:
        assert torch.allclose(theirs, ours_w[:, :1], rtol=1e-6, atol=0)


def test_trl_default_loss_type_weights_each_sequence_by_its_length(tmp_path):
    from trl import GRPOConfig
    default = GRPOConfig(output_dir=str(tmp_path), report_to="none", use_cpu=True).loss_type
    assert default == "dapo"
    trainer = make_trainer(tmp_path, importance_sampling_level="sequence", loss_type=default,
                           epsilon=3e-4, epsilon_high=4e-4, steps_per_generation=1)
    new, old, adv, mask = batch(0)
    v_trl, g_trl = trl_loss_and_grad(trainer, new, old, adv, mask)
    v_ours, g_ours = ours(minimal.gspo_loss, new, old, adv, mask)
    lengths = mask.sum(-1).to(F64)
    # TRL's default: sum_i |y_i| l_i / sum_i |y_i|; the paper's: (1/B) sum_i l_i. Every sequence's
    # gradient is scaled by |y_i| / mean|y|: here from 1/3.6 (length 1) to 6/3.6 (length 6).
    weight = lengths / lengths.mean()
    scale = torch.where(mask, weight[:, None], 0)
    assert (g_trl - g_ours * scale).abs().max().item() <= 1e-12
    per_seq = -torch.minimum(g.importance_ratio(new, old, mask) * adv,
                             g.importance_ratio(new, old, mask).clamp(1 - 3e-4, 1 + 4e-4) * adv)
    assert abs(v_trl.item() - (per_seq * lengths).sum().item() / lengths.sum().item()) <= 1e-12
    assert weight.min().item() == pytest.approx(1 / 3.625) and weight.max().item() == pytest.approx(6 / 3.625)


# --- Relatives of GSPO against TRL 1.16, one and four minibatches per rollout -------------------------
def make_gmpo_trainer(tmp_path, **config):
    from datasets import Dataset
    from trl.experimental.gmpo import GMPOConfig, GMPOTrainer
    tok = g.build_char_tokenizer()
    args = GMPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=8, num_generations=8,
                      max_completion_length=6, report_to="none", use_cpu=True, beta=0.0,
                      logging_steps=1, save_strategy="no", **config)
    trainer = GMPOTrainer(model=g.build_tiny_model(tok), args=args, processing_class=tok,
                          reward_funcs=lambda completions, **kw: [0.0] * len(completions),
                          train_dataset=Dataset.from_dict({"prompt": ["07+45="] * 8}))
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1
    return trainer


def wide_batch(seed, scale=1000.0):
    """batch() with log-ratios about `scale` times larger: GRPO-sized, some past every band."""
    new, old, adv, mask = batch(seed)
    return old + (new - old) * scale, old, adv, mask


# TRL builds SAPO's temperatures as a float32 tensor (1.05 -> 1.0499999523); ours are exact in the
# inputs' dtype. The equality tests give ours TRL's rounded values; the departure has its own test.
SAPO_TAU_F32 = tuple(torch.tensor(g.SAPO_TAU, dtype=torch.float32).tolist())

# name: (our loss, its keywords, TRL trainer config, the log-ratio scale of the test batch)
RELATIVE_CASES = {
    "gmpo": (g.gmpo_loss, {}, None, 1000.0),
    "sapo": (g.sapo_loss, {"tau": SAPO_TAU_F32},
             dict(loss_type="sapo", importance_sampling_level="token"), 1000.0),
    "sapo-seq": (g.sapo_loss, {"level": "sequence", "tau": SAPO_TAU_F32},
                 dict(loss_type="sapo", importance_sampling_level="sequence"), 1000.0),
    "cispo": (g.cispo_loss, {"cap": 5.0},
              dict(loss_type="cispo", importance_sampling_level="token", epsilon_high=5.0), 3000.0),
    "luspo": (g.luspo_loss, {}, dict(loss_type="luspo", importance_sampling_level="sequence",
                                     epsilon=3e-4, epsilon_high=4e-4), 1.0),
    "vespo": (g.vespo_loss, {}, dict(loss_type="vespo", importance_sampling_level="token"), 1000.0),
}
TOKEN_NORMALISED = {"cispo", "vespo"}


@pytest.mark.parametrize("minibatches", [1, 4])
@pytest.mark.parametrize("name", list(RELATIVE_CASES))
@pytest.mark.parametrize("seed", [0, 1])
def test_each_relative_equals_trl_in_value_and_gradient(tmp_path, name, minibatches, seed):
    fn, kw, config, scale = RELATIVE_CASES[name]
    spg = {"steps_per_generation": minibatches}
    trainer = (make_gmpo_trainer(tmp_path, **spg) if config is None
               else make_trainer(tmp_path, **config, **spg))
    new, old, adv, mask = wide_batch(seed, scale)
    delta = torch.where(mask, new - old, 0)
    s = g.importance_ratio(new, old, mask)
    reaches = {"gmpo": (delta.abs() > 0.4) & mask, "cispo": (delta.exp() > 5.0) & mask,
               "luspo": (s > 1 + 4e-4) | (s < 1 - 3e-4)}        # the batch reaches each clip
    assert reaches.get(name, torch.ones(1, dtype=torch.bool)).any()
    total = mask.sum()                                  # the rollout's tokens, as TRL counts them
    for rows in torch.arange(len(adv)).tensor_split(minibatches):
        part = [x[rows] for x in (new, old, adv, mask)]
        v_trl, g_trl = trl_loss_and_grad(trainer, *part, num_items=total)
        extra = {"num_tokens": total / minibatches} if name in TOKEN_NORMALISED else {}
        v_ours, g_ours = ours(fn, *part, **kw, **extra)
        assert abs(v_trl.item() - v_ours.item()) <= 1e-10, name
        assert (g_trl - g_ours).abs().max().item() <= 1e-10, name


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_sapo_departure_trl_builds_its_temperatures_in_float32(tmp_path, level):
    assert SAPO_TAU_F32[1] != 1.05 and abs(SAPO_TAU_F32[1] - 1.05) < 1e-7
    trainer = make_trainer(tmp_path, loss_type="sapo", importance_sampling_level=level)
    new, old, adv, mask = wide_batch(0, 1000.0)
    v_trl, _ = trl_loss_and_grad(trainer, new, old, adv, mask)
    v_ours, _ = ours(g.sapo_loss, new, old, adv, mask, level=level)          # exact 1.05 in float64
    gap = abs(v_trl.item() - v_ours.item())
    assert 1e-12 < gap <= 1e-6 * abs(v_ours.item())           # float32 round-off of tau, no more


def test_gmpo_departure_trl_counts_an_empty_row_as_minus_its_advantage(tmp_path):
    trainer = make_gmpo_trainer(tmp_path)
    new, old, adv, mask = wide_batch(0)
    mask[2] = False
    v_trl, g_trl = trl_loss_and_grad(trainer, new, old, adv, mask)
    v_ours, g_ours = ours(g.gmpo_loss, new, old, adv, mask)
    assert abs((v_trl - v_ours).item() - (-adv[2] / len(adv)).item()) <= 1e-12
    assert (g_trl - g_ours).abs().max().item() <= 1e-12         # no gradient either way


def test_cispo_departure_trl_caps_the_weight_at_epsilon_high_itself_by_default_0_2(tmp_path):
    trainer = make_trainer(tmp_path, loss_type="cispo", importance_sampling_level="token")
    assert trainer.epsilon_high == 0.2                   # epsilon_high unset: it takes epsilon's 0.2
    new, old, adv, mask = wide_batch(0, 3000.0)
    v_trl, _ = trl_loss_and_grad(trainer, new, old, adv, mask, num_items=mask.sum())
    v_ours, _ = ours(g.cispo_loss, new, old, adv, mask, cap=0.2)
    assert abs(v_trl.item() - v_ours.item()) <= 1e-10    # every weight <= 0.2: updates damped


def test_vespo_departure_trl_clamps_the_sequence_ratio_below_at_1e_minus_8():
    from trl import GRPOTrainer
    mask = torch.ones(3, 6, dtype=torch.bool)
    log_ratio = torch.tensor([-1.0, -4.0, -25.0], dtype=F64)[:, None].expand(3, 6).clone()
    adv = torch.tensor([[1.0], [1.0], [-1.0]], dtype=F64)
    phi_trl = GRPOTrainer.get_gamma_weights(adv, log_ratio, mask, None)[:, 0]
    log_w = log_ratio.sum(-1)                                       # -6, -24, -150
    k, lam = torch.tensor([2.0, 2.0, 3.0], dtype=F64), torch.tensor([3.0, 3.0, 2.0], dtype=F64)
    phi_paper = torch.exp(lam + k * log_w - lam * torch.exp(log_w))
    assert torch.allclose(phi_trl[0], phi_paper[0], rtol=1e-12)     # inside TRL's clamps: the same
    clamped = log_w.clamp(min=math.log(1e-8))
    assert torch.allclose(phi_trl[1:], torch.exp(lam + k * clamped - lam * torch.exp(clamped))[1:],
                          rtol=1e-12)
    assert (phi_trl[1:] > 1e3 * phi_paper[1:]).all()                 # ...and far from the paper's


@pytest.mark.parametrize("delta", [0.0, 1e-4, 0.05])
def test_off_policy_mask_equals_trl_and_masks_the_loss_as_trl_does(tmp_path, delta):
    from trl import GRPOTrainer
    new, old, adv, mask = wide_batch(1, 300.0)
    keep = g.off_policy_sequence_mask(new, old, adv, mask, delta)
    keep_trl = GRPOTrainer.get_off_policy_mask(adv[:, None], new, old, mask.long(), delta)[:, 0]
    assert torch.equal(keep, keep_trl.bool())
    assert delta > 0 or not keep.all()                   # at delta 0 this batch drops some responses
    trainer = make_trainer(tmp_path, importance_sampling_level="sequence", loss_type="grpo",
                           epsilon=3e-4, epsilon_high=4e-4, off_policy_mask_threshold=delta)
    v_trl, g_trl = trl_loss_and_grad(trainer, new, old, adv, mask)
    v_ours, g_ours = ours(minimal.gspo_loss, new, old, adv, mask & keep[:, None])
    assert abs(v_trl.item() - v_ours.item()) <= 1e-10
    assert (g_trl - g_ours).abs().max().item() <= 1e-10


# --- studies/trl_compare.py: the TRL run (make trl) -------------------------------------------------
TINY = ["--steps", "3", "--warmup-max-steps", "20", "--val-size", "40", "--test-size", "40",
        "--prompts-per-step", "4", "--group-size", "4", "--minibatches", "2", "--eval-every", "2"]


def test_grpo_config_is_gspo_with_our_batch_and_optimiser(tmp_path):
    from studies import trl_compare as tc
    args = tc.grpo_config(g.Config(), rollouts=3, out=str(tmp_path), device=torch.device("cpu"))
    assert (args.importance_sampling_level, args.loss_type, args.beta) == ("sequence", "grpo", 0.0)
    assert (args.epsilon, args.epsilon_high) == (3e-4, 4e-4)
    # one rollout of 32 x 8 completions, four optimiser steps of 64 completions each
    assert (args.num_generations, args.per_device_train_batch_size, args.steps_per_generation,
            args.gradient_accumulation_steps, args.max_steps) == (8, 64, 4, 1, 12)
    assert (args.learning_rate, args.weight_decay, args.max_grad_norm, args.lr_scheduler_type) == (
        2e-4, 0.01, 1.0, "linear")
    assert not args.gradient_checkpointing and not args.bf16 and args.shuffle_dataset is False
    grpo = tc.grpo_config(g.Config(loss="grpo"), rollouts=1, out=str(tmp_path), device=torch.device("cpu"))
    assert (grpo.importance_sampling_level, grpo.epsilon, grpo.epsilon_high) == ("token", 0.2, 0.27)


def test_the_tutorials_grpo_config_is_the_one_make_trl_builds(tmp_path):
    """tutorial.md section 14 shows GSPO in TRL as one `py` block: it runs, and every field it sets
    equals the GRPOConfig that make trl builds for make train's settings."""
    import os
    import re

    import studies.trl_compare as tc
    with open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "tutorial.md")) as f:
        blocks = re.findall(r"```py\n(.*?)```", f.read(), flags=re.S)
    assert len(blocks) == 1
    namespace: dict = {}
    exec(compile(blocks[0], "tutorial.md[py block]", "exec"), namespace)
    shown = namespace["config"]
    ours = tc.grpo_config(g.Config(), rollouts=500, out=str(tmp_path), device=torch.device("cpu"))
    for field in ("importance_sampling_level", "loss_type", "beta", "epsilon", "epsilon_high",
                  "num_generations", "per_device_train_batch_size", "steps_per_generation",
                  "gradient_accumulation_steps", "learning_rate", "weight_decay", "max_grad_norm",
                  "bf16", "gradient_checkpointing", "temperature", "top_p", "lr_scheduler_type"):
        assert getattr(shown, field) == getattr(ours, field), field
    assert namespace["reward"](["a", "b"], [[1], [2]]) == [0.0, 0.0]


def test_golden_grpo_config_is_the_one_trl_compare_built_before_the_split(tmp_path):
    """trl_compare.py as it was before its move to studies/ (conftest.pre_split, read from git)
    and now build the same GRPOConfig from the same Config, field for field."""
    from conftest import pre_split
    from studies import trl_compare as tc
    for cfg in (g.Config(), g.Config(loss="grpo"), g.Config(aggregation="dapo", minibatches=8),
                g.Config(task="addwork", scale_rewards="none", seed=3)):
        before = pre_split("trl_compare").grpo_config(cfg, 5, str(tmp_path), torch.device("cpu")).to_dict()
        assert tc.grpo_config(cfg, 5, str(tmp_path), torch.device("cpu")).to_dict() == before


def test_make_trl_writes_the_same_metrics_and_summary_fields_as_our_loop(tmp_path, capsys):
    import json
    from studies import trl_compare as tc
    out = tmp_path / "trl"
    assert tc.trl_main(TINY + ["--out", str(out)]) == 0
    summary = json.loads((out / "summary.json").read_text())
    for key in ("accuracy_before_rl", "accuracy_after_rl", "wall_seconds", "rl_tokens_per_second",
                "seed", "loss", "interrupted", "rl_steps", "rl_tokens", "warmup_steps"):
        assert key in summary, key
    assert summary["rl_steps"] == 3 and summary["trl_config"]["importance_sampling_level"] == "sequence"
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    rl = [r for r in records if r["stage"] == "rl"]
    assert [r["step"] for r in rl] == [1, 2, 3]
    assert [r["step"] for r in rl if "val_acc" in r] == [2, 3]
    for r in rl:
        assert {"reward", "flat_groups", "s_mean", "s_min", "s_max", "clip_tokens", "clip_seqs",
                "clip_ceiling", "form_gap", "response_tokens", "tokens_per_second",
                "loss"} <= set(r)
        assert r["s_min"] <= r["s_mean"] <= r["s_max"] and r["form_gap"] < 1e-4
    assert (out / "checkpoint" / "config.json").exists()
    assert "after TRL" in capsys.readouterr().out


def test_make_trl_refuses_what_grpo_config_cannot_express_in_one_line(capsys):
    from studies import trl_compare as tc
    assert tc.trl_main(["--loss", "gspo-token"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "GSPO-token" in err
    # 3 x 3 completions cannot split into 2 equal minibatches: refused before the warm-up starts
    assert tc.trl_main(["--prompts-per-step", "3", "--group-size", "3", "--minibatches", "2"]) == 2
    captured = capsys.readouterr()
    assert captured.err.strip().count("\n") == 0 and "equal parts" in captured.err
    assert "warm-up" not in captured.out


# --- studies/trl_compare.py: the benchmark's two timed loops (make bench) -----------------------------
def test_bench_times_both_sides_and_stops_on_its_budget(tmp_path, monkeypatch):
    from studies import trl_compare as tc
    monkeypatch.setattr(tc, "BENCH_DIR", str(tmp_path))
    torch.manual_seed(0)
    tok = g.build_char_tokenizer()
    start = str(tmp_path / "start")
    g.build_tiny_model(tok).save_pretrained(start)
    tok.save_pretrained(start)
    cfg = g.Config(prompts_per_step=4, group_size=4, minibatches=2, test_size=20, val_size=20)
    for timed_run in (tc.timed_run_ours, tc.timed_run_trl):
        cycles, tokens, sampling, acc = timed_run(cfg, start, torch.device("cpu"), 3)
        assert len(cycles) == len(tokens) == len(sampling) == 3
        assert all(0 < s < c for s, c in zip(sampling, cycles))     # sampling is part of a cycle
        assert all(16 <= t <= 16 * 6 for t in tokens) and 0 <= acc <= 1
        cycles, *_ = timed_run(cfg, start, torch.device("cpu"), 3, stop_after=0.0)
        assert len(cycles) == 1                                     # the budget ends the run


# --- --aggregation against TRL's own loss types, one and four minibatches per rollout -----------------
# (our function, its eps, TRL's importance_sampling_level, the log-ratio scale of the test batch)
AGGREGATION_CASES = {"gspo": (g.gspo_loss, (3e-4, 4e-4), "sequence", 1.0),
                     "grpo": (g.grpo_loss, (0.2, 0.27), "token", 1000.0)}


@pytest.mark.parametrize("minibatches", [1, 4])
@pytest.mark.parametrize("aggregation", ["dapo", "dr_grpo"])
@pytest.mark.parametrize("loss", list(AGGREGATION_CASES))
@pytest.mark.parametrize("seed", [0, 1])
def test_aggregation_equals_trl_loss_type_in_value_and_gradient(tmp_path, loss, aggregation,
                                                                minibatches, seed):
    fn, (lo, hi), level, scale = AGGREGATION_CASES[loss]
    trainer = make_trainer(tmp_path, importance_sampling_level=level, loss_type=aggregation,
                           epsilon=lo, epsilon_high=hi, steps_per_generation=minibatches)
    new, old, adv, mask = wide_batch(seed, scale)
    mask[5] = False                                          # an empty row: it adds nothing either way
    total = mask.sum()                                       # the rollout's tokens, as TRL counts them
    for rows in torch.arange(len(adv)).tensor_split(minibatches):
        part = [x[rows] for x in (new, old, adv, mask)]
        v_trl, g_trl = trl_loss_and_grad(trainer, *part, num_items=total)
        v_ours, g_ours = ours(fn, *part, eps_low=lo, eps_high=hi, aggregation=aggregation,
                              num_tokens=total / minibatches, max_tokens=6)   # TRL: max_completion_length
        assert abs(v_trl.item() - v_ours.item()) <= 1e-10, (loss, aggregation)
        assert (g_trl - g_ours).abs().max().item() <= 1e-10, (loss, aggregation)


def test_the_batches_of_the_aggregation_test_reach_each_clip():
    new, old, adv, mask = wide_batch(0, 1.0)
    s = g.importance_ratio(new, old, mask)
    assert ((s > 1 + 4e-4) | (s < 1 - 3e-4)).any() and ((s < 1 + 4e-4) & (s > 1 - 3e-4)).any()
    new, old, adv, mask = wide_batch(0, 1000.0)
    w = torch.where(mask, new - old, 0).exp()
    assert (((w > 1.27) | (w < 0.8)) & mask).any() and (((w < 1.27) & (w > 0.8)) & mask).any()


def test_trl_config_follows_aggregation_and_scale_rewards(tmp_path):
    from studies import trl_compare as tc
    cpu = torch.device("cpu")
    for aggregation, loss_type in (("paper", "grpo"), ("dapo", "dapo"), ("dr_grpo", "dr_grpo")):
        args = tc.grpo_config(g.Config(aggregation=aggregation, scale_rewards="none"), rollouts=1,
                              out=str(tmp_path), device=cpu)
        assert (args.loss_type, args.scale_rewards) == (loss_type, "none")


# --- Two processes, run for real: tutorial section 15's mapping with N = 2 (studies/two_process.py) --
# TRL's GRPOTrainer as GSPO with make trl's GRPOConfig, per_device_train_batch_size = 64 / N, on one
# fixed rollout (32 prompts x 8), one optimiser step, once on one process and once on two under
# torchrun (gloo); then gspo_minimal.rl_update on the same rollout. The script's docstring says
# what it replaces in TRL (sampling, and the shuffle that decides which completions make step 1).
TWO_PROCESS_TIMEOUT = 240           # seconds per run; both take about 15 s on 2 CPU cores


def run_two_process(out, processes: int) -> subprocess.Popen:
    """studies/two_process.py OUT --processes N, started now: under torchrun (as a module, the
    same program) for N > 1, in its own process group so that a timeout can end all of it."""
    script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "studies", "two_process.py")
    launch = ([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
               str(processes)] if processes > 1 else [sys.executable])
    return subprocess.Popen([*launch, script, str(out), "--processes", str(processes)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True,
                            env={**os.environ, "HF_HUB_OFFLINE": "1", "TRL_EXPERIMENTAL_SILENCE": "1",
                                 "OMP_NUM_THREADS": "1"})      # see our_first_minibatch_gradient


@pytest.fixture(scope="module")
def first_steps(tmp_path_factory):
    """{N: [(rank r's JSON, rank r's step-1 gradient) for each rank]} for N = 1 and N = 2, the two
    runs side by side."""
    outs = {n: tmp_path_factory.mktemp(f"processes{n}") for n in (1, 2)}
    procs = {n: run_two_process(out, n) for n, out in outs.items()}
    for n, proc in procs.items():
        try:
            log, _ = proc.communicate(timeout=TWO_PROCESS_TIMEOUT)
        except subprocess.TimeoutExpired:
            for other in procs.values():
                if other.poll() is None:
                    os.killpg(other.pid, signal.SIGKILL)
            pytest.fail(f"studies/two_process.py on {n} process(es) ran past {TWO_PROCESS_TIMEOUT} s")
        assert proc.returncode == 0, f"{n} process(es), exit {proc.returncode}:\n{log[-3000:]}"
    return {n: [(json.loads((out / f"rank{r}.json").read_text()), torch.load(out / f"grad_rank{r}.pt"))
                for r in range(n)] for n, out in outs.items()}


def relative_gap(grad: dict, reference: dict) -> float:
    """|grad - reference| / |reference| over every parameter's gradient at once, in float64."""
    assert sorted(grad) == sorted(reference)
    flat = lambda d: torch.cat([d[name].double().flatten() for name in sorted(d)])   # noqa: E731
    return ((flat(grad) - flat(reference)).norm() / flat(reference).norm()).item()


def step1_rows(record: dict) -> list[tuple]:
    """(prompt ids, completion ids up to the mask, advantage) of every row of a rank's step 1."""
    s = record["step1"]
    return [(tuple(p), tuple(c[:sum(m)]), a) for p, c, m, a in
            zip(s["prompt_ids"], s["completion_ids"], s["completion_mask"], s["advantages"])]


def test_two_processes_take_the_same_first_optimiser_step_as_one(first_steps):
    (one, grad_one), = first_steps[1]
    two = [record for record, _ in first_steps[2]]
    assert one["world_size"] == 1 and [r["world_size"] for r in two] == [2, 2]    # asserted in-run too
    # section 15's mapping: one rollout of 256 completions, 4 optimiser steps of 64, on either N
    assert one["per_device_train_batch_size"] == 64
    assert [r["per_device_train_batch_size"] for r in two] == [32, 32]
    for r in [one, *two]:
        assert (r["generation_batch_size"], r["steps_per_generation"], r["gradient_accumulation_steps"],
                r["num_generations"]) == (256, 4, 1, 8)
        assert r["start_checksum"] == one["start_checksum"]          # the same starting weights
    assert one["rollout_rows"] == 256 and [r["rollout_rows"] for r in two] == [128, 128]
    assert len(step1_rows(one)) == 64 and [len(step1_rows(r)) for r in two] == [32, 32]
    # step 1 holds the same completions with the same advantages (the gathered rewards' own)
    assert sorted(step1_rows(one)) == sorted(step1_rows(two[0]) + step1_rows(two[1]))
    # after backward every rank holds the one all-reduced gradient
    (_, grad_rank0), (_, grad_rank1) = first_steps[2]
    assert all(torch.equal(grad_rank0[name], grad_rank1[name]) for name in grad_rank0)
    # Stated before comparing: 1e-5 of the gradient's norm, float32. What differs is summation
    # order only: each rank's loss is the mean over its 32 sequences and DDP averages the two
    # ranks' gradients (gloo), where one process takes the mean over 64 in one backward pass; the
    # forward passes and TRL's pi_old pass run on 32 rows instead of 64. Measured: 9.5e-8.
    tolerance = 1e-5
    assert relative_gap(grad_rank0, grad_one) <= tolerance


def our_first_minibatch_gradient(monkeypatch, micro_batch: int, eps: float) -> tuple[dict, dict]:
    """gspo_minimal.rl_update on the fixed rollout with --micro-batch `micro_batch` and advantages
    with std eps `eps`: the gradient of its first minibatch, before clipping (--grad-clip 0) and
    the optimiser step, and the batch it was given. Its minibatches are TRL's deal (group k in
    minibatch k mod 4), not its own random draw of whole groups."""
    import dataclasses

    from studies import two_process as tp
    monkeypatch.setattr(g, "group_chunks", tp.dealt_chunks)
    model, tok = tp.tiny_model()
    groups = tp.fixed_rollout(tok)
    texts = [grp["prompt"] for grp in groups for _ in range(tp.G)]
    prompt_ids, prompt_mask = g.encode_prompts(tok, texts, "cpu")
    T = max(len(ids) for grp in groups for ids in grp["completions"])
    completions = torch.tensor([ids + [tok.pad_token_id] * (T - len(ids))
                                for grp in groups for ids in grp["completions"]])     # (256, T)
    rewards = torch.tensor([r for grp in groups for r in grp["rewards"]])
    batch = {"prompt_ids": prompt_ids, "prompt_mask": prompt_mask, "completions": completions,
             "mask": g.completion_mask(completions, tok.eos_token_id), "rewards": rewards,
             "advantages": g.group_advantages(rewards, tp.G, eps=eps)}
    cfg = dataclasses.replace(tp.CFG, micro_batch=micro_batch, grad_clip=0.0)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    first: dict = {}

    def keep_the_first(optimizer, args, kwargs):
        first.update({name: p.grad.detach().clone() for name, p in model.named_parameters()})
        raise FirstStepTaken                     # the other three minibatches are not compared
    opt.register_step_pre_hook(keep_the_first)
    # One thread: the tiny model's matrices are too small to share, and two threads on a busy
    # 2-core machine spin-wait for each other: 0.3 s per call on one, 5 to 15 s on two.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with pytest.raises(FirstStepTaken):
            g.rl_update(model, opt, batch, cfg, *g.resolved_eps(cfg))
    finally:
        torch.set_num_threads(threads)
    return first, batch


class FirstStepTaken(Exception):
    """Raised at rl_update's first optimiser step, once its gradient is kept."""


def test_rl_update_first_minibatch_equals_trls_first_step_but_for_the_advantage_eps(first_steps,
                                                                                     monkeypatch):
    """Ours against TRL's 1-process step 1, departure by departure (tutorial section 14):
    - the loss aggregation: TRL's loss_type="grpo" is ours (the tutorial's setting), nothing to do;
    - the minibatches: ours are random whole groups, TRL's random completions; both dealt the same;
    - the advantage's std eps: ours 1e-6, TRL's 1e-4 (hard-coded): set ours to 1e-4, then measured;
    - pi_old in step 1: ours is the step's own pass (s = 1 exactly), TRL's a separate pass
      (s = 1 up to round-off): inside the tolerance."""
    from studies import two_process as tp
    (trl_record, trl_grad), = first_steps[1]
    assert tp.weights_checksum(tp.tiny_model()[0]) == trl_record["start_checksum"]    # same start
    # Stated before comparing: 1e-5 of the gradient's norm, float32. With the departures above
    # neutralised what differs is the arithmetic: ours adds up the gradients of micro-batches, of
    # 8 rows (one group: its prompt run once under a KV cache) or 12 (prompt and completion in one
    # pass), where TRL runs prompt and completion in one pass over the 64 rows; and ours has s = 1
    # exactly, TRL s = 1 up to round-off. Measured: 5.0e-7 (8 rows), 3.9e-7 (12 rows).
    tolerance = 1e-5
    for micro_batch in (8, 12):              # one group (prompt once); pieces that split groups
        ours, batch = our_first_minibatch_gradient(monkeypatch, micro_batch, eps=1e-4)
        assert relative_gap(ours, trl_grad) <= tolerance, micro_batch
    # TRL's step 1 holds our first minibatch's rows, with our advantages at eps 1e-4 (float32)
    rows = tp.dealt_chunks(256, 8, 4, "cpu")[0]
    trl_rows = step1_rows(trl_record)
    assert [(p, c) for p, c, _ in trl_rows] == [
        (tuple(p), tuple(c[m].tolist())) for p, c, m in
        zip(batch["prompt_ids"][rows].tolist(), batch["completions"][rows], batch["mask"][rows])]
    trl_adv = torch.tensor([a for _, _, a in trl_rows])
    assert (trl_adv - batch["advantages"][rows]).abs().max().item() <= 1e-6
    # The departure itself, ours at its own eps 1e-6: the advantages of a group with std sigma grow
    # by a factor 1 + (1e-4 - 1e-6) / (sigma + 1e-6), for step 1's six groups that are not flat
    # from 1 + 1.9e-4 (sigma 0.53, four right in 8) to 1 + 2.8e-4 (sigma 0.35, one right in 8), and
    # the step-1 gradient is linear in them (s = 1: no clipping). Measured: 2.1e-4, between the
    # two, as each group's gradient scaled by its own factor gives unless they cancel.
    ours, _ = our_first_minibatch_gradient(monkeypatch, 8, eps=1e-6)
    r = batch["rewards"][rows].reshape(-1, 8)                             # step 1's eight groups
    sigma = r.std(dim=1)[r.std(dim=1) > 0]
    growth = (1e-4 - 1e-6) / (sigma + 1e-6)
    gap = relative_gap(ours, trl_grad)
    assert gap > 10 * tolerance                        # a departure, far above the arithmetic
    assert growth.min().item() - tolerance <= gap <= growth.max().item() + tolerance


def test_the_real_model_sides_of_make_pretrained_seeds_run_on_a_tiny_chat_model(bpe_tokenizer, tmp_path,
                                                                                  monkeypatch):
    """studies/pretrained_seeds.py's TRL part, each side as it runs in its child process, on a
    2-layer model with a chat template (TRL must then apply it, as encode_prompts does): the cycles
    are timed, and the two TRL sides keep the rollout of prompts x G completions."""
    pytest.importorskip("trl")
    from conftest import tiny_llama_for
    from studies import pretrained_seeds as ps
    folder = str(tmp_path / "chat_model")
    tiny_llama_for(bpe_tokenizer).save_pretrained(folder)
    bpe_tokenizer.save_pretrained(folder)
    monkeypatch.setattr(ps, "SEEDS_DIR", str(tmp_path))
    monkeypatch.setattr(ps, "ROWS_PER_PASS", 4)
    monkeypatch.setattr(ps, "TRAIN", ["--task", "add2-chat", "--warmup-max-steps", "0", "--prompts-per-step", "2",
                                      "--group-size", "4", "--minibatches", "2", "--max-new-tokens", "6",
                                      "--test-size", "4", "--val-size", "4"])
    monkeypatch.setitem(ps.SETTINGS, "trl", {**ps.SETTINGS["trl"], "cycles": 2, "rows_per_pass": 4,
                                             "defaults_rows_per_pass": 2})
    monkeypatch.chdir(os.path.dirname(os.path.abspath(__file__)))
    for side in ps.SETTINGS["trl"]["sides"]:
        res = ps.trl_side(side, folder, str(tmp_path / f"{side}.json"))
        assert len(res["cycle_seconds_all"]) == 2 and res["cycle_seconds"] > 0 and res["peak_rss_mb"] > 0
        assert all(0 < t <= 8 * 6 for t in res["completion_tokens_all"])    # 8 completions of at most 6 tokens
        assert json.loads((tmp_path / f"{side}.json").read_text())["side"] == side

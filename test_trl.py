"""Equality with TRL on identical tensors: our losses against GRPOTrainer's own loss code.

Skipped when trl is not installed; `make test-trl` installs requirements-trl.txt and runs this file.
TRL's number comes from a real `GRPOTrainer` (built on our tiny model, so every attribute its loss
reads is set by TRL itself from a `GRPOConfig`), whose `_compute_loss` is called on inputs we choose;
only its forward pass is replaced, by a function that returns our log-probs. That is the smallest
seam that leaves TRL's whole loss computation, clipping and aggregation in play.
"""
import pytest
import torch

trl = pytest.importorskip("trl")

import gspo_minimal as g  # noqa: E402

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


def trl_loss_and_grad(trainer, new, old, adv, mask):
    new = new.clone().requires_grad_(True)
    trainer._get_per_token_logps_and_entropies = lambda *a, **k: (new, torch.zeros_like(new), None)
    B, T = new.shape
    inputs = {"prompt_ids": torch.zeros(B, 1, dtype=torch.long),
              "prompt_mask": torch.ones(B, 1, dtype=torch.long),
              "completion_ids": torch.zeros(B, T, dtype=torch.long),
              "completion_mask": mask.long(),                # TRL's completion_mask is 0/1 integers
              "old_per_token_logps": old, "advantages": adv,
              "num_items_in_batch": mask.sum()}
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
    v_ours, g_ours = ours(g.gspo_loss, new, old, adv, mask)
    assert abs(v_trl.item() - v_ours.item()) <= 1e-10
    assert (g_trl - g_ours).abs().max().item() <= 1e-10


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_grpo_loss_equals_trl_token_level_with_loss_type_grpo(tmp_path, seed):
    trainer = make_trainer(tmp_path, importance_sampling_level="token", loss_type="grpo",
                           epsilon=0.2, epsilon_high=0.27)
    new, old, adv, mask = batch(seed)
    new = old + (new - old) * 1000                          # token ratios around GRPO's band
    v_trl, g_trl = trl_loss_and_grad(trainer, new, old, adv, mask)
    v_ours, g_ours = ours(g.grpo_loss, new, old, adv, mask)
    assert abs(v_trl.item() - v_ours.item()) <= 1e-10
    assert (g_trl - g_ours).abs().max().item() <= 1e-10


def test_trl_default_loss_type_weights_each_sequence_by_its_length(tmp_path):
    from trl import GRPOConfig
    default = GRPOConfig(output_dir=str(tmp_path), report_to="none", use_cpu=True).loss_type
    assert default == "dapo"
    trainer = make_trainer(tmp_path, importance_sampling_level="sequence", loss_type=default,
                           epsilon=3e-4, epsilon_high=4e-4, steps_per_generation=1)
    new, old, adv, mask = batch(0)
    v_trl, g_trl = trl_loss_and_grad(trainer, new, old, adv, mask)
    v_ours, g_ours = ours(g.gspo_loss, new, old, adv, mask)
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

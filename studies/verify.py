"""make verify: what the GSPO papers predict, measured on the model `make train` trained.

    python studies/verify.py     # `make verify`: runs/verify/verify.json and a table; trains first
                                 # (`make train`) when runs/train/checkpoint is missing

Four measurements on real rollouts of the trained checkpoint, each with a real GSPO update at the
script's defaults (the lab's `rl_update`, which is gspo_minimal's at these defaults; its optimiser warmed up by a few real steps):
  1. the three forms of the sequence ratio s agree to round-off, in float32 and float64 (results.md,
     "The identity");
  2. Var(log s) against the response length, with bootstrap 95% intervals, against the reference
     for uncorrelated tokens and synthetic independent ones (results.md, "Variance against length");
  3. GSPO and GRPO branched from one state of a run in progress, at its learning rate and a quarter
     of it: the share of tokens each clips, and the ceiling no clip fraction can pass (results.md,
     "Clipping: GSPO against GRPO");
  4. a tiny mixture-of-experts model: how many activated experts one update changes, and the token
     log-ratios of tokens whose route changed (results.md, "MoE routing").
make figures copies verify.json into figures/figures.json (its `verify` part) and draws from it.
"""
from __future__ import annotations

import copy
import os
import random
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))   # gspo_minimal, studies

import torch  # noqa: E402

import gspo_lab as g  # noqa: E402
from studies.common import (DEFAULTS, TRAIN_DIR, Parser, big_rollout, cli, load_checkpoint,  # noqa: E402
                            loglog_slope, logprobs_in_chunks, minibatch_ratios, one_update, problems,
                            variance_profile, warm_optimizer, write_json)

VERIFY_DIR = "runs/verify"


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
    # copies: an optimiser loads same-dtype state tensors without copying them, and AdamW then
    # updates them in place, so the next branch would start from this branch's moments and steps
    opt.load_state_dict(copy.deepcopy(state["opt"]))
    sched.load_state_dict(copy.deepcopy(state["sched"]))
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
    texts = [g.TASKS["add2"].prompt(a, b) for a, b in problems(n, rng)]
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
    write_json(os.path.join(VERIFY_DIR, "verify.json"), res, "python studies/verify.py",
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


@cli
def main(argv=None) -> int:
    Parser(description=__doc__.splitlines()[0]).parse_args(argv)
    from transformers.utils import logging as hf_logging
    hf_logging.disable_progress_bar()
    verify()
    return 0


if __name__ == "__main__":
    sys.exit(main())

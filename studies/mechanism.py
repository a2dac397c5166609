"""Why GSPO falls behind GRPO with an engine's record as pi_old: the gap's bias against its noise.

    python studies/mechanism.py calibrate    # the prototype: the synthetic engine (--record-noise
                                             # K,SIGMA) against the real bf16 record, and one timed run
                                             # per arm: figures/mechanism_calibration.json (about 6 min)

At theta = theta_old an engine's record hands GSPO log s = mean_t d_t, d_t = log pi_old(y_t) - log
record(y_t), whose mean over a response of n tokens is -K (the per-token KL floor: a bias that
length does not remove) and whose spread is sigma / sqrt(n) (a noise that it does). The synthetic
engine (gspo_minimal.synthetic_gap) draws d_t independently from N(-K, SIGMA^2) on the trainer's own
pass, so bias and noise can be set apart. Before any training run rests on it, this file calibrates
it against the real thing:

  * add2 (make train's task and settings), from make figures-map's dense warm-ups of seeds 0-2,
    CAL_ROLLOUTS rollouts each sampled by the bf16 copy: the real per-token gaps give K-hat (their
    negative mean) and SIGMA-hat (their standard deviation); the synthetic engine at those values,
    on the same responses' masks, gives log s to set beside the real log s, length by length
    (quantiles and the two-sample KS distance);
  * SmolLM2-135M at make engine's K and sigma (figures/engine.json keeps summaries by length, not
    samples): the lens's mean -K and standard deviation sigma / sqrt(n) beside engine.json's;
  * what the model misses, measured on the real add2 record: correlation along a response (lag-1
    autocorrelation of the gaps within responses) and a gap that depends on the token's probability
    (the gaps' mean and spread by bins of the trainer's probability of the token); y is drawn from
    the trainer p, not from the engine q (their per-token KL is the floor K itself);
  * the two estimators of K the calibrated band will need, -mean(d) and SIGMA-hat^2 / 2, with
    their standard errors;
  * one timed training run of each kind the cells will run, for the budget of the measured target.
"""
from __future__ import annotations

import math
import os
import random
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))   # gspo_minimal, studies

import torch  # noqa: E402

import gspo_minimal as g  # noqa: E402
from studies.common import Parser, cli, read_json, run_jobs, script_job, write_json  # noqa: E402

OUTPUTS = ("figures/mechanism_calibration.json",)
CAL_JSON = "figures/mechanism_calibration.json"
CAL_RUNS = "runs/mechanism"
CAL_SEEDS = (0, 1, 2)
CAL_ROLLOUTS = 8                       # rollouts of 256 responses per warm-up: about 6,000 tokens each
QUANTILES = (0.01, 0.1, 0.5, 0.9, 0.99)
PROB_BINS = (0.0, 0.5, 0.9, 0.99, 1.0)  # bins of the trainer's probability of the sampled token
SMOLLM_LENGTHS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)


# ---------------------------------------------------------------------------------------------
# Statistics on plain lists and tensors.
# ---------------------------------------------------------------------------------------------
def ks_distance(a: list[float], b: list[float]) -> float:
    """The two-sample Kolmogorov-Smirnov distance: the largest gap between the two empirical CDFs."""
    xs = sorted(set(a) | set(b))
    sa, sb = torch.tensor(sorted(a), dtype=torch.float64), torch.tensor(sorted(b), dtype=torch.float64)
    grid = torch.tensor(xs, dtype=torch.float64)
    fa = torch.searchsorted(sa, grid, right=True).double() / len(a)
    fb = torch.searchsorted(sb, grid, right=True).double() / len(b)
    return (fa - fb).abs().max().item()


def ks_critical(n: int, m: int, alpha: float = 0.05) -> float:
    """The asymptotic two-sample KS critical distance at level alpha: c(alpha) sqrt((n + m) / (n m))."""
    c = math.sqrt(-0.5 * math.log(alpha / 2))
    return c * math.sqrt((n + m) / (n * m))


def quantiles_of(x: list[float]) -> dict:
    t = torch.tensor(x, dtype=torch.float64)
    return {f"p{round(q * 100)}": torch.quantile(t, q).item() for q in QUANTILES}


def lag1_autocorrelation(d: torch.Tensor, mask: torch.Tensor) -> dict:
    """The correlation of consecutive gaps (d_t, d_t+1) inside responses, each centred on the pooled
    mean, over every pair of kept positions; with its standard error under independence, 1/sqrt(pairs)."""
    both = mask[:, :-1] & mask[:, 1:]
    x, y = d[:, :-1][both], d[:, 1:][both]
    mu = d[mask].mean()
    r = (((x - mu) * (y - mu)).mean() / ((d[mask] - mu) ** 2).mean()).item()
    return {"lag1": r, "pairs": int(both.sum()), "standard_error_if_independent": 1 / math.sqrt(max(int(both.sum()), 1))}


def by_probability(d: torch.Tensor, logp: torch.Tensor, mask: torch.Tensor) -> list[dict]:
    """The gaps' mean and standard deviation by bins of the trainer's probability of the token."""
    p = logp.exp()
    out = []
    for lo, hi in zip(PROB_BINS[:-1], PROB_BINS[1:]):
        sel = mask & (p >= lo) & ((p < hi) if hi < 1 else (p <= hi))
        x = d[sel]
        out.append({"probability": [lo, hi], "tokens": int(sel.sum()),
                    "mean_d": x.mean().item() if len(x) else None,
                    "std_d": x.std().item() if len(x) > 1 else None})
    return out


# ---------------------------------------------------------------------------------------------
# The real bf16 record on add2, and the synthetic engine on the same responses.
# ---------------------------------------------------------------------------------------------
@torch.no_grad()
def real_gaps(seed: int, rollouts: int = CAL_ROLLOUTS) -> dict:
    """From the dense warm-up of `seed` (theta_old), `rollouts` rollouts at make train's settings
    sampled by the bf16 copy; the trainer's pass over each (group_policy_logprobs, as the update's
    pre-update pass) and the per-token gap d = trainer - record, (rows, T) with its mask."""
    from studies import map as regimes
    cfg = g.parse_config(regimes.MODELS["dense"]["task"] + ["--sampler-dtype", "bfloat16", "--seed", str(seed)])
    model, tok = g.load_pretrained(os.path.join(regimes.warm_path("dense", seed), "checkpoint"))
    torch.manual_seed(seed)
    rng = random.Random(seed)
    task = g.task_of(cfg)
    splits = g.make_splits(task, cfg.test_size, cfg.val_size)
    ds, masks, logps, kls = [], [], [], []
    for _ in range(rollouts):
        sampler = g.sampling_model(model, cfg)
        b = g.rollout(sampler, tok, g.sample_train_problems(splits, task, cfg.prompts_per_step, rng), cfg, "cpu")
        kls.append(g.engine_kl_tokens(sampler, model, b, cfg))
        lp = g.group_policy_logprobs(model, b["prompt_ids"], b["prompt_mask"], b["completions"], cfg.group_size)
        T = cfg.max_new_tokens                                       # a common width across rollouts
        pad = lambda x: torch.nn.functional.pad(x, (0, T - x.shape[1]))
        ds.append(pad(lp.double() - b["sampler_logprobs"].double()))
        masks.append(pad(b["mask"]).bool())
        logps.append(pad(lp.double()))
    return {"d": torch.cat(ds), "mask": torch.cat(masks), "logp": torch.cat(logps), "engine_kl_tokens": kls}


def log_s_by_length(d: torch.Tensor, mask: torch.Tensor) -> dict[int, list[float]]:
    """log s = mean_t d_t of each response, grouped by its length n (tokens, EOS included)."""
    n = mask.sum(1)
    log_s = g.sequence_log_ratio(d, torch.zeros_like(d), mask)
    return {int(k): log_s[n == k].tolist() for k in n.unique().tolist() if k > 0}


def compare_by_length(real: dict[int, list[float]], synth: dict[int, list[float]]) -> list[dict]:
    rows = []
    for n in sorted(real):
        a, b = real[n], synth[n]
        row = {"length": n, "responses": len(a)}
        if len(a) >= 20:               # fewer: no quantile or KS distance worth reading
            row.update(real=quantiles_of(a), synthetic=quantiles_of(b), ks_distance=ks_distance(a, b),
                       ks_critical_05=ks_critical(len(a), len(b)),
                       real_std=statistics.stdev(a), synthetic_std=statistics.stdev(b),
                       lens_std=None)
        rows.append(row)
    return rows


def add2_calibration(seeds=CAL_SEEDS) -> dict:
    """The real record's K-hat and SIGMA-hat pooled over the seeds' rollouts, the synthetic engine at
    those values on the same masks, and what the model misses."""
    parts = [real_gaps(s) for s in seeds]
    d = torch.cat([p["d"] for p in parts])
    mask = torch.cat([p["mask"] for p in parts])
    logp = torch.cat([p["logp"] for p in parts])
    x = d[mask]
    N = len(x)
    k_hat, sigma_hat = -x.mean().item(), x.std().item()
    cfg = g.Config(record_noise=f"{k_hat!r},{sigma_hat!r}", seed=0)
    synth = g.synthetic_gap(mask, cfg).double()
    real_by_n, synth_by_n = log_s_by_length(d, mask), log_s_by_length(synth, mask)
    rows = compare_by_length(real_by_n, synth_by_n)
    for row in rows:
        if "real" in row:
            row["lens_std"] = sigma_hat / math.sqrt(row["length"])
    all_real = [v for vs in real_by_n.values() for v in vs]
    all_synth = [v for vs in synth_by_n.values() for v in vs]
    fourth = ((x - x.mean()) ** 4).mean().item()
    return {"seeds": list(seeds), "rollouts_per_seed": CAL_ROLLOUTS, "responses": int(mask.any(1).sum()),
            "tokens": N, "k_hat": k_hat, "sigma_hat": sigma_hat,
            "estimators_of_k": {
                "minus_mean_d": k_hat, "minus_mean_d_standard_error": sigma_hat / math.sqrt(N),
                "sigma_hat_squared_over_2": sigma_hat ** 2 / 2,
                "sigma_hat_squared_over_2_standard_error": math.sqrt(max(fourth - sigma_hat ** 4, 0) / N) / 2,
                "exact_kl_per_token_mean": statistics.fmean(k for p in parts for k in p["engine_kl_tokens"]),
                "note": "the exact KL(bf16 || trainer) over the vocabulary, per token, the mean of engine_kl_tokens "
                        "over the rollouts (each over its first minibatch's worth of rows): the K the lens means"},
            "by_length": rows,
            "pooled": {"real": quantiles_of(all_real), "synthetic": quantiles_of(all_synth),
                       "ks_distance": ks_distance(all_real, all_synth),
                       "ks_critical_05": ks_critical(len(all_real), len(all_synth))},
            "what_the_model_misses": {
                "autocorrelation": lag1_autocorrelation(d, mask),
                "by_trainer_probability": by_probability(d, logp, mask),
                "y_from_p_not_q": "the synthetic engine's tokens come from the trainer's p; the real ones from "
                                  "the bf16 copy's q, whose per-token KL from p is the floor K itself"}}


def smollm2_lens(engine_json: str = "figures/engine.json") -> dict:
    """The lens at make engine's SmolLM2 bf16 K and sigma (32 sequences, EOS suppressed, 512 tokens;
    each length's numbers are running means over the same sequences' prefixes): mean -K and standard
    deviation sigma / sqrt(n), beside engine.json's mean and standard deviation of log s."""
    m = read_json(engine_json)["models"]["smollm2"]["bfloat16"]
    K, sigma = m["kl_floor"], math.sqrt(m["sigma2"])
    rows = []
    for n in SMOLLM_LENGTHS:
        i = m["n"].index(n)
        rows.append({"length": n, "real_mean_log_s": m["mean_log_s"][i], "real_std_log_s": m["std_log_s"][i],
                     "lens_mean_log_s": -K, "lens_std_log_s": sigma / math.sqrt(n)})
    return {"source": f"{engine_json}: models.smollm2.bfloat16 (kl_floor, sigma2, n, mean_log_s, std_log_s)",
            "k": K, "sigma": sigma, "sequences": m["sequences"], "by_length": rows}


# ---------------------------------------------------------------------------------------------
# The timed prototype: one run of each kind the cells will run.
# ---------------------------------------------------------------------------------------------
def timing_jobs(k_hat: float, sigma_hat: float) -> list[dict]:
    """GSPO from seed 0's warm-up, at the engine study's step count: the real bf16 record and the
    synthetic engine at K-hat, SIGMA-hat (one thread each, one after another)."""
    from studies import engine
    from studies import map as regimes
    warm = regimes.warmup_job("dense", 0)
    ckpt = os.path.join(os.path.dirname(warm["done"]), "checkpoint")
    base = ["--model", ckpt, "--warmup-max-steps", "0", "--seed", "0", "--loss", "gspo", *regimes.MODELS["dense"]["task"]]
    steps = engine.em_steps("dense")
    return [script_job("timing_real_bf16", base + engine.BF16 + engine.FROM_SAMPLER, CAL_RUNS, steps, needs=warm["done"]),
            script_job("timing_synth_both", base + ["--record-noise", f"{k_hat:.6g},{sigma_hat:.6g}"], CAL_RUNS, steps,
                       needs=warm["done"])]


def calibrate() -> dict:
    from studies import map as regimes
    t0 = time.perf_counter()
    run_jobs([regimes.warmup_job("dense", s) for s in CAL_SEEDS], CAL_RUNS)     # made where missing
    add2 = add2_calibration()
    jobs = timing_jobs(add2["k_hat"], add2["sigma_hat"])
    run_jobs(jobs, CAL_RUNS, workers=1)
    timed = {}
    for job in jobs:
        s = read_json(job["done"])
        timed[job["name"]] = {"command": " ".join(job["cmd"][1:]), "wall_seconds": s["wall_seconds"],
                              "rl_steps": s["rl_steps"], "accuracy_before_rl": s["accuracy_before_rl"],
                              "accuracy_after_rl": s["accuracy_after_rl"]}
    return {"add2": add2, "smollm2": smollm2_lens(), "timing": timed,
            "timing_note": "each run alone, one thread (the measured target runs two at a time, one thread each)",
            "seconds_total": time.perf_counter() - t0}


@cli
def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = Parser(description=__doc__.splitlines()[0])
    parser.add_argument("what", choices=["calibrate"])
    parser.parse_args(argv)
    from transformers.utils import logging as hf_logging
    hf_logging.disable_progress_bar()
    res = calibrate()
    write_json(CAL_JSON, res, "python studies/mechanism.py calibrate", res.pop("seconds_total"))
    a = res["add2"]
    print(f"add2, bf16 record, {a['tokens']} tokens: K-hat {a['k_hat']:.3g} (+- {a['estimators_of_k']['minus_mean_d_standard_error']:.2g}), "
          f"SIGMA-hat {a['sigma_hat']:.3g}, SIGMA-hat^2/2 {a['estimators_of_k']['sigma_hat_squared_over_2']:.3g}, "
          f"exact KL {a['estimators_of_k']['exact_kl_per_token_mean']:.3g}")
    print(f"log s pooled: KS distance {a['pooled']['ks_distance']:.3f} (5% critical {a['pooled']['ks_critical_05']:.3f})")
    for r in a["by_length"]:
        if "real" in r:
            print(f"  n={r['length']}: {r['responses']} responses, real std {r['real_std']:.4f}, synthetic "
                  f"{r['synthetic_std']:.4f}, lens {r['lens_std']:.4f}, KS {r['ks_distance']:.3f} ({r['ks_critical_05']:.3f})")
    print(f"lag-1 autocorrelation {a['what_the_model_misses']['autocorrelation']['lag1']:.3f}; timing: "
          + ", ".join(f"{k} {v['wall_seconds']:.0f} s" for k, v in res["timing"].items()))
    print(CAL_JSON)
    return 0


if __name__ == "__main__":
    sys.exit(main())

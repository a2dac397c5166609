"""Why GSPO falls behind GRPO with an engine's record as pi_old: the gap's bias against its noise.

    python studies/mechanism.py calibrate    # the prototype: the synthetic engine (--record-noise
                                             # K,SIGMA) against the real bf16 record, and one timed run
                                             # per arm: figures/mechanism_calibration.json (about 6 min)
    python studies/mechanism.py design       # bias against noise: the cells, the rule and the
                                             # projection into figures/mechanism.json, before any run
    python studies/mechanism.py figures      # make figures-mechanism: the cells' runs (resumable,
                                             # two at a time), then their verdicts (about 30 min)
    python studies/mechanism.py remedy-design   # the remedy: two timed runs, then its cells, rule and
                                                # projection into figures/mechanism_remedy.json
    python studies/mechanism.py remedy       # make figures-remedy: the remedy's runs (resumable), then
                                             # their verdicts against mechanism.json's references
    python studies/mechanism.py bins         # the heteroscedastic record (--record-bins) against the real
                                             # bf16 record on add2, as the calibration compares the other:
                                             # figures/mechanism_bins.json (a few minutes, no training)
    python studies/mechanism.py readings     # comparisons the rule did not decide, read from the two
                                             # committed JSONs' runs (no training, seconds):
                                             # figures/mechanism_readings.json

At theta = theta_old an engine's record hands GSPO log s = mean_t d_t, d_t = log pi_old(y_t) - log
record(y_t), whose mean over a response of n tokens is -K (the per-token KL floor: a bias that
length does not remove) and whose spread is sigma / sqrt(n) (a noise that it does). The synthetic
engine (gspo_lab.synthetic_gap) draws d_t independently from N(-K, SIGMA^2) on the trainer's own
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

Then the cells (make figures-mechanism), fixed before their runs: on add2 from make figures-map's
dense warm-ups of seeds 0-4, GSPO and GRPO paired by warm-up and RL seed in each of seven cells,
pi_old from a real engine's record (bf16, fp16) or from the synthetic engine at the calibrated K-hat
and SIGMA-hat, at each alone (bias without noise, noise without bias), and at SmolLM2's floor; each
decided by the map's rule on five seeds. If the bias is the cause, synth_bias separates and
synth_noise does not; if the noise is, the other way round; real_fp16 (almost no bias) separating
would say the same as synth_noise.

Then the remedy (make figures-remedy), fixed before its runs: GSPO alone, each cell paired seed by
seed with a reference cell's GSPO runs: the calibrated band (--eps-engine 1.96) on the bf16 record
and on the synthetic engine at SmolLM2's floor, the fixed widened band of make figures-engine, TRL's
default route (the trainer's pi_old, --is-correction sequence_mask), and two controls that split the
calibrated band: re-centring alone (--eps-engine 0) and widening alone (the trainer's pi_old, a band
as wide as the calibrated one, centred where the paper's is: read from the first phase's runs).
"""
from __future__ import annotations

import json
import math
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))   # gspo_minimal, studies

import torch  # noqa: E402

import gspo_lab as g  # noqa: E402
from studies.common import (Ledger, Parser, cli, fail, kept_design, paired_differences, read_json,  # noqa: E402
                            rewrite_json, run_jobs, script_job, write_json, write_result)

OUTPUTS = ("figures/mechanism_calibration.json", "figures/mechanism.json", "figures/mechanism_remedy.json",
           "figures/mechanism_readings.json", "figures/mechanism_bins.json")
READINGS_JSON = "figures/mechanism_readings.json"
BINS_JSON = "figures/mechanism_bins.json"
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
    from studies.engine import warmup_rollouts
    ds, masks, logps, kls = [], [], [], []
    for model, cfg, sampler, b in warmup_rollouts(seed, rollouts):
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


def compare_by_length(real: dict[int, list[float]], synth: dict[int, list[float]], sigma: float) -> list[dict]:
    """Per length n: both records' log s quantiles, KS distance and standard deviation, beside the
    lens's sigma / sqrt(n)."""
    rows = []
    for n in sorted(real):
        a, b = real[n], synth[n]
        row = {"length": n, "responses": len(a)}
        if len(a) >= 20:               # fewer: no quantile or KS distance worth reading
            row.update(real=quantiles_of(a), synthetic=quantiles_of(b), **ks_of(a, b),
                       real_std=statistics.stdev(a), synthetic_std=statistics.stdev(b),
                       lens_std=sigma / math.sqrt(n))
        rows.append(row)
    return rows


def ks_of(a: list[float], b: list[float]) -> dict:
    """Two samples' KS distance beside its 5% critical value."""
    return {"ks_distance": ks_distance(a, b), "ks_critical_05": ks_critical(len(a), len(b))}


def against_real(d: torch.Tensor, synth: torch.Tensor, mask: torch.Tensor, sigma: float) -> tuple[list[dict], list, list]:
    """A synthetic record's gaps against the real record's d on the same responses: `compare_by_length`'s
    rows at the lens's sigma, then each record's log s pooled over every length (real, synthetic)."""
    real_by_n, synth_by_n = log_s_by_length(d, mask), log_s_by_length(synth, mask)
    return (compare_by_length(real_by_n, synth_by_n, sigma),
            [v for vs in real_by_n.values() for v in vs], [v for vs in synth_by_n.values() for v in vs])


def real_record(seeds) -> tuple[list[dict], torch.Tensor, torch.Tensor, torch.Tensor]:
    """The real bf16 record of each seed's rollouts (`real_gaps`), and its d, mask and logp joined."""
    parts = [real_gaps(s) for s in seeds]
    return (parts, *(torch.cat([p[k] for p in parts]) for k in ("d", "mask", "logp")))


def homoscedastic_record(d: torch.Tensor, mask: torch.Tensor) -> tuple[float, float, torch.Tensor]:
    """K-hat and SIGMA-hat of a real record's kept gaps, and the synthetic record at them (seed 0)."""
    x = d[mask]
    k_hat, sigma_hat = -x.mean().item(), x.std().item()
    cfg = g.Config(record_noise=f"{k_hat!r},{sigma_hat!r}", seed=0)
    return k_hat, sigma_hat, g.synthetic_gap(mask, cfg).double()


def record_bins_flag(rows: list[dict]) -> str:
    """--record-bins' value from a real record's gaps by bin of the trainer's probability (`by_probability`
    rows: [lo, hi), mean_d, std_d), copied as measured: "hi:mean:std,..." (an empty bin gets a zero gap)."""
    return ",".join(f"{r['probability'][1]!r}:{r['mean_d'] or 0.0!r}:{r['std_d'] or 0.0!r}" for r in rows)


def bins_comparison(d: torch.Tensor, logp: torch.Tensor, mask: torch.Tensor, seed: int = 0) -> dict:
    """The heteroscedastic synthetic record (--record-bins) fitted on a real record's gaps d (pooled over
    its responses), drawn on the same tokens (their trainer log-probs `logp`), against the real one as
    the calibration compares the homoscedastic record: log s by length (quantiles, KS distance, standard
    deviations beside the lens's) and pooled; and the bins' own means and spreads, real against drawn."""
    rows = by_probability(d, logp, mask)
    cfg = g.Config(record_bins=record_bins_flag(rows), seed=seed)
    synth = g.synthetic_gap(mask, cfg, logp).double()
    by_length, all_real, all_synth = against_real(d, synth, mask, d[mask].std().item())
    return {"flag": cfg.record_bins, "fitted_on": "the real record's tokens, pooled over every response",
            "bins_real": rows, "bins_synthetic": by_probability(synth, logp, mask),
            "by_length": by_length, "pooled": ks_of(all_real, all_synth)}


def bins_record(seeds=CAL_SEEDS) -> dict:
    """The heteroscedastic record against the real bf16 record on the calibration's tokens (make
    figures-map's dense warm-ups of `seeds`, made where missing; CAL_ROLLOUTS rollouts each by the
    bf16 copy), its bins fitted pooled over every token (`bins_comparison`); beside it the
    homoscedastic record at the same tokens' K-hat and SIGMA-hat, drawn from the same stream."""
    from studies import map as regimes
    t0 = time.perf_counter()
    run_jobs([regimes.warmup_job("dense", s) for s in seeds], CAL_RUNS)       # made where missing
    _, d, mask, logp = real_record(seeds)
    out = bins_comparison(d, logp, mask)
    k_hat, sigma_hat, homo = homoscedastic_record(d, mask)
    by_length, all_real, all_homo = against_real(d, homo, mask, sigma_hat)
    return {"seeds": list(seeds), "rollouts_per_seed": CAL_ROLLOUTS, "responses": int(mask.any(1).sum()),
            "tokens": int(mask.sum()), "k_hat": k_hat, "sigma_hat": sigma_hat, "heteroscedastic": out,
            "homoscedastic": {"by_length": by_length, "pooled": ks_of(all_real, all_homo)},
            "seconds_total": time.perf_counter() - t0}


def add2_calibration(seeds=CAL_SEEDS) -> dict:
    """The real record's K-hat and SIGMA-hat pooled over the seeds' rollouts, the synthetic engine at
    those values on the same masks, and what the model misses."""
    parts, d, mask, logp = real_record(seeds)
    x = d[mask]
    N = len(x)
    k_hat, sigma_hat, synth = homoscedastic_record(d, mask)
    rows, all_real, all_synth = against_real(d, synth, mask, sigma_hat)
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
            "pooled": {"real": quantiles_of(all_real), "synthetic": quantiles_of(all_synth), **ks_of(all_real, all_synth)},
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


# ---------------------------------------------------------------------------------------------
# make figures-mechanism: bias against noise on add2, seven cells under the map's rule on five seeds.
# ---------------------------------------------------------------------------------------------
MECH_JSON = "figures/mechanism.json"
MECH_RUNS = CAL_RUNS
MECH_SEEDS = (0, 1, 2, 3, 4)
MECH_NOISE_OFFSET = 100                 # GSPO's second RL stream: --seed s + 100 from the same warm-up
MECH_BUDGET_SECONDS = 75 * 60
PROJECTION_MARGIN = 0.9                 # the projection must fit 90% of the budget
MECH_NOISE_FIRST = ("real_bf16",)       # its noise measured up front, the others' where their signs agree
# the remedy's cells (the calibrated band, the widened band, TRL's route, two controls), counted in
# the family's chance probability: they run under a target of their own, designed with their code
REMEDY_CELLS = ("real_bf16_calibrated", "real_bf16_wide", "synth_both_large_calibrated", "trl_route",
                "control_recentre", "control_widen")
MECH_RULE = ("metric: accuracy_after_rl (test set). Each cell pairs its GSPO and GRPO runs of a seed (the same "
             "warm-up and RL seed): difference = GSPO - GRPO. A cell's noise is the largest |GSPO(s) - GSPO(s, "
             "second RL stream)| over its seeds (--seed s + 100 from the same warm-up), measured up front in "
             "real_bf16 and then in every cell whose five differences share a sign; a cell without its own uses "
             "the largest measured. A cell separates when all five differences have the same sign (a zero breaks "
             "it) and |median| exceeds its noise. No confirmation phase: five seeds from the start.")
NULL_NOTE = ("the chance that five seeds share a sign when neither objective is ahead; the rule also asks "
             "|median| > noise, so these bound the chance of a call from above")
BY_SIGN = ("clip_seqs_by_sign_by_minibatch: per minibatch, the share of GSPO's responses with A > 0 and with "
           "A < 0 whose s was clipped on its active side; a run's record keeps minibatch 1's mean over steps "
           "and the later minibatches' (their mean over steps and minibatches)")


def mech_cells(cal: dict, eng: dict) -> dict:
    """name -> the script's flags: the real engines' records and the synthetic engine at the values the
    prototype read (add2's K-hat and SIGMA-hat) or make engine measured (SmolLM2's floor and sigma)."""
    from studies import engine
    k, sigma = cal["add2"]["k_hat"], cal["add2"]["sigma_hat"]
    big_k, big_sigma = eng["models"]["smollm2"]["bfloat16"]["kl_floor"], math.sqrt(eng["models"]["smollm2"]["bfloat16"]["sigma2"])
    noise = lambda a, b: ["--record-noise", f"{a:.6g},{b:.6g}"]
    return {"real_bf16": engine.BF16 + engine.FROM_SAMPLER, "real_fp16": engine.FP16 + engine.FROM_SAMPLER,
            "synth_both": noise(k, sigma), "synth_noise": noise(0, sigma), "synth_bias": noise(k, 0),
            "synth_bias_large": noise(big_k, 0), "synth_both_large": noise(big_k, big_sigma)}


def mech_design(cal_json: str = CAL_JSON, engine_json: str = "figures/engine.json") -> dict:
    """Everything the measured run is held to, written into mechanism.json before it starts."""
    from studies import engine
    for path in (cal_json, engine_json):
        if not os.path.exists(path):
            fail(f"make figures-mechanism reads {path}: run `python studies/mechanism.py calibrate` "
                 "(and `make engine`) first")
    cal, eng = read_json(cal_json), read_json(engine_json)
    n2, n3 = len(mech_cells(cal, eng)), len(REMEDY_CELLS)
    return {"cells": {name: {"model": "dense", "task": "add2", "flags": flags, "losses": ["gspo", "grpo"], "steps": engine.em_steps("dense"),
                             "decided_by": "gspo - grpo"} for name, flags in mech_cells(cal, eng).items()},
            "seeds": list(MECH_SEEDS), "noise_rl_seed_offset": MECH_NOISE_OFFSET,
            "noise_measured_first_in": list(MECH_NOISE_FIRST),
            "values_read": {"k_hat": cal["add2"]["k_hat"], "sigma_hat": cal["add2"]["sigma_hat"],
                            "from": f"{cal_json}: add2.k_hat, add2.sigma_hat (the bf16 record at the warm-ups, "
                                    f"measured at {cal.get('measured_at_commit')})",
                            "smollm2_k": eng["models"]["smollm2"]["bfloat16"]["kl_floor"],
                            "smollm2_sigma": math.sqrt(eng["models"]["smollm2"]["bfloat16"]["sigma2"]),
                            "smollm2_from": f"{engine_json}: models.smollm2.bfloat16.kl_floor and sqrt(sigma2)"},
            "warmups": "make figures-map's dense warm-ups (runs/map/warmup_dense_s<seed>: python studies/map.py "
                       "_warmup dense SEED), made where missing",
            "decision_rule": MECH_RULE, "by_sign_metric": BY_SIGN,
            "null_probabilities": {"same_sign_5_of_5_per_cell": 1 / 16,
                                   "at_least_one_of_these_cells": 1 - (15 / 16) ** n2,
                                   "at_least_one_with_the_remedy_cells": 1 - (15 / 16) ** (n2 + n3),
                                   "remedy_cells": list(REMEDY_CELLS),
                                   "note": NULL_NOTE},
            "analysis": "mechanism.mech_verdicts (the map's verdicts on five seeds) and mechanism.mech_record",
            "budget_seconds": MECH_BUDGET_SECONDS, "workers": 2, "threads_per_run": 1}


def mech_projection(design: dict, cal: dict) -> dict:
    """The target's seconds from the prototype's timed runs (each alone, one thread), two at a time:
    every cell's GSPO and GRPO runs, every cell's second RL streams (the most the rule can ask for),
    and the warm-ups of the seeds the prototype did not make (about 60 s each)."""
    t = {k: v["wall_seconds"] for k, v in cal["timing"].items()}
    per_run = {c: t["timing_real_bf16"] if "--sampler-dtype" in d["flags"] else t["timing_synth_both"]
               for c, d in design["cells"].items()}
    runs = sum(per_run[c] * (len(d["losses"]) + 1) * len(design["seeds"]) for c, d in design["cells"].items())
    warm = 60.0 * len(set(design["seeds"]) - set(CAL_SEEDS))
    seconds = (runs + warm) / design["workers"]
    return {"seconds": seconds, "fits": seconds <= PROJECTION_MARGIN * design["budget_seconds"],
            "runs": sum((len(d["losses"]) + 1) * len(design["seeds"]) for d in design["cells"].values()),
            "from": "figures/mechanism_calibration.json: timing (one run of each kind, alone)"}


def mech_write_design() -> dict:
    """mechanism.json before any run: the design and its projection; one holding runs made under
    another design is never overwritten."""
    d = mech_design()
    kept = kept_design(MECH_JSON, d)
    if kept is not None:
        return kept
    proj = mech_projection(d, read_json(CAL_JSON))
    if not proj["fits"]:
        fail(f"the projected {proj['seconds'] / 60:.0f} min do not fit {PROJECTION_MARGIN:.0%} of the budget")
    record = {"figures_mechanism_seconds": 0.0, "design": d, "projection": proj, "runs": [], "cells": {}}
    write_json(MECH_JSON, record, "python studies/mechanism.py design", 0.0)
    return record


def mech_jobs(design: dict, cells, seeds, noise: bool = False, folder: str = MECH_RUNS) -> list[dict]:
    """Each cell's runs of `seeds` (with `noise`, GSPO's second RL streams), each waiting for its
    warm-up: make figures-engine's jobs (`engine.em_jobs`), in `folder` (the remedy's: REM_RUNS)."""
    from studies import engine
    return engine.em_jobs(design, cells, seeds, noise, folder=folder, noise_offset=MECH_NOISE_OFFSET)


def by_sign(rl: list[dict]) -> dict:
    """A run's clip shares by the sign of A: minibatch 1's mean over steps, the later minibatches'."""
    rows = [r["clip_seqs_by_sign_by_minibatch"] for r in rl if "clip_seqs_by_sign_by_minibatch" in r]
    if not rows:
        return {}
    first = [r[0] for r in rows]
    later = [m for r in rows for m in r[1:]]
    mean = lambda xs, i: statistics.fmean(x[i] for x in xs) if xs else None
    return {"clip_seqs_pos_adv_minibatch_1": mean(first, 0), "clip_seqs_neg_adv_minibatch_1": mean(first, 1),
            "clip_seqs_pos_adv_later": mean(later, 0), "clip_seqs_neg_adv_later": mean(later, 1)}


def mech_record(name: str, cell: str, seed: int, rl_seed: int, folder: str = MECH_RUNS) -> dict:
    """A run's record: the map's basics, its clip shares by sign (`by_sign`), the means over steps of
    the engine keys it logged, and, where its band was calibrated, the last step's estimates (K-hat
    both ways, SIGMA-hat) and the median over steps 2+ of its width at the median length."""
    from studies import map as regimes
    rec, rl = regimes.run_basics(name, folder, regimes.warm_path("dense", seed))
    rec.update({"cell": cell, "seed": seed, "rl_seed": rl_seed, **by_sign(rl),
                **{k: statistics.fmean(r[k] for r in rl) for k in ("engine_log_s_mean", "engine_kl_tokens",
                                                                    "engine_gap_seqs", "is_masked_tokens") if k in rl[0]}})
    later = [r for r in rl if "engine_k_hat" in r]
    if later:
        rec.update({k: later[-1][k] for k in ("engine_k_hat", "engine_k_hat_mean", "engine_sigma_hat")})
        rec["band_width_median"] = statistics.median(r["engine_band_width"] for r in later)
    return rec


def mech_collect(design: dict, folder: str = MECH_RUNS) -> tuple[list[dict], dict]:
    """The records of every finished run of `design` in `folder`, and accuracy_after_rl by cell, slot
    (its losses, and noise: GSPO's second RL stream) and seed."""
    from studies import engine
    records, acc = [], {}
    for cell, c in design["cells"].items():
        a = {"gspo": {}, "grpo": {}, "noise": {}}
        for seed in design["seeds"]:
            for loss, rl_seed, slot in [(loss, seed, loss) for loss in c["losses"]] + [
                    ("gspo", seed + MECH_NOISE_OFFSET, "noise")]:
                name = engine.em_run_name(cell, loss, seed, rl_seed)
                if os.path.exists(os.path.join(folder, name, "summary.json")):
                    records.append(mech_record(name, cell, seed, rl_seed, folder))
                    a[slot][seed] = records[-1]["accuracy_after_rl"]
        acc[cell] = a
    return records, acc


def mech_verdicts(acc: dict, seeds=MECH_SEEDS) -> dict:
    """The map's rule (studies/map.py's `verdicts`) on five seeds, one task: GSPO - GRPO per cell."""
    from studies import map as regimes
    out = regimes.verdicts(acc, {cell: "add2" for cell in acc}, seeds)
    for cell, v in out.items():
        v["decided_by"] = "gspo - grpo"
        v["gspo_minus_grpo_by_seed"] = dict(zip(seeds, paired_differences(acc[cell]["gspo"], acc[cell]["grpo"], seeds)))
    return out


def figures_mechanism() -> dict:
    """The warm-ups, every cell's runs and real_bf16's second streams; then the second streams of
    every cell whose signs agree; then the verdicts. Resumable: finished runs are kept."""
    from studies import map as regimes
    record = mech_write_design()
    d = record["design"]
    ledger = Ledger(os.path.join(MECH_RUNS, "figures_seconds.json"))
    try:
        warm = [regimes.warmup_job("dense", s) for s in MECH_SEEDS]
        run_jobs(warm + mech_jobs(d, d["cells"], MECH_SEEDS) + mech_jobs(d, MECH_NOISE_FIRST, MECH_SEEDS, noise=True),
                 MECH_RUNS)
        _, acc = mech_collect(d)
        agree = [c for c, v in mech_verdicts(acc).items() if v["common_sign"] and c not in MECH_NOISE_FIRST]
        run_jobs(mech_jobs(d, agree, MECH_SEEDS, noise=True), MECH_RUNS)
    finally:
        ledger.close()
    record["runs"], acc = mech_collect(d)
    record["cells"] = mech_verdicts(acc)
    for cell, v in record["cells"].items():
        mine = [r for r in record["runs"] if r["cell"] == cell and r["rl_seed"] == r["seed"]]
        v["collapses"] = {loss: sum(r["collapsed"] for r in mine if r["loss"] == loss) for loss in ("gspo", "grpo")}
    record["figures_mechanism_seconds"] = ledger.total()
    return record


# ---------------------------------------------------------------------------------------------
# make figures-remedy: a band that survives the gap. GSPO alone in six cells, each paired seed by
# seed with its reference cell's GSPO runs (the mechanism's, read from mechanism.json's runs, or
# bf16_trainer, made here), under the mechanism's rule; a second phase for the control whose band
# is read from the first phase's runs.
# ---------------------------------------------------------------------------------------------
REM_JSON = "figures/mechanism_remedy.json"
REM_RUNS = "runs/remedy"
REM_Z = 1.96                            # the calibrated band's Z: 95% of the engine's noise inside it at theta_old
REM_BUDGET_SECONDS = 60 * 60
REM_PHASE_2 = ("control_widen",)        # its band is the calibrated band's median width, read from phase 1
# name: (flags, reference cell): "MECH:<cell>" adds that mechanism cell's flags; WIDE the fixed widened
# band (engine.widened_band); WIDEN the band of control_widen (phase 2)
REM_CELLS = {
    "real_bf16_calibrated": (["MECH:real_bf16", "--eps-engine", f"{REM_Z:g}"], "real_bf16"),
    "real_bf16_wide": (["MECH:real_bf16", "WIDE"], "real_bf16"),
    "synth_both_large_calibrated": (["MECH:synth_both_large", "--eps-engine", f"{REM_Z:g}"], "synth_both_large"),
    "trl_route": (["--sampler-dtype", "bfloat16", "--is-correction", "sequence_mask"], "real_bf16"),
    "control_recentre": (["MECH:real_bf16", "--eps-engine", "0"], "real_bf16"),
    "control_widen": (["--sampler-dtype", "bfloat16", "WIDEN"], "bf16_trainer"),
    "bf16_trainer": (["--sampler-dtype", "bfloat16"], None)}        # control_widen's reference, not decided
REM_RULE = (MECH_RULE.replace("pairs its GSPO and GRPO runs of a seed (the same warm-up and RL seed): difference "
                              "= GSPO - GRPO", "pairs its GSPO run of a seed with its reference cell's GSPO run "
                              "of that seed (the same warm-up and RL seed): difference = GSPO(cell) - GSPO(reference)")
            .replace("measured up front in real_bf16 and then in every cell whose five differences share a sign; a "
                     "cell without its own uses the largest measured",
                     "measured in every cell whose five differences share a sign; a cell without its own uses the "
                     "largest measured here or in mechanism.json's cells"))
WIDEN_RULE = ("control_widen's band: the paper's band on log s widened on each side by half of (W - W_paper), W "
              "the median over real_bf16_calibrated's five runs of each run's median over its steps 2-70 of "
              "engine_band_width (the band's width at the median length; step 1 is the paper's), W_paper = "
              "log(1 + 4e-4) - log(1 - 3e-4): as wide as the calibrated band, centred where the paper's is (on "
              "zero to within 5e-5), with the trainer's pi_old")


def rem_flags(name: str, mech: dict, band: dict, widen: dict | None) -> list[str]:
    flags = []
    for f in REM_CELLS[name][0]:
        if f.startswith("MECH:"):
            flags += mech["cells"][f[5:]]["flags"]
        elif f in ("WIDE", "WIDEN"):
            b = band if f == "WIDE" else widen
            flags += ["--eps-low", f"{b['eps_low']:.6g}", "--eps-high", f"{b['eps_high']:.6g}"] if b else ["WIDEN"]
        else:
            flags.append(f)
    return flags


def rem_design(mech_json: str = MECH_JSON) -> dict:
    """Everything figures-remedy's runs are held to, written into mechanism_remedy.json before them
    (control_widen's band stands as WIDEN until phase 1 has measured it: the rule is fixed, the value read)."""
    from studies import engine
    mech, band = read_json(mech_json)["design"], engine.widened_band()
    cells = {name: {"model": "dense", "task": "add2", "flags": rem_flags(name, mech, band, None), "losses": ["gspo"],
                    "steps": engine.em_steps("dense"), "reference": ref,
                    "decided_by": None if ref is None else f"gspo({name}) - gspo({ref})",
                    "phase": 2 if name in REM_PHASE_2 else 1} for name, (_, ref) in REM_CELLS.items()}
    decided = [c for c, v in cells.items() if v["reference"] is not None]
    return {"cells": cells, "decided_cells": decided, "seeds": list(MECH_SEEDS), "noise_rl_seed_offset": MECH_NOISE_OFFSET,
            "z": REM_Z, "widened_band": band, "control_widen_rule": WIDEN_RULE,
            "references_from": f"{mech_json}: runs (real_bf16, synth_both_large), and bf16_trainer's runs made here",
            "also_reported": "gspo(cell) - grpo(the reference's cell) by seed where that cell ran GRPO (mechanism.json): "
                             "whether the remedy closes the gap to GRPO; not a deciding comparison",
            "decision_rule": REM_RULE, "by_sign_metric": BY_SIGN,
            "null_probabilities": {"same_sign_5_of_5_per_cell": 1 / 16,
                                   "at_least_one_of_these_cells": 1 - (15 / 16) ** len(decided),
                                   "at_least_one_with_the_mechanism_cells": 1 - (15 / 16) ** (len(decided) + len(mech["cells"])),
                                   "note": NULL_NOTE},
            "analysis": "mechanism.rem_verdicts and mechanism.mech_record", "budget_seconds": REM_BUDGET_SECONDS,
            "workers": 2, "threads_per_run": 1}


def widen_band(records: list[dict]) -> dict:
    """control_widen's (eps_low, eps_high) from real_bf16_calibrated's run records (WIDEN_RULE)."""
    widths = [r["band_width_median"] for r in records if r["cell"] == "real_bf16_calibrated" and r["rl_seed"] == r["seed"]]
    if len(widths) != len(MECH_SEEDS):
        fail(f"control_widen's band needs real_bf16_calibrated's {len(MECH_SEEDS)} runs; {len(widths)} finished")
    w, w_paper = statistics.median(widths), math.log1p(4e-4) - math.log1p(-3e-4)
    half = max(w - w_paper, 0.0) / 2
    return {"width_median": w, "width_paper": w_paper, "half_widening": half,
            "eps_low": 1 - (1 - 3e-4) * math.exp(-half), "eps_high": (1 + 4e-4) * math.exp(half) - 1,
            "from": "real_bf16_calibrated's runs: band_width_median", "rule": WIDEN_RULE}


def mech_accuracies(mech: dict) -> tuple[dict, list[float]]:
    """mechanism.json's accuracy_after_rl by cell, slot (gspo, grpo, noise) and seed, and the noises
    its cells measured."""
    acc: dict = {}
    for r in mech["runs"]:
        slot = r["loss"] if r["rl_seed"] == r["seed"] else "noise"
        acc.setdefault(r["cell"], {"gspo": {}, "grpo": {}, "noise": {}})[slot][r["seed"]] = r["accuracy_after_rl"]
    noises = [v["noise"] for v in mech["cells"].values() if v.get("noise_from") == "its own second RL streams"]
    return acc, noises


def pairing_problems(records: list[dict], mech: dict) -> list[str]:
    """The remedy's runs are paired with mechanism.json's by seed: each must start from the warm-up its
    reference started from (a warm-up made again, on another host, would start another run). Checked
    on accuracy_before_rl and val_acc_at_rl_start, which every run of a warm-up shares."""
    start = {}
    for r in mech["runs"]:
        start.setdefault(r["seed"], (r["accuracy_before_rl"], r["val_acc_at_rl_start"]))
    return [f"{r['name']}: starts at {(r['accuracy_before_rl'], r['val_acc_at_rl_start'])}, mechanism.json's seed "
            f"{r['seed']} at {start.get(r['seed'])}" for r in records
            if start.get(r["seed"]) != (r["accuracy_before_rl"], r["val_acc_at_rl_start"])]


def check_pairing(records: list[dict], mech: dict) -> None:
    problems = pairing_problems(records, mech)
    if problems:
        fail("runs not paired with their references' warm-ups (move runs/remedy away to start over): "
             + "; ".join(problems[:3]))


def rem_verdicts(design: dict, acc: dict, mech_acc: dict, mech_noises: list[float]) -> dict:
    """The map's rule (studies/map.py's `verdicts`) per decided cell: GSPO(cell) - GSPO(reference)
    seed by seed, the noise its own second streams' or the largest measured here or in mechanism.json
    (`mech_noises`); with gspo(cell) - grpo(reference) where the reference ran GRPO."""
    from studies import map as regimes
    seeds, decided = design["seeds"], design["decided_cells"]
    ref = {c: mech_acc.get(design["cells"][c]["reference"]) or acc[design["cells"][c]["reference"]] for c in decided}
    compared = {c: {"gspo": acc[c]["gspo"], "noise": acc[c]["noise"], "grpo": ref[c]["gspo"]} for c in decided}
    out = regimes.verdicts(compared, {c: "add2" for c in decided}, seeds,
                           noise_elsewhere={"add2": max(mech_noises)} if mech_noises else None)
    for c, v in out.items():
        del v["ahead"]                        # "gspo" or "grpo": the wrong words for a reference comparison
        grpo = ref[c].get("grpo")
        out[c] = {"decided_by": design["cells"][c]["decided_by"], **v,
                  "gspo_minus_reference_grpo_by_seed": (dict(zip(seeds, paired_differences(acc[c]["gspo"], grpo, seeds)))
                                                        if grpo else None)}
    return out


def remedy_readings(remedy: dict, mech: dict) -> dict:
    """Comparisons the remedy's rule did not decide, read from the committed runs, test accuracy after
    RL seed by seed (no rule applied to any of them; each is a reading, made after the data):

      * against the reference's own reruns: GSPO(cell) - GSPO(real_bf16, second RL stream), the
        reference arm's rerun standing in for the reference (it moved 0.196 on its rerun);
      * the calibrated band against the fixed widened one, and against the trainer's pi_old at the
        paper's band (bf16_trainer): how much of a gain a wider band gives with no record at all;
      * mechanism.json's cells that lean one way on every seed, called or not."""
    seeds = sorted({r["seed"] for r in remedy["runs"]})
    acc, _ = mech_accuracies(remedy)
    mech_acc, _ = mech_accuracies(mech)
    rerun = mech_acc["real_bf16"]["noise"]                     # GSPO on the record, second RL streams

    def minus(a: dict, b: dict) -> dict:
        diff = {str(s): a[s] - b[s] for s in seeds}
        return {"by_seed": diff, "median": statistics.median(diff.values()),
                "positive": sum(v > 0 for v in diff.values()), "negative": sum(v < 0 for v in diff.values())}
    out = {"seeds": seeds, "reference_rerun_of": "real_bf16 (mechanism.json), GSPO, second RL streams",
           "against_reference_reruns": {c: minus(acc[c]["gspo"], rerun) for c in
                                        ("real_bf16_calibrated", "real_bf16_wide", "trl_route", "control_recentre")},
           "calibrated_minus_wide": minus(acc["real_bf16_calibrated"]["gspo"], acc["real_bf16_wide"]["gspo"]),
           "calibrated_minus_trainer_paper_band": minus(acc["real_bf16_calibrated"]["gspo"], acc["bf16_trainer"]["gspo"]),
           "wide_minus_trainer_paper_band": minus(acc["real_bf16_wide"]["gspo"], acc["bf16_trainer"]["gspo"])}
    same_sign = {}
    for c, v in mech["cells"].items():
        signs = {(d > 0) - (d < 0) for d in v["differences_by_seed"].values()}
        if len(signs) == 1:
            same_sign[c] = signs.pop()
    out["mechanism_cells_one_sign_on_every_seed"] = {c: {"sign": sign, "called": mech["cells"][c]["separates"],
                                                         "median": mech["cells"][c]["median_difference"]}
                                                     for c, sign in sorted(same_sign.items())}
    out["mechanism_cells"] = len(mech["cells"])
    return out


def rem_projection(design: dict, timing: dict) -> dict:
    """The target's seconds from the prototype's timed runs (alone, one thread), two at a time: every
    cell's GSPO runs and every decided cell's second streams (the most the rule can ask for)."""
    per = lambda c: timing["timing_trl_route" if "--old-logprobs" not in design["cells"][c]["flags"] and
                           "--record-noise" not in design["cells"][c]["flags"] else "timing_real_bf16_calibrated"]["wall_seconds"]
    n = len(design["seeds"])
    seconds = sum(per(c) * n * (2 if c in design["decided_cells"] else 1) for c in design["cells"]) / design["workers"]
    return {"seconds": seconds, "fits": seconds <= PROJECTION_MARGIN * design["budget_seconds"],
            "runs": sum(n * (2 if c in design["decided_cells"] else 1) for c in design["cells"]),
            "from": f"{REM_JSON}: prototype (one run of each kind, alone, one thread)"}


def rem_prototype(design: dict) -> dict:
    """One timed GSPO run of each kind, from seed 0's warm-up, alone with one thread: the calibrated
    band on the bf16 record, and the trainer's pi_old with TRL's correction."""
    from studies import map as regimes
    warm = regimes.warmup_job("dense", 0)
    ckpt = os.path.join(os.path.dirname(warm["done"]), "checkpoint")
    base = ["--model", ckpt, "--warmup-max-steps", "0", "--seed", "0", "--loss", "gspo"]
    jobs = [script_job(f"timing_{c}", base + design["cells"][c]["flags"], REM_RUNS, design["cells"][c]["steps"],
                       needs=warm["done"]) for c in ("real_bf16_calibrated", "trl_route")]
    run_jobs([warm] + jobs, REM_RUNS, workers=1)
    return {job["name"]: {"command": " ".join(job["cmd"][1:]), "wall_seconds": read_json(job["done"])["wall_seconds"]}
            for job in jobs}


def rem_write_design() -> dict:
    """mechanism_remedy.json before any run: the design, the prototype's timings and the projection.
    A file holding this design is returned as it stands (its control_widen_band kept); one holding
    another design is never overwritten, runs or not."""
    d = rem_design()
    if os.path.exists(REM_JSON):
        old = read_json(REM_JSON)
        if old.get("design") != json.loads(json.dumps(d, allow_nan=False)):
            fail(f"{REM_JSON} holds another design than the code's; move it away to write this one")
        return old
    timing = rem_prototype(d)
    proj = rem_projection(d, timing)
    if not proj["fits"]:
        fail(f"the projected {proj['seconds'] / 60:.0f} min do not fit {PROJECTION_MARGIN:.0%} of the budget")
    record = {"figures_remedy_seconds": 0.0, "design": d, "prototype": timing, "projection": proj,
              "control_widen_band": None, "runs": [], "cells": {}}
    write_json(REM_JSON, record, "python studies/mechanism.py remedy-design", 0.0)
    return record


def figures_remedy() -> dict:
    """Phase 1 (every cell but control_widen), control_widen's band from it, phase 2, the second
    streams of every decided cell whose signs agree, then the verdicts. Resumable."""
    from studies import map as regimes
    mech = read_json(MECH_JSON)
    if not mech.get("cells"):
        fail(f"make figures-remedy pairs its cells with {MECH_JSON}'s runs: run `make figures-mechanism` first")
    record = rem_write_design()
    d = record["design"]
    phase1 = [c for c, v in d["cells"].items() if v["phase"] == 1]
    ledger = Ledger(os.path.join(REM_RUNS, "figures_seconds.json"))
    try:
        warm = [regimes.warmup_job("dense", s) for s in MECH_SEEDS]
        run_jobs(warm + mech_jobs(d, phase1, MECH_SEEDS, folder=REM_RUNS), REM_RUNS)
        records, _ = mech_collect(d, REM_RUNS)
        check_pairing(records, mech)
        band = record["control_widen_band"] or widen_band(records)
        if record["control_widen_band"] is None:             # written before control_widen's runs
            record["control_widen_band"] = band
            rewrite_json(REM_JSON, record)
        banded = {**d, "cells": {**d["cells"], **{c: {**d["cells"][c], "flags": rem_flags(
            c, mech["design"], d["widened_band"], band)} for c in REM_PHASE_2}}}   # the design keeps WIDEN
        run_jobs(mech_jobs(banded, REM_PHASE_2, MECH_SEEDS, folder=REM_RUNS), REM_RUNS)
        _, acc = mech_collect(d, REM_RUNS)
        mech_acc, mech_noises = mech_accuracies(mech)
        agree = [c for c, v in rem_verdicts(d, acc, mech_acc, mech_noises).items() if v["common_sign"]]
        run_jobs(mech_jobs(banded, agree, MECH_SEEDS, noise=True, folder=REM_RUNS), REM_RUNS)
    finally:
        ledger.close()
    record["runs"], acc = mech_collect(d, REM_RUNS)
    check_pairing(record["runs"], mech)
    record["pairing"] = "every run starts where mechanism.json's runs of its seed start (pairing_problems)"
    record["cells"] = rem_verdicts(d, acc, mech_acc, mech_noises)
    record["figures_remedy_seconds"] = ledger.total()
    return record


def print_verdicts(cells: dict, path: str) -> None:
    """One line per cell: its deciding comparison by seed, median, noise and verdict; then the file."""
    num = lambda x: "none" if x is None else f"{x:+.3f}"
    for cell, v in cells.items():
        diffs = ", ".join(num(x) for x in v["differences_by_seed"].values())
        noise = "none" if v["noise"] is None else f"{v['noise']:.3f}"
        print(f"{cell:28s} {v['decided_by']:52s} {diffs} | median {num(v['median_difference'])}, noise "
              f"{noise} | {'separates' if v['separates'] else 'does not separate'}")
    print(path)


@cli
def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = Parser(description=__doc__.splitlines()[0])
    parser.add_argument("what", choices=["calibrate", "design", "figures", "remedy-design", "remedy", "readings", "bins"])
    what = parser.parse_args(argv).what
    if what == "bins":
        res = bins_record()
        write_json(BINS_JSON, res, "python studies/mechanism.py bins", res.pop("seconds_total"))
        het, homo = res["heteroscedastic"]["pooled"], res["homoscedastic"]["pooled"]
        print(f"add2, bf16 record, {res['tokens']} tokens: pooled KS distance of log s against the real record: "
              f"binned {het['ks_distance']:.3f}, one sigma {homo['ks_distance']:.3f} (5% critical "
              f"{het['ks_critical_05']:.3f})")
        print(BINS_JSON)
        return 0
    if what == "readings":
        t0 = time.perf_counter()
        res = remedy_readings(read_json(REM_JSON), read_json(MECH_JSON))
        write_json(READINGS_JSON, res, "python studies/mechanism.py readings", time.perf_counter() - t0)
        print(json.dumps(res, indent=1, allow_nan=False))
        return 0
    from transformers.utils import logging as hf_logging
    hf_logging.disable_progress_bar()
    if what == "remedy-design":
        record = rem_write_design()
        print(f"{REM_JSON}: {len(record['design']['decided_cells'])} decided cells, projected "
              f"{record['projection']['seconds'] / 60:.0f} min of {REM_BUDGET_SECONDS // 60}")
        return 0
    if what == "remedy":
        record = figures_remedy()
        write_result(REM_JSON, record, "python studies/mechanism.py remedy", record["figures_remedy_seconds"])
        print_verdicts(record["cells"], REM_JSON)
        return 0
    if what == "design":
        record = mech_write_design()
        print(f"{MECH_JSON}: {len(record['design']['cells'])} cells, projected "
              f"{record.get('projection', {}).get('seconds', 0) / 60:.0f} min of {MECH_BUDGET_SECONDS // 60}")
        return 0
    if what == "figures":
        record = figures_mechanism()
        write_result(MECH_JSON, record, "python studies/mechanism.py figures", record["figures_mechanism_seconds"])
        print_verdicts(record["cells"], MECH_JSON)
        return 0
    res = calibrate()
    write_json(CAL_JSON, res, "python studies/mechanism.py calibrate", res.pop("seconds_total"))
    a = res["add2"]
    est = a["estimators_of_k"]
    print(f"add2, bf16 record, {a['tokens']} tokens: K-hat {a['k_hat']:.3g} (+- {est['minus_mean_d_standard_error']:.2g}), "
          f"SIGMA-hat {a['sigma_hat']:.3g}, SIGMA-hat^2/2 {est['sigma_hat_squared_over_2']:.3g}, "
          f"exact KL {est['exact_kl_per_token_mean']:.3g}")
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

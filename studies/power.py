"""The record or the band? One paired study at 30 seeds on add2, its design fixed before its runs.

    python studies/power.py effects   # the detectable effect at 80% power of each contrast, from the
                                      # committed runs' paired spreads (no training, seconds)
    python studies/power.py design    # the timed prototype (seed 0's warm-up, one run per arm, two at
                                      # a time), then the design and its projection: figures/power.json
    python studies/power.py figures   # make figures-power: the warm-ups and runs of seeds 100-129
                                      # (resumable, two at a time), then every contrast and its plot
    python studies/power.py exact     # after the runs: each contrast's exact sign-flip p beside the
                                      # design's estimate, and Holm's verdict on the exact values
    python studies/power.py redraw    # figures/power.png from figures/power.json (seconds)

The question: GSPO fell behind GRPO when pi_old came from a bf16 sampler's record, on add2 at five
seeds, under a rule that calls only effects of about 0.2 in test accuracy. Is that the record's cost
to GSPO, its cost to any objective, or the paper's band being narrower than what helps on 3-4-token
answers? Eleven arms (ARMS), each run at every seed from that seed's own warm-up with the same RL
seed, so that any two arms are paired seed by seed; nine primary contrasts, corrected together by
Holm's step-down, and five secondary ones, uncorrected and labelled so (CONTRASTS).

The analysis, fixed and tested before any run:
  * each contrast is a per-seed sum of signed test accuracies (c - a16; an interaction such as
    (c - a16) - (d - b16) is a difference of two such differences, seed by seed);
  * its test is a paired sign-flip permutation test of the mean difference (exact up to 2^16 sign
    patterns, else 10,000 random flips from a fixed seed), robust to the heavy tails that collapsed
    runs give; its interval a bootstrap 95% interval of the mean over seeds (`exact`, added after
    the runs, gives every contrast's p over all 2^30 patterns beside the design's estimate);
  * the detectable effect at 80% power of a paired test at n seeds, for a paired spread sd:
    (z(1 - alpha/2) + z(0.8)) sd / sqrt(n), at alpha = 0.05 and, for the strictest Holm step, 0.05/9,
    each contrast's sd read from the committed runs nearest to it (PROXIES) before any new run;
  * a run that stops non-finite keeps no test accuracy of its final model (summary.json holds null):
    `score_run` scores it 0, the floor of what its arm can reach, and counts it apart; a collapsed
    run is scored as measured.
"""
from __future__ import annotations

import json
import math
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))   # gspo_minimal, studies

from studies.common import (Ledger, Parser, cli, exact_sign_flip_p, fail, paired_differences,  # noqa: E402
                            read_json, rewrite_json, run_jobs, script_job, write_json, write_result)

OUTPUTS = ("figures/power.json", "figures/power.png")
POWER_PNG = "figures/power.png"
ALPHA, POWER = 0.05, 0.8
EXACT_UP_TO = 16                        # seeds: up to 2^16 sign patterns are enumerated
FLIPS = 10_000
SEED = 20261206                         # the permutation and bootstrap streams' seed, fixed


def score_run(summary: dict) -> tuple[float, bool]:
    """(test accuracy after RL to score, whether the run stopped non-finite): a stopped run scores 0."""
    after = summary.get("accuracy_after_rl")
    return (0.0, True) if after is None else (float(after), False)


def sign_flip_p(diffs: list[float], flips: int = FLIPS, seed: int = SEED) -> float:
    """Two-sided p of the mean paired difference under the null that each seed's sign is a fair coin:
    the share of sign patterns whose |sum| reaches the observed one (every pattern when there are at
    most 2^EXACT_UP_TO, else `flips` random ones and the observed, as a permutation p counts it). The
    design's test: `exact_sign_flip_p` off any grid, enumerating up to EXACT_UP_TO differences."""
    return exact_sign_flip_p(diffs, None, flips, seed, enumerate_up_to=EXACT_UP_TO)[0]


def bootstrap_mean_interval(diffs: list[float], n_boot: int = 10_000, seed: int = SEED, level: float = 0.95) -> list[float]:
    """A percentile interval of the mean paired difference, seeds resampled with replacement."""
    import numpy as np
    d = np.asarray(diffs, dtype=np.float64)
    means = d[np.random.default_rng(seed).integers(0, len(d), size=(n_boot, len(d)))].mean(1)
    return [float(np.quantile(means, (1 - level) / 2)), float(np.quantile(means, (1 + level) / 2))]


def holm_thresholds(pvalues: dict[str, float], alpha: float = ALPHA) -> dict[str, float]:
    """Each p's threshold in Holm's step-down: alpha / (m - k + 1) for the k-th smallest (ties in the
    given order)."""
    order = sorted(pvalues, key=pvalues.get)
    return {name: alpha / (len(order) - k) for k, name in enumerate(order)}


def holm(pvalues: dict[str, float], alpha: float = ALPHA) -> dict[str, bool]:
    """Holm's step-down: sorted p_(1) <= ... <= p_(m), call while p_(k) <= alpha / (m - k + 1), stop at
    the first that is not. Controls the family-wise error at alpha under any dependence."""
    called, going = {}, True
    for name, threshold in holm_thresholds(pvalues, alpha).items():
        going = going and pvalues[name] <= threshold
        called[name] = going
    return called


def contrast(diffs: list[float], flips: int = FLIPS) -> dict:
    """One contrast's paired differences (seed order) -> mean, bootstrap interval, signs and p."""
    return {"differences_by_seed": diffs, "mean_difference": statistics.fmean(diffs),
            "ci95": bootstrap_mean_interval(diffs), "positive": sum(d > 0 for d in diffs),
            "negative": sum(d < 0 for d in diffs), "p": sign_flip_p(diffs, flips)}


def analyse(primary: dict[str, list[float]], secondary: dict[str, list[float]], flips: int = FLIPS) -> dict:
    """Every contrast, called or not: the primary family Holm-corrected, the secondary uncorrected."""
    out = {name: {**contrast(d, flips), "family": "primary"} for name, d in primary.items()}
    for name, is_called in holm({n: v["p"] for n, v in out.items()}).items():
        out[name]["called"] = is_called
    for name, d in secondary.items():
        out[name] = {**contrast(d, flips), "family": "secondary, uncorrected", "called": None}
    return out


def normal_quantile(p: float) -> float:
    """The standard normal's quantile, by bisection on erf (no SciPy)."""
    lo, hi = -10.0, 10.0
    for _ in range(200):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if 0.5 * (1 + math.erf(mid / math.sqrt(2))) < p else (lo, mid)
    return (lo + hi) / 2


def detectable_effect(sd: float, n: int, alpha: float = ALPHA, power: float = POWER) -> float:
    """The mean paired difference a two-sided test at `alpha` finds with probability `power` at n
    seeds, for paired differences of standard deviation sd (the normal approximation)."""
    return (normal_quantile(1 - alpha / 2) + normal_quantile(power)) * sd / math.sqrt(n)


def committed_accuracies(path: str) -> dict:
    """(cell, loss) -> {seed: accuracy_after_rl} of a committed study's first-stream runs."""
    out: dict = {}
    for r in read_json(path)["runs"]:
        if r["rl_seed"] == r["seed"]:
            out.setdefault((r["cell"], r["loss"]), {})[r["seed"]] = r["accuracy_after_rl"]
    return out


def committed_paired_spreads(mech_json: str = "figures/mechanism.json") -> dict[str, float]:
    """The standard deviation over seeds of each committed mechanism cell's GSPO - GRPO differences
    (`effects` prints them beside the contrasts' own spreads, `proxy_spread`)."""
    acc = committed_accuracies(mech_json)
    seeds = sorted({s for by_seed in acc.values() for s in by_seed})
    return {cell: statistics.stdev(paired_differences(acc[cell, "gspo"], acc[cell, "grpo"], seeds))
            for cell in sorted({cell for cell, _ in acc})}


# ---------------------------------------------------------------------------------------------
# make figures-power: the arms, the contrasts, the design (written before any run), the runs
# ---------------------------------------------------------------------------------------------
POWER_JSON = "figures/power.json"
POWER_RUNS = "runs/power"
SEEDS = tuple(range(100, 130))          # fresh: seeds 0-4 produced the hypotheses and are not reused
PROTOTYPE_SEED = 0                      # the timed prototype's warm-up and RL seed (timings only)
BUDGET_SECONDS = 120 * 60
PROJECTION_MARGIN = 0.9                 # the projection must fit 90% of the budget, else seeds are dropped
LAST_STEPS = 20                         # the secondary outcome's window: mean rollout reward over these
CAL_JSON = "figures/mechanism_calibration.json"
BINS_JSON = "figures/mechanism_bins.json"
MAP_JSON, ENG_JSON = "figures/map.json", "figures/engine_map.json"
MECH_JSON, REM_JSON = "figures/mechanism.json", "figures/mechanism_remedy.json"
FSPO_Z = 1.96
FSPO_LENGTHS = (1, 2, 3, 4, 5, 6)        # add2's answers, end-of-answer token included

BF16 = ["--sampler-dtype", "bfloat16"]
RECORD = BF16 + ["--old-logprobs", "sampler"]
# name: (loss, what it is, flags); WIDE, FSPO, SYNTH and BINS stand for values `values_read` reads
ARMS = {
    "a32": ("gspo", "GSPO; the trainer samples in float32; the trainer's pi_old; the paper's band (the default)", []),
    "a16": ("gspo", "GSPO; a bf16 copy samples; the trainer's pi_old; the paper's band (TRL's and verl's default route)", BF16),
    "b16": ("grpo", "GRPO, as a16", BF16),
    "c": ("gspo", "GSPO; a bf16 copy samples; its record as pi_old; the paper's band", RECORD),
    "d": ("grpo", "GRPO, as c", RECORD),
    "e": ("gspo", "as a32, with the fixed widened band (make figures-engine's, about +-0.0121 on log s)", ["WIDE"]),
    "f": ("gspo", "as c, with the calibrated band, Z = 1.96", RECORD + ["--eps-engine", "1.96"]),
    "g": ("gspo", "as c, with FSPO's band", RECORD + ["FSPO"]),
    "j": ("gspo", "as a32, with FSPO's band", ["FSPO"]),
    "h": ("gspo", "as a32, with the homoscedastic synthetic record at the real record's K-hat and SIGMA-hat", ["SYNTH"]),
    "i": ("gspo", "as a32, with the heteroscedastic synthetic record (the real record's bins)", ["BINS"]),
}
# name: (family, terms {arm: sign}, the question it answers)
CONTRASTS = {
    "c - a16": ("primary", {"c": 1, "a16": -1}, "the record's cost to GSPO"),
    "d - b16": ("primary", {"d": 1, "b16": -1}, "the record's cost to GRPO"),
    "(c - a16) - (d - b16)": ("primary", {"c": 1, "a16": -1, "d": -1, "b16": 1}, "the part of the record's cost specific to GSPO"),
    "e - a32": ("primary", {"e": 1, "a32": -1}, "a wider band without any record"),
    "f - c": ("primary", {"f": 1, "c": -1}, "the calibrated band on the record"),
    "g - c": ("primary", {"g": 1, "c": -1}, "FSPO's band on the record"),
    "j - a32": ("primary", {"j": 1, "a32": -1}, "FSPO's band without a record"),
    "h - a32": ("primary", {"h": 1, "a32": -1}, "the homoscedastic synthetic record's cost to GSPO"),
    "i - a32": ("primary", {"i": 1, "a32": -1}, "the heteroscedastic synthetic record's cost to GSPO"),
    "f - a16": ("secondary", {"f": 1, "a16": -1}, "does the calibrated band reach the trainer's level"),
    "a16 - b16": ("secondary", {"a16": 1, "b16": -1}, "GSPO against GRPO on the default route"),
    "a16 - a32": ("secondary", {"a16": 1, "a32": -1}, "bf16 sampling alone"),
    "(h - a32) - (c - a16)": ("secondary", {"h": 1, "a32": -1, "c": -1, "a16": 1},
                              "does the homoscedastic synthetic record cost GSPO what the real one does"),
    "(i - a32) - (c - a16)": ("secondary", {"i": 1, "a32": -1, "c": -1, "a16": 1},
                              "does the heteroscedastic synthetic record cost GSPO what the real one does"),
}
EQUIVALENCE_ASKED = ("(h - a32) - (c - a16)", "(i - a32) - (c - a16)")
PRIMARY = [n for n, (family, _, _) in CONTRASTS.items() if family == "primary"]   # Holm's family

# Each contrast's paired spread before any run: the committed runs nearest to its arms, from the same
# warm-ups (make figures-map's, seeds 0-4) with the same RL seed, as (sign, (file, cell, loss)).
_A16, _B16 = (REM_JSON, "bf16_trainer", "gspo"), (ENG_JSON, "bf16_trainer", "grpo")
_C, _D = (MECH_JSON, "real_bf16", "gspo"), (MECH_JSON, "real_bf16", "grpo")
_A32, _H = (MAP_JSON, "base", "gspo"), (MECH_JSON, "synth_both", "gspo")
_F = (REM_JSON, "real_bf16_calibrated", "gspo")
PROXIES = {
    "c - a16": [(1, _C), (-1, _A16)],
    "d - b16": [(1, _D), (-1, _B16)],
    "(c - a16) - (d - b16)": [(1, _C), (-1, _A16), (-1, _D), (1, _B16)],
    "e - a32": [(1, (ENG_JSON, "wide_trainer", "gspo")), (-1, (ENG_JSON, "bf16_trainer", "gspo"))],
    "f - c": [(1, _F), (-1, _C)],
    "g - c": [(1, _F), (-1, _C)],
    "j - a32": [(1, (REM_JSON, "control_widen", "gspo")), (-1, _A16)],
    "h - a32": [(1, _H), (-1, _A32)],
    "i - a32": [(1, _H), (-1, _A32)],
    "f - a16": [(1, _F), (-1, _A16)],
    "a16 - b16": [(1, (ENG_JSON, "bf16_trainer", "gspo")), (-1, _B16)],
    "a16 - a32": [(1, _A16), (-1, _A32)],
    "(h - a32) - (c - a16)": [(1, _H), (-1, _A32), (-1, _C), (1, _A16)],
    "(i - a32) - (c - a16)": [(1, _H), (-1, _A32), (-1, _C), (1, _A16)],
}
PROXY_NOTE = ("each contrast's paired spread is the standard deviation over seeds of the same signed sum of "
              "committed runs nearest to its arms (proxies): g's band is near the calibrated band's (f), i "
              "has no committed run (h's stands), e and j have committed twins only on a bf16 sampler "
              "(wide_trainer, control_widen, against bf16_trainer). From 3 to 5 seeds each: an estimate of "
              "the spread, itself uncertain by a factor of about 1.5 either way")
FSPO_RULE = ("C, which the paper's abstracts do not give and whose method section was not read here: C = Z "
             "SIGMA-hat, Z = 1.96, SIGMA-hat the bf16 record's per-token spread of log(pi_trainer / record) at "
             "make figures-map's warm-ups of seeds 0-2 (mechanism_calibration.json: add2.sigma_hat). FSPO "
             "motivates its band by S being near Gaussian with a variance that grows as L; at this C about 95% "
             "of the S the record's noise alone gives lies inside the band at every length, as the calibrated "
             "band's Z = 1.96 holds. Symmetric, centred on 0 (v3's abstract names no drift). Ours, fixed before "
             "the runs")
SYNTH_RULE = ("both synthetic records fitted on the real bf16 record of make figures-map's warm-ups of seeds "
              "0-2, pooled over their tokens (chosen before the runs: the study's own warm-ups, seeds 100-129, "
              "are not read before them): h at mechanism_calibration.json's K-hat and SIGMA-hat (the values "
              "make figures-mechanism's synth_both ran at), i at mechanism_bins.json's bins")
TEST_RULE = ("each contrast: the paired differences over seeds (an interaction: the difference of two "
             "contrasts' differences, seed by seed); a two-sided sign-flip permutation test of their mean "
             f"(exact up to 2^{EXACT_UP_TO} patterns, else {FLIPS:,} random flips, seed {SEED}); a bootstrap "
             "95% percentile interval of the mean (10,000 resamples of seeds). The primary family is corrected "
             "by Holm's step-down at 0.05 and a contrast is called when Holm rejects it; the secondary "
             "contrasts are reported uncorrected, labelled so, and never called")
SCORE_RULE = ("a run that stops non-finite (summary.json: stop_reason set, accuracy_after_rl null) scores 0 "
              "test accuracy, the floor of what its arm can reach, and is counted apart in its arm; its "
              f"reward_last_{LAST_STEPS} is the mean over the last {LAST_STEPS} of the steps it logged, 0 "
              "when it stopped at step 1; a collapsed run is scored as measured. A run or warm-up that fails "
              "otherwise (no summary.json) stops the target, which resumes once the cause is fixed: the "
              "analysis reads only seeds every arm finished")
EQUIVALENCE_NOTE = ("an equivalence test (two one-sided tests at 0.05) with 80% power at a true difference of "
                    "0 needs a margin of (z(0.95) + z(0.9)) sd / sqrt(n); at 30 seeds and the proxies' spread "
                    "that margin is too wide to mean much beside the effects in question, so the study "
                    "claims no equivalence: it reports each interval and the largest effect it leaves in")


def signed_sum(terms: dict[str, int], acc: dict[str, dict[int, float]], seeds) -> list[float]:
    """Per seed, sum of sign x accuracy over a contrast's arms: the contrast's paired differences."""
    return [sum(sign * acc[arm][seed] for arm, sign in terms.items()) for seed in seeds]


def proxy_spread(name: str, cache: dict | None = None) -> dict:
    """A contrast's paired spread from its PROXIES: the seeds all terms share, their signed sums and sd."""
    cache = {} if cache is None else cache
    series = []
    for sign, (path, cell, loss) in PROXIES[name]:
        if path not in cache:
            cache[path] = committed_accuracies(path)
        series.append((sign, cache[path][(cell, loss)]))
    seeds = sorted(set.intersection(*(set(acc) for _, acc in series)))
    diffs = [sum(sign * acc[s] for sign, acc in series) for s in seeds]
    return {"seeds": seeds, "differences": diffs, "sd": statistics.stdev(diffs),
            "from": [f"{sign:+d} {path}: {cell} {loss}" for sign, (path, cell, loss) in PROXIES[name]]}


def design_effects(n: int) -> dict:
    """Per contrast: the proxy spread and the detectable effect at 80% power at n seeds (uncorrected;
    for the primary family also at Holm's strictest step, 0.05/9); for the interactions the
    equivalence margin a test at n seeds would need (EQUIVALENCE_NOTE)."""
    cache: dict = {}
    out = {}
    for name, (family, _, _) in CONTRASTS.items():
        p = proxy_spread(name, cache)
        row = {"proxy": p, "detectable_uncorrected": detectable_effect(p["sd"], n)}
        if family == "primary":
            row["detectable_at_holms_strictest_step"] = detectable_effect(p["sd"], n, ALPHA / len(PRIMARY))
        if name in EQUIVALENCE_ASKED:
            row["equivalence_margin_needed"] = (normal_quantile(1 - ALPHA) + normal_quantile(1 - (1 - POWER) / 2)) * p["sd"] / math.sqrt(n)
        out[name] = row
    return out


def pooled_effect(effects: dict, n: int) -> dict:
    """One spread for the simple contrasts (two arms each): the root mean square of their proxies'
    spreads, each from 3 to 5 seeds; and its detectable effect at n seeds, uncorrected and at Holm's
    strictest step. A steadier figure than any one proxy's."""
    simple = [n_ for n_, (_, terms, _) in CONTRASTS.items() if len(terms) == 2]
    sd = math.sqrt(statistics.fmean(effects[c]["proxy"]["sd"] ** 2 for c in simple))
    return {"contrasts": simple, "sd": sd, "detectable_uncorrected": detectable_effect(sd, n),
            "detectable_at_holms_strictest_step": detectable_effect(sd, n, ALPHA / len(PRIMARY))}


def values_read() -> dict:
    """The numbers the arms' flags take from committed files, read before the runs."""
    from studies import engine
    cal, bins = read_json(CAL_JSON)["add2"], read_json(BINS_JSON)
    band = engine.widened_band()
    c = FSPO_Z * cal["sigma_hat"]
    return {"k_hat": cal["k_hat"], "sigma_hat": cal["sigma_hat"], "from": f"{CAL_JSON}: add2.k_hat, add2.sigma_hat",
            "record_bins": bins["heteroscedastic"]["flag"], "record_bins_from": f"{BINS_JSON}: heteroscedastic.flag",
            "widened_band": band, "fspo_c": c, "fspo_rule": FSPO_RULE, "synthetic_records": SYNTH_RULE}


def arm_flags(arm: str, values: dict) -> list[str]:
    """An arm's flags for the lab, its placeholders filled from `values` (`values_read`)."""
    fill = {"WIDE": ["--eps-low", f"{values['widened_band']['eps_low']:.6g}", "--eps-high",
                     f"{values['widened_band']['eps_high']:.6g}"],
            "FSPO": ["--fspo-band", f"{values['fspo_c']:.6g}"],
            "SYNTH": ["--record-noise", f"{values['k_hat']:.6g},{values['sigma_hat']:.6g}"],
            "BINS": ["--record-bins", values["record_bins"]]}
    return [x for f in ARMS[arm][2] for x in fill.get(f, [f])]


def fspo_widths(values: dict) -> dict:
    """FSPO's band on log s at add2's lengths beside the paper's, the fixed widened band and the
    calibrated band at the calibration's K-hat and SIGMA-hat; where it sits among the |log s| quantiles
    make figures-map measured by minibatch (medians over seeds, GSPO's runs); add2's lengths."""
    c, k, sigma = values["fspo_c"], values["k_hat"], values["sigma_hat"]
    paper = [math.log1p(-3e-4), math.log1p(4e-4)]
    rows = [{"length": n, "fspo": [-c / math.sqrt(n), c / math.sqrt(n)], "paper": paper,
             "widened": [math.log1p(-values["widened_band"]["eps_low"]), math.log1p(values["widened_band"]["eps_high"])],
             "calibrated_at_the_calibrations_values": [paper[0] - k - 1.96 * sigma / math.sqrt(n), paper[1] - k + 1.96 * sigma / math.sqrt(n)]}
            for n in FSPO_LENGTHS]
    quantiles = {}
    for r in read_json(MAP_JSON)["runs"]:
        if r["loss"] == "gspo" and r["rl_seed"] == r["seed"] and r["cell"] in ("base", "bf16_sampler"):
            quantiles.setdefault(r["cell"], []).append(r["abs_log_s_by_minibatch"])
    by_cell = {cell: [[statistics.median(run[mb][q] for run in runs) for q in range(3)] for mb in range(len(runs[0]))]
               for cell, runs in quantiles.items()}
    lengths = {r["length"]: r["responses"] for r in read_json(BINS_JSON)["heteroscedastic"]["by_length"]}
    return {"by_length": rows, "upper_edge_equals_the_papers_at_length": (c / math.log1p(4e-4)) ** 2,
            "abs_log_s_p50_p90_p99_by_minibatch": by_cell,
            "abs_log_s_from": f"{MAP_JSON}: runs' abs_log_s_by_minibatch, GSPO, cells base (a32's settings) "
                              "and bf16_sampler (c's), the median over seeds of each step-median quantile",
            "add2_responses_by_length": lengths,
            "add2_lengths_from": f"{BINS_JSON}: heteroscedastic.by_length (the bf16 record at warm-ups 0-2)"}


def static_design() -> dict:
    """Everything the runs are held to but the seeds kept (which wait for the prototype)."""
    from studies import engine
    from studies import map as regimes
    values = values_read()
    return {"task": "add2", "model": "dense", "steps": engine.em_steps("dense"), "seeds_planned": list(SEEDS),
            "warmups": "make figures-map's dense warm-up of each seed (runs/map/warmup_dense_s<seed>: python "
                       "studies/map.py _warmup dense SEED), made where missing; every arm of a seed starts from "
                       "it with --seed SEED: paired",
            "arms": {a: {"loss": loss, "what": what, "flags": arm_flags(a, values),
                         "sampler": "bfloat16" if "--sampler-dtype" in flags else "float32"}
                     for a, (loss, what, flags) in ARMS.items()},
            "contrasts": {n: {"family": f, "terms": t, "question": q} for n, (f, t, q) in CONTRASTS.items()},
            "primary_family": PRIMARY,
            "correction": f"Holm's step-down over the {len(PRIMARY)} primary contrasts at {ALPHA}", "test": TEST_RULE,
            "missing_data_rule": SCORE_RULE, "collapse": regimes.COLLAPSE,
            "outcomes": {"primary": "accuracy_after_rl (test set, the final model)",
                         "secondary": [f"reward_last_{LAST_STEPS}: the mean rollout reward over the last {LAST_STEPS} RL steps",
                                       "collapsed (the map's definition, `collapse`)",
                                       "clip shares by sign of A at minibatch 1 and later (mechanism.by_sign; with the "
                                       "trainer's pi_old minibatch 1 cannot clip, s = 1 there)"]},
            "values_read": values, "fspo_widths": fspo_widths(values),
            "equivalence": EQUIVALENCE_NOTE, "proxies": PROXY_NOTE,
            "budget_seconds": BUDGET_SECONDS, "projection_margin": PROJECTION_MARGIN, "workers": 2, "threads_per_run": 1,
            "analysis": "studies/power.py: score_run, signed_sum, analyse (sign_flip_p, bootstrap_mean_interval, holm)"}


def run_name(arm: str, seed: int) -> str:
    return f"{arm}_s{seed}"


def arm_jobs(design: dict, seeds, folder: str = POWER_RUNS) -> list[dict]:
    """Each seed's warm-up, then its arms' runs (seed by seed, so a stopped target leaves whole seeds)."""
    from studies import map as regimes
    jobs = []
    for seed in seeds:
        warm = regimes.warmup_job("dense", seed)
        ckpt = os.path.join(os.path.dirname(warm["done"]), "checkpoint")
        jobs.append(warm)
        for arm, a in design["arms"].items():
            args = ["--model", ckpt, "--warmup-max-steps", "0", "--seed", str(seed), "--loss", a["loss"], *a["flags"]]
            jobs.append({**script_job(run_name(arm, seed), args, folder, design["steps"], needs=warm["done"]),
                         "non_finite_is_a_result": True})
    return jobs


def prototype(design: dict, runs_folder: str = POWER_RUNS) -> dict:
    """Seed PROTOTYPE_SEED's warm-up (kept where made), then one fresh run of every arm from it, two
    at a time as the target runs them: each run's seconds under that load, and the wall clock of the
    whole (process start-up and the last run's lone minutes included), in <runs_folder>/prototype."""
    import shutil
    import time
    from studies import map as regimes
    folder = os.path.join(runs_folder, "prototype")
    jobs = arm_jobs(design, [PROTOTYPE_SEED], folder)
    warm, runs = jobs[0], jobs[1:]
    timing = os.path.join(folder, "warmup_timing")     # a warm-up of the same seed made here, to time it
    timed_warm = {**warm, "name": "warmup_timing", "done": os.path.join(timing, "summary.json"),
                  "cmd": warm["cmd"][:-1] + [timing], "argv": warm["argv"][:-1] + [timing]}
    for job in [timed_warm] + runs:                    # timed afresh, never kept from an earlier prototype
        shutil.rmtree(os.path.dirname(job["done"]), ignore_errors=True)
    run_jobs([warm, timed_warm], folder, workers=1)
    t0 = time.perf_counter()
    run_jobs(runs, folder, workers=2)
    elapsed = time.perf_counter() - t0
    return {"seed": PROTOTYPE_SEED, "what": "timings only: the runs' accuracies are not read",
            "warmup_seconds": read_json(timed_warm["done"])["wall_seconds"],
            "warmup_from": f"{timing}: a warm-up of seed {PROTOTYPE_SEED} made by the prototype, alone (the runs "
                           f"start from {regimes.warm_path('dense', PROTOTYPE_SEED)}, made where missing)",
            "runs": {job["name"]: {"command": " ".join(job["cmd"][1:]), "wall_seconds": read_json(job["done"])["wall_seconds"]}
                     for job in runs},
            "two_at_a_time_seconds": elapsed}


def projection(proto: dict, n_arms: int) -> dict:
    """The target's seconds at n seeds: per seed, half a warm-up (it runs beside an arm) and the
    prototype's wall clock for every arm two at a time; and the most seeds (of 30) that fit
    PROJECTION_MARGIN of the budget."""
    per_seed = proto["warmup_seconds"] / 2 + proto["two_at_a_time_seconds"]
    kept = max(n for n in range(0, len(SEEDS) + 1) if n * per_seed <= PROJECTION_MARGIN * BUDGET_SECONDS)
    return {"seconds_per_seed": per_seed, "seconds_at_30_seeds": per_seed * len(SEEDS), "seeds_kept": kept,
            "seconds_at_seeds_kept": per_seed * kept, "runs_at_seeds_kept": kept * n_arms,
            "from": "prototype: half its warm-up's seconds and the wall clock of its eleven runs two at a time "
                    "(two_at_a_time_seconds; the sum of their own seconds, halved, is less: it leaves out "
                    "each process's start-up and the last run's lone minutes)"}


def write_design() -> dict:
    """power.json before any run: the timed prototype, the projection, the design with the seeds it
    keeps and the detectable effect at those seeds. A file holding this design is kept as it stands;
    one holding another is never overwritten."""
    static = static_design()
    if os.path.exists(POWER_JSON):
        old = read_json(POWER_JSON)
        if {k: v for k, v in old["design"].items() if k not in ("seeds", "detectable_effect")} != json.loads(json.dumps(static, allow_nan=False)):
            fail(f"{POWER_JSON} holds another design than the code's; move it away to write this one")
        return old
    import time
    t0 = time.perf_counter()
    proto = prototype(static)
    proj = projection(proto, len(ARMS))
    if proj["seeds_kept"] < 2:
        fail(f"{proj['seconds_per_seed'] / 60:.0f} min a seed: not two seeds in the budget")
    n = proj["seeds_kept"]
    effects = design_effects(n)
    design = {**static, "seeds": list(SEEDS[:n]),
              "detectable_effect": {"seeds": n, "by_contrast": effects, "pooled": pooled_effect(effects, n)}}
    record = {"figures_power_seconds": 0.0, "design": design, "prototype": proto, "projection": proj,
              "runs": [], "arms": {}, "contrasts": {}}
    write_json(POWER_JSON, record, "python studies/power.py design", time.perf_counter() - t0)
    return record


def run_record(arm: str, seed: int, folder: str = POWER_RUNS) -> dict:
    """A run's record: the map's basics (accuracies, collapse, clip shares), its score under
    SCORE_RULE, the mean reward over its last LAST_STEPS steps and its clip shares by sign of A."""
    from studies import map as regimes
    from studies.mechanism import by_sign
    rec, rl = regimes.run_basics(run_name(arm, seed), folder, regimes.warm_path("dense", seed))
    score, stopped = score_run(rec)
    rec.update({"arm": arm, "seed": seed, "rl_seed": seed, "score": score, "stopped_non_finite": stopped,
                f"reward_last_{LAST_STEPS}": statistics.fmean(r["reward"] for r in rl[-LAST_STEPS:]) if rl else None,
                **by_sign(rl)})
    return rec


def collect(design: dict, folder: str = POWER_RUNS) -> list[dict]:
    """The records of every finished run of the design's arms and seeds."""
    return [run_record(arm, seed, folder) for seed in design["seeds"] for arm in design["arms"]
            if os.path.exists(os.path.join(folder, run_name(arm, seed), "summary.json"))]


def complete_seeds(design: dict, runs: list[dict]) -> list[int]:
    have = {(r["arm"], r["seed"]) for r in runs}
    return [s for s in design["seeds"] if all((a, s) in have for a in design["arms"])]


def median_or_none(values: list) -> float | None:
    """The median of the values that are not None (a key some runs did not log); None if none are."""
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def analysis(design: dict, runs: list[dict], flips: int = FLIPS) -> tuple[dict, dict]:
    """(per arm, per contrast) from the runs, over the seeds every arm finished: the contrasts by
    `analyse` on the scores, each with a verdict, the reward's paired difference beside it and, where
    equivalence was asked, the largest effect its interval leaves in; per arm the scores' median,
    collapses, non-finite stops and the secondary outcomes' medians."""
    seeds = complete_seeds(design, runs)
    by = {(r["arm"], r["seed"]): r for r in runs}
    score = {a: {s: by[a, s]["score"] for s in seeds} for a in design["arms"]}
    reward = {a: {s: by[a, s][f"reward_last_{LAST_STEPS}"] or 0.0 for s in seeds} for a in design["arms"]}
    fam = {n: c["family"] for n, c in design["contrasts"].items()}
    diffs = {n: signed_sum(c["terms"], score, seeds) for n, c in design["contrasts"].items()}
    out = analyse({n: d for n, d in diffs.items() if fam[n] == "primary"},
                  {n: d for n, d in diffs.items() if fam[n] != "primary"}, flips)
    for n, v in out.items():
        v["seeds"] = seeds
        v["question"] = design["contrasts"][n]["question"]
        sign = "positive" if v["mean_difference"] > 0 else "negative"
        v["verdict"] = ("called, " + sign if v["called"] else "not called") if fam[n] == "primary" else \
            f"secondary, uncorrected p = {v['p']:.3g}: not called"
        r = signed_sum(design["contrasts"][n]["terms"], reward, seeds)
        v[f"reward_last_{LAST_STEPS}"] = {"mean_difference": statistics.fmean(r), "ci95": bootstrap_mean_interval(r)}
        if n in EQUIVALENCE_ASKED:
            v["largest_effect_not_excluded"] = max(abs(x) for x in v["ci95"])
    arms = {}
    for a in design["arms"]:
        mine = [by[a, s] for s in seeds]
        med = lambda key: median_or_none([x.get(key) for x in mine])
        arms[a] = {"seeds": len(mine), "score_median": med("score"), "score_mean": statistics.fmean(x["score"] for x in mine),
                   "collapsed": sum(x["collapsed"] for x in mine), "stopped_non_finite": sum(x["stopped_non_finite"] for x in mine),
                   f"reward_last_{LAST_STEPS}_median": med(f"reward_last_{LAST_STEPS}"),
                   **{k + "_median": med(k) for k in ("clip_seqs_pos_adv_minibatch_1", "clip_seqs_neg_adv_minibatch_1",
                                                       "clip_seqs_pos_adv_later", "clip_seqs_neg_adv_later")}}
    return arms, out


def figures_power() -> dict:
    """The design (it must have been written: `python studies/power.py design`), every seed's warm-up
    and arms (resumable), then every contrast."""
    if not os.path.exists(POWER_JSON):
        fail(f"make figures-power runs the design in {POWER_JSON}: write it first with `python studies/power.py design`")
    record = write_design()
    record.setdefault("design_written", {k: record.get(k) for k in ("command", "seconds", "measured_at_commit",
                                                                  "dirty", "dirty_paths")})   # kept past the runs' own
    d = record["design"]
    ledger = Ledger(os.path.join(POWER_RUNS, "figures_seconds.json"))
    try:
        run_jobs(arm_jobs(d, d["seeds"]), POWER_RUNS)
    finally:
        ledger.close()
    record["runs"] = collect(d)
    record["arms"], record["contrasts"] = analysis(d, record["runs"])
    record["figures_power_seconds"] = ledger.total()
    return record


# ---------------------------------------------------------------------------------------------
# After the runs: the exact p of every contrast, beside the design's Monte Carlo estimate
# ---------------------------------------------------------------------------------------------
EXACT_COMMAND = "python studies/power.py exact"


def test_size_of(runs: list[dict]) -> int:
    """The number of test problems every run was scored on (its --test-size, else the lab's default):
    each score is a multiple of 1/that, and so is each contrast's difference."""
    import gspo_lab as lab
    sizes = set()
    for r in runs:
        words = r["command"].split()
        sizes.add(int(words[words.index("--test-size") + 1]) if "--test-size" in words else lab.Config().test_size)
    if len(sizes) != 1:
        fail(f"the runs were scored on test sets of {sorted(sizes)} problems: no one grid for the exact p")
    return sizes.pop()


def add_exact(record: dict, path: str = POWER_JSON, command: str = EXACT_COMMAND) -> dict:
    """record with each contrast's `p_exact` and `p_exact_method` (exact_sign_flip_p on its
    differences, the grid 1/test size read from the runs), the primary family's `called_exact` from
    Holm's step-down on the exact values and `holm_threshold_exact` (alpha over the contrasts left at
    its step), and `exact_p`: this pass's provenance. The design, `p`, `called` and `verdict` stay as
    the runs' analysis wrote them."""
    import gspo_minimal as g
    import time
    t0 = time.perf_counter()
    contrasts = record["contrasts"]
    grid = test_size_of([r for r in record["runs"] if r["seed"] in next(iter(contrasts.values()))["seeds"]])
    for v in contrasts.values():
        v["p_exact"], v["p_exact_method"] = exact_sign_flip_p(v["differences_by_seed"], grid, FLIPS, SEED)
    primary = {n: v["p_exact"] for n, v in contrasts.items() if v["family"] == "primary"}
    thresholds = holm_thresholds(primary)
    for n, is_called in holm(primary).items():
        contrasts[n]["called_exact"] = is_called
        contrasts[n]["holm_threshold_exact"] = thresholds[n]
    for v in contrasts.values():
        v.setdefault("called_exact", None)
    record["exact_p"] = {**g.provenance(command, time.perf_counter() - t0, g.tree_state([path])),
                         "grid": f"1/{grid}: every run scored on {grid} test problems",
                         "when": "after the runs: the design fixed 10,000 random flips (p, called); p_exact and "
                                 "called_exact are computed from the same differences by `exact`"}
    return record


POWER_TITLE = "The record or the band: add2, 70 RL steps, seeds 100-129, design fixed before the runs (make figures-power)"


def plot_power(record: dict, path: str = POWER_PNG, title: str = POWER_TITLE) -> None:
    """Left, each arm's test accuracy after RL, one dot per seed (x: a collapsed run), its median a
    bar; right, each contrast's mean paired difference with its bootstrap 95% interval, the primary
    family above the secondary, a filled marker where Holm called it, its sign count beside it."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np
    d, runs, contrasts = record["design"], record["runs"], record["contrasts"]
    seeds = set(next(iter(contrasts.values()))["seeds"]) if contrasts else set()
    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 6.5), gridspec_kw={"width_ratios": [1, 1.25]})
    arms = list(d["arms"])
    jitter = np.random.default_rng(0)
    for y, arm in enumerate(arms):
        mine = [r for r in runs if r["arm"] == arm and r["seed"] in seeds]
        for collapsed in (False, True):
            xs = [r["score"] for r in mine if r["collapsed"] == collapsed]
            left.scatter(xs, y + jitter.uniform(-0.18, 0.18, len(xs)), s=14, alpha=0.6,
                         marker="x" if collapsed else "o", color="C3" if collapsed else "C0")
        if mine:
            left.plot([statistics.median(r["score"] for r in mine)] * 2, [y - 0.32, y + 0.32], color="k", lw=2)
    left.set_yticks(range(len(arms)), [f"{a}: {d['arms'][a]['loss']}" for a in arms])
    left.invert_yaxis()
    left.set_xlabel("test accuracy after RL (one dot per seed; x: collapsed; bar: median)")
    left.set_title(f"the arms, {len(seeds)} paired seeds", fontsize=10)
    names = list(contrasts)
    for y, name in enumerate(names):
        v = contrasts[name]
        primary = v["family"] == "primary"
        lo, hi = v["ci95"]
        color = "C0" if primary else "0.5"
        right.plot([lo, hi], [y, y], color=color, lw=2)
        right.plot([v["mean_difference"]], [y], "o", color=color, mfc=color if v["called"] else "white", ms=7)
        exact = f", exact {v['p_exact']:.2g}" if "p_exact" in v else ""
        right.annotate(f"{v['positive']}+ {v['negative']}-  p {v['p']:.2g}{exact}", (1.01, y),
                       xycoords=("axes fraction", "data"), va="center", fontsize=8)
    right.axvline(0, color="k", lw=0.8)
    right.set_yticks(range(len(names)), [n + ("" if contrasts[n]["family"] == "primary" else " (2nd)") for n in names])
    right.invert_yaxis()
    right.set_xlabel("mean paired difference in test accuracy, bootstrap 95% interval")
    right.set_title("the contrasts (filled: called under Holm; grey: secondary, uncorrected)", fontsize=10)
    fig.suptitle(title, fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


@cli
def main(argv=None) -> int:
    parser = Parser(description=__doc__.splitlines()[0])
    parser.add_argument("what", choices=["effects", "design", "figures", "exact", "redraw"])
    what = parser.parse_args(argv).what
    if what == "effects":
        spreads = committed_paired_spreads()
        sd = statistics.median(spreads.values())
        print("paired spread of GSPO - GRPO by mechanism cell, 5 seeds: "
              + ", ".join(f"{c} {v:.3f}" for c, v in spreads.items()) + f"; median {sd:.3f}")
        for name, row in design_effects(len(SEEDS)).items():
            holm_step = row.get("detectable_at_holms_strictest_step")
            print(f"{name:24s} proxy sd {row['proxy']['sd']:.3f} ({len(row['proxy']['seeds'])} seeds): detectable at "
                  f"30 seeds {row['detectable_uncorrected']:.3f}" + (f", {holm_step:.3f} at Holm's strictest step" if holm_step else ""))
        pooled = pooled_effect(design_effects(len(SEEDS)), len(SEEDS))
        print(f"pooled over the simple contrasts: sd {pooled['sd']:.3f}, detectable at 30 seeds "
              f"{pooled['detectable_uncorrected']:.3f}, {pooled['detectable_at_holms_strictest_step']:.3f} at Holm's strictest step")
        return 0
    if what == "exact":
        record = read_json(POWER_JSON)
        if not record["runs"]:
            fail(f"{POWER_JSON} holds no runs yet: make figures-power first")
        rewrite_json(POWER_JSON, add_exact(record))
        plot_power(record)
        for name, v in record["contrasts"].items():
            edge = f" (Holm's step {v['holm_threshold_exact']:.3g})" if v["family"] == "primary" else ""
            print(f"{name:24s} p {v['p']:.4g}, exact {v['p_exact']:.6g}{edge} | design: {v['called']}, "
                  f"exact: {v['called_exact']}")
        print(POWER_JSON, POWER_PNG)
        return 0
    if what == "redraw":
        plot_power(read_json(POWER_JSON))
        print(POWER_PNG)
        return 0
    from transformers.utils import logging as hf_logging
    hf_logging.disable_progress_bar()
    if what == "design":
        record = write_design()
        p = record["projection"]
        print(f"{POWER_JSON}: {len(record['design']['arms'])} arms x {p['seeds_kept']} seeds, projected "
              f"{p['seconds_at_seeds_kept'] / 60:.0f} min of {BUDGET_SECONDS // 60} (30 seeds: {p['seconds_at_30_seeds'] / 60:.0f} min)")
        return 0
    record = figures_power()
    write_result(POWER_JSON, record, "python studies/power.py figures", record["figures_power_seconds"])
    plot_power(record)
    for name, v in record["contrasts"].items():
        lo, hi = v["ci95"]
        print(f"{name:24s} {v['mean_difference']:+.3f} [{lo:+.3f}, {hi:+.3f}] {v['positive']}+ {v['negative']}- "
              f"p {v['p']:.3g} | {v['verdict']}")
    print(POWER_JSON, POWER_PNG)
    return 0


if __name__ == "__main__":
    sys.exit(main())

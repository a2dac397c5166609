"""The record or the band? The analysis of a paired study at 30 seeds, before its runs exist.

    python studies/power.py effects   # the detectable effect at 80% power of each contrast, from the
                                      # committed runs' paired spreads (no training, seconds)

The question it will serve: GSPO fell behind GRPO when pi_old came from a bf16 sampler's record, on
add2 at five seeds, under a rule that calls only effects of about 0.2 in test accuracy. A paired
study at 30 seeds can tell the record's cost to GSPO from its cost to GRPO, and both from what a
wider band does with no record at all. This file holds what that study's analysis needs, fixed and
tested before any of its runs:

  * each contrast is a per-seed difference of test accuracies between arms run from the same warm-up
    with the same RL seed (an interaction is a difference of two such differences, seed by seed);
  * its test is a paired sign-flip permutation test of the mean difference (exact up to 2^16 sign
    patterns, else 10,000 random flips from a fixed seed), robust to the heavy tails that collapsed
    runs give; its interval a bootstrap 95% interval of the mean over seeds;
  * the primary family is corrected by Holm's step-down procedure; secondary contrasts are
    uncorrected and labelled so;
  * the detectable effect at 80% power of a paired test at n seeds, for a paired spread sd:
    (z(1 - alpha/2) + z(0.8)) sd / sqrt(n), at alpha = 0.05 and, for the strictest Holm step, 0.05/m;
  * a run that stops non-finite keeps no test accuracy of its final model (summary.json holds null):
    the rule `score_run` applies is fixed here, before any run: it scores 0, the floor of what its
    arm can reach, and is counted apart; a collapsed run is scored as measured.

What is not here yet: the runs, their design in figures/power.json and the arms that need FSPO's
band (arXiv 2509.09177), whose method section this project has not read.
"""
from __future__ import annotations

import math
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))   # gspo_minimal, studies

from studies.common import Parser, cli, paired_differences, read_json  # noqa: E402

OUTPUTS: tuple[str, ...] = ()
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
    most 2^EXACT_UP_TO, else `flips` random ones and the observed, as a permutation p counts it)."""
    import numpy as np
    d = np.asarray(diffs, dtype=np.float64)
    n = len(d)
    observed = abs(d.sum()) - 1e-12 * max(1.0, np.abs(d).sum())     # ties count as extreme
    if n <= EXACT_UP_TO:
        signs = 1 - 2 * ((np.arange(2 ** n)[:, None] >> np.arange(n)) & 1)          # every pattern
        return float((np.abs(signs @ d) >= observed).mean())
    signs = np.random.default_rng(seed).choice([-1.0, 1.0], size=(flips, n))
    return float(((np.abs(signs @ d) >= observed).sum() + 1) / (flips + 1))


def bootstrap_mean_interval(diffs: list[float], n_boot: int = 10_000, seed: int = SEED, level: float = 0.95) -> list[float]:
    """A percentile interval of the mean paired difference, seeds resampled with replacement."""
    import numpy as np
    d = np.asarray(diffs, dtype=np.float64)
    means = d[np.random.default_rng(seed).integers(0, len(d), size=(n_boot, len(d)))].mean(1)
    return [float(np.quantile(means, (1 - level) / 2)), float(np.quantile(means, (1 + level) / 2))]


def holm(pvalues: dict[str, float], alpha: float = ALPHA) -> dict[str, bool]:
    """Holm's step-down: sorted p_(1) <= ... <= p_(m), call while p_(k) <= alpha / (m - k + 1), stop at
    the first that is not. Controls the family-wise error at alpha under any dependence."""
    order = sorted(pvalues, key=pvalues.get)
    called, going = {}, True
    for k, name in enumerate(order):
        going = going and pvalues[name] <= alpha / (len(order) - k)
        called[name] = going
    return called


def contrast(diffs: list[float], flips: int = FLIPS) -> dict:
    """One contrast's paired differences (seed order) -> mean, bootstrap interval, signs and p."""
    return {"differences_by_seed": diffs, "mean_difference": statistics.fmean(diffs),
            "ci95": bootstrap_mean_interval(diffs), "positive": sum(d > 0 for d in diffs),
            "negative": sum(d < 0 for d in diffs), "p": sign_flip_p(diffs, flips)}


def interaction(a: list[float], b: list[float]) -> list[float]:
    """(x - y) - (u - v) seed by seed, from two contrasts' paired differences in one seed order."""
    if len(a) != len(b):
        raise ValueError(f"an interaction pairs two contrasts seed by seed: {len(a)} and {len(b)} seeds")
    return [x - y for x, y in zip(a, b)]


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


def committed_paired_spreads(mech_json: str = "figures/mechanism.json") -> dict[str, float]:
    """The standard deviation over seeds of each committed mechanism cell's GSPO - GRPO differences:
    the paired spreads the study's detectable effects are computed from, before any of its runs."""
    mech = read_json(mech_json)
    acc: dict = {}
    for r in mech["runs"]:
        if r["rl_seed"] == r["seed"]:
            acc.setdefault(r["cell"], {}).setdefault(r["loss"], {})[r["seed"]] = r["accuracy_after_rl"]
    seeds = sorted({r["seed"] for r in mech["runs"]})
    return {cell: statistics.stdev(paired_differences(v["gspo"], v["grpo"], seeds)) for cell, v in sorted(acc.items())}


@cli
def main(argv=None) -> int:
    parser = Parser(description=__doc__.splitlines()[0])
    parser.add_argument("what", choices=["effects"])
    parser.parse_args(argv)
    spreads = committed_paired_spreads()
    sd = statistics.median(spreads.values())
    print("paired spread of GSPO - GRPO by mechanism cell, 5 seeds: "
          + ", ".join(f"{c} {v:.3f}" for c, v in spreads.items()) + f"; median {sd:.3f}")
    for n in (5, 30):
        print(f"{n} seeds: detectable at 80% power {detectable_effect(sd, n):.3f} uncorrected, "
              f"{detectable_effect(sd, n, ALPHA / 9):.3f} at Holm's strictest step of 9")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""make figures-frontier: where does each objective break? GSPO and GRPO on a ladder of ever harsher
updates, every comparison a pair from one warm-up, the test fixed and powered before the runs.

    python studies/frontier.py             # `make figures-frontier`: the first phase (resumable,
                                           # runs/frontier), figures/frontier.json and frontier.png
    python studies/frontier.py prototype   # the ladder tried on seeds no measured run uses (90, 91):
                                           # frontier_prototype.json, the shift each rule asks for
    python studies/frontier.py prototype --check   # the shifted ladder on seeds 92, 93 and the
                                           # warm-ups the budget allows: the same file's `check`
    python studies/frontier.py design      # the design into figures/frontier.json, no run
    python studies/frontier.py redraw      # frontier.png again from frontier.json

The GSPO paper's central claim is stability: token-level ratios make GRPO collapse where GSPO's
sequence ratio does not, above all off-policy and on mixture-of-experts models. Here the learning
rate climbs a ladder (1x, 1.5x, 2x and 3x `make train`'s at 4 minibatches; 1x, 1.5x and 2x at 8;
1x and 2x on the tiny MoE at 4), and from each warm-up one GSPO and one GRPO run start with the
same RL seed, so that every comparison is a pair. The primary test is one-sided, in the direction
the paper names (H1: GSPO collapses less often than GRPO): McNemar's exact test on the discordant
pairs pooled over all cells, confirmed by a permutation test that swaps the labels of a whole
warm-up at once. Per objective and minibatch setting the frontier is the multiplier at which a
penalised (Firth) logistic fit of collapse on log2(multiplier) crosses one half. Everything the
runs are held to is in `design()` and goes into frontier.json before the first run.
"""
from __future__ import annotations

import math
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))   # gspo_minimal, studies

import gspo_lab as g  # noqa: E402
from studies.common import (FIG_DIR, Ledger, Parser, cli, cluster_bootstrap, fail,  # noqa: E402
                            firth_logistic, kept_design, mcnemar_exact, paired_permutation_p, read_json,
                            read_summary, rewrite_json, run_jobs, script_job, sign_test,
                            smallest_significant_split, write_json, write_result)
from studies.map import COLLAPSE, is_collapsed, run_basics, warm_path, warmup_job  # noqa: E402

# The files this target writes into figures/ (left out of its dirty check).
OUTPUTS = ("figures/frontier.json", "figures/frontier.png", "figures/frontier_prototype.json")

FRONTIER_RUNS = "runs/frontier"
FRONTIER_JSON = os.path.join(FIG_DIR, "frontier.json")
PROTOTYPE_JSON = os.path.join(FIG_DIR, "frontier_prototype.json")
LR = g.Config().lr                 # make train's learning rate, 2e-4: the ladder's 1x
# The ladder: per setting, the model, the minibatches per rollout and the learning-rate multipliers.
LADDER = {"dense_mb4": {"model": "dense", "minibatches": 4, "multipliers": [1, 1.5, 2, 3]},
          "dense_mb8": {"model": "dense", "minibatches": 8, "multipliers": [1, 1.5, 2]},
          "moe_mb4": {"model": "moe", "minibatches": 4, "multipliers": [1, 2]}}
# The ladder's shift. The rule written before the first prototype looked at a setting as a whole
# (halve it if every run collapsed, double it if none did) and asked for none; the rule looks
# at each rung: the prototype (frontier_prototype.json) collapsed every run at 2x and 3x on 4
# minibatches and at 1.5x and 2x on 8, so each such setting is scaled until its lowest all-collapsed
# rung is its top (`rung_shift_of`, chosen after seeing the first prototype, and checked on new
# seeds by the second: `prototype --check`).
LADDER_SHIFT = {"dense_mb4": 2 / 3, "dense_mb8": 0.75}
STEPS = 40                         # RL steps, the learning rate decayed linearly to 0 over them
EVAL_AT = [2, 4]                   # with --eval-every 5: evaluations at 2, 4, 5, 10, ..., 40
EVAL_EVERY = 5
MIN_WARMUPS = 6
MAX_WARMUPS = 16
# Warm-ups per model (seeds 0..WARMUPS-1, make figures-map's own warm-ups where they exist): the
# most, MIN_WARMUPS to MAX_WARMUPS, whose projected first phase fits PROJECTION_MARGIN of the
# budget at the prototype's timings. Fixed at 10 from frontier_prototype.json's `check` (the shifted
# ladder's timings): the first phase projected at 58 min.
WARMUPS: int | None = 10
PROTOTYPE_SEEDS = (90, 91)         # two warm-ups per model that no measured run uses
CHECK_SEEDS = (92, 93)             # the shifted ladder's check, likewise
BUDGET_SECONDS = 75 * 60
PROJECTION_MARGIN = 0.85
ALPHA = 0.05
LOSSES = ("gspo", "grpo")
# The commit at which the design below and the analysis code (the_test, cell_summary, frontier_of)
# were written and committed, before any measured run (figures/frontier.json's design was written
# there, clean). Later commits refactored the code without changing what it computes, fixed the
# plot, and added the update-size summary (`update_size_reading` says when).
DESIGN_COMMIT = "254a1156e3d1d149d1efb8eebf5c613ca5a4ddf2"


def cells(shift: dict | None = None) -> dict:
    """Every cell of the ladder: name -> setting, model, minibatches, multiplier and the RL flags."""
    shift = LADDER_SHIFT if shift is None else shift
    out = {}
    for setting, rung in LADDER.items():
        for m in rung["multipliers"]:
            mult = round(m * shift.get(setting, 1), 3)
            out[f"{setting}_x{mult:g}"] = {"setting": setting, "model": rung["model"],
                                           "minibatches": rung["minibatches"], "multiplier": mult,
                                           "flags": ["--minibatches", str(rung["minibatches"]),
                                                     "--lr", f"{LR * mult:g}"]}
    return out


# ---------------------------------------------------------------------------------------------
# The design, fixed before any measured run
# ---------------------------------------------------------------------------------------------
COLLAPSED_AT = ("collapsed_at_step: the first evaluation step e such that the collapse definition, "
                "applied to the evaluations up to e (start included), holds at e and at every later "
                "evaluation; null when the run does not end collapsed")
TEST = ("H1 (one-sided, the direction the GSPO paper names): GSPO collapses less often than GRPO. "
        "Discordant pairs (one run of a pair collapsed, the other not) pooled over every cell; McNemar's "
        "exact one-sided test: p = P(X >= b), X ~ Binomial(b + c, 1/2), b the pairs in which only GRPO "
        "collapsed, c those in which only GSPO did. Called when p < 0.05. Confirmation: a permutation test "
        "whose unit is a warm-up (every pair from one warm-up, over all its cells, swapped together; "
        "statistic b - c; 10,000 permutations, seed 0), reported beside it. Per cell, descriptively: the "
        "paired differences of accuracy_after_rl (GSPO - GRPO), an exact two-sided sign test (ties "
        "dropped), and a 95% interval of their median from resampling warm-ups (2,000 resamples).")
FRONTIER = ("per objective and minibatch setting on the dense model: a Firth-penalised logistic fit of "
            "collapsed (0/1, every run) on log2(multiplier); the frontier is the multiplier where the "
            "fitted share is one half, 2^(-b0/b1), with the delta method's 95% interval mapped the same "
            "way; 'below <lowest>x' when every rung's observed share is at least one half, 'above "
            "<highest>x' when none reaches it. The MoE: the collapse share per rung only.")


def power(n_pairs: int, alpha: float = ALPHA) -> dict:
    """What the test can call with n discordant pairs: the fewest on GRPO's side it calls, and the
    chance of calling when a share theta of discordant pairs fall on GRPO's side."""
    k = smallest_significant_split(n_pairs, alpha)
    at = {f"{theta:g}": (None if k is None else sum(math.comb(n_pairs, i) * theta ** i * (1 - theta) ** (n_pairs - i)
                                                    for i in range(k, n_pairs + 1)))
          for theta in (0.6, 0.7, 0.8, 0.9)}
    return {"discordant_pairs": n_pairs, "smallest_significant_split": k, "power_if_grpo_share_is": at}


def expected_discordant(proto: dict, warmups: int) -> float:
    """The discordant pairs the design can expect: per cell, warmups x (p_gspo (1 - p_grpo) +
    p_grpo (1 - p_gspo)) with each objective's collapse share in the prototype's runs of that
    cell (two warm-ups: a plug-in of shares 0, 1/2 or 1, a rough guide, not a promise)."""
    total = 0.0
    for cell, c in proto["cells"].items():
        pg, pr = c["collapse_share"]["gspo"], c["collapse_share"]["grpo"]
        total += warmups * (pg * (1 - pr) + pr * (1 - pg))
    return total


def design(warmups: int | None = WARMUPS, proto: dict | None = None) -> dict:
    """Everything the measured run is held to, written into frontier.json before it starts."""
    d = {"ladder": LADDER, "ladder_shift": LADDER_SHIFT, "base_lr": LR,
         "ladder_shift_rule": "after the first prototype (chosen after seeing it): in each setting where some "
                              "rung collapsed every prototype run, the multipliers scaled so that the lowest such "
                              "rung is the top one; the rule written before it (halve a setting whose runs all "
                              "collapsed, double one where none did) asked for no shift; the shifted ladder "
                              "checked on seeds 92 and 93 (frontier_prototype.json's `check`)",
         "cells": cells(), "losses": list(LOSSES), "warmups_per_model": warmups,
         "warmup_seeds": None if warmups is None else list(range(warmups)),
         "rl_seed": "the warm-up's seed: GSPO and GRPO of a pair share the warm-up and the RL seed",
         "warmups": "make figures-map's (runs/map/warmup_<model>_s<seed>: the script's own warm-up, "
                    "--moe for the MoE), made there when missing",
         "steps": STEPS, "lr_schedule": "linear decay to 0 over the steps",
         "evaluation_steps": [0] + sorted(g.eval_steps(g.Config(steps=STEPS, eval_every=EVAL_EVERY,
                                                                    eval_at=",".join(map(str, EVAL_AT))))),
         "evaluation_note": "step 0 is the warm-up's last validation evaluation, the start of every run",
         "collapse": COLLAPSE, "collapsed_at_step": COLLAPSED_AT, "test": TEST, "alpha": ALPHA,
         "frontier": FRONTIER, "update_size": "update_size_by_step: per RL step, per minibatch, the mean of "
                                              "log(pi_old / pi_theta) over its tokens just before its update",
         "budget_seconds": BUDGET_SECONDS, "projection_margin": PROJECTION_MARGIN,
         "warmups_rule": f"the most warm-ups per model, {MIN_WARMUPS} to {MAX_WARMUPS}, whose projected first "
                         f"phase (prototype timings, 2 runs at a time) fits {PROJECTION_MARGIN:.0%} of the budget",
         "workers": 2, "threads_per_run": 1, "analysis_code_commit": DESIGN_COMMIT}
    if warmups is not None:
        pairs = warmups * len(d["cells"])
        d["pairs"] = pairs
        d["power"] = {"at_every_pair_discordant": power(pairs)}
        if proto is not None:
            n = expected_discordant(proto, warmups)
            d["power"]["expected_discordant_pairs"] = n
            d["power"]["at_expected"] = power(max(1, round(n)))
    return d


# ---------------------------------------------------------------------------------------------
# Runs
# ---------------------------------------------------------------------------------------------
def run_name(cell: str, loss: str, seed: int) -> str:
    return f"{cell}_{loss}_s{seed}"


def run_args(cell: dict, loss: str, seed: int, checkpoint: str) -> list[str]:
    return ["--model", checkpoint, "--warmup-max-steps", "0", "--seed", str(seed), "--loss", loss,
            *cell["flags"], "--eval-every", str(EVAL_EVERY), "--eval-at", ",".join(map(str, EVAL_AT))]


def jobs_of(cell_map: dict, seeds, folder: str = FRONTIER_RUNS, warm=None) -> list[dict]:
    """Every warm-up the cells need, then GSPO and GRPO of each cell and seed, each waiting for its
    warm-up (`warm`: model, seed -> that warm-up's job, make figures-map's by default)."""
    warm = warm or warmup_job
    models = sorted({c["model"] for c in cell_map.values()})
    jobs = {(m, s): warm(m, s) for m in models for s in seeds}
    out = list(jobs.values())
    for name, cell in cell_map.items():
        for seed in seeds:
            w = jobs[(cell["model"], seed)]
            ckpt = os.path.join(os.path.dirname(w["done"]), "checkpoint")
            for loss in LOSSES:
                out.append(script_job(run_name(name, loss, seed), run_args(cell, loss, seed, ckpt), folder, STEPS,
                                      needs=w["done"]))
    return out


def collapsed_at_step(start: float, curve: dict[int, float]) -> int | None:
    """The first evaluation from which the run stays collapsed by the map's definition (applied to
    the evaluations up to each step), None if it does not end collapsed."""
    steps = sorted(curve)
    state = [is_collapsed(start, [curve[t] for t in steps[:i + 1]]) for i in range(len(steps))]
    if not state or not state[-1]:
        return None
    i = len(state) - 1
    while i > 0 and state[i - 1]:
        i -= 1
    return steps[i]


def run_record(name: str, cell: str, c: dict, seed: int, folder: str, warm_dir: str) -> dict:
    record, rl = run_basics(name, folder, warm_dir)
    sizes = [r["update_size_by_minibatch"] for r in rl]
    record.update({"cell": cell, "setting": c["setting"], "model": c["model"], "multiplier": c["multiplier"],
                   "minibatches": c["minibatches"], "seed": seed, "warmup": warm_dir,
                   "collapsed_at_step": (collapsed_at_step(record["val_acc_at_rl_start"], record["val_acc_at_step"])
                                         if record["collapsed"] else None),
                   "grad_norm_median": statistics.median(r["grad_norm"] for r in rl),
                   "update_size_by_step": sizes,
                   "update_size_last_minibatch_median": statistics.median(x[-1] for x in sizes)})
    return record


# ---------------------------------------------------------------------------------------------
# The analysis: the test, each cell, the frontier (statistics in studies/common.py)
# ---------------------------------------------------------------------------------------------
def wilson(k: int, n: int, z: float = 1.959964) -> list[float] | None:
    """Wilson's 95% interval for a share k of n (None for n = 0)."""
    if n == 0:
        return None
    p = k / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return [max(0.0, centre - half), min(1.0, centre + half)]


def pairs_of(runs: list[dict]) -> dict[tuple[str, int], dict[str, dict]]:
    """(cell, seed) -> {loss: run}, only where both runs of the pair finished."""
    out: dict = {}
    for r in runs:
        out.setdefault((r["cell"], r["seed"]), {})[r["loss"]] = r
    return {k: v for k, v in out.items() if set(v) == set(LOSSES)}


def the_test(runs: list[dict], n_perm: int = 10000) -> dict:
    """H1: GSPO collapses less often. b: pairs where only GRPO collapsed, c: only GSPO; McNemar's
    exact one-sided p, and the permutation p with a warm-up (model, seed) as the unit."""
    pairs = pairs_of(runs)
    b = sum(p["grpo"]["collapsed"] and not p["gspo"]["collapsed"] for p in pairs.values())
    c = sum(p["gspo"]["collapsed"] and not p["grpo"]["collapsed"] for p in pairs.values())
    blocks: dict = {}
    for (cell, seed), p in pairs.items():
        key = (p["gspo"]["model"], seed)
        gs, gr = blocks.get(key, (0, 0))
        blocks[key] = (gs + p["gspo"]["collapsed"], gr + p["grpo"]["collapsed"])
    perm = paired_permutation_p(list(blocks.values()), lambda ps: sum(r - s for s, r in ps), n_perm) if blocks else None
    p = mcnemar_exact(b, c)
    return {"pairs": len(pairs), "both_collapsed": sum(p_["gspo"]["collapsed"] and p_["grpo"]["collapsed"]
                                                       for p_ in pairs.values()),
            "neither_collapsed": sum(not p_["gspo"]["collapsed"] and not p_["grpo"]["collapsed"]
                                     for p_ in pairs.values()),
            "only_grpo_collapsed": b, "only_gspo_collapsed": c, "p_one_sided": p,
            "permutation_p": perm, "permutation_units": len(blocks), "called": p < ALPHA,
            "confirmed_by_permutation": perm is not None and perm < ALPHA,
            "smallest_significant_split": smallest_significant_split(b + c, ALPHA)}


def cell_summary(runs: list[dict], cell: str) -> dict:
    mine = [r for r in runs if r["cell"] == cell]
    out = {}
    for loss in LOSSES:
        rs = [r for r in mine if r["loss"] == loss]
        k = sum(r["collapsed"] for r in rs)
        out[loss] = {"runs": len(rs), "collapsed": k, "collapse_share": k / len(rs) if rs else None,
                     "collapse_share_ci95": wilson(k, len(rs)),
                     "median_accuracy_after_rl": statistics.median(r["accuracy_after_rl"] for r in rs) if rs else None}
    pairs = {seed: p for (c, seed), p in pairs_of(mine).items()}
    diffs = {seed: p["gspo"]["accuracy_after_rl"] - p["grpo"]["accuracy_after_rl"] for seed, p in sorted(pairs.items())}
    pos, neg = sum(d > 0 for d in diffs.values()), sum(d < 0 for d in diffs.values())
    out["differences_by_seed"] = diffs
    out["median_difference"] = statistics.median(diffs.values()) if diffs else None
    out["sign_test_p_two_sided"] = sign_test(pos, neg, "two-sided") if pos + neg else None
    out["median_difference_ci95"] = (cluster_bootstrap([[d] for d in diffs.values()], statistics.median)
                                     if len(diffs) > 1 else None)
    out["update_size"] = update_size_summary(mine)
    return out


EARLY_STEPS = 4                    # the update-size reading's early window: RL steps 1-4, through the step-4 evaluation
UPDATE_SIZE = (f"per run, the last minibatch's realised update size (mean log(pi_old / pi_theta) over its tokens, "
               f"just before its update): its median over RL steps 1-{EARLY_STEPS} (`early`, before most collapses "
               f"are dated) and over every step (`all_steps`); per cell and objective the median over runs; "
               f"`gspo_minus_grpo_early_by_seed`, the paired difference of `early`, and its median")


def early_update_size(run: dict) -> float:
    return statistics.median(x[-1] for x in run["update_size_by_step"][:EARLY_STEPS])


def update_size_summary(runs: list[dict]) -> dict:
    """UPDATE_SIZE for one cell's runs: does one objective collapse less only because it moves less?"""
    out = {}
    for loss in LOSSES:
        rs = [r for r in runs if r["loss"] == loss and r.get("update_size_by_step")]
        out[loss] = {"early_median": statistics.median(map(early_update_size, rs)) if rs else None,
                     "all_steps_median": statistics.median(r["update_size_last_minibatch_median"] for r in rs)
                     if rs else None}
    pairs = {seed: p for (_, seed), p in pairs_of(runs).items()
             if all(p[loss].get("update_size_by_step") for loss in LOSSES)}
    diffs = {seed: early_update_size(p["gspo"]) - early_update_size(p["grpo"]) for seed, p in sorted(pairs.items())}
    out["gspo_minus_grpo_early_by_seed"] = diffs
    out["gspo_minus_grpo_early_median"] = statistics.median(diffs.values()) if diffs else None
    return out


def frontier_of(runs: list[dict], cell_map: dict) -> dict:
    """Per objective and setting: the Firth frontier on the dense settings, the shares on the MoE."""
    out = {}
    for setting, rung in LADDER.items():
        mults = sorted({c["multiplier"] for c in cell_map.values() if c["setting"] == setting})
        for loss in LOSSES:
            rs = [r for r in runs if r["setting"] == setting and r["loss"] == loss]
            shares = {f"{m:g}": (statistics.fmean(r["collapsed"] for r in rs if r["multiplier"] == m)
                                 if any(r["multiplier"] == m for r in rs) else None) for m in mults}
            entry = {"collapse_share_by_multiplier": shares}
            seen = [v for v in shares.values() if v is not None]
            if rung["model"] == "dense" and seen:
                if all(v >= 0.5 for v in seen):
                    entry["frontier"] = f"below {mults[0]:g}x"
                elif all(v < 0.5 for v in seen):
                    entry["frontier"] = f"above {mults[-1]:g}x"
                else:
                    fit = firth_logistic([math.log2(r["multiplier"]) for r in rs], [int(r["collapsed"]) for r in rs])
                    x, ci = fit["x_at_half"], fit["x_at_half_ci95"]
                    entry.update(fit=fit, frontier_multiplier=None if x is None else 2 ** x,
                                 frontier_multiplier_ci95=None if ci is None else [2 ** ci[0], 2 ** ci[1]])
            out.setdefault(setting, {})[loss] = entry
    return out


def analyse(record: dict) -> dict:
    runs, cell_map = record["runs"], record["design"]["cells"]
    record["cells"] = {cell: cell_summary(runs, cell) for cell in cell_map}
    record["test"] = the_test(runs)
    record["frontier"] = frontier_of(runs, cell_map)
    record["update_size_reading"] = {
        "definition": UPDATE_SIZE,
        "when": "written while the measured runs ran and before any of their results was read; the design "
                "committed before the runs named the per-run update sizes, not this summary of them"}
    return record


# ---------------------------------------------------------------------------------------------
# The prototype: does the ladder bracket the frontier, and how many warm-ups fit the budget?
# ---------------------------------------------------------------------------------------------
def projection(proto: dict, warmups: int) -> dict:
    """The first phase's seconds with `warmups` per model, 2 runs at a time, from the prototype's
    per-run seconds (each cell's mean) and warm-up seconds (each model's mean); the warm-ups that
    make figures-map already made (seeds 0-2) counted all the same."""
    runs = sum(len(LOSSES) * warmups * c["run_seconds"] for c in proto["cells"].values())
    warm = sum(warmups * s for s in proto["warmup_seconds"].values())
    return {"warmups": warmups, "seconds": (runs + warm) / 2, "runs_seconds": runs / 2, "warmups_seconds": warm / 2}


def warmups_that_fit(proto: dict) -> int:
    fits = [n for n in range(MIN_WARMUPS, MAX_WARMUPS + 1)
            if projection(proto, n)["seconds"] <= PROJECTION_MARGIN * BUDGET_SECONDS]
    return max(fits) if fits else MIN_WARMUPS


def shift_of(proto_cells: dict) -> dict:
    """The ladder shift rule: per setting, 0.5 if every prototype run collapsed, 2 if none did."""
    out = {}
    for setting in LADDER:
        flags = [c["collapse_share"][loss] for c in proto_cells.values() if c["setting"] == setting for loss in LOSSES]
        if flags and all(f == 1 for f in flags):
            out[setting] = 0.5
        elif flags and all(f == 0 for f in flags):
            out[setting] = 2
    return out


def rung_shift_of(proto_cells: dict) -> dict:
    """The per-rung rule: where some rung of a setting collapsed every prototype run, the factor that
    makes the lowest such rung the setting's top rung (none where that is the top already)."""
    out = {}
    for setting, rung in LADDER.items():
        full = sorted(c["multiplier"] for c in proto_cells.values()
                      if c["setting"] == setting and all(c["collapse_share"][loss] == 1 for loss in LOSSES))
        if full and full[0] != max(rung["multipliers"]):
            out[setting] = full[0] / max(rung["multipliers"])
    return out


def ladder_trial(cell_map: dict, seeds, folder: str) -> dict:
    """GSPO and GRPO of every cell on `seeds`, each from a warm-up of its own in `folder` (never
    the measured run's), 2 at a time as the measured run goes: per cell the collapse shares, dates,
    accuracies and seconds per run; each model's warm-up seconds."""
    def own_warmup(model, seed):
        job = warmup_job(model, seed)
        out = os.path.join(folder, f"warmup_{model}_s{seed}")
        return {**job, "cmd": job["cmd"][:-1] + [out], "done": os.path.join(out, "summary.json"),
                "argv": job["argv"][:-1] + [out]}
    run_jobs(jobs_of(cell_map, seeds, folder, own_warmup), folder)
    runs = [run_record(run_name(name, loss, seed), name, c, seed, folder,
                       os.path.join(folder, f"warmup_{c['model']}_s{seed}"))
            for name, c in cell_map.items() for seed in seeds for loss in LOSSES]
    trial_cells = {}
    for name, c in cell_map.items():
        mine = [r for r in runs if r["cell"] == name]
        trial_cells[name] = {"setting": c["setting"], "multiplier": c["multiplier"],
                             "collapse_share": {loss: statistics.fmean(r["collapsed"] for r in mine if r["loss"] == loss)
                                                for loss in LOSSES},
                             "collapsed_at_step": {r["name"]: r["collapsed_at_step"] for r in mine},
                             "accuracy_after_rl": {r["name"]: r["accuracy_after_rl"] for r in mine},
                             "run_seconds": statistics.fmean(r["wall_seconds"] for r in mine)}
    warm = {m: statistics.fmean(read_summary(f"warmup_{m}_s{s}", folder)["wall_seconds"] for s in seeds)
            for m in ("dense", "moe")}
    trial = {"seeds": list(seeds), "steps": STEPS, "cells": trial_cells, "warmup_seconds": warm,
             "runs": runs, "workers": 2, "threads_per_run": 1}
    trial["warmups_per_model"] = warmups_that_fit(trial)
    trial["projection"] = projection(trial, trial["warmups_per_model"])
    return trial


def prototype() -> dict:
    """The unshifted ladder on PROTOTYPE_SEEDS (runs/frontier/prototype): what each rule of shifting
    asks for, and the warm-ups the budget allows; frontier_prototype.json."""
    t0 = time.perf_counter()
    proto = ladder_trial(cells({}), PROTOTYPE_SEEDS, os.path.join(FRONTIER_RUNS, "prototype"))
    proto["ladder_shift"] = shift_of(proto["cells"])
    proto["ladder_shift_per_rung"] = rung_shift_of(proto["cells"])
    write_json(PROTOTYPE_JSON, proto, "python studies/frontier.py prototype", time.perf_counter() - t0)
    return proto


def prototype_check() -> dict:
    """The shifted ladder (LADDER_SHIFT) on CHECK_SEEDS (runs/frontier/prototype_check): does it
    bracket the frontier, and how many warm-ups fit at its timings? Added to frontier_prototype.json
    as `check`, with its own provenance, the first prototype's kept as it is."""
    from studies import common
    proto = read_json(PROTOTYPE_JSON)
    t0 = time.perf_counter()
    check = ladder_trial(cells(), CHECK_SEEDS, os.path.join(FRONTIER_RUNS, "prototype_check"))
    check["ladder_shift"] = LADDER_SHIFT
    check["design_at_these_warmups"] = design(check["warmups_per_model"], check)
    proto["check"] = {**g.provenance("python studies/frontier.py prototype --check", time.perf_counter() - t0,
                                     common.target_tree), **check}
    rewrite_json(PROTOTYPE_JSON, proto)
    return check


# ---------------------------------------------------------------------------------------------
# The measured run, its plot
# ---------------------------------------------------------------------------------------------
def fixed_design() -> dict:
    if WARMUPS is None:
        fail("the warm-ups per model are not fixed yet: run `python studies/frontier.py prototype` and set "
             "WARMUPS (and LADDER_SHIFT, if it asks for one) in studies/frontier.py before the measured run")
    proto = read_json(PROTOTYPE_JSON) if os.path.exists(PROTOTYPE_JSON) else {}
    return design(WARMUPS, proto.get("check"))


def write_design() -> dict:
    """figures/frontier.json before any run: the design, no runs; one holding runs made under another
    design is never overwritten."""
    d = fixed_design()
    kept = kept_design(FRONTIER_JSON, d)
    if kept is not None:
        return kept
    record = {"figures_frontier_seconds": 0.0, "design": d, "runs": []}
    write_json(FRONTIER_JSON, record, "python studies/frontier.py design", 0.0)
    return record


def figures_frontier() -> dict:
    record = write_design()
    d = record["design"]
    cell_map, seeds = d["cells"], d["warmup_seeds"]
    ledger = Ledger(os.path.join(FRONTIER_RUNS, "first_phase_seconds.json"))
    try:
        run_jobs(jobs_of(cell_map, seeds), FRONTIER_RUNS)
    finally:
        ledger.close()
    record["runs"] = [run_record(run_name(name, loss, seed), name, c, seed, FRONTIER_RUNS, warm_path(c["model"], seed))
                      for name, c in cell_map.items() for seed in seeds for loss in LOSSES]
    analyse(record)
    record["figures_frontier_seconds"] = ledger.total()
    write_result(FRONTIER_JSON, record, "python studies/frontier.py", record["figures_frontier_seconds"])
    plot(record)
    t = record["test"]
    print(f"discordant pairs: only GRPO collapsed {t['only_grpo_collapsed']}, only GSPO {t['only_gspo_collapsed']}; "
          f"one-sided p {t['p_one_sided']:.4f}, permutation p {t['permutation_p']:.4f}: "
          f"{'called' if t['called'] else 'not called'}")
    print(f"{FRONTIER_JSON}, {FIG_DIR}/frontier.png, {record['figures_frontier_seconds'] / 60:.0f} min")
    return record


def plot(record: dict, path: str = os.path.join(FIG_DIR, "frontier.png")) -> None:
    """Top: collapse share against the multiplier, GSPO and GRPO with Wilson intervals, one panel per
    setting. Bottom: accuracy after RL per cell, each run a dot, pairs joined; collapse against the
    realised update size (each run's median over steps of its last minibatch's)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    colour = {"gspo": "#0072B2", "grpo": "#D55E00"}
    runs, cell_map = record["runs"], record["design"]["cells"]
    fig = plt.figure(figsize=(15, 8))
    top = [fig.add_subplot(2, 3, i + 1) for i in range(len(LADDER))]
    for ax, setting in zip(top, LADDER):
        for i, loss in enumerate(LOSSES):
            xs, ys, lo, hi = [], [], [], []
            for c in sorted((c for c in cell_map.values() if c["setting"] == setting), key=lambda c: c["multiplier"]):
                rs = [r for r in runs if r["setting"] == setting and r["loss"] == loss and r["multiplier"] == c["multiplier"]]
                if not rs:
                    continue
                k = sum(r["collapsed"] for r in rs)
                ci = wilson(k, len(rs))
                xs.append(c["multiplier"] * (1 + 0.02 * (i - 0.5)))
                ys.append(k / len(rs))
                lo.append(max(0.0, k / len(rs) - ci[0]))     # Wilson's bound at k = 0 or n is the share
                hi.append(max(0.0, ci[1] - k / len(rs)))     # itself, up to a rounding of either sign
            ax.errorbar(xs, ys, yerr=[lo, hi], color=colour[loss], marker="o", capsize=3, label=loss.upper())
        ax.axhline(0.5, color="grey", lw=0.8, ls=":")
        ax.set(xscale="log", ylim=(-0.05, 1.05), xlabel="learning rate / make train's",
               ylabel="collapse share (95% Wilson)", title=setting)
        ax.set_xticks(sorted({c["multiplier"] for c in cell_map.values() if c["setting"] == setting}))
        ax.get_xaxis().set_major_formatter(matplotlib.ticker.FormatStrFormatter("%gx"))
        ax.get_xaxis().set_minor_formatter(matplotlib.ticker.NullFormatter())
        ax.legend(fontsize=8)
    acc = fig.add_subplot(2, 3, (4, 5))
    names = list(cell_map)
    for x, cell in enumerate(names):
        for seed_pair in pairs_of([r for r in runs if r["cell"] == cell]).values():
            a, b = seed_pair["gspo"], seed_pair["grpo"]
            acc.plot([x - 0.15, x + 0.15], [a["accuracy_after_rl"], b["accuracy_after_rl"]], color="#bbbbbb", lw=0.7)
            for r, dx in ((a, -0.15), (b, 0.15)):
                acc.scatter(x + dx, r["accuracy_after_rl"], color=colour[r["loss"]], s=14,
                            marker="x" if r["collapsed"] else "o")
    acc.set_xticks(range(len(names)), names, rotation=30, fontsize=7, ha="right")
    acc.set_ylabel("test accuracy after RL (x: collapsed; pairs joined)")
    size = fig.add_subplot(2, 3, 6)
    for i, loss in enumerate(LOSSES):
        rs = [r for r in runs if r["loss"] == loss]
        size.scatter([abs(r["update_size_last_minibatch_median"]) + 1e-9 for r in rs],
                     [r["collapsed"] + 0.06 * (i - 0.5) for r in rs], color=colour[loss], s=12, alpha=0.6,
                     label=loss.upper())
    size.set(xscale="log", yticks=[0, 1], yticklabels=["stable", "collapsed"],
             xlabel="|update size| (last minibatch's mean log(pi_old/pi_theta),\nmedian over a run's steps)")
    size.legend(fontsize=8)
    t = record.get("test", {})
    fig.suptitle(f"Where does each objective break? {record['design']['warmups_per_model']} warm-ups per model, "
                 f"{STEPS} RL steps; discordant pairs: only GRPO collapsed {t.get('only_grpo_collapsed')}, "
                 f"only GSPO {t.get('only_gspo_collapsed')}, one-sided p {t.get('p_one_sided', float('nan')):.3g}",
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


@cli
def main(argv=None) -> int:
    parser = Parser(description=__doc__.splitlines()[0])
    parser.add_argument("what", nargs="?", choices=["prototype", "design", "redraw"], default=None)
    parser.add_argument("--check", action="store_true", help="prototype: the shifted ladder on seeds 92 and 93")
    args = parser.parse_args(argv)
    if args.what == "prototype":
        proto = prototype_check() if args.check else prototype()
        print(f"ladder shift: {proto.get('ladder_shift') or 'none'}; per rung: {proto.get('ladder_shift_per_rung')}; "
              f"warm-ups per model: {proto['warmups_per_model']} "
              f"(projected {proto['projection']['seconds'] / 60:.0f} min); wrote {PROTOTYPE_JSON}")
        return 0
    if args.what == "design":
        write_design()
        print(f"wrote the design into {FRONTIER_JSON}")
        return 0
    if args.what == "redraw":
        plot(read_json(FRONTIER_JSON))
        return 0
    figures_frontier()
    return 0


if __name__ == "__main__":
    sys.exit(main())

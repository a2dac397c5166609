"""make figures-map: do GSPO and GRPO part ways? The regimes the GSPO paper names, mapped under a
decision rule fixed before the runs.

    python studies/map.py              # `make figures-map`: the first phase, figures/map.json and
                                       # figures/map.png; resumable (runs/map), its time summed
    python studies/map.py --confirm    # `make figures-map CONFIRM=1`: seeds 3 and 4 for at most the
                                       # two separating cells with the largest |median difference|
    python studies/map.py prototype    # each cell's seconds per run (seed 9, a few steps, runs not
                                       # reused): figures/map_prototype.json, and the step fraction
    python studies/map.py design       # the design and the pilot into figures/map.json, no run
    python studies/map.py pilot        # the decision rule applied to figures.json's add2 runs
    python studies/map.py clip         # `make figures-map CLIP=1`: the two bf16-sampler cells again
                                       # (runs/map_clip), logging the clipped share per minibatch:
                                       # map.json's `first_minibatch_clip` (about 5 min)

The GSPO paper places GSPO's advantage over GRPO in four conditions: updates far off-policy, long
responses, expert volatility in mixture-of-experts models, and a precision gap between the engine
that samples and the one that trains. Nine cells, each GSPO and GRPO from one warm-up per seed
(seeds 0, 1, 2): `make figures`' settings on add2 (base); 16 minibatches per rollout (deep); the
learning rate x4 (hot); both; the tiny mixture of experts, deep and hot; a bf16 sampler with pi_old
from the trainer; a bf16 sampler with pi_old from the sampler's record (the pre-update pass
skipped), at base settings and deep and hot; addwork's long answers, deep and hot. The decision
rule, the collapse definition and the step counts are in `design()`, written into map.json before
any measured run. The claim it serves: results.md, "When GSPO and GRPO differ in learning" (the
regimes table, and its subsection on the sampler's precision).
"""
from __future__ import annotations

import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))   # gspo_minimal, studies

from studies import common  # noqa: E402
from studies.common import (FIG_DIR, FIG_STEPS, SEEDS, Ledger, Parser, cli, common_sign, fail,  # noqa: E402
                            kept_design, paired_differences, read_json, read_metrics, read_summary, rewrite_json, run_jobs,
                            script_job, second_stream_noise, warm_start, warm_start_argv, write_json, write_result)
from studies.long import LONG_STEPS, warm_dir as long_warm_dir  # noqa: E402

# The files this target writes into figures/: its own outputs, left out of its dirty check
# (gspo_minimal.tree_state, taken by studies.common.cli when it starts).
OUTPUTS = ("figures/map.json",
           "figures/map.png",
           "figures/map_prototype.json",)


MAP_RUNS = "runs/map"
MAP_JSON = os.path.join(FIG_DIR, "map.json")
PROTOTYPE_JSON = os.path.join(FIG_DIR, "map_prototype.json")
CONFIRM_SEEDS = (3, 4)
NOISE_OFFSET = 100         # the second RL stream of warm-up s: --seed s + 100 from the same checkpoint
PROTOTYPE_SEED = 9         # outside 0-4: the prototype's runs are never reused
PROTOTYPE_STEPS = {"add2": 20, "addwork": 10}
BUDGET_SECONDS = 70 * 60   # the first phase: warm-ups, every cell, the noise runs
CONFIRM_BUDGET_SECONDS = 20 * 60
# The step fraction: the largest multiple of 0.05 whose projected first phase, from the prototype's
# timings, fits BUDGET_SECONDS less a margin; fixed from figures/map_prototype.json before the
# measured run (`python studies/map.py prototype` prints it). None: not yet fixed. Fixed at 0.35
# from figures/map_prototype.json: the first phase projected at 62.9 min (117.5 at full steps).
STEP_FRACTION: float | None = 0.35
PROJECTION_MARGIN = 0.9    # the projection must fit 90% of the budget

# The models each cell starts from: the script's flags for the warm-up and for the RL runs, and
# the RL steps a cell's step fraction is taken of (make figures' 200 on add2, make figures-long's
# 60 on addwork).
MODELS = {"dense": {"warmup": [], "task": [], "default_steps": FIG_STEPS},
          "moe": {"warmup": ["--moe"], "task": [], "default_steps": FIG_STEPS},
          "addwork": {"warmup": ["--task", "addwork"], "task": ["--task", "addwork"],
                      "default_steps": LONG_STEPS}}
DEEP = ["--minibatches", "16"]     # 4x the optimiser steps per rollout, the last 15 steps after sampling
HOT = ["--lr", "8e-4"]             # 4x the default 2e-4 (add2 and addwork alike)
BF16 = ["--sampler-dtype", "bfloat16"]
FROM_SAMPLER = ["--old-logprobs", "sampler"]
CELLS = {"base": ("dense", []),
         "deep": ("dense", DEEP),
         "hot": ("dense", HOT),
         "deep_hot": ("dense", DEEP + HOT),
         "moe_deep_hot": ("moe", DEEP + HOT),
         "bf16_trainer": ("dense", BF16),
         "bf16_sampler": ("dense", BF16 + FROM_SAMPLER),
         "bf16_sampler_deep_hot": ("dense", BF16 + FROM_SAMPLER + DEEP + HOT),
         "addwork_deep_hot": ("addwork", DEEP + HOT)}
TASK_OF = {"dense": "add2", "moe": "add2", "addwork": "addwork"}
NOISE_FIRST = ("base", "addwork_deep_hot")   # each task's noise is measured up front in these
CLIP_RUNS = "runs/map_clip"
CLIP_CELLS = ("bf16_trainer", "bf16_sampler")   # the same bf16 sampler, pi_old from each engine
CLIP_METRIC = ("clip_seqs_by_minibatch: per minibatch index, the share of the step's sequences in that "
               "minibatch that clip (gspo_minimal.ratio_metrics), as the mean over the run's steps; "
               "minibatch_1_step_1 is the first update of the run. The runs repeat map.json's own (same "
               "flags, seeds and steps, from the same warm-ups); `same_accuracy_as_map` says whether "
               "each ended where its map.json run did")


# ---------------------------------------------------------------------------------------------
# The design, fixed before any measured run
# ---------------------------------------------------------------------------------------------
COLLAPSE = ("collapsed: the run's last two validation evaluations are both below max(best - 0.10, "
            "start - 0.05), where start is the validation accuracy of the warm-up checkpoint the run "
            "starts from (the last evaluation of its warm-up) and best the highest of start and the "
            "run's own validation evaluations")
RULE = ("metric: accuracy_after_rl (test set; the runs of a seed share a warm-up, so this is also the "
        "gain). Paired difference d_s = GSPO(s) - GRPO(s) for seeds 0, 1, 2. A cell's noise is the "
        "largest |GSPO(s) - GSPO(s, second RL stream)| over its seeds (the same warm-up, --seed s + 100), "
        "measured in each task's first cell (base for add2, addwork_deep_hot for addwork) and in every "
        "cell whose three differences share a sign; a cell without its own uses the largest noise "
        "measured for its task. A cell separates GSPO and GRPO when its three d_s have the same sign (a "
        "zero breaks it) and |median(d_s)| exceeds its noise; the sign says which is ahead. "
        "Confirmation (CONFIRM=1): for at most the two separating cells with the largest |median|, seeds "
        "3 and 4 are added; such a cell is confirmed only with 5 of 5 same signs and |median of 5| above "
        "its noise.")


def steps_of(cell: str, fraction: float) -> int:
    """A cell's RL steps: the fraction of its model's default, at least 10."""
    return max(10, round(fraction * MODELS[CELLS[cell][0]]["default_steps"]))


def design(fraction: float | None = STEP_FRACTION) -> dict:
    """Everything the measured run is held to, written into map.json before it starts."""
    return {"cells": {name: {"model": model, "task": TASK_OF[model], "flags": MODELS[model]["task"] + flags,
                             "steps": steps_of(name, fraction) if fraction else None}
                      for name, (model, flags) in CELLS.items()},
            "losses": ["gspo", "grpo"], "seeds": list(SEEDS), "confirm_seeds": list(CONFIRM_SEEDS),
            "noise_rl_seed_offset": NOISE_OFFSET, "noise_measured_first_in": list(NOISE_FIRST),
            "step_fraction": fraction, "default_steps": {m: v["default_steps"] for m, v in MODELS.items()},
            "step_fraction_rule": "the largest multiple of 0.05 whose projected first phase (prototype "
                                  f"timings, 2 runs at a time) fits {PROJECTION_MARGIN:.0%} of the budget",
            "budget_seconds": BUDGET_SECONDS, "confirm_budget_seconds": CONFIRM_BUDGET_SECONDS,
            "warmups": "one per model and seed, the script's own warm-up (make figures-long's for addwork, "
                       "reused from runs/long when there), every RL run of that seed starts from it "
                       "with --warmup-max-steps 0",
            "collapse": COLLAPSE, "decision_rule": RULE,
            "null_probabilities": {"same_sign_3_of_3_per_cell": 0.25,
                                   "at_least_one_of_9_cells": 1 - 0.75 ** len(CELLS),
                                   "same_sign_5_of_5_per_cell": 1 / 16},
            "workers": 2, "threads_per_run": 1}


# ---------------------------------------------------------------------------------------------
# Warm-ups and runs
# ---------------------------------------------------------------------------------------------
def warm_path(model: str, seed: int) -> str:
    """Where a model's warm-up of one seed lives: make figures-long's own for addwork."""
    return long_warm_dir(seed) if model == "addwork" else os.path.join(MAP_RUNS, f"warmup_{model}_s{seed}")


def warmup_job(model: str, seed: int) -> dict:
    out = warm_path(model, seed)
    return {"name": f"warmup_{model}_s{seed}", "done": os.path.join(out, "summary.json"), "needs": None,
            "cmd": [sys.executable, "studies/map.py", "_warmup", model, str(seed), out],
            "argv": warm_start_argv(MODELS[model]["warmup"], seed, out)}


def run_name(cell: str, loss: str, seed: int, rl_seed: int | None = None) -> str:
    return f"{cell}_{loss}_s{seed}" + ("" if rl_seed in (None, seed) else f"_rl{rl_seed}")


def run_args(cell: str, loss: str, seed: int, rl_seed: int | None = None) -> list[str]:
    model, flags = CELLS[cell]
    return ["--model", os.path.join(warm_path(model, seed), "checkpoint"), "--warmup-max-steps", "0",
            "--seed", str(seed if rl_seed is None else rl_seed), "--loss", loss,
            *MODELS[model]["task"], *flags]


def run_jobs_of(cells, seeds, fraction: float, folder: str = MAP_RUNS, noise: bool = False) -> list[dict]:
    """GSPO and GRPO (or, with `noise`, GSPO's second RL stream) of each cell and seed, each waiting
    for its warm-up."""
    jobs = []
    for cell in cells:
        model = CELLS[cell][0]
        for seed in seeds:
            runs = ([("gspo", seed + NOISE_OFFSET)] if noise else [("gspo", None), ("grpo", None)])
            for loss, rl_seed in runs:
                jobs.append(script_job(run_name(cell, loss, seed, rl_seed), run_args(cell, loss, seed, rl_seed),
                                       folder, steps_of(cell, fraction),
                                       needs=warmup_job(model, seed)["done"]))
    return jobs


# ---------------------------------------------------------------------------------------------
# What each run leaves: its record in map.json
# ---------------------------------------------------------------------------------------------
def is_collapsed(start: float, curve: list[float]) -> bool:
    """The design's collapse: the last two validation evaluations both below max(best - 0.10,
    start - 0.05), best over the start and the run's own evaluations."""
    if len(curve) < 2:
        return False
    floor = max(max([start, *curve]) - 0.10, start - 0.05)
    return curve[-1] < floor and curve[-2] < floor


def pooled_quantiles(rl: list[dict], key: str) -> list[list[float]]:
    """Per minibatch index, over the run's steps: the median of each step's p50, p90 and p99, and the
    largest maximum (the script logs each step's quantiles, `gspo_lab.quantiles`)."""
    per_step = [r[key] for r in rl if key in r]
    if not per_step:
        return []
    out = []
    for k in range(len(per_step[0])):
        qs = [step[k] for step in per_step]
        out.append([statistics.median(q[i] for q in qs) for i in range(len(qs[0]) - 1)]
                   + [max(q[-1] for q in qs)])
    return out


def warmup_end(warm_dir: str) -> float | None:
    """The validation accuracy a warm-up ended at (its last evaluation): every run from it starts
    there, the collapse definition's `start`. None when it logged none."""
    warm = [r for r in read_metrics(os.path.basename(warm_dir), os.path.dirname(warm_dir)) if "val_acc" in r]
    return warm[-1]["val_acc"] if warm else None


def run_basics(name: str, folder: str, warm_dir: str) -> tuple[dict, list[dict]]:
    """What every study's run record starts from (the map's, the frontier's, figures-engine's): the
    run's identity, accuracies, validation curve from its warm-up's end, `collapsed`, mean clip
    shares, largest gradient norm and times; with its RL lines, for the fields a study adds."""
    s = read_summary(name, folder)
    rl = [r for r in read_metrics(name, folder) if r["stage"] == "rl"]
    start = warmup_end(warm_dir)
    curve = {r["step"]: r["val_acc"] for r in rl if "val_acc" in r}
    return {"name": name, "loss": s["loss"], "command": s.get("command"), "steps": len(rl),
            "stop_reason": s.get("stop_reason"),
            "accuracy_before_rl": s["accuracy_before_rl"], "accuracy_after_rl": s["accuracy_after_rl"],
            "val_acc_at_rl_start": start, "val_acc_at_step": curve,
            "collapsed": start is not None and is_collapsed(start, list(curve.values())),
            "clip_tokens": statistics.fmean(r["clip_tokens"] for r in rl) if rl else None,   # none: stopped at step 1
            "clip_seqs": statistics.fmean(r["clip_seqs"] for r in rl) if rl else None,
            "grad_norm_max": max(r["grad_norm"] for r in rl) if rl else None,
            "wall_seconds": s["wall_seconds"], "rl_seconds": s["rl_seconds"]}, rl


def run_record(name: str, cell: str, seed: int, rl_seed: int, folder: str = MAP_RUNS) -> dict:
    model = CELLS[cell][0]
    record, rl = run_basics(name, folder, warm_path(model, seed))
    record.update({"cell": cell, "model": model, "seed": seed, "rl_seed": rl_seed,
                   "abs_log_s_by_minibatch": pooled_quantiles(rl, "abs_log_s_q"),
                   "abs_token_log_ratio_by_minibatch": pooled_quantiles(rl, "abs_token_log_ratio_q"),
                   "quantiles": "per minibatch index: the medians over steps of p50, p90, p99, then the largest max",
                   "tokens_per_second_median": statistics.median(r["tokens_per_second"] for r in rl)})
    if "--sampler-dtype" in CELLS[cell][1]:                       # where the engines differ
        first_step = [r for r in rl if r["step"] == 1]
        record.update(engine_gap_tokens=statistics.fmean(r["engine_gap_tokens"] for r in rl),
                      engine_gap_seqs=statistics.fmean(r["engine_gap_seqs"] for r in rl),
                      clip_seqs_first_step=first_step[0]["clip_seqs"] if first_step else None)
    return record


# ---------------------------------------------------------------------------------------------
# The decision rule (its statistics, shared with the other comparisons, in studies/common.py)
# ---------------------------------------------------------------------------------------------
def verdicts(after: dict, task_of: dict[str, str], seeds=SEEDS, noise_elsewhere: dict[str, float] | None = None) -> dict:
    """The rule applied to `after[cell] = {"gspo": {seed: acc}, "grpo": {...}, "noise": {seed: acc}}`
    (noise: GSPO's second RL stream, where run). Per cell: the paired differences, their median and
    common sign, the noise and where it came from, and `separates`. `noise_elsewhere`: per task, the
    largest noise measured by cells outside `after`, which the cells without their own may take."""
    own = {cell: second_stream_noise(a["gspo"], a.get("noise", {})) for cell, a in after.items()}
    by_task: dict[str, float] = dict(noise_elsewhere or {})
    for cell, n in own.items():
        if n is not None:
            by_task[task_of[cell]] = max(n, by_task.get(task_of[cell], 0.0))
    out = {}
    for cell, a in after.items():
        diffs = paired_differences(a["gspo"], a["grpo"], seeds)
        median = statistics.median(diffs) if diffs else None
        sign = common_sign(diffs) if len(diffs) == len(seeds) else 0
        noise = own[cell] if own[cell] is not None else by_task.get(task_of[cell])
        out[cell] = {"differences_by_seed": dict(zip(seeds, diffs)), "median_difference": median,
                     "common_sign": sign, "noise": noise,
                     "noise_from": ("its own second RL streams" if own[cell] is not None else
                                    f"the largest measured for {task_of[cell]}" if noise is not None else None),
                     "separates": bool(sign and noise is not None and abs(median) > noise),
                     "ahead": None if not sign else ("gspo" if sign > 0 else "grpo")}
    return out


def pilot() -> dict:
    """The rule applied to figures.json's add2 runs (GSPO and GRPO at make figures' settings, each
    with its own warm-up of the same seed): no second RL stream was run there, so only the sign test
    and the median can be applied."""
    fig = read_json(os.path.join(FIG_DIR, "figures.json"))
    acc = {r["name"]: r["accuracy_after_rl"] for r in fig["runs"]}
    after = {"base": {"gspo": {s: acc[f"gspo_s{s}"] for s in SEEDS}, "grpo": {s: acc[f"grpo_s{s}"] for s in SEEDS}}}
    v = verdicts(after, {"base": "add2"})["base"]
    return {"source": "figures/figures.json, runs gspo_s0-2 and grpo_s0-2 (make figures, 200 steps)",
            "figures_json_commit": fig.get("measured_at_commit"), "figures_json_dirty": fig.get("dirty", False),
            **v, "reading": "no second RL stream in figures.json, so no noise to compare the median with: "
                            + (f"the sign test alone passes, {v['ahead'].upper()} ahead on all three seeds"
                               if v["common_sign"] else "the sign test alone fails")}


# ---------------------------------------------------------------------------------------------
# The prototype: each cell's seconds per run, and the step fraction that fits the budget
# ---------------------------------------------------------------------------------------------
def projection(proto: dict, fraction: float) -> dict:
    """The first phase's seconds at `fraction`, from the prototype's per-run overhead and seconds per
    step, 2 runs at a time: every warm-up, every cell's 6 runs, the up-front noise runs, and the
    noise runs of the two most expensive other cells (under a null, 9/4 cells pass the sign test)."""
    per_run = {cell: c["overhead_seconds"] + steps_of(cell, fraction) * c["seconds_per_step"]
               for cell, c in proto["cells"].items()}
    warmups = sum(len(SEEDS) * proto["warmup_seconds"][m] for m in MODELS)
    runs = sum(2 * len(SEEDS) * t for t in per_run.values())
    noise = sum(len(SEEDS) * per_run[c] for c in NOISE_FIRST)
    others = sorted((t for c, t in per_run.items() if c not in NOISE_FIRST), reverse=True)[:2]
    allowance = sum(len(SEEDS) * t for t in others)
    total = (warmups + runs + noise + allowance) / 2
    return {"fraction": fraction, "per_run_seconds": per_run, "seconds": total,
            "parts": {"warmups": warmups / 2, "runs": runs / 2, "noise": noise / 2, "noise_allowance": allowance / 2}}


def fraction_that_fits(proto: dict) -> float:
    grid = [round(0.05 * k, 2) for k in range(20, 0, -1)]
    for f in grid:
        if projection(proto, f)["seconds"] <= PROJECTION_MARGIN * BUDGET_SECONDS:
            return f
    return grid[-1]


def prototype() -> dict:
    """Seed 9's warm-ups, then GSPO and GRPO of every cell for PROTOTYPE_STEPS steps, 2 at a time as
    the measured run goes: each cell's overhead (a run's wall seconds outside its RL steps) and
    seconds per RL step (evaluations included), and the warm-ups' seconds."""
    folder = os.path.join(MAP_RUNS, "prototype")
    seed = PROTOTYPE_SEED
    warm = {m: warmup_job(m, seed) for m in MODELS}
    for m, job in warm.items():        # the prototype's own warm-ups, never figures-long's
        out = os.path.join(folder, f"warmup_{m}_s{seed}")
        job.update(cmd=job["cmd"][:-1] + [out], done=os.path.join(out, "summary.json"))
    jobs = list(warm.values())
    for cell, (model, flags) in CELLS.items():
        ckpt = os.path.join(folder, f"warmup_{model}_s{seed}", "checkpoint")
        for loss in ("gspo", "grpo"):
            args = ["--model", ckpt, "--warmup-max-steps", "0", "--seed", str(seed), "--loss", loss,
                    *MODELS[model]["task"], *flags]
            jobs.append(script_job(f"{cell}_{loss}", args, folder, PROTOTYPE_STEPS[TASK_OF[model]],
                                   needs=warm[model]["done"]))
    t0 = time.perf_counter()
    run_jobs(jobs, folder)
    cells = {}
    for cell in CELLS:
        per = [read_summary(f"{cell}_{loss}", folder) for loss in ("gspo", "grpo")]
        cells[cell] = {"overhead_seconds": statistics.fmean(s["wall_seconds"] - s["rl_seconds"] for s in per),
                       "seconds_per_step": statistics.fmean(s["rl_seconds"] / s["rl_steps"] for s in per),
                       "steps": PROTOTYPE_STEPS[TASK_OF[CELLS[cell][0]]]}
    proto = {"seed": seed, "steps": PROTOTYPE_STEPS, "cells": cells,
             "warmup_seconds": {m: read_summary(f"warmup_{m}_s{seed}", folder)["wall_seconds"] for m in MODELS},
             "warmup_steps": {m: read_summary(f"warmup_{m}_s{seed}", folder)["warmup_steps"] for m in MODELS},
             "workers": 2, "threads_per_run": 1}
    proto["step_fraction"] = fraction_that_fits(proto)
    proto["projection"] = projection(proto, proto["step_fraction"])
    proto["projection_at_full_steps"] = projection(proto, 1.0)
    write_json(PROTOTYPE_JSON, proto, "python studies/map.py prototype", time.perf_counter() - t0)
    return proto


# ---------------------------------------------------------------------------------------------
# The measured run, its summary and its plot
# ---------------------------------------------------------------------------------------------
def fixed_design() -> dict:
    if STEP_FRACTION is None:
        fail("the step fraction is not fixed yet: run `python studies/map.py prototype` and set "
             "STEP_FRACTION in studies/map.py from what it prints, before the measured run")
    return design(STEP_FRACTION)


def write_design() -> dict:
    """figures/map.json before any measured run: the design and the pilot, no runs. A map.json
    holding runs is never overwritten by another design."""
    d = fixed_design()
    kept = kept_design(MAP_JSON, d)
    if kept is not None:
        return kept
    record = {"figures_map_seconds": 0.0, "design": d, "pilot": pilot(), "runs": [], "cells": {}}
    write_json(MAP_JSON, record, "python studies/map.py design", 0.0)
    return record


def collect(cells, seeds, confirm: bool = False) -> tuple[list[dict], dict]:
    """The records of every finished run of `cells` x `seeds` (and their second streams), and the
    test accuracies the rule reads."""
    records, after = [], {}
    for cell in cells:
        a = {"gspo": {}, "grpo": {}, "noise": {}}
        for seed in seeds:
            for loss, rl_seed, slot in (("gspo", seed, "gspo"), ("grpo", seed, "grpo"),
                                        ("gspo", seed + NOISE_OFFSET, "noise")):
                name = run_name(cell, loss, seed, rl_seed)
                if os.path.exists(os.path.join(MAP_RUNS, name, "summary.json")):
                    rec = run_record(name, cell, seed, rl_seed)
                    rec["phase"] = "confirm" if confirm and seed in CONFIRM_SEEDS else "first"
                    records.append(rec)
                    a[slot][seed] = rec["accuracy_after_rl"]
        after[cell] = a
    return records, after


def summarise(record: dict, confirm: bool = False) -> dict:
    """Every finished run's record and the rule's verdict per cell into `record` (map.json's body);
    with `confirm`, the verdicts over seeds 0-4 of the confirmation's cells as well."""
    task_of = {c: TASK_OF[CELLS[c][0]] for c in CELLS}
    runs, after = collect(CELLS, SEEDS + (CONFIRM_SEEDS if confirm else ()), confirm)
    first = {c: {k: {s: v for s, v in a[k].items() if s in SEEDS} for k in a} for c, a in after.items()}
    record["runs"], record["cells"] = runs, verdicts(first, task_of)
    for cell, v in record["cells"].items():
        mine = [r for r in runs if r["cell"] == cell and r["seed"] in SEEDS and r["rl_seed"] == r["seed"]]
        v["collapses"] = {loss: sum(r["collapsed"] for r in mine if r["loss"] == loss) for loss in ("gspo", "grpo")}
        v["detectable_difference"] = v["noise"]     # the smallest |median| the rule could call
    if confirm:
        chosen = record["confirmation"]["cells"]
        five = verdicts({c: after[c] for c in chosen}, task_of, SEEDS + CONFIRM_SEEDS)
        for c in chosen:                                    # the noise stays the first phase's
            v = five[c]
            v["noise"] = record["cells"][c]["noise"]
            v["confirmed"] = bool(v["common_sign"] and v["noise"] is not None
                                  and abs(v["median_difference"]) > v["noise"])
        record["confirmation"]["by_cell"] = five
    record["null_probabilities"] = record["design"]["null_probabilities"]
    record["separating_cells"] = [c for c, v in record["cells"].items() if v["separates"]]
    return record


def figures_map(confirm: bool = False) -> dict:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    d = fixed_design()
    record = write_design()
    fraction = d["step_fraction"]
    ledger = Ledger(os.path.join(MAP_RUNS, ("confirm" if confirm else "first_phase") + "_seconds.json"))
    try:
        if not confirm:
            jobs = [warmup_job(m, s) for m in MODELS for s in SEEDS]
            jobs += run_jobs_of(CELLS, SEEDS, fraction) + run_jobs_of(NOISE_FIRST, SEEDS, fraction, noise=True)
            run_jobs(jobs, MAP_RUNS)
            _, after = collect(CELLS, SEEDS)
            passing = [c for c, v in verdicts(after, {c: TASK_OF[CELLS[c][0]] for c in CELLS}).items()
                       if v["common_sign"] and c not in NOISE_FIRST]
            run_jobs(run_jobs_of(passing, SEEDS, fraction, noise=True), MAP_RUNS)
        else:
            if not record.get("cells"):
                fail(f"{MAP_JSON} has no first phase yet: run `make figures-map` first")
            chosen = sorted((c for c, v in record["cells"].items() if v["separates"]),
                            key=lambda c: -abs(record["cells"][c]["median_difference"]))[:2]
            record["confirmation"] = {"cells": chosen, "seeds": list(SEEDS + CONFIRM_SEEDS)}
            if chosen:
                models = sorted({CELLS[c][0] for c in chosen})
                jobs = [warmup_job(m, s) for m in models for s in CONFIRM_SEEDS]
                run_jobs(jobs + run_jobs_of(chosen, CONFIRM_SEEDS, fraction), MAP_RUNS)
    finally:
        ledger.close()
    summarise(record, confirm)
    if confirm:
        record["confirmation"]["figures_map_confirm_seconds"] = ledger.total()
    else:
        record["figures_map_seconds"] = ledger.total()
    ledger.close()                                        # the summary's seconds counted too
    write_result(MAP_JSON, record, "python studies/map.py" + (" --confirm" if confirm else ""),
                 record["figures_map_seconds"])
    plot_map(plt, record)
    plt.close("all")
    print_map(record)
    return record


def clip_record(name: str, cell: str, seed: int) -> dict:
    """One rerun's clipped shares per minibatch, beside its map.json twin's accuracy."""
    rl = [r for r in read_metrics(name, CLIP_RUNS) if r["stage"] == "rl"]
    per_step = [r["clip_seqs_by_minibatch"] for r in rl]
    s = read_summary(name, CLIP_RUNS)
    return {"name": name, "cell": cell, "loss": s["loss"], "seed": seed,
            "steps": len(rl), "minibatch_1_step_1": per_step[0][0],
            "clip_seqs_by_minibatch": [statistics.fmean(step[k] for step in per_step)
                                       for k in range(len(per_step[0]))],
            "accuracy_after_rl": s["accuracy_after_rl"]}


def first_minibatch_clip() -> dict:
    """`make figures-map CLIP=1`: the bf16-sampler cells' runs again, with the per-minibatch clip
    share the first phase did not log, into map.json's `first_minibatch_clip` (its own provenance;
    the rest of map.json untouched)."""
    import gspo_minimal as g
    record = read_json(MAP_JSON)
    if not record.get("runs"):
        fail(f"{MAP_JSON} has no first phase yet: run `make figures-map` first")
    fraction = record["design"]["step_fraction"]
    t0 = time.perf_counter()
    jobs = [warmup_job("dense", s) for s in SEEDS]
    jobs += run_jobs_of(CLIP_CELLS, SEEDS, fraction, folder=CLIP_RUNS)
    run_jobs(jobs, CLIP_RUNS)
    twin = {r["name"]: r["accuracy_after_rl"] for r in record["runs"]}
    runs = []
    for cell in CLIP_CELLS:
        for seed in SEEDS:
            for loss in ("gspo", "grpo"):
                rec = clip_record(run_name(cell, loss, seed), cell, seed)
                rec["map_accuracy_after_rl"] = twin.get(rec["name"])
                rec["same_accuracy_as_map"] = rec["map_accuracy_after_rl"] == rec["accuracy_after_rl"]
                runs.append(rec)
    def median_of(cell, loss, value):
        return statistics.median(value(r) for r in runs if r["cell"] == cell and r["loss"] == loss)
    by_cell = {cell: {loss: {"minibatch_1_step_1_median": median_of(cell, loss, lambda r: r["minibatch_1_step_1"]),
                             "minibatch_1_mean_median": median_of(cell, loss, lambda r: r["clip_seqs_by_minibatch"][0])}
                      for loss in ("gspo", "grpo")} for cell in CLIP_CELLS}
    seconds = time.perf_counter() - t0
    record["first_minibatch_clip"] = {**g.provenance("python studies/map.py clip", seconds, common.target_tree),
                                      "metric": CLIP_METRIC, "cells": list(CLIP_CELLS), "seeds": list(SEEDS),
                                      "runs": runs, "by_cell": by_cell}
    rewrite_json(MAP_JSON, record)                         # the first phase's provenance stays
    for cell, v in by_cell.items():
        for loss, m in v.items():
            print(f"{cell:14s} {loss}: minibatch 1 clips {m['minibatch_1_step_1_median']:.3f} of its "
                  f"sequences at step 1, {m['minibatch_1_mean_median']:.3f} over the run (medians of 3 seeds)")
    print(f"{MAP_JSON} first_minibatch_clip, {seconds:.0f} s")
    return record


def plot_map(plt, record: dict, labels: dict | None = None,
             differences: str = "GSPO - GRPO by seed (grey: the cell's noise, +-)",
             title: str = "Do GSPO and GRPO part ways? Seeds 0-2, one warm-up per seed; rule fixed before the runs",
             path: str = os.path.join(FIG_DIR, "map.png")) -> None:
    """The cells down one axis (`labels`: cell -> its tick label; the map's own cells by default);
    test accuracy after RL, GSPO and GRPO side by side, each seed a dot (x: collapsed); the paired
    differences (`differences` names them) with each cell's noise beside them. make figures-engine
    draws its cells with it too."""
    labels = labels or {cell: cell for cell in CELLS}
    cells = list(labels)
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(13, 0.55 * len(cells) + 1.8), sharey=True)
    for y, cell in enumerate(cells):
        for loss, dy, colour in (("gspo", -0.15, "#0072B2"), ("grpo", 0.15, "#D55E00")):
            rs = [r for r in record["runs"] if r["cell"] == cell and r["loss"] == loss and r["rl_seed"] == r["seed"]]
            for r in rs:
                a1.scatter(r["accuracy_after_rl"], y + dy, color=colour, marker="x" if r["collapsed"] else "o",
                           s=30, label=loss.upper() if y == 0 and r is rs[0] else None)
        v = record["cells"].get(cell, {})
        diffs = list(v.get("differences_by_seed", {}).values())
        a2.scatter(diffs, [y] * len(diffs), color="#000000", s=24)
        if v.get("noise") is not None:
            a2.plot([-v["noise"], v["noise"]], [y, y], color="#999999", lw=6, alpha=0.4)
        if v.get("separates"):
            a2.annotate("separates", (max(diffs), y), xytext=(6, 0), textcoords="offset points", fontsize=8)
    a1.set_yticks(range(len(cells)), list(labels.values()), fontsize=8)
    a1.invert_yaxis()
    a1.set_xlabel("test accuracy after RL (each seed a dot, x: collapsed)")
    a1.legend(fontsize=8)
    a1.grid(alpha=0.3)
    a2.axvline(0, color="k", lw=0.8)
    a2.set_xlabel(differences)
    a2.grid(alpha=0.3)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def print_map(record: dict) -> None:
    print(f"{'cell':24s} {'GSPO - GRPO by seed':28s} {'median':>8s} {'noise':>7s}  verdict")
    for cell, v in record["cells"].items():
        diffs = ", ".join(f"{x:+.3f}" for x in v["differences_by_seed"].values())
        noise = "-" if v["noise"] is None else f"{v['noise']:.3f}"
        verdict = f"separates, {v['ahead']} ahead" if v["separates"] else "no separation"
        print(f"{cell:24s} {diffs:28s} {v['median_difference']:+8.3f} {noise:>7s}  {verdict}")
    print(f"{MAP_JSON}, {FIG_DIR}/map.png, {record['figures_map_seconds']:.0f} s")


@cli
def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "_warmup":                    # child process of the target
        if len(argv) != 4 or argv[1] not in MODELS or not argv[2].isdigit():
            fail("usage: python studies/map.py _warmup {dense,moe,addwork} SEED OUT")
        model, seed, out = argv[1], int(argv[2]), argv[3]
        warm_start(MODELS[model]["warmup"], seed, out, " ".join(["python studies/map.py _warmup", *argv[1:]]))
        return 0
    parser = Parser(description=__doc__.splitlines()[0])
    parser.add_argument("what", nargs="?", choices=("run", "prototype", "design", "pilot", "clip"),
                        default="run")
    parser.add_argument("--confirm", action="store_true", help="the confirmation phase (CONFIRM=1)")
    args = parser.parse_args(argv)
    from transformers.utils import logging as hf_logging
    hf_logging.disable_progress_bar()
    if args.what == "pilot":
        print(json.dumps(pilot(), indent=2, allow_nan=False))
    elif args.what == "prototype":
        proto = prototype()
        for cell, c in proto["cells"].items():
            print(f"{cell:24s} overhead {c['overhead_seconds']:5.1f} s, {c['seconds_per_step']:.2f} s per step")
        p = proto["projection"]
        print(f"step fraction {proto['step_fraction']}: first phase projected at {p['seconds'] / 60:.1f} min "
              f"(at full steps {proto['projection_at_full_steps']['seconds'] / 60:.1f} min); {PROTOTYPE_JSON}")
    elif args.what == "clip":
        first_minibatch_clip()
    elif args.what == "design":
        write_design()
        print(f"{MAP_JSON}: the design and the pilot, no runs")
    else:
        figures_map(confirm=args.confirm)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The record or the band on a real engine: one paired study with llama.cpp in the loop, on add2,
its design fixed before its runs (make figures-power's form, studies/power.py's analysis).

    .venv-engine/bin/python studies/engine_power.py design    # the timed prototype (seed 0's warm-up,
        one run per arm, two at a time), then the design, its seeds and its projection:
        figures/engine_power.json (about 10 minutes)
    .venv-engine/bin/python studies/engine_power.py figures   # make figures-engine-power: the warm-ups
        and runs of the design's seeds (resumable, two at a time), every contrast, the exact p, the plot
    .venv-engine/bin/python studies/engine_power.py redraw    # figures/engine_power.png from the JSON

make figures-power found, at 30 paired seeds, that a bf16 copy's record as pi_old cost GSPO and no
cost to GRPO was detected; the copy is the trainer's own model cast to bfloat16, run by the same
PyTorch code. Here llama.cpp samples (gspo_lab's --engine llama.cpp:bf16, its KV cache f16: the
weights at the copy's rounding, its own kernels, KV cache and sampler chain), and the questions are
the same ones asked of a real engine: what sampling from it costs with the trainer's pi_old (TRL's
synchronous route), what its record costs as pi_old (TRL's AsyncGRPOTrainer, verl's bypass mode),
GSPO against GRPO on each, whether the stand-in predicted the real engine, and what the bands and
TRL's correction give back. Eleven arms (ARMS), every one at every seed from that seed's own warm-up
with the same RL seed, so any two are paired seed by seed; ten primary contrasts corrected together
by Holm's step-down (CONTRASTS). The bands keep power.json's constants (read from its design).

What it cannot show: it is synchronous (verl#7356's clip fractions come from asynchronous
staleness); ggml's CPU kernels are not vLLM's or SGLang's GPU kernels; add2's answers are 3-4 tokens;
the gap measured here may be smaller than the ones users report with vLLM.
"""
from __future__ import annotations

import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))   # gspo_minimal, studies

from studies import power  # noqa: E402
from studies.common import Ledger, Parser, cli, fail, read_json, run_jobs, write_json, write_result  # noqa: E402

OUTPUTS = ("figures/engine_power.json", "figures/engine_power.png")
JSON, PNG = OUTPUTS
RUNS = "runs/engine_power"
FIRST_SEED = 200                        # fresh: seeds 0-4 and 100-129 made the earlier studies' claims
MOST_SEEDS, FEWEST_SEEDS = 40, 20       # the design keeps as many as fit the budget, within these
BUDGET_SECONDS = 120 * 60
POWER_JSON = "figures/power.json"       # the bands' constants and the proxies' paired spreads

ENGINE = ["--engine", "llama.cpp:bf16"]                 # llama.cpp's KV cache at its default, f16
RECORD = ENGINE + ["--old-logprobs", "sampler"]
# name: (loss, what it is, flags); WIDE and FSPO stand for power.json's values (`values_read`)
ARMS = {
    "gspo_ref": ("gspo", "GSPO; the trainer samples in float32; the trainer's pi_old; the paper's band", []),
    "grpo_ref": ("grpo", "GRPO, as gspo_ref", []),
    "gspo_eng": ("gspo", "GSPO; llama.cpp samples (bf16 weights, f16 KV); the trainer's pi_old (TRL's synchronous "
                         "route, its correction off)", ENGINE),
    "grpo_eng": ("grpo", "GRPO, as gspo_eng", ENGINE),
    "gspo_eng_trl": ("gspo", "as gspo_eng, with TRL's default correction for vLLM (sequence_mask, cap 3)",
                     ENGINE + ["--is-correction", "sequence_mask"]),
    "gspo_rec": ("gspo", "GSPO; llama.cpp samples; its record as pi_old (bypass); the paper's band", RECORD),
    "grpo_rec": ("grpo", "GRPO, as gspo_rec", RECORD),
    "gspo_copy_rec": ("gspo", "GSPO; the bf16 torch copy samples; its record as pi_old (make figures-power's c)",
                      ["--sampler-dtype", "bfloat16", "--old-logprobs", "sampler"]),
    "gspo_rec_cal": ("gspo", "as gspo_rec, with the calibrated band (Z = 1.96, K and SIGMA estimated online from "
                             "llama.cpp's record)", RECORD + ["--eps-engine", "1.96"]),
    "gspo_rec_fspo": ("gspo", "as gspo_rec, with FSPO's band at power.json's C", RECORD + ["FSPO"]),
    "gspo_eng_wide": ("gspo", "as gspo_eng, with power.json's fixed widened band", ENGINE + ["WIDE"]),
}
# name: (family, terms {arm: sign}, the question it answers)
CONTRASTS = {
    "gspo_eng - gspo_ref": ("primary", {"gspo_eng": 1, "gspo_ref": -1}, "sampling from llama.cpp's cost to GSPO"),
    "grpo_eng - grpo_ref": ("primary", {"grpo_eng": 1, "grpo_ref": -1}, "sampling from llama.cpp's cost to GRPO"),
    "gspo_rec - gspo_eng": ("primary", {"gspo_rec": 1, "gspo_eng": -1}, "llama.cpp's record's cost to GSPO"),
    "grpo_rec - grpo_eng": ("primary", {"grpo_rec": 1, "grpo_eng": -1}, "llama.cpp's record's cost to GRPO"),
    "(gspo_rec - gspo_eng) - (grpo_rec - grpo_eng)": (
        "primary", {"gspo_rec": 1, "gspo_eng": -1, "grpo_rec": -1, "grpo_eng": 1},
        "the part of the record's cost specific to GSPO"),
    "gspo_rec - gspo_copy_rec": ("primary", {"gspo_rec": 1, "gspo_copy_rec": -1},
                                 "the real engine's record against its stand-in's"),
    "gspo_rec_cal - gspo_rec": ("primary", {"gspo_rec_cal": 1, "gspo_rec": -1}, "the calibrated band on the record"),
    "gspo_rec_fspo - gspo_rec": ("primary", {"gspo_rec_fspo": 1, "gspo_rec": -1}, "FSPO's band on the record"),
    "gspo_eng_wide - gspo_eng": ("primary", {"gspo_eng_wide": 1, "gspo_eng": -1},
                                 "the fixed wider band on TRL's synchronous route"),
    "gspo_eng_trl - gspo_eng": ("primary", {"gspo_eng_trl": 1, "gspo_eng": -1}, "TRL's default correction"),
    "gspo_ref - grpo_ref": ("secondary", {"gspo_ref": 1, "grpo_ref": -1}, "GSPO against GRPO, float32 sampling"),
    "gspo_eng - grpo_eng": ("secondary", {"gspo_eng": 1, "grpo_eng": -1}, "GSPO against GRPO sampling from llama.cpp"),
    "gspo_rec - grpo_rec": ("secondary", {"gspo_rec": 1, "grpo_rec": -1}, "GSPO against GRPO on llama.cpp's record"),
    "gspo_rec_cal - gspo_eng": ("secondary", {"gspo_rec_cal": 1, "gspo_eng": -1},
                                "does the calibrated band reach the trainer's pi_old"),
}
PRIMARY = [n for n, (family, _, _) in CONTRASTS.items() if family == "primary"]
# Each contrast's paired spread before any run: the nearest contrast of make figures-power (its 30 seeds'
# differences, power.json), read as an estimate of this one's.
PROXIES = {
    "gspo_eng - gspo_ref": "a16 - a32", "grpo_eng - grpo_ref": "a16 - a32",
    "gspo_rec - gspo_eng": "c - a16", "grpo_rec - grpo_eng": "d - b16",
    "(gspo_rec - gspo_eng) - (grpo_rec - grpo_eng)": "(c - a16) - (d - b16)",
    "gspo_rec - gspo_copy_rec": "c - a16", "gspo_rec_cal - gspo_rec": "f - c", "gspo_rec_fspo - gspo_rec": "g - c",
    "gspo_eng_wide - gspo_eng": "e - a32", "gspo_eng_trl - gspo_eng": "a16 - a32",
    "gspo_ref - grpo_ref": "a16 - b16", "gspo_eng - grpo_eng": "a16 - b16", "gspo_rec - grpo_rec": "a16 - b16",
    "gspo_rec_cal - gspo_eng": "f - a16",
}
PROXY_NOTE = ("each contrast's paired spread is the standard deviation over make figures-power's 30 seeds of the "
              "nearest contrast there (power.json: contrasts[...].differences_by_seed): the copy's record stands for "
              "llama.cpp's, a bf16 copy's sampling for llama.cpp's; gspo_rec - gspo_copy_rec and TRL's correction, "
              "with no committed twin, take the record's and bf16 sampling's spreads")
SCORE_RULE = power.SCORE_RULE
TEST_RULE = power.TEST_RULE.replace("The primary family", f"The primary family ({len(PRIMARY)} contrasts)") + (
    "; after the runs each contrast's exact p (every sign pattern, on the grid of the test set) stands beside it, "
    "with Holm's verdict on the exact values")
RESUME_NOTE = ("a run or warm-up is reused only where its summary says it was made on an equal host (CPU, "
               "dispatch level, versions, threads: common.reuse_problem); on another host each is made again, so "
               "a resume there redoes every run, and llama.cpp's draws, like torch's, may differ between hosts")


def values_read() -> dict:
    """The bands' constants, read from make figures-power's design before any run."""
    v = read_json(POWER_JSON)["design"]["values_read"]
    return {"widened_band": v["widened_band"], "fspo_c": v["fspo_c"],
            "from": f"{POWER_JSON}: design.values_read.widened_band and design.values_read.fspo_c"}


def arm_flags(arm: str, values: dict) -> list[str]:
    fill = {"WIDE": ["--eps-low", f"{values['widened_band']['eps_low']:.6g}", "--eps-high",
                     f"{values['widened_band']['eps_high']:.6g}"],
            "FSPO": ["--fspo-band", f"{values['fspo_c']:.6g}"]}
    return [x for f in ARMS[arm][2] for x in fill.get(f, [f])]


def static_design() -> dict:
    """Everything the runs are held to but the seeds (which wait for the prototype)."""
    from studies import engine
    from studies import map as regimes
    values = values_read()
    return {"task": "add2", "model": "dense", "steps": engine.em_steps("dense"),
            "seeds_rule": f"from {FIRST_SEED} up: as many as the prototype projects within {BUDGET_SECONDS // 60} min, "
                          f"at least {FEWEST_SEEDS}, at most {MOST_SEEDS}",
            "warmups": "make figures-map's dense warm-up of each seed (runs/map/"
                       "warmup_dense_s<seed>), made where missing; every arm of a seed starts from it with --seed SEED",
            "engine": "llama.cpp (llama-cpp-python, requirements-engine.txt, native CPU options off): --engine "
                      "llama.cpp:bf16, KV cache f16; the trainer's weights synced before every rollout",
            "arms": {a: {"loss": loss, "what": what, "flags": arm_flags(a, values)} for a, (loss, what, _) in ARMS.items()},
            "contrasts": {n: {"family": f, "terms": t, "question": q} for n, (f, t, q) in CONTRASTS.items()},
            "primary_family": PRIMARY,
            "correction": f"Holm's step-down over the {len(PRIMARY)} primary contrasts at {power.ALPHA}",
            "test": TEST_RULE, "missing_data_rule": SCORE_RULE, "collapse": regimes.COLLAPSE,
            "outcomes": {"primary": "accuracy_after_rl (test set, the final model)",
                         "secondary": [f"reward_last_{power.LAST_STEPS}", "collapsed",
                                       "clip shares by sign of A at minibatch 1 and later",
                                       "engine_kl_tokens and engine_gap_tokens at minibatch 1 (llama.cpp's and the copy's "
                                       "arms): the gap the record handed each step"]},
            "values_read": values, "proxies": PROXY_NOTE, "resume": RESUME_NOTE,
            "budget_seconds": BUDGET_SECONDS, "workers": 2, "threads_per_run": 1,
            "analysis": "studies/power.py: score_run, signed_sum, analyse (sign_flip_p, bootstrap_mean_interval, holm), "
                        "add_exact's exact sign-flip p"}


def design_effects(n: int) -> dict:
    """Per contrast: its proxy's paired spread and the detectable effect at 80% power at n seeds."""
    contrasts = read_json(POWER_JSON)["contrasts"]
    out = {}
    for name, (family, _, _) in CONTRASTS.items():
        diffs = contrasts[PROXIES[name]]["differences_by_seed"]
        sd = statistics.stdev(diffs)
        row = {"proxy": PROXIES[name], "proxy_sd": sd, "proxy_seeds": len(diffs),
               "detectable_uncorrected": power.detectable_effect(sd, n)}
        if family == "primary":
            row["detectable_at_holms_strictest_step"] = power.detectable_effect(sd, n, power.ALPHA / len(PRIMARY))
        out[name] = row
    return out


def projection(proto: dict) -> dict:
    """The target's seconds per seed (half a warm-up, which runs beside an arm, and the prototype's wall
    clock for every arm two at a time) and the seeds kept: as many as fit the budget, within the bounds."""
    per_seed = proto["warmup_seconds"] / 2 + proto["two_at_a_time_seconds"]
    fit = int(BUDGET_SECONDS // per_seed)
    kept = max(FEWEST_SEEDS, min(MOST_SEEDS, fit))
    return {"seconds_per_seed": per_seed, "seeds_that_fit": fit, "seeds_kept": kept,
            "seconds_at_seeds_kept": per_seed * kept, "over_budget": kept > fit,
            "from": "prototype: half its warm-up's seconds and the wall clock of its eleven runs two at a time"}


def write_design() -> dict:
    """engine_power.json before any run: the timed prototype, the projection, the design with its seeds
    and the detectable effect at those seeds. A file holding this design is kept; another is never
    overwritten."""
    static = static_design()
    if os.path.exists(JSON):
        old = read_json(JSON)
        if {k: v for k, v in old["design"].items() if k not in ("seeds", "detectable_effect")} != \
                json.loads(json.dumps(static, allow_nan=False)):
            fail(f"{JSON} holds another design than the code's; move it away to write this one")
        return old
    t0 = time.perf_counter()
    proto = power.prototype(static, RUNS)
    proj = projection(proto)
    seeds = list(range(FIRST_SEED, FIRST_SEED + proj["seeds_kept"]))
    design = {**static, "seeds": seeds, "detectable_effect": {"seeds": len(seeds), "by_contrast": design_effects(len(seeds))}}
    record = {"figures_engine_power_seconds": 0.0, "design": design, "prototype": proto, "projection": proj,
              "runs": [], "arms": {}, "contrasts": {}}
    write_json(JSON, record, "python studies/engine_power.py design", time.perf_counter() - t0)
    return record


def engine_medians(design: dict, runs: list[dict]) -> dict:
    """Per arm, the median over its runs of each step's minibatch-1 engine gap and KL (None off the engine)."""
    out = {}
    for arm in design["arms"]:
        rows = []
        for r in runs:
            if r["arm"] != arm:
                continue
            with open(os.path.join(RUNS, power.run_name(arm, r["seed"]), "metrics.jsonl")) as f:
                steps = [x for x in map(json.loads, f) if x.get("stage") == "rl"]
            rows.append({k: statistics.median(s[k] for s in steps) if steps and k in steps[0] else None
                         for k in ("engine_gap_tokens", "engine_kl_tokens", "engine_log_s_mean")})
        out[arm] = {k + "_median": power.median_or_none([x[k] for x in rows]) for k in
                    ("engine_gap_tokens", "engine_kl_tokens", "engine_log_s_mean")}
    return out


def figures_engine_power() -> dict:
    if not os.path.exists(JSON):
        fail(f"make figures-engine-power runs the design in {JSON}: write it first with "
             "`.venv-engine/bin/python studies/engine_power.py design`")
    record = write_design()
    record.setdefault("design_written", {k: record.get(k) for k in ("command", "seconds", "measured_at_commit",
                                                                  "dirty", "dirty_paths")})
    d = record["design"]
    ledger = Ledger(os.path.join(RUNS, "figures_seconds.json"))
    try:
        run_jobs(power.arm_jobs(d, d["seeds"], RUNS), RUNS)
    finally:
        ledger.close()
    record["runs"] = power.collect(d, RUNS)
    record["arms"], record["contrasts"] = power.analysis(d, record["runs"])
    for arm, extra in engine_medians(d, record["runs"]).items():
        record["arms"][arm].update(extra)
    record["figures_engine_power_seconds"] = ledger.total()
    return power.add_exact(record, JSON, "python studies/engine_power.py figures")


@cli
def main(argv=None) -> int:
    parser = Parser(description=__doc__.splitlines()[0])
    parser.add_argument("what", choices=["design", "figures", "redraw"])
    what = parser.parse_args(argv).what
    if what == "redraw":
        power.plot_power(read_json(JSON), PNG, "llama.cpp in the loop: add2, 70 RL steps, design fixed before the runs "
                                               "(make figures-engine-power)")
        print(PNG)
        return 0
    import gspo_lab as g
    g.engine_modules()                                  # the engine extra, or one line naming it
    from transformers.utils import logging as hf_logging
    hf_logging.disable_progress_bar()
    if what == "design":
        record = write_design()
        p = record["projection"]
        print(f"{JSON}: {len(record['design']['arms'])} arms x {p['seeds_kept']} seeds, projected "
              f"{p['seconds_at_seeds_kept'] / 60:.0f} min of {BUDGET_SECONDS // 60} ({p['seeds_that_fit']} seeds fit)")
        return 0
    record = figures_engine_power()
    write_result(JSON, record, "python studies/engine_power.py figures", record["figures_engine_power_seconds"])
    power.plot_power(record, PNG, "llama.cpp in the loop: add2, 70 RL steps, design fixed before the runs "
                                  "(make figures-engine-power)")
    for name, v in record["contrasts"].items():
        lo, hi = v["ci95"]
        print(f"{name:46s} {v['mean_difference']:+.3f} [{lo:+.3f}, {hi:+.3f}] {v['positive']}+ {v['negative']}- "
              f"p {v['p']:.3g}, exact {v['p_exact']:.3g} | {v['verdict']}")
    print(JSON, PNG)
    return 0


if __name__ == "__main__":
    sys.exit(main())

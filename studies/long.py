"""make figures-long: long answers (--task addwork), where per-token and per-sequence ratios can part.

    python studies/long.py     # `make figures-long`: figures/long.json, long_accuracy.png,
                               # long_aggregation.png, long_variance.png; resumable (runs/long)

addwork answers a + b with its column working, then the sum: 15 to 60 tokens instead of add2's 2 to
4. One warm-up per seed (`python studies/long.py _warmup SEED OUT`, a child process of the target:
the script's own warm-up, saved as the checkpoint every RL run of that seed starts from), then 60 RL
steps of each group, seeds 0, 1, 2: GSPO, GSPO-token and GRPO; GSPO and GRPO with `--aggregation
dapo` (each token weighted alike, so each response by its length); GSPO and GRPO at 8 minibatches
per rollout (further off-policy, twice the optimiser steps); GSPO with its rewards shuffled (the
control). Then Var(log s) against length on the task's own natural answers (EOS never suppressed)
and each run's accuracy on the short and the long half of the test set. The claims it serves
(results.md): "Learning from the reward" and "When GSPO and GRPO differ in learning" on long
answers, "Per-response weighting" (paper against dapo), "Variance against length" on natural
answers, and "Clipping: GSPO against GRPO" at 4 and 8 minibatches.
"""
from __future__ import annotations

import contextlib
import json
import os
import random
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))   # gspo_minimal, studies

import torch  # noqa: E402

import gspo_lab as g  # noqa: E402
from studies.common import (DEFAULTS, FIG_DIR, SEEDS, STYLE, Ledger, Parser, big_rollout,  # noqa: E402
                            binned_variance, cli, fail, loglog_slope, logprobs_in_chunks, one_update,
                            read_metrics, read_json, read_summary, reused_runs, run_jobs, script_job,
                            variance_panels, variance_profile, warm_optimizer, warm_start, warm_start_argv, write_json)


# The files this target writes into figures/: its own outputs, left out of its dirty check
# (gspo_minimal.tree_state, taken by studies.common.cli when it starts).
OUTPUTS = ("figures/long.json",
           "figures/long_accuracy.png",
           "figures/long_aggregation.png",
           "figures/long_variance.png",)

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
    """The script's own warm-up for `--task addwork --seed SEED`, saved as the checkpoint that every
    RL run of that seed starts from (studies.common.warm_start)."""
    warm_start(["--task", "addwork", *extra], seed, out,
               " ".join(["python studies/long.py _warmup", str(seed), out, *extra]))


def long_runs() -> list[tuple[str, list[str]]]:
    """Every RL run of make figures-long, seed 0's first, with its flags."""
    return [(f"{group}_s{seed}", ["--task", "addwork", "--model", os.path.join(warm_dir(seed), "checkpoint"),
                                  "--warmup-max-steps", "0", "--seed", str(seed), *flags])
            for seed in SEEDS for group, flags in LONG_GROUPS.items()]


def long_jobs() -> list[dict]:
    """The warm-ups, then the RL runs, each waiting for its seed's warm-up."""
    jobs = [{"name": f"warmup_s{seed}", "cmd": [sys.executable, "studies/long.py", "_warmup", str(seed),
                                                 warm_dir(seed), *LONG_EXTRA],
             "done": os.path.join(warm_dir(seed), "summary.json"), "needs": None,
             "argv": warm_start_argv(["--task", "addwork", *LONG_EXTRA], seed, warm_dir(seed))} for seed in SEEDS]
    for name, args in long_runs():
        seed = int(args[args.index("--seed") + 1])
        jobs.append(script_job(name, args, LONG_RUNS, LONG_STEPS, needs=jobs[seed]["done"], extra=LONG_EXTRA))
    return jobs


def length_split(task: str = "addwork") -> dict[str, list]:
    """The test problems in two halves by the length of their solutions, short and long (sorted
    by length, ties in the test set's order, cut in the middle)."""
    test = g.make_splits(g.TASKS[task], DEFAULTS.test_size, DEFAULTS.val_size)["test"]
    ranked = sorted(test, key=lambda p: len(g.TASKS[task].solution(*p)))
    return {"short": ranked[:len(ranked) // 2], "long": ranked[len(ranked) // 2:]}


def accuracy_by_length(checkpoint: str) -> dict:
    """Greedy test accuracy of a checkpoint on the short and on the long half of the test set."""
    model, tok = g.load_pretrained(checkpoint)
    return {half: g.accuracy(model, tok, g.TASKS["addwork"], probs, g.TASK_DEFAULTS["addwork"]["max_new_tokens"], "cpu")
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
        return read_json(path)
    res = fn()
    with open(path, "w") as f:
        json.dump(res, f, indent=2, allow_nan=False)
    return res


def long_summary(variance: dict, by_length: dict) -> dict:
    """figures/long.json: every run with its settings and results, medians per group, the variance study."""
    import numpy as np
    tok = g.build_char_tokenizer(g.TASKS["addwork"])
    test = g.make_splits(g.TASKS["addwork"], DEFAULTS.test_size, DEFAULTS.val_size)["test"]
    ref = np.array([len(tok(g.TASKS["addwork"].solution(a, b), add_special_tokens=False).input_ids) + 1
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
    os.makedirs(FIG_DIR, exist_ok=True)
    path = os.path.join(FIG_DIR, "long.json")
    jobs = long_jobs()
    reused = [n for n in reused_runs(jobs) if not n.startswith("warmup_")]       # the RL runs kept
    ledger = Ledger(os.path.join(LONG_RUNS, "seconds.json"))
    try:
        if run_jobs(jobs, LONG_RUNS):          # a run was (re)made: what is computed from them too
            for cache in ("variance.json", "by_length.json"):
                with contextlib.suppress(FileNotFoundError):
                    os.remove(os.path.join(LONG_RUNS, cache))
        print("the variance of log s on natural answers, and each run's accuracy on short and long "
              "problems", flush=True)
        variance = cached(os.path.join(LONG_RUNS, "variance.json"), long_variance)
        by_length = cached(os.path.join(LONG_RUNS, "by_length.json"), lambda: {
            name: accuracy_by_length(os.path.join(LONG_RUNS, name, "checkpoint"))
            for name in [f"warmup_s{seed}" for seed in SEEDS] + [n for n, _ in long_runs()]})
    finally:
        ledger.close()
    summary = long_summary(variance, by_length)
    summary["runs_reused"] = reused
    ledger.record(summary, "figures_long_seconds")
    write_json(path, summary, "python studies/long.py", summary["figures_long_seconds"])
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


@cli
def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "_warmup":                    # child process of figures-long
        if len(argv) < 3 or not argv[1].isdigit():
            fail("usage: python studies/long.py _warmup SEED OUT [gspo_minimal flags]")
        long_warmup(int(argv[1]), argv[2], argv[3:])
        return 0
    Parser(description=__doc__.splitlines()[0]).parse_args(argv)
    from transformers.utils import logging as hf_logging
    hf_logging.disable_progress_bar()
    figures_long()
    return 0


if __name__ == "__main__":
    sys.exit(main())

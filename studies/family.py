"""make figures-family: every relative of GSPO on add2, beside GSPO and GRPO, at make figures' settings.

    python studies/family.py     # `make figures-family`: about 32 minutes on 2 cores;
                                 # figures/family.json, family_accuracy.png, family_clip.png; resumable

Runs GSPO, GRPO, GMPO, SAPO (token and sequence), CISPO, LUSPO and VESPO, each with the script's
default widths for its loss (gspo_minimal.DEFAULT_EPS), 200 RL steps after the script's warm-up,
seeds 0, 1, 2 (24 runs in runs/family, two at a time on one thread each). Keeps per run its accuracies, how many tokens it
clipped (or, for SAPO and VESPO, gated below half weight), its response lengths and seconds, and per
loss the medians over seeds. The claim it serves (results.md, "When GSPO and GRPO differ in learning"
and "Clipping: GSPO against GRPO"): where the relatives part from GSPO and GRPO on one small task, at
one learning rate, and how often each one's clip or gate acts at all.
"""
from __future__ import annotations

import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))   # gspo_minimal, studies

from studies.common import (FIG_DIR, FIG_STEPS, SEEDS, STYLE, Ledger, Parser, accuracy_curves, cli,  # noqa: E402
                            figure_jobs, read_metrics, reused_runs, run_all, run_record, write_json)


# The files this target writes into figures/: its own outputs, left out of its dirty check
# (gspo_minimal.tree_state, taken by studies.common.cli when it starts).
OUTPUTS = ("figures/family.json",
           "figures/family_accuracy.png",
           "figures/family_clip.png",)

# ---------------------------------------------------------------------------------------------
# make figures-family: every relative of GSPO on add2 at make figures' settings, with GSPO and GRPO
# ---------------------------------------------------------------------------------------------
FAMILY_RUNS = "runs/family"
FAMILY = ("gspo", "grpo", "gmpo", "sapo", "sapo-seq", "cispo", "luspo", "vespo")
GATES = ("sapo", "sapo-seq", "vespo")


def family_runs() -> list[tuple[str, list[str]]]:
    return [(f"{loss}_s{seed}", ["--loss", loss, "--seed", str(seed)]) for loss in FAMILY for seed in SEEDS]


def family_summary() -> dict:
    import numpy as np
    runs = []
    for name, args in family_runs():
        run, s, rl = run_record(name, args, FAMILY_RUNS)
        run.update(rl_seconds=s["rl_seconds"],
                   mean_response_tokens_first_10_steps=statistics.fmean(r["response_tokens"] for r in rl[:10]),
                   mean_response_tokens_last_10_steps=statistics.fmean(r["response_tokens"] for r in rl[-10:]))
        if run["loss"] in GATES:
            run["gate_tokens"] = statistics.fmean(r["gate_tokens"] for r in rl)
        runs.append(run)
    by_loss = {}
    for loss in FAMILY:
        rs = [r for r in runs if r["loss"] == loss]
        by_loss[loss] = {"median_after": float(np.median([r["accuracy_after_rl"] for r in rs])),
                         "median_before": float(np.median([r["accuracy_before_rl"] for r in rs])),
                         "seeds_after": [r["accuracy_after_rl"] for r in rs],
                         "median_clip_tokens": float(np.median([r["clip_tokens"] for r in rs])),
                         "median_gate_tokens": (float(np.median([r["gate_tokens"] for r in rs]))
                                                if loss in GATES else None),
                         "median_rl_seconds": float(np.median([r["rl_seconds"] for r in rs]))}
    return {"task": "add2", "steps": FIG_STEPS, "seeds": list(SEEDS), "runs": runs, "by_loss": by_loss}


def plot_family(plt, summary: dict) -> None:
    """family_accuracy.png: validation accuracy against RL step and against each run's own elapsed
    time; family_clip.png: clip_tokens (gate_tokens for the smooth gates) and response length."""
    import numpy as np
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(13, 4.8))
    for loss in FAMILY:
        names = [f"{loss}_s{seed}" for seed in SEEDS]
        curves = [[r for r in read_metrics(n, FAMILY_RUNS) if r["stage"] == "rl" and "val_acc" in r]
                  for n in names]
        steps = np.array([r["step"] for r in curves[0]])
        ys = np.array([[r["val_acc"] for r in c] for c in curves])
        colour, ls, marker = STYLE[loss]
        a1.plot(steps, np.median(ys, 0), color=colour, ls=ls, marker=marker, markevery=4, label=loss)
    a1.set_xlabel("RL step")
    a1.set_ylabel("validation accuracy (greedy), median of 3 seeds")
    a1.set_title("every relative of GSPO on add2, make figures' settings", fontsize=10)
    a1.grid(alpha=0.3)
    a1.legend(fontsize=8, ncol=2)
    accuracy_curves(a2, {loss: [f"{loss}_s{seed}" for seed in SEEDS] for loss in ("gspo", "grpo", "gmpo", "cispo")},
                    "against time: four of them, with seed bands", FAMILY_RUNS)
    fig.tight_layout()
    fig.savefig(os.path.join(FIG_DIR, "family_accuracy.png"), dpi=120)
    fig, (b1, b2) = plt.subplots(1, 2, figsize=(13, 4.5))
    for loss in FAMILY:
        per_seed = [[r for r in read_metrics(f"{loss}_s{seed}", FAMILY_RUNS) if r["stage"] == "rl"]
                    for seed in SEEDS]
        key = "gate_tokens" if loss in GATES else "clip_tokens"
        steps = np.array([r["step"] for r in per_seed[0]])
        colour, ls, marker = STYLE[loss]
        clip = np.median([[r[key] for r in rs] for rs in per_seed], 0)
        length = np.median([[r["response_tokens"] for r in rs] for rs in per_seed], 0)
        k = 10                                                          # a 10-step running mean
        smooth = np.convolve(clip, np.ones(k) / k, mode="valid")
        b1.plot(steps[k - 1:], smooth, color=colour, ls=ls, label=f"{loss} ({key})")
        b2.plot(steps[k - 1:], np.convolve(length, np.ones(k) / k, mode="valid"), color=colour, ls=ls,
                label=loss)
    b1.set_xlabel("RL step")
    b1.set_ylabel("share of tokens, median of 3 seeds, 10-step mean")
    b1.set_title("clip_tokens; gate_tokens (gate weight below 1/2) for SAPO and VESPO", fontsize=10)
    b1.grid(alpha=0.3)
    b1.legend(fontsize=7, ncol=2)
    b2.set_xlabel("RL step")
    b2.set_ylabel("response_tokens (EOS included)")
    b2.set_title("mean response length", fontsize=10)
    b2.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(os.path.join(FIG_DIR, "family_clip.png"), dpi=120)


def figures_family() -> dict:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    os.makedirs(FIG_DIR, exist_ok=True)
    path = os.path.join(FIG_DIR, "family.json")
    reused = reused_runs(figure_jobs(family_runs(), FAMILY_RUNS))
    ledger = Ledger(os.path.join(FAMILY_RUNS, "seconds.json"))
    try:
        run_all(family_runs(), folder=FAMILY_RUNS)
    finally:
        ledger.close()
    summary = family_summary()
    summary["runs_reused"] = reused
    ledger.record(summary, "figures_family_seconds")
    # the numbers first: new PNGs beside them would read as a dirty tree
    write_json(path, summary, "python studies/family.py", summary["figures_family_seconds"])
    plot_family(plt, summary)
    plt.close("all")
    print(f"{'loss':9s} {'test acc before -> after (median of 3)':40s} {'seeds after':24s} "
          f"{'clip/gate tokens':>16s} {'RL s':>6s}")
    for loss, r in summary["by_loss"].items():
        share = r["median_gate_tokens"] if loss in GATES else r["median_clip_tokens"]
        print(f"{loss:9s} {r['median_before']:.3f} -> {r['median_after']:.3f}{'':26s} "
              f"{', '.join(f'{a:.3f}' for a in r['seeds_after']):24s} {share:16.4f} "
              f"{r['median_rl_seconds']:6.0f}")
    print(f"{FIG_DIR}/family_accuracy.png, {FIG_DIR}/family_clip.png, {path}, "
          f"{summary['figures_family_seconds']:.0f} s")
    return summary


@cli
def main(argv=None) -> int:
    Parser(description=__doc__.splitlines()[0]).parse_args(argv)
    from transformers.utils import logging as hf_logging
    hf_logging.disable_progress_bar()
    figures_family()
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""make figures: the runs the plots need, three seeds each, and the PNGs of figures/.

    python studies/figures.py     # `make figures`: about 31 minutes on 2 cores (make train and make
                                  # verify included), figures/figures.json and the PNGs; resumable
                                  # (a finished run in runs/figures is kept)

Runs, 200 RL steps each after the script's warm-up, seeds 0, 1, 2, two at a time on one thread each:
GSPO, GSPO-token and GRPO on the dense model; GSPO and GRPO on the tiny mixture of experts; GSPO with
its rewards shuffled (the control). It also needs runs/verify/verify.json (`make verify`, run first
when missing), whose numbers it copies into figures.json and draws. The claims they serve:
  * the model learns from the reward, not from the update alone: GSPO against its control
    (results.md, "Learning from the reward"; reward_vs_step.png);
  * GSPO, GSPO-token and GRPO against time, dense and MoE (results.md, "When GSPO and GRPO differ in
    learning"; accuracy_vs_time.png, moe_gspo_vs_grpo.png);
  * GSPO clips far more tokens than GRPO, under a ceiling neither can pass (results.md, "Clipping:
    GSPO against GRPO"; clip_fraction.png, log_s_by_minibatch.png, clipped_objective.png);
  * Var(log s) against length and MoE routing from verify.json (results.md, "Variance against
    length", "MoE routing"; variance_vs_length.png, moe_routing.png); rollout_timeline.png draws
    which weights give pi_new and pi_old in each minibatch.
"""
from __future__ import annotations

import math
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))   # gspo_minimal, studies

import torch  # noqa: E402

import gspo_lab as g  # noqa: E402
from studies.common import (FIG_DIR, FIG_RUNS, FIG_STEPS, SEEDS, STYLE, Parser, accuracy_curves,  # noqa: E402
                            Ledger, cli, figure_jobs, kept_problem, read_json, read_metrics, reused_runs, run_all, run_record, variance_panels,
                            write_json)
from studies.verify import VERIFY_DIR, verify  # noqa: E402

# The files this target writes into figures/: its own outputs, left out of its dirty check
# (gspo_minimal.tree_state, taken by studies.common.cli when it starts).
OUTPUTS = ("figures/figures.json",
           "figures/accuracy_vs_time.png",
           "figures/moe_gspo_vs_grpo.png",
           "figures/variance_vs_length.png",
           "figures/clip_fraction.png",
           "figures/moe_routing.png",
           "figures/clipped_objective.png",
           "figures/rollout_timeline.png",
           "figures/log_s_by_minibatch.png",
           "figures/reward_vs_step.png",)


# ---------------------------------------------------------------------------------------------
# make figures: its runs, its plots, figures.json
# ---------------------------------------------------------------------------------------------
def figure_runs() -> list[tuple[str, list[str]]]:
    """Every run `make figures` makes, with the flags that differ from the script's defaults."""
    runs = [(f"{loss}_s{seed}", ["--loss", loss, "--seed", str(seed)])
            for loss in ("gspo", "gspo-token", "grpo") for seed in SEEDS]
    runs += [(f"moe_{loss}_s{seed}", ["--moe", "--loss", loss, "--seed", str(seed)])
             for loss in ("gspo", "grpo") for seed in SEEDS]
    runs += [(f"control_s{seed}", ["--shuffle-rewards", "--seed", str(seed)]) for seed in SEEDS]
    return runs


def plot_clipped_objective(plt) -> None:
    """The clipped term min(s A, clip(s) A) against s for A = +1 and A = -1, GSPO's band."""
    lo, hi = g.DEFAULT_EPS["gspo"]
    s = torch.linspace(1 - 4 * lo, 1 + 4 * hi, 801, dtype=torch.float64)
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8), sharey=False)
    for ax, adv in zip(axes, (1.0, -1.0)):
        a = torch.full_like(s, adv)
        term = g.clipped_surrogate(s, a, lo, hi)
        dead = g.clipped_on_active_side(s, a, lo, hi)
        x = (s - 1).numpy() * 1e4
        ax.plot(x, term.numpy(), color="#0072B2", lw=2, label="min(s A, clip(s, 1-eps_low, 1+eps_high) A)")
        ax.plot(x, (s * a).numpy(), color="#D55E00", ls=":", label="s A (unclipped)")
        ax.axvspan(-lo * 1e4, hi * 1e4, color="#999999", alpha=0.2, label="the band: [1-eps_low, 1+eps_high]")
        xs = x[dead.numpy()]
        ax.axvspan(xs.min(), xs.max(), color="#E69F00", alpha=0.25, hatch="//",
                   label="clipped on its active side: zero gradient")
        ax.set_title(f"A {'> 0' if adv > 0 else '< 0'} (A = {adv:+.0f})")
        ax.set_xlabel("s - 1, in units of 1e-4")
        ax.set_ylabel("objective term (maximised)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="upper left" if adv > 0 else "upper right")
    fig.suptitle("GSPO's clipped term for one response, eps_low = 3e-4, eps_high = 4e-4", fontsize=10)
    fig.tight_layout()
    fig.savefig(os.path.join(FIG_DIR, "clipped_objective.png"), dpi=120)


def plot_rollout_timeline(plt) -> None:
    """Which weights give pi_new and pi_old for each minibatch of one rollout (4 minibatches)."""
    fig, ax = plt.subplots(figsize=(10, 3.4))
    boxes = [(0.0, 2.0, "sample the rollout\nwith theta_0\n(pi_old = theta_0)", "#56B4E9"),
             (2.2, 1.8, "one no-grad pass:\nlog pi_old for\nminibatches 2-4", "#CCCCCC")]
    for k in range(4):
        boxes.append((4.2 + 1.5 * k, 1.3, f"minibatch {k + 1}\npi_new = theta_{k}\n"
                      f"pi_old = theta_0\n" + ("s = 1 exactly" if k == 0 else "off-policy"),
                      "#009E73" if k == 0 else "#E69F00"))
    for x, w, text, colour in boxes:
        ax.add_patch(plt.Rectangle((x, 0.3), w, 1.4, facecolor=colour, edgecolor="black", alpha=0.6))
        ax.text(x + w / 2, 1.0, text, ha="center", va="center", fontsize=8)
    for k in range(4):
        x = 4.2 + 1.5 * k + 1.3
        ax.annotate(f"step: theta_{k}\n-> theta_{k + 1}", (x, 0.3), (x, -0.35), ha="center", fontsize=7,
                    arrowprops=dict(arrowstyle="->"))
    ax.set_xlim(-0.2, 10.4)
    ax.set_ylim(-0.6, 2.0)
    ax.axis("off")
    ax.set_title("One GSPO step (`rl_update`): every minibatch is compared with the policy that "
                 "sampled the rollout", fontsize=10)
    fig.tight_layout()
    fig.savefig(os.path.join(FIG_DIR, "rollout_timeline.png"), dpi=120)


def plot_log_s_by_minibatch(plt, v: dict) -> None:
    import numpy as np
    lo, hi = g.DEFAULT_EPS["gspo"]
    per_mb = v["log_s_by_minibatch"]
    fig, axes = plt.subplots(1, len(per_mb), figsize=(12, 3.2), sharey=True)
    edges = np.linspace(-0.6, 0.6, 61)
    for k, (ax, vals) in enumerate(zip(axes, per_mb)):
        vals = np.array(vals)
        ax.hist(np.clip(vals, edges[0], edges[-1]), bins=edges, color="#0072B2", alpha=0.7)
        ax.axvspan(math.log(1 - lo), math.log(1 + hi), color="#D55E00", alpha=0.8)
        inside = np.mean((vals >= math.log(1 - lo)) & (vals <= math.log(1 + hi)))
        ax.set_title(f"minibatch {k + 1}: {inside:.1%} inside the band", fontsize=9)
        ax.set_xlabel("log s (nats per token)")
    axes[0].set_ylabel("responses")
    fig.suptitle(f"log s of every response by minibatch position ({len(per_mb[0])} responses each: "
                 f"{v['clip_steps']} GSPO steps from one run state, lr {v['clip_lr']:.1e}; values "
                 f"beyond +-0.6 piled at the edges). Orange: GSPO's band, "
                 f"[{math.log(1 - lo):.1e}, {math.log(1 + hi):.1e}], narrower than the line", fontsize=8)
    fig.tight_layout()
    fig.savefig(os.path.join(FIG_DIR, "log_s_by_minibatch.png"), dpi=120)


def plot_control(plt) -> None:
    """Reward and validation accuracy against RL step: GSPO against the shuffled-reward control."""
    import numpy as np
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4))
    for group in ("gspo", "control"):
        colour, ls, marker = STYLE[group]
        runs = [[r for r in read_metrics(f"{group}_s{s}") if r["stage"] == "rl"] for s in SEEDS]
        reward = np.array([[r["reward"] for r in run[:FIG_STEPS]] for run in runs])
        k = 10
        smooth = np.array([np.convolve(x, np.ones(k) / k, mode="valid") for x in reward])
        steps = np.arange(k, FIG_STEPS + 1)
        label = "GSPO" if group == "gspo" else "GSPO, rewards shuffled (control)"
        a1.plot(steps, np.median(smooth, 0), color=colour, ls=ls, label=f"{label}: median of 3 seeds")
        a1.fill_between(steps, smooth.min(0), smooth.max(0), color=colour, alpha=0.15)
        evals = [[(r["step"], r["val_acc"]) for r in run if "val_acc" in r] for run in runs]
        xs = [st for st, _ in evals[0]]
        acc = np.array([[a for _, a in e] for e in evals])
        a2.plot(xs, np.median(acc, 0), color=colour, ls=ls, marker=marker, label=label)
        a2.fill_between(xs, acc.min(0), acc.max(0), color=colour, alpha=0.15)
    a1.set_xlabel("RL step")
    a1.set_ylabel("mean reward of the rollout (10-step average)")
    a2.set_xlabel("RL step")
    a2.set_ylabel("validation accuracy (greedy)")
    for ax in (a1, a2):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle("RL steps after the warm-up. Left: 10-step average, so it starts at step 10; right: "
                 "evaluated every 10 steps. Shaded: lowest to highest of 3 seeds.", fontsize=9)
    fig.tight_layout()
    fig.savefig(os.path.join(FIG_DIR, "reward_vs_step.png"), dpi=120)


def plot_variance(plt, v: dict) -> None:
    L = v["variance_lengths"]
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4.2))
    variance_panels(a1, a2, L, v["variance_log_s"], v["variance_log_s_ci95_by_length"],
                    v["variance_uncorrelated"], v["variance_by_position"], "response",
                    "Var(log s), real update (95% bootstrap CI)")
    a1.loglog(L, v["variance_independent"], color="#009E73", ls=":", marker="s",
              label="synthetic independent tokens (slope -1)")
    a1.set_xlabel("prefix length L (tokens)")
    lo, hi = v["variance_slope_log_s_ci95"]
    a1.set_title(f"slope {v['variance_slope_log_s']:+.2f} [{lo:+.2f}, {hi:+.2f}]; "
                 f"uncorrelated reference {v['variance_slope_uncorrelated']:+.2f}", fontsize=9)
    a1.legend(fontsize=7)
    a2.set_title("per-position variance: the EOS-suppressed text is not stationary", fontsize=9)
    fig.tight_layout()
    fig.savefig(os.path.join(FIG_DIR, "variance_vs_length.png"), dpi=120)


def plot_clip_fraction(plt) -> None:
    import numpy as np
    fig, ax = plt.subplots(figsize=(7, 4.5))
    k = 10                                                   # 10-step moving average
    for loss in ("gspo", "grpo"):
        colour, ls, marker = STYLE[loss]
        for key, width, label in (("clip_tokens", 2.0, "clip_tokens"),
                                  ("clip_ceiling", 0.8, "clip_ceiling (cannot be exceeded)")):
            series = [[r[key] for r in read_metrics(f"{loss}_s{s}") if r["stage"] == "rl"]
                      for s in SEEDS]
            y = np.median(np.array([x[:FIG_STEPS] for x in series]), 0)
            y = np.convolve(y, np.ones(k) / k, mode="valid")
            ax.semilogy(np.arange(len(y)) + k, np.maximum(y, 1e-5), color=colour, lw=width,
                        ls=ls if key == "clip_tokens" else "-", marker=marker if key == "clip_tokens"
                        else None, markevery=20, label=f"{loss}: {label}")
    ax.set_xlabel("RL step (the learning rate decays linearly to 0 over the 200 steps)")
    ax.set_ylabel("share of completion tokens")
    ax.set_title("Clip fraction over training (median of 3 seeds, 10-step average;\n"
                 "a share of 0 is drawn at 1e-5)", fontsize=10)
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(os.path.join(FIG_DIR, "clip_fraction.png"), dpi=120)


def plot_moe(plt, v: dict) -> None:
    import numpy as np
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 4))
    by_layer = v["moe_routing_change_by_layer"]
    a1.bar(range(1, len(by_layer) + 1), by_layer, color="#56B4E9", edgecolor="black")
    a1.set_xticks(range(1, len(by_layer) + 1))
    a1.set_xlabel("layer")
    a1.set_ylabel("share of activated experts that changed")
    a1.set_title("Tiny MoE: routing after one GSPO update", fontsize=10)
    moe = v["ratio_spread"]["moe"]
    dense = v["ratio_spread"]["dense"]
    labels = ["dense:\nevery token", "MoE: route\nkept", "MoE: route changed\n(some layer)"]
    vals = [dense["token_logratio_std"], moe["token_logratio_std_route_kept"],
            moe["token_logratio_std_route_changed"]]
    a2.bar(np.arange(3), vals, color=["#0072B2", "#009E73", "#E69F00"], edgecolor="black")
    a2.set_xticks(np.arange(3), labels, fontsize=8)
    a2.set_ylabel("std of token log-ratios after one update (nats)")
    a2.set_title(f"{moe['tokens_route_changed']:.0%} of MoE tokens changed route in some layer",
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(os.path.join(FIG_DIR, "moe_routing.png"), dpi=120)


def figures() -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    os.makedirs(FIG_RUNS, exist_ok=True)
    os.makedirs(FIG_DIR, exist_ok=True)
    reused = reused_runs(figure_jobs(figure_runs()))
    ledger = Ledger(os.path.join(FIG_RUNS, "seconds.json"))
    try:
        why = kept_problem(os.path.join(VERIFY_DIR, "verify.json"), g.host_fingerprint())
        if why:                                   # missing, or made on another host
            verify()
        run_all(figure_runs())
    finally:
        ledger.close()
    v = read_json(os.path.join(VERIFY_DIR, "verify.json"))

    for names, title, file in (
            ({loss: [f"{loss}_s{s}" for s in SEEDS] for loss in ("gspo", "gspo-token", "grpo")},
             "Dense model, 2-digit addition: GSPO, GSPO-token, GRPO", "accuracy_vs_time.png"),
            ({loss: [f"moe_{loss}_s{s}" for s in SEEDS] for loss in ("gspo", "grpo")},
             "Tiny mixture-of-experts model: GSPO against GRPO", "moe_gspo_vs_grpo.png")):
        fig, ax = plt.subplots(figsize=(7.5, 4.8))
        accuracy_curves(ax, names, title)
        fig.tight_layout()
        fig.savefig(os.path.join(FIG_DIR, file), dpi=120)
    plot_variance(plt, v)
    plot_clip_fraction(plt)
    plot_moe(plt, v)
    plot_clipped_objective(plt)
    plot_rollout_timeline(plt)
    plot_log_s_by_minibatch(plt, v)
    plot_control(plt)
    plt.close("all")
    summary = figure_summary()
    summary["runs_reused"] = reused
    ledger.record(summary, "figures_seconds")
    summary["verify"] = {k: val for k, val in v.items() if k not in ("log_s_by_minibatch",
                                                                     "variance_by_position",
                                                                     "mean_by_position")}
    write_json(os.path.join(FIG_DIR, "figures.json"), summary, "python studies/figures.py",
               summary["figures_seconds"])
    for group, r in summary["test_accuracy"].items():
        print(f"{group:10s} test accuracy before -> after {FIG_STEPS} RL steps: median "
              f"{r['median_before']:.3f} -> {r['median']:.3f} (seeds after: "
              f"{', '.join(f'{a:.3f}' for a in r['seeds'])})")
    for loss, r in summary["clip_tokens"].items():
        print(f"{loss:10s} clip_tokens, median of 3 seeds: steps 1-{FIG_STEPS // 2} "
              f"{r['first_half']:.3f}, steps {FIG_STEPS // 2 + 1}-{FIG_STEPS} {r['second_half']:.3f} "
              f"(clip_ceiling {r['ceiling_first_half']:.3f}, {r['ceiling_second_half']:.3f})")
    print(f"figures written to {FIG_DIR}/ with their numbers in {FIG_DIR}/figures.json, "
          f"in {summary['figures_seconds']:.0f} s")


def figure_summary() -> dict:
    """The numbers results.md quotes from the figure runs: every run's settings and results, the
    per-group medians, and the dense runs' clip fractions over each half of training."""
    import numpy as np
    runs, groups = [], {}
    for name, args in figure_runs():
        run, s, _ = run_record(name, args)
        runs.append({**run, "warmup_steps": s["warmup_steps"]})
        groups.setdefault(name.rsplit("_s", 1)[0], []).append(runs[-1])
    accuracy = {group: {"median": float(np.median([r["accuracy_after_rl"] for r in rs])),
                        "median_before": float(np.median([r["accuracy_before_rl"] for r in rs])),
                        "seeds": [r["accuracy_after_rl"] for r in rs],
                        "seeds_before": [r["accuracy_before_rl"] for r in rs]}
                for group, rs in groups.items()}
    clip = {}
    half = FIG_STEPS // 2
    for loss in ("gspo", "grpo"):
        out = {}
        for key, name in (("clip_tokens", ""), ("clip_ceiling", "ceiling_")):
            per_seed = [[r[key] for r in read_metrics(f"{loss}_s{s}") if r["stage"] == "rl"]
                        for s in SEEDS]
            out[name + "first_half"] = float(np.median([np.median(x[:half]) for x in per_seed]))
            out[name + "second_half"] = float(np.median([np.median(x[half:]) for x in per_seed]))
        clip[loss] = out
    return {"steps": FIG_STEPS, "seeds": list(SEEDS), "runs": runs, "test_accuracy": accuracy,
            "clip_tokens": clip}


@cli
def main(argv=None) -> int:
    Parser(description=__doc__.splitlines()[0]).parse_args(argv)
    from transformers.utils import logging as hf_logging
    hf_logging.disable_progress_bar()
    figures()
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Measurements of what the GSPO papers predict, on a model you trained yourself with `make train`.

    python experiments.py verify     # `make verify`: writes runs/verify/verify.json, prints a table
    python experiments.py figures    # `make figures`: the runs the plots need, PNGs into figures/
    python experiments.py sampler    # hand-written KV-cached sampler against transformers' generate

Everything here imports gspo_minimal and adds no training logic of its own: the updates measured are
`gspo_minimal.rl_update` at the script's defaults, the log-probs are `gspo_minimal.policy_logprobs`.
"""
from __future__ import annotations

import argparse
import functools
import json
import math
import os
import random
import statistics
import subprocess
import sys
import time

import torch

import gspo_minimal as g

TRAIN_DIR = "runs/train"
VERIFY_DIR = "runs/verify"
FIG_DIR = "figures"


# ---------------------------------------------------------------------------------------------
# Shared helpers: load the trained checkpoint, sample rollouts, take one real update.
# ---------------------------------------------------------------------------------------------
def load_checkpoint(path: str = os.path.join(TRAIN_DIR, "checkpoint")):
    from transformers import AutoModelForCausalLM, AutoTokenizer
    if not os.path.isdir(path):
        print(f"no checkpoint at {path}: running `make train` first", flush=True)
        subprocess.run([sys.executable, "gspo_minimal.py", "--out", TRAIN_DIR], check=True)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(path)
    tok.padding_side = "left"
    return model, tok


@functools.cache
def splits(task: str = "add2") -> dict:
    """The script's fixed test / validation split, drawn once: training problems avoid both."""
    return g.make_splits(task, 500, 300)


def problems(n: int, rng: random.Random, task: str = "add2"):
    return g.sample_train_problems(splits(task), task, n, rng)


def one_update(model, tok, cfg: g.Config, rng: random.Random, opt) -> dict:
    """One real GSPO step at the script's defaults: a fresh rollout and its minibatch updates."""
    batch = g.rollout(model, tok, problems(cfg.prompts_per_step, rng), cfg, "cpu")
    return g.rl_update(model, opt, batch, cfg, *g.resolved_eps(cfg))


def warm_optimizer(model, tok, cfg: g.Config, rng: random.Random, steps: int = 5):
    """AdamW after a few real GSPO steps. A fresh AdamW's first step moves every weight by about
    lr whatever its gradient (m / sqrt(v) = sign(g)), far more than any later step: measuring
    "one update" with it would exaggerate every ratio. Training never takes that step twice."""
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr)
    for _ in range(steps):
        one_update(model, tok, cfg, rng, opt)
    return opt


def logprobs_in_chunks(model, batch: dict, dtype=torch.float32, chunk: int = 512) -> torch.Tensor:
    """policy_logprobs over a large batch, in chunks, without gradients, in the given dtype."""
    model = model.to(dtype)
    out = []
    with torch.no_grad():
        for i in range(0, len(batch["completions"]), chunk):
            sl = slice(i, i + chunk)
            out.append(g.policy_logprobs(model, batch["prompt_ids"][sl], batch["prompt_mask"][sl],
                                         batch["completions"][sl]))
    model.to(torch.float32)
    return torch.cat(out)


def big_rollout(model, tok, n_prompts: int, cfg: g.Config, rng: random.Random) -> dict:
    """n_prompts x G sampled completions, in rollouts of the default size, concatenated."""
    parts = [g.rollout(model, tok, problems(cfg.prompts_per_step, rng), cfg, "cpu")
             for _ in range(math.ceil(n_prompts / cfg.prompts_per_step))]
    T = max(p["completions"].shape[1] for p in parts)

    def pad(x, value):
        return torch.nn.functional.pad(x, (0, T - x.shape[1]), value=value)
    return {"prompt_ids": torch.cat([p["prompt_ids"] for p in parts]),
            "prompt_mask": torch.cat([p["prompt_mask"] for p in parts]),
            "completions": torch.cat([pad(p["completions"], tok.pad_token_id) for p in parts]),
            "mask": torch.cat([pad(p["mask"], False) for p in parts])}


def max_form_disagreement(new, old, mask) -> float:
    """Largest relative gap between s and PPL_old/PPL_new or exp(H_old - H_new), over rows."""
    s = g.importance_ratio(new, old, mask)
    ppl = g.perplexity(old, mask) / g.perplexity(new, mask)
    ent = torch.exp(g.cross_entropy(old, mask) - g.cross_entropy(new, mask))
    return max((ppl / s - 1).abs().max().item(), (ent / s - 1).abs().max().item())


def loglog_slope(xs, ys) -> float:
    lx = [math.log(x) for x in xs]
    ly = [math.log(y) for y in ys]
    mx, my = statistics.fmean(lx), statistics.fmean(ly)
    return sum((a - mx) * (b - my) for a, b in zip(lx, ly)) / sum((a - mx) ** 2 for a in lx)


# ---------------------------------------------------------------------------------------------
# 1. Equivalence of the three forms on real rollouts and a real update (a round-off check).
# ---------------------------------------------------------------------------------------------
def measure_equivalence(model, tok, cfg, rng, n_prompts: int = 1280) -> dict:
    opt = warm_optimizer(model, tok, cfg, rng)
    batch = big_rollout(model, tok, n_prompts, cfg, rng)
    old32, old64 = logprobs_in_chunks(model, batch), logprobs_in_chunks(model, batch, torch.float64)
    one_update(model, tok, cfg, rng, opt)
    new32, new64 = logprobs_in_chunks(model, batch), logprobs_in_chunks(model, batch, torch.float64)
    m = batch["mask"]
    return {"equivalence_sequences": len(m),
            "equivalence_max_rel_err_float32": max_form_disagreement(new32, old32, m),
            "equivalence_max_rel_err_float64": max_form_disagreement(new64, old64, m)}


# ---------------------------------------------------------------------------------------------
# 2. Variance of log s against length, on long responses of the trained model.
# ---------------------------------------------------------------------------------------------
# Our answers are 2-4 tokens long, so long responses are sampled with EOS suppressed: the model keeps
# writing digits past the point where it would stop. That costs realism (these continuations are
# off-distribution for the task), not validity: the ratio identity and the variance formula
# hold for any response, and the update that moves the weights is a real GSPO step on real rollouts.
def sample_long(model, tok, n: int, length: int, rng: random.Random) -> dict:
    """n responses of exactly `length` tokens each, EOS forbidden, at temperature 1."""
    texts = [g.prompt_text("add2", a, b) for a, b in problems(n, rng)]
    ids, attn = g.encode_prompts(tok, texts, "cpu")
    comp = g.sample_completions(model, ids, attn, length, tok.eos_token_id, tok.pad_token_id,
                                temperature=1.0, suppress_eos=True)
    return {"prompt_ids": ids, "prompt_mask": attn, "completions": comp,
            "mask": torch.ones_like(comp, dtype=torch.bool)}


def variance_by_length(delta: torch.Tensor, lengths) -> tuple[list[float], list[float]]:
    """Var over sequences of the prefix mean (log s) and prefix sum of per-token log-ratios."""
    csum = delta.cumsum(-1)
    normalised = [(csum[:, L - 1] / L).var().item() for L in lengths]
    unnormalised = [csum[:, L - 1].var().item() for L in lengths]
    return normalised, unnormalised


def autocorrelation(delta: torch.Tensor, max_lag: int) -> list[float]:
    d = delta - delta.mean()
    var = (d * d).mean()
    return [((d[:, :-k] * d[:, k:]).mean() / var).item() for k in range(1, max_lag + 1)]


def measure_variance(model, tok, cfg, rng, n: int = 512, length: int = 256) -> dict:
    lengths = [1, 2, 4, 8, 16, 32, 64, 128, 256]
    opt = warm_optimizer(model, tok, cfg, rng)
    batch = sample_long(model, tok, n, length, rng)
    old = logprobs_in_chunks(model, batch, torch.float64, chunk=128)
    same = logprobs_in_chunks(model, batch, torch.float64, chunk=96)   # unchanged weights
    one_update(model, tok, cfg, rng, opt)
    new = logprobs_in_chunks(model, batch, torch.float64, chunk=128)
    delta, floor = new - old, same - old
    var_s, var_sum = variance_by_length(delta, lengths)
    var_floor, _ = variance_by_length(floor, lengths)
    synth = torch.randn(n, length, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    var_synth, _ = variance_by_length(synth * delta.std(), lengths)
    rho = autocorrelation(delta, 16)
    # equicorrelated model (PAPERS.md section 2): Var(log s) = sigma^2 [(1 - c)/L + c], with c the
    # mean autocorrelation over lags 1-16 and sigma^2 the variance of a single token's log-ratio
    c, sigma2 = statistics.fmean(rho), delta.var().item()
    return {"variance_equicorrelated_prediction": [sigma2 * ((1 - c) / L + c) for L in lengths],
            "variance_mean_autocorrelation": c,
            "variance_lengths": lengths, "variance_log_s": var_s, "variance_unnormalised": var_sum,
            "variance_floor_by_length": var_floor, "variance_independent": var_synth,
            "variance_slope_log_s": loglog_slope(lengths, var_s),
            "variance_slope_unnormalised": loglog_slope(lengths, var_sum),
            "variance_slope_independent": loglog_slope(lengths, var_synth),
            "variance_noise_floor": max(var_floor),
            "variance_token_logratio_std": delta.std().item(),
            "autocorrelation_lag1_to_16": rho,
            "variance_sequences": n}


# ---------------------------------------------------------------------------------------------
# 3. Clipping: GSPO and GRPO, each in a short run of its own from the same checkpoint.
# ---------------------------------------------------------------------------------------------
def measure_clipping(path: str, steps: int, rng_seed: int = 0) -> dict:
    out = {}
    for loss in ("gspo", "grpo"):
        model, tok = load_checkpoint(path)
        torch.manual_seed(rng_seed)
        cfg = g.Config(loss=loss)
        rng = random.Random(rng_seed)
        opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr)
        fractions = []
        for _ in range(steps):
            batch = g.rollout(model, tok, problems(cfg.prompts_per_step, rng), cfg, "cpu")
            m = g.rl_update(model, opt, batch, cfg, *g.resolved_eps(cfg))
            fractions.append(m["clip_tokens"])
        out[f"clip_fraction_{loss}"] = statistics.fmean(fractions)
        out[f"clip_fraction_{loss}_by_step"] = fractions
    out["clip_steps"] = steps
    return out


# ---------------------------------------------------------------------------------------------
# 4. Mixture of experts: how much routing moves after one update, and what that does to ratios.
# ---------------------------------------------------------------------------------------------
def routed_experts(model, batch: dict) -> torch.Tensor:
    """Top-k expert ids of every completion token in every layer: (layers, tokens, k)."""
    seen = []
    hooks = [layer.mlp.gate.register_forward_hook(lambda mod, inp, out: seen.append(out[2]))
             for layer in model.model.layers]
    with torch.no_grad():
        g.policy_logprobs(model, batch["prompt_ids"], batch["prompt_mask"], batch["completions"])
    for h in hooks:
        h.remove()
    B, P = batch["prompt_ids"].shape
    keep = torch.cat([torch.zeros(B, P, dtype=torch.bool), batch["mask"]], 1).flatten()
    return torch.stack([ids[keep] for ids in seen])


def ratio_spread(model, tok, cfg, rng) -> dict:
    """Token and sequence log-ratio spread after one real update, for one model."""
    opt = warm_optimizer(model, tok, cfg, rng)
    batch = big_rollout(model, tok, 256, cfg, rng)
    old = logprobs_in_chunks(model, batch)
    before = routed_experts(model, batch) if cfg.moe else None
    one_update(model, tok, cfg, rng, opt)
    new = logprobs_in_chunks(model, batch)
    keep = batch["mask"]
    token_lr = (new - old)[keep]
    out = {"token_logratio_std": token_lr.std().item(),
           "token_logratio_max_abs": token_lr.abs().max().item(),
           "seq_logratio_std": g.sequence_log_ratio(new, old, keep).std().item()}
    if before is not None:
        after = routed_experts(model, batch)
        k = before.shape[-1]
        kept = (before.unsqueeze(-1) == after.unsqueeze(-2)).any(-1).sum(-1)   # (layers, tokens)
        out["routing_change_fraction"] = (1 - kept.float() / k).mean().item()
        out["routing_change_by_layer"] = (1 - kept.float() / k).mean(-1).tolist()
    return out


def moe_checkpoint(out: str) -> str:
    """A tiny MoE, trained like the dense model: warm-up to the threshold, then a few GSPO steps."""
    path = os.path.join(out, "checkpoint")
    if not os.path.isdir(path):
        code = g.main(["--moe", "--steps", "20", "--out", out])
        assert code == 0, "the MoE training run failed"
    return path


def measure_moe(dense_path: str, cfg: g.Config, rng_seed: int = 0) -> dict:
    results = {}
    for name, path in (("dense", dense_path), ("moe", moe_checkpoint(os.path.join(VERIFY_DIR, "moe")))):
        model, tok = load_checkpoint(path)
        torch.manual_seed(rng_seed)
        rng = random.Random(rng_seed)
        c = g.Config(**{**cfg.__dict__, "moe": name == "moe"})
        results[name] = ratio_spread(model, tok, c, rng)
    return {"moe_routing_change_fraction": results["moe"]["routing_change_fraction"],
            "moe_routing_change_by_layer": results["moe"]["routing_change_by_layer"],
            "ratio_spread": results}


# ---------------------------------------------------------------------------------------------
# make verify
# ---------------------------------------------------------------------------------------------
def verify() -> dict:
    t0 = time.perf_counter()
    os.makedirs(VERIFY_DIR, exist_ok=True)
    cfg = g.Config()
    torch.manual_seed(0)
    rng = random.Random(0)
    path = os.path.join(TRAIN_DIR, "checkpoint")
    model, tok = load_checkpoint(path)
    t_start = time.perf_counter()
    res = {"checkpoint": path}
    res.update(measure_equivalence(model, tok, cfg, rng))
    model, tok = load_checkpoint(path)
    res.update(measure_variance(model, tok, cfg, rng))
    res.update(measure_clipping(path, steps=10))
    res.update(measure_moe(path, cfg))
    res["verify_seconds"] = time.perf_counter() - t_start
    res["verify_seconds_with_loading"] = time.perf_counter() - t0
    with open(os.path.join(VERIFY_DIR, "verify.json"), "w") as f:
        json.dump(res, f, indent=2)
    print_table(res)
    return res


def print_table(r: dict) -> None:
    rows = [
        ("sequences compared (three forms of s)", f"{r['equivalence_sequences']}", "round-off check"),
        ("max rel. disagreement, float32", f"{r['equivalence_max_rel_err_float32']:.2e}", "~1e-6"),
        ("max rel. disagreement, float64", f"{r['equivalence_max_rel_err_float64']:.2e}", "~1e-15"),
        ("slope of Var(log s) vs L", f"{r['variance_slope_log_s']:+.3f}", "-1 if independent"),
        ("slope of Var(sum of log-ratios) vs L", f"{r['variance_slope_unnormalised']:+.3f}", "+1 if independent"),
        ("slope, synthetic independent tokens", f"{r['variance_slope_independent']:+.3f}", "-1 (harness check)"),
        ("lag-1 autocorrelation of token log-ratios", f"{r['autocorrelation_lag1_to_16'][0]:+.3f}", "0 if independent"),
        ("mean autocorrelation, lags 1-16 (c)", f"{r['variance_mean_autocorrelation']:+.3f}", ""),
        (f"Var(log s) at L={r['variance_lengths'][-1]}: measured / sigma^2[(1-c)/L+c]",
         f"{r['variance_log_s'][-1]:.4f} / {r['variance_equicorrelated_prediction'][-1]:.4f}", "equicorrelated model"),
        ("noise floor of Var(log s), same weights", f"{r['variance_noise_floor']:.1e}", "float64 round-off"),
        ("clip fraction per token, GSPO", f"{r['clip_fraction_gspo']:.4f}", "paper: ~100x GRPO"),
        ("clip fraction per token, GRPO", f"{r['clip_fraction_grpo']:.4f}", ""),
        ("MoE: activated experts changed by one update", f"{r['moe_routing_change_fraction']:.3f}", "paper: ~0.10 (48 layers)"),
        ("token log-ratio std, dense / MoE", f"{r['ratio_spread']['dense']['token_logratio_std']:.4f} / "
         f"{r['ratio_spread']['moe']['token_logratio_std']:.4f}", ""),
        ("sequence log-ratio std, dense / MoE", f"{r['ratio_spread']['dense']['seq_logratio_std']:.4f} / "
         f"{r['ratio_spread']['moe']['seq_logratio_std']:.4f}", ""),
        ("verify seconds (training excluded)", f"{r['verify_seconds']:.0f}", "budget 300"),
    ]
    w = max(len(a) for a, _, _ in rows)
    for a, b, c in rows:
        print(f"{a:<{w}}  {b:>18}  {c}")


# ---------------------------------------------------------------------------------------------
# Sampler benchmark: the hand-written loop against transformers' generate.
# ---------------------------------------------------------------------------------------------
def bench_sampler(repeats: int = 15) -> dict:
    torch.manual_seed(0)
    cfg = g.Config()
    results = {}
    for name in ("untrained", "trained"):            # the trained model stops after ~3.5 tokens
        if name == "trained":
            model, tok = load_checkpoint()
        else:
            tok = g.build_char_tokenizer()
            model = g.build_tiny_model(tok)
        results[name] = time_samplers(model.eval(), tok, cfg, repeats)
    res = {"completions": cfg.prompts_per_step * cfg.group_size, "max_new_tokens": cfg.max_new_tokens,
           "threads": torch.get_num_threads(), "repeats": repeats, **results}
    os.makedirs("runs/sampler", exist_ok=True)
    with open("runs/sampler/sampler.json", "w") as f:
        json.dump(res, f, indent=2)
    for name, r in results.items():
        print(f"{name} model: {res['completions']} completions, up to {cfg.max_new_tokens} tokens, "
              f"{res['threads']} threads, median of {repeats}: hand-written "
              f"{r['median_seconds_ours'] * 1e3:.1f} ms, the same with each prompt run once per "
              f"group {r['median_seconds_ours_grouped'] * 1e3:.1f} ms, generate "
              f"{r['median_seconds_generate'] * 1e3:.1f} ms (generate / ours = {r['speedup']:.2f}, "
              f"generate / grouped = {r['speedup_grouped']:.2f})")
    return res


def time_samplers(model, tok, cfg: g.Config, repeats: int) -> dict:
    from transformers import GenerationConfig
    texts = [g.prompt_text("add2", a, b) for a, b in problems(cfg.prompts_per_step, random.Random(0))
             for _ in range(cfg.group_size)]
    ids, attn = g.encode_prompts(tok, texts, "cpu")
    gen_cfg = GenerationConfig(do_sample=True, temperature=1.0, top_k=None, top_p=None,
                               max_new_tokens=cfg.max_new_tokens, eos_token_id=tok.eos_token_id,
                               pad_token_id=tok.pad_token_id)

    def ours():
        return g.sample_completions(model, ids, attn, cfg.max_new_tokens, tok.eos_token_id,
                                    tok.pad_token_id, 1.0)

    def ours_grouped():                  # as rollouts call it: each prompt run once per group
        return g.sample_completions(model, ids, attn, cfg.max_new_tokens, tok.eos_token_id,
                                    tok.pad_token_id, 1.0, group_size=cfg.group_size)

    def theirs():
        with torch.no_grad():
            return model.generate(input_ids=ids, attention_mask=attn, generation_config=gen_cfg)

    samplers = {"ours": ours, "ours_grouped": ours_grouped, "generate": theirs}
    times = {name: [] for name in samplers}
    for fn in samplers.values():
        fn()                                                              # warm-up
    for _ in range(repeats):                                              # interleaved
        for name, fn in samplers.items():
            t = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t)
    res = {f"median_seconds_{name}": statistics.median(t) for name, t in times.items()}
    res["speedup"] = res["median_seconds_generate"] / res["median_seconds_ours"]
    res["speedup_grouped"] = res["median_seconds_generate"] / res["median_seconds_ours_grouped"]
    return res


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("what", choices=["verify", "figures", "sampler"])
    args = parser.parse_args(argv)
    from transformers.utils import logging as hf_logging
    hf_logging.disable_progress_bar()
    {"verify": verify, "figures": figures, "sampler": bench_sampler}[args.what]()
    return 0


# ---------------------------------------------------------------------------------------------
# make figures
# ---------------------------------------------------------------------------------------------
FIG_RUNS = "runs/figures"
FIG_STEPS = 200          # RL steps per figure run (make train uses 500): 15 runs fit in 30 minutes
SEEDS = (0, 1, 2)
# Okabe-Ito colours, each paired with its own line style and marker so the plots read in grey too
STYLE = {"gspo": ("#0072B2", "-", "o"), "gspo-token": ("#009E73", "--", "s"),
         "grpo": ("#D55E00", ":", "^")}


def figure_runs() -> list[tuple[str, list[str]]]:
    runs = [(f"{loss}_s{seed}", ["--loss", loss, "--seed", str(seed)])
            for loss in ("gspo", "gspo-token", "grpo") for seed in SEEDS]
    runs += [(f"moe_{loss}_s{seed}", ["--moe", "--loss", loss, "--seed", str(seed)])
             for loss in ("gspo", "grpo") for seed in SEEDS]
    return runs


def run_all(runs, workers: int = 2) -> None:
    """Run the training jobs, `workers` at a time, one thread each (2 cores: no oversubscription)."""
    pending = [r for r in runs if not os.path.exists(os.path.join(FIG_RUNS, r[0], "summary.json"))]
    active: list[tuple[str, subprocess.Popen]] = []
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    while pending or active:
        while pending and len(active) < workers:
            name, args = pending.pop(0)
            log = open(os.path.join(FIG_RUNS, name + ".log"), "w")
            cmd = [sys.executable, "gspo_minimal.py", *args, "--steps", str(FIG_STEPS),
                   "--threads", "1", "--out", os.path.join(FIG_RUNS, name)]
            active.append((name, subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)))
            print(f"started {name}", flush=True)
        time.sleep(1)
        for name, proc in list(active):
            if proc.poll() is not None:
                active.remove((name, proc))
                print(f"finished {name} (exit {proc.returncode})", flush=True)


def read_metrics(name: str) -> list[dict]:
    with open(os.path.join(FIG_RUNS, name, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def accuracy_curves(ax, names_by_loss: dict[str, list[str]], title: str) -> None:
    """Validation accuracy against wall time: median over seeds, min-max band."""
    import numpy as np
    for loss, names in names_by_loss.items():
        curves = []
        for name in names:
            rl = [r for r in read_metrics(name) if "val_acc" in r]      # warm-up, then RL
            curves.append((np.array([r["elapsed"] for r in rl]), np.array([r["val_acc"] for r in rl])))
        start = max(c[0][0] for c in curves)
        end = min(c[0][-1] for c in curves)
        grid = np.linspace(start, end, 60)
        ys = np.stack([np.interp(grid, t, y) for t, y in curves])
        colour, ls, marker = STYLE[loss]
        ax.plot(grid, np.median(ys, 0), color=colour, ls=ls, marker=marker, markevery=10,
                label=f"{loss} (median of {len(names)} seeds)")
        ax.fill_between(grid, ys.min(0), ys.max(0), color=colour, alpha=0.15)
    ax.set_xlabel("wall time since start, warm-up included, s (2 runs at a time, 1 thread each)")
    ax.set_ylabel("validation accuracy (greedy)")
    ax.set_title(title)
    ax.set_ylim(0, 1)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")


def figures() -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    t0 = time.perf_counter()
    os.makedirs(FIG_RUNS, exist_ok=True)
    os.makedirs(FIG_DIR, exist_ok=True)
    if not os.path.exists(os.path.join(VERIFY_DIR, "verify.json")):
        verify()
    with open(os.path.join(VERIFY_DIR, "verify.json")) as f:
        v = json.load(f)
    run_all(figure_runs())

    fig, ax = plt.subplots(figsize=(7, 4.5))
    accuracy_curves(ax, {loss: [f"{loss}_s{s}" for s in SEEDS] for loss in STYLE},
                    "Dense model, 2-digit addition: GSPO, GSPO-token, GRPO")
    fig.tight_layout()
    fig.savefig(os.path.join(FIG_DIR, "accuracy_vs_time.png"), dpi=120)

    fig, ax = plt.subplots(figsize=(7, 4.5))
    accuracy_curves(ax, {loss: [f"moe_{loss}_s{s}" for s in SEEDS] for loss in ("gspo", "grpo")},
                    "Tiny mixture-of-experts model: GSPO against GRPO")
    fig.tight_layout()
    fig.savefig(os.path.join(FIG_DIR, "moe_gspo_vs_grpo.png"), dpi=120)

    fig, ax = plt.subplots(figsize=(7, 4.5))
    L = v["variance_lengths"]
    for key, label, colour, ls, marker in (
            ("variance_log_s", "Var(log s), real update", "#0072B2", "-", "o"),
            ("variance_unnormalised", "Var(sum of token log-ratios), real update", "#D55E00", "--", "^"),
            ("variance_independent", "Var(log s), synthetic independent tokens", "#009E73", ":", "s")):
        ax.loglog(L, v[key], color=colour, ls=ls, marker=marker, label=label)
    ax.loglog(L, v["variance_equicorrelated_prediction"], color="black", ls="-.", lw=1,
              label=f"sigma^2[(1-c)/L + c], measured c = {v['variance_mean_autocorrelation']:.2f}")
    ax.set_xlabel("response length L (tokens)")
    ax.set_ylabel("variance over responses")
    ax.set_title(f"log s: slope {v['variance_slope_log_s']:+.2f} (independent tokens: -1); "
                 f"sum: {v['variance_slope_unnormalised']:+.2f}", fontsize=10)
    ax.grid(alpha=0.3, which="both")
    ax.legend()
    fig.tight_layout()
    fig.savefig(os.path.join(FIG_DIR, "variance_vs_length.png"), dpi=120)

    fig, ax = plt.subplots(figsize=(7, 4.5))
    import numpy as np
    for loss in ("gspo", "grpo"):
        colour, ls, marker = STYLE[loss]
        series = [[r["clip_tokens"] for r in read_metrics(f"{loss}_s{s}") if r["stage"] == "rl"]
                  for s in SEEDS]
        n = min(map(len, series))
        y = np.median(np.array([x[:n] for x in series]), 0)
        k = 10                                                   # 10-step moving average
        y = np.convolve(y, np.ones(k) / k, mode="valid")
        ax.semilogy(np.arange(len(y)) + k, np.maximum(y, 1e-5), color=colour, ls=ls, label=loss)
    ax.set_xlabel("RL step")
    ax.set_ylabel("share of completion tokens clipped (active side)")
    ax.set_title("Clip fraction over training (median of 3 seeds, 10-step average)")
    ax.grid(alpha=0.3, which="both")
    ax.legend()
    fig.tight_layout()
    fig.savefig(os.path.join(FIG_DIR, "clip_fraction.png"), dpi=120)

    fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 4))
    by_layer = v["moe_routing_change_by_layer"]
    a1.bar(range(1, len(by_layer) + 1), by_layer, color="#56B4E9", edgecolor="black", hatch="//")
    a1.set_xlabel("layer")
    a1.set_ylabel("share of activated experts that changed")
    a1.set_title("MoE routing after one GSPO update")
    spread = v["ratio_spread"]
    x = np.arange(2)
    for i, (key, label, hatch) in enumerate((("token_logratio_std", "token log-ratio", ""),
                                             ("seq_logratio_std", "sequence log-ratio (log s)", ".."))):
        a2.bar(x + 0.38 * i, [spread["dense"][key], spread["moe"][key]], width=0.38, label=label,
               color=["#0072B2", "#E69F00"][i], edgecolor="black", hatch=hatch)
    a2.set_xticks(x + 0.19, ["dense", "MoE"])
    a2.set_ylabel("standard deviation after one update (nats)")
    a2.set_title("Spread of log-ratios, dense against MoE")
    a2.legend()
    fig.tight_layout()
    fig.savefig(os.path.join(FIG_DIR, "moe_routing.png"), dpi=120)
    summary = figure_summary()
    summary["figures_seconds"] = time.perf_counter() - t0
    with open(os.path.join(FIG_RUNS, "figures.json"), "w") as f:
        json.dump(summary, f, indent=2)
    for group, r in summary["test_accuracy"].items():
        print(f"{group:10s} test accuracy after {FIG_STEPS} RL steps: median {r['median']:.3f} "
              f"(seeds {', '.join(f'{a:.3f}' for a in r['seeds'])})")
    for loss, r in summary["clip_tokens"].items():
        print(f"{loss:10s} clip fraction per token, median of 3 seeds: steps 1-{FIG_STEPS // 2} "
              f"{r['first_half']:.3f}, steps {FIG_STEPS // 2 + 1}-{FIG_STEPS} {r['second_half']:.3f}")
    print(f"figures written to {FIG_DIR}/, numbers to {FIG_RUNS}/figures.json, "
          f"in {summary['figures_seconds']:.0f} s")


def figure_summary() -> dict:
    """The numbers tutorial.md quotes from the figure runs: final test accuracy of every run, and
    the clip fraction of the dense runs over the first and second half of training."""
    import numpy as np
    groups = {**{loss: loss for loss in STYLE}, "moe_gspo": "moe_gspo", "moe_grpo": "moe_grpo"}
    accuracy = {}
    for group, prefix in groups.items():
        seeds = []
        for s in SEEDS:
            with open(os.path.join(FIG_RUNS, f"{prefix}_s{s}", "summary.json")) as f:
                seeds.append(json.load(f)["accuracy_after_rl"])
        accuracy[group] = {"median": float(np.median(seeds)), "seeds": seeds}
    clip = {}
    for loss in ("gspo", "grpo"):
        per_seed = [[r["clip_tokens"] for r in read_metrics(f"{loss}_s{s}") if r["stage"] == "rl"]
                    for s in SEEDS]
        half = FIG_STEPS // 2
        clip[loss] = {"first_half": float(np.median([np.median(x[:half]) for x in per_seed])),
                      "second_half": float(np.median([np.median(x[half:]) for x in per_seed]))}
    return {"steps": FIG_STEPS, "test_accuracy": accuracy, "clip_tokens": clip}


if __name__ == "__main__":
    sys.exit(main())

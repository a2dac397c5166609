"""The engine gap against length, at theta = theta_old: a sampler in another precision (or with a
nucleus) against the float32 trainer, no training.

    python studies/engine.py prototype --models add2,addwork          # in .venv, then
    .venv-pretrained/bin/python studies/engine.py prototype --models smollm2   # (it needs gguf):
        figures/engine_prototype.json, seconds and tokens per second per model and sampler (minutes)
    python studies/engine.py --pretrained-python .venv-pretrained/bin/python   # make engine:
        every model, sampler and view a part kept in runs/engine/ (SmolLM2's in that interpreter),
        then figures/engine.json and engine.png (about 35 minutes; an interrupted run resumes)
    python studies/engine.py redraw       # engine.png again from engine.json

A trainer fed by an inference engine samples y from the engine's q and, with the engine's record
as pi_old, hands the update s = exp(mean_t d_t) with d_t = log p_t(y_t) - log q_t(y_t), p the
trainer's own distribution at the same weights. Two exact facts organise what this file measures
(tutorial section 12; test_identities.py section 7b checks them by enumeration):

  * E_q[d_t | y_<t] = -KL(q_t || p_t) =: -k_t at every position: the gap is biased downwards by
    the exact per-token KL, which this file computes over the whole vocabulary;
  * the centred gaps e_t = d_t + k_t are martingale differences, uncorrelated, so over the first n
    tokens  log s_n = -K_n + M_n / n,  K_n the mean of k_t: the noise falls like 1/sqrt(n), the
    bias -K_n does not.

So whether GSPO's band (log s in [log(1 - 3e-4), log(1 + 4e-4)], about +-3.5e-4 nats per token)
holds the engine's s at some length is a question of two numbers: K (the floor) and sigma^2, the
mean of e_t^2. Our reading: the share of sequences inside the band grows with length only while K
is below the nearer half-band eps; the length at which z standard deviations of the noise fit
inside what K leaves of it is L* = (z sigma / (eps - K))^2, infinite once K >= eps.

Each sequence is sampled by the sampler token by token with its own KV cache, as an engine decodes,
while the trainer reads the same tokens with a cache of its own (float32; a full pass over the
sequence agrees with it to float32 round-off). With EOS suppressed, on both sides, every sequence
runs to the full length and each of its prefixes is one point of the length law; natural-length
sequences (EOS allowed) are a second, EOS-selected view, where stopping picks the sequences and the
per-length means are not -K (test_identities.py's counterexample).
"""
from __future__ import annotations

import math
import os
import random
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

import gspo_minimal as g  # noqa: E402
from studies.common import (Parser, bootstrap_slopes, cli, fail, in_own_process, kept_part,  # noqa: E402
                            load_checkpoint, read_json, reuse_problem, run_jobs, smollm_gguf, write_json)

# The files this target writes into figures/ (left out of its dirty check).
OUTPUTS = ("figures/engine.json", "figures/engine.png", "figures/engine_prototype.json")
FOLDER = "runs/engine"
PROTOTYPE_JSON = "figures/engine_prototype.json"

GSPO_BAND = (math.log(1 - 3e-4), math.log(1 + 4e-4))     # log s, nats per token
GRPO_BAND = (math.log(1 - 0.2), math.log(1 + 0.27))       # a token's log-ratio
SAMPLERS = {"bfloat16": ("bfloat16", 1.0), "float16": ("float16", 1.0), "float32_top_p_0.9": ("float32", 0.9)}
# Open prompts for SmolLM2-135M-Instruct, asked through its chat template: answers of any length.
SMOLLM_PROMPTS = ["Tell me a story about a lighthouse keeper.", "Explain how a bicycle works.",
                  "Write a letter to a friend about your week.", "Describe the water cycle.",
                  "What should I know before adopting a cat?", "Summarise the history of the printing press.",
                  "Give advice to someone starting to learn the piano.", "Describe a walk through a forest in autumn.",
                  "Explain why the sky is blue.", "Write a short speech for a friend's wedding.",
                  "How do I plan a vegetable garden?", "Tell me about the planets of the solar system.",
                  "Describe your perfect weekend.", "Explain how bread is made.",
                  "Write a poem about the sea.", "What are good habits for studying?"]


# ---------------------------------------------------------------------------------------------
# The measurement: one sampler and one trainer reading the same tokens.
# ---------------------------------------------------------------------------------------------
@torch.no_grad()
def paired_decode(sampler, trainer, prompt_ids, prompt_mask, length: int, eos_id: int, *,
                  temperature: float = 1.0, top_p: float = 1.0, suppress_eos: bool = True) -> dict:
    """Sample `length` tokens per row from `sampler` (q, `nucleus_logprobs` of its logits, KV cache)
    while `trainer` (p, float32 log_softmax of logits / temperature) reads them with a cache of its
    own. Returns (B, L) float64 `d` = log p(y_t) - log q(y_t) and `k` = KL(q_t || p_t) over the
    vocabulary, and bool `alive` (False after a row's EOS; all True with `suppress_eos`, which sets
    EOS to -inf on both sides, so both distributions are renormalised without it)."""
    from transformers import DynamicCache
    attn = prompt_mask.long()
    pos = (attn.cumsum(-1) - 1).clamp(min=0)
    caches = [DynamicCache(config=m.config) for m in (sampler, trainer)]
    logits = [m(input_ids=prompt_ids, attention_mask=attn, position_ids=pos, cache=c, use_cache=True,
                logits_to_keep=1).logits[:, -1] for m, c in zip((sampler, trainer), caches)]
    done = torch.zeros(len(prompt_ids), dtype=torch.bool)
    d, k, alive = [], [], []
    for _ in range(length):
        if suppress_eos:
            for lg in logits:
                lg[:, eos_id] = -float("inf")
        logq = g.nucleus_logprobs(logits[0], temperature, top_p)                  # (B, V)
        logp = torch.log_softmax(logits[1].float() / temperature, dim=-1)        # (B, V)
        nxt = torch.multinomial(logq.exp(), 1).squeeze(-1)                       # (B,)
        pick = nxt[:, None]
        d.append((logp.gather(-1, pick) - logq.gather(-1, pick)).squeeze(-1).double())
        k.append(g.token_kl(logq, logp).double())
        alive.append(~done)
        done = done | (nxt == eos_id)
        if done.all():
            break
        attn = torch.cat([attn, torch.ones_like(attn[:, :1])], dim=1)
        pos = pos[:, -1:] + 1
        logits = [m(input_ids=nxt[:, None], attention_mask=attn, position_ids=pos, cache=c,
                    use_cache=True).logits[:, -1] for m, c in zip((sampler, trainer), caches)]
    return {"d": torch.stack(d, 1), "k": torch.stack(k, 1), "alive": torch.stack(alive, 1)}


# ---------------------------------------------------------------------------------------------
# The analysis: the length law from prefixes, and the EOS-selected view by natural length.
# ---------------------------------------------------------------------------------------------
def length_law(d: torch.Tensor, k: torch.Tensor, z: float, n_boot: int = 1000, seed: int = 0) -> dict:
    """(N, L) float64 gaps and KLs of full-length sequences -> per prefix length n = 1..L and per
    position the statistics engine.json keeps, the fitted slope of mean |log s_n| against n on
    log axes with a bootstrap interval over sequences, `kl_floor` (the mean KL per token), sigma^2
    (the mean e_t^2) and L* = (z sigma / (eps - K))^2 (None: infinite, K >= eps) with intervals."""
    N, L = d.shape
    n = torch.arange(1, L + 1, dtype=torch.float64)
    log_s = d.cumsum(1) / n                                                      # (N, L)
    lo, hi = GSPO_BAND
    below, above = (log_s < lo).double().mean(0), (log_s > hi).double().mean(0)
    eps = min(-lo, hi)
    gen = torch.Generator().manual_seed(seed)
    boot = torch.randint(0, N, (n_boot, N), generator=gen)                       # resampled sequences

    def slope(rows):                                  # log mean|log s_n| against log n, all n
        return bootstrap_slopes(log_s[rows].abs().mean(-2).clamp(min=1e-300), n.tolist())

    def l_star(rows):
        K = k[rows].mean((-2, -1))
        sigma = ((d[rows] + k[rows]) ** 2).mean((-2, -1)).sqrt()
        return torch.where(K < eps, (z * sigma / (eps - K).clamp(min=1e-300)) ** 2, torch.inf)

    # in pieces of resamples: n_boot x N x L float64 at once would be gigabytes on the tiny models
    piece = max(1, 2**24 // (N * L))
    slopes = torch.cat([slope(boot[i:i + piece]) for i in range(0, n_boot, piece)])
    stars = torch.cat([l_star(boot[i:i + piece]) for i in range(0, n_boot, piece)])
    star = l_star(torch.arange(N)).item()

    def finite(x):
        return None if math.isinf(x) else x
    return {"sequences": N, "n": n.long().tolist(),
            "mean_log_s": log_s.mean(0).tolist(), "std_log_s": log_s.std(0).tolist(),
            "mean_abs_log_s": log_s.abs().mean(0).tolist(),
            "mean_kl_tokens": (k.cumsum(1) / n).mean(0).tolist(),
            "share_outside_gspo_band": (below + above).tolist(), "share_below_band": below.tolist(),
            "share_above_band": above.tolist(),
            "mean_abs_d": d.abs().mean(0).tolist(), "mean_kl": k.mean(0).tolist(),
            "abs_log_s_slope": slope(torch.arange(N)[None]).item(),
            "abs_log_s_slope_ci95": torch.quantile(slopes, torch.tensor([0.025, 0.975], dtype=torch.float64)).tolist(),
            "kl_floor": k.mean().item(), "sigma2": ((d + k) ** 2).mean().item(), "eps": eps, "z": z,
            "length_inside_band": finite(star),
            "length_inside_band_ci95": [finite(v) for v in torch.quantile(
                stars, torch.tensor([0.025, 0.975], dtype=torch.float64)).tolist()]}


def by_natural_length(d: torch.Tensor, alive: torch.Tensor, edges: list[int]) -> list[dict]:
    """Sequences sampled with EOS allowed, binned by their natural length (labelled EOS-selected):
    per bin [lo, hi) the mean and mean absolute log s at the sequence's own length, the share
    outside GSPO's band, the quantiles p1, p10, p50 of the weight TRL's default correction gives
    them (sequence_mask at clip_max 3.0: exp(sum_t d_t), 0 above 3) and the share it masks, and the
    share verl's geometric preset rejects (exp(mean_t d_t) outside [1/1.001, 1.001])."""
    lengths = alive.sum(1)
    zeros = torch.zeros_like(d)
    trl = g.correction_weight(d, zeros, alive, "sequence_mask", None, 3.0)[:, 0]
    geo = g.correction_weight(d, zeros, alive, "sequence_geometric_mask", 1 / 1.001, 1.001)[:, 0]
    log_s = (d * alive).sum(1) / lengths.clamp(min=1)
    out = []
    for lo, hi in zip(edges[:-1], edges[1:]):
        rows = (lengths >= lo) & (lengths < hi)
        if not rows.any():
            continue
        q = torch.quantile(trl[rows], torch.tensor([0.01, 0.10, 0.50], dtype=trl.dtype)).tolist()
        out.append({"lengths": [lo, hi - 1], "label": "EOS-selected", "sequences": int(rows.sum()),
                    "mean_log_s": log_s[rows].mean().item(), "mean_abs_log_s": log_s[rows].abs().mean().item(),
                    "share_outside_gspo_band": ((log_s[rows] < GSPO_BAND[0]) | (log_s[rows] > GSPO_BAND[1]))
                    .double().mean().item(),
                    "trl_default_weight_p1": q[0], "trl_default_weight_p10": q[1], "trl_default_weight_p50": q[2],
                    "share_masked_trl_default": (trl[rows] == 0).double().mean().item(),
                    "share_rejected_geometric": (geo[rows] == 0).double().mean().item()})
    return out


def natural_view(d: torch.Tensor, alive: torch.Tensor, cap: int) -> dict:
    """The EOS-allowed sequences as training would see them: their lengths (p10, p50, p90 and the
    share that reached `cap` unfinished), the quantiles of |log s| at their own lengths (p50, p90,
    p99: make figures-engine's widened band reads p90 on add2), and `by_natural_length` over bins
    1, 2-3, 4-7, ... doubling up to the cap, the sequences that reached it a bin of their own."""
    lengths = alive.sum(1)
    log_s = (d * alive).sum(1) / lengths.clamp(min=1)
    edges = [1] + [2 ** i for i in range(1, max(1, cap.bit_length())) if 2 ** i < cap] + [cap, cap + 1]
    lq = torch.quantile(lengths.double(), torch.tensor([0.1, 0.5, 0.9], dtype=torch.float64)).tolist()
    aq = torch.quantile(log_s.abs(), torch.tensor([0.5, 0.9, 0.99], dtype=log_s.dtype)).tolist()
    return {"sequences": len(d), "cap": cap, "length_p10": lq[0], "length_p50": lq[1], "length_p90": lq[2],
            "share_at_cap": (lengths >= cap).double().mean().item(),
            "abs_log_s_p50": aq[0], "abs_log_s_p90": aq[1], "abs_log_s_p99": aq[2],
            "bins": by_natural_length(d, alive, edges)}


# ---------------------------------------------------------------------------------------------
# The models: the add2 model, the addwork model, SmolLM2 (a GGUF, Q4_1, dequantised to float32).
# ---------------------------------------------------------------------------------------------
def model_and_prompts(name: str, n: int, rng: random.Random):
    """(trainer model, tokenizer, prompt ids, prompt mask, longest length the model allows)."""
    if name == "smollm2":
        path = smollm_gguf()
        if path is None:
            fail("the smollm2 parts need SmolLM2's GGUF (make engine installs it in .venv-pretrained)")
        model, tok = g.load_pretrained(path)
        texts = [SMOLLM_PROMPTS[i % len(SMOLLM_PROMPTS)] for i in range(n)]
        ids, attn = g.encode_prompts(tok, texts, "cpu")
        return model, tok, ids, attn, 512
    if name == "add2":
        model, tok = load_checkpoint()
        task = "add2"
    else:
        model, tok = addwork_checkpoint()
        task = "addwork"
    problems = g.sample_train_problems(g.make_splits(task, 500, 300), task, n, rng)
    ids, attn = g.encode_prompts(tok, [g.prompt_text(task, a, b) for a, b in problems], "cpu")
    return model, tok, ids, attn, model.config.max_position_embeddings - ids.shape[1]


def addwork_checkpoint():
    """The addwork model: seed 0's warm-up checkpoint from `make figures-long` when made on this
    host, else that warm-up made here (studies/long.py's job, counted in this target's time)."""
    from studies import long as long_study
    job = next(j for j in long_study.long_jobs() if j["name"] == "warmup_s0")
    if reuse_problem(job) is not None:
        run_jobs([job], long_study.LONG_RUNS, workers=1)
    return g.load_pretrained(os.path.join(long_study.warm_dir(0), "checkpoint"))


def sampler_of(model, dtype: str):
    return model if dtype == "float32" else g.sampling_model(model, g.Config(sampler_dtype=dtype))


# ---------------------------------------------------------------------------------------------
# The prototype: how fast each part runs here, so that the full run's sizes fit its budget.
# ---------------------------------------------------------------------------------------------
PROTOTYPE = {"add2": {"rows": 64, "length": 32}, "addwork": {"rows": 32, "length": 64},
             "smollm2": {"rows": 4, "length": 64}}
# SmolLM2 at the batch make engine decodes (rows 32): CPU decoding is memory-bound, so its rate is not
# 4 rows' times eight.
PROTOTYPE_BATCH = {"smollm2_bfloat16_rows32": ("smollm2", "bfloat16", {"rows": 32, "length": 64})}


def prototype_part(name: str, sampler: str, size: dict) -> dict:
    rng = random.Random(0)
    torch.manual_seed(0)
    model, tok, ids, attn, room = model_and_prompts(name, size["rows"], rng)
    dtype, top_p = SAMPLERS[sampler]
    t0 = time.perf_counter()
    out = paired_decode(sampler_of(model, dtype), model, ids, attn, min(size["length"], room),
                        tok.eos_token_id, top_p=top_p)
    seconds = time.perf_counter() - t0
    tokens = out["d"].numel()
    return {"model": name, "sampler": sampler, "rows": size["rows"], "length": out["d"].shape[1],
            "decode_seconds": seconds, "tokens_per_second": tokens / seconds,
            "kl_floor": out["k"].mean().item(), "mean_d": out["d"].mean().item()}


def prototype(models: list[str]) -> dict:
    """Each model and sampler a kept part (runs/engine/prototype/, with its own host and peak
    memory: SmolLM2's parts run in .venv-pretrained, the tiny models' in .venv, where their
    checkpoints were made); the result holds every part made so far."""
    folder = os.path.join(FOLDER, "prototype")
    plan = {f"{m}_{s}": (m, s, PROTOTYPE[m]) for m in PROTOTYPE for s in SAMPLERS} | PROTOTYPE_BATCH
    for part_id, (name, sampler, size) in plan.items():
        if name not in models:
            continue
        part = kept_part(folder, "engine", part_id, lambda: prototype_part(name, sampler, size),
                         own_peak=True, settings={**size, "sampler": sampler})
        print(f"{part_id}: {part['tokens_per_second']:.0f} tokens/s "
              f"({part['rows']} x {part['length']} in {part['decode_seconds']:.1f} s), "
              f"kl_floor {part['kl_floor']:.2e}", flush=True)
    parts = {p: read_json(os.path.join(folder, f"{p}.json")) for p in plan
             if os.path.exists(os.path.join(folder, f"{p}.json"))}
    return {"parts": parts, "sizes": {p: {"model": m, "sampler": s, **size} for p, (m, s, size) in plan.items()},
            "missing": [p for p in plan if p not in parts]}


# ---------------------------------------------------------------------------------------------
# make engine: the sizes, fixed from the prototype before the run, and its parts.
# ---------------------------------------------------------------------------------------------
# The prototype (figures/engine_prototype.json) decoded 2,000-4,000 tokens/s on the tiny models
# and 15-19 on SmolLM2 four rows at a time; its batch part, 32 rows, about 85 (bf16). So the tiny
# models take a thousand sequences in seconds and SmolLM2 32 per view and sampler, 32 x 512 tokens
# twice per sampler, which `projected_seconds` puts near half an hour (the 40-minute bound).
# `length` None: as far as the model's positions allow after the prompt (add2 58, addwork 114).
SIZES = {"add2": {"rows": 1024, "length": None, "batch": 256},
         "addwork": {"rows": 512, "length": None, "batch": 256},
         "smollm2": {"rows": 32, "length": 512, "batch": 32}}
ROOM = {"add2": 58, "addwork": 114}    # their positions (64, 128) less their prompts (6, 14 tokens)
VIEWS = ("law", "natural")       # EOS suppressed, every prefix a point; EOS allowed, natural lengths
Z = 1.96                         # L*: z standard deviations of the noise inside what K leaves of the band
N_BOOT = 1000                    # bootstrap resamples of the sequences for the slope's and L*'s intervals
SEED = 1                         # the prototype used seed 0
SETTINGS = {"sizes": SIZES, "views": list(VIEWS), "z": Z, "n_boot": N_BOOT, "seed": SEED,
            "samplers": {name: {"dtype": dt, "top_p": p} for name, (dt, p) in SAMPLERS.items()},
            "temperature": 1.0, "gspo_band": list(GSPO_BAND), "grpo_band": list(GRPO_BAND),
            "smollm2_prompts": SMOLLM_PROMPTS, "trainer": "float32, the same weights (theta = theta_old)"}


def measure_part(name: str, sampler: str, view: str) -> dict:
    """One model, sampler and view: `rows` sequences decoded `batch` at a time (sampler and trainer
    with their own caches), then the length law (view `law`, EOS suppressed on both sides) or the
    natural lengths (view `natural`, EOS allowed, the same cap)."""
    size = SIZES[name]
    rng = random.Random(SEED)
    torch.manual_seed(SEED)
    model, tok, ids, attn, room = model_and_prompts(name, size["rows"], rng)
    length = min(size["length"] or room, room)
    dtype, top_p = SAMPLERS[sampler]
    sampler_model = sampler_of(model, dtype)
    pieces = [paired_decode(sampler_model, model, ids[i:i + size["batch"]], attn[i:i + size["batch"]], length,
                            tok.eos_token_id, top_p=top_p, suppress_eos=view == "law")
              for i in range(0, size["rows"], size["batch"])]
    width = max(p["d"].shape[1] for p in pieces)       # natural pieces stop when their rows have all ended

    def joined(key, fill):
        return torch.cat([torch.nn.functional.pad(p[key], (0, width - p[key].shape[1]), value=fill) for p in pieces])
    d, k, alive = joined("d", 0.0), joined("k", 0.0), joined("alive", False)
    tokens = int(alive.sum())
    out = {"model": name, "sampler": sampler, "view": view, "rows": size["rows"], "length": length,
           "tokens": tokens}
    if view == "law":
        return {**out, **length_law(d, k, Z, N_BOOT, SEED)}
    return {**out, **natural_view(d, alive, length)}


def part_name(name: str, sampler: str, view: str) -> str:
    return f"{name}_{sampler}_{view}"


def part_settings(name: str) -> dict:
    return {"size": SIZES[name], "z": Z, "n_boot": N_BOOT, "seed": SEED}


def measure(models: list[str]) -> None:
    """Every part of `models` in this process, each kept in runs/engine/ with its host and peak."""
    for name in models:
        for sampler in SAMPLERS:
            for view in VIEWS:
                part = kept_part(FOLDER, "engine", part_name(name, sampler, view),
                                 lambda: measure_part(name, sampler, view), own_peak=True,
                                 settings={**part_settings(name), "sampler": sampler, "view": view})
                print(f"{part_name(name, sampler, view)}: {part['tokens']} tokens in {part['seconds']:.0f} s, "
                      f"peak {part['peak_rss_mb']:.0f} MiB", flush=True)


def projected_seconds(prototype: dict) -> float:
    """make engine's decoding time from the prototype's rates: the tiny models at their measured
    tokens/s, SmolLM2 at its 32-row rate for bf16, scaled for the other samplers by their 4-row
    rates against bf16's. A projection: attention over 512 tokens costs more than over 64."""
    parts, total = prototype["parts"], 0.0
    for name, size in SIZES.items():
        length = size["length"] or ROOM[name]
        for sampler in SAMPLERS:
            rate = parts[f"{name}_{sampler}"]["tokens_per_second"]
            if name == "smollm2":
                rate *= parts["smollm2_bfloat16_rows32"]["tokens_per_second"] / parts["smollm2_bfloat16"]["tokens_per_second"]
            total += len(VIEWS) * size["rows"] * length / rate
    return total


def assemble() -> dict:
    """engine.json: every part read back from runs/engine/, one entry per model and sampler;
    `engine_seconds` sums the parts' own seconds (each loads its model and decodes), whichever
    invocation made them."""
    models, hosts, peaks, engine_seconds = {}, {}, {}, 0.0
    for name in SIZES:
        for sampler in SAMPLERS:
            entry = {}
            for view in VIEWS:
                part = read_json(os.path.join(FOLDER, part_name(name, sampler, view) + ".json"))
                hosts[part_name(name, sampler, view)] = part["host"]
                peaks[part_name(name, sampler, view)] = part["peak_rss_mb"]
                engine_seconds += part["seconds"]
                keep = {k: v for k, v in part.items() if k not in ("command", "measured_at_commit", "dirty",
                                                                    "dirty_paths", "versions", "threads", "host",
                                                                    "model", "sampler", "view", "part_settings")}
                entry.update(keep if view == "law" else {"natural": keep})
            models.setdefault(name, {})[sampler] = entry
    return {"engine_seconds": engine_seconds, "settings": SETTINGS, "models": models,
            "part_hosts": hosts, "peak_rss_mb": peaks}


def plot(result: dict, path: str = "figures/engine.png") -> None:
    """|log s| against prefix length on log axes, one panel per model, a line per sampler with its
    exact KL floor dotted, GSPO's band (shaded, at its nearer and farther half-widths) and GRPO's
    token band (a token's |log r| at its clip) on the same axis."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    colours = {"bfloat16": "#D55E00", "float16": "#0072B2", "float32_top_p_0.9": "#009E73"}
    fig, axes = plt.subplots(1, len(result["models"]), figsize=(5 * len(result["models"]), 4), sharey=True,
                             squeeze=False)
    axes = axes[0]
    for ax, (name, by_sampler) in zip(axes, result["models"].items()):
        for sampler, r in by_sampler.items():
            ax.plot(r["n"], r["mean_abs_log_s"], color=colours[sampler], label=f"{sampler}: mean |log s|")
            ax.axhline(r["kl_floor"], color=colours[sampler], ls=":", lw=1)
        ax.axhspan(1e-9, -GSPO_BAND[0], color="grey", alpha=0.15)
        ax.axhline(-GSPO_BAND[0], color="black", lw=1, label="GSPO band (3e-4 / 4e-4)")
        ax.axhline(GSPO_BAND[1], color="black", lw=1)
        ax.axhline(-GRPO_BAND[0], color="grey", ls="--", lw=1, label="GRPO token band (0.22 / 0.24)")
        ax.axhline(GRPO_BAND[1], color="grey", ls="--", lw=1)
        ax.set(xscale="log", yscale="log", xlabel="prefix length n (tokens, EOS suppressed)",
               title=f"{name} ({next(iter(by_sampler.values()))['sequences']} sequences per sampler)")
    axes[0].set_ylabel("mean |log s| over the first n tokens (dotted: exact KL floor)")
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


@cli
def main(argv=None) -> int:
    parser = Parser(description=__doc__.splitlines()[0])
    parser.add_argument("what", nargs="?", choices=["prototype", "measure", "redraw"], default=None,
                        help="prototype: figures/engine_prototype.json; measure: only the parts of --models, "
                             "in this interpreter; redraw: engine.png from engine.json; none: make engine")
    parser.add_argument("--models", default="add2,addwork,smollm2", help="comma-separated: add2, addwork, smollm2")
    parser.add_argument("--pretrained-python", default=".venv-pretrained/bin/python",
                        help="an interpreter with gguf, for SmolLM2's parts (make engine passes .venv-pretrained's)")
    args = parser.parse_args(argv)
    models = args.models.split(",")
    if any(m not in PROTOTYPE for m in models):
        fail(f"--models takes add2, addwork and smollm2, got {args.models}")
    t0 = time.perf_counter()
    if args.what == "prototype":
        result = prototype(models)
        seconds = sum(p["seconds"] for p in result["parts"].values())
        write_json(PROTOTYPE_JSON, {"engine_prototype_seconds": seconds, **result},
                   "python studies/engine.py prototype (each model in its venv)", time.perf_counter() - t0)
        print(f"wrote {PROTOTYPE_JSON}")
        return 0
    if args.what == "measure":
        measure(models)
        return 0
    if args.what == "redraw":
        plot(read_json("figures/engine.json"))
        return 0
    print(f"make engine: about {projected_seconds(read_json(PROTOTYPE_JSON)) / 60:.0f} min of decoding "
          f"projected from {PROTOTYPE_JSON}", flush=True)
    measure([m for m in models if m != "smollm2"])
    if "smollm2" in models:
        if not os.path.exists(args.pretrained_python):
            fail(f"SmolLM2's parts run in {args.pretrained_python}, which does not exist (make engine builds it)")
        code, _ = in_own_process("studies/engine.py", ["measure", "--models", "smollm2"], python=args.pretrained_python)
        if code:
            fail(f"make engine: SmolLM2's parts exited with {code}; their log is above", 1)
    if models != list(SIZES):
        return 0
    result = assemble()
    plot(result)
    write_json("figures/engine.json", result, "make engine", result["engine_seconds"])
    print(f"wrote figures/engine.json and figures/engine.png ({result['engine_seconds'] / 60:.0f} min)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

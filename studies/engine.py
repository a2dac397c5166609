"""The engine gap against length, at theta = theta_old: a sampler in another precision (or with a
nucleus) against the float32 trainer, no training.

    python studies/engine.py prototype --models add2,addwork          # in .venv, then
    .venv-pretrained/bin/python studies/engine.py prototype --models smollm2   # (it needs gguf):
        figures/engine_prototype.json, seconds and tokens per second per model and sampler (minutes)
    python studies/engine.py --pretrained-python .venv-pretrained/bin/python   # make engine:
        every model, sampler and view a part kept in runs/engine/ (SmolLM2's in that interpreter),
        then figures/engine.json and engine.png (40 minutes on 2 cores; an interrupted run resumes)
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
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

import gspo_lab as g  # noqa: E402
from studies.common import (Ledger, Parser, bootstrap_slopes, cli, fail, in_own_process,  # noqa: E402
                            kept_design, kept_part, load_checkpoint, paired_differences, read_json,
                            reuse_problem, run_jobs, script_job, smollm_gguf, write_json, write_result)

# The files this target writes into figures/ (left out of its dirty check).
OUTPUTS = ("figures/engine.json", "figures/engine.png", "figures/engine_prototype.json",
           "figures/engine_map.json", "figures/engine_map.png", "figures/engine_geo_check.json",
           "figures/engine_kl_formulas.json")
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
def preallocated_cache(config, capacity: int):
    """A transformers DynamicCache whose full-attention layers write into buffers sized once for
    `capacity` positions and hand attention a view of the first n: the values torch.cat would give,
    without a new, one-token-longer allocation per layer and step. That growth is what fragments
    glibc's heap: SmolLM2's float32 cache alone reaches about 0.9 GB over 512 tokens."""
    from transformers import DynamicCache
    from transformers.cache_utils import DynamicLayer

    class Preallocated(DynamicLayer):
        def update(self, key_states, value_states, *args, **kwargs):
            if not self.is_initialized:
                self.lazy_initialization(key_states, value_states)
                b, h, _, d = key_states.shape
                self.buffers = (key_states.new_empty(b, h, capacity, d), value_states.new_empty(b, h, capacity, d))
                self.n = 0
            m = key_states.shape[-2]
            for buf, new in zip(self.buffers, (key_states, value_states)):
                buf[:, :, self.n:self.n + m] = new
            self.n += m
            self.keys, self.values = (buf[:, :, :self.n] for buf in self.buffers)
            return self.keys, self.values

    cache = DynamicCache(config=config)
    cache.layers = [Preallocated() if type(layer) is DynamicLayer else layer for layer in cache.layers]
    return cache


@torch.no_grad()
def paired_decode(sampler, trainer, prompt_ids, prompt_mask, length: int, eos_id: int, *,
                  temperature: float = 1.0, top_p: float = 1.0, suppress_eos: bool = True) -> dict:
    """Sample `length` tokens per row from `sampler` (q, `nucleus_logprobs` of its logits, KV cache)
    while `trainer` (p, float32 log_softmax of logits / temperature) reads them with a cache of its
    own. Returns (B, L) float64 `d` = log p(y_t) - log q(y_t) and `k` = KL(q_t || p_t) over the
    vocabulary, and bool `alive` (False after a row's EOS; all True with `suppress_eos`, which sets
    EOS to -inf on both sides, so both distributions are renormalised without it); with the
    sampled `tokens` (B, L) and the sampler's record of them, `logq` (B, L) float64."""
    attn = prompt_mask.long()
    pos = (attn.cumsum(-1) - 1).clamp(min=0)
    caches = [preallocated_cache(m.config, prompt_ids.shape[1] + length) for m in (sampler, trainer)]
    logits = [m(input_ids=prompt_ids, attention_mask=attn, position_ids=pos, cache=c, use_cache=True,
                logits_to_keep=1).logits[:, -1] for m, c in zip((sampler, trainer), caches)]
    done = torch.zeros(len(prompt_ids), dtype=torch.bool)
    d, k, alive, tokens, record = [], [], [], [], []
    for _ in range(length):
        if suppress_eos:
            for lg in logits:
                lg[:, eos_id] = -float("inf")
        logq = g.nucleus_logprobs(logits[0], temperature, top_p)                  # (B, V)
        logp = torch.log_softmax(logits[1].float() / temperature, dim=-1)        # (B, V)
        nxt = torch.multinomial(logq.exp(), 1).squeeze(-1)                       # (B,)
        pick = nxt[:, None]
        picked = logq.gather(-1, pick)                                           # (B, 1): the record
        d.append((logp.gather(-1, pick) - picked).squeeze(-1).double())
        k.append(g.token_kl(logits[0], logits[1], temperature, top_p))
        alive.append(~done)
        tokens.append(nxt)
        record.append(picked.squeeze(-1).double())
        done = done | (nxt == eos_id)
        if done.all():
            break
        attn = torch.cat([attn, torch.ones_like(attn[:, :1])], dim=1)
        pos = pos[:, -1:] + 1
        logits = [m(input_ids=nxt[:, None], attention_mask=attn, position_ids=pos, cache=c,
                    use_cache=True).logits[:, -1] for m, c in zip((sampler, trainer), caches)]
    return {"d": torch.stack(d, 1), "k": torch.stack(k, 1), "alive": torch.stack(alive, 1),
            "tokens": torch.stack(tokens, 1), "logq": torch.stack(record, 1)}


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
    problems = g.sample_train_problems(g.make_splits(g.TASKS[task], 500, 300), n, rng)
    ids, attn = g.encode_prompts(tok, [g.TASKS[task].prompt(a, b) for a, b in problems], "cpu")
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


# ---------------------------------------------------------------------------------------------
# The KL's two formulas: make engine's committed numbers came from the float32 one
# ---------------------------------------------------------------------------------------------
KL_FORMULAS_JSON = "figures/engine_kl_formulas.json"
KL_FORMULA_SIZES = {"add2": {"rows": 64, "length": 32}, "addwork": {"rows": 16, "length": 64},
                    "smollm2": {"rows": 4, "length": 64}}


def float32_kl(sampler_logits: torch.Tensor, trainer_logits: torch.Tensor, temperature: float, top_p: float) -> torch.Tensor:
    """The formula engine.json, engine_map.json and the mechanism JSONs were measured with: sum over q's
    support of q (log q - log p), in float32, which round-off can put on either side of 0."""
    logq = g.nucleus_logprobs(sampler_logits, temperature, top_p)
    logp = torch.log_softmax(trainer_logits.float() / temperature, dim=-1)
    return torch.where(logq > -math.inf, logq.exp() * (logq - logp), 0.0).sum(-1)


def kl_formulas(name: str) -> dict:
    """Per sampler, on the logits of one model's decoded tokens (make engine's decoding, EOS allowed in
    a full pass of both models): the mean KL per token by token_kl (float64, term by term >= 0) and by
    the float32 formula, their largest difference at a token and the tokens where the float32 one is < 0."""
    rng = random.Random(0)
    torch.manual_seed(0)
    size = KL_FORMULA_SIZES[name]
    model, tok, ids, attn, room = model_and_prompts(name, size["rows"], rng)
    out = {}
    for sampler, (dtype, top_p) in SAMPLERS.items():
        copy = sampler_of(model, dtype)
        dec = paired_decode(copy, model, ids, attn, min(size["length"], room), tok.eos_token_id, top_p=top_p)
        with torch.no_grad():
            logits = [g.completion_logits(m, ids, attn, dec["tokens"]) for m in (copy, model)]   # (B, L, V) each
        exact, old = g.token_kl(*logits, 1.0, top_p), float32_kl(*logits, 1.0, top_p).double()  # (B, L) each
        diff = (old - exact).abs()
        out[sampler] = {"tokens": exact.numel(), "mean_kl_float64": exact.mean().item(),
                        "mean_kl_float32": old.mean().item(),
                        "relative_difference_of_means": abs(old.mean().item() - exact.mean().item()) / exact.mean().item(),
                        "max_abs_difference_per_token": diff.max().item(),
                        "mean_abs_difference_per_token": diff.mean().item(),
                        "float32_negative_tokens": int((old < 0).sum()), "float64_negative_tokens": int((exact < 0).sum())}
    return out


def write_kl_formulas(models: list[str]) -> dict:
    """KL_FORMULAS_JSON with `models`' entries (re)made, the others kept: SmolLM2's runs in its own venv."""
    t0 = time.perf_counter()
    record = read_json(KL_FORMULAS_JSON) if os.path.exists(KL_FORMULAS_JSON) else {"models": {}}
    command = "python studies/engine.py kl-formulas --models " + ",".join(models)
    for name in models:                 # each model's entry names the invocation that made it
        record["models"][name] = {**kl_formulas(name), "size": KL_FORMULA_SIZES[name], "command": command,
                                  "measured_at_commit": g.tree_state([KL_FORMULAS_JSON])["measured_at_commit"]}
    write_result(KL_FORMULAS_JSON, record, command, time.perf_counter() - t0)
    return record


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


# SmolLM2's parts run one to a process: in one process, a part's peak counted what earlier parts
# had freed but the allocator kept (make engine's first run: its last three parts above 4 GiB). Within a
# part, blocks that grow by a token every step (the caches, attention's copies of them) fragment
# glibc's heap: make pretrained's cure, every block of 1 MiB or more handed back when freed, holds
# the peak down, and the preallocated caches (`preallocated_cache`) win back the time it costs.
SMOLLM_ENV = {"MALLOC_MMAP_THRESHOLD_": str(1 << 20)}


def measure(models: list[str], only: tuple[str, str] | None = None) -> None:
    """Every part of `models` (or only the sampler and view `only`) in this process, each kept in
    runs/engine/ with its host and peak."""
    for name in models:
        for sampler in SAMPLERS:
            for view in VIEWS:
                if only is not None and (sampler, view) != only:
                    continue
                part = kept_part(FOLDER, "engine", part_name(name, sampler, view),
                                 lambda: measure_part(name, sampler, view), own_peak=True,
                                 settings={**part_settings(name), "sampler": sampler, "view": view})
                print(f"{part_name(name, sampler, view)}: {part['tokens']} tokens in {part['seconds']:.0f} s, "
                      f"peak {part['peak_rss_mb']:.0f} MiB", flush=True)


def projected_seconds(prototype: dict) -> float:
    """make engine's decoding time from the prototype's rates: the tiny models at their measured
    tokens/s, SmolLM2 at its 32-row rate for bf16, scaled for the other samplers by their 4-row
    rates against bf16's. A projection: attention over 512 tokens costs more than over 64, and the
    full run's parts took about 1.6 times the 1,502 s projected here (engine.json's engine_seconds)."""
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
        ax.axhspan(1e-6, -GSPO_BAND[0], color="grey", alpha=0.15)
        ax.axhline(-GSPO_BAND[0], color="black", lw=1, label="GSPO band (3e-4 / 4e-4)")
        ax.axhline(GSPO_BAND[1], color="black", lw=1)
        ax.axhline(-GRPO_BAND[0], color="grey", ls="--", lw=1, label="GRPO token band (0.22 / 0.24)")
        ax.axhline(GRPO_BAND[1], color="grey", ls="--", lw=1)
        natural = statistics.median(r["natural"]["length_p50"] for r in by_sampler.values())
        ax.axvline(natural, color="grey", ls=":", lw=1, label="median natural length (EOS allowed)")
        ax.set(xscale="log", yscale="log", ylim=(1e-5, 0.5), xlabel="prefix length n (tokens, EOS suppressed)",
               title=f"{name} ({next(iter(by_sampler.values()))['sequences']} sequences per sampler)")
    axes[0].set_ylabel("mean |log s| over the first n tokens")
    axes[0].legend(fontsize=7, title="dotted: each sampler's exact KL floor", title_fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ---------------------------------------------------------------------------------------------
# make figures-engine: what stops GSPO with the sampler's pi_old, and what restores it. On add2,
# each cell from make figures-map's warm-ups (seeds 0-2; 3 and 4 with CONFIRM=1) at its step count,
# one comparison named per cell, the map's rule; addwork's natural answers as the length check.
# ---------------------------------------------------------------------------------------------
EM_RUNS = "runs/engine_map"
EM_JSON = "figures/engine_map.json"
EM_SEEDS = (0, 1, 2)
EM_CONFIRM_SEEDS = (3, 4)
EM_NOISE_OFFSET = 100               # GSPO's second RL stream: --seed s + 100 from the same warm-up
EM_BUDGET_SECONDS = 60 * 60
EM_CONFIRM_BUDGET_SECONDS = 20 * 60
BF16 = ["--sampler-dtype", "bfloat16"]
FP16 = ["--sampler-dtype", "float16"]
FROM_SAMPLER = ["--old-logprobs", "sampler"]
GEO_MASK = ["--is-correction", "sequence_geometric_mask"]          # verl's preset, 1/1.001 and 1.001
# name: (model, flags, losses, the deciding comparison: "gspo - grpo" in the cell, or the reference
# cell whose GSPO runs this cell's GSPO runs are paired with, seed by seed; drop: minibatch 1's)
EM_CELLS = {
    "bf16_trainer": ("dense", BF16, ("gspo", "grpo"), "gspo - grpo", None),
    "bf16_sampler": ("dense", BF16 + FROM_SAMPLER, ("gspo", "grpo"), "gspo - grpo", None),
    "bf16_sampler_wide": ("dense", BF16 + FROM_SAMPLER + ["WIDE"], ("gspo",), "bf16_sampler", None),
    "wide_trainer": ("dense", BF16 + ["WIDE"], ("gspo",), "bf16_trainer", None),
    "random_drop": ("dense", BF16, ("gspo",), "bf16_trainer", "random"),
    "gap_drop": ("dense", BF16, ("gspo",), "bf16_trainer", "gap"),
    "fp16_sampler": ("dense", FP16 + FROM_SAMPLER, ("gspo", "grpo"), "bf16_sampler", None),
    "bf16_trainer_geo_mask": ("dense", BF16 + GEO_MASK, ("gspo", "grpo"), "bf16_trainer", None),
    "addwork_bf16_trainer": ("addwork", BF16, ("gspo", "grpo"), "gspo - grpo", None),
    "addwork_bf16_sampler": ("addwork", BF16 + FROM_SAMPLER, ("gspo", "grpo"), "addwork_bf16_trainer", None)}
EM_NOISE_FIRST = ("bf16_trainer", "addwork_bf16_trainer")   # each task's noise measured up front
EM_RULE = ("metric: accuracy_after_rl (test set). Each cell is decided by the one comparison its design "
           "names: 'gspo - grpo' pairs the cell's GSPO and GRPO runs of a seed; a reference cell pairs the "
           "cell's GSPO run of seed s with the reference's GSPO run of seed s (the same warm-up and RL seed). "
           "A cell's noise is the largest |GSPO(s) - GSPO(s, second RL stream)| over its seeds (--seed s + "
           "100 from the same warm-up), measured up front in bf16_trainer and addwork_bf16_trainer and in "
           "every cell whose three differences share a sign; a cell without its own uses the largest "
           "measured for its task. A cell separates when its three differences have the same sign (a zero "
           "breaks it) and |median| exceeds its noise. Confirmation (CONFIRM=1): seeds 3 and 4 for at most "
           "the two separating cells with the largest |median| (and, for a reference comparison, the "
           "reference's GSPO runs of those seeds); confirmed only with 5 of 5 same signs and |median of 5| "
           "above the noise. The confirmation's two new seeds carry p = 1/4 on their own (the same sign by "
           "chance), so a call rests on the size of the median against the noise as much as on the signs.")


def widened_band(engine_json: str = "figures/engine.json") -> dict:
    """GSPO's band widened to the 90th percentile of |log s| that make engine measured on add2's
    bf16 sampler at natural lengths: log s in [-p90, p90], i.e. eps_low = 1 - e^-p90, eps_high =
    e^p90 - 1 (both sides as wide, in log space)."""
    if not os.path.exists(engine_json):
        fail(f"make figures-engine widens GSPO's band from {engine_json}: run `make engine` first")
    p90 = read_json(engine_json)["models"]["add2"]["bfloat16"]["natural"]["abs_log_s_p90"]
    return {"abs_log_s_p90": p90, "eps_low": 1 - math.exp(-p90), "eps_high": math.exp(p90) - 1,
            "source": f"{engine_json}: models.add2.bfloat16.natural.abs_log_s_p90"}


def drop_rate(map_json: str = "figures/map.json") -> dict:
    """random_drop's rate: the share of minibatch 1's sequences GSPO clipped in make figures-map's
    bf16_sampler cell, over its runs (first_minibatch_clip, the median over seeds of each run's mean)."""
    rate = read_json(map_json)["first_minibatch_clip"]["by_cell"]["bf16_sampler"]["gspo"]["minibatch_1_mean_median"]
    return {"rate": rate, "source": f"{map_json}: first_minibatch_clip.by_cell.bf16_sampler.gspo.minibatch_1_mean_median"}


def em_steps(model: str) -> int:
    """The map's step count: its step fraction of the model's default steps."""
    from studies import map as regimes
    return max(10, round(regimes.STEP_FRACTION * regimes.MODELS[model]["default_steps"]))


def em_flags(cell: str, band: dict) -> list[str]:
    model, flags, *_ = EM_CELLS[cell]
    from studies import map as regimes
    wide = ["--eps-low", f"{band['eps_low']:.6g}", "--eps-high", f"{band['eps_high']:.6g}"]
    return regimes.MODELS[model]["task"] + [f for flag in flags for f in (wide if flag == "WIDE" else [flag])]


def em_design(band: dict | None = None, rate: dict | None = None) -> dict:
    """Everything the measured run is held to, written into engine_map.json before it starts."""
    band = band or widened_band()
    rate = rate or drop_rate()
    cells = {}
    for name, (model, _, losses, against, drop) in EM_CELLS.items():
        cells[name] = {"model": model, "task": "addwork" if model == "addwork" else "add2",
                       "flags": em_flags(name, band), "losses": list(losses), "steps": em_steps(model),
                       "decided_by": against if against == "gspo - grpo" else f"gspo({name}) - gspo({against})",
                       "drop_in_minibatch_1": drop}
    return {"cells": cells, "seeds": list(EM_SEEDS), "confirm_seeds": list(EM_CONFIRM_SEEDS),
            "noise_rl_seed_offset": EM_NOISE_OFFSET, "noise_measured_first_in": list(EM_NOISE_FIRST),
            "widened_band": band, "random_drop_rate": rate,
            "gap_drop": "in minibatch 1 only, the sequences whose s from the sampler's record against the "
                        "trainer's pass at theta_old lies outside GSPO's band on the side that clips for the "
                        "sign of their advantage: their advantage set to 0 there (a clipped sequence's "
                        "gradient is 0 and it stays in the 1/G mean, as here); random_drop likewise at the rate",
            "warmups": "make figures-map's (runs/map/warmup_dense_s<seed>; addwork: make figures-long's), made "
                       "where missing",
            "decision_rule": EM_RULE, "budget_seconds": EM_BUDGET_SECONDS,
            "confirm_budget_seconds": EM_CONFIRM_BUDGET_SECONDS,
            "null_probabilities": {"same_sign_3_of_3_per_cell": 0.25,
                                   "at_least_one_of_10_cells": 1 - 0.75 ** len(EM_CELLS),
                                   "same_sign_5_of_5_per_cell": 1 / 16},
            "workers": 2, "threads_per_run": 1}


def em_run_name(cell: str, loss: str, seed: int, rl_seed: int | None = None) -> str:
    return f"{cell}_{loss}_s{seed}" + ("" if rl_seed in (None, seed) else f"_rl{rl_seed}")


def em_jobs(design: dict, cells, seeds, noise: bool = False, losses=None, folder: str = EM_RUNS,
            noise_offset: int = EM_NOISE_OFFSET) -> list[dict]:
    """Each cell's runs (or, with `noise`, GSPO's second RL streams, --seed s + `noise_offset`) of
    `seeds` into `folder`, each waiting for its warm-up; a drop cell's run goes through `python
    studies/engine.py _run KIND RATE ...`. make figures-mechanism's jobs are these too."""
    from studies import map as regimes
    jobs = []
    for cell in cells:
        c = design["cells"][cell]
        for seed in seeds:
            warm = regimes.warmup_job(c["model"], seed)
            ckpt = os.path.join(os.path.dirname(warm["done"]), "checkpoint")
            todo = [("gspo", seed + noise_offset)] if noise else [(loss, seed) for loss in (losses or c["losses"])]
            for loss, rl_seed in todo:
                name = em_run_name(cell, loss, seed, rl_seed)
                args = ["--model", ckpt, "--warmup-max-steps", "0", "--seed", str(rl_seed), "--loss", loss, *c["flags"]]
                job = script_job(name, args, folder, c["steps"], needs=warm["done"])
                if c.get("drop_in_minibatch_1"):
                    job = drop_job(job, c["drop_in_minibatch_1"], design["random_drop_rate"]["rate"])
                jobs.append(job)
    return jobs


def drop_job(job: dict, kind: str, rate: float) -> dict:
    """A script_job's run made through `python studies/engine.py _run KIND RATE` (`drop_run`)."""
    out = job["cmd"][2:]                                                  # the script's flags
    return {**job, "cmd": [sys.executable, "studies/engine.py", "_run", kind, f"{rate:.6g}", *out], "argv": out}


def drop_run(kind: str, rate: float, argv: list[str]) -> int:
    """gspo_lab.main(argv) with minibatch 1's chosen sequences given advantage 0 at every step:
    `random`, each with probability `rate` (its own generator, seeded by the run's seed and step);
    `gap`, those the sampler's record as pi_old would have clipped on their active side;
    `random_all` (geo-check's), like `random` over the whole rollout, every minibatch. The random
    state is restored after drawing the chunks, so nothing else differs from the plain run. The
    step's metrics gain `dropped_first_minibatch` (`dropped`), the share of those rows dropped."""
    original, step = g.rl_update, [0]

    def rl_update(model, opt, batch, cfg, eps_low, eps_high):
        step[0] += 1
        if kind == "random_all":             # geo-check's control: every minibatch's rows
            first = torch.arange(len(batch["rewards"]))
        else:
            state = torch.get_rng_state()    # rl_update draws the same chunks again: the run stays paired
            first = g.group_chunks(len(batch["rewards"]), cfg.group_size, cfg.minibatches, batch["rewards"].device)[0]
            torch.set_rng_state(state)
        mask = batch["mask"][first] != 0
        if kind.startswith("random"):
            gen = torch.Generator().manual_seed(cfg.seed * 1_000_003 + step[0])
            drop = torch.rand(len(first), generator=gen) < rate
        else:
            with torch.no_grad():
                lp = g.group_policy_logprobs(model, batch["prompt_ids"][first], batch["prompt_mask"][first],
                                             batch["completions"][first], cfg.group_size, temperature=cfg.temperature)
            s = torch.exp(g.sequence_log_ratio(lp, batch["sampler_logprobs"][first].to(lp.dtype), mask))
            drop = g.clipped_on_active_side(s, batch["advantages"][first], eps_low, eps_high) & mask.any(-1)
        adv = batch["advantages"].clone()
        adv[first[drop]] = 0
        m = original(model, opt, {**batch, "advantages": adv}, cfg, eps_low, eps_high)
        m["dropped" if kind == "random_all" else "dropped_first_minibatch"] = drop.double().mean().item()
        return m
    g.rl_update = rl_update
    try:
        return g.main(argv)
    finally:
        g.rl_update = original


def em_projection(design: dict, proto_json: str = "figures/map_prototype.json") -> dict:
    """The first phase's seconds from make figures-map's prototype timings, 2 runs at a time: every
    cell's runs, the up-front noise runs, and an allowance of two more cells' noise runs (the bf16
    cells' seconds per step for add2; addwork_deep_hot's, with 16 minibatches, for addwork: an upper bound)."""
    proto = read_json(proto_json)["cells"]
    per = {"dense": proto["bf16_trainer"], "addwork": proto["addwork_deep_hot"]}

    def run_seconds(cell):
        c = design["cells"][cell]
        t = per[c["model"]]
        return t["overhead_seconds"] + c["steps"] * t["seconds_per_step"]
    runs = sum(len(EM_SEEDS) * len(c["losses"]) * run_seconds(n) for n, c in design["cells"].items())
    noise = sum(len(EM_SEEDS) * run_seconds(n) for n in EM_NOISE_FIRST)
    others = sorted((run_seconds(n) for n in design["cells"] if n not in EM_NOISE_FIRST), reverse=True)[:2]
    total = (runs + noise + len(EM_SEEDS) * sum(others)) / 2
    return {"seconds": total, "runs": runs / 2, "noise": noise / 2, "allowance": len(EM_SEEDS) * sum(others) / 2}


def em_collect(design: dict, seeds) -> tuple[list[dict], dict]:
    """The records of every finished run (the map's run record, plus the drop share where logged) and
    accuracy_after_rl by cell, slot (gspo, grpo, noise) and seed."""
    from studies import map as regimes
    records, acc = [], {}
    for cell, c in design["cells"].items():
        a = {"gspo": {}, "grpo": {}, "noise": {}}
        for seed in seeds:
            for loss, rl_seed, slot in (("gspo", seed, "gspo"), ("grpo", seed, "grpo"),
                                        ("gspo", seed + EM_NOISE_OFFSET, "noise")):
                name = em_run_name(cell, loss, seed, rl_seed)
                if not os.path.exists(os.path.join(EM_RUNS, name, "summary.json")):
                    continue
                rec, rl = regimes.run_basics(name, EM_RUNS, regimes.warm_path(c["model"], seed))
                rec.update({"cell": cell, "seed": seed, "rl_seed": rl_seed,
                            "clip_seqs_minibatch_1": statistics.fmean(r["clip_seqs_by_minibatch"][0] for r in rl),
                            **{k: statistics.fmean(r[k] for r in rl) for k in ("engine_log_s_mean", "engine_kl_tokens",
                                                                                "clip_seqs_pos_adv", "clip_seqs_neg_adv",
                                                                                "is_masked_tokens",
                                                                                "dropped_first_minibatch") if k in rl[0]}})
                records.append(rec)
                a[slot][seed] = rec["accuracy_after_rl"]
        acc[cell] = a
    return records, acc


def em_verdicts(design: dict, acc: dict, seeds) -> dict:
    """The map's rule (studies/map.py's `verdicts`) per cell on its named comparison: the cell's GSPO
    runs against its GRPO runs, or against its reference cell's GSPO runs, seed by seed; each with
    the comparison it was decided by and, where the cell ran GRPO, GSPO - GRPO by seed."""
    from studies import map as regimes
    compared = {cell: {"gspo": a["gspo"], "noise": a["noise"],
                       "grpo": a["grpo"] if EM_CELLS[cell][3] == "gspo - grpo" else acc[EM_CELLS[cell][3]]["gspo"]}
                for cell, a in acc.items()}
    out = regimes.verdicts(compared, {c: v["task"] for c, v in design["cells"].items()}, seeds)
    for cell, v in out.items():
        del v["ahead"]                        # "gspo" or "grpo": the wrong words for a reference comparison
        a = acc[cell]
        out[cell] = {"decided_by": design["cells"][cell]["decided_by"], **v,
                     "gspo_minus_grpo_by_seed": (dict(zip(seeds, paired_differences(a["gspo"], a["grpo"], seeds)))
                                                 if a["grpo"] else None)}
    return out


def em_write_design() -> dict:
    """engine_map.json before any run: the design and its projected time, no runs; one holding runs
    made under another design is never overwritten."""
    d = em_design()
    kept = kept_design(EM_JSON, d)
    if kept is not None:
        return kept
    record = {"figures_engine_seconds": 0.0, "design": d, "projection": em_projection(d), "runs": [], "cells": {}}
    write_json(EM_JSON, record, "python studies/engine.py figures-design", 0.0)
    return record


def figures_engine(confirm: bool = False) -> dict:
    """make figures-engine: the first phase (every cell, the up-front noise, then the noise of each
    cell whose signs agree), or with `confirm` seeds 3 and 4 of at most two separating cells."""
    from studies import map as regimes
    record = em_write_design()
    d = record["design"]
    ledger = Ledger(os.path.join(EM_RUNS, ("confirm" if confirm else "first_phase") + "_seconds.json"))
    try:
        if not confirm:
            warm = [regimes.warmup_job(m, s) for m in ("dense", "addwork") for s in EM_SEEDS]
            run_jobs(warm + em_jobs(d, d["cells"], EM_SEEDS) + em_jobs(d, EM_NOISE_FIRST, EM_SEEDS, noise=True), EM_RUNS)
            _, acc = em_collect(d, EM_SEEDS)
            agree = [c for c, v in em_verdicts(d, acc, EM_SEEDS).items() if v["common_sign"] and c not in EM_NOISE_FIRST]
            run_jobs(em_jobs(d, agree, EM_SEEDS, noise=True), EM_RUNS)
        else:
            if not record.get("cells"):
                fail(f"{EM_JSON} has no first phase yet: run `make figures-engine` first")
            chosen = sorted((c for c, v in record["cells"].items() if v["separates"]),
                            key=lambda c: -abs(record["cells"][c]["median_difference"]))[:2]
            record["confirmation"] = {"cells": chosen, "seeds": list(EM_SEEDS + EM_CONFIRM_SEEDS)}
            jobs = [regimes.warmup_job(d["cells"][c]["model"], s) for c in chosen for s in EM_CONFIRM_SEEDS]
            for c in chosen:
                jobs += em_jobs(d, [c], EM_CONFIRM_SEEDS)
                against = EM_CELLS[c][3]
                if against != "gspo - grpo":
                    jobs += em_jobs(d, [against], EM_CONFIRM_SEEDS, losses=("gspo",))
            unique = {j["name"]: j for j in jobs}
            run_jobs(list(unique.values()), EM_RUNS)
    finally:
        ledger.close()
    seeds = EM_SEEDS + (EM_CONFIRM_SEEDS if confirm else ())
    record["runs"], acc = em_collect(d, seeds)
    first = {c: {k: {s: v for s, v in a[k].items() if s in EM_SEEDS} for k in a} for c, a in acc.items()}
    record["cells"] = em_verdicts(d, first, EM_SEEDS)
    for cell, v in record["cells"].items():
        mine = [r for r in record["runs"] if r["cell"] == cell and r["seed"] in EM_SEEDS and r["rl_seed"] == r["seed"]]
        v["collapses"] = {loss: sum(r["collapsed"] for r in mine if r["loss"] == loss) for loss in EM_CELLS[cell][2]}
    if confirm:
        chosen = record["confirmation"]["cells"]
        five = em_verdicts(d, {c: acc[c] for c in acc}, EM_SEEDS + EM_CONFIRM_SEEDS)
        record["confirmation"]["by_cell"] = {}
        for c in chosen:
            v = {**five[c], "noise": record["cells"][c]["noise"]}            # the noise stays the first phase's
            v["confirmed"] = bool(v["common_sign"] and v["noise"] is not None and abs(v["median_difference"]) > v["noise"])
            record["confirmation"]["by_cell"][c] = v
        record["confirmation"]["figures_engine_confirm_seconds"] = ledger.total()
    else:
        record["figures_engine_seconds"] = ledger.total()
    record["separating_cells"] = [c for c, v in record["cells"].items() if v["separates"]]
    write_result(EM_JSON, record, "python studies/engine.py figures" + (" --confirm" if confirm else ""),
                 record["figures_engine_seconds"])
    plot_engine_map(record)
    for cell, v in record["cells"].items():
        diffs = ", ".join(f"{x:+.3f}" for x in v["differences_by_seed"].values())
        print(f"{cell:24s} {v['decided_by']:48s} {diffs:24s} noise {v['noise'] if v['noise'] is None else round(v['noise'], 3)}"
              f"  {'separates' if v['separates'] else '-'}")
    return record


# ---------------------------------------------------------------------------------------------
# After the first phase: why verl's geometric mask collapsed every run (python studies/engine.py
# geo-check, figures/engine_geo_check.json). Designed once those runs had been read, so outside
# figures-engine's design and rule: a check for a bug, a control and a count, each stated alone.
# ---------------------------------------------------------------------------------------------
GEO_JSON = "figures/engine_geo_check.json"
GEO_RUNS = "runs/engine_geo_check"
GEO_CELL = "bf16_trainer_geo_mask"
GEO_WIDE = ["--is-clip-min", "1e-30", "--is-clip-max", "1e30"]     # bounds no ratio leaves: nothing masked
GEO_ROLLOUTS = 5                                                   # per seed's warm-up, for the kept shares
GEO_PRESET = g.is_bounds(g.Config(is_correction="sequence_geometric_mask"))    # verl's, 1/1.001 and 1.001


def geo_design(em: dict) -> dict:
    """The check's settings, from engine_map.json's design and its geo-mask GSPO runs."""
    runs = {r["name"]: r for r in em["runs"]}
    rates = {s: runs[em_run_name(GEO_CELL, "gspo", s)]["is_masked_tokens"] for s in EM_SEEDS}
    return {"post_hoc": "designed after figures-engine's first phase had been read (every geometric-mask run "
                        "collapsed); not part of engine_map.json's design or rule",
            "seeds": list(EM_SEEDS), "loss": "gspo", "steps": em["design"]["cells"][GEO_CELL]["steps"],
            "wide_bounds": {"flags": em["design"]["cells"][GEO_CELL]["flags"] + GEO_WIDE,
                            "question": "does the masked run equal bf16_trainer's GSPO run when nothing is masked?"},
            "random_keep": {"flags": em["design"]["cells"]["bf16_trainer"]["flags"], "drop_rate_by_seed": rates,
                            "source": f"{EM_JSON}: runs[name={GEO_CELL}_gspo_s<seed>].is_masked_tokens",
                            "how": "every step, each response of the whole rollout given advantage 0 with that "
                                   "probability (its own generator), the trainer's pi_old, no mask",
                            "question": "does keeping as few responses, chosen at random, collapse the run too?"},
            "kept_shares": {"rollouts_per_seed": GEO_ROLLOUTS, "bounds": list(GEO_PRESET),
                            "question": "which responses does the preset keep, by the sign of the advantage?",
                            "where": "the warm-up checkpoints the runs start from, the bf16 sampler, the "
                                     "trainer's pi_old, no update"}}


def geo_jobs(design: dict) -> list[dict]:
    from studies import map as regimes
    jobs = []
    for seed in design["seeds"]:
        warm = regimes.warmup_job("dense", seed)
        base = ["--model", os.path.join(os.path.dirname(warm["done"]), "checkpoint"), "--warmup-max-steps", "0",
                "--seed", str(seed), "--loss", design["loss"]]
        jobs.append(script_job(f"wide_gspo_s{seed}", base + design["wide_bounds"]["flags"], GEO_RUNS,
                               design["steps"], needs=warm["done"]))
        job = script_job(f"random_keep_gspo_s{seed}", base + design["random_keep"]["flags"], GEO_RUNS,
                         design["steps"], needs=warm["done"])
        jobs.append(drop_job(job, "random_all", design["random_keep"]["drop_rate_by_seed"][seed]))
    return jobs


@torch.no_grad()
def warmup_rollouts(seed: int, rollouts: int):
    """`rollouts` rollouts at make train's settings from the dense warm-up of `seed` (theta_old),
    each sampled by a fresh bf16 copy, the random streams seeded by `seed`: yields (model, cfg,
    sampler, batch) for each, as a run's first step sees them."""
    from studies import map as regimes
    cfg = g.parse_config(regimes.MODELS["dense"]["task"] + ["--sampler-dtype", "bfloat16", "--seed", str(seed)])
    model, tok = g.load_pretrained(os.path.join(regimes.warm_path("dense", seed), "checkpoint"))
    torch.manual_seed(seed)
    rng = random.Random(seed)
    task = g.task_of(cfg)
    splits = g.make_splits(task, cfg.test_size, cfg.val_size)
    for _ in range(rollouts):
        sampler = g.sampling_model(model, cfg)
        yield model, cfg, sampler, g.rollout(sampler, tok, g.sample_train_problems(splits, cfg.prompts_per_step, rng),
                                             cfg, "cpu")


@torch.no_grad()
def geo_kept_shares(seeds, rollouts: int = GEO_ROLLOUTS) -> dict:
    """The share of responses the preset keeps, overall and by the sign of the advantage, over
    `rollouts` rollouts from each seed's warm-up (as the runs' first step sees them)."""
    rows = []
    for seed in seeds:
        for model, _, _, b in warmup_rollouts(seed, rollouts):
            old = g.policy_logprobs(model, b["prompt_ids"], b["prompt_mask"], b["completions"])
            mask = b["mask"] != 0
            w = g.correction_weight(old, b["sampler_logprobs"], mask, "sequence_geometric_mask", *GEO_PRESET)
            rows.append(torch.stack([w[:, 0], b["advantages"]], 1))
    w, a = torch.cat(rows).T
    kept = w == 1

    def share(sel):
        return {"responses": int(sel.sum()), "kept_share": kept[sel].double().mean().item()}
    return {"all": share(a == a), "positive_advantage": share(a > 0), "negative_advantage": share(a < 0),
            "zero_advantage": share(a == 0), "sum_of_kept_advantages": a[kept].sum().item()}


def geo_check() -> dict:
    """python studies/engine.py geo-check: the runs (2 at a time, resumable), then the record."""
    from studies import map as regimes
    em = read_json(EM_JSON)
    if not em.get("runs"):
        fail(f"{EM_JSON} has no runs yet: run `make figures-engine` first")
    design = geo_design(em)
    ledger = Ledger(os.path.join(GEO_RUNS, "seconds.json"))
    try:
        warm = [regimes.warmup_job("dense", s) for s in design["seeds"]]      # made where missing, as make figures-map's
        run_jobs(warm + geo_jobs(design), GEO_RUNS)
        kept = geo_kept_shares(design["seeds"])
    finally:
        ledger.close()
    by_name = {r["name"]: r for r in em["runs"]}
    out = {}
    for seed in design["seeds"]:
        plain = by_name[em_run_name("bf16_trainer", "gspo", seed)]
        geo = by_name[em_run_name(GEO_CELL, "gspo", seed)]
        warm = regimes.warm_path("dense", seed)
        wide, _ = regimes.run_basics(f"wide_gspo_s{seed}", GEO_RUNS, warm)
        rand, rl = regimes.run_basics(f"random_keep_gspo_s{seed}", GEO_RUNS, warm)
        out[seed] = {"plain_accuracy_after_rl": plain["accuracy_after_rl"], "geo_accuracy_after_rl": geo["accuracy_after_rl"],
                     "geo_collapsed": geo["collapsed"],
                     "wide_accuracy_after_rl": wide["accuracy_after_rl"],
                     "wide_equals_plain": (wide["accuracy_after_rl"] == plain["accuracy_after_rl"]
                                           and {int(k): v for k, v in wide["val_acc_at_step"].items()}
                                           == {int(k): v for k, v in plain["val_acc_at_step"].items()}),
                     "random_keep_accuracy_after_rl": rand["accuracy_after_rl"], "random_keep_collapsed": rand["collapsed"],
                     "random_keep_dropped": statistics.fmean(r["dropped"] for r in rl)}
    record = {"geo_check_seconds": ledger.total(), "design": design, "by_seed": out, "kept_shares": kept}
    write_json(GEO_JSON, record, "python studies/engine.py geo-check", ledger.total())
    for seed, v in out.items():
        print(f"seed {seed}: plain {v['plain_accuracy_after_rl']:.3f}, geometric mask {v['geo_accuracy_after_rl']:.3f}, "
              f"mask at bounds that keep all {v['wide_accuracy_after_rl']:.3f} (equal to plain: {v['wide_equals_plain']}), "
              f"random keep {v['random_keep_accuracy_after_rl']:.3f}")
    print(f"kept: {kept['all']['kept_share']:.3f} of responses; A > 0 {kept['positive_advantage']['kept_share']:.3f}, "
          f"A < 0 {kept['negative_advantage']['kept_share']:.3f}; wrote {GEO_JSON}")
    return record


def plot_engine_map(record: dict, path: str = "figures/engine_map.png") -> None:
    """The cells down one axis, each labelled with its deciding comparison: test accuracy after RL,
    GSPO and GRPO, each seed a dot (x: collapsed); each cell's deciding differences with its noise
    (studies/map.py's plot_map)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from studies import map as regimes
    regimes.plot_map(plt, record, {c: f"{c}\n({v['decided_by']})" for c, v in record["design"]["cells"].items()},
                     differences="the cell's deciding difference by seed (grey: its noise, +-)",
                     title="What stops GSPO with the sampler's pi_old, and what restores it (seeds 0-2; rule fixed "
                           "before the runs)", path=path)
    plt.close("all")


@cli
def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "_run":                     # make figures-engine's child: a run with a drop
        if len(argv) < 3 or argv[1] not in ("random", "gap", "random_all"):
            fail("usage: python studies/engine.py _run {random,gap,random_all} RATE [gspo_minimal.py flags]")
        return drop_run(argv[1], float(argv[2]), argv[3:])
    parser = Parser(description=__doc__.splitlines()[0])
    parser.add_argument("what", nargs="?", default=None,
                        choices=["prototype", "measure", "redraw", "figures", "figures-design", "geo-check",
                                 "kl-formulas"],
                        help="prototype: figures/engine_prototype.json; measure: only the parts of --models, "
                             "in this interpreter; redraw: engine.png from engine.json; none: make engine; "
                             "figures: make figures-engine; figures-design: its design into engine_map.json; "
                             "geo-check: after figures-engine, the geometric mask's collapse checked; "
                             "kl-formulas: the KL by token_kl against the float32 formula of the committed JSONs")
    parser.add_argument("--confirm", action="store_true", help="figures: the confirmation (CONFIRM=1)")
    parser.add_argument("--models", default="add2,addwork,smollm2", help="comma-separated: add2, addwork, smollm2")
    parser.add_argument("--part", default=None, help="measure: only this SAMPLER:VIEW (make engine's SmolLM2 children)")
    parser.add_argument("--pretrained-python", default=".venv-pretrained/bin/python",
                        help="an interpreter with gguf, for SmolLM2's parts (make engine passes .venv-pretrained's)")
    args = parser.parse_args(argv)
    models = args.models.split(",")
    if any(m not in PROTOTYPE for m in models):
        fail(f"--models takes add2, addwork and smollm2, got {args.models}")
    if args.what == "figures-design":
        em_write_design()
        print(f"wrote the design into {EM_JSON}")
        return 0
    if args.what == "figures":
        figures_engine(args.confirm)
        return 0
    if args.what == "geo-check":
        geo_check()
        return 0
    if args.what == "kl-formulas":
        for name, by in write_kl_formulas(models)["models"].items():
            for sampler, r in by.items():
                if sampler in SAMPLERS:
                    print(f"{name} {sampler}: K {r['mean_kl_float64']:.4g} (float64) against {r['mean_kl_float32']:.4g} "
                          f"(float32), at most {r['max_abs_difference_per_token']:.2g} apart at a token")
        return 0
    t0 = time.perf_counter()
    if args.what == "prototype":
        result = prototype(models)
        seconds = sum(p["seconds"] for p in result["parts"].values())
        write_json(PROTOTYPE_JSON, {"engine_prototype_seconds": seconds, **result},
                   "python studies/engine.py prototype (each model in its venv)", time.perf_counter() - t0)
        print(f"wrote {PROTOTYPE_JSON}")
        return 0
    if args.what == "measure":
        only = tuple(args.part.split(":")) if args.part else None
        if only is not None and (len(only) != 2 or only[0] not in SAMPLERS or only[1] not in VIEWS):
            fail(f"--part takes SAMPLER:VIEW ({', '.join(SAMPLERS)}; {', '.join(VIEWS)}), got {args.part}")
        measure(models, only)
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
        for sampler in SAMPLERS:
            for view in VIEWS:
                code, _ = in_own_process("studies/engine.py", ["measure", "--models", "smollm2", "--part",
                                                               f"{sampler}:{view}"],
                                         python=args.pretrained_python, env=SMOLLM_ENV)
                if code:
                    fail(f"make engine: SmolLM2's part {sampler}:{view} exited with {code}; its log is above", 1)
    if models != list(SIZES):
        return 0
    result = assemble()
    plot(result)
    write_json("figures/engine.json", result, "make engine", result["engine_seconds"])
    print(f"wrote figures/engine.json and figures/engine.png ({result['engine_seconds'] / 60:.0f} min)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

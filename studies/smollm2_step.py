"""make mechanism-smollm2: the mechanism on a real model, one step on SmolLM2, no learning claim.

    python studies/smollm2_step.py             # `make mechanism-smollm2` (in .venv-pretrained):
                                               # figures/mechanism_smollm2.json; resumable, one part
                                               # per seed in runs/mechanism_smollm2/
    python studies/smollm2_step.py prototype   # seed 0 at the measured size, timed, for the budget

At theta = theta_old, an engine's record as pi_old hands GSPO log s = mean_t d_t, d_t = log
pi_theta(y_t) - log record(y_t): under the lens (tutorial section 12) a normal of mean -K and
standard deviation sigma / sqrt(n) for a response of n tokens. A band [lo, hi] on log s then clips
a response on its active side with probability

    A < 0:  P(log s < lo) = Phi((lo + K) sqrt(n) / sigma)        (its gradient is lost)
    A > 0:  P(log s > hi) = 1 - Phi((hi + K) sqrt(n) / sigma)

with lo = log(1 - eps_low), hi = log(1 + eps_high) for the paper's band, and the calibrated band's
own bounds (gspo_lab.calibrated_band) for --eps-engine's. Per seed, one rollout of SmolLM2-135M
on arithmetic word problems (G answers each, scored by their last number), sampled as make engine
samples it, but at make pretrained's temperature 0.6 (at 1 the model's answers earned no reward in
the prototype, so no advantage had a sign): the bf16 copy draws every token while the float32 model
reads the same tokens, EOS allowed (natural answers), at most STEP["max_new_tokens"] tokens. Then:

  1. K (the per-token KL of the bf16 copy from the model, from the decode) and sigma (the standard
     deviation of the trainer-record gaps d_t) of this rollout's own answers, and the lens's
     prediction per response and sign of A, written to the part's folder BEFORE any scoring;
  2. the scoring: GSPO's active-side clip shares by sign of A (gspo_lab.ratio_metrics's count)
     with the real record as pi_old, under the paper's band and under the calibrated band (Z =
     STEP["z"], K-hat and SIGMA-hat from this rollout's gaps, as the flag estimates them); then the
     same with the synthetic engine's record (gspo_lab.synthetic_gap at make engine's K and
     sigma for SmolLM2) in place of the real one;
  3. the gradient of GSPO's loss in each setting against the gradient with the trainer's pi_old
     (s = 1, nothing clips): their cosine and norm ratio, over the whole rollout as one minibatch.

The synthetic record's K and sigma are make engine's, measured at temperature 1 on text run past
natural answers; this rollout samples at 0.6, so the synthetic record is the lens's model at those
values, not a copy of this rollout's gap (whose own K and sigma are measured and reported beside it).

The gradients: GSPO's loss depends on the model only through each response's log s_i, so its
gradient is sum_i c_i grad log s_i with c_i = dLoss / d log s_i, read off autograd through
gspo_minimal.gspo_loss alone (`sequence_weights`). One backward pass per response then gives grad
log s_i, and every setting's gradient is a weighted sum of those (`weighted_gradients`): two sweeps
over the responses (real record, synthetic record), not one backward pass per setting.
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import random
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))   # gspo_minimal, studies

import torch  # noqa: E402

import gspo_lab as g  # noqa: E402
from studies.common import (Parser, cli, fail, in_own_process, kept_part, logprobs_in_chunks, read_json,  # noqa: E402
                            smollm_gguf, write_json, write_result)

OUTPUTS = ("figures/mechanism_smollm2.json",)
STEP_JSON = "figures/mechanism_smollm2.json"
STEP_RUNS = "runs/mechanism_smollm2"
# Every setting, fixed before the run and written into the JSON.
STEP = {
    "seeds": [0, 1, 2],
    "prompts": 2,               # x group_size answers per seed: one rollout (the prototype sets the budget)
    "group_size": 16,           # the model rarely gets these right: large groups, so most have spread
    "sampler": "bfloat16", "top_p": 1.0,   # make engine's sampler: the bf16 copy draws, float32 reads
    "temperature": 0.6,         # make pretrained's. At make engine's 1.0 the prototype's 8 answers all
                                # missed (reward 0, one flat group): no advantage to split by sign
    "max_new_tokens": 512,      # make engine's cap; EOS allowed
    "eps": [3e-4, 4e-4],        # the paper's band
    "z": 1.96,                  # the calibrated band's Z (make figures-remedy's)
    "logprob_chunk": 2,         # rows per no-grad pass
    "synthetic_seed_offset": 1000,   # the synthetic record's generator: --seed s + this, XOR gspo_minimal's mix
    "agreement": "per setting and sign of A, pooled over the seeds: the measured share is within 2 standard "
                 "deviations of the predicted one, the standard deviation the lens's own (responses clipped "
                 "independently, each with its predicted probability: a Poisson binomial)",
    "min_responses": 10,        # fewer responses of a sign, pooled: its agreement is not tested (the
                                # prototype's seed had 1 with A > 0; within 2 sd is then always true)
    "malloc_mmap_threshold": 1 << 20,
    "peak_rss_goal_mb": 4096,
    "budget_seconds": 30 * 60,
}
# one seed at the measured size: a shorter cap truncated the answers before their numbers (reward 0
# for all 32 at 128 tokens), so no response had an advantage and the gradients' time went unmeasured
PROTOTYPE: dict = {}
SETTINGS = ("real_paper", "real_calibrated", "synthetic_paper", "synthetic_calibrated")


# ---------------------------------------------------------------------------------------------
# The lens's prediction and the scoring: pure functions of tensors.
# ---------------------------------------------------------------------------------------------
def normal_cdf(x: torch.Tensor) -> torch.Tensor:
    return torch.special.ndtr(x.double())


def lens_prediction(lengths: torch.Tensor, adv: torch.Tensor, k: float, sigma: float, lo, hi) -> dict:
    """Per response (n tokens, advantage A, band [lo, hi] on log s: floats or (B,)), the probability
    that log s ~ N(-K, sigma^2 / n) clips it on its active side (0 for A = 0); per sign of A the
    expected share and its standard deviation (a Poisson binomial over that sign's responses)."""
    n = lengths.double().clamp(min=1)
    lo, hi = (torch.as_tensor(b, dtype=torch.float64) for b in (lo, hi))
    if sigma > 0:
        p_neg, p_pos = normal_cdf((lo + k) * n.sqrt() / sigma), 1 - normal_cdf((hi + k) * n.sqrt() / sigma)
    else:                                    # no noise: log s = -K exactly
        p_neg, p_pos = ((-k < lo) * torch.ones_like(n)).double(), ((-k > hi) * torch.ones_like(n)).double()
    p = torch.where(adv < 0, p_neg, torch.where(adv > 0, p_pos, torch.zeros_like(n)))
    out = {"p_clipped": p.tolist()}
    for side, rows in (("pos", adv > 0), ("neg", adv < 0)):
        m = int(rows.sum())
        out[f"n_seqs_{side}"] = m
        out[f"expected_clipped_{side}"] = p[rows].sum().item()
        out[f"variance_clipped_{side}"] = (p[rows] * (1 - p[rows])).sum().item()
        out[f"share_{side}"] = p[rows].mean().item() if m else None
        out[f"share_sd_{side}"] = math.sqrt(out[f"variance_clipped_{side}"]) / m if m else None
    return out


def gap_summary(d: torch.Tensor, kl: torch.Tensor | None = None) -> dict:
    """A record's gaps d (the masked tokens, flat): the sums the calibrated band pools and its
    estimates (K-hat = SIGMA-hat^2 / 2, SIGMA-hat), -mean d, and the mean per-token KL where known."""
    d = d.double()
    state = [float(d.numel()), d.sum().item(), (d * d).sum().item()]
    k_hat, sigma_hat = g.gap_estimates(state)
    out = {"tokens": d.numel(), "state": state, "k_hat": k_hat, "sigma_hat": sigma_hat,
           "k_hat_mean": -d.mean().item(), "k_hat_mean_standard_error": d.std().item() / math.sqrt(d.numel())}
    if kl is not None:
        out["kl_per_token"] = kl.double().mean().item()
    return out


def bands(mask: torch.Tensor, state: list[float], z: float, eps: tuple[float, float]) -> dict:
    """The paper's band and --eps-engine Z's, from a record's pooled gap sums (gspo_minimal's own
    calibrated_band): name -> (eps_low, eps_high), floats or (B,)."""
    cfg = g.Config(eps_engine=z)
    g.engine_gap_state(cfg)[:] = state
    return {"paper": eps, "calibrated": g.calibrated_band(mask, cfg, *eps)}


def log_band(eps_low, eps_high) -> tuple[torch.Tensor, torch.Tensor]:
    return (torch.log1p(-torch.as_tensor(eps_low, dtype=torch.float64)),
            torch.log1p(torch.as_tensor(eps_high, dtype=torch.float64)))


def clip_shares(logp, logp_old, adv, mask, eps_low, eps_high) -> dict:
    """GSPO's active-side clip counts by sign of A (gspo_lab.ratio_metrics) and their shares, in
    float64 as `sequence_weights` decides them, so a response clipped here gets no gradient there."""
    eps_low, eps_high = (e.double() if torch.is_tensor(e) else e for e in (eps_low, eps_high))
    r = g.ratio_metrics(logp.double(), logp_old.double(), adv.double(), mask, "gspo", eps_low, eps_high)
    out = {k: r[k] for k in ("n_clip_seqs_pos", "n_seqs_pos", "n_clip_seqs_neg", "n_seqs_neg")}
    for side in ("pos", "neg"):
        out[f"share_{side}"] = r[f"n_clip_seqs_{side}"] / r[f"n_seqs_{side}"] if r[f"n_seqs_{side}"] else None
    return out


def sequence_weights(logp, logp_old, adv, mask, eps_low, eps_high) -> torch.Tensor:
    """c_i = dLoss / d log s_i of gspo_minimal.gspo_loss at these log-probs, (B,): the loss's gradient
    is sum_i c_i grad log s_i. Read off autograd through the loss alone: dLoss / d logp_it = c_i / n_i
    at every token of response i (checked), 0 elsewhere."""
    x = logp.detach().double().requires_grad_(True)
    eps_low, eps_high = (e.double() if torch.is_tensor(e) else e for e in (eps_low, eps_high))
    loss = g.gspo_loss(x, logp_old.double(), adv.double(), mask, eps_low, eps_high)
    (u,) = torch.autograd.grad(loss, x)
    n = mask.sum(-1).clamp(min=1).double()
    c = (u * n[:, None]).where(mask, torch.zeros((), dtype=torch.float64))           # (B, T)
    first = c.gather(1, mask.long().argmax(-1, keepdim=True))                        # (B, 1)
    if not torch.allclose(c, (first * mask).double(), rtol=1e-9, atol=1e-15):
        raise AssertionError("GSPO's loss is not a function of each response's log s here")
    return first.squeeze(-1) * mask.any(-1)


def weighted_gradients(model, batch: dict, weights: dict[str, torch.Tensor], temperature: float) -> dict:
    """sum_i weights[k][i] grad log s_i for each k, flat float32 (one backward pass per response with
    any non-zero weight; log s_i's gradient is that of its mean log-prob, pi_old being a constant)."""
    params = [p for p in model.parameters() if p.requires_grad]
    total = sum(p.numel() for p in params)
    acc = {k: torch.zeros(total) for k in weights}
    mask = batch["mask"]
    for i in range(len(mask)):
        if all(w[i] == 0 for w in weights.values()):
            continue
        row = slice(i, i + 1)
        logp = g.policy_logprobs(model, batch["prompt_ids"][row], batch["prompt_mask"][row],
                                 batch["completions"][row], temperature=temperature)
        m = mask[row]
        grads = torch.autograd.grad((logp * m).sum() / m.sum(), params)
        off = 0
        for p, gr in zip(params, grads):
            for k, w in weights.items():
                if w[i] != 0:
                    acc[k][off:off + p.numel()].add_(gr.reshape(-1), alpha=float(w[i]))
            off += p.numel()
        del grads, logp
    return acc


def compared(grad: torch.Tensor, ref: torch.Tensor, chunk: int = 1 << 20) -> dict:
    """The cosine of a gradient with the trainer's-pi_old gradient and their norm ratio (float64 sums,
    a chunk at a time: a float64 copy of a whole gradient is 1 GiB for SmolLM2)."""
    def dot(x, y):
        return sum(torch.dot(x[i:i + chunk].double(), y[i:i + chunk].double()).item() for i in range(0, len(x), chunk))
    dot, a, b = dot(grad, ref), dot(grad, grad), dot(ref, ref)
    return {"cosine": dot / math.sqrt(a * b) if a > 0 and b > 0 else None,
            "norm_ratio": math.sqrt(a / b) if b > 0 else None}


# ---------------------------------------------------------------------------------------------
# One seed: the rollout, the prediction (written first), the scoring.
# ---------------------------------------------------------------------------------------------
def smollm2_rollout(model, tok, seed: int, size: dict) -> tuple[dict, dict]:
    """One rollout of word problems, the bf16 copy sampling and the float32 model reading (engine's
    paired_decode): the batch, the record's log-probs and the decode's per-token KL and timing."""
    from studies import engine
    from studies.pretrained import word_problem
    rng = random.Random(seed)
    torch.manual_seed(seed)
    problems = [word_problem(rng) for _ in range(size["prompts"])]
    G = size["group_size"]
    ids, attn = g.encode_prompts(tok, [q for q, _ in problems for _ in range(G)], "cpu")
    sampler = engine.sampler_of(model, STEP["sampler"])
    t0 = time.perf_counter()
    out = engine.paired_decode(sampler, model, ids, attn, size["max_new_tokens"], tok.eos_token_id,
                               temperature=STEP["temperature"], top_p=STEP["top_p"], suppress_eos=False)
    seconds = time.perf_counter() - t0
    del sampler
    mask = g.completion_mask(out["tokens"], tok.eos_token_id)
    if not torch.equal(mask, out["alive"]):
        raise AssertionError("the decode's live tokens are not the completion mask")
    comp = out["tokens"].where(mask, torch.full_like(out["tokens"], tok.pad_token_id))
    answers = [a for _, a in problems for _ in range(G)]
    rewards = torch.tensor([g.reward(row, a, tok, task=g.TASKS["add2-chat"]) for row, a in zip(comp.tolist(), answers)])
    batch = {"prompt_ids": ids, "prompt_mask": attn, "completions": comp, "mask": mask, "rewards": rewards,
             "advantages": g.group_advantages(rewards, G)}
    lengths = mask.sum(-1).float()
    return batch, {"record": out["logq"].float().where(mask, torch.zeros(())), "kl": out["k"][mask],
                   "decode_seconds": seconds, "decoded_tokens": out["tokens"].numel(),
                   "decode_tokens_per_second": out["tokens"].numel() / seconds,
                   "answer_tokens": int(mask.sum()), "length_median": lengths.median().item(),
                   "length_p10": lengths.quantile(0.1).item(), "length_p90": lengths.quantile(0.9).item(),
                   "share_at_cap": (lengths == size["max_new_tokens"]).float().mean().item(),
                   "reward_mean": rewards.mean().item(), "flat_groups": g.flat_group_share(rewards, G)}


def synthetic_engine() -> tuple[float, float]:
    """make engine's K and sigma for SmolLM2's bf16 copy (engine.json, text run past natural answers)."""
    s = read_json("figures/engine.json")["models"]["smollm2"]["bfloat16"]
    return s["kl_floor"], math.sqrt(s["sigma2"])


def step_part(seed: int, size: dict, folder: str) -> dict:
    model, tok = g.load_pretrained(smollm_gguf())
    batch, roll = smollm2_rollout(model, tok, seed, size)
    T, eps, z = STEP["temperature"], tuple(STEP["eps"]), STEP["z"]
    mask, adv = batch["mask"], batch["advantages"]
    t0 = time.perf_counter()
    logp = logprobs_in_chunks(model, batch, chunk=STEP["logprob_chunk"], temperature=T)   # theta_old, (B, T)
    pass_seconds = time.perf_counter() - t0
    k_syn, sigma_syn = synthetic_engine()
    cfg = g.Config(record_noise=f"{k_syn:.6g},{sigma_syn:.6g}", seed=seed + STEP["synthetic_seed_offset"])
    records = {"real": roll.pop("record"), "synthetic": logp - g.synthetic_gap(mask, cfg)}
    kl = roll.pop("kl")
    gaps = {"real": gap_summary((logp - records["real"])[mask], kl),
            "synthetic": gap_summary((logp - records["synthetic"])[mask])}
    lens = {"real": (gaps["real"]["kl_per_token"], gaps["real"]["sigma_hat"]), "synthetic": (k_syn, sigma_syn)}
    band = {r: bands(mask, gaps[r]["state"], z, eps) for r in records}
    # each setting (SETTINGS): its record as pi_old, its band (eps_low, eps_high) and its lens (K, sigma)
    setting = {f"{r}_{b}": (records[r], band[r][b], lens[r]) for r in records for b in ("paper", "calibrated")}
    lengths = mask.sum(-1)
    prediction = {s: {"k": k, "sigma": sigma, **lens_prediction(lengths, adv, k, sigma, *log_band(*b))}
                  for s, (_, b, (k, sigma)) in setting.items()}
    written = os.path.join(folder, f"prediction_s{seed}.json")          # before any scoring
    write_json(written, {"seed": seed, "prediction": prediction}, f"python studies/smollm2_step.py (seed {seed})", 0.0)
    with open(written, "rb") as f:
        written_sha256 = hashlib.sha256(f.read()).hexdigest()
    order = {"prediction_written_at": time.time()}
    measured = {s: clip_shares(logp, old, adv, mask, *b) for s, (old, b, _) in setting.items()}
    weights = {"trainer": sequence_weights(logp, logp, adv, mask, *eps)}
    weights.update({s: sequence_weights(logp, old, adv, mask, *b) for s, (old, b, _) in setting.items()})
    model.requires_grad_(True)
    t0 = time.perf_counter()
    first = weighted_gradients(model, batch, {k: weights[k] for k in ("trainer", "real_paper", "real_calibrated")}, T)
    ref = first.pop("trainer")
    grads = {k: compared(v, ref) for k, v in first.items()}
    del first
    second = weighted_gradients(model, batch, {k: weights[k] for k in ("synthetic_paper", "synthetic_calibrated")}, T)
    grads.update({k: compared(v, ref) for k, v in second.items()})
    grad_seconds = time.perf_counter() - t0
    order["scoring_finished_at"] = time.time()
    for s in SETTINGS:
        measured[s].update(grads[s])
        measured[s]["responses_with_gradient"] = int((weights[s] != 0).sum())
        unclipped = measured[s]["n_seqs_pos"] + measured[s]["n_seqs_neg"] - measured[s]["n_clip_seqs_pos"] - measured[s]["n_clip_seqs_neg"]
        if measured[s]["responses_with_gradient"] != unclipped:
            raise AssertionError(f"{s}: the clip count and the gradient's weights disagree")
    band_medians = {r: {b: [x.median().item() for x in log_band(*band[r][b])] for b in band[r]} for r in band}
    return {"seed": seed, "size": size, **roll, "trainer_pass_seconds": pass_seconds, "gradient_seconds": grad_seconds,
            "responses": len(mask), "n_pos": int((adv > 0).sum()), "n_neg": int((adv < 0).sum()),
            "gaps": {r: {k: v for k, v in x.items() if k != "state"} for r, x in gaps.items()},
            "band_log_medians": band_medians, "prediction_file": written, "prediction_sha256": written_sha256,
            **order, "prediction": prediction,
            "measured": measured, "responses_with_gradient_trainer": int((weights["trainer"] != 0).sum())}


def decode_speed(rows: int = 16, tokens: int = 32) -> dict:
    """Tokens per second of the sampler alone, the bf16 copy against the float32 model: the same
    prompts and length, EOS suppressed (gspo_minimal.sample_completions, its KV cache)."""
    from studies import engine
    from studies.pretrained import word_problem
    model, tok = g.load_pretrained(smollm_gguf())
    rng = random.Random(0)
    ids, attn = g.encode_prompts(tok, [word_problem(rng)[0] for _ in range(rows)], "cpu")
    out = {"rows": rows, "tokens": tokens}
    for dtype in ("float32", "bfloat16"):
        sampler = engine.sampler_of(model, dtype)
        torch.manual_seed(0)
        t0 = time.perf_counter()
        g.sample_completions(sampler, ids, attn, tokens, tok.eos_token_id, tok.pad_token_id, temperature=1.0,
                             suppress_eos=True)
        out[f"{dtype}_tokens_per_second"] = rows * tokens / (time.perf_counter() - t0)
    out["bfloat16_over_float32"] = out["bfloat16_tokens_per_second"] / out["float32_tokens_per_second"]
    return out


# ---------------------------------------------------------------------------------------------
# The target: the design and its prototype first, then one part per seed, then the comparison.
# ---------------------------------------------------------------------------------------------
def part_name(seed: int, prototype: bool = False) -> str:
    return f"prototype_s{seed}" if prototype else f"step_s{seed}"


def run_part(what: str, seed: int) -> dict:
    """A part in a process of its own (its own peak; glibc's threshold fixed), kept in STEP_RUNS."""
    code, _ = in_own_process("studies/smollm2_step.py", ["_part", what, str(seed)],
                             env={"MALLOC_MMAP_THRESHOLD_": str(STEP["malloc_mmap_threshold"])})
    if code:
        fail(f"the part {what} {seed} failed (exit {code})", 1)
    name = "decode_speed" if what == "speed" else part_name(seed, what == "prototype")
    return read_json(os.path.join(STEP_RUNS, f"{name}.json"))


def size_of(what: str) -> dict:
    return {**{k: STEP[k] for k in ("prompts", "group_size", "max_new_tokens")}, **(PROTOTYPE if what == "prototype" else {})}


def projection(proto: dict, speed: dict) -> dict:
    """The measured target's seconds: the prototype's seed (at the measured size) once per seed, and
    the decode-speed part."""
    seconds = len(STEP["seeds"]) * proto["seconds"] + speed["seconds"]
    return {"seconds": seconds, "fits": seconds <= 0.9 * STEP["budget_seconds"],
            "per_seed": {k: proto[k] for k in ("seconds", "decode_seconds", "trainer_pass_seconds", "gradient_seconds")},
            "from": "the prototype part (seed 0 at the measured size, its own process) and the decode-speed part"}


def write_design() -> dict:
    """mechanism_smollm2.json before the measured parts: STEP, the prototype, the projection."""
    proto, speed = run_part("prototype", 0), run_part("speed", 0)
    proj = projection(proto, speed)
    record = {"step": STEP, "prototype_size": PROTOTYPE, "prototype": proto, "decode_speed": speed,
              "projection": proj, "seeds": {}, "pooled": {}}
    write_json(STEP_JSON, record, "python studies/smollm2_step.py prototype", proto["seconds"] + speed["seconds"])
    return record


def pooled(parts: list[dict]) -> dict:
    """Per setting and sign of A, over the seeds: measured and predicted clip shares, the lens's
    standard deviation, and whether they agree (STEP's agreement); the gradients' cosines and norm
    ratios by seed with their medians."""
    out = {}
    for s in SETTINGS:
        row = {}
        for side in ("pos", "neg"):
            n = sum(p["measured"][s][f"n_seqs_{side}"] for p in parts)
            clipped = sum(p["measured"][s][f"n_clip_seqs_{side}"] for p in parts)
            expected = sum(p["prediction"][s][f"expected_clipped_{side}"] for p in parts)
            sd = math.sqrt(sum(p["prediction"][s][f"variance_clipped_{side}"] for p in parts))
            testable = n >= STEP["min_responses"]
            row[side] = {"responses": n, "measured_share": clipped / n if n else None,
                         "predicted_share": expected / n if n else None, "predicted_sd": sd / n if n else None,
                         "testable": testable, "agrees": abs(clipped - expected) <= 2 * sd if testable else None}
        for key in ("cosine", "norm_ratio"):
            vals = [p["measured"][s][key] for p in parts]
            row[f"{key}_by_seed"] = vals
            row[f"{key}_median"] = statistics.median(v for v in vals if v is not None) if any(v is not None for v in vals) else None
        out[s] = row
    return out


def mechanism_smollm2() -> dict:
    if not os.path.exists(STEP_JSON) or read_json(STEP_JSON).get("step") != json.loads(json.dumps(STEP, allow_nan=False)):
        fail(f"{STEP_JSON} holds no design at these settings: run `python studies/smollm2_step.py prototype` first")
    record = read_json(STEP_JSON)
    parts = [run_part("step", s) for s in STEP["seeds"]]
    record["seeds"] = {str(p["seed"]): p for p in parts}
    record["pooled"] = pooled(parts)
    record["mechanism_smollm2_seconds"] = sum(p["seconds"] for p in parts)
    return record


@cli
def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["_part"]:                    # one part in its own process (run_part)
        what, seed = argv[1], int(argv[2])
        if smollm_gguf() is None:
            fail("this part needs SmolLM2's GGUF: run it in .venv-pretrained (make mechanism-smollm2 builds it)")
        from transformers.utils import logging as hf_logging
        hf_logging.disable_progress_bar()
        torch.set_num_threads(2)
        if what == "speed":
            kept_part(STEP_RUNS, "smollm2_step", "decode_speed", decode_speed, own_peak=True)
            return 0
        name, size = part_name(seed, what == "prototype"), size_of(what)
        kept_part(STEP_RUNS, "smollm2_step", name, lambda: step_part(seed, size, STEP_RUNS), own_peak=True,
                  settings={"step": STEP, "size": size, "seed": seed})
        return 0
    parser = Parser(description=__doc__.splitlines()[0])
    parser.add_argument("what", nargs="?", choices=["prototype"], default=None)
    args = parser.parse_args(argv)
    if smollm_gguf() is None:
        fail("make mechanism-smollm2 needs SmolLM2's GGUF: run it in .venv-pretrained (the target builds it)")
    os.makedirs(STEP_RUNS, exist_ok=True)
    if args.what == "prototype":
        r = write_design()
        print(f"{STEP_JSON}: prototype {r['prototype']['seconds']:.0f} s; projected "
              f"{r['projection']['seconds'] / 60:.0f} min of {STEP['budget_seconds'] // 60}")
        return 0
    record = mechanism_smollm2()
    write_result(STEP_JSON, record, "python studies/smollm2_step.py", record["mechanism_smollm2_seconds"])
    num = lambda x: "none" if x is None else f"{x:.3f}"
    for s, row in record["pooled"].items():
        print(f"{s:22s} " + " | ".join(f"A{'>' if side == 'pos' else '<'}0 ({row[side]['responses']}): measured "
                                      f"{num(row[side]['measured_share'])}, predicted {num(row[side]['predicted_share'])}"
                                      f" +- {num(row[side]['predicted_sd'])}, agrees {row[side]['agrees']}"
                                      for side in ("pos", "neg"))
              + f" | cosine {num(row['cosine_median'])}, norm ratio {num(row['norm_ratio_median'])}")
    print(STEP_JSON)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The lab: every research option of the studies, on top of gspo_minimal.py.

    python gspo_lab.py                                   # exactly `python gspo_minimal.py` (a test holds it)
    python gspo_lab.py --loss gmpo                       # a relative of GSPO (tutorial section 10)
    python gspo_lab.py --sampler-dtype bfloat16 --old-logprobs sampler   # pi_old from a bf16 sampler's record
    python gspo_lab.py --task addwork                    # long answers: column working, then the sum
    python gspo_lab.py --help                            # the algorithm's flags, then the lab's own

gspo_minimal.py is the algorithm and a user's own run; this file is the workshop the studies run in.
It takes every flag of gspo_minimal.py plus its own (`--help` lists them in two groups):
  * GSPO's relatives (GMPO, SAPO, CISPO, LUSPO, VESPO), the other aggregations (dapo, dr_grpo),
    --scale-rewards none (Dr. GRPO) and DeepSeek-V3.2's off-policy sequence mask;
  * the sampler: --sampler-dtype (a bf16 or fp16 copy samples, as an inference engine would),
    --top-p, and --old-logprobs sampler (its record as pi_old), with the engine metrics;
  * mismatch corrections (--is-correction and its bounds), the synthetic record (--record-noise,
    --record-bins), the calibrated band (--eps-engine) and FSPO's band (--fspo-band);
  * memory: --micro-batch (automatic above 20M parameters) and --gradient-checkpointing;
  * the tasks beyond add2 (add3, mul2, addwork, add2-chat), the tiny MoE (--moe), GGUF files, --eval-at.
  * a real inference engine: `LlamaCppEngine`, llama.cpp on a GGUF file of the trainer's weights (the
    engine extra; `make test-engine` runs test_gspo_lab.py's engine tests, which hold it to the
    trainer); not yet a flag of the run.

Design (chosen before the code moved): a variant file, as CleanRL's ppo_atari.py is to ppo.py. The lab
imports gspo_minimal, takes every name it has (`from gspo_minimal import *`), and keeps its own fuller
Config, sampler, rollout, update (`rl_update`) and loop (`train`), in which the options branch. The
minimal file offers no hooks; its pieces (log-probs, the ratio identities, the losses, the warm-up,
evaluation, the run folder, the command line's checks) are called here as they are, with the lab's
task objects, which have the minimal file's task methods. Where a function here is a fuller twin of
one there (Config, the sampler, the three losses, group_advantages, ratio_metrics, rollout,
rl_update, train, validate), test_gspo_lab.py proves that at the lab's defaults the two agree: the
same tokens, values, metrics and final weights. The lab never assigns to gspo_minimal's attributes;
gspo_minimal never imports the lab (tests hold both).
"""

from __future__ import annotations

import copy
import math
import os
import random
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass

import torch

import gspo_minimal as g
from gspo_minimal import *  # noqa: F401,F403  every name of the algorithm is the lab's too
from gspo_minimal import Add2, BadInput, Diverged, GracefulStop, Run, masked_mean, read_data  # noqa: F401


# ---------------------------------------------------------------------------------------------
# The lab's flags, after the algorithm's (gspo_minimal.Config). The string under each is its --help.
# ---------------------------------------------------------------------------------------------
@dataclass
class Config(g.Config):
    """the lab's own flags (gspo_lab.py only)
    In the lab --loss also takes GSPO's relatives, gmpo, sapo, sapo-seq, cispo, luspo and vespo
    (tutorial section 10), with their own --eps-low and --eps-high (GMPO's in log space, default 0.4;
    CISPO's --eps-high caps each token's weight, 5.0; SAPO and VESPO have none), and --model also
    takes a .gguf file (dequantised to float32; needs the gguf package)."""
    task: str = "add2"
    """problems: add2 (a+b, a,b < 100), add3 (a+b, a,b < 1000), mul2 (a*b, a,b < 100), addwork (a+b
    with 2 to 6 digits each, answered with its column working and then the sum: long answers; its
    own defaults for --max-new-tokens, --steps and the warm-up, see TASK_DEFAULTS), or add2-chat
    (add2's problems asked as 'a + b = ?' of a chat model, needs --model; reward on the last number).
    Exclusive with --data"""
    moe: bool = False
    """use a tiny mixture-of-experts model (transformers' Mixtral classes) instead of the dense one"""
    micro_batch: int | None = None
    """rows per forward and backward pass inside a minibatch, their gradients added up before its one
    optimiser step: the same update at the memory of this many rows, a little slower (a multiple of
    --group-size keeps each prompt run once per group; 0: one pass). Default: 0 under 20M parameters
    (the built-in models), else 1024 // --max-new-tokens rows, at least 1. With a micro-batch,
    rollouts are sampled at most 4096 // --max-new-tokens rows (whole groups) at a time"""
    gradient_checkpointing: bool = False
    """recompute each layer's activations during the backward pass instead of keeping them (Hugging
    Face models): less memory for more time; the update then runs one full pass per row"""
    aggregation: str = "paper"
    """how a minibatch's terms become one loss (gspo, gspo-token, grpo): paper (a mean over
    sequences, each a token mean for GRPO), dapo (a sum over tokens / the rollout's tokens per
    minibatch: TRL's default, which weights a sequence-level term by |y|), or dr_grpo (a sum over
    tokens / (rows x --max-new-tokens))"""
    scale_rewards: str = "group"
    """group: A = (r - mean) / (std + eps) within each group (GSPO eq. 6); none: A = r - mean
    (Dr. GRPO, arXiv 2503.20783)"""
    off_policy_mask: float | None = None
    """DeepSeek-V3.2's off-policy sequence mask: drop a response with A < 0 once its per-token
    cross-entropy has risen by more than this many nats since sampling (off by default)"""
    sampler_dtype: str = "float32"
    """precision of the model that samples the rollouts: float32 (the trainer's own model), bfloat16
    or float16 (a copy in that dtype made before each rollout, as an inference engine such as vLLM
    holds weights of its own; CUDA needs support for the dtype, a CPU without it runs it slowly)"""
    top_p: float = 1.0
    """nucleus sampling: sample from the smallest set of most likely tokens whose probability
    reaches top_p, renormalised (1.0: off). The sampler's record is then the log-prob under that
    truncated distribution; the trainer's pass keeps the full softmax"""
    old_logprobs: str = "trainer"
    """where log pi_old comes from: trainer (the trainer's own pass over the rollout) or sampler (the
    log-probs the sampler recorded while sampling, for every minibatch, the first included: the
    trainer's pre-update pass is skipped, as trainers fed by vLLM or SGLang do)"""
    record_noise: str = ""
    """synthetic engine, "K,SIGMA": pi_old is the trainer's own pass shifted by a gap d_t ~ N(-K, SIGMA^2)
    per token, as if an engine had recorded it (float32 sampler, --old-logprobs trainer; `synthetic_gap`)"""
    record_bins: str = ""
    """heteroscedastic synthetic engine, "P1:M1:S1,P2:M2:S2,...,1:Mn:Sn": as --record-noise, but each
    token's gap d_t ~ N(M_b, S_b^2) by the bin b of the trainer's probability of the sampled token
    (bins [0, P1), [P1, P2), ..., [P(n-1), 1]: a real record's gap by bin, as measured, copied; float32
    sampler, --old-logprobs trainer; exclusive with --record-noise; `synthetic_gap`)"""
    eps_engine: float | None = None
    """calibrated band, Z: GSPO's band on log s moved by the record's bias -K and widened by Z SIGMA /
    sqrt(|y|), K and SIGMA estimated from minibatch 1's gaps of the earlier steps (`calibrated_band`)"""
    fspo_band: str = ""
    """FSPO's band (arXiv 2509.09177), "C" or "C_LOW,C_HIGH": GSPO's band replaced by one on the
    sequence log-ratio S = |y| log s that scales as sqrt(|y|), S in [-C_LOW sqrt(|y|), C_HIGH
    sqrt(|y|)], i.e. log s in [-C_LOW, C_HIGH] / sqrt(|y|) (gspo only; no default: `fspo_band`)"""
    is_correction: str = "none"
    """correct the sampler-trainer mismatch with a detached weight on each token's loss term, the
    trainer's pi_old against the sampler's record (TRL 1.16's vllm_importance_sampling_mode of the
    same name): token_truncate, token_mask (each token's ratio), sequence_truncate, sequence_mask
    (the response's ratio, a product), or sequence_geometric_mask (verl's: a response is dropped when
    its per-token mean ratio leaves [clip_min, clip_max]). Needs a bf16 or fp16 sampler and
    --old-logprobs trainer; gspo, gspo-token and grpo only"""
    is_clip_max: float | None = None
    """upper bound of --is-correction's weight: *_truncate clamps to it, *_mask drops above it;
    default 3.0 (TRL's), 1.001 for sequence_geometric_mask (verl's preset)"""
    is_clip_min: float | None = None
    """lower bound, likewise; default none, 1/1.001 for sequence_geometric_mask"""
    eval_at: str = ""
    """further RL steps to evaluate at, comma-separated (e.g. 2,4: an early collapse can be dated)"""
    engine: str = ""
    """a real inference engine samples the rollouts: llama.cpp[:WEIGHTS], llama.cpp running the trainer's
    weights, written as a GGUF file before each rollout at WEIGHTS f32, f16 (the default), bf16 or q8_0.
    Its sampler chain draws from the full softmax at --temperature (no --top-p), seeded by --seed and
    the step, on --threads threads; its record can be pi_old (--old-logprobs sampler) and takes
    --is-correction, --eps-engine and --fspo-band, as a copy's does. A plain Llama only (the built-in
    dense model, SmolLM2); needs the engine extra (`make test-engine` builds .venv-engine)"""
    engine_kv: str = "f16"
    """llama.cpp's KV cache with --engine: f16 (llama.cpp's default) or f32"""


LOSSES = ("gspo", "gspo-token", "grpo", "gmpo", "sapo", "sapo-seq", "cispo", "luspo", "vespo")
AGGREGATIONS = ("paper", "dapo", "dr_grpo")
SAMPLER_DTYPES = ("float32", "bfloat16", "float16")
IS_CORRECTIONS = ("none", "token_truncate", "token_mask", "sequence_truncate", "sequence_mask",
                  "sequence_geometric_mask")
# addwork's answers are 15 to 60 tokens instead of 2 to 4: room to write them; a smaller warm-up
# batch at a higher rate (results.md, "Notes on the runs", lists the settings tried), stopped a
# little later, at 0.4, so that fewer groups start flat; 60 RL steps, validated every 5, so that one
# run fits in ten minutes on two CPU cores. A flag given on the command line wins over these.
TASK_DEFAULTS = {"addwork": {"max_new_tokens": 64, "steps": 60, "eval_every": 5, "warmup_batch": 64,
                             "warmup_lr": 2e-3, "warmup_target": 0.4}}
DEFAULT_EPS = {**g.DEFAULT_EPS, "gmpo": (0.4, 0.4), "luspo": (3e-4, 4e-4), "cispo": (None, 5.0),
               "sapo": (None, None), "sapo-seq": (None, None), "vespo": (None, None)}


def resolved_eps(cfg: Config) -> tuple[float | None, float | None]:
    """The clip widths, defaulting to the loss's own (GSPO 3e-4/4e-4, GRPO 0.2/0.27); None where the
    loss has no such bound."""
    low, high = DEFAULT_EPS[cfg.loss]
    return (low if cfg.eps_low is None else cfg.eps_low,
            high if cfg.eps_high is None else cfg.eps_high)


def is_bounds(cfg: Config) -> tuple[float | None, float | None]:
    """--is-correction's (clip_min, clip_max): TRL's defaults (none, 3.0), or for
    sequence_geometric_mask verl's preset (1/1.001, 1.001)."""
    low, high = (1 / 1.001, 1.001) if cfg.is_correction == "sequence_geometric_mask" else (None, 3.0)
    return (low if cfg.is_clip_min is None else cfg.is_clip_min,
            high if cfg.is_clip_max is None else cfg.is_clip_max)


# ---------------------------------------------------------------------------------------------
# Tasks beyond add2: objects with gspo_minimal's task methods (see gspo_minimal.Add2).
# ---------------------------------------------------------------------------------------------
class Arithmetic(Add2):
    """add3 (a+b, a,b < 1000) and mul2 (a*b, a,b < 100): add2 with another range or operator."""

    def __init__(self, name: str, n: int, op: str):
        self.name, self.n, self.op = name, n, op

    def prompt(self, a, b) -> str:                  # both operands zero-padded to n's width
        width = len(str(self.n - 1))
        return f"{a:0{width}d}{self.op}{b:0{width}d}="

    def answer(self, a, b) -> str:
        return str(a * b if self.op == "*" else a + b)


class AddWork(Arithmetic):
    """addwork: a+b with 2 to 6 digits each, answered with the column working, least significant
    column first, each column 'x+y=z' with '+1' for a carry, then the result:
    4581+77= -> '1+7=8|8+7=15|5+0+1=6|4+0=4|4658' (15 to 60 tokens with EOS, like a reasoning trace:
    work first, answer last). The reward reads the result after the last '|' only: the working is
    never checked, as a reasoning trace's is not (a bare result also scores)."""
    characters = Add2.characters + "|"

    def __init__(self):
        super().__init__("addwork", 10 ** 6, "+")

    def draw(self, rng):          # each operand's number of digits first: short and long answers alike
        return tuple(rng.randrange(10 ** (d - 1), 10 ** d) for d in (rng.randint(2, 6), rng.randint(2, 6)))

    def count(self) -> int:       # no operand below 10
        return (self.n - 10) ** 2

    def solution(self, a, b) -> str:
        xs, ys = str(a)[::-1], str(b)[::-1]
        columns, carry = [], 0
        for i in range(max(len(xs), len(ys))):
            x, y = int(xs[i]) if i < len(xs) else 0, int(ys[i]) if i < len(ys) else 0
            z = x + y + carry
            columns.append(f"{x}+{y}{'+1' if carry else ''}={z}")
            carry = z // 10
        return "|".join(columns + [str(a + b)])

    def score(self, text: str, answer: str) -> float:
        return float(text.rsplit("|", 1)[-1].strip() == answer)


class Add2Chat(Add2):
    """add2-chat: add2's problems asked of a chat model in words its tokenizer knows, '7 + 45 = ?',
    scored by the last number of its sentence ('7 + 45 = 52.')."""
    name = "add2-chat"

    def prompt(self, a, b) -> str:
        return f"{a} + {b} = ?"

    def score(self, text: str, answer: str) -> float:
        return g.last_number_matches(text, answer)


TASKS = {"add2": g.ADD2, "add3": Arithmetic("add3", 1000, "+"), "mul2": Arithmetic("mul2", 100, "*"),
         "addwork": AddWork(), "add2-chat": Add2Chat()}


def task_of(cfg: Config):
    """A run's problems: the rows of --data (read once per process), or --task's."""
    return read_data(cfg.data, cfg.reward) if cfg.data else TASKS[cfg.task]


# ---------------------------------------------------------------------------------------------
# Models: the tiny MoE beside the tiny Llama, GGUF files, gradient checkpointing.
# ---------------------------------------------------------------------------------------------
TINY_SHAPE = dict(hidden_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4,
                  bos_token_id=None, tie_word_embeddings=True)       # gspo_minimal's Llama's (a test holds it)


def build_tiny_model(tokenizer, moe: bool = False, positions: int = 64):
    """gspo_minimal's 1.05M-parameter Llama, or with `moe` a Mixtral of the same shape, 1.84M
    parameters (4 experts, 2 active per token), router aux loss off so that the objective stays pure."""
    if not moe:
        return g.build_tiny_model(tokenizer, positions)
    from transformers import MixtralConfig, MixtralForCausalLM
    return MixtralForCausalLM(MixtralConfig(
        vocab_size=len(tokenizer), intermediate_size=256, num_local_experts=4, num_experts_per_tok=2,
        router_aux_loss_coef=0.0, output_router_logits=False, max_position_embeddings=positions,
        pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id, **TINY_SHAPE))


def load_pretrained(name_or_path: str):
    """gspo_minimal.load_pretrained, and one .gguf file too (transformers dequantises its weights to
    float32, which checkpoints then save as plain tensors)."""
    if not name_or_path.endswith(".gguf"):
        return g.load_pretrained(name_or_path)
    from transformers import AutoModelForCausalLM, AutoTokenizer
    folder, name = os.path.split(os.path.abspath(name_or_path))
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, gguf_file=name)
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    return model, tokenizer


def build(cfg: Config, device, task):
    """gspo_minimal.build with the lab's models: --moe, a .gguf --model, --gradient-checkpointing."""
    if cfg.model:
        model, tokenizer = load_pretrained(cfg.model)
        if cfg.no_chat_template:
            tokenizer.chat_template = None
    else:
        tokenizer = build_char_tokenizer(task)
        longest = task.longest_prompt() + cfg.max_new_tokens
        model = build_tiny_model(tokenizer, moe=cfg.moe, positions=max(64, 1 << (longest - 1).bit_length()))
    if cfg.gradient_checkpointing:     # its layers recompute only in training mode (dropout 0 here)
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        model.train()
    return model.to(device), tokenizer



# ---------------------------------------------------------------------------------------------
# Sampling with a record: the sampler's own log-probs of its tokens, nucleus sampling, pieces.
# ---------------------------------------------------------------------------------------------

# Nucleus sampling (top-p): draw only from the smallest set of most likely tokens whose probability
# reaches p, renormalised: q(v) = pi(v) / Z for v in the set, Z = its mass >= p, 0 elsewhere. The
# sampler's record log q(y_t) = log pi(y_t) - log Z_t then sits above the full softmax's log pi(y_t)
# by the truncation bias -log Z_t >= 0 at every token, and KL(q || pi) = -log Z_t exactly.
def nucleus_logprobs(logits: torch.Tensor, temperature: float, top_p: float = 1.0) -> torch.Tensor:
    """(..., V) logits -> log q of the distribution the sampler draws from (..., V), float32:
    log_softmax(logits / temperature), truncated to the nucleus and renormalised when top_p < 1
    (-inf outside it). The most likely token is always kept."""
    logp = torch.log_softmax(logits.float() / temperature, dim=-1)
    if top_p >= 1:
        return logp
    ranked, order = logp.sort(dim=-1, descending=True)
    above = ranked.exp().cumsum(-1) - ranked.exp()           # the mass of every more likely token
    drop = torch.zeros_like(above, dtype=torch.bool).scatter(-1, order, above >= top_p)
    logp = logp.masked_fill(drop, -float("inf"))
    return logp - logp.logsumexp(-1, keepdim=True)


@torch.no_grad()
def sample_completions(model, prompt_ids, prompt_mask, max_new_tokens: int, eos_id: int,
                       pad_id: int, *, temperature: float = 1.0, suppress_eos: bool = False,
                       group_size: int = 1, with_logprobs: bool = False, rows: int = 0,
                       top_p: float = 1.0):
    """Sample one completion per row; temperature 0 is greedy. Returns (B, T) token ids, T <= max_new;
    with `with_logprobs`, also the sampler's own record of their log-probs, (B, T) float32 (0 after a
    row's EOS): log_softmax(logits.float() / temperature), the formula `policy_logprobs` uses, so
    the record differs from the trainer's only where the two models' arithmetic does. With `top_p`
    < 1 it samples from the nucleus and records log q under it (`nucleus_logprobs`).

    `group_size` G: rows come in groups of G identical prompts (a rollout's layout), so each prompt
    runs through the model once per group and its KV cache is repeated G times. `suppress_eos`
    forbids EOS, so every row runs to max_new_tokens (studies/verify.py's long responses). `rows` > 0
    samples whole groups of at most that many rows at a time, padded to one length: the KV cache of
    a piece, not of the batch, is what memory holds (a different random stream from one piece).

    A hand-written loop over a DynamicCache rather than `model.generate`, so that every step of
    sampling is in view and the temperature matches `policy_logprobs` by construction. Greedy
    output equals generate's token for token (test_hand_written_sampler_matches_generate_when_greedy;
    `python studies/speed.py sampler` times the two). Stopped rows keep receiving `pad_id`; the loop
    ends when every row has stopped. A model that leaves the cache empty is refused (`grouped_prompt_pass`).
    """
    G = group_size
    step = max(G, rows // G * G) if rows else len(prompt_ids)
    if step < len(prompt_ids):
        kw = dict(temperature=temperature, suppress_eos=suppress_eos, group_size=G, with_logprobs=with_logprobs,
                  top_p=top_p)
        pieces = [sample_completions(model, prompt_ids[i:i + step], prompt_mask[i:i + step], max_new_tokens,
                                     eos_id, pad_id, **kw) for i in range(0, len(prompt_ids), step)]
        pieces = [p if with_logprobs else (p,) for p in pieces]      # (completions[, record]) each
        T = max(p[0].shape[1] for p in pieces)       # a piece whose rows all stopped early is shorter
        out = [torch.cat([torch.nn.functional.pad(p[k], (0, T - p[k].shape[1]), value=fill) for p in pieces])
               for k, fill in zip(range(len(pieces[0])), (pad_id, 0.0))]
        return tuple(out) if with_logprobs else out[0]
    attn = prompt_mask.long()                                  # (B, P), 0 on left padding
    pos = (attn.cumsum(-1) - 1).clamp(min=0)                   # (B, P), positions skip the padding
    logits, cache = grouped_prompt_pass(model, prompt_ids, attn, pos, G, "sample_completions")   # (B, V)
    done = torch.zeros(len(prompt_ids), dtype=torch.bool, device=prompt_ids.device)
    out, record = [], []
    for _ in range(max_new_tokens):
        if suppress_eos:
            logits[:, eos_id] = -float("inf")
        nucleus = temperature > 0 and top_p < 1
        if nucleus:
            logq = nucleus_logprobs(logits, temperature, top_p)    # (B, V)
            nxt = torch.multinomial(logq.exp(), 1).squeeze(-1)     # (B,)
        elif temperature > 0:
            probs = torch.softmax(logits.float() / temperature, dim=-1)
            nxt = torch.multinomial(probs, 1).squeeze(-1)          # (B,)
        else:
            nxt = logits.argmax(-1)
        nxt = torch.where(done, pad_id, nxt)
        out.append(nxt)
        if with_logprobs:
            scaled = logits.float() / temperature if temperature > 0 else logits.float()
            logq = logq if nucleus else torch.log_softmax(scaled, dim=-1)
            logp = logq.gather(-1, nxt[:, None]).squeeze(-1)       # (B,)
            record.append(torch.where(done, 0.0, logp))
        done |= nxt == eos_id
        if done.all():
            break
        attn = torch.cat([attn, torch.ones_like(attn[:, :1])], dim=1)
        pos = pos[:, -1:] + 1
        logits = model(input_ids=nxt[:, None], attention_mask=attn, position_ids=pos, cache=cache,
                       use_cache=True).logits[:, -1]
    if with_logprobs:
        return torch.stack(out, dim=1), torch.stack(record, dim=1)   # (B, T) each
    return torch.stack(out, dim=1)                             # (B, T)




# ---------------------------------------------------------------------------------------------
# Dr. GRPO's advantage beside GSPO's (eq. 6).
# ---------------------------------------------------------------------------------------------

# A_i = (r_i - mean(r_1..r_G)) / (std(r_1..r_G) + eps),  std Bessel-corrected (TRL, verl).
# Dr. GRPO (arXiv 2503.20783) drops the division: A_i = r_i - mean(r_1..r_G) (`scale=False`), so a
# group whose rewards barely differ is not blown up to unit spread.
def group_advantages(rewards: torch.Tensor, group_size: int, *, eps: float = 1e-6,
                     scale: bool = True) -> torch.Tensor:
    """rewards (B,), laid out group after group -> advantages (B,).

    A group whose rewards are all equal carries no signal and gets exactly 0, detected explicitly:
    (r - mean) can be a tiny non-zero round-off that the division by (0 + eps) would blow up.
    """
    if group_size < 2 or rewards.numel() % group_size:
        raise ValueError(f"need group_size >= 2 dividing {rewards.numel()} rewards, got {group_size}")
    r = rewards.reshape(-1, group_size)                        # (B/G, G)
    centred = r - r.mean(dim=1, keepdim=True)
    adv = centred / (r.std(dim=1, keepdim=True) + eps) if scale else centred
    all_equal = (r == r[:, :1]).all(dim=1, keepdim=True)       # (B/G, 1)
    return torch.where(all_equal, torch.zeros_like(adv), adv).reshape(-1)




# The engine gap: log pi_old as the sampler recorded it against the trainer's own pass, at the SAME
# weights. In a trainer fed by an inference engine (vLLM, SGLang) the two are different programs,
# often in different precisions; taking the sampler's record as pi_old (--old-logprobs sampler)
# hands the update a sequence ratio s = exp(mean_t(log p_trainer - log p_sampler)) != 1 before any
# weight has moved. GSPO's band is ln(1 + 4e-4) = 4.0e-4 nats per token wide on the upper side.
#   engine_gap_tokens = mean_{i,t} |log p_trainer - log p_sampler|,  engine_gap_seqs = mean_i |log s_i|
def engine_gap(logp_trainer, logp_sampler, mask) -> tuple[float, float]:
    """(B, T) log-probs of the same tokens from the trainer and the sampler at theta_old -> the mean
    absolute gap per completion token and the mean |log s| per sequence, in nats."""
    keep = mask != 0
    delta = torch.where(keep, logp_trainer - logp_sampler, torch.zeros_like(logp_trainer))   # (B, T)
    per_token = delta.abs().sum() / keep.sum().clamp(min=1)
    return per_token.item(), sequence_log_ratio(logp_trainer, logp_sampler, mask).abs().mean().item()


# ---------------------------------------------------------------------------------------------
# The three objectives with every aggregation and --is-correction's weight. At aggregation "paper"
# with no weight each is gspo_minimal's, value and gradient (test_gspo_lab.py holds it).
# ---------------------------------------------------------------------------------------------
def _deltas(logp_new, logp_old, mask) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, T) per-token log-ratios, 0 at masked positions, and the bool mask."""
    keep = mask != 0
    return torch.where(keep, logp_new - logp_old, torch.zeros_like(logp_new)), keep


def _per_row(term: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """-(1/B) sum_i term_i over rows with at least one token: the paper's 1/G aggregation."""
    return -torch.where(keep.any(-1), term, torch.zeros_like(term)).sum() / term.numel()


def _token_sum(term: torch.Tensor, keep: torch.Tensor, num_tokens) -> torch.Tensor:
    """-(sum_{i,t} term_it) / num_tokens over kept positions (default: this batch's count)."""
    n = keep.sum() if num_tokens is None else torch.as_tensor(num_tokens, dtype=torch.float64)
    return -torch.where(keep, term, torch.zeros_like(term)).sum() / n.clamp(min=1).to(term.dtype)


# How a minibatch's terms l_i (one per sequence) or l_it (one per token) become one loss:
#   paper:   -(1/B) sum_i l_i               or  -(1/B) sum_i (1/|y_i|) sum_t l_it     (eqs. 5, 2)
#   dapo:    -(1/N) sum_i |y_i| l_i         or  -(1/N) sum_i sum_t l_it,   N = num_tokens
#   dr_grpo: as dapo with N = B * max_tokens, a constant (arXiv 2503.20783)
# With a sequence-level ratio, dapo (TRL's default loss_type) gives sequence i the weight |y_i| / mean|y|:
# long responses count for more. Which weighting is right is disputed: GSPO weights every response
# equally (its paper motivates the 1/|y| inside s by variance and a common numerical range of s), while
# DAPO, Dr. GRPO and LUSPO weight by length. GSPO under dapo or dr_grpo is LUSPO up to a constant:
# luspo_loss = mean|y| x gspo_loss(dapo) = max_tokens x gspo_loss(dr_grpo) (tutorial section 11).
def aggregate(term, keep, aggregation: str = "paper", *, num_tokens=None, max_tokens=None, weight=None):
    """term (B,) or (B, T), keep (B, T) bool -> the scalar loss (sign flipped). num_tokens: dapo's
    N (default: this batch's tokens); max_tokens: dr_grpo's (default: T, the mask's width). weight
    (B, T), detached: --is-correction's, multiplied onto each token's term first (a sequence's
    term then counts mean_t(w_t) times under paper, as in TRL)."""
    if term.dim() == 1 and (aggregation != "paper" or weight is not None):   # one term per sequence:
        term = term.unsqueeze(-1).expand_as(keep)                             # on each token
    if weight is not None:
        term = term * weight
    if aggregation == "paper":          # an empty row's token mean is 0: it adds nothing either way
        return _per_row(term, keep) if term.dim() == 1 else -masked_mean(term, keep).mean()
    if aggregation == "dapo":
        return _token_sum(term, keep, num_tokens)
    if aggregation == "dr_grpo":
        width = keep.shape[-1] if max_tokens is None else max_tokens
        return _token_sum(term, keep, keep.shape[0] * width)
    raise ValueError(f"aggregation must be one of {AGGREGATIONS}, got {aggregation!r}")


# J_GSPO = (1/G) sum_i min(s_i A_i, clip(s_i, 1-eps_low, 1+eps_high) A_i)                (eq. 5)
def gspo_loss(logp_new, logp_old, advantages, mask, eps_low: float = 3e-4, eps_high: float = 4e-4,
              *, aggregation: str = "paper", num_tokens=None, max_tokens=None, weight=None) -> torch.Tensor:
    """GSPO: one clipped term per sequence, mean over sequences. (B, T) log-probs, (B,) advantages.

    Its gradient is (eq. 10) s_i A_i (1/|y_i|) sum_t grad log pi(y_it): every token of a response
    shares one weight. An empty row adds nothing (explicit `where`: the clipped term at s = 1 would
    add A), but still counts in the 1/B, as the paper's 1/G does. `aggregation` other than "paper"
    reweights the sequences (`aggregate`); so does `weight`, --is-correction's (`correction_weight`).
    """
    at_least_float32(logp_new, logp_old)
    s = importance_ratio(logp_new, logp_old, mask)                     # (B,)
    per_seq = clipped_surrogate(s, advantages, eps_low, eps_high)     # (B,)
    return aggregate(per_seq, mask != 0, aggregation, num_tokens=num_tokens, max_tokens=max_tokens,
                     weight=weight)


# s_it = sg[s_i] * pi(y_it) / sg[pi(y_it)]                                          (eqs. 13-14)
# J = (1/G) sum_i (1/|y_i|) sum_t min(s_it A_it, clip(s_it, 1-eps_low, 1+eps_high) A_it)
def gspo_token_loss(logp_new, logp_old, advantages, mask, eps_low: float = 3e-4,
                    eps_high: float = 4e-4, *, aggregation: str = "paper", num_tokens=None,
                    max_tokens=None, weight=None) -> torch.Tensor:
    """GSPO-token: every s_it has the VALUE s_i (so clipping is decided per sequence) and the
    GRADIENT s_i * grad log pi(y_it), which lets each token carry its own advantage A_it.
    With A_it = A_i it equals GSPO in value and gradient (eqs. 15-17)."""
    at_least_float32(logp_new, logp_old)
    keep = mask != 0
    s = importance_ratio(logp_new, logp_old, mask).detach()            # (B,), sg[s_i]
    own = torch.where(keep, logp_new - logp_new.detach(), torch.zeros_like(logp_new))  # 0, grad 1
    s_tok = s.unsqueeze(-1) * torch.exp(own)                           # (B, T), value s_i
    per_tok = clipped_surrogate(s_tok, per_token(advantages, s_tok), eps_low, eps_high)
    return aggregate(per_tok, keep, aggregation, num_tokens=num_tokens, max_tokens=max_tokens, weight=weight)


# w_it = pi_new(y_it) / pi_old(y_it)
# J_GRPO = (1/G) sum_i (1/|y_i|) sum_t min(w_it A_i, clip(w_it, 1-eps_low, 1+eps_high) A_i)   (eq. 2;
# the paper writes one eps, the asymmetric band is DAPO's "clip-higher", as in its GRPO baseline)
def grpo_loss(logp_new, logp_old, advantages, mask, eps_low: float = 0.2, eps_high: float = 0.27,
              *, aggregation: str = "paper", num_tokens=None, max_tokens=None, weight=None) -> torch.Tensor:
    """GRPO: every token clipped on its own ratio; per-row token mean, then mean over rows
    (`aggregation` "paper"; "dapo" and "dr_grpo" sum over tokens instead, `aggregate`)."""
    at_least_float32(logp_new, logp_old)
    log_w, keep = _deltas(logp_new, logp_old, mask)                          # (B, T)
    per_tok = clipped_surrogate(torch.exp(log_w), per_token(advantages, log_w), eps_low, eps_high)
    return aggregate(per_tok, keep, aggregation, num_tokens=num_tokens, max_tokens=max_tokens, weight=weight)


LOSS_FNS = {"gspo": gspo_loss, "gspo-token": gspo_token_loss, "grpo": grpo_loss}


# Correcting the engine gap (--is-correction, with the trainer's pi_old): y was drawn from the
# sampler q, and the update treats it as drawn from pi_old. A detached weight on each token's loss
# term moves it back, from d_t = log pi_old(y_t) - log q(y_t):
#   token_truncate, token_mask:         w_t = exp(d_t)           each token's own ratio
#   sequence_truncate, sequence_mask:   w_t = exp(sum_t d_t)     pi_old(y) / q(y), the whole response
#   sequence_geometric_mask:            w_t = 1 if exp(mean_t d_t) in [lo, hi], else 0
# *_truncate clamps w into [lo, hi], *_mask sets it to 0 outside (TRL 1.16's modes of these names).
# The geometric one is verl's rejection by the per-token mean, pure rejection (no weight): mean_t d_t
# is the engine's own log s, so it keeps a response only inside a band, on the scale of GSPO's. A
# sum grows with |y| where a mean does not: the sequence modes shrink or drop long responses.
def correction_weight(logp_old, logp_sampler, mask, mode: str, clip_min: float | None = None,
                      clip_max: float | None = 3.0) -> torch.Tensor:
    """(B, T) log-probs of the sampled tokens under the trainer's pi_old and as the sampler recorded
    them -> (B, T) the detached weight of `mode` (what it holds at masked positions, the loss ignores)."""
    d, keep = _deltas(logp_old.detach(), logp_sampler, mask)                    # (B, T)
    if mode in ("token_truncate", "token_mask"):
        log_w = d
    elif mode in ("sequence_truncate", "sequence_mask"):
        log_w = d.sum(-1, keepdim=True).expand_as(d)
    elif mode == "sequence_geometric_mask":
        log_w = masked_mean(d, keep).unsqueeze(-1).expand_as(d)
    else:
        raise ValueError(f"--is-correction must be one of {IS_CORRECTIONS[1:]}, got {mode!r}")
    w = torch.exp(log_w)
    if mode.endswith("truncate"):
        return w.clamp(min=clip_min, max=clip_max) if (clip_min, clip_max) != (None, None) else w
    outside = ((w < clip_min) if clip_min is not None else torch.zeros_like(keep)) | (
        (w > clip_max) if clip_max is not None else torch.zeros_like(keep))
    kept = torch.ones_like(w) if mode == "sequence_geometric_mask" else w
    return torch.where(outside, torch.zeros_like(w), kept)


# ---------------------------------------------------------------------------------------------
# Relatives of GSPO. Objectives published since GSPO, each a statement about the same per-token
# log-ratios delta_t = log pi_new(y_t) - log pi_old(y_t), read through the same lens:
#   sum_t delta_t = |y| log s = |y| (H_old - H_new)       log s = mean_t delta_t = H_old - H_new
# Each takes gspo_loss's first four arguments and its own hyperparameters, keyword-only, with its
# paper's defaults. Masked positions never reach a value or a gradient (`_deltas`), and an empty
# row adds nothing. Those that weight log pi itself (CISPO, VESPO) normalise by a token count,
# `num_tokens`: by default this batch's; a trainer that splits a rollout into minibatches passes
# the rollout's count divided by the number of minibatches, as TRL does.
# ---------------------------------------------------------------------------------------------
# GMPO (arXiv 2507.20673): the geometric mean of CLIPPED token ratios, clipped in log space.
#   J = (1/G) sum_i A_i exp( (1/|y_i|) sum_t c_it ),   c_it = min(delta_it, clip(delta_it, -e_lo, e_hi))
#   when A_i > 0, max(...) when A_i < 0 (PPO's pessimistic side, written for the log-ratio).
# Perplexity lens: GSPO clips exp(H_old - H_new) after averaging; GMPO clips each token's
# contribution to H_old - H_new before it. Unclipped, the weight is exactly s.
def gmpo_loss(logp_new, logp_old, advantages, mask, *, eps: tuple[float, float] = (0.4, 0.4)
              ) -> torch.Tensor:
    """GMPO, eps = (e_lo, e_hi) in LOG space: token ratios kept within (exp(-e_lo), exp(e_hi)).
    An empty row adds nothing (TRL 1.16 adds -A_i/B for it: its geometric mean of no tokens is 1)."""
    delta, keep = _deltas(logp_new, logp_old, mask)
    adv = advantages.unsqueeze(-1)                                        # (B, 1)
    bounded = delta.clamp(-eps[0], eps[1])
    clipped = torch.where(adv > 0, torch.minimum(delta, bounded), torch.maximum(delta, bounded))
    return _per_row(torch.exp(masked_mean(clipped, keep)) * advantages, keep)


# SAPO (arXiv 2511.20347): a smooth gate in place of the hard clip.
#   f(r) = sigmoid(tau (r - 1)) * 4 / tau,   tau = tau_pos if A > 0 else tau_neg
#   token level:    J = (1/G) sum_i (1/|y_i|) sum_t f(w_it) A_i     (w_it = exp(delta_it))
#   sequence level: J = (1/G) sum_i f(s_i) A_i                        (s_i = PPL_old / PPL_new)
# f'(r) = 4 sigmoid (1 - sigmoid): 1 at r = 1 (on-policy it is the plain policy gradient) and
# falling smoothly to 0 as r leaves 1; the larger tau, the narrower the region that still learns.
SAPO_TAU = (1.0, 1.05)                  # (tau_pos, tau_neg), the paper's


def _by_sign(positive, pair, like) -> torch.Tensor:
    """pair[0] where `positive`, else pair[1], built in like's dtype (1.05 stays 1.05 in float64)."""
    first, second = (torch.full_like(like, v) for v in pair)
    return torch.where(positive, first, second)


def _sapo_terms(delta, keep, advantages, tau, level: str):
    """SAPO's ratio, advantage and temperature, of one shape: (B, T) per token, (B,) per sequence."""
    if level == "sequence":
        ratio, adv = torch.exp(masked_mean(delta, keep)), advantages                # (B,)
    elif level == "token":
        ratio, adv = torch.exp(delta), per_token(advantages, delta)                 # (B, T)
    else:
        raise ValueError(f"level must be 'token' or 'sequence', got {level!r}")
    return ratio, adv, _by_sign(adv > 0, tau, ratio)


def sapo_loss(logp_new, logp_old, advantages, mask, *, tau: tuple[float, float] = SAPO_TAU,
              level: str = "token") -> torch.Tensor:
    """SAPO, tau = (tau_pos, tau_neg); level "token" (the paper's) or "sequence" (the gate on GSPO's s,
    TRL's importance_sampling_level="sequence"). tau is built in the inputs' dtype; TRL 1.16 builds it
    in float32 (1.05 -> 1.0499999523), so in float64 the two differ by about 3e-8 relative."""
    delta, keep = _deltas(logp_new, logp_old, mask)
    ratio, adv, t = _sapo_terms(delta, keep, advantages, tau, level)
    gated = torch.sigmoid(t * (ratio - 1)) * 4 / t * adv
    return _per_row(gated if level == "sequence" else masked_mean(gated, keep), keep)


# CISPO (arXiv 2506.13585, MiniMax-M1): keep every token's gradient, clip only its WEIGHT.
#   J = (1 / sum_i |y_i|) sum_i sum_t sg[min(w_it, cap)] A_i log pi_new(y_it)
# The paper writes clip(w, 1 - e_lo, 1 + e_hi) with e_lo so large that only the upper bound acts;
# `cap` is that upper bound, 1 + e_hi, an absolute value as TRL's `epsilon_high` is for CISPO.
def cispo_loss(logp_new, logp_old, advantages, mask, *, cap: float = 5.0,
               num_tokens=None) -> torch.Tensor:
    """CISPO: REINFORCE on log pi weighted by the detached token ratio capped at `cap` (> 1). The
    paper states no value for its bound; 5.0 is the one TRL's documentation uses."""
    delta, keep = _deltas(logp_new, logp_old, mask)
    weight = torch.exp(delta).clamp(max=cap).detach()
    logp = torch.where(keep, logp_new, torch.zeros_like(logp_new))
    return _token_sum(weight * per_token(advantages, delta) * logp, keep, num_tokens)


# LUSPO (arXiv 2602.05261): GSPO's term times the response length, undoing the 1/|y| that gives a
# long response as much weight in total as a short one.
#   J = (1/G) sum_i |y_i| min(s_i A_i, clip(s_i, 1-e_lo, 1+e_hi) A_i)
def luspo_loss(logp_new, logp_old, advantages, mask, *, eps: tuple[float, float] = (3e-4, 4e-4)
               ) -> torch.Tensor:
    """LUSPO: GSPO's per-sequence term weighted by |y_i|, mean over sequences."""
    delta, keep = _deltas(logp_new, logp_old, mask)
    s = torch.exp(masked_mean(delta, keep))
    return _per_row(keep.sum(-1).to(s.dtype) * clipped_surrogate(s, advantages, *eps), keep)


# VESPO (arXiv 2602.10693): weight log pi by a smooth function of the UNNORMALISED sequence ratio
#   W_i = prod_t w_it = exp(sum_t delta_it) = (PPL_old / PPL_new) ** |y_i| = s_i ** |y_i|
#   phi(W) = W^k exp(lam (1 - W)),  phi(1) = 1, largest at W = k / lam, vanishing as W -> 0 or inf
#   J = (1 / sum_i |y_i|) sum_i sum_t sg[phi(W_i)] A_i log pi_new(y_it)
VESPO_K, VESPO_LAM = (2.0, 3.0), (3.0, 2.0)     # (for A >= 0, for A < 0), the paper's


def _vespo_phi(log_w, advantages, k, lam) -> torch.Tensor:
    """phi(W) = exp(lam + k log W - lam W) per row (B,), k and lam by the sign of A; 0 where W overflows."""
    kk, ll = _by_sign(advantages >= 0, k, log_w), _by_sign(advantages >= 0, lam, log_w)
    return torch.exp(ll + kk * log_w - ll * torch.exp(log_w))


def vespo_loss(logp_new, logp_old, advantages, mask, *, k: tuple[float, float] = VESPO_K,
               lam: tuple[float, float] = VESPO_LAM, num_tokens=None) -> torch.Tensor:
    """VESPO, k = (k_pos, k_neg), lam = (lam_pos, lam_neg), chosen by A >= 0 / A < 0. phi is computed
    in log space with no clamp (TRL 1.16 clamps each delta to +-20 and log W to [log 1e-8, 20])."""
    delta, keep = _deltas(logp_new, logp_old, mask)
    phi = _vespo_phi(delta.sum(-1).detach(), advantages, k, lam)         # (B,), from log W_i
    logp = torch.where(keep, logp_new, torch.zeros_like(logp_new))
    return _token_sum((phi * advantages).unsqueeze(-1) * logp, keep, num_tokens)


# The off-policy sequence mask (DeepSeek-V3.2): drop a response with a negative advantage when the
# new policy has drifted too far from the one that sampled it,
#   keep_i = A_i >= 0  or  (1/|y_i|) sum_t (log pi_old - log pi_new) <= delta
# and (1/|y|) sum_t (log pi_old - log pi_new) = H_new - H_old = log(PPL_new / PPL_old) = -log s.
def off_policy_sequence_mask(logp_new, logp_old, advantages, mask, delta: float) -> torch.Tensor:
    """(B,) bool, True where the response is kept; multiply it into any loss's mask."""
    d, keep = _deltas(logp_new.detach(), logp_old, mask)
    return (advantages >= 0) | (-masked_mean(d, keep) <= delta)


def gate_weight(loss: str, logp_new, logp_old, advantages, mask) -> torch.Tensor:
    """(B, T) the weight SAPO's or VESPO's gate gives each token's gradient, relative to its
    on-policy value 1: SAPO's slope 4 sigmoid (1 - sigmoid) at w_t (sapo) or s (sapo-seq), VESPO's
    phi(W). Training logs the share of tokens below 1/2 as `gate_tokens`, the smooth gates'
    counterpart of a clip fraction."""
    delta, keep = _deltas(logp_new, logp_old, mask)
    if loss == "vespo":
        weight = _vespo_phi(delta.sum(-1), advantages, VESPO_K, VESPO_LAM)      # (B,)
    else:
        ratio, _, t = _sapo_terms(delta, keep, advantages, SAPO_TAU,
                                  "sequence" if loss == "sapo-seq" else "token")
        p = torch.sigmoid(t * (ratio - 1))
        weight = 4 * p * (1 - p)                                                # (B,) or (B, T)
    return (weight.unsqueeze(-1) if weight.dim() == 1 else weight).expand_as(delta)


def loss_value(loss: str, logp_new, logp_old, advantages, mask, eps_low, eps_high, num_tokens, *,
               aggregation: str = "paper", max_tokens=None, weight=None):
    """The objective `loss` names, with the clip widths rl_update resolved (GMPO's in log space,
    CISPO's eps_high its cap), the token count the token-normalised losses divide by, and the
    aggregation of GSPO, GSPO-token and GRPO (the relatives have their own), and for those three
    --is-correction's `weight`."""
    if loss in LOSS_FNS:
        return LOSS_FNS[loss](logp_new, logp_old, advantages, mask, eps_low, eps_high,
                              aggregation=aggregation, num_tokens=num_tokens, max_tokens=max_tokens,
                              weight=weight)
    if weight is not None:
        raise ValueError(f"--is-correction is for gspo, gspo-token and grpo, not {loss}")
    args = (logp_new, logp_old, advantages, mask)
    return {"gmpo": lambda: gmpo_loss(*args, eps=(eps_low, eps_high)),
            "sapo": lambda: sapo_loss(*args, level="token"),
            "sapo-seq": lambda: sapo_loss(*args, level="sequence"),
            "cispo": lambda: cispo_loss(*args, cap=eps_high, num_tokens=num_tokens),
            "luspo": lambda: luspo_loss(*args, eps=(eps_low, eps_high)),
            "vespo": lambda: vespo_loss(*args, num_tokens=num_tokens)}[loss]()




# ---------------------------------------------------------------------------------------------
# The lab's step: the sampler as an engine, its record, the synthetic record, the calibrated band.
# ---------------------------------------------------------------------------------------------

def sampling_model(model, cfg: Config, engine=None):
    """The model that samples a rollout: the policy itself (--sampler-dtype float32), a copy of it
    cast to bfloat16 or float16, weights and activations, made now, as an inference engine holds
    weights of its own, or llama.cpp (--engine, `engine`), the trainer's current weights synced into
    it now. Its log-probs of the same tokens differ by the engine gap (`engine_gap`)."""
    if engine is not None:
        engine.sync(model)
        return engine
    if cfg.sampler_dtype == "float32":
        return model
    return copy.deepcopy(model).to(getattr(torch, cfg.sampler_dtype))


def engine_differs(cfg: Config) -> bool:
    """Whether pi_old's record differs from the trainer by construction: another dtype, llama.cpp, a
    nucleus (--top-p) or the synthetic engine. Such runs log log s at theta_old (and a real engine its KL)."""
    return (cfg.sampler_dtype != "float32" or bool(cfg.engine) or cfg.top_p < 1
            or bool(cfg.record_noise or cfg.record_bins))


KL_ELEMENTS = 2 ** 22      # logits per piece of `engine_kl_tokens`: 32 MiB in float64, any vocabulary


def completion_logits(model, prompt_ids, prompt_mask, completions) -> torch.Tensor:
    """The logits (B, T, V) that predict each completion token: gspo_minimal.policy_logprobs' one pass,
    before its log-softmax (a test holds the two equal), for a KL over the whole vocabulary."""
    ids = torch.cat([prompt_ids, completions], dim=1)                    # (B, P+T)
    attn = torch.cat([prompt_mask.long(), torch.ones_like(completions)], dim=1)
    pos = (attn.cumsum(-1) - 1).clamp(min=0)
    return model(input_ids=ids, attention_mask=attn, position_ids=pos, use_cache=False,
                 logits_to_keep=completions.shape[1] + 1).logits[:, :-1]   # (B, T, V): predicts y_1..y_T


# The engine gap, exactly: at each position the sampler draws from q_t, the trainer holds p_t, and
#   KL(q_t || p_t) = sum_v q_t(v) (log q_t(v) - log p_t(v)) >= 0     over the whole vocabulary.
# The sampled token's gap d_t = log p_t(y_t) - log q_t(y_t) has mean E_q[d_t] = -KL(q_t || p_t): a
# sampler that differs from the trainer biases log s downwards, by the mean KL at a fixed length.
# Written with r = p/q on the tokens S the sampler can draw (all of them, or a nucleus),
#   KL(q_t || p_t) = sum_{v in S} q (r - 1 - log r) + (1 - sum_{v in S} p),
# a sum of terms each >= 0 (r - 1 >= log r) plus the trainer's mass outside S. Near-equal models
# have KLs far below float32's resolution (1.2e-7 per term), where q (log q - log p) summed in
# float32 lands on either side of zero by the CPU's round-off; this form, in float64, cannot.
def token_kl(sampler_logits: torch.Tensor, trainer_logits: torch.Tensor, temperature: float,
             top_p: float = 1.0) -> torch.Tensor:
    """(..., V) logits of the sampler and of the trainer -> (...,) KL(q || p) in float64, q the
    distribution the sampler draws from (its nucleus under `top_p`, `nucleus_logprobs`), p the
    trainer's softmax, both of logits / temperature. Never negative, and exactly 0 for equal logits."""
    inside = nucleus_logprobs(sampler_logits, temperature, top_p) > -float("inf")     # (..., V): S
    logq = torch.log_softmax((sampler_logits.double() / temperature).masked_fill(~inside, -float("inf")), -1)
    logp = torch.log_softmax(trainer_logits.double() / temperature, dim=-1)
    log_r = torch.where(inside, logp - logq, 0.0)                  # 0 outside S, where q = 0
    return (logq.exp() * (torch.expm1(log_r) - log_r)).sum(-1) + torch.where(inside, 0.0, logp.exp()).sum(-1)


@torch.no_grad()
def engine_kl_tokens(sampler, trainer, batch: dict, cfg: Config) -> float:
    """Mean KL(sampler || trainer) per completion token over a minibatch's worth of the rollout (its
    first B / minibatches rows, whole groups), at theta_old, `token_kl` in float64. The sampler's
    logits come from one full pass over the sampled tokens (the record came from its token-by-token
    pass with a KV cache, which in bf16 differs in the last bits); pieces of rows hold at most
    KL_ELEMENTS logits, so a real vocabulary stays small."""
    G = cfg.group_size
    n = max(1, len(batch["rewards"]) // G // cfg.minibatches) * G
    T = batch["completions"].shape[1]
    step = max(1, KL_ELEMENTS // (T * trainer.get_output_embeddings().weight.shape[0]))
    total, count = 0.0, 0
    for i in range(0, n, step):
        args = [batch[k][i:min(i + step, n)] for k in ("prompt_ids", "prompt_mask", "completions")]
        trained = completion_logits(trainer, *args)                                       # (b, T, V)
        sampled = (sampler.logits(*args).to(trained.device) if isinstance(sampler, LlamaCppEngine)
                   else completion_logits(sampler, *args))                                # (b, T, V)
        kl = token_kl(sampled, trained, cfg.temperature, cfg.top_p)                       # (b, T)
        keep = batch["mask"][i:min(i + step, n)] != 0
        total, count = total + kl[keep].sum().item(), count + keep.sum().item()
    return total / max(count, 1)


@torch.no_grad()
def rollout(model, tokenizer, problems, cfg: Config, device, seed: int = 0) -> dict:
    """Sample G completions per prompt with `model` (the sampler: a torch model, or llama.cpp, whose
    draws `seed` seeds), score them, and compute group advantages. `sampler_logprobs` is the
    sampler's own record of its tokens' log-probs."""
    G, task = cfg.group_size, task_of(cfg)
    texts = [task.prompt(a, b) for a, b in problems for _ in range(G)]       # group after group
    prompt_ids, prompt_mask = encode_prompts(tokenizer, texts, device)            # (B, P)
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    if isinstance(model, LlamaCppEngine):     # llama.cpp's own sampler chain; (B, T) each, on the CPU
        completions, sampled = (x.to(device) for x in model.sample(
            prompt_ids, prompt_mask, cfg.max_new_tokens, eos, pad, temperature=cfg.temperature,
            group_size=G, seed=seed))
    else:
        completions, sampled = sample_completions(model, prompt_ids, prompt_mask, cfg.max_new_tokens, eos, pad,
                                                  temperature=cfg.temperature, group_size=G,
                                                  top_p=cfg.top_p, with_logprobs=True,   # (B, T) each
                                                  rows=SAMPLE_TOKENS // cfg.max_new_tokens if cfg.micro_batch else 0)
    mask = completion_mask(completions, tokenizer.eos_token_id)                    # (B, T)
    answers = [task.answer(a, b) for a, b in problems for _ in range(G)]
    rewards = torch.tensor([reward(row, ans, tokenizer, task=task) for row, ans in
                            zip(completions.tolist(), answers)], device=device)    # (B,)
    if cfg.shuffle_rewards:           # the control: same reward statistics, no relation to answers
        rewards = rewards[torch.randperm(len(rewards), device=device)]
    return {"prompt_ids": prompt_ids, "prompt_mask": prompt_mask, "completions": completions, "mask": mask,
            "rewards": rewards, "sampler_logprobs": sampled, "record_gap": synthetic_gap(mask, cfg, sampled),
            "advantages": group_advantages(rewards, G, scale=cfg.scale_rewards == "group")}





QUANTILES = (0.5, 0.9, 0.99, 1.0)


def quantiles(x: torch.Tensor) -> list[float]:
    """The median, p90, p99 and maximum of a 1-D tensor (empty: all 0): how far off-policy one
    minibatch is, without keeping its every value."""
    if x.numel() == 0:
        return [0.0] * len(QUANTILES)
    return torch.quantile(x.double(), torch.tensor(QUANTILES, dtype=torch.float64, device=x.device)).tolist()


def ratio_metrics(logp_new, logp_old, adv, mask, loss: str, eps_low: float, eps_high: float) -> dict:
    """s, the three forms' disagreement, and the clip counts of one minibatch.

    A token counts as clipped when its objective term sits on the clipped, zero-gradient side of
    the min (the "active side": s > 1+eps_high with A > 0, s < 1-eps_low with A < 0). For GSPO a
    clipped sequence clips all of its tokens (our reading of GSPO §5.2, and what verl's
    pg_clipfrac counts), so that `clip_tokens` has one unit for GSPO and GRPO; `clip_seqs` counts
    GSPO's sequences.
    """
    delta, keep = _deltas(logp_new, logp_old, mask)
    s = importance_ratio(logp_new, logp_old, mask)                          # (B,)
    a = adv.unsqueeze(-1)
    gated = torch.zeros_like(keep)
    band_on_s = loss in ("gspo", "gspo-token", "grpo", "luspo")
    seq_clipped = clipped_on_active_side(s, adv, eps_low, eps_high) if band_on_s else None   # (B,)
    if loss == "grpo":                                                      # each token's own ratio
        tok_clipped = clipped_on_active_side(torch.exp(delta), a, eps_low, eps_high) & keep
    elif band_on_s:                                          # a clipped sequence clips its tokens
        tok_clipped = seq_clipped.unsqueeze(-1) & keep
    elif loss == "gmpo":                                                    # each token, log space
        tok_clipped = (((a > 0) & (delta > eps_high)) | ((a < 0) & (delta < -eps_low))) & keep
    elif loss == "cispo":                        # a weight capped where it would push up (as TRL)
        tok_clipped = (torch.exp(delta) > eps_high) & (a > 0) & keep
    else:                                                                   # smooth gates
        tok_clipped = torch.zeros_like(keep)
        gated = (gate_weight(loss, logp_new, logp_old, adv, mask) < 0.5) & keep
    if seq_clipped is None:
        seq_clipped = tok_clipped.any(-1)
    log_s = sequence_log_ratio(logp_new, logp_old, mask)[keep.any(-1)]
    by_sign = {}                                # the same counts among responses with A > 0, A < 0
    for side, rows in (("pos", adv > 0), ("neg", adv < 0)):
        by_sign.update({f"n_clip_seqs_{side}": (seq_clipped & rows).sum().item(),
                        f"n_seqs_{side}": (rows & keep.any(-1)).sum().item(),
                        f"n_clip_tokens_{side}": (tok_clipped & rows.unsqueeze(-1)).sum().item(),
                        f"n_tokens_{side}": (keep & rows.unsqueeze(-1)).sum().item()})
    return {"s": s, "form_gap": form_gap(logp_new, logp_old, mask).max().item(),   # counts, not shares:
            "n_clip_tokens": tok_clipped.sum().item(), "n_tokens": keep.sum().item(),
            "n_clip_seqs": seq_clipped.sum().item(), "n_gate_tokens": gated.sum().item(),
            "abs_log_s_q": quantiles(log_s.abs()), "abs_token_log_ratio_q": quantiles(delta[keep].abs()),
            "sum_old_minus_new": -delta[keep].sum().item(),
            "kl_sum": (torch.expm1(delta.double()) - delta.double()).sum().item(), **by_sign}





def summarise_minibatches(logs: list[dict]) -> dict:
    """One step's metrics from its minibatches' `ratio_metrics` (each with "loss", "n_clip_ceiling" and
    "n_off_policy"); gspo_minimal.summarise_minibatches' keys mean what they mean there.

    `clip_ceiling`: the share of the step's tokens that could clip at all (`clip_tokens` never
    exceeds it). `grad_norm`: the largest minibatch's, before clipping. Per minibatch in order: its
    share of clipped sequences, the `quantiles` of |log s| and of |delta_t|, and the mean of
    log(pi_old / pi_theta) over its tokens just before its update (0 for minibatch 1 with the
    trainer's pi_old). The engine gap is minibatch 1's; the clip shares among responses and tokens
    with A > 0 and A < 0 (`clip_seqs_pos_adv`, ..., the responses' also per minibatch: the lab's, not
    gspo_minimal's); --is-correction's mean and zero weights.
    """
    s = torch.cat([m["s"] for m in logs])                                  # (B,)
    tokens = max(sum(m["n_tokens"] for m in logs), 1)
    return {"loss": sum(m["loss"] for m in logs) / len(logs), "s_mean": s.mean().item(),
            "s_min": s.min().item(), "s_max": s.max().item(),
            "clip_tokens": sum(m["n_clip_tokens"] for m in logs) / tokens,
            "clip_seqs": sum(m["n_clip_seqs"] for m in logs) / len(s),
            "clip_ceiling": sum(m.get("n_clip_ceiling", 0) for m in logs) / tokens,
            **({"approx_kl": sum(m["kl_sum"] for m in logs) / max(sum(m["n_off_policy"] for m in logs), 1)}
               if "n_off_policy" in logs[0] else {}),      # (studies/trl_compare.py's records from TRL: none)
            "gate_tokens": sum(m.get("n_gate_tokens", 0) for m in logs) / tokens,
            "masked_seqs": sum(m.get("n_masked_seqs", 0) for m in logs) / len(s),
            "form_gap": max(m["form_gap"] for m in logs),
            **({"grad_norm": max(m["grad_norm"] for m in logs)} if "grad_norm" in logs[0] else {}),
            **{k: v for k, v in logs[0].items() if k.startswith("engine_")},
            **{f"clip_{unit}_{side}_adv": sum(m[f"n_clip_{unit}_{side}"] for m in logs)
               / max(sum(m[f"n_{unit}_{side}"] for m in logs), 1)
               for unit in ("seqs", "tokens") for side in ("pos", "neg")},
            "clip_seqs_by_sign_by_minibatch": [[m[f"n_clip_seqs_{side}"] / max(m[f"n_seqs_{side}"], 1)
                                                for side in ("pos", "neg")] for m in logs],
            **({"is_weight_mean": sum(m["is_weight_sum"] for m in logs) / tokens,
                "is_masked_tokens": sum(m["n_is_zero"] for m in logs) / tokens} if "is_weight_sum" in logs[0] else {}),
            "clip_seqs_by_minibatch": [m["n_clip_seqs"] / len(m["s"]) for m in logs],
            "update_size_by_minibatch": [m["sum_old_minus_new"] / max(m["n_tokens"], 1) for m in logs],
            "abs_log_s_q": [m["abs_log_s_q"] for m in logs],
            "abs_token_log_ratio_q": [m["abs_token_log_ratio_q"] for m in logs]}


def per_token(advantages: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """Advantages (B,) or (B, T) -> (B, T) (a view, not a copy, for the (B,) case)."""
    return advantages.unsqueeze(-1).expand_as(like) if advantages.dim() == 1 else advantages


def group_chunks(n_rows: int, group_size: int, minibatches: int, device) -> list[torch.Tensor]:
    """Row indices of `minibatches` random chunks of whole groups, as gspo_minimal.rl_update deals them
    (the equality tests hold the two): group k is rows kG .. kG+G-1; tensor_split, not chunk."""
    groups = torch.randperm(n_rows // group_size, device=device).tensor_split(minibatches)
    return [(grp[:, None] * group_size + torch.arange(group_size, device=device)).flatten()
            for grp in groups]


def flat_group_share(rewards: torch.Tensor, group_size: int) -> float:
    """Share of groups whose rewards are all equal: their advantages are 0, they teach nothing (gspo_minimal's
    `flat_groups`, read there from the advantages; the equality tests hold the two)."""
    r = rewards.reshape(-1, group_size)                                     # (B/G, G)
    return (r == r[:, :1]).all(1).float().mean().item()


def micro_batches(idx: torch.Tensor, rows: int) -> list[torch.Tensor]:
    """`idx` (a minibatch's rows, whole groups in order) in consecutive pieces of `rows` rows (0:
    one piece). A piece of a multiple of G rows holds whole groups."""
    return [idx] if rows <= 0 or rows >= len(idx) else list(idx.split(rows))


def row_share(loss: str, aggregation: str) -> bool:
    """Whether the loss divides by its batch's number of rows (a mean over sequences, or dr_grpo's
    rows x max_tokens), so that a micro-batch's loss counts for rows_micro / rows_minibatch of the
    minibatch's; the others divide by `num_tokens`, fixed for the minibatch, and simply add up."""
    return loss in ("gmpo", "sapo", "sapo-seq", "luspo") or (loss in LOSS_FNS and aggregation != "dapo")


def rl_update(model, opt, batch: dict, cfg: Config, eps_low: float, eps_high: float) -> dict:
    """Split one rollout into `minibatches` chunks of whole groups and take one clipped step on each.

    Whole groups: each prompt runs once per chunk (group_policy_logprobs), and each chunk's
    advantages sum to 0 group by group (TRL shuffles single completions instead). pi_old is the
    policy that sampled the rollout. With --old-logprobs trainer (the default) it is the trainer's
    own arithmetic: for chunk 1 the update's own pass, detached, so s = 1 exactly there; for the
    others, one pass BEFORE the first update (the synthetic engine shifts both by its gap). With
    --old-logprobs sampler it is the sampler's record for every chunk and that pass is skipped: s
    != 1 already in chunk 1, by the engine gap. Every later chunk is off-policy.

    --micro-batch N runs each chunk N rows at a time and adds up their gradients before the one
    optimiser step: the same loss and gradient as one pass (each piece weighted by its share,
    `row_share`; token-normalised losses keep the chunk's `num_tokens`), at the memory of N rows.
    Pieces of whole groups keep the prompt-once pass; other pieces, and gradient checkpointing
    (whose layers drop the KV cache), run one full pass per row. Returns `summarise_minibatches`.
    """
    G = cfg.group_size
    chunks = group_chunks(len(batch["rewards"]), G, cfg.minibatches, batch["rewards"].device)
    num_tokens = (batch["mask"] != 0).sum() / cfg.minibatches    # dapo, CISPO, VESPO: as TRL normalises
    from_sampler = cfg.old_logprobs == "sampler"
    rows = cfg.micro_batch or 0
    prompt_once = rows % G == 0 and not cfg.gradient_checkpointing

    def logprobs(idx):                                                   # (len(idx), T)
        args = batch["prompt_ids"][idx], batch["prompt_mask"][idx], batch["completions"][idx]
        if prompt_once:
            return group_policy_logprobs(model, *args, G, temperature=cfg.temperature)
        return policy_logprobs(model, *args, temperature=cfg.temperature)
    record = batch.get("sampler_logprobs")   # (B, T); None in a batch not made by `rollout`
    shift = batch.get("record_gap")           # (B, T): the synthetic engine's d_t (--record-noise), or None
    eps_low, eps_high = calibrated_band(batch["mask"], cfg, eps_low, eps_high)   # (B,) each with --eps-engine
    eps_low, eps_high = fspo_band(batch["mask"], cfg, eps_low, eps_high)         # (B,) each with --fspo-band
    band = lambda rows: [e[rows] if torch.is_tensor(e) else e for e in (eps_low, eps_high)]
    if from_sampler and record is None:
        raise ValueError("--old-logprobs sampler needs the rollout's sampler_logprobs")
    old = record                              # pi_old: the sampler's record, or the trainer's pass
    if not from_sampler and len(chunks) > 1:
        with torch.no_grad():                  # pi_old of chunks 2, 3, ... before any update
            later = torch.cat(chunks[1:])
            passed = torch.cat([logprobs(part) for part in micro_batches(later, rows)])
        old = passed.new_zeros(batch["completions"].shape)
        old[later] = passed
    logs = []
    for k, idx in enumerate(chunks):
        opt.zero_grad(set_to_none=True)
        seen, corrected, loss = [], [], 0.0
        for part in micro_batches(idx, rows):
            logp_new = logprobs(part)
            # chunk 1 in trainer mode: nothing has changed yet, its own pass is pi_old (s = 1)
            logp_old = logp_new.detach() if k == 0 and not from_sampler else old[part].to(logp_new.dtype)
            if shift is not None:             # the synthetic engine's record of the same tokens
                logp_old = logp_old - shift[part]
            adv, mask = batch["advantages"][part], batch["mask"][part] != 0
            dropped = 0
            if cfg.off_policy_mask is not None:           # DeepSeek-V3.2: drop drifted A < 0 responses
                kept = off_policy_sequence_mask(logp_new, logp_old, adv, mask, cfg.off_policy_mask)
                dropped, mask = (~kept & mask.any(-1)).sum().item(), mask & kept.unsqueeze(-1)
            weight = None
            if cfg.is_correction != "none":     # y came from the sampler: weigh it towards pi_old
                weight = correction_weight(logp_old, record[part], mask, cfg.is_correction, *is_bounds(cfg))
                corrected.append(((weight * mask).sum().item(), ((weight == 0) & mask).sum().item()))
            piece = loss_value(cfg.loss, logp_new, logp_old, adv, mask, *band(part), num_tokens,
                               aggregation=cfg.aggregation, max_tokens=cfg.max_new_tokens, weight=weight)
            if len(part) < len(idx) and row_share(cfg.loss, cfg.aggregation):
                piece = piece * (len(part) / len(idx))
            piece.backward()                  # gradients add up across the pieces of one chunk
            loss = loss + piece.detach()
            seen.append((logp_new.detach(), logp_old, adv, mask, dropped))
        norm = finite_grad_norm(model, loss, f"minibatch {k + 1} of {len(chunks)} of the next step")
        if cfg.grad_clip > 0:      # clip_grad_norm_ without computing the norm a second time
            torch.nn.utils.clip_grads_with_norm_(model.parameters(), cfg.grad_clip, norm)
        opt.step()
        logp_new, logp_old, adv, mask = (torch.cat(x) for x in list(zip(*seen))[:4])
        gap = {}
        if k == 0 and record is not None:   # the trainer's pass at theta_old, which ran anyway
            full, rec = batch["mask"][idx] != 0, record[idx] if shift is None else logp_old
            gap = dict(zip(("engine_gap_tokens", "engine_gap_seqs"), engine_gap(logp_new, rec, full)))
            if engine_differs(cfg):         # signed: the mean log s the sampler hands the update
                gap["engine_log_s_mean"] = sequence_log_ratio(logp_new, rec, full)[full.any(-1)].mean().item()
                gap.update(record_engine_gap(cfg, logp_new, rec, full, *band(idx)))   # --eps-engine's estimate
                if "engine_kl_tokens" in batch:      # train() measured it as the rollout ended
                    gap["engine_kl_tokens"] = batch["engine_kl_tokens"]
        if corrected:
            gap.update(is_weight_sum=sum(c[0] for c in corrected), n_is_zero=sum(c[1] for c in corrected))
        # a token can clip only off-policy (s = 1 in chunk 1 unless pi_old is the sampler's record)
        # and only with A != 0 (no flat group)
        could_clip = 0 if k == 0 and not from_sampler else (mask & (adv != 0).unsqueeze(-1)).sum().item()
        # off-policy: every chunk after the first, and the first too where pi_old is a record (a
        # synthetic one of gap 0 is the trainer's own pass: on-policy)
        on_policy = k == 0 and not from_sampler and (shift is None or not shift.any())
        n_off = 0 if on_policy else mask.sum().item()
        logs.append({**ratio_metrics(logp_new, logp_old, adv, mask, cfg.loss, *band(idx)),
                     "loss": loss.item(), "n_clip_ceiling": could_clip, "n_off_policy": n_off, "grad_norm": norm.item(),
                     "n_masked_seqs": sum(x[4] for x in seen), **gap})
    opt.zero_grad(set_to_none=True)         # the gradients' memory is free while the next rollout samples
    return summarise_minibatches(logs)





# ---------------------------------------------------------------------------------------------
# The lab's loop: gspo_minimal.train with the sampler as an engine (a copy in another dtype samples,
# and its KL to the trainer is measured) and --eval-at's extra evaluations.
# ---------------------------------------------------------------------------------------------
def eval_steps(cfg: Config) -> set[int]:
    """The RL steps that end with a validation evaluation and a checkpoint: every --eval-every'th and the
    last (as gspo_minimal.train), and each of --eval-at's (a comma-separated list, checked by `validate`)."""
    every = {step for step in range(1, cfg.steps + 1) if step % cfg.eval_every == 0} | {cfg.steps}
    return every | {int(v) for v in cfg.eval_at.split(",") if v.strip()}


def train(cfg: Config, model, tokenizer, device, run, stop) -> dict:
    """gspo_minimal.train, with the lab's task, sampler, rollout and update. Returns what summary.json holds."""
    task = task_of(cfg)                            # --task's problems, or the rows of --data
    splits = make_splits(task, cfg.test_size, cfg.val_size)
    rng = random.Random(cfg.seed)                  # training prompts; the held-out splits are fixed
    eps_low, eps_high = resolved_eps(cfg)
    summary = run.new_summary(cfg, eps_low, eps_high)
    engine = LlamaCppEngine(*engine_settings(cfg), threads=torch.get_num_threads()) if cfg.engine else None
    try:
        summary["warmup_steps"] = warmup(model, tokenizer, splits, cfg, device, rng, run, stop)
        if not stop.requested:                # after a Ctrl-C in the warm-up, straight to the end
            summary["accuracy_before_rl"] = accuracy(model, tokenizer, task, splits["test"], cfg.max_new_tokens, device)
            run.checkpoint(model, tokenizer)
            print(f"warm-up done after {summary['warmup_steps']} steps | "
                  f"test acc {summary['accuracy_before_rl']:.3f}", flush=True)
        opt, sched = rl_optimizer(model, cfg)
        evaluate_at = eval_steps(cfg)                   # every eval_every steps, --eval-at's, the last
        for step in range(1, cfg.steps + 1):
            if stop.requested:
                break
            t0 = time.perf_counter()
            # Rollout: the model as it is now is pi_old; it samples, or a copy in bfloat16 or float16
            # does (--sampler-dtype), or llama.cpp with its weights (--engine), as an inference engine would.
            problems = sample_train_problems(splits, cfg.prompts_per_step, rng)
            sampler = sampling_model(model, cfg, engine)
            batch = rollout(sampler, tokenizer, problems, cfg, device, seed=engine_seed(cfg.seed, step))
            if engine_differs(cfg) and not (cfg.record_noise or cfg.record_bins):   # a real engine's: KL
                batch["engine_kl_tokens"] = engine_kl_tokens(sampler, model, batch, cfg)
            del sampler
            m = rl_update(model, opt, batch, cfg, eps_low, eps_high)
            sched.step()
            if step in evaluate_at:
                m["val_acc"] = accuracy(model, tokenizer, task, splits["val"], cfg.max_new_tokens, device)
                run.checkpoint(model, tokenizer)
            n_tok, dt = int(batch["mask"].sum()), time.perf_counter() - t0
            m.update(reward=batch["rewards"].mean().item(),
                     flat_groups=flat_group_share(batch["rewards"], cfg.group_size),
                     response_tokens=n_tok / len(batch["rewards"]), tokens_per_second=n_tok / dt, step_seconds=dt)
            run.add_step(summary, step, n_tok, dt)
            run.log({"stage": "rl", "step": step, **m}, progress_line(step, cfg, m))
    except KeyboardInterrupt:
        pass
    except Diverged as err:
        summary["stop_reason"] = str(err)
    finally:
        if engine is not None:
            engine.close()
    opt = sched = None          # AdamW's two moments (twice the weights) are not needed to evaluate
    return run.finish(summary, model, tokenizer, stop,
                      lambda: accuracy(model, tokenizer, task, splits["test"], cfg.max_new_tokens, device))


def main(argv: list[str] | None = None) -> int:
    """gspo_minimal.main with the lab's flags, model and loop."""
    t_start = time.perf_counter()
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        cfg = parse_config(argv)
        device, model, tokenizer = prepare(cfg)
    except BadInput as err:
        print(f"gspo_lab.py: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("\ninterrupted before the run began: nothing was written", file=sys.stderr)
        return 130
    print(g.run_header(cfg, model, device, cfg.data or cfg.task, memory_note=False), flush=True)
    try:
        run = Run(cfg.out, t_start, command=" ".join(["python gspo_lab.py", *argv]))
    except RuntimeError as err:
        print(f"gspo_lab.py: error: {err}", file=sys.stderr)
        return 2
    with GracefulStop() as stop:
        try:
            summary = train(cfg, model, tokenizer, device, run, stop)
        finally:
            run.close()
    return run.exit_code(summary, "gspo_lab.py")


# --- A real engine: llama.cpp samples from a GGUF file of the trainer's weights ----------------------
# Only with the engine extra (requirements-engine.txt, `make test-engine`): llama-cpp-python, built here
# from its source package, and the gguf package, which writes the file. Nothing else imports them.
ENGINE_WEIGHTS = ("f32", "f16", "bf16", "q8_0")
ENGINE_KV = ("f16", "f32")
LLAMA_MAX_SEQS = 256          # llama.cpp's LLAMA_MAX_SEQ: a rollout samples in pieces of at most 256 rows
# One llama_decode takes a whole piece, which llama.cpp computes in micro-batches of at most this many
# tokens. Its attention buffer is micro-batch x KV cells per head: 256 rows of 130 tokens in one
# micro-batch would need over 20 GiB. A lab rollout (256 rows of about 10 tokens) fits in one.
LLAMA_UBATCH_MAX = 4096


def engine_modules():
    """(llama_cpp, gguf), or BadInput in one line naming the extra."""
    try:
        import gguf
        import llama_cpp
    except ImportError as err:
        raise BadInput(f"llama.cpp needs the engine extra ({err.name} is not installed): "
                       "`make test-engine` builds .venv-engine") from None
    return llama_cpp, gguf


def engine_settings(cfg: Config) -> tuple[str, str]:
    """--engine's (weights, KV cache): llama.cpp alone means f16 weights (`validate` has checked the text)."""
    return cfg.engine.partition(":")[2] or "f16", cfg.engine_kv


def engine_seed(seed: int, step: int) -> int:
    """llama.cpp's seed for the rollout of RL step `step` of a run of --seed `seed`, 32 bits: distinct
    for every pair with seed < 4096 and step < 2^20, so no two rollouts of a study share their draws."""
    return seed % 4096 * 2 ** 20 + step % 2 ** 20


def gguf_refusal(model) -> str:
    """Why `write_gguf` cannot write this model ('' where it can): it writes a plain Llama only."""
    cfg = model.config
    rope = getattr(cfg, "rope_parameters", None) or {"rope_type": "default"}
    if (cfg.model_type != "llama" or rope.get("rope_type", "default") != "default"
            or getattr(cfg, "attention_bias", False) or getattr(cfg, "mlp_bias", False)):
        return (f"llama.cpp's engine takes a plain Llama (the tiny model, SmolLM2), not this "
                f"{cfg.model_type} (the MoE, RoPE scaling and biases are not written)")
    return ""


def llama_cpp_layout(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """A q or k projection (out, in) from Hugging Face's RoPE layout (each head's two halves rotated
    together) to llama.cpp's (adjacent pairs): the permutation llama.cpp's own converter applies to Llama."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(model, path: str, weights: str = "f32") -> None:
    """A Llama causal LM (the tiny model, SmolLM2) as a GGUF file for llama.cpp, written with the gguf
    package: its weights at `weights` (f32, f16, bf16 or q8_0; the norms stay f32, as llama.cpp's
    converter keeps them), q and k in llama.cpp's RoPE layout, the vocabulary `none` (token ids as they
    are, `vocab_size` dummy tokens), the output matrix tied to the embedding where the model ties them."""
    _, gguf = engine_modules()
    why = gguf_refusal(model)
    if why:
        raise BadInput(why)
    cfg = model.config
    rope = getattr(cfg, "rope_parameters", None) or {"rope_type": "default", "rope_theta": cfg.rope_theta}
    kind = {"f32": gguf.GGMLQuantizationType.F32, "f16": gguf.GGMLQuantizationType.F16,
            "bf16": gguf.GGMLQuantizationType.BF16, "q8_0": gguf.GGMLQuantizationType.Q8_0}[weights]
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    out = gguf.GGUFWriter(path, "llama")
    out.add_context_length(cfg.max_position_embeddings)
    out.add_embedding_length(cfg.hidden_size)
    out.add_block_count(cfg.num_hidden_layers)
    out.add_feed_forward_length(cfg.intermediate_size)
    out.add_head_count(cfg.num_attention_heads)
    out.add_head_count_kv(cfg.num_key_value_heads)
    out.add_rope_dimension_count(head_dim)
    out.add_rope_freq_base(float(rope["rope_theta"]))
    out.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    out.add_vocab_size(cfg.vocab_size)
    out.add_tokenizer_model("none")
    state = {k: v.detach().float().cpu() for k, v in model.state_dict().items()}
    names = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight"}
    if not cfg.tie_word_embeddings:
        names["lm_head.weight"] = "output.weight"
    for i in range(cfg.num_hidden_layers):
        for hf, cpp in (("input_layernorm", "attn_norm"), ("self_attn.q_proj", "attn_q"),
                        ("self_attn.k_proj", "attn_k"), ("self_attn.v_proj", "attn_v"),
                        ("self_attn.o_proj", "attn_output"), ("post_attention_layernorm", "ffn_norm"),
                        ("mlp.gate_proj", "ffn_gate"), ("mlp.up_proj", "ffn_up"), ("mlp.down_proj", "ffn_down")):
            names[f"model.layers.{i}.{hf}.weight"] = f"blk.{i}.{cpp}.weight"
    for hf, cpp in names.items():
        w = state[hf]
        if cpp.endswith("attn_q.weight"):
            w = llama_cpp_layout(w, cfg.num_attention_heads)
        elif cpp.endswith("attn_k.weight"):
            w = llama_cpp_layout(w, cfg.num_key_value_heads)
        data = w.numpy()
        if w.dim() == 1 or kind == gguf.GGMLQuantizationType.F32:
            out.add_tensor(cpp, data)
        else:
            out.add_tensor(cpp, gguf.quants.quantize(data, kind), raw_dtype=kind)   # bytes: shape read back
    out.write_header_to_file()
    out.write_kv_data_to_file()
    out.write_tensors_to_file()
    out.close()


class LlamaCppEngine:
    """llama.cpp running the trainer's weights, as an inference engine beside a trainer. `sync(model)` writes
    them as GGUF (`write_gguf`) and loads that file, as a trainer syncs its engine before each rollout.
    `sample` draws the completions with llama.cpp's own sampler chain (temperature, then a seeded draw
    from the full distribution: no top-k, top-p, min-p or penalty) and records each token's log-prob from
    llama.cpp's logits, log_softmax(logits / T) in float32 (the trainer's convention). `logits` scores
    given completions. All rows go through llama.cpp's batch API together, one sequence each in one
    unified KV cache (`kv`: f16, llama.cpp's default, or f32); each prompt runs once per group and its
    cache is shared by the group's G sequences. Threads: `threads`, or one per core."""

    def __init__(self, weights: str = "f16", kv: str = "f16", threads: int = 0):
        if weights not in ENGINE_WEIGHTS or kv not in ENGINE_KV:
            raise BadInput(f"llama.cpp's weights are one of {', '.join(ENGINE_WEIGHTS)} and its KV cache "
                           f"f16 or f32, not {weights!r} and {kv!r}")
        self.lib, _ = engine_modules()
        self.weights, self.kv, self.threads = weights, kv, threads or (os.cpu_count() or 1)
        self.model = self.ctx = None
        self.folder = tempfile.mkdtemp(prefix="gspo-llama-cpp-")
        self._quiet = self.lib.llama_log_callback(lambda level, text, data: None)   # kept: C holds it
        self.lib.llama_log_set(self._quiet, None)
        self.lib.llama_backend_init()

    def sync(self, model) -> None:
        """The trainer's current weights into llama.cpp: a fresh GGUF file, loaded in place of the last."""
        self.close_model()
        path = os.path.join(self.folder, f"policy-{self.weights}.gguf")
        write_gguf(model, path, self.weights)
        params = self.lib.llama_model_default_params()
        self.model = self.lib.llama_model_load_from_file(path.encode(), params)
        if not self.model:
            raise BadInput(f"llama.cpp could not load the GGUF file written from this model ({path})")
        self.n_vocab = model.config.vocab_size

    def _context(self, cells: int, seqs: int):
        """A fresh context holding `cells` KV cells in one unified cache for `seqs` sequences, all of
        them decodable in one call (computed LLAMA_UBATCH_MAX tokens at a time)."""
        if self.ctx:
            self.lib.llama_free(self.ctx)
        p = self.lib.llama_context_default_params()
        p.n_ctx = p.n_batch = max(cells, 16)
        p.n_ubatch = min(p.n_batch, LLAMA_UBATCH_MAX)
        p.n_seq_max, p.kv_unified, p.n_threads, p.n_threads_batch = seqs, True, self.threads, self.threads
        p.type_k = p.type_v = {"f16": self.lib.GGML_TYPE_F16, "f32": self.lib.GGML_TYPE_F32}[self.kv]
        p.flash_attn_type = self.lib.LLAMA_FLASH_ATTN_TYPE_DISABLED
        self.ctx = self.lib.llama_init_from_model(self.model, p)
        if not self.ctx:
            raise RuntimeError(f"llama.cpp could not make a context of {cells} cells for {seqs} sequences")

    def _decode(self, tokens: list[tuple[int, int, int, bool]]) -> list[int]:
        """One llama_decode of (token, position, sequence, wants_logits) entries: the entries with logits."""
        batch = self.lib.llama_batch_init(len(tokens), 0, 1)
        try:
            for j, (tok, pos, seq, out) in enumerate(tokens):
                batch.token[j], batch.pos[j], batch.n_seq_id[j] = tok, pos, 1
                batch.seq_id[j][0], batch.logits[j] = seq, int(out)
            batch.n_tokens = len(tokens)
            if self.lib.llama_decode(self.ctx, batch) != 0:
                raise RuntimeError("llama_decode failed")
        finally:
            self.lib.llama_batch_free(batch)
        return [j for j, entry in enumerate(tokens) if entry[3]]

    def _row_logits(self, j: int) -> torch.Tensor:
        """The logits (V,) float32 of batch entry j of the last decode, copied out of llama.cpp."""
        import numpy as np
        return torch.from_numpy(np.ctypeslib.as_array(self.lib.llama_get_logits_ith(self.ctx, j),
                                                      shape=(self.n_vocab,)).copy())

    @staticmethod
    def _prompts(prompt_ids, prompt_mask) -> list[list[int]]:
        return [row[m].tolist() for row, m in zip(prompt_ids.cpu(), prompt_mask.cpu().bool())]

    @torch.no_grad()
    def sample(self, prompt_ids, prompt_mask, max_new_tokens: int, eos_id: int, pad_id: int, *,
               temperature: float = 1.0, group_size: int = 1, seed: int = 0, banned: int | None = None):
        """(completions (B, T), record (B, T)) as the lab's sampler returns them: pad, and a log-prob of 0,
        after each row's EOS; T the longest row; temperature 0 greedy. Rows come in groups of G prompts,
        sampled in pieces of whole groups of at most 256 rows, all from one seeded stream of draws.
        `banned`: a token never drawn (a logit bias of -inf first in the chain; the record renormalised
        without it), as make engine-llamacpp suppresses EOS to run text past its natural end."""
        G, B = group_size, len(prompt_ids)
        chain = self.lib.llama_sampler_chain_init(self.lib.llama_sampler_chain_default_params())
        if banned is not None:
            bias = (self.lib.llama_logit_bias * 1)()
            bias[0].token, bias[0].bias = banned, -float("inf")
            self.lib.llama_sampler_chain_add(chain, self.lib.llama_sampler_init_logit_bias(self.n_vocab, 1, bias))
        if temperature > 0:                          # logits / T, then one seeded draw from the softmax
            self.lib.llama_sampler_chain_add(chain, self.lib.llama_sampler_init_temp(temperature))
            draw = self.lib.llama_sampler_init_dist(seed % (2 ** 32 - 1))     # 2^32 - 1 would mean unseeded
            self.lib.llama_sampler_chain_add(chain, draw)
        else:
            self.lib.llama_sampler_chain_add(chain, self.lib.llama_sampler_init_greedy())
        step = max(G, LLAMA_MAX_SEQS // G * G)
        try:
            pieces = [self._sample_piece(chain, prompt_ids[i:i + step], prompt_mask[i:i + step], max_new_tokens,
                                         eos_id, pad_id, temperature, G, banned) for i in range(0, B, step)]
        finally:
            self.lib.llama_sampler_free(chain)
        T = max(c.shape[1] for c, _ in pieces)
        pad = lambda x, v: torch.nn.functional.pad(x, (0, T - x.shape[1]), value=v)
        return torch.cat([pad(c, pad_id) for c, _ in pieces]), torch.cat([pad(r, 0.0) for _, r in pieces])

    def _sample_piece(self, chain, prompt_ids, prompt_mask, max_new_tokens, eos_id, pad_id, temperature, G, banned):
        """`sample` for at most 256 rows: one context, each group's prompt decoded once."""
        B = len(prompt_ids)
        prompts = self._prompts(prompt_ids, prompt_mask)
        self._context(sum(len(p) for p in prompts[::G]) + B * max_new_tokens, B)
        # each group's prompt once, as sequence kG (its first row); the group's other rows share its cells
        outs = self._decode([(t, i, k * G, i == len(p) - 1) for k, p in enumerate(prompts[::G])
                             for i, t in enumerate(p)])
        memory = self.lib.llama_get_memory(self.ctx)
        for k in range(B // G):
            for r in range(1, G):
                self.lib.llama_memory_seq_cp(memory, k * G, k * G + r, -1, -1)
        at = [outs[b // G] for b in range(B)]        # each row's entry in the last decode: its logits
        tokens = torch.full((B, max_new_tokens), pad_id, dtype=torch.long)
        record = torch.zeros(B, max_new_tokens)
        live, T = list(range(B)), 0
        while live and T < max_new_tokens:
            for b in live:
                tok = self.lib.llama_sampler_sample(chain, self.ctx, at[b])
                logits = self._row_logits(at[b])                                 # (V,)
                if banned is not None:
                    logits[banned] = -float("inf")
                scaled = logits / temperature if temperature > 0 else logits
                tokens[b, T], record[b, T] = tok, torch.log_softmax(scaled, -1)[tok]
            live, T = [b for b in live if tokens[b, T] != eos_id], T + 1
            if live and T < max_new_tokens:
                at = dict(zip(live, self._decode([(int(tokens[b, T - 1]), len(prompts[b]) + T - 1, b, True)
                                                  for b in live])))
        return tokens[:, :T], record[:, :T]

    @torch.no_grad()
    def logits(self, prompt_ids, prompt_mask, completions) -> torch.Tensor:
        """The logits (B, T, V) that predict each completion token, as `completion_logits` gives the
        trainer's: one decode of every row's prompt and completion, each row a sequence of its own."""
        B, T = completions.shape
        if B > LLAMA_MAX_SEQS:
            return torch.cat([self.logits(prompt_ids[i:i + LLAMA_MAX_SEQS], prompt_mask[i:i + LLAMA_MAX_SEQS],
                                          completions[i:i + LLAMA_MAX_SEQS]) for i in range(0, B, LLAMA_MAX_SEQS)])
        prompts = self._prompts(prompt_ids, prompt_mask)
        self._context(sum(len(p) + T for p in prompts), B)
        rows = [p + completions[b, :-1].tolist() for b, p in enumerate(prompts)]
        outs = self._decode([(t, i, b, i >= len(prompts[b]) - 1) for b, row in enumerate(rows)
                             for i, t in enumerate(row)])
        return torch.stack([self._row_logits(j) for j in outs]).reshape(B, T, self.n_vocab)

    def close_model(self) -> None:
        if self.ctx:
            self.lib.llama_free(self.ctx)
        if self.model:
            self.lib.llama_model_free(self.model)
        self.model = self.ctx = None

    def close(self) -> None:
        """Frees llama.cpp's model and context and removes the GGUF file."""
        self.close_model()
        shutil.rmtree(self.folder, ignore_errors=True)


# --- The synthetic engine (--record-noise): a record of pi_old with a gap of known bias and noise --
RECORD_SEED_MIX = 0x9E3779B97F4A7C15      # its generator's seed is --seed XOR this: a stream of its own


def run_state(cfg: Config, name: str, make):
    """What a run keeps from step to step beside its model (the synthetic engine's generator, the
    calibrated band's sums): an attribute of `cfg` made by `make()` at first use; not a field, so
    dataclasses.asdict, and with it summary.json's config, leaves it out."""
    if name not in cfg.__dict__:
        cfg.__dict__[name] = make()
    return cfg.__dict__[name]


def record_noise_values(cfg: Config) -> tuple[float, float] | None:
    """--record-noise's (K, SIGMA), None without it (`validate` has checked the text)."""
    if not cfg.record_noise:
        return None
    k, sigma = (float(v) for v in cfg.record_noise.split(","))
    return k, sigma


def record_bins_values(cfg: Config) -> list[tuple[float, float, float]] | None:
    """--record-bins' (upper edge, mean, spread) per bin, None without it (`validate` has checked it)."""
    if not cfg.record_bins:
        return None
    return [tuple(float(v) for v in part.split(":")) for part in cfg.record_bins.split(",")]


def bin_gaps(z: torch.Tensor, logp: torch.Tensor, bins: list[tuple[float, float, float]]) -> torch.Tensor:
    """Standard normal draws z (B, T) made into gaps M_b + S_b z by the bin b of exp(logp), the
    trainer's probability of each token: bins [0, P1), [P1, P2), ..., the last closed at 1."""
    edges = torch.tensor([b[0] for b in bins[:-1]], dtype=torch.float64)
    means, spreads = (torch.tensor([b[k] for b in bins], dtype=torch.float32) for k in (1, 2))
    which = (logp.double().exp().unsqueeze(-1) >= edges).sum(-1)                  # (B, T) bin index
    return z * spreads[which] + means[which]


def synthetic_gap(mask: torch.Tensor, cfg: Config, logp: torch.Tensor | None = None) -> torch.Tensor | None:
    """The synthetic engine's gap d_t = log pi_old(y_t) - log record(y_t) at each token of a rollout,
    (B, T) float32, 0 after a row's EOS: independent draws of N(-K, SIGMA^2), K and SIGMA from
    --record-noise; or, with --record-bins, of N(M_b, S_b^2) by the bin of the token's probability
    under the trainer, read from `logp` (B, T), the float32 sampler's record of its own tokens, which
    is the trainer's pass to round-off; None without either flag. The draws come from a generator of
    the run's own (made at the first rollout, kept on `cfg`), so the rollout and every other random
    number are those of the run without the flag, and a zero gap (K = SIGMA = 0, or every bin's mean
    and spread 0) gives that run exactly. `rl_update` subtracts d_t from
    the trainer's pi_old; at theta = theta_old a response of n tokens then has log s = mean_t d_t,
    of mean -K and variance SIGMA^2 / n: tutorial section 12's model of an engine's gap, with a
    bias that length does not remove and a noise that it does."""
    values, bins = record_noise_values(cfg), record_bins_values(cfg)
    if values is None and bins is None:
        return None
    gen = run_state(cfg, "_record_generator", lambda: torch.Generator().manual_seed(cfg.seed ^ RECORD_SEED_MIX))
    z = torch.randn(mask.shape, generator=gen)                                  # (B, T), on the CPU
    d = z * values[1] - values[0] if bins is None else bin_gaps(z, logp.detach().cpu(), bins)
    return torch.where(mask.cpu() != 0, d, torch.zeros(())).to(mask.device)


# --- The calibrated band (--eps-engine Z): GSPO's band moved by the record's bias, widened by its noise --
# With an engine's record as pi_old, at theta = theta_old log s = -K + M/n (tutorial section 12): a
# bias -K that length leaves and a noise of standard deviation SIGMA / sqrt(n). The band on log s,
# [log(1 - eps_low), log(1 + eps_high)], becomes, for a response of n tokens,
#   [log(1 - eps_low) - K - Z SIGMA / sqrt(n),  log(1 + eps_high) - K + Z SIGMA / sqrt(n)],
# K and SIGMA estimated from the per-token gaps d_t = log pi_theta(y_t) - log record(y_t) of minibatch
# 1 (theta = theta_old there, so the gap is the engine's alone), pooled over the run's earlier steps.
# K-hat = SIGMA-hat^2 / 2, not -mean(d): for a small gap K = E[d^2]/2 to second order, and the
# variance's error is far smaller than the mean's (mechanism_calibration.json: 34x on add2's bf16
# record); a gap that breaks the relation (a nucleus's, or a synthetic one set otherwise) breaks the
# estimate too, so both estimates are logged (engine_k_hat, engine_k_hat_mean).
def engine_gap_state(cfg: Config) -> list[float]:
    """[tokens, sum of d, sum of d^2] over the run so far (`run_state`)."""
    return run_state(cfg, "_engine_gap", lambda: [0.0, 0.0, 0.0])


def gap_estimates(state: list[float]) -> tuple[float, float] | None:
    """(K-hat = SIGMA-hat^2 / 2, SIGMA-hat) from the pooled sums; None before two tokens."""
    n, total, squares = state
    if n < 2:
        return None
    var = max(squares - total * total / n, 0.0) / (n - 1)
    return var / 2, math.sqrt(var)


def calibrated_band(mask: torch.Tensor, cfg: Config, eps_low, eps_high):
    """--eps-engine's per-response (eps_low, eps_high), (B,) each, such that GSPO's clip(s, 1 -
    eps_low, 1 + eps_high) is the band above; the floats unchanged without the flag, before any
    estimate, or with a zero gap (then it is the paper's band exactly)."""
    est = gap_estimates(engine_gap_state(cfg)) if cfg.eps_engine is not None else None
    if est is None or est == (0.0, 0.0):
        return eps_low, eps_high
    k, sigma = est
    n = (mask != 0).sum(-1).clamp(min=1).double()                                   # (B,)
    half = cfg.eps_engine * sigma / n.sqrt()
    low = 1 - (1 - eps_low) * torch.exp(-k - half)
    high = (1 + eps_high) * torch.exp(-k + half) - 1
    return low.float(), high.float()


@torch.no_grad()
def record_engine_gap(cfg: Config, logp_trainer, logp_record, mask, eps_low, eps_high) -> dict:
    """Add minibatch 1's gaps to --eps-engine's pooled sums and return the step's metrics: the
    estimates the step's band used (`engine_k_hat`, `engine_k_hat_mean` = -mean d, `engine_sigma_hat`;
    absent at the first step) and the medians over responses of its band on log s: each edge
    (`engine_band_log_low`, `engine_band_log_high`) and its width (`engine_band_width`: the width
    at the median length, where the edges' medians may come from two responses). {} without the flag."""
    if cfg.eps_engine is None:
        return {}
    state = engine_gap_state(cfg)
    est, out = gap_estimates(state), {}
    if est is not None:
        out.update(engine_k_hat=est[0], engine_k_hat_mean=-state[1] / state[0], engine_sigma_hat=est[1])
    lo = torch.log1p(-torch.as_tensor(eps_low, dtype=torch.float64))
    hi = torch.log1p(torch.as_tensor(eps_high, dtype=torch.float64))
    out.update(engine_band_log_low=lo.median().item(), engine_band_log_high=hi.median().item(),
               engine_band_width=(hi - lo).median().item())
    d = (logp_trainer.double() - logp_record.double())[mask]
    state[0], state[1], state[2] = state[0] + d.numel(), state[1] + d.sum().item(), state[2] + (d * d).sum().item()
    return out


# --- FSPO's band (--fspo-band C): a band on the sequence log-ratio that scales as sqrt(|y|) ----------
# FSPO (Mao, Xiao, Pang and Liu, "Clip Your Sequences Fairly", arXiv 2509.09177) clips the sequence
# log importance ratio S = sum_t log(pi_theta(y_t) / pi_old(y_t)) = |y| log s within a band that scales
# as sqrt(|y|). As the lab reads it (centred on 0, widths C_LOW below and C_HIGH above):
#   S in [-C_LOW sqrt(|y|), C_HIGH sqrt(|y|)]   <=>   log s in [-C_LOW / sqrt(|y|), C_HIGH / sqrt(|y|)],
# the same responses clipped, so it is GSPO's clip(s, 1 - eps_low, 1 + eps_high) with per-response
#   eps_low = 1 - exp(-C_LOW / sqrt(|y|)),   eps_high = exp(C_HIGH / sqrt(|y|)) - 1.
# GSPO's band on log s is the same width at every length, while log s at theta_old spreads as 1/sqrt(|y|)
# once pi_old is an engine's record (tutorial section 12): a fixed band clips short responses more
# often. FSPO's band keeps the share clipped the same across lengths when S spreads as sqrt(|y|).
# What the lab takes from the paper and what it sets itself:
#   * the band's form, S within a band that scales as sqrt(L): the abstracts of v1 (September 2025)
#     and v3 (the latest) both say so; the method section was out of reach here, so no equation
#     number is cited and the form is checked only against the abstracts' words;
#   * the drift: the v1 abstract says the band "applies a KL-corrected drift term", v3's names none.
#     The lab follows v3: the band is centred on 0 (a centre moved by the record's bias is the
#     calibrated band's, --eps-engine);
#   * C: the paper's value was not read. The flag has no default; make figures-power sets it by a
#     rule fixed before its runs (studies/power.py's FSPO_RULE);
#   * the weight: the lab puts the band on GSPO's s and keeps GSPO's objective, so a run is GSPO with
#     FSPO's band; FSPO's own weighting of the clipped ratio was not read and is not implemented.
def fspo_constants(cfg: Config) -> tuple[float, float] | None:
    """(C_LOW, C_HIGH) from --fspo-band "C" or "C_LOW,C_HIGH"; None without the flag."""
    if not cfg.fspo_band:
        return None
    values = [float(v) for v in cfg.fspo_band.split(",")]
    return (values[0], values[0]) if len(values) == 1 else (values[0], values[1])


def fspo_band(mask: torch.Tensor, cfg: Config, eps_low, eps_high):
    """--fspo-band's per-response (eps_low, eps_high), (B,) each, such that GSPO's clip(s, 1 - eps_low,
    1 + eps_high) clips log s to [-C_LOW, C_HIGH] / sqrt(|y|); the floats unchanged without the flag."""
    c = fspo_constants(cfg)
    if c is None:
        return eps_low, eps_high
    root = (mask != 0).sum(-1).clamp(min=1).double().sqrt()                         # (B,)
    return (-torch.expm1(-c[0] / root)).float(), torch.expm1(c[1] / root).float()




# ---------------------------------------------------------------------------------------------
# The lab's command line: gspo_minimal's parser and checks, and the lab's flags' own.
# ---------------------------------------------------------------------------------------------
MICRO_BATCH_ABOVE = g.BIG_MODEL  # parameters: above, --micro-batch defaults to
MICRO_BATCH_TOKENS = 1024       # this many completion tokens per forward and backward pass
SAMPLE_TOKENS = 4096            # with a micro-batch, a rollout samples whole groups of at most this
                                # many rows x --max-new-tokens at a time (its KV cache bounded)
FLAG_RANGES = {**g.FLAG_RANGES, "micro_batch": (0, None, "rows per pass; 0: the whole minibatch"),
               "off_policy_mask": (0, None, "a rise in cross-entropy, in nats")}
OFF_SPELLING = {**g.OFF_SPELLING, "off_policy_mask": "; no mask is no --off-policy-mask"}


def settings_of(argv: list[str] | None = None) -> Config:
    """The settings a command line gives, unchecked: the flags given, over the task's own defaults
    (TASK_DEFAULTS), over the dataclass's."""
    given = g.given_flags(argv, Config)
    if "data" in given and "task" in given:
        raise BadInput("--task and --data exclude each other: the problems come from a built-in task "
                       "or from your file")
    return Config(**{**TASK_DEFAULTS.get(given.get("task", Config.task), {}), **given})


def parse_config(argv: list[str] | None = None) -> Config:
    """settings_of, checked (`validate`)."""
    cfg = settings_of(argv)
    validate(cfg)
    return cfg


def validate(cfg: Config) -> None:
    """gspo_minimal.validate for the lab's flags: BadInput for anything the run would choke on later,
    before a model is built or a file written. The checks of the algorithm's flags are gspo_minimal's
    (`check_rates_and_sizes`, `check_device_out_and_model`) or say the same (a test runs one table of
    bad input through both commands)."""
    if cfg.loss not in LOSSES:
        raise BadInput(f"unknown --loss {cfg.loss!r}; choose one of {', '.join(LOSSES)}")
    if cfg.task not in TASKS:
        raise BadInput(f"unknown --task {cfg.task!r}; choose one of {', '.join(TASKS)}")
    if cfg.reward not in g.REWARDS:
        raise BadInput(f"unknown --reward {cfg.reward!r}; choose one of {', '.join(g.REWARDS)}")
    if cfg.device not in ("auto", "cpu", "cuda"):
        raise BadInput(f"unknown --device {cfg.device!r}; choose auto, cpu or cuda")
    g.check_numbers(cfg, FLAG_RANGES, OFF_SPELLING)
    for name, default, eps in zip(("--eps-low", "--eps-high"), DEFAULT_EPS[cfg.loss], resolved_eps(cfg)):
        if default is None and eps is not None:
            raise BadInput(f"--loss {cfg.loss} has no {name} (tutorial section 10)")
        if eps is None:
            continue
        if cfg.loss == "gmpo" and not eps > 0:
            raise BadInput(f"{name} for gmpo is a log-space width and must be positive, got {eps}")
        if cfg.loss == "cispo" and not eps > 1:
            raise BadInput(f"--eps-high for cispo caps each token's weight and must exceed 1, got {eps}")
        if cfg.loss not in ("gmpo", "cispo") and not 0 < eps < 1:
            raise BadInput(f"{name} must lie in (0, 1), got {eps}")
    if cfg.aggregation not in AGGREGATIONS:
        raise BadInput(f"unknown --aggregation {cfg.aggregation!r}; choose one of {', '.join(AGGREGATIONS)}")
    if cfg.aggregation != "paper" and cfg.loss not in LOSS_FNS:
        raise BadInput(f"--aggregation is for gspo, gspo-token and grpo; --loss {cfg.loss} has its "
                       "own (tutorial section 10)")
    if cfg.sampler_dtype not in SAMPLER_DTYPES:
        raise BadInput(f"unknown --sampler-dtype {cfg.sampler_dtype!r}; choose one of {', '.join(SAMPLER_DTYPES)}")
    try:
        extra = [int(v) for v in cfg.eval_at.split(",") if v.strip()]
    except ValueError:
        raise BadInput(f"--eval-at takes RL steps separated by commas, e.g. 2,4; got {cfg.eval_at!r}") from None
    if any(not 1 <= v <= cfg.steps for v in extra):
        raise BadInput(f"--eval-at's steps must lie between 1 and --steps ({cfg.steps}), got {cfg.eval_at}")
    if cfg.old_logprobs not in ("trainer", "sampler"):
        raise BadInput(f"unknown --old-logprobs {cfg.old_logprobs!r}; choose trainer or sampler")
    if not 0 < cfg.top_p <= 1:
        raise BadInput(f"--top-p must lie in (0, 1] (1: off), got {cfg.top_p}")
    if cfg.is_correction not in IS_CORRECTIONS:
        raise BadInput(f"unknown --is-correction {cfg.is_correction!r}; choose one of {', '.join(IS_CORRECTIONS)}")
    if cfg.is_correction == "none" and (cfg.is_clip_max, cfg.is_clip_min) != (None, None):
        raise BadInput("--is-clip-max and --is-clip-min bound --is-correction's weight; set --is-correction too")
    if cfg.engine:
        name, _, weights = cfg.engine.partition(":")
        if name != "llama.cpp" or (weights and weights not in ENGINE_WEIGHTS):
            raise BadInput(f"--engine takes llama.cpp or llama.cpp:WEIGHTS, WEIGHTS one of "
                           f"{', '.join(ENGINE_WEIGHTS)}; got {cfg.engine!r}")
        if cfg.sampler_dtype != "float32":
            raise BadInput("--engine samples with llama.cpp, --sampler-dtype with a torch copy: give one")
        if cfg.top_p < 1:
            raise BadInput("--top-p is not taken with --engine: llama.cpp's nucleus is not the one its "
                           "record would be scored under (`nucleus_logprobs`)")
        if cfg.record_noise or cfg.record_bins:
            raise BadInput("--record-noise and --record-bins are a synthetic engine, --engine a real one: give one")
        if cfg.moe:
            raise BadInput("--engine takes a plain Llama: llama.cpp's GGUF file is not written for --moe")
    if cfg.engine_kv not in ENGINE_KV:
        raise BadInput(f"unknown --engine-kv {cfg.engine_kv!r}; choose f16 or f32")
    if cfg.engine_kv != "f16" and not cfg.engine:
        raise BadInput("--engine-kv sets llama.cpp's KV cache: set --engine too")
    if cfg.is_correction != "none":
        if cfg.sampler_dtype == "float32" and not cfg.engine:
            raise BadInput("--is-correction corrects a sampler that differs from the trainer; it needs "
                           "--sampler-dtype bfloat16 or float16, or --engine")
        if cfg.old_logprobs == "sampler":
            raise BadInput("--is-correction weighs the trainer's pi_old against the sampler's record; with "
                           "--old-logprobs sampler there is no trainer's pi_old: drop one")
        if cfg.loss not in LOSS_FNS:
            raise BadInput(f"--is-correction is for gspo, gspo-token and grpo, not --loss {cfg.loss}")
        low, high = is_bounds(cfg)
        if not (high is None or high > 0) or not (low is None or low >= 0) or (
                low is not None and high is not None and not low < high):
            raise BadInput(f"--is-clip-min and --is-clip-max must satisfy 0 <= min < max, got {low} and {high}")
    if cfg.record_noise:
        try:
            k, sigma = record_noise_values(cfg)
        except ValueError:
            raise BadInput(f"--record-noise takes K,SIGMA (two numbers, e.g. 1.2e-3,0.049), got "
                           f"{cfg.record_noise!r}") from None
        if not (math.isfinite(k) and math.isfinite(sigma) and k >= 0 and sigma >= 0):
            raise BadInput(f"--record-noise's K (a KL floor) and SIGMA must be finite and >= 0, got "
                           f"{cfg.record_noise}")
        if (cfg.sampler_dtype, cfg.top_p, cfg.old_logprobs, cfg.is_correction) != ("float32", 1.0, "trainer", "none"):
            raise BadInput("--record-noise shifts the trainer's own pi_old: it needs --sampler-dtype float32, "
                           "--top-p 1, --old-logprobs trainer and no --is-correction")
    if cfg.record_bins:
        try:
            bins = record_bins_values(cfg)
            ok = all(len(b) == 3 for b in bins)
        except ValueError:
            ok = False
        if not ok:
            raise BadInput(f"--record-bins takes EDGE:MEAN:SPREAD per bin, comma-separated, e.g. "
                           f"0.5:-3e-4:0.022,1:1e-5:7e-5; got {cfg.record_bins!r}")
        edges = [b[0] for b in bins]
        if not (all(math.isfinite(v) for b in bins for v in b) and all(b[2] >= 0 for b in bins)
                and all(0 < a < c for a, c in zip(edges, edges[1:])) and edges[-1] == 1 and edges[0] > 0):
            raise BadInput(f"--record-bins' edges must rise within (0, 1] and end at 1, its spreads be >= 0 "
                           f"and every number finite; got {cfg.record_bins}")
        if cfg.record_noise:
            raise BadInput("--record-bins and --record-noise are two synthetic engines: give one")
        if (cfg.sampler_dtype, cfg.top_p, cfg.old_logprobs, cfg.is_correction) != ("float32", 1.0, "trainer", "none"):
            raise BadInput("--record-bins shifts the trainer's own pi_old: it needs --sampler-dtype float32, "
                           "--top-p 1, --old-logprobs trainer and no --is-correction")
    if cfg.eps_engine is not None:
        if not (math.isfinite(cfg.eps_engine) and cfg.eps_engine >= 0):
            raise BadInput(f"--eps-engine (Z, the noise's width in standard deviations) must be a finite "
                           f"number >= 0, got {cfg.eps_engine}")
        if cfg.loss != "gspo":
            raise BadInput(f"--eps-engine calibrates GSPO's band on s; not for --loss {cfg.loss}")
        engine = cfg.old_logprobs == "sampler" and (cfg.sampler_dtype != "float32" or cfg.engine)
        if not (cfg.record_noise or cfg.record_bins or engine):
            raise BadInput("--eps-engine calibrates the band for an engine's record as pi_old: it needs "
                           "--old-logprobs sampler with a bf16 or fp16 sampler or --engine, or --record-noise")
    if cfg.fspo_band:
        try:
            c = fspo_constants(cfg)
            ok = len(cfg.fspo_band.split(",")) <= 2 and all(math.isfinite(v) and v > 0 for v in c)
        except ValueError:
            ok = False
        if not ok:
            raise BadInput(f"--fspo-band takes C or C_LOW,C_HIGH, each a finite number > 0 (a width on the "
                           f"sequence log-ratio per sqrt(token)), e.g. 0.03; got {cfg.fspo_band!r}")
        if cfg.loss != "gspo":
            raise BadInput(f"--fspo-band replaces GSPO's band on s; not for --loss {cfg.loss}")
        if cfg.eps_engine is not None or cfg.eps_low is not None or cfg.eps_high is not None:
            raise BadInput("--fspo-band replaces GSPO's band: drop --eps-engine, --eps-low and --eps-high")
    if cfg.scale_rewards not in ("group", "none"):
        raise BadInput(f"unknown --scale-rewards {cfg.scale_rewards!r}; choose group or none")
    if cfg.prompts_per_step * cfg.group_size > g.MAX_ROLLOUT:
        raise BadInput(f"--prompts-per-step x --group-size is {cfg.prompts_per_step * cfg.group_size} "
                       f"completions per rollout; at most {g.MAX_ROLLOUT}")
    g.check_rates_and_sizes(cfg, task_of(cfg))     # a --data file is read and checked here (`read_data`)
    if cfg.task == "add2-chat" and not cfg.model:
        raise BadInput("--task add2-chat asks in words: it needs a pretrained --model, not the "
                       "built-in character tokenizer")
    if cfg.moe and cfg.model:
        raise BadInput("--moe builds the built-in mixture-of-experts model; drop it or --model")
    if (cfg.sampler_dtype == "bfloat16" and g.pick_device(cfg).type == "cuda"
            and not torch.cuda.is_bf16_supported()):
        raise BadInput("--sampler-dtype bfloat16, but this CUDA device does not support bfloat16")
    if cfg.model.endswith(".gguf"):
        import importlib.util
        problem = g.local_model_problem(cfg.model)
        if problem:
            raise BadInput(f"--model {cfg.model}: {problem}")
        if importlib.util.find_spec("gguf") is None:
            raise BadInput(f"--model {cfg.model}: a .gguf file needs the gguf package "
                           "(pip install -r requirements-pretrained.txt)")
    g.check_device_out_and_model(cfg)
    if cfg.engine:
        engine_modules()                  # the extra is installed, or one line naming it


def prepare(cfg: Config):
    """gspo_minimal.prepare with the lab's task and models; then --micro-batch's default: 0 (one pass)
    under 20M parameters, else MICRO_BATCH_TOKENS // --max-new-tokens rows (big models' activations on
    long answers need it). A model --engine cannot write to GGUF gets BadInput here."""
    device, model, tokenizer = g.prepare(cfg, task_of(cfg), build)
    why = gguf_refusal(model) if cfg.engine else ""
    if why:
        raise BadInput(f"--engine: {why}")
    if cfg.micro_batch is None:
        big = sum(p.numel() for p in model.parameters()) > MICRO_BATCH_ABOVE
        cfg.micro_batch = max(1, MICRO_BATCH_TOKENS // cfg.max_new_tokens) if big else 0
    return device, model, tokenizer


if __name__ == "__main__":
    sys.exit(main())

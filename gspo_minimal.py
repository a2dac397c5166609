"""GSPO in one file: Group Sequence Policy Optimization, annotated, on a model that learns on a laptop CPU.

    python gspo_minimal.py                 # the default run (`make train`): 1.05M-parameter model, 2-digit addition
    python gspo_minimal.py --loss grpo     # the same run with GRPO's token-level objective
    python gspo_minimal.py --task addwork  # long answers (15-60 tokens): column working, then the sum
    python gspo_minimal.py --data f.jsonl  # your own problems: a JSONL file of prompts and answers
    python gspo_minimal.py --help          # every hyperparameter, with its meaning

Papers:
  GSPO            Zheng et al., "Group Sequence Policy Optimization", arXiv 2507.18071 (v2).
  Rethinking GSPO Chi Liu, "Rethinking GSPO: The Perplexity-Entropy Equivalence", arXiv 2510.23142.

The one idea. GSPO weights every sampled response y by the length-normalised sequence ratio

    s = (pi_new(y|x) / pi_old(y|x)) ** (1/|y|)                                  (GSPO eq. 7)

Written with the per-token cross-entropy of the sampled response, H(y) = -(1/|y|) sum_t log pi(y_t|x,y_<t),
and its perplexity PPL = exp(H), the same number is

    s = PPL_old(y) / PPL_new(y) = exp(H_old(y) - H_new(y))

so GSPO scales the policy gradient by how much LESS perplexed the new policy is by the response.
`importance_ratio` computes the first form, `perplexity` and `cross_entropy` the pieces of the other two,
and `form_gap` all three side by side: every training step logs their largest disagreement to
metrics.jsonl (`form_gap`, round-off only).

Reading order, which is the file's order: hyperparameters -> task and reward -> tokenizer -> model ->
sampling -> group advantages -> token log-probs -> the ratio identities -> the objectives (GSPO,
GSPO-token, GRPO) -> their relatives (GMPO, SAPO, CISPO, LUSPO, VESPO, the off-policy sequence
mask) -> batches and evaluation -> warm-up -> one GSPO step (rollout, minibatch updates)
-> the training loop, `train()`, in one place -> main(). Below main() sits the plumbing, behind a
banner: the run folder, Ctrl-C, the command line, reading a --data file. The functions from
`group_advantages` to `off_policy_sequence_mask` need only torch and each other: copy them into
your own trainer as they are.

Honest list of simplifications (each is named again where it happens):
  * The model is tiny (4 layers, width 128) and the task is synthetic arithmetic with an exact-match
    reward, so that a full run fits in four minutes on two CPU cores. `--model` swaps in any Hugging
    Face causal LM.
  * A short supervised warm-up comes first: RL learns only from groups that contain some successes,
    and a random model has none.
  * No KL penalty and no reference model. The GSPO paper omits the KL term "for brevity" and
    says nothing of its runs' KL; leaving it out is its first author's advice for GSPO in verl.
  * One optimiser step per minibatch, 4 minibatches per rollout (the paper's setting), so that
    all but the first update are off-policy: that is where GSPO and GRPO differ at all.
  * The advantage's std gets a small eps (1e-6, as verl); the paper leaves the convention open.
  * Sampling uses a hand-written KV-cached loop, not `model.generate` (as fast row for row, and
    faster with each prompt run once per group; results.md, "Speed and memory", times both).
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import copy
import dataclasses
import functools
import inspect
import json
import math
import os
import random
import re
import shutil
import signal
import sys
import tempfile
import textwrap
import time
import typing
import weakref
from dataclasses import dataclass

import torch


# ---------------------------------------------------------------------------------------------
# Hyperparameters. The string under each field is its --help text (the command line at the end).
# ---------------------------------------------------------------------------------------------
@dataclass
class Config:
    loss: str = "gspo"
    """objective: gspo (sequence ratio, eq. 5), gspo-token (eqs. 13-14) or grpo (token ratio, eq. 2);
    or a relative of GSPO: gmpo, sapo, sapo-seq, cispo, luspo, vespo (tutorial section 10)"""
    task: str = "add2"
    """problems: add2 (a+b, a,b < 100), add3 (a+b, a,b < 1000), mul2 (a*b, a,b < 100), addwork (a+b
    with 2 to 6 digits each, answered with its column working and then the sum: long answers; its
    own defaults for --max-new-tokens, --steps and the warm-up, see TASK_DEFAULTS), or add2-chat
    (add2's problems asked as 'a + b = ?' of a chat model, needs --model; reward on the last number).
    Exclusive with --data"""
    data: str = ""
    """your own problems instead of --task: a JSONL file, one object a line with string fields
    'prompt' and 'answer'. --test-size and --val-size rows are held out by a seeded split, never
    trained on; the built-in model's warm-up learns to write the answers (then every character must
    be one it has: digits, + * = |)"""
    reward: str = "exact"
    """reward of --data: exact (the stripped completion is the answer) or last-number (the last
    number in it is; the answers must be integers); EOS required either way"""
    model: str = ""
    """Hugging Face causal LM with its tokenizer: a hub id, a local folder or a .gguf file (dequantised
    to float32; needs the gguf package); empty: the built-in tiny model"""
    no_chat_template: bool = False
    """write prompts as plain text even when the tokenizer has a chat template"""
    moe: bool = False
    """use a tiny mixture-of-experts model (transformers' Mixtral classes) instead of the dense one"""
    device: str = "auto"
    """auto (CUDA when available, else CPU), cpu or cuda"""
    seed: int = 0
    """seed for model initialisation, sampling and the training prompts (the test set is fixed);
    0 to 2**64 - 1"""
    group_size: int = 8
    """G: completions sampled per prompt; advantages are normalised within each group"""
    prompts_per_step: int = 32
    """prompts per rollout; a rollout holds prompts_per_step * group_size completions"""
    minibatches: int = 4
    """optimiser steps per rollout; every one after the first is off-policy"""
    micro_batch: int | None = None
    """rows per forward and backward pass inside a minibatch, their gradients added up before its one
    optimiser step: the same update at the memory of this many rows, a little slower (a multiple of
    --group-size keeps each prompt run once per group; 0: one pass). Default: 0 under 20M parameters
    (the built-in models), else 1024 // --max-new-tokens rows, at least 1. With a micro-batch,
    rollouts are sampled at most 4096 // --max-new-tokens rows (whole groups) at a time"""
    gradient_checkpointing: bool = False
    """recompute each layer's activations during the backward pass instead of keeping them (Hugging
    Face models): less memory for more time; the update then runs one full pass per row"""
    eps_low: float | None = None
    """lower clip width: clip(s, 1 - eps_low, ...); default 3e-4 for GSPO variants and LUSPO, 0.2 for
    GRPO; GMPO's is in log space (default 0.4); CISPO, SAPO and VESPO have none"""
    eps_high: float | None = None
    """upper clip width: clip(s, ..., 1 + eps_high); default 4e-4 for GSPO variants and LUSPO, 0.27
    for GRPO; GMPO's is in log space (0.4); for CISPO the cap on each token's weight (5.0, above 1)"""
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
    lr: float = 2e-4
    """AdamW learning rate of the RL stage, decayed linearly to 0 over --steps"""
    steps: int = 500
    """RL steps (one rollout and its minibatch updates each)"""
    max_new_tokens: int = 6
    """longest completion sampled; a completion without EOS by then gets reward 0"""
    temperature: float = 1.0
    """sampling temperature, 0.01 to 100; the policy's log-probs use logits / temperature, so s = 1
    on-policy"""
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
    eps_engine: float | None = None
    """calibrated band, Z: GSPO's band on log s moved by the record's bias -K and widened by Z SIGMA /
    sqrt(|y|), K and SIGMA estimated from minibatch 1's gaps of the earlier steps (`calibrated_band`)"""
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
    out: str = "runs/train"
    """output folder: metrics.jsonl, summary.json and checkpoint/ (Hugging Face format); the run
    writes <out>.incomplete until its first checkpoint, holds <out>.lock while it lives (a second
    run at the same --out is refused), and never touches what it did not write"""
    shuffle_rewards: bool = False
    """control experiment: permute rewards across the rollout, destroying the signal"""
    warmup_lr: float = 1e-3
    """AdamW learning rate of the supervised warm-up"""
    warmup_target: float = 0.3
    """the warm-up stops once validation accuracy first reaches this (0 to 1)"""
    warmup_max_steps: int = 3000
    """the warm-up stops after this many steps even below warmup_target"""
    warmup_batch: int = 256
    """problems per warm-up step"""
    eval_every: int = 10
    """RL steps between validation evaluations (the warm-up checks every 20 steps)"""
    eval_at: str = ""
    """further RL steps to evaluate at, comma-separated (e.g. 2,4: an early collapse can be dated)"""
    val_size: int = 300
    """validation problems: they drive every decision"""
    test_size: int = 500
    """test problems: used only for the two accuracies in summary.json"""
    grad_clip: float = 1.0
    """clip the gradient norm at this value (0: off)"""
    threads: int = 0
    """CPU threads for torch (0: torch's default; at most 4 per core)"""


LOSSES = ("gspo", "gspo-token", "grpo", "gmpo", "sapo", "sapo-seq", "cispo", "luspo", "vespo")
AGGREGATIONS = ("paper", "dapo", "dr_grpo")
TASKS = ("add2", "add3", "mul2", "addwork", "add2-chat")
REWARDS = ("exact", "last-number")      # --data's
SAMPLER_DTYPES = ("float32", "bfloat16", "float16")
IS_CORRECTIONS = ("none", "token_truncate", "token_mask", "sequence_truncate", "sequence_mask",
                  "sequence_geometric_mask")
# addwork's answers are 15 to 60 tokens instead of 2 to 4: room to write them; a smaller warm-up
# batch at a higher rate (results.md, "Notes on the runs", lists the settings tried), stopped a
# little later, at 0.4, so that fewer groups start flat; 60 RL steps, validated every 5, so that one
# run fits in ten minutes on two CPU cores. A flag given on the command line wins over these.
TASK_DEFAULTS = {"addwork": {"max_new_tokens": 64, "steps": 60, "eval_every": 5, "warmup_batch": 64,
                             "warmup_lr": 2e-3, "warmup_target": 0.4}}
DEFAULT_EPS = {"gspo": (3e-4, 4e-4), "gspo-token": (3e-4, 4e-4), "grpo": (0.2, 0.27),
               "gmpo": (0.4, 0.4), "luspo": (3e-4, 4e-4), "cispo": (None, 5.0),
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
# Task and reward: arithmetic problems, split into test / validation / training by their operands;
# or the rows of a file of your own (--data), split the same way.
# ---------------------------------------------------------------------------------------------
DATA_SEED = 1234  # fixed: every run, whatever its --seed, is scored on the same test problems


@dataclass(frozen=True)
class DataTask:
    """--data: a file's rows as the problems. A row is the pair (prompt, answer), as an arithmetic
    problem is the pair (a, b), so the functions below that draw, split, ask and score problems serve
    both. `read_data` (after main) reads the file and checks it."""
    path: str
    reward: str                                          # "exact" or "last-number" (REWARDS)
    rows: tuple[tuple[str, str], ...] = dataclasses.field(repr=False)


def task_of(cfg: Config) -> str | DataTask:
    """What a run's problems come from: --task's name, or the rows of --data (read once per process,
    so they never change under a run)."""
    return read_data(cfg.data, cfg.reward) if cfg.data else cfg.task


def task_spec(task: str) -> tuple[int, str]:
    """Operand range (operands lie below it) and operator of a task."""
    return {"add2": (100, "+"), "add3": (1000, "+"), "mul2": (100, "*"), "addwork": (10 ** 6, "+"),
            "add2-chat": (100, "+")}[task]


def draw_problem(task: str | DataTask, rng: random.Random) -> tuple:
    """One problem (a, b). addwork draws each operand's number of digits first, 2 to 6 uniformly,
    so that short and long answers are equally common; the other tasks draw a and b uniformly, and
    a file one of its rows."""
    if isinstance(task, DataTask):
        return rng.choice(task.rows)
    if task == "addwork":
        return tuple(rng.randrange(10 ** (d - 1), 10 ** d) for d in (rng.randint(2, 6), rng.randint(2, 6)))
    n, _ = task_spec(task)
    return rng.randrange(n), rng.randrange(n)


def problem_count(task: str | DataTask) -> int:
    """How many distinct problems a task has (a file: its rows, no prompt twice)."""
    if isinstance(task, DataTask):
        return len(task.rows)
    n, _ = task_spec(task)
    return (n - 10) ** 2 if task == "addwork" else n * n        # addwork: no operand below 10


def held_out_room(task: str | DataTask) -> int:
    """The most problems the test and validation sets may take together: half of a built-in task's
    (training finds the rest by redrawing, which must stay quick), a file's rows but one to train on."""
    n = problem_count(task)
    return n - 1 if isinstance(task, DataTask) else n // 2


def make_splits(task: str | DataTask, test_size: int, val_size: int) -> dict:
    """The fixed test set first, then validation; training later samples only from the rest.

    A problem is its ordered operand pair (a, b), so 3+4 and 4+3 are different problems; a file's
    problem is its row, so the split depends on the rows' order, not on the run's --seed.
    """
    if test_size + val_size > held_out_room(task):
        raise ValueError(f"{task} has {problem_count(task)} problems: too few for "
                         f"{test_size + val_size} held out")
    rng = random.Random(DATA_SEED)
    held: dict[tuple[int, int], None] = {}         # a dict keeps the order in which pairs were drawn
    while len(held) < test_size + val_size:
        held[draw_problem(task, rng)] = None
    pairs = list(held)
    return {"test": pairs[:test_size], "val": pairs[test_size:], "held_out": set(pairs)}


def sample_train_problems(splits: dict, task: str | DataTask, k: int, rng: random.Random) -> list[tuple]:
    """k training problems drawn as the held-out ones were, from outside the test and validation sets."""
    out: list[tuple] = []
    while len(out) < k:
        pair = draw_problem(task, rng)
        if pair not in splits["held_out"]:
            out.append(pair)
    return out


def prompt_text(task: str | DataTask, a, b) -> str:
    """'07+45=': operands zero-padded, so every prompt of a task has the same length.
    add2-chat asks a chat model in words its tokenizer knows: '7 + 45 = ?'. A file's row (a, b)
    is (prompt, answer): its prompt as written."""
    if isinstance(task, DataTask):
        return a
    if task == "add2-chat":
        return f"{a} + {b} = ?"
    n, op = task_spec(task)
    width = len(str(n - 1))
    return f"{a:0{width}d}{op}{b:0{width}d}="


def answer_text(task: str | DataTask, a, b) -> str:
    """The result the reward checks: '52' for 07+45=; a file row's answer."""
    if isinstance(task, DataTask):
        return b
    return str(a * b if task_spec(task)[1] == "*" else a + b)


def solution_text(task: str | DataTask, a, b) -> str:
    """What the warm-up teaches the model to write. For addwork, the column working, least
    significant column first, each column 'x+y=z' with '+1' for a carry, then the result:
    4581+77= -> '1+7=8|8+7=15|5+0+1=6|4+0=4|4658' (15 to 60 tokens with EOS, like a reasoning trace:
    work first, answer last). For every other task, the answer alone (a file's 'answer' field)."""
    if task != "addwork":
        return answer_text(task, a, b)
    xs, ys = str(a)[::-1], str(b)[::-1]
    columns, carry = [], 0
    for i in range(max(len(xs), len(ys))):
        x, y = int(xs[i]) if i < len(xs) else 0, int(ys[i]) if i < len(ys) else 0
        z = x + y + carry
        columns.append(f"{x}+{y}{'+1' if carry else ''}={z}")
        carry = z // 10
    return "|".join(columns + [str(a + b)])


def reward(completion_ids: list[int], answer: str, tokenizer, *, task: str | DataTask = "add2") -> float:
    """1.0 when the text before the first EOS is the answer, else 0.0.

    A completion that never stops gets 0, so the policy learns to end its answers. addwork scores
    the result after the last '|' only: the working is never checked, as a reasoning trace's is
    not (a bare result, no working at all, also scores). add2-chat scores a chat model's sentence
    ('7 + 45 = 52.') by the last number in it, the usual reading of a pretrained model's answer;
    every other task wants the answer and nothing else. A file is scored as its --reward says:
    exact as add2, last-number as add2-chat.
    """
    eos = tokenizer.eos_token_id
    if eos not in completion_ids:
        return 0.0
    text = tokenizer.decode(completion_ids[:completion_ids.index(eos)], skip_special_tokens=True)
    if task == "add2-chat" or (isinstance(task, DataTask) and task.reward == "last-number"):
        numbers = re.findall(r"-?\d+", text.replace(",", ""))
        return float(bool(numbers) and numbers[-1] == answer)
    if task == "addwork":
        text = text.rsplit("|", 1)[-1]
    return float(text.strip() == answer)


# ---------------------------------------------------------------------------------------------
# Tokenizer: one token per character, built with `tokenizers`, saved with every checkpoint.
# ---------------------------------------------------------------------------------------------
def tiny_characters(task: str | DataTask) -> str:
    """The characters the built-in tokenizer has a token for: the digits, '+', '*', '='; '|', the
    separator of addwork's working, for addwork and a file only (so the other tasks' models stay as
    they were)."""
    return "0123456789+*=" + ("|" if task == "addwork" or isinstance(task, DataTask) else "")


def build_char_tokenizer(task: str | DataTask = "add2"):
    """16 tokens: <pad>, <eos>, <unk> and the 13 `tiny_characters` (17 with '|'). pad != eos on
    purpose: a mask built from `tokens != pad` would otherwise drop the EOS and the model would
    never learn to stop."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<pad>", "<eos>", "<unk>"]
    chars = tiny_characters(task)
    vocab = {tok: i for i, tok in enumerate(specials + list(chars))}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")  # every character
    tok.decoder = decoders.Fuse()                                              # join without spaces
    tok.add_special_tokens(specials)
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>",
                                   unk_token="<unk>", padding_side="left")


# ---------------------------------------------------------------------------------------------
# Model: a tiny Llama (or Mixtral for --moe) built from a config, no download; or any hub model.
# ---------------------------------------------------------------------------------------------
def build_tiny_model(tokenizer, moe: bool = False, positions: int = 64):
    """1.05M parameters dense; 1.84M with --moe (4 experts, 2 active per token). `positions`: room
    for the longest prompt + completion (RoPE: no parameter depends on it)."""
    from transformers import LlamaConfig, LlamaForCausalLM, MixtralConfig, MixtralForCausalLM

    common = dict(vocab_size=len(tokenizer), hidden_size=128, num_hidden_layers=4,
                  num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=positions,
                  pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
                  bos_token_id=None, tie_word_embeddings=True)
    if moe:  # router aux loss off: the objective stays pure GSPO, as in the comparison we measure
        cfg = MixtralConfig(intermediate_size=256, num_local_experts=4, num_experts_per_tok=2,
                            router_aux_loss_coef=0.0, output_router_logits=False, **common)
        return MixtralForCausalLM(cfg)
    return LlamaForCausalLM(LlamaConfig(intermediate_size=512, **common))


def load_pretrained(name_or_path: str):
    """Any causal LM with its tokenizer: a hub id, a folder, or one .gguf file (transformers
    dequantises its weights to float32). Left padding, so that every prompt ends at the same column."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    where = {}
    if name_or_path.endswith(".gguf"):
        name_or_path, where["gguf_file"] = os.path.split(os.path.abspath(name_or_path))
    tokenizer = AutoTokenizer.from_pretrained(name_or_path, **where)
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:              # the completion mask comes from the first EOS, so
        tokenizer.pad_token = tokenizer.eos_token  # pad == eos is harmless here (see completion_mask)
    model = AutoModelForCausalLM.from_pretrained(name_or_path, dtype=torch.float32, **where)
    if where:       # the GGUF weights are now plain float32 tensors: let checkpoints save them as such
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
    return model, tokenizer


def build(cfg: Config, device):
    """Model and tokenizer: `--model` (a hub id, local folder or .gguf file), or the tiny built-in
    one. The built-in model's weights come from torch's global seed (set by the caller)."""
    if cfg.model:
        model, tokenizer = load_pretrained(cfg.model)
        if cfg.no_chat_template:          # encode_prompts then writes prompts as plain text
            tokenizer.chat_template = None
    else:
        task = task_of(cfg)
        tokenizer = build_char_tokenizer(task)
        prompts = [p for p, _ in task.rows] if isinstance(task, DataTask) else [prompt_text(task, 0, 0)]
        longest = max(map(len, prompts)) + cfg.max_new_tokens              # a token per character
        model = build_tiny_model(tokenizer, moe=cfg.moe,   # 64 positions, or the next power of 2 up
                                 positions=max(64, 1 << (longest - 1).bit_length()))
    if cfg.gradient_checkpointing:     # its layers recompute only in training mode (dropout 0 here)
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        model.train()
    return model.to(device), tokenizer


# ---------------------------------------------------------------------------------------------
# Sampling: G completions per prompt with a KV cache; the completion mask from the first EOS.
# ---------------------------------------------------------------------------------------------
def completion_mask(completions: torch.Tensor, eos_id: int) -> torch.Tensor:
    """True up to and including the first EOS of each row; all True for a row that never stops.

    completions: (B, T) int -> (B, T) bool. Built from EOS positions, never from `!= pad`.
    """
    is_eos = completions == eos_id
    eos_before = (is_eos.cumsum(-1) - is_eos.long()) > 0   # an EOS strictly earlier in the row
    return ~eos_before


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
    ends when every row has stopped.
    """
    from transformers import DynamicCache

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
    cache = DynamicCache(config=model.config)
    attn = prompt_mask.long()                                  # (B, P), 0 on left padding
    pos = (attn.cumsum(-1) - 1).clamp(min=0)                   # (B, P), positions skip the padding
    logits = model(input_ids=prompt_ids[::G], attention_mask=attn[::G], position_ids=pos[::G],
                   cache=cache, use_cache=True, logits_to_keep=1).logits[:, -1]   # (B/G, V)
    logits = logits.repeat_interleave(G, dim=0)                # (B, V)
    cache.batch_repeat_interleave(G)                           # every cached tensor: B/G -> B rows
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
# Group advantages (GSPO eq. 6): each response against the other responses to the same prompt.
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


# ---------------------------------------------------------------------------------------------
# Token log-probs and the masked mean that every sequence-level quantity is built from.
# ---------------------------------------------------------------------------------------------
# log pi(y_t | x, y_<t) = log_softmax(logits_t)[y_t]
def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, *,
                   chunk_elements: int = 2 ** 22) -> torch.Tensor:
    """logits (B, T, V), tokens (B, T) -> (B, T) log-probabilities of the given tokens.

    At least float32: a log-softmax in bf16 would round log-probs to ~0.01 nats, far coarser than
    GSPO's clip band of 3e-4 nats per token; float64 inputs stay float64. The log-softmax runs on
    chunks of positions of at most `chunk_elements` logits each, so a real vocabulary never needs a
    float32 copy of the whole (B, T, V) tensor: each position's log-softmax depends on its own V
    logits only, so the result is bit for bit the one-shot formula's (test_token_logprobs_...).
    Under autograd each chunk's log-softmax keeps its output for the backward pass, as the one-shot
    formula does.
    """
    B, T, V = logits.shape
    dtype = torch.promote_types(logits.dtype, torch.float32)
    flat, idx = logits.reshape(B * T, V), tokens.reshape(B * T, 1).long()     # (B*T, V), (B*T, 1)
    rows = max(1, chunk_elements // max(V, 1))                                  # positions per chunk
    # written into one preallocated tensor: a list of small results between the large temporaries
    # would fragment the heap until it held the whole (B, T, V) after all
    out = torch.empty(B * T, 1, dtype=dtype, device=logits.device)            # (B*T, 1)
    for start in range(0, B * T, rows):
        part = slice(start, start + rows)
        out[part] = torch.log_softmax(flat[part].to(dtype), dim=-1).gather(-1, idx[part])
    return out.reshape(B, T)


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Mean of x over positions where mask is true; an empty row gives 0.

    `torch.where`, never `x * mask`: a NaN or inf at a masked position would survive the
    multiplication (0 * inf = NaN) and poison both the value and the gradient.
    """
    keep = mask != 0                                           # bool, 0/1 int or 0/1 float masks alike
    total = torch.where(keep, x, torch.zeros((), dtype=x.dtype, device=x.device)).sum(dim)
    return total / keep.sum(dim).clamp(min=1).to(x.dtype)


# ---------------------------------------------------------------------------------------------
# The ratio identities. With delta_t = log pi_new(y_t) - log pi_old(y_t):
#   log s = (1/|y|) sum_t delta_t = H_old(y) - H_new(y)        (a mean of per-token log-ratios)
#   s = exp(log s) = PPL_old(y) / PPL_new(y) = exp(H_old - H_new)
# Everything stays in log space: a product of |y| token probabilities underflows for long y.
# ---------------------------------------------------------------------------------------------
def sequence_log_ratio(logp_new, logp_old, mask) -> torch.Tensor:
    """log s_i = (1/|y_i|) sum_t (logp_new - logp_old): (B, T) inputs -> (B,)."""
    return masked_mean(logp_new - logp_old, mask)


# s_i = (pi_new(y_i|x) / pi_old(y_i|x)) ** (1/|y_i|)                                (GSPO eq. 7)
def importance_ratio(logp_new, logp_old, mask) -> torch.Tensor:
    """The sequence importance ratio s (B,): the geometric mean of the token ratios."""
    return torch.exp(sequence_log_ratio(logp_new, logp_old, mask))


# H(y) = -(1/|y|) sum_t log pi(y_t | x, y_<t)
def cross_entropy(logp, mask) -> torch.Tensor:
    """Per-token cross-entropy of the SAMPLED sequence (B,), in nats.

    Not the Shannon entropy -sum_v p(v) log p(v) of the policy: it scores the one response that
    was sampled, which is exactly what the importance ratio needs.
    """
    return -masked_mean(logp, mask)


# PPL(y) = exp(H(y)) = pi(y|x) ** (-1/|y|)
def perplexity(logp, mask) -> torch.Tensor:
    """Perplexity of the sampled sequence (B,); +inf once exp(H) leaves the dtype's range."""
    return torch.exp(cross_entropy(logp, mask))


# gap_i = max(|(PPL_old/PPL_new) / s - 1|, |exp(H_old - H_new) / s - 1|)
def form_gap(logp_new, logp_old, mask) -> torch.Tensor:
    """How far the three forms of s disagree, per row (B,): the largest relative gap of the
    perplexity form and the cross-entropy form from `importance_ratio`.

    Equal in exact arithmetic, so this is pure round-off: about 1e-7 in float32, 1e-16 in float64,
    growing with |H| and |y|. Training logs its maximum every step. The perplexity form is computed
    as written, so a row whose PPL overflows (H > 88.7 nats per token in float32) gives NaN.
    """
    s = importance_ratio(logp_new, logp_old, mask)                          # (B,)
    s_ppl = perplexity(logp_old, mask) / perplexity(logp_new, mask)          # PPL_old / PPL_new
    s_ent = torch.exp(cross_entropy(logp_old, mask) - cross_entropy(logp_new, mask))
    return torch.maximum((s_ppl / s - 1).abs(), (s_ent / s - 1).abs())


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
# The objectives. Each returns a loss to MINIMISE (the paper's J with its sign flipped).
# PPO's clipped surrogate min(r A, clip(r, 1-eps_low, 1+eps_high) A) stops the gradient only on the
# side that would profit from moving further: r > 1+eps_high when A > 0, r < 1-eps_low when A < 0.
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


def _clipped_surrogate(ratio, adv, eps_low: float, eps_high: float) -> torch.Tensor:
    """min(r A, clip(r, 1-eps_low, 1+eps_high) A), elementwise; r and A broadcast together."""
    return torch.minimum(ratio * adv, ratio.clamp(1 - eps_low, 1 + eps_high) * adv)


def clipped_on_active_side(ratio, adv, eps_low: float, eps_high: float) -> torch.Tensor:
    """Where the min picks the clipped term and so the gradient is zero (bool, broadcast shape)."""
    return ((adv > 0) & (ratio > 1 + eps_high)) | ((adv < 0) & (ratio < 1 - eps_low))


# J_GSPO = (1/G) sum_i min(s_i A_i, clip(s_i, 1-eps_low, 1+eps_high) A_i)                (eq. 5)
def gspo_loss(logp_new, logp_old, advantages, mask, eps_low: float = 3e-4, eps_high: float = 4e-4,
              *, aggregation: str = "paper", num_tokens=None, max_tokens=None, weight=None) -> torch.Tensor:
    """GSPO: one clipped term per sequence, mean over sequences. (B, T) log-probs, (B,) advantages.

    Its gradient is (eq. 10) s_i A_i (1/|y_i|) sum_t grad log pi(y_it): every token of a response
    shares one weight. An empty row adds nothing (explicit `where`: the clipped term at s = 1 would
    add A), but still counts in the 1/B, as the paper's 1/G does. `aggregation` other than "paper"
    reweights the sequences (`aggregate`); so does `weight`, --is-correction's (`correction_weight`).
    """
    s = importance_ratio(logp_new, logp_old, mask)                     # (B,)
    per_seq = _clipped_surrogate(s, advantages, eps_low, eps_high)     # (B,)
    return aggregate(per_seq, mask != 0, aggregation, num_tokens=num_tokens, max_tokens=max_tokens,
                     weight=weight)


def _per_token(advantages: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """Advantages (B,) or (B, T) -> (B, T) (a view, not a copy, for the (B,) case)."""
    return advantages.unsqueeze(-1).expand_as(like) if advantages.dim() == 1 else advantages


# s_it = sg[s_i] * pi(y_it) / sg[pi(y_it)]                                          (eqs. 13-14)
# J = (1/G) sum_i (1/|y_i|) sum_t min(s_it A_it, clip(s_it, 1-eps_low, 1+eps_high) A_it)
def gspo_token_loss(logp_new, logp_old, advantages, mask, eps_low: float = 3e-4,
                    eps_high: float = 4e-4, *, aggregation: str = "paper", num_tokens=None,
                    max_tokens=None, weight=None) -> torch.Tensor:
    """GSPO-token: every s_it has the VALUE s_i (so clipping is decided per sequence) and the
    GRADIENT s_i * grad log pi(y_it), which lets each token carry its own advantage A_it.
    With A_it = A_i it equals GSPO in value and gradient (eqs. 15-17)."""
    keep = mask != 0
    s = importance_ratio(logp_new, logp_old, mask).detach()            # (B,), sg[s_i]
    own = torch.where(keep, logp_new - logp_new.detach(), torch.zeros_like(logp_new))  # 0, grad 1
    s_tok = s.unsqueeze(-1) * torch.exp(own)                           # (B, T), value s_i
    per_tok = _clipped_surrogate(s_tok, _per_token(advantages, s_tok), eps_low, eps_high)
    return aggregate(per_tok, keep, aggregation, num_tokens=num_tokens, max_tokens=max_tokens, weight=weight)


# w_it = pi_new(y_it) / pi_old(y_it)
# J_GRPO = (1/G) sum_i (1/|y_i|) sum_t min(w_it A_i, clip(w_it, 1-eps_low, 1+eps_high) A_i)   (eq. 2;
# the paper writes one eps, the asymmetric band is DAPO's "clip-higher", as in its GRPO baseline)
def grpo_loss(logp_new, logp_old, advantages, mask, eps_low: float = 0.2, eps_high: float = 0.27,
              *, aggregation: str = "paper", num_tokens=None, max_tokens=None, weight=None) -> torch.Tensor:
    """GRPO: every token clipped on its own ratio; per-row token mean, then mean over rows
    (`aggregation` "paper"; "dapo" and "dr_grpo" sum over tokens instead, `aggregate`)."""
    log_w, keep = _deltas(logp_new, logp_old, mask)                          # (B, T)
    per_tok = _clipped_surrogate(torch.exp(log_w), _per_token(advantages, log_w), eps_low, eps_high)
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
        ratio, adv = torch.exp(delta), _per_token(advantages, delta)                 # (B, T)
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
    return _token_sum(weight * _per_token(advantages, delta) * logp, keep, num_tokens)


# LUSPO (arXiv 2602.05261): GSPO's term times the response length, undoing the 1/|y| that gives a
# long response as much weight in total as a short one.
#   J = (1/G) sum_i |y_i| min(s_i A_i, clip(s_i, 1-e_lo, 1+e_hi) A_i)
def luspo_loss(logp_new, logp_old, advantages, mask, *, eps: tuple[float, float] = (3e-4, 4e-4)
               ) -> torch.Tensor:
    """LUSPO: GSPO's per-sequence term weighted by |y_i|, mean over sequences."""
    delta, keep = _deltas(logp_new, logp_old, mask)
    s = torch.exp(masked_mean(delta, keep))
    return _per_row(keep.sum(-1).to(s.dtype) * _clipped_surrogate(s, advantages, *eps), keep)


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
# Batches: prompts to tensors, the policy's log-probs of given completions, and greedy accuracy.
# ---------------------------------------------------------------------------------------------
def encode_prompts(tokenizer, texts: list[str], device) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded prompt ids and attention mask, both (B, P).

    A tokenizer with a chat template (an instruct model's) gets each text as one user message
    followed by the opening of the assistant's turn, as the model saw in its own training; the
    template writes the special tokens itself, so the tokenizer must not add them again.
    """
    if getattr(tokenizer, "chat_template", None):
        texts = [tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                               add_generation_prompt=True) for text in texts]
        enc = tokenizer(texts, padding=True, return_tensors="pt", add_special_tokens=False)
    else:
        enc = tokenizer(texts, padding=True, return_tensors="pt")
    return enc.input_ids.to(device), enc.attention_mask.to(device)


def completion_logits(model, prompt_ids, prompt_mask, completions) -> torch.Tensor:
    """The logits that predict each completion token, (B, T, V), from one forward pass over prompt +
    completion; logits_to_keep skips the prompt's logits, whose (B, P, V) tensor would dominate
    memory with a real vocabulary."""
    ids = torch.cat([prompt_ids, completions], dim=1)                    # (B, P+T)
    attn = torch.cat([prompt_mask.long(), torch.ones_like(completions)], dim=1)
    pos = (attn.cumsum(-1) - 1).clamp(min=0)
    T = completions.shape[1]
    return model(input_ids=ids, attention_mask=attn, position_ids=pos, use_cache=False,
                 logits_to_keep=T + 1).logits[:, :-1]                   # (B, T, V): predicts y_1..y_T


def policy_logprobs(model, prompt_ids, prompt_mask, completions, *, temperature: float = 1.0):
    """log pi(y_t | x, y_<t) for every completion position: (B, T), differentiable."""
    logits = completion_logits(model, prompt_ids, prompt_mask, completions)   # (B, T, V)
    if temperature > 0:                        # 0 leaves the logits as they are (the warm-up's NLL)
        logits = logits / temperature          # the sampler's distribution, so s = 1 on-policy
    return token_logprobs(logits, completions)


def group_policy_logprobs(model, prompt_ids, prompt_mask, completions, group_size: int, *,
                          temperature: float = 1.0):
    """`policy_logprobs` for rows in groups of `group_size` identical prompts, prompt run once per group.

    A rollout holds every prompt G times: here it goes through the model once per group, its keys
    and values are repeated for the group's G completions, and the completions run on top of them.
    The same numbers as `policy_logprobs`, gradient included (autograd sums the G completions'
    gradients into the one prompt pass; test_group_policy_logprobs_match_...). On add2 the prompts
    (6 tokens) are longer than the answers (2-4 with EOS): this skips nearly half of the positions.
    """
    from transformers import DynamicCache

    G, P, T = group_size, prompt_ids.shape[1], completions.shape[1]
    attn = torch.cat([prompt_mask.long(), torch.ones_like(completions)], dim=1)     # (B, P+T)
    pos = (attn.cumsum(-1) - 1).clamp(min=0)
    cache = DynamicCache(config=model.config)
    first = model(input_ids=prompt_ids[::G], attention_mask=attn[::G, :P], position_ids=pos[::G, :P],
                  cache=cache, use_cache=True, logits_to_keep=1).logits        # (B/G, 1, V): y_1
    logits = first.repeat_interleave(G, dim=0)                                  # (B, 1, V)
    if T > 1:
        cache.batch_repeat_interleave(G)
        rest = model(input_ids=completions[:, :-1], attention_mask=attn[:, :-1],
                     position_ids=pos[:, P:-1], cache=cache, use_cache=True).logits  # (B, T-1, V)
        logits = torch.cat([logits, rest], dim=1)                               # (B, T, V): y_1..y_T
    if temperature > 0:
        logits = logits / temperature
    return token_logprobs(logits, completions)


@torch.no_grad()
def accuracy(model, tokenizer, task: str | DataTask, problems, max_new_tokens: int, device,
             batch_size: int = 512) -> float:
    """Greedy accuracy (the task's reward, EOS required) over a list of (a, b) problems."""
    hits = 0.0
    for i in range(0, len(problems), batch_size):
        chunk = problems[i:i + batch_size]
        ids, attn = encode_prompts(tokenizer, [prompt_text(task, a, b) for a, b in chunk], device)
        comp = sample_completions(model, ids, attn, max_new_tokens, tokenizer.eos_token_id,
                                  tokenizer.pad_token_id, temperature=0.0)
        hits += sum(reward(row, answer_text(task, a, b), tokenizer, task=task)
                    for row, (a, b) in zip(comp.tolist(), chunk))
    return hits / len(problems)


# ---------------------------------------------------------------------------------------------
# Supervised warm-up: teach the answer format until some sampled answers are right.
# ---------------------------------------------------------------------------------------------
# Why: GSPO's signal is the reward spread INSIDE a group. A random model answers nothing right, every
# group is all zeros, every advantage is 0 and nothing is learnt. We stop as soon as validation
# accuracy first reaches `warmup_target` (0.3): enough groups then hold both successes and failures,
# and everything beyond that is RL's work. (A departure from the paper, which starts from a
# pretrained model.)
def supervised_loss(model, tokenizer, task: str | DataTask, problems, device) -> torch.Tensor:
    """Mean token negative log-likelihood of 'solution<eos>' after each prompt (`solution_text`:
    the answer alone, a file's 'answer' field, or addwork's working and answer)."""
    ids, attn = encode_prompts(tokenizer, [prompt_text(task, a, b) for a, b in problems], device)
    answers = [tokenizer(solution_text(task, a, b), add_special_tokens=False).input_ids
               + [tokenizer.eos_token_id] for a, b in problems]
    T = max(map(len, answers))
    target = torch.tensor([ans + [tokenizer.pad_token_id] * (T - len(ans)) for ans in answers],
                          device=device)                                 # (B, T)
    mask = torch.tensor([[t < len(ans) for t in range(T)] for ans in answers], device=device)
    logp = policy_logprobs(model, ids, attn, target, temperature=0.0)   # (B, T); 0: logits unscaled
    return -masked_mean(logp.flatten(), mask.flatten())


def warmup(model, tokenizer, splits, cfg: Config, device, rng: random.Random, run, stop) -> int:
    """Train on correct answers until validation accuracy >= cfg.warmup_target. Returns steps taken.

    `run.log` records progress; `stop.requested` turns true after Ctrl-C (both defined at the end).
    """
    task = task_of(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.warmup_lr)
    val_acc = accuracy(model, tokenizer, task, splits["val"], cfg.max_new_tokens, device)
    step = 0
    while val_acc < cfg.warmup_target and step < cfg.warmup_max_steps and not stop.requested:
        step += 1
        loss = supervised_loss(model, tokenizer, task,
                               sample_train_problems(splits, task, cfg.warmup_batch, rng), device)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        stop_if_not_finite(f"warm-up step {step}", loss, model)   # before the update reaches the weights
        opt.step()
        if step % 20 == 0:       # supervised accuracy jumps suddenly: look often, it costs little
            val_acc = accuracy(model, tokenizer, task, splits["val"], cfg.max_new_tokens, device)
            run.log({"stage": "warmup", "step": step, "loss": loss.item(), "val_acc": val_acc},
                    f"warm-up {step} | loss {loss.item():.3f} | val_acc {val_acc:.2f}")
    return step


# ---------------------------------------------------------------------------------------------
# One GSPO step: a rollout of G completions per prompt, then `minibatches` clipped updates on it.
# ---------------------------------------------------------------------------------------------
def sampling_model(model, cfg: Config):
    """The model that samples a rollout: the policy itself (--sampler-dtype float32), or a copy of it
    cast to bfloat16 or float16, weights and activations, made now, as an inference engine holds
    weights of its own. Its log-probs of the same tokens differ by the engine gap (`engine_gap`)."""
    if cfg.sampler_dtype == "float32":
        return model
    return copy.deepcopy(model).to(getattr(torch, cfg.sampler_dtype))


def engine_differs(cfg: Config) -> bool:
    """Whether pi_old's record differs from the trainer by construction: another dtype, a nucleus
    (--top-p) or the synthetic engine. Such runs log log s at theta_old (and a real engine its KL)."""
    return cfg.sampler_dtype != "float32" or cfg.top_p < 1 or bool(cfg.record_noise)


KL_ELEMENTS = 2 ** 22      # logits per piece of `engine_kl_tokens`: 16 MiB in float32, any vocabulary


# The engine gap, exactly: at each position the sampler draws from q_t, the trainer holds p_t, and
#   KL(q_t || p_t) = sum_v q_t(v) (log q_t(v) - log p_t(v)) >= 0     over the whole vocabulary.
# The sampled token's gap d_t = log p_t(y_t) - log q_t(y_t) has mean E_q[d_t] = -KL(q_t || p_t): a
# sampler that differs from the trainer biases log s downwards, by the mean KL at a fixed length.
def token_kl(logq: torch.Tensor, logp: torch.Tensor) -> torch.Tensor:
    """(..., V) log q and log p -> (...,) KL(q || p); tokens outside q's support (log q = -inf, a
    nucleus's) add nothing."""
    return torch.where(logq > -float("inf"), logq.exp() * (logq - logp), 0.0).sum(-1)


@torch.no_grad()
def engine_kl_tokens(sampler, trainer, batch: dict, cfg: Config) -> float:
    """Mean KL(sampler || trainer) per completion token over a minibatch's worth of the rollout (its
    first B / minibatches rows, whole groups), at theta_old. The sampler's q is `nucleus_logprobs` of
    its logits from one full pass over the sampled tokens (the record came from its token-by-token
    pass with a KV cache, which in bf16 differs in the last bits); pieces of rows hold at most
    KL_ELEMENTS logits, so a real vocabulary stays small."""
    G = cfg.group_size
    n = max(1, len(batch["rewards"]) // G // cfg.minibatches) * G
    T = batch["completions"].shape[1]
    step = max(1, KL_ELEMENTS // (T * trainer.get_output_embeddings().weight.shape[0]))
    total, count = 0.0, 0
    for i in range(0, n, step):
        args = [batch[k][i:min(i + step, n)] for k in ("prompt_ids", "prompt_mask", "completions")]
        logq = nucleus_logprobs(completion_logits(sampler, *args), cfg.temperature, cfg.top_p)  # (b, T, V)
        logp = torch.log_softmax(completion_logits(trainer, *args).float() / cfg.temperature, dim=-1)
        kl = token_kl(logq, logp)                                                                # (b, T)
        keep = batch["mask"][i:min(i + step, n)] != 0
        total, count = total + kl[keep].sum().item(), count + keep.sum().item()
    return total / max(count, 1)


@torch.no_grad()
def rollout(model, tokenizer, problems, cfg: Config, device) -> dict:
    """Sample G completions per prompt with `model` (the sampler), score them, and compute group
    advantages. `sampler_logprobs` is the sampler's own record of its tokens' log-probs."""
    G, task = cfg.group_size, task_of(cfg)
    texts = [prompt_text(task, a, b) for a, b in problems for _ in range(G)]       # group after group
    prompt_ids, prompt_mask = encode_prompts(tokenizer, texts, device)            # (B, P)
    completions, sampled = sample_completions(model, prompt_ids, prompt_mask, cfg.max_new_tokens,
                                              tokenizer.eos_token_id, tokenizer.pad_token_id,
                                              temperature=cfg.temperature, group_size=G,
                                              top_p=cfg.top_p, with_logprobs=True,   # (B, T) each
                                              rows=SAMPLE_TOKENS // cfg.max_new_tokens if cfg.micro_batch else 0)
    mask = completion_mask(completions, tokenizer.eos_token_id)                    # (B, T)
    answers = [answer_text(task, a, b) for a, b in problems for _ in range(G)]
    rewards = torch.tensor([reward(row, ans, tokenizer, task=task) for row, ans in
                            zip(completions.tolist(), answers)], device=device)    # (B,)
    if cfg.shuffle_rewards:           # the control: same reward statistics, no relation to answers
        rewards = rewards[torch.randperm(len(rewards), device=device)]
    return {"prompt_ids": prompt_ids, "prompt_mask": prompt_mask, "completions": completions, "mask": mask,
            "rewards": rewards, "sampler_logprobs": sampled, "record_gap": synthetic_gap(mask, cfg),  # (B, T)
            "advantages": group_advantages(rewards, G, scale=cfg.scale_rewards == "group")}


def flat_group_share(rewards: torch.Tensor, group_size: int) -> float:
    """Share of groups whose rewards are all equal: their advantages are 0, they teach nothing."""
    r = rewards.reshape(-1, group_size)                                     # (B/G, G)
    return (r == r[:, :1]).all(1).float().mean().item()


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
            "sum_old_minus_new": -delta[keep].sum().item(), **by_sign}


def group_chunks(n_rows: int, group_size: int, minibatches: int, device) -> list[torch.Tensor]:
    """Row indices of `minibatches` random chunks of whole groups (group k is rows kG .. kG+G-1).

    tensor_split, not chunk: chunk(5) of 12 groups gives 4 parts of 3, one optimiser step short.
    """
    groups = torch.randperm(n_rows // group_size, device=device).tensor_split(minibatches)
    return [(grp[:, None] * group_size + torch.arange(group_size, device=device)).flatten()
            for grp in groups]


def summarise_minibatches(logs: list[dict]) -> dict:
    """One step's metrics from its minibatches' `ratio_metrics` (each with "loss", "n_clip_ceiling").

    `clip_ceiling`: the share of the step's tokens that could clip at all (`clip_tokens` never
    exceeds it). `grad_norm`: the largest minibatch's, before clipping. Per minibatch in order: its
    share of clipped sequences, the `quantiles` of |log s| and of |delta_t|, and the mean of
    log(pi_old / pi_theta) over its tokens just before its update (0 for minibatch 1 with the
    trainer's pi_old). The engine gap is minibatch 1's; where pi_old's record differs from the
    trainer (`engine_differs`), the clip shares among responses and tokens with A > 0 and A < 0
    (`clip_seqs_pos_adv`, ..., the responses' also per minibatch); --is-correction's mean and zero weights.
    """
    s = torch.cat([m["s"] for m in logs])                                  # (B,)
    tokens = max(sum(m["n_tokens"] for m in logs), 1)
    return {"loss": sum(m["loss"] for m in logs) / len(logs), "s_mean": s.mean().item(),
            "s_min": s.min().item(), "s_max": s.max().item(),
            "clip_tokens": sum(m["n_clip_tokens"] for m in logs) / tokens,
            "clip_seqs": sum(m["n_clip_seqs"] for m in logs) / len(s),
            "clip_ceiling": sum(m.get("n_clip_ceiling", 0) for m in logs) / tokens,
            "gate_tokens": sum(m.get("n_gate_tokens", 0) for m in logs) / tokens,
            "masked_seqs": sum(m.get("n_masked_seqs", 0) for m in logs) / len(s),
            "form_gap": max(m["form_gap"] for m in logs),
            **({"grad_norm": max(m["grad_norm"] for m in logs)} if "grad_norm" in logs[0] else {}),
            **{k: v for k, v in logs[0].items() if k.startswith("engine_")},
            **({**{f"clip_{unit}_{side}_adv": sum(m[f"n_clip_{unit}_{side}"] for m in logs)
                   / max(sum(m[f"n_{unit}_{side}"] for m in logs), 1)
                   for unit in ("seqs", "tokens") for side in ("pos", "neg")},
                "clip_seqs_by_sign_by_minibatch": [[m[f"n_clip_seqs_{side}"] / max(m[f"n_seqs_{side}"], 1)
                                                    for side in ("pos", "neg")] for m in logs]}
               if "engine_log_s_mean" in logs[0] else {}),
            **({"is_weight_mean": sum(m["is_weight_sum"] for m in logs) / tokens,
                "is_masked_tokens": sum(m["n_is_zero"] for m in logs) / tokens} if "is_weight_sum" in logs[0] else {}),
            "clip_seqs_by_minibatch": [m["n_clip_seqs"] / len(m["s"]) for m in logs],
            "update_size_by_minibatch": [m["sum_old_minus_new"] / max(m["n_tokens"], 1) for m in logs],
            "abs_log_s_q": [m["abs_log_s_q"] for m in logs],
            "abs_token_log_ratio_q": [m["abs_token_log_ratio_q"] for m in logs]}


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
        norm = stop_if_not_finite(f"minibatch {k + 1} of {len(chunks)} of the next step", loss, model)
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
        logs.append({**ratio_metrics(logp_new, logp_old, adv, mask, cfg.loss, *band(idx)),
                     "loss": loss.item(), "n_clip_ceiling": could_clip, "grad_norm": norm.item(),
                     "n_masked_seqs": sum(x[4] for x in seen), **gap})
    opt.zero_grad(set_to_none=True)         # the gradients' memory is free while the next rollout samples
    return summarise_minibatches(logs)


# ---------------------------------------------------------------------------------------------
# The training loop: warm-up, then GSPO steps, then the test set. The whole run is `train()`.
# ---------------------------------------------------------------------------------------------
def rl_optimizer(model, cfg: Config):
    """AdamW (weight decay 0.01, torch's default) with the learning rate decayed linearly to 0 over
    the RL steps, TRL's default schedule as well. Fused: one kernel for all parameters instead of
    a Python loop over them, as transformers' Trainer does."""
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, fused=True)
    return opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda i: 1 - i / cfg.steps)


def progress_line(step: int, cfg: Config, m: dict) -> str:
    """One line per step, each number under its metrics.jsonl name; [s_min, s_max] after s_mean."""
    acc = f" | val_acc {m['val_acc']:.2f}" if "val_acc" in m else ""
    tps = m["tokens_per_second"]
    tps = f"{tps / 1e3:.1f}k" if tps >= 1e3 else f"{tps:.0f}"              # a real model: ~20/s on a CPU
    return (f"step {step}/{cfg.steps} | reward {m['reward']:.2f}{acc} | "
            f"s_mean {m['s_mean']:.4f} [{m['s_min']:.4f}, {m['s_max']:.4f}] | "
            f"clip_tokens {m['clip_tokens']:.3f} | flat_groups {m['flat_groups']:.2f} | "
            f"response_tokens {m['response_tokens']:.1f} | "
            f"tokens_per_second {tps}")


def train(cfg: Config, model, tokenizer, device, run, stop) -> dict:
    """The whole run: supervised warm-up, `cfg.steps` GSPO steps, then the test set.

    `run` writes the run folder (`run.log`, `run.checkpoint`, `run.write_summary`) and `stop`
    turns `stop.requested` true after a Ctrl-C: plumbing, both defined after `main`. The run ends
    between steps; a second Ctrl-C (KeyboardInterrupt) ends it at once. Either way a final
    checkpoint, the test accuracy (unless another Ctrl-C cuts it short) and summary.json follow.
    A step whose loss or gradient is not finite ends it too (`Diverged`, raised before that
    update is taken), without either: its last checkpoint stays its result and `stop_reason`
    says why. Returns what summary.json holds.
    """
    task = task_of(cfg)                            # --task's name, or the rows of --data
    splits = make_splits(task, cfg.test_size, cfg.val_size)
    rng = random.Random(cfg.seed)                  # training prompts; the held-out splits are fixed
    eps_low, eps_high = resolved_eps(cfg)
    G = cfg.group_size
    summary = {"seed": cfg.seed, "loss": cfg.loss, "eps_low": eps_low, "eps_high": eps_high,
               "warmup_steps": None, "accuracy_before_rl": None, "accuracy_after_rl": None,
               "interrupted": False, "stop_reason": None, "rl_steps": 0, "rl_tokens": 0,
               "rl_seconds": 0.0, "config": dataclasses.asdict(cfg)}
    try:
        # 1. Supervised warm-up until validation accuracy reaches cfg.warmup_target; then the test
        #    accuracy it reached and the first checkpoint (the run folder appears in --out here).
        summary["warmup_steps"] = warmup(model, tokenizer, splits, cfg, device, rng, run, stop)
        if not stop.requested:                # after a Ctrl-C in the warm-up, straight to the end
            summary["accuracy_before_rl"] = accuracy(model, tokenizer, task, splits["test"],
                                                     cfg.max_new_tokens, device)
            run.checkpoint(model, tokenizer)
            print(f"warm-up done after {summary['warmup_steps']} steps | "
                  f"test acc {summary['accuracy_before_rl']:.3f}", flush=True)

        # 2. GSPO: each step is one rollout and `minibatches` optimiser steps on it.
        opt, sched = rl_optimizer(model, cfg)
        evaluate_at = eval_steps(cfg)                   # every eval_every steps, --eval-at's, the last
        for step in range(1, cfg.steps + 1):
            if stop.requested:
                break
            t0 = time.perf_counter()
            # Rollout: G completions for each of `prompts_per_step` fresh training problems, their
            # rewards and group advantages. The model as it is now is pi_old; it samples, or a copy
            # in bfloat16 or float16 does (--sampler-dtype), as an inference engine would.
            problems = sample_train_problems(splits, task, cfg.prompts_per_step, rng)
            sampler = sampling_model(model, cfg)
            batch = rollout(sampler, tokenizer, problems, cfg, device)
            if engine_differs(cfg) and not cfg.record_noise:      # a real engine's two distributions: KL
                batch["engine_kl_tokens"] = engine_kl_tokens(sampler, model, batch, cfg)
            del sampler
            # Update: one clipped step per minibatch of whole groups; all but the first off-policy.
            m = rl_update(model, opt, batch, cfg, eps_low, eps_high)
            sched.step()                                 # the learning rate decays once per rollout
            # Evaluate on the validation set, and checkpoint, every `eval_every` steps and at the end.
            if step in evaluate_at:
                m["val_acc"] = accuracy(model, tokenizer, task, splits["val"],
                                        cfg.max_new_tokens, device)
                run.checkpoint(model, tokenizer)
            # Log: one object in metrics.jsonl and one progress line, the same names in both.
            n_tok = int(batch["mask"].sum())             # completion tokens sampled, EOS included
            dt = time.perf_counter() - t0                # the whole step, evaluation included
            m.update(reward=batch["rewards"].mean().item(),
                     flat_groups=flat_group_share(batch["rewards"], G),
                     response_tokens=n_tok / len(batch["rewards"]),
                     tokens_per_second=n_tok / dt, step_seconds=dt)
            summary["rl_steps"] = step
            summary["rl_tokens"] += n_tok
            summary["rl_seconds"] += dt
            run.log({"stage": "rl", "step": step, **m}, progress_line(step, cfg, m))
    except KeyboardInterrupt:                            # the second Ctrl-C: stop where we are
        pass
    except Diverged as err:                              # a non-finite loss or gradient: stop here
        summary["stop_reason"] = str(err)

    opt = sched = None          # AdamW's two moments (twice the weights) are not needed to evaluate
    # 3. The end, after Ctrl-C too: a final checkpoint, and the final model's test accuracy. Not
    #    after a non-finite step, nor with a non-finite weight (an update with a finite loss and
    #    gradient can still overflow one): the last checkpoint, all finite, is the run's result.
    #    From here a Ctrl-C cuts no file in half: it can only cut the final evaluation short.
    with stop.finishing():
        summary["stop_reason"] = summary["stop_reason"] or non_finite_weights(model)
        if stop.requested:
            print("interrupted: writing a final checkpoint and summary.json", file=sys.stderr)
        if summary["stop_reason"] is None:
            # a run stopped in its warm-up stays in <out>.incomplete: an earlier run in --out is kept
            run.checkpoint(model, tokenizer, promote=summary["accuracy_before_rl"] is not None)
            summary["accuracy_after_rl"] = stop.cut_short(accuracy, model, tokenizer, task,
                                                          splits["test"], cfg.max_new_tokens, device)
        summary["final_evaluation_interrupted"] = stop.cut    # then accuracy_after_rl is null
        summary["interrupted"] = stop.requested
        summary["rl_tokens_per_second"] = summary["rl_tokens"] / max(summary["rl_seconds"], 1e-9)
        summary["wall_seconds"] = time.perf_counter() - run.t_start  # the whole run, set-up included
        run.write_summary(summary)
    return summary


def main(argv: list[str] | None = None) -> int:
    """Parse the flags (bad input: one line, exit 2), build the model, train, report.
    Exit code 0, 130 when Ctrl-C ended the run, or 2 when a non-finite step did (one line)."""
    t_start = time.perf_counter()
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        cfg = parse_config(argv)
        device, model, tokenizer = prepare(cfg)      # a --model that cannot be loaded: BadInput too
    except BadInput as err:
        print(f"gspo_minimal.py: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:                        # Ctrl-C before the run folder exists
        print("\ninterrupted before the run began: nothing was written", file=sys.stderr)
        return 130
    n_params = sum(p.numel() for p in model.parameters())
    print(f"{cfg.loss} | {type(model).__name__} {n_params / 1e6:.2f}M params | {cfg.data or cfg.task} | "
          f"device {device} | seed {cfg.seed} | out {cfg.out}", flush=True)
    try:
        run = Run(cfg.out, t_start, command=" ".join(["python gspo_minimal.py", *argv]))
    except RuntimeError as err:              # --out changed since it was checked: one line, exit 2
        print(f"gspo_minimal.py: error: {err}", file=sys.stderr)
        return 2
    with GracefulStop() as stop:
        try:
            summary = train(cfg, model, tokenizer, device, run, stop)
        finally:
            run.close()                      # --out is free for the next run
        if summary["stop_reason"]:
            print(f"gspo_minimal.py: error: {diverged_line(summary, run)}", file=sys.stderr)
            return 2
        print(final_line(summary, run, "RL"), flush=True)
    return 130 if summary["interrupted"] else 0


# =============================================================================================
# Nothing below is GSPO: the run folder, Ctrl-C, the command line, reading a --data file.
# =============================================================================================
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


def synthetic_gap(mask: torch.Tensor, cfg: Config) -> torch.Tensor | None:
    """The synthetic engine's gap d_t = log pi_old(y_t) - log record(y_t) at each token of a rollout,
    (B, T) float32, 0 after a row's EOS: independent draws of N(-K, SIGMA^2), K and SIGMA from
    --record-noise; None without it. The draws come from a generator of the run's own (made at the
    first rollout, kept on `cfg`), so the rollout and every other random number are those of the
    run without the flag, and K = SIGMA = 0 gives that run exactly. `rl_update` subtracts d_t from
    the trainer's pi_old; at theta = theta_old a response of n tokens then has log s = mean_t d_t,
    of mean -K and variance SIGMA^2 / n: tutorial section 12's model of an engine's gap, with a
    bias that length does not remove and a noise that it does."""
    values = record_noise_values(cfg)
    if values is None:
        return None
    k, sigma = values
    gen = run_state(cfg, "_record_generator", lambda: torch.Generator().manual_seed(cfg.seed ^ RECORD_SEED_MIX))
    d = torch.randn(mask.shape, generator=gen) * sigma - k                     # (B, T), on the CPU
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


# --- The run folder: metrics.jsonl, atomic checkpoints, summary.json --------------------------
MARKER = ".gspo_minimal_run"   # says "this script wrote this folder", so it may be replaced
# everything this script (or studies/trl_compare.py) writes into a run folder; anything else is the
# user's
OURS = {MARKER, "metrics.jsonl", "summary.json", "summary.json.tmp", "checkpoint", "checkpoint.tmp",
        "checkpoint.old", "trl_output"}


def written_by_us(path: str) -> bool:
    """A real folder (not a link) holding our marker file and nothing we would not write."""
    return (os.path.isdir(path) and not os.path.islink(path)
            and os.path.isfile(os.path.join(path, MARKER)) and set(os.listdir(path)) <= OURS)


try:
    import fcntl                      # POSIX: a run's lock on its --out (Windows: no lock)
except ImportError:                   # pragma: no cover
    fcntl = None

# The longest name save_pretrained writes into a checkpoint folder (model-00001-of-00002.safetensors
# is 32 bytes), with room to spare: `path_problem` checks that the deepest path a run writes fits.
CHECKPOINT_NAME_RESERVE = 48


def lock_path(out: str) -> str:
    """`<out>.lock`, beside the run folder: the run writing `out` holds it (flock) for its whole
    life, warm-up, promotion and final write included; the lock dies with the process."""
    return os.path.abspath(out) + ".lock"


def lock_holder(out: str) -> str | None:
    """"pid N" of the live run holding `<out>.lock`, or None. Only looks: creates nothing. A lock
    file left by a run that was killed is not held, so it is taken over."""
    try:
        fd = os.open(lock_path(out), os.O_RDONLY)
    except OSError:
        return None
    try:
        if fcntl is None:
            return None
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            return None                            # nobody holds it (closing lets it go again)
        except BlockingIOError:
            return f"pid {os.read(fd, 32).decode(errors='replace').strip() or '?'}"
    finally:
        os.close(fd)


def take_lock(out: str) -> int:
    """Hold `<out>.lock` (created if need be) and write our pid into it; RuntimeError when a live
    run holds it. Returns the file descriptor, which `release_lock` closes."""
    path = lock_path(out)
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        if fcntl is None:
            break
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.read(fd, 32).decode(errors="replace").strip() or "?"
            os.close(fd)
            raise RuntimeError(f"--out {out}: another run (pid {holder}) is writing it; wait for it "
                               "to end or choose another folder") from None
        try:                                       # the run that held it may have just removed it:
            if os.fstat(fd).st_ino == os.stat(path).st_ino:  # then ours is a ghost; open it again
                break
        except FileNotFoundError:
            pass
        os.close(fd)
    os.ftruncate(fd, 0)
    os.write(fd, str(os.getpid()).encode())
    return fd


def release_lock(fd: int, path: str) -> None:
    """Remove `<out>.lock`, then let the lock go (in that order: nobody can take a removed one)."""
    with contextlib.suppress(OSError):
        os.unlink(path)
    with contextlib.suppress(OSError):
        os.close(fd)


def path_problem(out: str) -> str | None:
    """Why a name the run will write for `out` is too long for the file system, or None: each new
    folder on the way, `<out>`, `<out>.incomplete`, `<out>.old` and `<out>.lock` (NAME_MAX bytes
    each), and the deepest file, `<out>.incomplete/checkpoint.tmp/<a file>` (PATH_MAX)."""
    parent = os.path.dirname(out)
    while not os.path.lexists(parent):
        parent = os.path.dirname(parent)

    def limit(name, fallback):
        try:
            return os.pathconf(parent if os.path.isdir(parent) else "/", name)
        except (OSError, ValueError):
            return fallback
    name_max, path_max = limit("PC_NAME_MAX", 255), limit("PC_PATH_MAX", 4096)
    new = os.path.relpath(os.path.dirname(out), parent).split(os.sep)
    base = os.path.basename(out)
    for name in [n for n in new if n != "."] + [base + s for s in ("", ".incomplete", ".old",
                                                                   ".lock")]:
        if len(os.fsencode(name)) > name_max:
            return (f"--out {out}: the name {name[:40]}... that the run writes is "
                    f"{len(os.fsencode(name))} bytes, longer than the {name_max} this file system "
                    "allows; choose a shorter --out")
    deepest = os.path.join(out + ".incomplete", "checkpoint.tmp", "x" * CHECKPOINT_NAME_RESERVE)
    if len(os.fsencode(deepest)) >= path_max:
        return (f"--out {out}: the run's deepest file, {out}.incomplete/checkpoint.tmp/..., would be "
                f"longer than the {path_max} bytes a path may have here; choose a shorter --out")
    return None


def out_problem(out: str, check_lock: bool = True) -> str | None:
    """Why `out` cannot hold a run, or None. Checked before the model is built.

    A run writes `<out>.incomplete` first, swaps through `<out>.old`, and holds `<out>.lock` for
    its whole life. Every one of these names must fit the file system (`path_problem`); `out` must
    be absent, an empty folder or a folder this script wrote (marker, nothing else added);
    `<out>.incomplete` absent or a leftover of this script; `<out>.lock` absent, or ours and held by
    no live run (`lock_holder`); `<out>.old` absent (only a run killed in the middle of a swap
    leaves one: it may hold that earlier run); and the nearest existing parent a folder we can
    write in (tried with an empty probe folder, removed at once). Nothing else is ever touched.
    """
    out = os.path.abspath(out)          # `.` and `a/..` name a folder; its siblings sit beside it
    problem = path_problem(out)
    if problem:
        return problem
    if os.path.lexists(out) and not written_by_us(out):
        if os.path.islink(out) or not os.path.isdir(out):
            return f"--out {out} exists and is not a folder; choose a folder path"
        if os.listdir(out):
            return f"--out {out} holds files this script did not write; choose another folder"
    incomplete, old = out + ".incomplete", out + ".old"
    if os.path.lexists(incomplete) and not written_by_us(incomplete):
        return (f"--out {out}: {incomplete} exists and this script did not write it; "
                "move it or choose another folder")
    lock = lock_path(out)
    if os.path.lexists(lock) and not ours_lock_file(lock):
        return f"--out {out}: {lock} exists and this script did not write it; move it"
    holder = lock_holder(out) if check_lock else None
    if holder:
        return (f"--out {out}: another run ({holder}) is writing it; wait for it to end or choose "
                "another folder")
    if os.path.lexists(old):
        return (f"--out {out}: {old} exists (a run stopped in the middle of replacing an earlier "
                "one leaves it; it may hold that run): move it or delete it")
    parent = os.path.dirname(out)
    while not os.path.lexists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        return f"--out {out}: {parent} is a file, not a folder"
    if not os.access(parent, os.W_OK | os.X_OK):
        return f"--out {out}: cannot create anything in {parent}"
    try:                        # os.access says yes to root everywhere (/proc too): only trying tells
        os.rmdir(tempfile.mkdtemp(prefix=".gspo_minimal_probe_", dir=parent))
    except OSError as err:
        return f"--out {out}: cannot create anything in {parent} ({err.strerror})"
    return None


def ours_lock_file(path: str) -> bool:
    """A regular file holding a pid, or nothing: what `take_lock` writes."""
    if os.path.islink(path) or not os.path.isfile(path):
        return False
    with open(path, "rb") as f:
        text = f.read(64).strip()
    return text.isdigit() or not text


def remove_ours(path: str) -> None:
    """Delete `path` if this script wrote it; refuse to touch anything else."""
    if written_by_us(path):
        shutil.rmtree(path)
    elif os.path.lexists(path):
        raise RuntimeError(f"{path} was not written by gspo_minimal.py: left as it is")


def replace_folder(new: str, final: str) -> None:
    """Inside a run folder: replace `final` by the complete folder `new` (rename is atomic)."""
    old = final + ".old"
    shutil.rmtree(old, ignore_errors=True)
    if os.path.exists(final):
        os.rename(final, old)
    os.rename(new, final)
    shutil.rmtree(old, ignore_errors=True)


def finite_or_null(value):
    """`value` with every non-finite float inside it replaced by None (JSON's null): JSON has no NaN
    or Infinity, and a file holding them is not JSON to jq or a browser. In metrics.jsonl they
    are legitimate: `form_gap` is NaN where a perplexity overflows, `s_max` inf where s does."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: finite_or_null(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite_or_null(v) for v in value]
    return value


class Run:
    """Writes into `<out>.incomplete` until the first checkpoint is complete, then swaps it in for
    `<out>`: an earlier run in `out` survives a new run that dies before its first checkpoint.
    Only folders marked as this script's are ever replaced or deleted (`out_problem`). It holds
    `<out>.lock` from its start until `close()` (or until it is collected, or the process ends):
    a second run at the same --out is refused all that time."""

    def __init__(self, out: str, t_start: float | None = None, command: str = ""):
        self.out = os.path.abspath(out)
        self.dir = self.out + ".incomplete"
        self.given = os.path.normpath(out)       # as the user wrote it, for messages
        self.t_start = time.perf_counter() if t_start is None else t_start
        self.command = command
        self.tree = tree_state()                # the commit and tracked tree as the run starts
        problem = out_problem(self.out, check_lock=False)
        if problem:
            raise RuntimeError(problem)
        os.makedirs(os.path.dirname(self.out), exist_ok=True)
        fd = take_lock(self.out)                # --out is ours until `close` (or the process ends)
        self.close = weakref.finalize(self, release_lock, fd, lock_path(self.out))
        remove_ours(self.dir)                   # a leftover of a run that was killed
        os.makedirs(self.dir)
        with open(os.path.join(self.dir, MARKER), "w") as f:
            f.write(str(os.getpid()))
        self.promoted = False

    def log(self, record: dict, line: str | None = None) -> None:
        record = {**record, "elapsed": time.perf_counter() - self.t_start,   # seconds since start
                  "cpu_seconds": time.process_time()}          # this process's CPU time, all threads
        with open(os.path.join(self.dir, "metrics.jsonl"), "a") as f:
            f.write(json.dumps(finite_or_null(record), allow_nan=False) + "\n")
        if line:
            print(line, flush=True)

    def checkpoint(self, model, tokenizer, promote: bool = True) -> None:
        """A complete checkpoint in the run folder; the first one (with `promote`) makes the run
        folder `<out>`."""
        problem = non_finite_weights(model)
        if problem:                             # never saved, so never promoted over a finite run
            raise Diverged(problem)
        tmp = os.path.join(self.dir, "checkpoint.tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        replace_folder(tmp, os.path.join(self.dir, "checkpoint"))
        if promote and not self.promoted:
            self.promote()

    def promote(self) -> None:
        """`<out>.incomplete` becomes `<out>`; an earlier run there goes (ours only)."""
        old = self.out + ".old"
        remove_ours(old)
        if written_by_us(self.out):
            os.rename(self.out, old)
        elif os.path.isdir(self.out) and not os.path.islink(self.out) and not os.listdir(self.out):
            os.rmdir(self.out)                         # an empty folder made for this run
        elif os.path.lexists(self.out):
            raise RuntimeError(f"{self.out} now holds files this script did not write: left as it "
                               f"is; this run is in {self.dir}")
        os.rename(self.dir, self.out)
        remove_ours(old)
        self.dir, self.promoted = self.out, True

    def write_summary(self, summary: dict) -> None:
        """summary.json, with the keys every JSON of this project carries (`provenance`)."""
        summary = {**summary, **provenance(self.command, summary.get("wall_seconds"), self.tree)}
        tmp = os.path.join(self.dir, "summary.json.tmp")
        with open(tmp, "w") as f:    # every number in it is finite by construction: a NaN here
            json.dump(summary, f, indent=2, allow_nan=False)   # is a bug, and fails here
        os.replace(tmp, os.path.join(self.dir, "summary.json"))


def final_line(summary: dict, run: Run, trained_by: str) -> str:
    """A run's last line: its two test accuracies, its time, and where summary.json is."""
    before, after = summary["accuracy_before_rl"], summary["accuracy_after_rl"]
    where = run.given if run.promoted else run.given + ".incomplete"
    return (f"test accuracy: {'n/a' if before is None else f'{before:.3f}'} after warm-up -> "
            f"{'n/a (its evaluation was cut short)' if after is None else f'{after:.3f}'} after "
            f"{trained_by} | "
            f"{summary['wall_seconds']:.0f} s | {where}/summary.json")


def diverged_line(summary: dict, run: Run) -> str:
    """A diverged run's one line: where it stopped, why, and what it kept."""
    kept = (f"its last checkpoint, all finite, is {run.given}/checkpoint" if run.promoted else
            f"no checkpoint was written (an earlier run in {run.given} is untouched)")
    where = run.given if run.promoted else run.given + ".incomplete"
    return (f"stopped after {summary['rl_steps']} RL steps: {summary['stop_reason']}; {kept}; "
            f"{where}/summary.json says so")


# --- Provenance: what made a result (the commit, the tree, the host) --------------------------
# On one host a run repeats bit for bit; another CPU or thread count gives other numbers. torch
# picks its CPU kernels by instruction set (AVX2, AVX-512, AMX) and splits reductions by thread
# count, so float32 moves in its last bits, and the warm-up's stop rule (checked every 20 steps) or
# one flipped sampled token turns that into another run. So every result names its host.
CPU_FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_fp16", "amx_bf16", "amx_tile", "fma", "f16c")
KERNEL_ENV_PREFIXES = ("OMP_", "MKL_", "KMP_", "MALLOC_", "ATEN_CPU_CAPABILITY")


def cpu_description() -> dict:
    """The CPU as Linux describes it (/proc/cpuinfo, sysfs caches); None where a field is unknown."""
    info: dict[str, str] = {}
    with contextlib.suppress(OSError):
        with open("/proc/cpuinfo") as f:
            for line in f:
                if not line.strip():
                    break                                  # the first processor is enough
                key, _, value = line.partition(":")
                info[key.strip()] = value.strip()
    caches = {}
    for index in range(8):
        base = f"/sys/devices/system/cpu/cpu0/cache/index{index}"
        with contextlib.suppress(OSError):
            with open(f"{base}/level") as level, open(f"{base}/size") as size:
                caches[f"l{level.read().strip()}"] = size.read().strip()
    flags = set(info.get("flags", "").split())
    import platform
    return {"model_name": info.get("model name") or platform.processor() or None,
            "vendor": info.get("vendor_id"), "family": info.get("cpu family"),
            "model": info.get("model"), "stepping": info.get("stepping"),
            "l2_cache": caches.get("l2"), "l3_cache": caches.get("l3"),
            "flags": {flag: flag in flags for flag in CPU_FLAGS} if flags else None}


def versions() -> dict:
    """python, torch, and transformers, trl and gguf where installed (read from the environment's
    package metadata, whether or not this process imported them, so that two processes of one
    environment always agree)."""
    import importlib.metadata
    import platform
    out = {"python": platform.python_version(), "torch": torch.__version__}
    for name in ("transformers", "trl", "gguf"):
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            out[name] = importlib.metadata.version(name)
    return out


def host_fingerprint(threads: int | None = None, env: typing.Mapping[str, str] | None = None) -> dict:
    """What, beside the code and the seed, decides a run's numbers: the CPU (model, instruction-set
    flags, caches), the kernels torch picked for it, its parallel backend and thread count, the
    environment variables that steer kernels or allocation, the CUDA device where one was used,
    and the versions. `threads` and `env` default to this process's own; a study passes a child
    run's to predict the fingerprint that child will record."""
    env = os.environ if env is None else env
    backend = next((line.split(":", 1)[1].strip() for line in torch.__config__.parallel_info().splitlines()
                    if line.startswith("ATen parallel backend")), None)
    cuda = (torch.cuda.get_device_name(torch.cuda.current_device())
            if torch.cuda.is_available() and torch.cuda.is_initialized() else None)
    return {"cpu": cpu_description(), "cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "parallel_backend": backend, "threads": torch.get_num_threads() if threads is None else threads,
            "env": {k: env[k] for k in sorted(env) if k.startswith(KERNEL_ENV_PREFIXES)},
            "cuda_device": cuda, "versions": versions()}


def host_differences(recorded, expected: dict, where: str = "") -> list[str]:
    """The fields in which two host fingerprints differ ("cpu.flags.avx512f: True here, False
    there"), recursing into nested fields; [] when they are equal field by field."""
    if isinstance(recorded, dict) and isinstance(expected, dict):
        return [d for k in sorted(set(recorded) | set(expected))
                for d in host_differences(recorded.get(k), expected.get(k), f"{where}.{k}" if where else k)]
    return [] if recorded == expected else [f"{where or 'host'}: {expected!r} here, {recorded!r} there"]


def tree_state(exclude: typing.Iterable[str] = (), repo: str | None = None) -> dict:
    """measured_at_commit (HEAD), and whether the tracked tree differed from it (`dirty`) in which
    paths (`dirty_paths`, from the repository root), leaving out `exclude` (the files the target
    itself writes). Untracked files do not count. `repo`: this file's checkout unless given.
    Outside a git checkout: all three None."""
    import subprocess
    here = repo or os.path.dirname(os.path.abspath(__file__))

    def git(*args) -> str | None:
        try:
            res = subprocess.run(["git", "-C", here, *args], capture_output=True, text=True, timeout=10)
        except (OSError, subprocess.SubprocessError):
            return None
        return res.stdout if res.returncode == 0 else None
    head = (git("rev-parse", "HEAD") or "").strip()
    status = git("status", "--porcelain", "--untracked-files=no")
    if not head or status is None:
        return {"measured_at_commit": None, "dirty": None, "dirty_paths": None}
    skip = {os.path.normpath(p) for p in exclude}
    paths = sorted({os.path.normpath(line[3:].split(" -> ")[-1].strip('"'))
                    for line in status.splitlines() if line.strip()} - skip)
    return {"measured_at_commit": head, "dirty": bool(paths), "dirty_paths": paths}


def provenance(command: str, seconds: float | None, tree: dict | None = None) -> dict:
    """The keys every JSON of the project carries: command, seconds, the tree it was made from
    (`tree_state`, taken when the run or target started; now, if not given), versions, threads and
    the host."""
    host = host_fingerprint()
    return {"command": command, "seconds": seconds, **(tree or tree_state()),
            "versions": host["versions"], "threads": host["threads"], "host": host}


# --- A diverged run: a non-finite loss or gradient stops it before the update is taken ----------
class Diverged(Exception):
    """A non-finite loss, gradient norm or weight: the run stops, and keeps its last checkpoint."""


def stop_if_not_finite(where: str, loss: torch.Tensor, model) -> torch.Tensor:
    """Raise Diverged unless the loss and the gradient norm (before any clipping) are finite, and
    return that norm, so clipping need not compute it again. Called between backward and the
    optimiser step, so that the weights never take such a step; it reads the gradients only."""
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    norm = torch.nn.utils.get_total_norm(grads) if grads else torch.zeros(())
    if not (math.isfinite(loss.item()) and math.isfinite(norm.item())):
        raise Diverged(f"{where} has loss {loss.item():.4g} and gradient norm {norm.item():.4g} (a "
                       "learning rate too high?)")
    return norm


def non_finite_weights(model) -> str | None:
    """Why the model's weights cannot be saved (some are NaN or infinite), or None."""
    bad = [name for name, p in model.named_parameters() if not torch.isfinite(p).all()]
    return f"{len(bad)} weight tensors are not finite, {bad[0]} the first" if bad else None


# --- Ctrl-C -----------------------------------------------------------------------------------
class GracefulStop:
    """The first Ctrl-C asks the run to stop after the current step; a second one stops at once.

    Stopping between steps, rather than wherever KeyboardInterrupt happens to land, never cuts a
    checkpoint write or a library's worker threads in half. Inside `finishing` (the final
    checkpoint, the final test evaluation, summary.json) no Ctrl-C raises except during
    `cut_short`, which it ends at once (`cut` turns true): the files are always written.
    """

    def __enter__(self):
        self.requested, self.interrupted, self.previous = False, False, None
        self.final, self.cuttable, self.cut = False, False, False
        try:
            self.previous = signal.signal(signal.SIGINT, self._handle)
        except ValueError:          # not the main thread: Ctrl-C keeps its default behaviour
            pass
        return self

    def _handle(self, signum, frame):
        again, self.requested = self.requested, True
        if self.cuttable or (again and not self.interrupted and not self.final):
            self.interrupted, self.cuttable = True, False
            raise KeyboardInterrupt
        print("\nCtrl-C: " + ("writing the final checkpoint and summary.json" if again or self.final
                              else "stopping after this step (press again to stop at once)"),
              file=sys.stderr, flush=True)

    @contextlib.contextmanager
    def finishing(self):
        """The end of the run: from here on a Ctrl-C never raises, except inside `cut_short`."""
        self.final = True
        yield self

    def cut_short(self, fn, *args):
        """`fn(*args)`, or None if a Ctrl-C stops it (then `cut` is true)."""
        try:
            self.cuttable = True
            try:
                return fn(*args)
            finally:
                self.cuttable = False
        except KeyboardInterrupt:
            self.cut = True
            print("\nCtrl-C: the final test evaluation is cut short; writing summary.json",
                  file=sys.stderr, flush=True)
            return None

    def __exit__(self, *exc):
        if self.previous is not None:
            signal.signal(signal.SIGINT, self.previous)


# --- The command line: every bad input gets one line on stderr and exit code 2 -----------------
class BadInput(Exception):
    pass


class _Parser(argparse.ArgumentParser):
    def error(self, message):              # argparse would print its usage too: one line is enough
        raise BadInput(message)


@functools.cache
def field_help(cls=Config) -> dict[str, str]:
    """Map each dataclass field (inherited ones too) to the string literal written under it (read
    from the source once per class)."""
    helps: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if not dataclasses.is_dataclass(klass):
            continue
        body = ast.parse(textwrap.dedent(inspect.getsource(klass))).body[0].body
        helps.update({node.target.id: nxt.value.value
                      for node, nxt in zip(body, body[1:])
                      if isinstance(node, ast.AnnAssign) and isinstance(nxt, ast.Expr)})
    return helps


def build_parser(cls=Config) -> argparse.ArgumentParser:
    """One flag per dataclass field, typed from its annotation: bool is a switch, `X | None` takes
    an X (None, the default, means "not given")."""
    helps, hints = field_help(cls), typing.get_type_hints(cls)
    parser = _Parser(description="GSPO in one file: Group Sequence Policy Optimization, annotated.",
                     epilog="Every bad input gets one line on stderr and exit code 2, before any "
                            "model is built.",
                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    for f in dataclasses.fields(cls):
        flag, kind = "--" + f.name.replace("_", "-"), hints[f.name]
        if kind is bool:
            parser.add_argument(flag, action="store_true", help=helps.get(f.name, ""))
            continue
        options = [t for t in typing.get_args(kind) if t is not type(None)]
        if options:                                          # int | None -> int
            kind = options[0]
        parser.add_argument(flag, type=kind, default=f.default, help=helps.get(f.name, ""))
    return parser


def parse_config(argv: list[str] | None = None, cls=Config) -> Config:
    """The flags given, over the task's own defaults (TASK_DEFAULTS), over the dataclass's; checked."""
    cfg = settings_of(argv, cls)
    validate(cfg)
    return cfg


def settings_of(argv: list[str] | None = None, cls=Config) -> Config:
    """parse_config without the checks that look at the disk and the ranges (`validate`): the
    settings a command line gives, for comparing a finished run's with a job's."""
    unset = object()          # argparse fills in a default only where the namespace has no value yet
    blank = argparse.Namespace(**{f.name: unset for f in dataclasses.fields(cls)})
    ns = build_parser(cls).parse_args(argv, blank)
    given = {k: v for k, v in vars(ns).items() if v is not unset}                 # on the line
    if "data" in given and not given["data"]:
        raise BadInput("--data needs a file name")
    if "data" in given and "task" in given:
        raise BadInput("--task and --data exclude each other: the problems come from a built-in task "
                       "or from your file")
    if "reward" in given and "data" not in given:
        raise BadInput("--reward is --data's; each --task has a reward of its own (see --help)")
    return cls(**{**TASK_DEFAULTS.get(given.get("task", cls.task), {}), **given})


# The range of every numeric flag but the clip widths (theirs depends on the loss), checked before
# anything is built: (lowest, highest, why), None where that side is open. The upper bounds are
# generous: they are there so that a slip of the keyboard (an extra zero or three) gets one line
# instead of a run that swaps, or never ends.
MAX_ROLLOUT = 2 ** 16          # completions per rollout, --prompts-per-step x --group-size
MAX_HELD_OUT = 100_000         # --test-size + --val-size: every evaluation scores all of them
MICRO_BATCH_ABOVE = 20_000_000  # parameters: above, --micro-batch defaults to
MICRO_BATCH_TOKENS = 1024       # this many completion tokens per forward and backward pass
SAMPLE_TOKENS = 4096            # with a micro-batch, a rollout samples whole groups of at most this
                                # many rows x --max-new-tokens at a time (its KV cache bounded)
MAX_NEW_TOKENS_BUILT_IN = 1024   # the built-in model's longest answer (addwork's) is 60 tokens
FLAG_RANGES = {
    "seed": (0, 2 ** 64 - 1, "torch.manual_seed's range; random.Random would read -s as s"),
    "steps": (1, 10 ** 7, "ten million steps are months of the default run"),
    "warmup_max_steps": (0, 10 ** 7, "ten million steps are months of the default run"),
    "group_size": (2, MAX_ROLLOUT, "advantages compare the responses to one prompt"),
    "prompts_per_step": (1, MAX_ROLLOUT // 2, "with at least 2 completions each"),
    "minibatches": (1, None, "at most --prompts-per-step, checked below"),
    "micro_batch": (0, None, "rows per pass; 0: the whole minibatch"),
    "warmup_batch": (1, MAX_ROLLOUT, "problems per supervised step"),
    "eval_every": (1, None, "above --steps: once, at the end"),
    "val_size": (1, MAX_HELD_OUT, "every evaluation scores them all"),
    "test_size": (1, MAX_HELD_OUT, "every evaluation scores them all"),
    "max_new_tokens": (1, None, "checked against the model's positions below"),
    "threads": (0, 4 * (os.cpu_count() or 1), f"0: torch's default; at most 4 per core of this "
                                              f"machine's {os.cpu_count() or 1}"),
    "warmup_target": (0, 1, "an accuracy: above 1 the warm-up could never reach it"),
    "grad_clip": (0, None, "0: no clipping"),
    "off_policy_mask": (0, None, "a rise in cross-entropy, in nats"),
}
# Where infinity would read as "off", the flag has its own spelling of off.
OFF_SPELLING = {"grad_clip": "; no clipping is --grad-clip 0",
                "off_policy_mask": "; no mask is no --off-policy-mask",
                "warmup_target": "; no warm-up is --warmup-max-steps 0"}


def flag_of(name: str) -> str:
    return "--" + name.replace("_", "-")


def eval_steps(cfg: Config) -> set[int]:
    """The RL steps that end with a validation evaluation and a checkpoint: every --eval-every'th,
    each of --eval-at's (a comma-separated list, checked by `validate`) and the last."""
    extra = {int(v) for v in cfg.eval_at.split(",") if v.strip()}
    return {step for step in range(1, cfg.steps + 1) if step % cfg.eval_every == 0} | extra | {cfg.steps}


def validate(cfg: Config) -> None:
    """Raise BadInput for anything the run would choke on later: every flag is checked here, before
    a model is built or a file written."""
    if cfg.loss not in LOSSES:
        raise BadInput(f"unknown --loss {cfg.loss!r}; choose one of {', '.join(LOSSES)}")
    if cfg.task not in TASKS:
        raise BadInput(f"unknown --task {cfg.task!r}; choose one of {', '.join(TASKS)}")
    if cfg.reward not in REWARDS:
        raise BadInput(f"unknown --reward {cfg.reward!r}; choose one of {', '.join(REWARDS)}")
    if cfg.device not in ("auto", "cpu", "cuda"):
        raise BadInput(f"unknown --device {cfg.device!r}; choose auto, cpu or cuda")
    for f in dataclasses.fields(cfg):        # every number finite: argparse's float() takes nan and inf
        value = getattr(cfg, f.name)
        if isinstance(value, float) and not math.isfinite(value):
            raise BadInput(f"{flag_of(f.name)} must be a finite number, got {value}"
                           f"{OFF_SPELLING.get(f.name, '')}")
    for name, (low, high, why) in FLAG_RANGES.items():
        value = getattr(cfg, name)
        if value is not None and not ((low is None or value >= low) and (high is None or value <= high)):
            where = f"at least {low}" if high is None else f"between {low} and {high}"
            raise BadInput(f"{flag_of(name)} must be {where} ({why}), got {value}")
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
    if cfg.is_correction != "none":
        if cfg.sampler_dtype == "float32":
            raise BadInput("--is-correction corrects a sampler that differs from the trainer; it needs "
                           "--sampler-dtype bfloat16 or float16")
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
    if cfg.eps_engine is not None:
        if not (math.isfinite(cfg.eps_engine) and cfg.eps_engine >= 0):
            raise BadInput(f"--eps-engine (Z, the noise's width in standard deviations) must be a finite "
                           f"number >= 0, got {cfg.eps_engine}")
        if cfg.loss != "gspo":
            raise BadInput(f"--eps-engine calibrates GSPO's band on s; not for --loss {cfg.loss}")
        if not (cfg.record_noise or (cfg.old_logprobs == "sampler" and cfg.sampler_dtype != "float32")):
            raise BadInput("--eps-engine calibrates the band for an engine's record as pi_old: it needs "
                           "--old-logprobs sampler with a bf16 or fp16 sampler, or --record-noise")
    if cfg.scale_rewards not in ("group", "none"):
        raise BadInput(f"unknown --scale-rewards {cfg.scale_rewards!r}; choose group or none")
    if cfg.prompts_per_step * cfg.group_size > MAX_ROLLOUT:
        raise BadInput(f"--prompts-per-step x --group-size is {cfg.prompts_per_step * cfg.group_size} "
                       f"completions per rollout; at most {MAX_ROLLOUT}")
    for name in ("lr", "warmup_lr"):          # above 1 nothing learnt survives a step, and a huge lr
        if not 0 < getattr(cfg, name) <= 1:   # overflows the weights through AdamW's weight decay alone
            raise BadInput(f"{flag_of(name)} must lie in (0, 1] (each AdamW step moves every weight by "
                           f"about this much), got {getattr(cfg, name)}")
    if not 0.01 <= cfg.temperature <= 100:
        raise BadInput(f"--temperature must lie in [0.01, 100] (below, every completion of a prompt is "
                       f"the greedy one and every group flat; above, sampling is noise), got "
                       f"{cfg.temperature}")
    task = task_of(cfg)                       # a --data file is read and checked here (`read_data`)
    n, room = problem_count(task), min(held_out_room(task), MAX_HELD_OUT)
    if cfg.test_size + cfg.val_size > room:
        of = (f"--data {cfg.data} (its {n} rows but one, to train on" if cfg.data else
              f"{cfg.task} (half of its {n} problems")
        raise BadInput(f"--test-size + --val-size must be at most {room} for {of}, and at most "
                       f"{MAX_HELD_OUT}), got {cfg.test_size + cfg.val_size}")
    if not cfg.model and cfg.max_new_tokens > MAX_NEW_TOKENS_BUILT_IN:
        raise BadInput(f"--max-new-tokens must be at most {MAX_NEW_TOKENS_BUILT_IN} for the built-in "
                       f"model (each token is a position), got {cfg.max_new_tokens}")
    if cfg.data and not cfg.model:
        problem = built_in_model_problem(task, cfg.max_new_tokens)
        if problem:
            raise BadInput(f"--data {cfg.data}: {problem}")
    if cfg.task == "add2-chat" and not cfg.model:
        raise BadInput("--task add2-chat asks in words: it needs a pretrained --model, not the "
                       "built-in character tokenizer")
    if cfg.moe and cfg.model:
        raise BadInput("--moe builds the built-in mixture-of-experts model; drop it or --model")
    if cfg.minibatches > cfg.prompts_per_step:
        raise BadInput("--minibatches cannot exceed --prompts-per-step (a minibatch holds whole groups)")
    if cfg.device == "cuda" and not torch.cuda.is_available():
        raise BadInput("--device cuda, but torch sees no CUDA device")
    if (cfg.sampler_dtype == "bfloat16" and pick_device(cfg).type == "cuda"
            and not torch.cuda.is_bf16_supported()):
        raise BadInput("--sampler-dtype bfloat16, but this CUDA device does not support bfloat16")
    problem = out_problem(cfg.out)
    if problem:
        raise BadInput(problem)
    positions = None                          # the --model's positions, where its config says
    if cfg.model and (cfg.model.endswith(".gguf") or os.path.lexists(cfg.model)):
        problem = local_model_problem(cfg.model)
        if problem:
            raise BadInput(f"--model {cfg.model}: {problem}")
    if cfg.model.endswith(".gguf"):
        import importlib.util
        if importlib.util.find_spec("gguf") is None:
            raise BadInput(f"--model {cfg.model}: a .gguf file needs the gguf package "
                           "(pip install -r requirements-pretrained.txt)")
    elif cfg.model and not os.path.isdir(cfg.model):
        if cfg.model.startswith((".", "/", "~")) or os.sep in cfg.model.rstrip("/").split("/", 1)[-1]:
            raise BadInput(f"--model {cfg.model}: no such folder")
        try:                                  # a hub id: one cheap config fetch tells if it resolves
            from transformers import AutoConfig
            positions = getattr(AutoConfig.from_pretrained(cfg.model), "max_position_embeddings", None)
        except Exception as err:              # offline, unknown id, no access: one line, no traceback
            raise BadInput(f"--model {cfg.model}: cannot load ({type(err).__name__}); "
                           "pass a local folder or check the name and your connection") from None
    elif cfg.model:
        try:
            with open(os.path.join(cfg.model, "config.json")) as f:
                positions = json.load(f).get("max_position_embeddings")
        except (OSError, ValueError, AttributeError):
            pass
    if isinstance(positions, int) and cfg.max_new_tokens >= positions:
        raise BadInput(f"--max-new-tokens {cfg.max_new_tokens} leaves no room for a prompt in the "
                       f"{positions} positions of --model {cfg.model}")


WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                "pytorch_model.bin.index.json")


def local_model_problem(path: str) -> str | None:
    """Why the local --model `path` (a .gguf file, or a folder as save_pretrained writes it) cannot
    be loaded, as far as a look at its files tells; None when it looks loadable. What only loading
    finds (truncated weights, a corrupt GGUF body) `prepare` reports in one line as well."""
    if path.endswith(".gguf"):
        if not os.path.isfile(path):
            return "no such file"
        with open(path, "rb") as f:
            magic = f.read(4)
        return (None if magic == b"GGUF" else "the file is empty" if not magic else
                f"not a GGUF file (a GGUF file starts with the bytes GGUF, this one with {magic!r})")
    if not os.path.isdir(path):
        return "not a folder (a --model path is a save_pretrained folder or a .gguf file)"
    if not os.path.isfile(os.path.join(path, "config.json")):
        return "no config.json in it (a model folder is what save_pretrained writes)"
    try:
        with open(os.path.join(path, "config.json")) as f:
            config = json.load(f)
    except (OSError, ValueError) as err:
        return f"its config.json cannot be read ({type(err).__name__}: {err})"
    if not isinstance(config, dict) or "model_type" not in config:
        return "its config.json names no model_type"
    if not any(os.path.exists(os.path.join(path, name)) for name in WEIGHT_FILES):
        return f"no weights in it (none of {', '.join(WEIGHT_FILES)})"
    return None


def unwritable_characters(tokenizer, task: str | DataTask) -> str:
    """The characters of the task's prompts and solutions (50 drawn problems; every row of a file)
    that `tokenizer` cannot write (each one encoded alone and decoded again), e.g. '|' for an add2
    checkpoint on addwork: an answer it cannot write can never earn a reward."""
    rng = random.Random(DATA_SEED)
    problems = task.rows if isinstance(task, DataTask) else [draw_problem(task, rng) for _ in range(50)]
    text = "".join(prompt_text(task, a, b) + solution_text(task, a, b) for a, b in problems)
    return "".join(c for c in sorted(set(text)) if not c.isspace() and tokenizer.decode(
        tokenizer(c, add_special_tokens=False).input_ids, skip_special_tokens=True).strip() != c)


def pick_device(cfg: Config) -> torch.device:
    if cfg.device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(cfg.device)


def prepare(cfg: Config):
    """Threads, seed and device, then the model and tokenizer (`build`): how every run begins.
    A --model that fails to load, or whose tokenizer cannot write the task, is BadInput."""
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    from transformers.utils import logging as hf_logging
    hf_logging.disable_progress_bar()       # no "Writing model shards" bar at every checkpoint
    torch.manual_seed(cfg.seed)
    device = pick_device(cfg)
    try:
        model, tokenizer = build(cfg, device)
    except Exception as err:       # what only loading finds (truncated weights, a corrupt GGUF body)
        if not cfg.model:
            raise
        reason = (str(err).strip().splitlines() or [""])[0][:200]
        raise BadInput(f"--model {cfg.model}: cannot load it ({type(err).__name__}: {reason})") from None
    if cfg.micro_batch is None:     # the default: big models' activations on long answers need it
        big = sum(p.numel() for p in model.parameters()) > MICRO_BATCH_ABOVE
        cfg.micro_batch = max(1, MICRO_BATCH_TOKENS // cfg.max_new_tokens) if big else 0
    missing = unwritable_characters(tokenizer, task_of(cfg)) if cfg.model else ""
    if missing:
        needs = f"--data {cfg.data}" if cfg.data else f"--task {cfg.task}"
        raise BadInput(f"--model {cfg.model}: its tokenizer cannot write {missing!r}, which {needs} "
                       "needs (a checkpoint of another task?)")
    return device, model, tokenizer


# --- --data: a JSONL file of problems, read once and checked line by line ----------------------
JSON_KINDS = {dict: "an object", list: "an array", str: "a string", int: "a number", float: "a number",
              bool: "true or false", type(None): "null"}


@functools.cache
def read_data(path: str, reward: str) -> DataTask:
    """The rows of a --data file: one JSON object a line (blank lines skipped) with non-empty string
    fields "prompt" and "answer" (other fields ignored), no prompt twice, an integer answer for
    --reward last-number. The answer is stripped, as the reward strips a completion. Anything else
    is BadInput, naming the line. Cached for the process: a run reads its file once (`task_of`), so
    its problems never change under it (code that rewrites the file in-process calls cache_clear)."""
    if not os.path.isfile(path):
        raise BadInput(f"--data {path}: " + ("not a file" if os.path.exists(path) else "no such file"))
    rows, first_seen = [], {}
    try:
        with open(path, encoding="utf-8-sig") as f:       # -sig: a byte-order mark is not JSON
            for number, line in enumerate(f, 1):
                if not line.strip():
                    continue
                prompt, answer = data_row(line, f"--data {path} line {number}", reward)
                if prompt in first_seen:
                    raise BadInput(f"--data {path} line {number} repeats the prompt of line "
                                   f"{first_seen[prompt]}: a prompt may appear once, so that no "
                                   "held-out prompt is trained on")
                first_seen[prompt] = number
                rows.append((prompt, answer))
    except (OSError, UnicodeDecodeError) as err:
        raise BadInput(f"--data {path}: cannot read it ({type(err).__name__}: {err})") from None
    if not rows:
        raise BadInput(f"--data {path} is empty: write one JSON object a line, "
                       '{"prompt": "...", "answer": "..."}')
    return DataTask(path, reward, tuple(rows))


def data_row(line: str, where: str, reward: str) -> tuple[str, str]:
    """One line of a --data file -> (prompt, answer), or BadInput saying what is wrong with it."""
    try:
        row = json.loads(line)
    except json.JSONDecodeError as err:
        raise BadInput(f"{where} is not JSON ({err.msg})") from None
    if not isinstance(row, dict):
        raise BadInput(f'{where} is {JSON_KINDS[type(row)]}, not an object {{"prompt": ..., "answer": ...}}')
    for field in ("prompt", "answer"):
        if field not in row:
            raise BadInput(f"{where} has no {field!r} field")
        if not isinstance(row[field], str):
            raise BadInput(f"{where}: {field!r} must be a string, got {JSON_KINDS[type(row[field])]}")
        if not row[field].strip():
            raise BadInput(f"{where}: {field!r} is empty")
    answer = row["answer"].strip()
    if reward == "last-number" and not re.fullmatch(r"-?\d+", answer):
        raise BadInput(f"{where}: --reward last-number compares the last number of a completion with "
                       f"the answer, which must be an integer, got {answer[:40]!r}")
    return row["prompt"], answer


def built_in_model_problem(task: DataTask, max_new_tokens: int) -> str | None:
    """Why the built-in model cannot learn a file's rows, or None: it has a token for each of
    `tiny_characters` only, and writes an answer a character a token, then EOS."""
    used = set("".join(prompt + answer for prompt, answer in task.rows))
    foreign = "".join(sorted(used - set(tiny_characters(task))))
    if foreign:
        return (f"it uses characters the built-in model has no token for, {foreign[:60]!r} (it has "
                f"{tiny_characters(task)!r}): pass a --model with a tokenizer of its own")
    longest = max(len(answer) for _, answer in task.rows)
    if longest >= max_new_tokens:
        return (f"its longest answer has {longest} characters, which the built-in model writes in "
                f"{longest + 1} tokens with EOS: give --max-new-tokens {longest + 1} or more")
    return None


if __name__ == "__main__":
    sys.exit(main())

"""GSPO in one file: Group Sequence Policy Optimization, annotated, on a model that learns on a laptop CPU.

    python gspo_minimal.py                 # the default run (`make train`): 1.05M-parameter model, 2-digit addition
    python gspo_minimal.py --loss grpo     # the same run with GRPO's token-level objective
    python gspo_minimal.py --data f.jsonl  # your own problems (JSONL); --model DIR: any Hugging Face causal LM
    python gspo_minimal.py --help          # every hyperparameter, with its meaning

GSPO (Zheng et al., "Group Sequence Policy Optimization", arXiv 2507.18071, eq. 7) weights each sampled response
y by the length-normalised sequence ratio s. With y's per-token cross-entropy H(y) = -(1/|y|) sum_t log pi(y_t|x,y_<t)
and perplexity PPL = exp(H) (Chi Liu, "Rethinking GSPO: The Perplexity-Entropy Equivalence", arXiv 2510.23142):

    s = (pi_new(y|x) / pi_old(y|x)) ** (1/|y|) = PPL_old(y) / PPL_new(y) = exp(H_old(y) - H_new(y))

so GSPO scales the policy gradient by how much LESS perplexed the new policy is by the response.

One GSPO step, as `train` runs it after a supervised `warmup`:
  1. sample_train_problems  prompts_per_step problems, none from the test or validation set
  2. rollout                the policy as it is now, pi_old, answers each problem G times:
       sample_completions     temperature 1, a KV cache; `reward` scores each answer, and
       group_advantages       A_i = (r_i - mean of its group) / std of its group
  3. rl_update              the rollout in `minibatches` chunks of whole groups; for each chunk:
       group_policy_logprobs  log pi_theta(y_t) of every answer token; pi_old (nothing stored at sampling):
                              chunk 1's own pass, detached, the others' from one pass before any step
       gspo_loss              -mean_i min(s_i A_i, clip(s_i, 1 - 3e-4, 1 + 4e-4) A_i), s_i by importance_ratio
       AdamW                  one step; every chunk after the first is off-policy (ratio_metrics logs s,
                              the clipped shares and PPO's approximate KL)
  4. accuracy               every eval_every steps, greedy answers on the validation set

Needs torch >= 2.6 (clip_grads_with_norm_) and transformers >= 5.0 (`cache=`, `dtype=`), read from the
APIs it calls and tested at requirements.txt's pins only. `group_advantages` to `grpo_loss` need only torch:
copy them as they are. gspo_lab.py imports this file and holds GSPO's relatives, samplers and tasks.
Simplified, as said where it happens: a tiny model (4 layers, width 128); a supervised warm-up first; no
KL penalty or reference model (the paper omits it "for brevity"); the advantage's std gets verl's eps 1e-6.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass

import torch


# --- Hyperparameters: the string under each field is its --help text ------------------------------
@dataclass
class Config:
    """the algorithm's flags (gspo_minimal.py takes these)"""
    loss: str = "gspo"
    """objective: gspo (sequence ratio, eq. 5), gspo-token (eqs. 13-14) or grpo (token ratio, eq. 2)"""
    data: str = ""
    """your own problems: a JSONL file of {"prompt": ..., "answer": ...} lines (the built-in model writes 0-9+*=|)"""
    reward: str = "exact"
    """--data's reward: exact (the stripped completion is the answer) or last-number (its last number is)"""
    model: str = ""
    """Hugging Face causal LM with its tokenizer: a hub id or a local folder; empty: the built-in tiny model"""
    no_chat_template: bool = False
    """write prompts as plain text even when the tokenizer has a chat template"""
    device: str = "auto"
    """auto (CUDA when available, else CPU), cpu or cuda"""
    seed: int = 0
    """seed for model initialisation, sampling and the training prompts (the test set is fixed)"""
    group_size: int = 8
    """G: completions sampled per prompt; advantages are normalised within each group"""
    prompts_per_step: int = 32
    """prompts per rollout; a rollout holds prompts_per_step * group_size completions"""
    minibatches: int = 4
    """optimiser steps per rollout; every one after the first is off-policy"""
    eps_low: float | None = None
    """lower clip width: clip(s, 1 - eps_low, ...); default 3e-4 for GSPO, 0.2 for GRPO"""
    eps_high: float | None = None
    """upper clip width: clip(s, ..., 1 + eps_high); default 4e-4 for GSPO, 0.27 for GRPO"""
    lr: float = 2e-4
    """AdamW learning rate of the RL stage, decayed linearly to 0 over --steps"""
    steps: int = 500
    """RL steps (one rollout and its minibatch updates each)"""
    max_new_tokens: int = 6
    """longest completion sampled; a completion without EOS by then gets reward 0"""
    temperature: float = 1.0
    """sampling temperature, 0.01 to 100; the log-probs score logits / temperature, the sampler's distribution"""
    out: str = "runs/train"
    """output folder: metrics.jsonl, summary.json, curves.png and checkpoint/ (Hugging Face format)"""
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
    val_size: int = 300
    """validation problems: they drive every decision"""
    test_size: int = 500
    """test problems: used only for the two accuracies in summary.json"""
    grad_clip: float = 1.0
    """clip the gradient norm at this value (0: off)"""
    threads: int = 0
    """CPU threads for torch (0: torch's default; at most 4 per core)"""


DEFAULT_EPS = {"gspo": (3e-4, 4e-4), "gspo-token": (3e-4, 4e-4), "grpo": (0.2, 0.27)}


def resolved_eps(cfg: Config) -> tuple[float, float]:
    """The clip widths: the flags, or the loss's own defaults (GSPO 3e-4/4e-4, GRPO 0.2/0.27)."""
    low, high = DEFAULT_EPS[cfg.loss]
    return (low if cfg.eps_low is None else cfg.eps_low, high if cfg.eps_high is None else cfg.eps_high)


# --- Task and reward: 2-digit addition ------------------------------------------------------------
# A problem is a pair: the operands (a, b) for add2; with --data, a row's (prompt, answer).
DATA_SEED = 1234  # fixed: every run, whatever its --seed, is scored on the same test problems


class Add2:
    """a + b for a, b < 100, asked '07+45=' (zero-padded: every prompt has one length), answered '52' then EOS."""
    name, n, op = "add2", 100, "+"
    characters = "0123456789+*="          # the tokenizer's; '*' (the lab's mul2's) is unused here, kept as
                                          # one character less would change the tiny model's initial weights

    def draw(self, rng: random.Random) -> tuple:
        return rng.randrange(self.n), rng.randrange(self.n)

    def count(self) -> int:               # distinct problems: 3+4 and 4+3 are two
        return self.n * self.n

    def room(self) -> int:                # at most half the problems may be held out
        return self.count() // 2

    def prompt(self, a, b) -> str:
        return f"{a:02d}{self.op}{b:02d}="

    def answer(self, a, b) -> str:        # what the reward checks
        return str(a + b)

    def solution(self, a, b) -> str:      # what the warm-up teaches the model to write
        return self.answer(a, b)

    def score(self, text: str, answer: str) -> float:
        return float(text.strip() == answer)

    def longest_prompt(self) -> int:
        return len(self.prompt(0, 0))


ADD2 = Add2()


def make_splits(task, test_size: int, val_size: int) -> dict:
    """The fixed test set first, then validation; training later samples only from the rest."""
    if test_size + val_size > task.room():
        raise ValueError(f"{task.name} has {task.count()} problems: too few for {test_size + val_size} held out")
    rng = random.Random(DATA_SEED)
    held: dict[tuple, None] = {}                   # a dict keeps the order in which problems were drawn
    while len(held) < test_size + val_size:
        held[task.draw(rng)] = None
    pairs = list(held)
    return {"task": task, "test": pairs[:test_size], "val": pairs[test_size:], "held_out": set(pairs)}


def sample_train_problems(splits: dict, k: int, rng: random.Random) -> list[tuple]:
    """k training problems drawn as the held-out ones were, from outside the test and validation sets."""
    out: list[tuple] = []
    while len(out) < k:
        pair = splits["task"].draw(rng)
        if pair not in splits["held_out"]:
            out.append(pair)
    return out


def reward(completion_ids: list[int], answer: str, tokenizer, *, task=ADD2) -> float:
    """The task's score of the text before the first EOS; 0.0 without an EOS, so that the policy learns to stop."""
    eos = tokenizer.eos_token_id
    if eos not in completion_ids:
        return 0.0
    return task.score(tokenizer.decode(completion_ids[:completion_ids.index(eos)], skip_special_tokens=True),
                      answer)


# --- Tokenizer and model: a token per character, a tiny Llama from a config (no download) ---------
def build_char_tokenizer(task=ADD2):
    """<pad>, <eos>, <unk> and a token per character of `task.characters` (16 tokens for add2). pad !=
    eos on purpose: a mask built from `tokens != pad` would drop the EOS and the model never learn to stop."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<pad>", "<eos>", "<unk>"]
    vocab = {tok: i for i, tok in enumerate(specials + list(task.characters))}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")  # every character
    tok.decoder = decoders.Fuse()                                              # join without spaces
    tok.add_special_tokens(specials)
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>",
                                   unk_token="<unk>", padding_side="left")


def build_tiny_model(tokenizer, positions: int = 64):
    """1.05M parameters; `positions` holds the longest prompt + completion (RoPE: no weight depends on it)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=128, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=4, max_position_embeddings=positions, pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id, bos_token_id=None, tie_word_embeddings=True))


def build(cfg: Config, device, task):
    """Model and tokenizer: --model's (`load_pretrained`), or the tiny built-in one (weights from torch's seed)."""
    if cfg.model:
        model, tokenizer = load_pretrained(cfg.model)
        if cfg.no_chat_template:          # encode_prompts then writes prompts as plain text
            tokenizer.chat_template = None
    else:
        tokenizer = build_char_tokenizer(task)
        longest = task.longest_prompt() + cfg.max_new_tokens             # a token per character
        model = build_tiny_model(tokenizer, positions=max(64, 1 << (longest - 1).bit_length()))
    return model.to(device), tokenizer


# --- Sampling: G completions per prompt with a KV cache; the mask from the first EOS --------------
def completion_mask(completions: torch.Tensor, eos_id: int) -> torch.Tensor:
    """(B, T) int -> (B, T) bool: True up to and including each row's first EOS (all of a row without one)."""
    is_eos = completions == eos_id
    eos_before = (is_eos.cumsum(-1) - is_eos.long()) > 0   # an EOS strictly earlier in the row
    return ~eos_before


def grouped_prompt_pass(model, prompt_ids, attn, pos, group_size: int, where: str):
    """Each group's prompt run once: the logits after it and its KV cache, repeated for the G rows. A model
    that ignores `cache=` leaves the cache empty, and every later token would lose its prompt: refused."""
    from transformers import DynamicCache

    G, cache = group_size, DynamicCache(config=model.config)
    logits = model(input_ids=prompt_ids[::G], attention_mask=attn[::G], position_ids=pos[::G],
                   cache=cache, use_cache=True, logits_to_keep=1).logits[:, -1]   # (B/G, V)
    if cache.get_seq_length() == 0:
        raise RuntimeError(f"{where}: the model left the KV cache passed as cache= empty (transformers >= 5.0 needed)")
    cache.batch_repeat_interleave(G)                           # every cached tensor: B/G -> B rows
    return logits.repeat_interleave(G, dim=0), cache           # (B, V)


@torch.no_grad()
def sample_completions(model, prompt_ids, prompt_mask, max_new_tokens: int, eos_id: int,
                       pad_id: int, *, temperature: float = 1.0, group_size: int = 1) -> torch.Tensor:
    """One completion per row, (B, T) ids, T <= max_new_tokens, in groups of `group_size`; temperature=0: greedy."""
    attn = prompt_mask.long()                                  # (B, P), 0 on left padding
    pos = (attn.cumsum(-1) - 1).clamp(min=0)                   # (B, P), positions skip the padding
    logits, cache = grouped_prompt_pass(model, prompt_ids, attn, pos, group_size, "sample_completions")
    done = torch.zeros(len(prompt_ids), dtype=torch.bool, device=prompt_ids.device)
    out = []
    for _ in range(max_new_tokens):
        if temperature > 0:                                    # softmax(logits / T): what the log-probs score
            probs = torch.softmax(logits.float() / temperature, dim=-1)
            nxt = torch.multinomial(probs, 1).squeeze(-1)      # (B,)
        else:
            nxt = logits.argmax(-1)
        nxt = torch.where(done, pad_id, nxt)
        out.append(nxt)
        done |= nxt == eos_id
        if done.all():
            break
        attn = torch.cat([attn, torch.ones_like(attn[:, :1])], dim=1)
        pos = pos[:, -1:] + 1
        logits = model(input_ids=nxt[:, None], attention_mask=attn, position_ids=pos, cache=cache,
                       use_cache=True).logits[:, -1]
    return torch.stack(out, dim=1)                             # (B, T)


# --- Group advantages (GSPO eq. 6), token log-probs, the masked mean ------------------------------
# A_i = (r_i - mean(r_1..r_G)) / (std(r_1..r_G) + eps),  std Bessel-corrected (TRL, verl).
def group_advantages(rewards: torch.Tensor, group_size: int, *, eps: float = 1e-6) -> torch.Tensor:
    """rewards (B,), laid out group after group -> advantages (B,). A group whose rewards are all equal
    gets exactly 0, detected: (r - mean) can be a round-off that dividing by (0 + eps) would blow up."""
    if group_size < 2 or rewards.numel() % group_size:
        raise ValueError(f"need group_size >= 2 dividing {rewards.numel()} rewards, got {group_size}")
    r = rewards.reshape(-1, group_size)                        # (B/G, G)
    adv = (r - r.mean(dim=1, keepdim=True)) / (r.std(dim=1, keepdim=True) + eps)
    all_equal = (r == r[:, :1]).all(dim=1, keepdim=True)       # (B/G, 1)
    return torch.where(all_equal, torch.zeros_like(adv), adv).reshape(-1)


# log pi(y_t | x, y_<t) = log_softmax(logits_t)[y_t]
def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, *,
                   chunk_elements: int = 2 ** 22) -> torch.Tensor:
    """logits (B, T, V), tokens (B, T) -> (B, T) log-probs in float32 at least (bf16's ~0.01 nats dwarf GSPO's
    3e-4 band), `chunk_elements` logits at a time: a real vocabulary never needs a float32 (B, T, V)."""
    B, T, V = logits.shape
    dtype = torch.promote_types(logits.dtype, torch.float32)
    flat, idx = logits.reshape(B * T, V), tokens.reshape(B * T, 1).long()     # (B*T, V), (B*T, 1)
    rows = max(1, chunk_elements // max(V, 1))                                  # positions per chunk
    return torch.cat([torch.log_softmax(flat[i:i + rows].to(dtype), dim=-1).gather(-1, idx[i:i + rows])
                      for i in range(0, B * T, rows)]).reshape(B, T)


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Mean of x where mask is true; an empty row gives 0. `torch.where`, never `x * mask`: a NaN or inf
    at a masked position would survive the product (0 * inf = NaN), in the value and the gradient."""
    keep = mask != 0                                           # bool, 0/1 int or 0/1 float masks alike
    total = torch.where(keep, x, torch.zeros((), dtype=x.dtype, device=x.device)).sum(dim)
    return total / keep.sum(dim).clamp(min=1).to(x.dtype)


# --- The ratio identities, with delta_t = log pi_new(y_t) - log pi_old(y_t) -----------------------
#   log s = (1/|y|) sum_t delta_t = H_old(y) - H_new(y)        (a mean of per-token log-ratios)
#   s = exp(log s) = PPL_old(y) / PPL_new(y) = exp(H_old - H_new)
# Everything stays in log space: a product of |y| token probabilities underflows for long y.
def sequence_log_ratio(logp_new, logp_old, mask) -> torch.Tensor:
    """log s_i = (1/|y_i|) sum_t (logp_new - logp_old): (B, T) inputs -> (B,)."""
    return masked_mean(logp_new - logp_old, mask)


# s_i = (pi_new(y_i|x) / pi_old(y_i|x)) ** (1/|y_i|)                                (GSPO eq. 7)
def importance_ratio(logp_new, logp_old, mask) -> torch.Tensor:
    """The sequence importance ratio s (B,): the geometric mean of the token ratios."""
    return torch.exp(sequence_log_ratio(logp_new, logp_old, mask))


# H(y) = -(1/|y|) sum_t log pi(y_t | x, y_<t)
def cross_entropy(logp, mask) -> torch.Tensor:
    """Per-token cross-entropy of the SAMPLED sequence (B,), in nats; not the policy's entropy -sum_v p log p."""
    return -masked_mean(logp, mask)


# PPL(y) = exp(H(y)) = pi(y|x) ** (-1/|y|)
def perplexity(logp, mask) -> torch.Tensor:
    """Perplexity of the sampled sequence (B,); +inf once exp(H) leaves the dtype's range."""
    return torch.exp(cross_entropy(logp, mask))


# gap_i = max(|(PPL_old/PPL_new) / s - 1|, |exp(H_old - H_new) / s - 1|)
def form_gap(logp_new, logp_old, mask) -> torch.Tensor:
    """How far the three forms of s disagree, per row (B,), logged as a diagnostic. Equal in exact arithmetic,
    so this is round-off: about 1e-7 in float32, growing with |H| and |y|; NaN where a PPL overflows."""
    s = importance_ratio(logp_new, logp_old, mask)                          # (B,)
    s_ppl = perplexity(logp_old, mask) / perplexity(logp_new, mask)          # PPL_old / PPL_new
    s_ent = torch.exp(cross_entropy(logp_old, mask) - cross_entropy(logp_new, mask))
    return torch.maximum((s_ppl / s - 1).abs(), (s_ent / s - 1).abs())


# --- The objectives: losses to MINIMISE (the paper's J, sign flipped) -----------------------------
# One term per sequence (a token mean for GRPO), mean over the B sequences. PPO's min(r A, clip(r, 1-eps_low,
# 1+eps_high) A) stops the gradient only where moving on gains: r > 1+eps_high if A > 0, r < 1-eps_low if A < 0.
def clipped_surrogate(ratio, adv, eps_low: float, eps_high: float) -> torch.Tensor:
    """min(r A, clip(r, 1-eps_low, 1+eps_high) A), elementwise; A (B,) against a (B, T) r counts for every token."""
    adv = adv.unsqueeze(-1) if adv.dim() < ratio.dim() else adv
    return torch.minimum(ratio * adv, ratio.clamp(1 - eps_low, 1 + eps_high) * adv)


def clipped_on_active_side(ratio, adv, eps_low: float, eps_high: float) -> torch.Tensor:
    """Where the min picks the clipped term and so the gradient is zero (bool, broadcast shape)."""
    return ((adv > 0) & (ratio > 1 + eps_high)) | ((adv < 0) & (ratio < 1 - eps_low))


def at_least_float32(*logps: torch.Tensor) -> None:
    """Refuse bf16 or fp16 log-probs: their difference rounds to ~0.01 nats, so s = 1 for any smaller update
    and GSPO's 3e-4 band never clips. Values rounded to bf16, then cast to float32, pass unseen."""
    for x in logps:
        if x.dtype not in (torch.float32, torch.float64):
            raise ValueError(f"log-probs in {x.dtype}: a difference of {x.dtype} log-probs rounds s to 1, "
                             "so GSPO's band never clips; pass float32 log-probs")


# J_GSPO = (1/G) sum_i min(s_i A_i, clip(s_i, 1-eps_low, 1+eps_high) A_i)                (eq. 5)
def gspo_loss(logp_new, logp_old, advantages, mask, eps_low: float = 3e-4, eps_high: float = 4e-4
              ) -> torch.Tensor:
    """GSPO, (B, T) log-probs and (B,) advantages; an empty row adds 0 but counts in the 1/B. Unclipped, its
    gradient (eq. 10) s_i A_i (1/|y_i|) sum_t grad log pi(y_it) weights every token of a response alike."""
    at_least_float32(logp_new, logp_old)
    s = importance_ratio(logp_new, logp_old, mask)                     # (B,)
    per_seq = clipped_surrogate(s, advantages, eps_low, eps_high)      # (B,)
    return -torch.where((mask != 0).any(-1), per_seq, torch.zeros_like(per_seq)).sum() / per_seq.numel()


# s_it = sg[s_i] * pi(y_it) / sg[pi(y_it)]                                          (eqs. 13-14)
# J = (1/G) sum_i (1/|y_i|) sum_t min(s_it A_it, clip(s_it, 1-eps_low, 1+eps_high) A_it)
def gspo_token_loss(logp_new, logp_old, advantages, mask, eps_low: float = 3e-4,
                    eps_high: float = 4e-4) -> torch.Tensor:
    """Each s_it has the VALUE s_i (clipping is per sequence) and the GRADIENT s_i grad log pi(y_it), so a token may
    carry its own advantage A_it ((B,) or (B, T)); with A_it = A_i, GSPO's value and gradient (eqs. 15-17)."""
    at_least_float32(logp_new, logp_old)
    keep = mask != 0
    s = importance_ratio(logp_new, logp_old, mask).detach()            # (B,), sg[s_i]
    own = torch.where(keep, logp_new - logp_new.detach(), torch.zeros_like(logp_new))  # value 0, grad of log pi
    s_tok = s.unsqueeze(-1) * torch.exp(own)                           # (B, T), value s_i
    per_tok = clipped_surrogate(s_tok, advantages, eps_low, eps_high)   # (B, T)
    return -masked_mean(per_tok, keep).mean()


# w_it = pi_new(y_it) / pi_old(y_it)
# J_GRPO = (1/G) sum_i (1/|y_i|) sum_t min(w_it A_i, clip(w_it, 1-eps_low, 1+eps_high) A_i)   (eq. 2;
# the paper writes one eps, the asymmetric band is DAPO's "clip-higher", as in its GRPO baseline)
def grpo_loss(logp_new, logp_old, advantages, mask, eps_low: float = 0.2, eps_high: float = 0.27
              ) -> torch.Tensor:
    """GRPO: every token clipped on its own ratio; per-row token mean, then mean over rows."""
    at_least_float32(logp_new, logp_old)
    keep = mask != 0
    log_w = torch.where(keep, logp_new - logp_old, torch.zeros_like(logp_new))       # (B, T)
    per_tok = clipped_surrogate(torch.exp(log_w), advantages, eps_low, eps_high)         # (B, T)
    return -masked_mean(per_tok, keep).mean()


LOSS_FNS = {"gspo": gspo_loss, "gspo-token": gspo_token_loss, "grpo": grpo_loss}


# --- Batches: prompts to tensors, log-probs of given completions, greedy accuracy -----------------
def encode_prompts(tokenizer, texts: list[str], device) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded prompt ids and mask, (B, P) each. With a chat template (an instruct model's) each text
    is a user message, then the assistant's turn opens; the template writes the special tokens."""
    chat = bool(getattr(tokenizer, "chat_template", None))
    if chat:
        texts = [tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                               add_generation_prompt=True) for text in texts]
    enc = tokenizer(texts, padding=True, return_tensors="pt", add_special_tokens=not chat)
    return enc.input_ids.to(device), enc.attention_mask.to(device)


def policy_logprobs(model, prompt_ids, prompt_mask, completions, *, temperature: float | None = 1.0):
    """log pi(y_t | x, y_<t) for every completion position: (B, T), differentiable, from one pass over prompt +
    completion; the logits divided by the sampler's `temperature` (None: as they are), to score what sampled."""
    ids = torch.cat([prompt_ids, completions], dim=1)                    # (B, P+T)
    attn = torch.cat([prompt_mask.long(), torch.ones_like(completions)], dim=1)
    pos = (attn.cumsum(-1) - 1).clamp(min=0)
    T = completions.shape[1]        # logits_to_keep: not the prompt's (B, P, V), a real vocabulary's memory
    logits = model(input_ids=ids, attention_mask=attn, position_ids=pos, use_cache=False,
                   logits_to_keep=T + 1).logits[:, :-1]                   # (B, T, V): predicts y_1..y_T
    if temperature:
        logits = logits / temperature
    return token_logprobs(logits, completions)


def group_policy_logprobs(model, prompt_ids, prompt_mask, completions, group_size: int, *,
                          temperature: float | None = 1.0):
    """`policy_logprobs` of rows in groups of `group_size` identical prompts, each prompt run once and its KV
    cache repeated under the G completions: the same numbers and gradient, the prompt not recomputed G times."""
    P, T = prompt_ids.shape[1], completions.shape[1]
    attn = torch.cat([prompt_mask.long(), torch.ones_like(completions)], dim=1)     # (B, P+T)
    pos = (attn.cumsum(-1) - 1).clamp(min=0)
    first, cache = grouped_prompt_pass(model, prompt_ids, attn[:, :P], pos[:, :P], group_size,
                                       "group_policy_logprobs")                 # (B, V): predicts y_1
    logits = first[:, None]                                                     # (B, 1, V)
    if T > 1:
        rest = model(input_ids=completions[:, :-1], attention_mask=attn[:, :-1],     # y_1..y_{T-1} after the
                     position_ids=pos[:, P:-1], cache=cache, use_cache=True).logits  # P cached: (B, T-1, V)
        logits = torch.cat([logits, rest], dim=1)                               # (B, T, V): y_1..y_T
    if temperature:
        logits = logits / temperature
    return token_logprobs(logits, completions)


@torch.no_grad()
def accuracy(model, tokenizer, task, problems, max_new_tokens: int, device, batch_size: int = 512) -> float:
    """Greedy accuracy (the task's reward, EOS required) over a list of problems."""
    hits = 0.0
    for i in range(0, len(problems), batch_size):
        chunk = problems[i:i + batch_size]
        ids, attn = encode_prompts(tokenizer, [task.prompt(a, b) for a, b in chunk], device)
        comp = sample_completions(model, ids, attn, max_new_tokens, tokenizer.eos_token_id,
                                  tokenizer.pad_token_id, temperature=0.0)
        hits += sum(reward(row, task.answer(a, b), tokenizer, task=task)
                    for row, (a, b) in zip(comp.tolist(), chunk))
    return hits / len(problems)


# --- Supervised warm-up: teach the answer format until some sampled answers are right -------------
# GSPO's signal is the reward spread INSIDE a group: a random model answers nothing right, every advantage is 0.
# At `warmup_target` (0.3) validation accuracy enough groups hold both. (The paper starts from a pretrained model.)
def supervised_loss(model, tokenizer, task, problems, device) -> torch.Tensor:
    """Mean token negative log-likelihood of 'solution<eos>' after each prompt."""
    ids, attn = encode_prompts(tokenizer, [task.prompt(a, b) for a, b in problems], device)
    answers = [torch.tensor(tokenizer(task.solution(a, b), add_special_tokens=False).input_ids
                            + [tokenizer.eos_token_id]) for a, b in problems]
    target = torch.nn.utils.rnn.pad_sequence(answers, batch_first=True,
                                             padding_value=tokenizer.pad_token_id).to(device)   # (B, T)
    mask = completion_mask(target, tokenizer.eos_token_id)              # up to each answer's EOS
    logp = policy_logprobs(model, ids, attn, target, temperature=None)  # (B, T), the plain logits
    return -masked_mean(logp.flatten(), mask.flatten())


def warmup(model, tokenizer, splits, cfg: Config, device, rng: random.Random, run, stop) -> int:
    """Train on correct answers until validation accuracy >= cfg.warmup_target. Returns steps taken."""
    task = splits["task"]
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.warmup_lr)
    val_acc = accuracy(model, tokenizer, task, splits["val"], cfg.max_new_tokens, device)
    step = 0
    while val_acc < cfg.warmup_target and step < cfg.warmup_max_steps and not stop.requested:
        step += 1
        loss = supervised_loss(model, tokenizer, task, sample_train_problems(splits, cfg.warmup_batch, rng), device)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        finite_grad_norm(model, loss, f"warm-up step {step}")   # raises Diverged before a bad update
        opt.step()
        if step % 20 == 0:       # supervised accuracy jumps suddenly: look often, it costs little
            val_acc = accuracy(model, tokenizer, task, splits["val"], cfg.max_new_tokens, device)
            run.log({"stage": "warmup", "step": step, "loss": loss.item(), "val_acc": val_acc},
                    f"warm-up {step} | loss {loss.item():.3f} | val_acc {val_acc:.2f}")
    return step


# --- One GSPO step: a rollout, then `minibatches` clipped updates on it ---------------------------
@torch.no_grad()
def rollout(model, tokenizer, problems, cfg: Config, device, task=ADD2) -> dict:
    """Sample G completions per prompt with the policy as it is now (pi_old), score them, and
    compute group advantages. Tensors (B, ...) with B = len(problems) * G, group after group."""
    G = cfg.group_size
    texts = [task.prompt(a, b) for a, b in problems for _ in range(G)]
    prompt_ids, prompt_mask = encode_prompts(tokenizer, texts, device)            # (B, P)
    completions = sample_completions(model, prompt_ids, prompt_mask, cfg.max_new_tokens, tokenizer.eos_token_id,
                                     tokenizer.pad_token_id, temperature=cfg.temperature, group_size=G)  # (B, T)
    mask = completion_mask(completions, tokenizer.eos_token_id)                    # (B, T)
    answers = [task.answer(a, b) for a, b in problems for _ in range(G)]
    rewards = torch.tensor([reward(row, ans, tokenizer, task=task) for row, ans in
                            zip(completions.tolist(), answers)], device=device)    # (B,)
    if cfg.shuffle_rewards:           # the control: same reward statistics, no relation to answers
        rewards = rewards[torch.randperm(len(rewards), device=device)]
    return {"prompt_ids": prompt_ids, "prompt_mask": prompt_mask, "completions": completions, "mask": mask,
            "rewards": rewards, "advantages": group_advantages(rewards, G)}


# PPO's approximate KL (CleanRL's `approx_kl`): KL(pi_old || pi_theta) ~ mean_t (e^x - 1 - x) >= 0, with x =
# log pi_theta(y_t) - log pi_old(y_t) before the step. As E[x] = -KL under pi_old, the mean of log s (not s_mean)
# is about -approx_kl. In float64: CleanRL's (e^x - 1) - x in float32 is noise at |x| ~ 1e-4.
def ratio_metrics(logp_new, logp_old, adv, mask, loss: str, eps_low: float, eps_high: float, off_policy: bool) -> dict:
    """A minibatch's s (B,), its forms' largest disagreement, and counts. A token is clipped on the min's clipped,
    zero-gradient side; a clipped GSPO response clips all its tokens (as verl counts): one unit with GRPO's."""
    keep = mask != 0
    s = importance_ratio(logp_new, logp_old, mask)                          # (B,)
    seq_clipped = clipped_on_active_side(s, adv, eps_low, eps_high)         # (B,); GSPO's (for GRPO, s on its band)
    log_w = torch.where(keep, logp_new - logp_old, torch.zeros_like(logp_new))          # (B, T)
    if loss == "grpo":                                                      # each token's own ratio
        tok_clipped = clipped_on_active_side(torch.exp(log_w), adv.unsqueeze(-1), eps_low, eps_high) & keep
    else:
        tok_clipped = seq_clipped.unsqueeze(-1) & keep
    x, could_clip = log_w.double(), keep & (adv != 0).unsqueeze(-1)       # A = 0 never clips
    return {"s": s, "form_gap": form_gap(logp_new, logp_old, mask).max().item(),
            "n_clip_tokens": tok_clipped.sum().item(), "n_tokens": keep.sum().item(),
            "n_clip_seqs": seq_clipped.sum().item(), "kl_sum": (torch.expm1(x) - x).sum().item(),
            "n_off_policy": keep.sum().item() if off_policy else 0,       # minibatch 1: s = 1, none clip
            "n_clip_ceiling": could_clip.sum().item() if off_policy else 0}


def summarise_minibatches(logs: list[dict]) -> dict:
    """A step's metrics from its minibatches' `ratio_metrics`, loss and grad_norm (unclipped). `s_mean` is over every
    response, minibatch 1's exact 1s included; `approx_kl` over off-policy tokens (0 with one minibatch);
    `clip_ceiling`, the largest share `clip_tokens` can reach: off-policy tokens with A != 0."""
    s = torch.cat([m["s"] for m in logs])                                  # (B,)
    tokens = max(sum(m["n_tokens"] for m in logs), 1)
    return {"loss": sum(m["loss"] for m in logs) / len(logs), "s_mean": s.mean().item(),
            "s_min": s.min().item(), "s_max": s.max().item(),
            "clip_tokens": sum(m["n_clip_tokens"] for m in logs) / tokens,
            "clip_seqs": sum(m["n_clip_seqs"] for m in logs) / len(s),
            "clip_ceiling": sum(m["n_clip_ceiling"] for m in logs) / tokens,
            "approx_kl": sum(m["kl_sum"] for m in logs) / max(sum(m["n_off_policy"] for m in logs), 1),
            "form_gap": max(m["form_gap"] for m in logs), "grad_norm": max(m["grad_norm"] for m in logs),
            "clip_seqs_by_minibatch": [m["n_clip_seqs"] / len(m["s"]) for m in logs]}


def rl_update(model, opt, batch: dict, cfg: Config, eps_low: float, eps_high: float) -> dict:
    """One clipped step on each of `minibatches` chunks of whole groups. pi_old, the weights that sampled, recomputed:
    chunk 1's own pass, detached (s = 1 exactly), the others' one pass before the first step (so dropout must be
    off). At s = w = 1 GSPO's and GRPO's gradients are the plain policy gradient: they differ only off-policy."""
    G, device = cfg.group_size, batch["rewards"].device
    # random chunks of whole groups (rows kG..kG+G-1) by tensor_split: torch.chunk(5) of 12 groups makes only 4
    groups = torch.randperm(len(batch["rewards"]) // G, device=device).tensor_split(cfg.minibatches)
    chunks = [(grp[:, None] * G + torch.arange(G, device=device)).flatten() for grp in groups]    # row indices
    logprobs = lambda idx: group_policy_logprobs(model, batch["prompt_ids"][idx], batch["prompt_mask"][idx],
                                                 batch["completions"][idx], G, temperature=cfg.temperature)
    old = None                                               # log pi_old of chunks 2, 3, ...
    if len(chunks) > 1:
        later = torch.cat(chunks[1:])
        with torch.no_grad():                                # in one pass, before any update
            passed = logprobs(later)                         # (b', T)
        old = passed.new_zeros(batch["completions"].shape)   # (B, T)
        old[later] = passed
    logs = []
    for k, idx in enumerate(chunks):
        logp_new = logprobs(idx)                                               # (b, T), differentiable
        logp_old = logp_new.detach() if k == 0 else old[idx]                   # (b, T)
        adv, mask = batch["advantages"][idx], batch["mask"][idx] != 0          # (b,), (b, T)
        loss = LOSS_FNS[cfg.loss](logp_new, logp_old, adv, mask, eps_low, eps_high)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        norm = finite_grad_norm(model, loss, f"minibatch {k + 1} of {len(chunks)} of the next step")
        if cfg.grad_clip > 0:      # clip_grad_norm_ without computing the norm a second time
            torch.nn.utils.clip_grads_with_norm_(model.parameters(), cfg.grad_clip, norm)
        opt.step()
        logs.append({**ratio_metrics(logp_new.detach(), logp_old, adv, mask, cfg.loss, eps_low, eps_high,  # pre-step
                                     off_policy=k > 0), "loss": loss.item(), "grad_norm": norm.item()})
    opt.zero_grad(set_to_none=True)         # the gradients' memory is free while the next rollout samples
    return summarise_minibatches(logs)


# --- The training loop: warm-up, GSPO steps, the test set; the whole run is `train()` -------------
def rl_optimizer(model, cfg: Config):
    """AdamW (torch's weight decay 0.01; fused), its rate decayed linearly to 0 over the RL steps as TRL's default."""
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, fused=True)
    return opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda i: 1 - i / cfg.steps)


def train(cfg: Config, model, tokenizer, device, run, stop) -> dict:
    """The whole run: warm-up, `cfg.steps` GSPO steps, the test set; returns what summary.json holds. `run`
    is the run folder (log, checkpoint, finish), `stop.requested` true after Ctrl-C (plumbing, after main)."""
    task = task_of(cfg)                            # add2, or the rows of --data (after main, by read_data)
    splits = make_splits(task, cfg.test_size, cfg.val_size)
    rng = random.Random(cfg.seed)                  # training prompts; the held-out splits are fixed
    eps_low, eps_high = resolved_eps(cfg)
    summary = run.new_summary(cfg, eps_low, eps_high)
    try:
        # 1. Warm-up to cfg.warmup_target; its test accuracy; the first checkpoint (the folder appears).
        summary["warmup_steps"] = warmup(model, tokenizer, splits, cfg, device, rng, run, stop)
        if not stop.requested:                # after a Ctrl-C in the warm-up, straight to the end
            summary["accuracy_before_rl"] = accuracy(model, tokenizer, task, splits["test"], cfg.max_new_tokens, device)
            run.checkpoint(model, tokenizer)
            print(f"warm-up done after {summary['warmup_steps']} steps | "
                  f"test acc {summary['accuracy_before_rl']:.3f}", flush=True)

        # 2. GSPO: each step is one rollout and `minibatches` optimiser steps on it.
        opt, sched = rl_optimizer(model, cfg)
        for step in range(1, cfg.steps + 1):
            if stop.requested:
                break
            t0 = time.perf_counter()
            problems = sample_train_problems(splits, cfg.prompts_per_step, rng)
            batch = rollout(model, tokenizer, problems, cfg, device, task)
            m = rl_update(model, opt, batch, cfg, eps_low, eps_high)
            sched.step()                                 # the learning rate decays once per rollout
            if step % cfg.eval_every == 0 or step == cfg.steps:      # validation, and a checkpoint
                m["val_acc"] = accuracy(model, tokenizer, task, splits["val"], cfg.max_new_tokens, device)
                run.checkpoint(model, tokenizer)
            # Log: one object in metrics.jsonl and one progress line, the same names in both.
            n_tok, dt = int(batch["mask"].sum()), time.perf_counter() - t0   # the whole step's time
            flat = (batch["advantages"].reshape(-1, cfg.group_size) == 0).all(1)   # equal rewards: they teach nothing
            m.update(reward=batch["rewards"].mean().item(), flat_groups=flat.float().mean().item(),
                     response_tokens=n_tok / len(batch["rewards"]), tokens_per_second=n_tok / dt, step_seconds=dt)
            summary["rl_steps"], summary["rl_tokens"] = step, summary["rl_tokens"] + n_tok
            summary["rl_seconds"] += dt
            run.log({"stage": "rl", "step": step, **m}, progress_line(step, cfg, m))
    except KeyboardInterrupt:                            # the second Ctrl-C: stop where we are
        pass
    except Diverged as err:                              # a non-finite loss or gradient: stop here
        summary["stop_reason"] = str(err)
    opt = sched = None          # AdamW's two moments (twice the weights) are not needed to evaluate
    # 3. The end, after Ctrl-C too: a final checkpoint, the test accuracy, summary.json, curves.png.
    return run.finish(summary, model, tokenizer, stop,
                      lambda: accuracy(model, tokenizer, task, splits["test"], cfg.max_new_tokens, device))


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
    print(run_header(cfg, model, device, cfg.data or ADD2.name), flush=True)
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
    return run.exit_code(summary, "gspo_minimal.py")


# =============================================================================================
# Nothing below is GSPO: the plumbing of a run. The story above calls only these entry points: Run (the run
# folder: its log, checkpoint, new_summary and finish, curves.png), run_header and progress_line (its lines),
# GracefulStop (Ctrl-C's flag, stop.requested), Diverged and finite_grad_norm (the non-finite stop), BadInput,
# parse_config, prepare and load_pretrained (the command line, its model), task_of (add2 or --data's rows).
# =============================================================================================
import argparse  # noqa: E402  the plumbing's own imports: the story above needs none of them
import ast  # noqa: E402
import contextlib  # noqa: E402
import dataclasses  # noqa: E402
import functools  # noqa: E402
import inspect  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import os  # noqa: E402
import re  # noqa: E402
import shutil  # noqa: E402
import signal  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import textwrap  # noqa: E402
import typing  # noqa: E402
import weakref  # noqa: E402

# --- The run folder: metrics.jsonl, atomic checkpoints, summary.json --------------------------
MARKER = ".gspo_minimal_run"   # says "this script wrote this folder", so it may be replaced
# all this script (or studies/trl_compare.py) writes into a run folder; anything else is the user's
OURS = {MARKER, "metrics.jsonl", "summary.json", "summary.json.tmp", "curves.png", "checkpoint", "checkpoint.tmp",
        "checkpoint.old", "trl_output"}


def written_by_us(path: str) -> bool:
    """A real folder (not a link) holding our marker file and nothing we would not write."""
    return (os.path.isdir(path) and not os.path.islink(path)
            and os.path.isfile(os.path.join(path, MARKER)) and set(os.listdir(path)) <= OURS)


try:
    import fcntl                      # POSIX: a run's lock on its --out (Windows: no lock)
except ImportError:                   # pragma: no cover
    fcntl = None

# save_pretrained's longest name (model-00001-of-00002.safetensors, 32 bytes) and room to spare, for `path_problem`.
CHECKPOINT_NAME_RESERVE = 48


def lock_path(out: str) -> str:
    """`<out>.lock`: the run writing `out` holds it (flock) its whole life; the lock dies with the process."""
    return os.path.abspath(out) + ".lock"


def lock_holder(out: str) -> str | None:
    """"pid N" of the live run holding `<out>.lock`, or None; creates nothing. A killed run's lock is not held."""
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
    """Hold `<out>.lock` (made if need be) with our pid in it, and return its fd; RuntimeError if a run holds it."""
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
        with contextlib.suppress(FileNotFoundError):  # the run that held it may have just removed it:
            if os.fstat(fd).st_ino == os.stat(path).st_ino:  # then ours is a ghost; open it again
                break
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
    """Why a name the run writes for `out` exceeds NAME_MAX, or its deepest file PATH_MAX; None when all fit."""
    parent = os.path.dirname(out)
    while not os.path.lexists(parent):
        parent = os.path.dirname(parent)

    def limit(name, fallback):
        try:
            return os.pathconf(parent if os.path.isdir(parent) else "/", name)
        except (OSError, ValueError):
            return fallback
    name_max, path_max = limit("PC_NAME_MAX", 255), limit("PC_PATH_MAX", 4096)
    new, base = os.path.relpath(os.path.dirname(out), parent).split(os.sep), os.path.basename(out)
    for name in [n for n in new if n != "."] + [base + s for s in ("", ".incomplete", ".old", ".lock")]:
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
    """Why `out` cannot hold a run, or None (before the model is built): a name too long, `out` or `<out>.incomplete`
    not ours, `<out>.lock` not ours or held, a `<out>.old` (a run killed mid-swap may be in it), no writable parent."""
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
    """`value` with every non-finite float in it as None: JSON has no NaN or Infinity, yet `s_max` may overflow."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: finite_or_null(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite_or_null(v) for v in value]
    return value


class Run:
    """Writes into `<out>.incomplete`, swapped in for `<out>` at the first checkpoint (an earlier run outlives one that
    dies sooner); replaces only folders it marked; holds `<out>.lock` until `close()`: a second run there is refused."""

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
        self.promoted, self.curves = False, None         # curves: curves.png's path once `finish` drew it

    def log(self, record: dict, line: str | None = None) -> None:
        record = {**record, "elapsed": time.perf_counter() - self.t_start,   # seconds since start
                  "cpu_seconds": time.process_time()}          # this process's CPU time, all threads
        with open(os.path.join(self.dir, "metrics.jsonl"), "a") as f:
            f.write(json.dumps(finite_or_null(record), allow_nan=False) + "\n")
        if line:
            print(line, flush=True)

    def checkpoint(self, model, tokenizer, promote: bool = True) -> None:
        """A complete checkpoint in the run folder; the first one (with `promote`) makes the run folder `<out>`."""
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

    def new_summary(self, cfg, eps_low, eps_high) -> dict:
        return {"seed": cfg.seed, "loss": cfg.loss, "eps_low": eps_low, "eps_high": eps_high,
                "warmup_steps": None, "accuracy_before_rl": None, "accuracy_after_rl": None,
                "interrupted": False, "stop_reason": None, "rl_steps": 0, "rl_tokens": 0,
                "rl_seconds": 0.0, "config": dataclasses.asdict(cfg)}

    @staticmethod
    def add_step(summary: dict, step: int, tokens: int, seconds: float) -> None:
        summary["rl_steps"] = step
        summary["rl_tokens"] += tokens
        summary["rl_seconds"] += seconds

    def finish(self, summary: dict, model, tokenizer, stop, test_accuracy) -> dict:
        """The end of a run, Ctrl-C too: a final checkpoint, `test_accuracy()`, summary.json (returned). Not after a
        non-finite step or weight (a finite update can overflow one): then the last checkpoint is the result."""
        with stop.finishing():
            summary["stop_reason"] = summary["stop_reason"] or non_finite_weights(model)
            if stop.requested:
                print("interrupted: writing a final checkpoint and summary.json", file=sys.stderr)
            if summary["stop_reason"] is None:
                # a run stopped in its warm-up stays in <out>.incomplete: an earlier run in --out is kept
                self.checkpoint(model, tokenizer, promote=summary["accuracy_before_rl"] is not None)
                summary["accuracy_after_rl"] = stop.cut_short(test_accuracy)
            summary["final_evaluation_interrupted"] = stop.cut    # then accuracy_after_rl is null
            summary["interrupted"] = stop.requested
            summary["rl_tokens_per_second"] = summary["rl_tokens"] / max(summary["rl_seconds"], 1e-9)
            summary["wall_seconds"] = time.perf_counter() - self.t_start  # the whole run, set-up included
            self.write_summary(summary)
            self.curves = draw_curves(self.dir)
        return summary

    def exit_code(self, summary: dict, script: str) -> int:
        """Print the run's last line (if it diverged, one error line) and return the exit code: 0, 130 (Ctrl-C) or 2."""
        if self.curves:                         # drawn by `finish`, whichever way the run ended
            print(f"curves: {os.path.join(self.given if self.promoted else self.given + '.incomplete', 'curves.png')}")
        if summary["stop_reason"]:
            print(f"{script}: error: {diverged_line(summary, self)}", file=sys.stderr)
            return 2
        print(final_line(summary, self, "RL"), flush=True)
        return 130 if summary["interrupted"] else 0

    def write_summary(self, summary: dict) -> None:
        summary = {**summary, **provenance(self.command, summary.get("wall_seconds"), self.tree)}
        tmp = os.path.join(self.dir, "summary.json.tmp")
        with open(tmp, "w") as f:    # every number in it is finite by construction: a NaN here
            json.dump(summary, f, indent=2, allow_nan=False)   # is a bug, and fails here
        os.replace(tmp, os.path.join(self.dir, "summary.json"))


def draw_curves(folder: str) -> str | None:
    """`folder`/curves.png from its metrics.jsonl, so that a run cut short by Ctrl-C or a non-finite step
    has one too: the rollout reward, validation accuracy (the warm-up's at steps below 0) and the clipped
    share of tokens, by RL step. matplotlib only here, without pyplot: no backend, no window, nothing at
    import. Returns the path, or None where matplotlib is missing."""
    try:
        from matplotlib.figure import Figure
    except ImportError:
        return None
    rows = []
    with contextlib.suppress(FileNotFoundError), open(os.path.join(folder, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    rl = [r for r in rows if r.get("stage") == "rl"]
    warm = [r for r in rows if r.get("stage") == "warmup"]
    last_warm = warm[-1]["step"] if warm else 0
    fig = Figure(figsize=(12, 3.4), layout="constrained")
    reward, acc, clip = fig.subplots(1, 3)
    reward.plot([r["step"] for r in rl], [r["reward"] for r in rl], color="C0")
    acc.plot([r["step"] - last_warm for r in warm], [r["val_acc"] for r in warm], "o-", color="0.6", ms=3,
             label="warm-up")
    acc.plot([r["step"] for r in rl if "val_acc" in r], [r["val_acc"] for r in rl if "val_acc" in r], "o-",
             color="C1", ms=3, label="RL")
    acc.legend(fontsize=8)
    clip.plot([r["step"] for r in rl], [r["clip_tokens"] for r in rl], color="C2")
    for ax, title in ((reward, "mean rollout reward"), (acc, "validation accuracy"), (clip, "clipped share of tokens")):
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("RL step" + ("" if rl else " (the run stopped in its warm-up)"))
    path = os.path.join(folder, "curves.png")
    fig.savefig(path, dpi=90)
    return path


def run_header(cfg, model, device, task_name: str, memory_note: bool = True) -> str:
    """A run's first line (loss, model, size, task, device, seed, folder); above BIG_MODEL, where memory options are."""
    n_params = sum(p.numel() for p in model.parameters())
    line = (f"{cfg.loss} | {type(model).__name__} {n_params / 1e6:.2f}M params | {task_name} | "
            f"device {device} | seed {cfg.seed} | out {cfg.out}")
    if n_params > BIG_MODEL and memory_note:
        line += (f"\nnote: each minibatch runs in one pass; for this model's memory, the lab has --micro-batch "
                 f"and --gradient-checkpointing ({LAB_COMMAND} --help)")
    return line


def progress_line(step: int, cfg: Config, m: dict) -> str:
    """One line per step, each number under its metrics.jsonl name; [s_min, s_max] after s_mean."""
    acc = f" | val_acc {m['val_acc']:.2f}" if "val_acc" in m else ""
    tps = m["tokens_per_second"]
    tps = f"{tps / 1e3:.1f}k" if tps >= 1e3 else f"{tps:.0f}"              # a real model: ~20/s on a CPU
    return (f"step {step}/{cfg.steps} | reward {m['reward']:.2f}{acc} | "
            f"s_mean {m['s_mean']:.4f} [{m['s_min']:.4f}, {m['s_max']:.4f}] | "
            f"clip_tokens {m['clip_tokens']:.3f} | flat_groups {m['flat_groups']:.2f} | "
            f"response_tokens {m['response_tokens']:.1f} | tokens_per_second {tps}")


def final_line(summary: dict, run: Run, trained_by: str) -> str:
    before, after = summary["accuracy_before_rl"], summary["accuracy_after_rl"]
    where = run.given if run.promoted else run.given + ".incomplete"
    return (f"test accuracy: {'n/a' if before is None else f'{before:.3f}'} after warm-up -> "
            f"{'n/a (its evaluation was cut short)' if after is None else f'{after:.3f}'} after "
            f"{trained_by} | "
            f"{summary['wall_seconds']:.0f} s | {where}/summary.json")


def diverged_line(summary: dict, run: Run) -> str:
    kept = (f"its last checkpoint, all finite, is {run.given}/checkpoint" if run.promoted else
            f"no checkpoint was written (an earlier run in {run.given} is untouched)")
    where = run.given if run.promoted else run.given + ".incomplete"
    return (f"stopped after {summary['rl_steps']} RL steps: {summary['stop_reason']}; {kept}; "
            f"{where}/summary.json says so")


# --- Provenance: what made a result (the commit, the tree, the host) --------------------------
# A run repeats bit for bit on one host only: torch picks kernels by instruction set (AVX2, AVX-512, AMX) and splits
# reductions by thread count; float32's last bits move, a sampled token flips: another run. Results name their host.
CPU_FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_fp16", "amx_bf16", "amx_tile", "fma", "f16c")
KERNEL_ENV_PREFIXES = ("OMP_", "MKL_", "KMP_", "MALLOC_", "ATEN_CPU_CAPABILITY")


def cpu_description() -> dict:
    """The CPU as Linux describes it (/proc/cpuinfo, sysfs caches); None where a field is unknown."""
    info: dict[str, str] = {}
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        for line in f:
            if not line.strip():
                break                                      # the first processor is enough
            key, _, value = line.partition(":")
            info[key.strip()] = value.strip()
    caches = {}
    for index in range(8):
        base = f"/sys/devices/system/cpu/cpu0/cache/index{index}"
        with contextlib.suppress(OSError), open(f"{base}/level") as level, open(f"{base}/size") as size:
            caches[f"l{level.read().strip()}"] = size.read().strip()
    flags = set(info.get("flags", "").split())
    import platform
    return {"model_name": info.get("model name") or platform.processor() or None, "vendor": info.get("vendor_id"),
            "family": info.get("cpu family"), "model": info.get("model"), "stepping": info.get("stepping"),
            "l2_cache": caches.get("l2"), "l3_cache": caches.get("l3"),
            "flags": {flag: flag in flags for flag in CPU_FLAGS} if flags else None}


def versions() -> dict:
    """python, torch, and where installed transformers, trl and gguf (package metadata: imported or not, they agree)."""
    import importlib.metadata
    import platform
    out = {"python": platform.python_version(), "torch": torch.__version__}
    for name in ("transformers", "trl", "gguf"):
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            out[name] = importlib.metadata.version(name)
    return out


def host_fingerprint(threads: int | None = None, env: typing.Mapping[str, str] | None = None) -> dict:
    """What, beside code and seed, decides a run's numbers (a study passes a child run's `threads` and `env`)."""
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
    """The fields, nested ones too, in which two host fingerprints differ, one line each; [] when they are equal."""
    if isinstance(recorded, dict) and isinstance(expected, dict):
        return [d for k in sorted(set(recorded) | set(expected))
                for d in host_differences(recorded.get(k), expected.get(k), f"{where}.{k}" if where else k)]
    return [] if recorded == expected else [f"{where or 'host'}: {expected!r} here, {recorded!r} there"]


def tree_state(exclude: typing.Iterable[str] = (), repo: str | None = None) -> dict:
    """measured_at_commit (HEAD), dirty, dirty_paths: the tracked files but `exclude` that differ; None outside git."""
    import subprocess
    here = repo or os.path.dirname(os.path.abspath(__file__))

    def git(*args) -> str | None:
        try:
            res = subprocess.run(["git", "-C", here, *args], capture_output=True, text=True, timeout=10)
        except (OSError, subprocess.SubprocessError):
            return None
        return res.stdout if res.returncode == 0 else None
    head, status = (git("rev-parse", "HEAD") or "").strip(), git("status", "--porcelain", "--untracked-files=no")
    if not head or status is None:
        return {"measured_at_commit": None, "dirty": None, "dirty_paths": None}
    skip = {os.path.normpath(p) for p in exclude}
    paths = sorted({os.path.normpath(line[3:].split(" -> ")[-1].strip('"'))
                    for line in status.splitlines() if line.strip()} - skip)
    return {"measured_at_commit": head, "dirty": bool(paths), "dirty_paths": paths}


def provenance(command: str, seconds: float | None, tree: dict | None = None) -> dict:
    """The keys every JSON of the project carries: command, seconds, tree (`tree_state`), versions, threads, host."""
    host = host_fingerprint()
    return {"command": command, "seconds": seconds, **(tree or tree_state()),
            "versions": host["versions"], "threads": host["threads"], "host": host}


# --- A diverged run: a non-finite loss or gradient stops it before the update is taken ----------
class Diverged(Exception):
    """A non-finite loss, gradient norm or weight: the run stops, and keeps its last checkpoint."""


def finite_grad_norm(model, loss: torch.Tensor, where: str) -> torch.Tensor:
    """The unclipped gradient norm after loss.backward(); Diverged instead, before the optimiser step, where it
    or the loss is not finite."""
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    norm = torch.nn.utils.get_total_norm(grads) if grads else torch.zeros(())
    if not (math.isfinite(loss.item()) and math.isfinite(norm.item())):
        raise Diverged(f"{where} has loss {loss.item():.4g} and gradient norm {norm.item():.4g} (a "
                       "learning rate too high?)")
    return norm


def non_finite_weights(model) -> str | None:
    bad = [name for name, p in model.named_parameters() if not torch.isfinite(p).all()]
    return f"{len(bad)} weight tensors are not finite, {bad[0]} the first" if bad else None


# --- Ctrl-C -----------------------------------------------------------------------------------
class GracefulStop:
    """First Ctrl-C: stop after this step (no checkpoint or worker thread cut in half); a second: at once. Inside
    `finishing` only `cut_short` can be interrupted (`cut` turns true): the final files are always written."""

    def __enter__(self):
        self.requested, self.interrupted, self.previous = False, False, None
        self.final, self.cuttable, self.cut = False, False, False
        with contextlib.suppress(ValueError):       # not the main thread: Ctrl-C keeps its default behaviour
            self.previous = signal.signal(signal.SIGINT, self._handle)
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
            print("\nCtrl-C: the final test evaluation is cut short; writing summary.json", file=sys.stderr, flush=True)
            return None

    def __exit__(self, *exc):
        if self.previous is not None:
            signal.signal(signal.SIGINT, self.previous)


# --- The command line: every bad input gets one line on stderr and exit code 2 -----------------
LOSSES = tuple(LOSS_FNS)                # gspo, gspo-token, grpo
REWARDS = ("exact", "last-number")      # --data's


class BadInput(Exception):
    pass


class _Parser(argparse.ArgumentParser):
    def error(self, message):              # argparse would print its usage too: one line is enough
        raise BadInput(message)


@functools.cache
def field_help(cls) -> dict[str, str]:
    """Each dataclass field (inherited ones too) -> the string literal under it, read from the source once per class."""
    helps: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if not dataclasses.is_dataclass(klass):
            continue
        body = ast.parse(textwrap.dedent(inspect.getsource(klass))).body[0].body
        helps.update({node.target.id: nxt.value.value for node, nxt in zip(body, body[1:])
                      if isinstance(node, ast.AnnAssign) and isinstance(nxt, ast.Expr)})
    return helps


def build_parser(cls) -> argparse.ArgumentParser:
    """One flag per dataclass field, typed from its annotation: bool is a switch, `X | None` an X (None: not given)."""
    helps, hints = field_help(cls), typing.get_type_hints(cls)
    parser = _Parser(description=(sys.modules[cls.__module__].__doc__ or " ").strip().splitlines()[0],
                     epilog="Every bad input gets one line on stderr and exit code 2, before any "
                            "model is built.",
                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    groups = {}                     # each class's own fields under its docstring: which flags are whose
    for klass in reversed(cls.__mro__):
        if dataclasses.is_dataclass(klass):
            title, _, more = klass.__doc__.strip().partition("\n")
            groups[klass] = parser.add_argument_group(title, " ".join(more.split()) or None)
    for f in dataclasses.fields(cls):
        owner = next(k for k in groups if f.name in k.__annotations__)
        flag, kind = "--" + f.name.replace("_", "-"), hints[f.name]
        if kind is bool:
            groups[owner].add_argument(flag, action="store_true", help=helps.get(f.name, ""))
            continue
        options = [t for t in typing.get_args(kind) if t is not type(None)]
        if options:                                          # int | None -> int
            kind = options[0]
        groups[owner].add_argument(flag, type=kind, default=f.default, help=helps.get(f.name, ""))
    return parser


def parse_config(argv: list[str] | None = None) -> Config:
    cfg = settings_of(argv)
    validate(cfg)
    return cfg


# The lab's flags (gspo_lab.py's Config; a test holds both lists equal): here each gets a line naming the lab's command.
LAB_COMMAND = "python gspo_lab.py"
LAB_FLAGS = ("task", "moe", "micro_batch", "gradient_checkpointing", "aggregation", "scale_rewards",
             "off_policy_mask", "sampler_dtype", "top_p", "old_logprobs", "record_noise", "record_bins", "eps_engine",
             "is_correction", "is_clip_max", "is_clip_min", "eval_at", "fspo_band", "engine", "engine_kv")


def given_flags(argv: list[str] | None, cls) -> dict:
    """Only the flags a command line gives, parsed by `cls`'s parser, and the checks between --data and its --reward."""
    unset = object()          # argparse fills in a default only where the namespace has no value yet
    blank = argparse.Namespace(**{f.name: unset for f in dataclasses.fields(cls)})
    given = {k: v for k, v in vars(build_parser(cls).parse_args(argv, blank)).items() if v is not unset}
    if "data" in given and not given["data"]:
        raise BadInput("--data needs a file name")
    if "reward" in given and "data" not in given:
        raise BadInput("--reward is --data's; the built-in task has a reward of its own (see --help)")
    return given


def settings_of(argv: list[str] | None = None) -> Config:
    """parse_config without `validate` (disk, ranges): a command line's settings, to compare a run's with a job's."""
    for arg in argv or ():
        name = arg.split("=", 1)[0][2:].replace("-", "_") if arg.startswith("--") else ""
        if name in LAB_FLAGS:
            raise BadInput(f"{arg.split('=', 1)[0]} is a flag of the lab: {LAB_COMMAND} takes it, with "
                           "every flag of this script (see its --help)")
    return Config(**given_flags(argv, Config))


# (lowest, highest, why) per numeric flag but eps (the loss's); None: open. Upper bounds catch a slipped extra zero.
MAX_ROLLOUT = 2 ** 16          # completions per rollout, --prompts-per-step x --group-size
MAX_HELD_OUT = 100_000         # --test-size + --val-size: every evaluation scores all of them
BIG_MODEL = 20_000_000          # parameters: above, the run's first line names the lab's memory options
MAX_NEW_TOKENS_BUILT_IN = 1024   # the built-in model's positions grow with it (RoPE: no parameters)
FLAG_RANGES = {
    "seed": (0, 2 ** 64 - 1, "torch.manual_seed's range; random.Random would read -s as s"),
    "steps": (1, 10 ** 7, "ten million steps are months of the default run"),
    "warmup_max_steps": (0, 10 ** 7, "ten million steps are months of the default run"),
    "group_size": (2, MAX_ROLLOUT, "advantages compare the responses to one prompt"),
    "prompts_per_step": (1, MAX_ROLLOUT // 2, "with at least 2 completions each"),
    "minibatches": (1, None, "at most --prompts-per-step, checked below"),
    "warmup_batch": (1, MAX_ROLLOUT, "problems per supervised step"),
    "eval_every": (1, None, "above --steps: once, at the end"),
    "val_size": (1, MAX_HELD_OUT, "every evaluation scores them all"),
    "test_size": (1, MAX_HELD_OUT, "every evaluation scores them all"),
    "max_new_tokens": (1, None, "checked against the model's positions below"),
    "threads": (0, 4 * (os.cpu_count() or 1), f"0: torch's default; at most 4 per core of this "
                                              f"machine's {os.cpu_count() or 1}"),
    "warmup_target": (0, 1, "an accuracy: above 1 the warm-up could never reach it"),
    "grad_clip": (0, None, "0: no clipping"),
}
# Where infinity would read as "off", the flag has its own spelling of off.
OFF_SPELLING = {"grad_clip": "; no clipping is --grad-clip 0", "warmup_target": "; no warm-up is --warmup-max-steps 0"}


def flag_of(name: str) -> str:
    return "--" + name.replace("_", "-")


def validate(cfg: Config) -> None:
    """BadInput for anything the run would choke on later: every flag is checked here, before a model or file exists."""
    if cfg.loss not in LOSSES:
        raise BadInput(f"unknown --loss {cfg.loss!r}; choose one of {', '.join(LOSSES)} (GSPO's relatives "
                       f"are the lab's: {LAB_COMMAND} --help)")
    if cfg.reward not in REWARDS:
        raise BadInput(f"unknown --reward {cfg.reward!r}; choose one of {', '.join(REWARDS)}")
    if cfg.device not in ("auto", "cpu", "cuda"):
        raise BadInput(f"unknown --device {cfg.device!r}; choose auto, cpu or cuda")
    check_numbers(cfg, FLAG_RANGES, OFF_SPELLING)
    for name, eps in zip(("--eps-low", "--eps-high"), resolved_eps(cfg)):
        if not 0 < eps < 1:
            raise BadInput(f"{name} must lie in (0, 1), got {eps}")
    if cfg.prompts_per_step * cfg.group_size > MAX_ROLLOUT:
        raise BadInput(f"--prompts-per-step x --group-size is {cfg.prompts_per_step * cfg.group_size} "
                       f"completions per rollout; at most {MAX_ROLLOUT}")
    check_rates_and_sizes(cfg, task_of(cfg))   # a --data file is read and checked here (`read_data`)
    if cfg.model.endswith(".gguf"):
        raise BadInput(f"--model {cfg.model}: a .gguf file is the lab's to load ({LAB_COMMAND} --model "
                       f"{cfg.model} ...)")
    check_device_out_and_model(cfg)


def check_numbers(cfg: Config, ranges: dict, off_spelling: dict) -> None:
    """Every float finite (argparse's float() takes nan and inf) and every ranged flag in its range."""
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        if isinstance(value, float) and not math.isfinite(value):
            raise BadInput(f"{flag_of(f.name)} must be a finite number, got {value}{off_spelling.get(f.name, '')}")
    for name, (low, high, why) in ranges.items():
        value = getattr(cfg, name)
        if value is not None and not ((low is None or value >= low) and (high is None or value <= high)):
            where = f"at least {low}" if high is None else f"between {low} and {high}"
            raise BadInput(f"{flag_of(name)} must be {where} ({why}), got {value}")


def check_rates_and_sizes(cfg: Config, task) -> None:
    """Rates, temperature, held-out sizes, built-in model's room, minibatches; shared with the lab, as the next is."""
    for name in ("lr", "warmup_lr"):          # above 1 nothing learnt survives a step, and a huge lr
        if not 0 < getattr(cfg, name) <= 1:   # overflows the weights through AdamW's weight decay alone
            raise BadInput(f"{flag_of(name)} must lie in (0, 1] (each AdamW step moves every weight by "
                           f"about this much), got {getattr(cfg, name)}")
    if not 0.01 <= cfg.temperature <= 100:
        raise BadInput(f"--temperature must lie in [0.01, 100] (below, every completion of a prompt is "
                       f"the greedy one and every group flat; above, sampling is noise), got "
                       f"{cfg.temperature}")
    n, room = task.count(), min(task.room(), MAX_HELD_OUT)
    if cfg.test_size + cfg.val_size > room:
        of = (f"--data {cfg.data} (its {n} rows but one, to train on" if cfg.data else
              f"{task.name} (half of its {n} problems")
        raise BadInput(f"--test-size + --val-size must be at most {room} for {of}, and at most "
                       f"{MAX_HELD_OUT}), got {cfg.test_size + cfg.val_size}")
    if not cfg.model and cfg.max_new_tokens > MAX_NEW_TOKENS_BUILT_IN:
        raise BadInput(f"--max-new-tokens must be at most {MAX_NEW_TOKENS_BUILT_IN} for the built-in "
                       f"model (each token is a position), got {cfg.max_new_tokens}")
    if cfg.data and not cfg.model:
        problem = built_in_model_problem(task, cfg.max_new_tokens)
        if problem:
            raise BadInput(f"--data {cfg.data}: {problem}")
    if cfg.minibatches > cfg.prompts_per_step:
        raise BadInput("--minibatches cannot exceed --prompts-per-step (a minibatch holds whole groups)")


def check_device_out_and_model(cfg: Config) -> None:
    """--device, --out, --model: a local model must look loadable, a hub id resolve, a prompt fit the positions."""
    if cfg.device == "cuda" and not torch.cuda.is_available():
        raise BadInput("--device cuda, but torch sees no CUDA device")
    problem = out_problem(cfg.out)
    if problem:
        raise BadInput(problem)
    positions = None                          # the --model's positions, where its config says
    if cfg.model and (cfg.model.endswith(".gguf") or os.path.lexists(cfg.model)):
        problem = local_model_problem(cfg.model)
        if problem:
            raise BadInput(f"--model {cfg.model}: {problem}")
    if cfg.model and not os.path.isdir(cfg.model) and not cfg.model.endswith(".gguf"):
        if cfg.model.startswith((".", "/", "~")) or os.sep in cfg.model.rstrip("/").split("/", 1)[-1]:
            raise BadInput(f"--model {cfg.model}: no such folder")
        try:                                  # a hub id: one cheap config fetch tells if it resolves
            from transformers import AutoConfig
            positions = getattr(AutoConfig.from_pretrained(cfg.model), "max_position_embeddings", None)
        except Exception as err:              # offline, unknown id, no access: one line, no traceback
            raise BadInput(f"--model {cfg.model}: cannot load ({type(err).__name__}); "
                           "pass a local folder or check the name and your connection") from None
    elif cfg.model and os.path.isdir(cfg.model):
        with contextlib.suppress(OSError, ValueError, AttributeError):
            with open(os.path.join(cfg.model, "config.json")) as f:
                positions = json.load(f).get("max_position_embeddings")
    if isinstance(positions, int) and cfg.max_new_tokens >= positions:
        raise BadInput(f"--max-new-tokens {cfg.max_new_tokens} leaves no room for a prompt in the "
                       f"{positions} positions of --model {cfg.model}")


WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                "pytorch_model.bin.index.json")


def local_model_problem(path: str) -> str | None:
    """Why the local --model `path` (a .gguf file or save_pretrained folder) cannot load, as its files tell, or None."""
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


def unwritable_characters(tokenizer, task) -> str:
    """The task's characters `tokenizer` cannot write (e.g. '|' for an add2 checkpoint on addwork): never rewardable."""
    rng = random.Random(DATA_SEED)
    problems = task.rows if isinstance(task, DataTask) else [task.draw(rng) for _ in range(50)]
    text = "".join(task.prompt(a, b) + task.solution(a, b) for a, b in problems)
    return "".join(c for c in sorted(set(text)) if not c.isspace() and tokenizer.decode(
        tokenizer(c, add_special_tokens=False).input_ids, skip_special_tokens=True).strip() != c)


def pick_device(cfg: Config) -> torch.device:
    return torch.device(("cuda" if torch.cuda.is_available() else "cpu") if cfg.device == "auto" else cfg.device)


def load_pretrained(name_or_path: str):
    """Any causal LM with its tokenizer, in float32, padded on the left (every prompt ends at one column)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(name_or_path)
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:              # the completion mask comes from the first EOS, so
        tokenizer.pad_token = tokenizer.eos_token  # pad == eos is harmless here (see completion_mask)
    return AutoModelForCausalLM.from_pretrained(name_or_path, dtype=torch.float32), tokenizer


def prepare(cfg: Config, task=None, make=None):
    """How every run begins: threads, seed, device, model and tokenizer (`make` for `task`); a bad --model: BadInput."""
    task, make = task or task_of(cfg), make or build
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    from transformers.utils import logging as hf_logging
    hf_logging.disable_progress_bar()       # no "Writing model shards" bar at every checkpoint
    torch.manual_seed(cfg.seed)
    device = pick_device(cfg)
    try:
        model, tokenizer = make(cfg, device, task)
    except Exception as err:       # what only loading finds (truncated weights, a corrupt GGUF body)
        if not cfg.model:
            raise
        reason = (str(err).strip().splitlines() or [""])[0][:200]
        raise BadInput(f"--model {cfg.model}: cannot load it ({type(err).__name__}: {reason})") from None
    missing = unwritable_characters(tokenizer, task) if cfg.model else ""
    if missing:
        needs = task.name if cfg.data else f"--task {task.name}"
        raise BadInput(f"--model {cfg.model}: its tokenizer cannot write {missing!r}, which {needs} "
                       "needs (a checkpoint of another task?)")
    return device, model, tokenizer


# --- --data: a JSONL file of problems, read once and checked line by line ----------------------
def task_of(cfg: Config):
    """A run's problems, for `train` and `prepare`: the rows of --data (read once per process), or add2."""
    return read_data(cfg.data, cfg.reward) if cfg.data else ADD2


@dataclass(frozen=True)
class DataTask:
    """--data: a file's (prompt, answer) rows, read and checked by `read_data`; split by their order, not --seed."""
    path: str
    reward: str                                          # "exact" or "last-number" (REWARDS)
    rows: tuple[tuple[str, str], ...] = dataclasses.field(repr=False)
    characters = "0123456789+*=|"                       # the built-in tokenizer's, for a file

    @property
    def name(self) -> str:
        return f"--data {self.path}"

    def draw(self, rng):
        return rng.choice(self.rows)

    def count(self) -> int:
        return len(self.rows)

    def room(self) -> int:               # every row but one may be held out
        return self.count() - 1

    def prompt(self, a, b) -> str:
        return a

    def answer(self, a, b) -> str:
        return b

    solution = answer

    def score(self, text: str, answer: str) -> float:
        return last_number_matches(text, answer) if self.reward == "last-number" else float(text.strip() == answer)

    def longest_prompt(self) -> int:
        return max(len(p) for p, _ in self.rows)


def last_number_matches(text: str, answer: str) -> float:
    """1.0 when the last number in `text` (commas ignored) is `answer`: how a sentence like '7 + 45 = 52.' is read."""
    numbers = re.findall(r"-?\d+", text.replace(",", ""))
    return float(bool(numbers) and numbers[-1] == answer)


JSON_KINDS = {dict: "an object", list: "an array", str: "a string", int: "a number", float: "a number",
              bool: "true or false", type(None): "null"}


@functools.cache
def read_data(path: str, reward: str) -> DataTask:
    """A --data file's rows (`data_row`), no prompt twice, or BadInput; cached: a run's rows never change under it."""
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
    """A line -> (prompt, answer): non-empty strings, the answer stripped (as the reward strips a completion)."""
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
    """Why the built-in model cannot learn a file's rows, or None: it has tokens for `characters` only, and EOS."""
    used = set("".join(prompt + answer for prompt, answer in task.rows))
    foreign = "".join(sorted(used - set(task.characters)))
    if foreign:
        return (f"it uses characters the built-in model has no token for, {foreign[:60]!r} (it has "
                f"{task.characters!r}): pass a --model with a tokenizer of its own")
    longest = max(len(answer) for _, answer in task.rows)
    if longest >= max_new_tokens:
        return (f"its longest answer has {longest} characters, which the built-in model writes in "
                f"{longest + 1} tokens with EOS: give --max-new-tokens {longest + 1} or more")
    return None


if __name__ == "__main__":
    sys.exit(main())

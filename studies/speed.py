"""Speed and memory of gspo_minimal.py: where one cycle of `make train` spends its time, and two
pieces of it, each against what a library would use.

    python studies/speed.py profile    # make profile: one tiny cycle (a rollout and its 4 updates)
                                       # by part, against the bare-GEMM time of its FLOPs:
                                       # figures/profile.json

    python studies/speed.py train-seeds  # make train-seeds: make train's run at seeds 0, 1, 2, one after
                                       # another, each alone: figures/train_seeds.json
    python studies/speed.py sampler    # the hand-written KV-cached sampler against transformers'
                                       # generate, untrained and trained model: runs/sampler/sampler.json
    python studies/speed.py logprobs   # token_logprobs at a real vocabulary, (8, 1024, 49152) logits:
                                       # extra memory and time against the one-shot formula and TRL's
                                       # selective_log_softmax: runs/logprobs/token_logprobs.json

The claim they serve (results.md, "Speed and memory"): writing the sampler and the log-probs by hand,
to keep every step in view, costs no speed and no memory against the library calls. Each
token_logprobs variant runs in a fresh process of its own (`python studies/speed.py _logprobs
VARIANT DTYPE`, started by `logprobs`), so that each peak of resident memory is its own; TRL's
variant is skipped where trl is not installed. make pretrained runs `logprobs` as one of its parts.
"""
from __future__ import annotations

import copy
import functools
import json
import os
import random
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))   # gspo_minimal, studies

import torch  # noqa: E402

import gspo_minimal as g  # noqa: E402
from studies.common import (Parser, cli, fail, finished, load_checkpoint, need, problems, reset_peak_rss,  # noqa: E402
                            read_json, status_kib, warm_start, write_json)


OUTPUTS = ("figures/profile.json", "figures/train_seeds.json")

# ---------------------------------------------------------------------------------------------
# The profile of one cycle: where `make train`'s RL time goes. Fixed before the run: seed 0's
# warm-up (the script's own, made here), then PROFILE_CYCLES cycles at make train's settings and
# threads, the first PROFILE_WARM discarded; each part is timed by wrapping the function that does
# it, so the parts add up to the cycle but for the code between them ("other").
# ---------------------------------------------------------------------------------------------
PROFILE_DIR = "runs/profile"
PROFILE_CYCLES, PROFILE_WARM = 40, 5
GEMM_OPS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm")


class PartTimer:
    """Wraps gspo_minimal's functions (and Tensor.backward, the optimiser's step) so that each call
    adds its seconds to a part in `seconds` (reset it for each cycle). Undone by `close`."""

    def __init__(self, opt):
        self.seconds: dict = {}
        self.undo = []
        grad_part = lambda: "update_forward" if torch.is_grad_enabled() else "pre_update_pass"
        for name, part in (("sample_completions", "sampling"), ("rollout", "rollout"),
                           ("rl_update", "update"), ("group_policy_logprobs", grad_part),
                           ("ratio_metrics", "metrics"), ("summarise_minibatches", "metrics"),
                           ("finite_grad_norm", "optimiser")):
            self.wrap(g, name, part)
        for loss in list(g.LOSS_FNS):                 # the objective, as rl_update looks it up
            self.wrap(g.LOSS_FNS, loss, "update_forward")
        self.wrap(torch.nn.utils, "clip_grads_with_norm_", "optimiser")
        self.wrap(torch.Tensor, "backward", "backward")
        self.wrap(opt, "step", "optimiser")

    def wrap(self, owner, name, part):
        """Time `owner.name` (or `owner[name]` for a dict) under `part`, until `close`."""
        item = isinstance(owner, dict)
        original = owner[name] if item else getattr(owner, name)
        put = (lambda value: owner.__setitem__(name, value)) if item else (lambda value: setattr(owner, name, value))

        @functools.wraps(original)      # keeps what torch's LR scheduler marked on opt.step
        def timed(*args, **kwargs):
            t = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                key = part() if callable(part) else part
                self.seconds[key] = self.seconds.get(key, 0.0) + time.perf_counter() - t
        put(timed)
        self.undo.append(lambda: put(original))

    def close(self):
        for undo in reversed(self.undo):
            undo()


def gemm_rate(threads: int, shape=(1024, 1024, 1024), repeats: int = 20) -> float:
    """FLOP/s of a float32 matmul of `shape` (M, K, N) at `threads`, median of `repeats`."""
    M, K, N = shape
    a, b = torch.randn(M, K), torch.randn(K, N)
    for _ in range(3):
        a @ b
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        a @ b
        times.append(time.perf_counter() - t)
    return 2 * M * K * N / statistics.median(times)


def profile_cycle() -> dict:
    """One cycle of make train by part (medians over cycles), its FLOPs and their bare-GEMM time,
    and the share of its time in ATen kernels (GEMMs and the rest) from torch's profiler."""
    from torch.profiler import ProfilerActivity, profile
    from torch.utils.flop_counter import FlopCounterMode
    t0 = time.perf_counter()
    threads = torch.get_num_threads()                      # make train's: torch's default
    start = os.path.join(PROFILE_DIR, "warmup")
    if not finished(os.path.join(start, "summary.json")):
        warm_start([], 0, start, "python studies/speed.py profile")
    torch.set_num_threads(threads)                         # the warm-up ran on one thread
    model, tok = load_checkpoint(os.path.join(start, "checkpoint"))
    cfg = g.Config()
    eps = g.resolved_eps(cfg)
    opt, sched = g.rl_optimizer(model, cfg)
    rng = random.Random(0)
    torch.manual_seed(0)

    def cycle():
        batch = g.rollout(model, tok, problems(cfg.prompts_per_step, rng), cfg, "cpu")
        g.rl_update(model, opt, batch, cfg, *eps)
        sched.step()
        return batch

    rows, tokens = [], []
    timer = PartTimer(opt)
    try:
        for i in range(PROFILE_CYCLES):
            timer.seconds = {}
            t = time.perf_counter()
            batch = cycle()
            part = {"cycle": time.perf_counter() - t, **timer.seconds}
            rows.append(part)
            tokens.append([int(batch["mask"].sum()), batch["completions"].shape[1]])
    finally:
        timer.close()
    kept = rows[PROFILE_WARM:]
    med = lambda key: statistics.median(r.get(key, 0.0) for r in kept)
    parts = {"sampling": med("sampling"), "rollout_rest": med("rollout") - med("sampling"),
             "pre_update_pass": med("pre_update_pass"), "update_forward": med("update_forward"),
             "backward": med("backward"), "optimiser": med("optimiser"), "metrics": med("metrics")}
    parts["update_rest"] = med("update") - sum(parts[k] for k in ("pre_update_pass", "update_forward",
                                                                   "backward", "optimiser", "metrics"))
    parts["other"] = med("cycle") - med("rollout") - med("update")
    val = g.make_splits(g.ADD2, cfg.test_size, cfg.val_size)["val"]
    evals = []
    for _ in range(5):
        t = time.perf_counter()
        g.accuracy(model, tok, g.ADD2, val, cfg.max_new_tokens, "cpu")
        evals.append(time.perf_counter() - t)
    parts["evaluation_per_cycle"] = statistics.median(evals) / cfg.eval_every   # every eval_every cycles
    with FlopCounterMode(display=False) as flops:              # one more cycle, its FLOPs counted
        cycle()
    total_flops = flops.get_total_flops()
    with profile(activities=[ProfilerActivity.CPU]) as prof:   # and five more, kernel by kernel
        t = time.perf_counter()
        for _ in range(5):
            cycle()
        profiled_wall = (time.perf_counter() - t) / 5
    ops = prof.key_averages()
    aten = sum(e.self_cpu_time_total for e in ops if e.key.startswith("aten::")) / 5e6
    gemm = sum(e.self_cpu_time_total for e in ops if e.key in GEMM_OPS) / 5e6
    tried = levers(model, tok, cycle(), cfg)
    rate, rate_small = gemm_rate(threads), gemm_rate(threads, (384, 128, 512))
    return {"model": "built-in tiny Llama, 1.05M parameters", "settings": "make train's (gspo_minimal.Config())",
            "start": "seed 0's warm-up, made by this command (runs/profile/warmup)",
            "threads": threads, "cycles": PROFILE_CYCLES, "cycles_discarded": PROFILE_WARM,
            "profile": {"cycle_seconds": med("cycle"),
                        "cycle_seconds_iqr": [statistics.quantiles([r["cycle"] for r in kept], n=4)[i] for i in (0, 2)],
                        "parts_seconds": parts,
                        "cycle_flops": total_flops,
                        "gemm_flops_per_second": rate, "gemm_flops_per_second_small": rate_small,
                        "bare_gemm_seconds": total_flops / rate,
                        "profiled_cycle_seconds": profiled_wall, "aten_seconds": aten, "gemm_kernel_seconds": gemm,
                        "outside_aten_seconds": profiled_wall - aten},
            "levers": tried,
            "completion_tokens_and_width": tokens[PROFILE_WARM:],
            "definitions": {
                "parts_seconds": "medians over the kept cycles of the seconds spent inside each wrapped function: "
                                 "sampling (sample_completions), rollout_rest (the rest of rollout: tokenising, "
                                 "rewards, advantages), pre_update_pass (the no-grad pass for pi_old of minibatches "
                                 "2-4), update_forward (the update's forward passes and losses), backward, optimiser "
                                 "(the gradient norm, clipping and AdamW's step), metrics (ratio_metrics, "
                                 "summarise_minibatches), update_rest and other (the code between them); "
                                 "evaluation_per_cycle: one validation pass over the 300 problems / eval_every",
                "bare_gemm_seconds": "the cycle's FLOPs (torch's FlopCounterMode: matmuls and attention) divided by "
                                     "this host's float32 matmul rate at 1024x1024x1024 and the same threads: what "
                                     "the cycle would take if every FLOP ran at the rate of one large matmul",
                "levers": "the update's pass (forward and backward) on one minibatch of the next cycle's rollout, "
                          "median of 17 after 3 discarded, the ways interleaved round by round, under: the "
                          "script's group_policy_logprobs (script), "
                          "the same with eager attention in place of SDPA, one packed sequence per group "
                          "(prefix_packed: padding and positions after EOS never computed), one full pass per row "
                          "(policy_logprobs), and that pass through torch.compile (dynamic shapes; "
                          "first_call_seconds holds the compilation)",
                "aten_seconds": "from torch's profiler over 5 further cycles: self time of every ATen op per cycle; "
                                "gemm_kernel_seconds: that of mm, addmm, bmm and baddbmm; outside_aten_seconds: the "
                                "profiled cycle's wall time less aten_seconds (Python, the module calls, autograd's "
                                "bookkeeping); the profiler's own cost per op inflates all three"},
            "seconds_total": time.perf_counter() - t0}


# Levers tried on the update's pass (one minibatch of 64 rows, forward and backward: about 60% of a
# cycle), each against the script's own pass on the same rows; none is kept in gspo_minimal.py.
def prefix_packed_logprobs(model, prompt_ids, prompt_mask, completions, mask, group_size: int):
    """group_policy_logprobs' numbers at the kept positions (0 elsewhere) from one pass over one
    packed sequence per group: the prompt's real tokens, then each completion's tokens up to the one
    before its last kept token, with a block mask under which a completion sees the prompt and its
    own earlier tokens only. Padding and the positions after EOS are never computed. The boolean
    mask (True: may attend) is read as such by SDPA attention, the tiny model's."""
    G, (B, T) = group_size, completions.shape
    keep = mask != 0                                                      # (B, T)
    fed = keep.sum(1).clamp(min=1) - 1                                    # tokens fed per completion
    seqs, positions, owners, reads = [], [], [], []
    for k in range(B // G):
        p = prompt_ids[k * G][prompt_mask[k * G] != 0]
        parts, pos, own, read = [p], [torch.arange(len(p))], [torch.full((len(p),), -1)], []
        at = len(p)
        for i in range(k * G, (k + 1) * G):
            n = int(fed[i])
            parts.append(completions[i, :n])
            pos.append(len(p) + torch.arange(n))
            own.append(torch.full((n,), i))
            read.append(torch.cat([torch.tensor([len(p) - 1]), at + torch.arange(n)]))   # predicts y_1..y_n+1
            at += n
        seqs.append(torch.cat(parts)), positions.append(torch.cat(pos)), owners.append(torch.cat(own))
        reads.append(read)
    S = max(map(len, seqs))
    pad = lambda xs, v: torch.stack([torch.nn.functional.pad(x, (0, S - len(x)), value=v) for x in xs])
    ids, pos, own = pad(seqs, 0), pad(positions, 0), pad(owners, -2)                    # (B/G, S)
    sees = torch.ones(S, S, dtype=torch.bool).tril() & ((own[:, None, :] == -1) | (own[:, None, :] == own[:, :, None]))
    sees |= torch.eye(S, dtype=torch.bool)
    logits = model(input_ids=ids, attention_mask=sees[:, None], position_ids=pos, use_cache=False).logits
    out = logits.new_zeros(B, T, logits.shape[-1])
    for k in range(B // G):
        for j, read in enumerate(reads[k]):
            out[k * G + j, :len(read)] = logits[k, read]
    return torch.where(keep, g.token_logprobs(out, completions), 0.0)


def eager_copy(model):
    """The same weights under transformers' eager attention, in place of SDPA. From a copy of the
    config: from_config would set the shared one's attention to eager for `model` too."""
    from transformers import AutoModelForCausalLM
    eager = AutoModelForCausalLM.from_config(copy.deepcopy(model.config), attn_implementation="eager")
    eager.load_state_dict(model.state_dict())
    return eager


def levers(model, tok, batch: dict, cfg: g.Config, repeats: int = 20) -> dict:
    """Median seconds of the update's forward and backward on the batch's first minibatch (64
    rows) under each lever, with the largest difference of its log-probs from the script's pass."""
    rows = torch.arange(len(batch["rewards"]) // cfg.minibatches)
    args = [batch[k][rows] for k in ("prompt_ids", "prompt_mask", "completions")]
    keep = batch["mask"][rows] != 0
    eager = eager_copy(model)
    compiled = torch.compile(model, dynamic=True)
    ways = {"script": lambda: g.group_policy_logprobs(model, *args, cfg.group_size),
            "eager_attention": lambda: g.group_policy_logprobs(eager, *args, cfg.group_size),
            "prefix_packed": lambda: prefix_packed_logprobs(model, *args, keep, cfg.group_size),
            "one_pass_per_row": lambda: g.policy_logprobs(model, *args),
            "one_pass_per_row_compiled": lambda: g.policy_logprobs(compiled, *args)}
    reference = ways["script"]().detach()
    out, times = {}, {name: [] for name in ways}
    for name, way in ways.items():
        t = time.perf_counter()
        lp = way()                                                   # the first call compiles, if any
        out[name] = {"first_call_seconds": time.perf_counter() - t,
                     "max_abs_logprob_difference": (lp.detach() - reference)[keep].abs().max().item()}
    for _ in range(repeats):                       # round after round, every way in each: drift hits all alike
        for name, way in ways.items():
            model.zero_grad(set_to_none=True), eager.zero_grad(set_to_none=True)
            t = time.perf_counter()
            way()[keep].sum().backward()
            times[name].append(time.perf_counter() - t)
    for name in ways:
        out[name]["seconds"] = statistics.median(times[name][3:])
    model.zero_grad(set_to_none=True)
    for name in out:
        out[name]["against_script"] = out[name]["seconds"] / out["script"]["seconds"]
    return {"rows": len(rows), "width": batch["completions"].shape[1], "ways": out}


def print_profile(res: dict) -> None:
    p = res["profile"]
    print(f"one cycle of make train ({res['threads']} threads, median of {res['cycles'] - res['cycles_discarded']}): "
          f"{p['cycle_seconds'] * 1e3:.0f} ms")
    for name, sec in p["parts_seconds"].items():
        print(f"  {name:22s} {sec * 1e3:7.1f} ms")
    print(f"  FLOPs {p['cycle_flops'] / 1e9:.1f} G; at {p['gemm_flops_per_second'] / 1e9:.0f} GFLOP/s (one large "
          f"matmul): {p['bare_gemm_seconds'] * 1e3:.0f} ms")
    for name, w in res["levers"]["ways"].items():
        print(f"  lever {name:26s} {w['seconds'] * 1e3:6.1f} ms ({w['against_script']:.2f}x the script's pass; "
              f"log-probs within {w['max_abs_logprob_difference']:.1e})")
    print(f"  under the profiler: {p['profiled_cycle_seconds'] * 1e3:.0f} ms, of which ATen kernels "
          f"{p['aten_seconds'] * 1e3:.0f} ms (GEMMs {p['gemm_kernel_seconds'] * 1e3:.0f} ms)")


# ---------------------------------------------------------------------------------------------
# make train at three seeds: its wall time and what it learns, the reference a faster cycle must meet.
# ---------------------------------------------------------------------------------------------
TRAIN_SEEDS = (0, 1, 2)
TRAIN_SEEDS_DIR = "runs/train_seeds"


def train_seeds() -> dict:
    """`python gspo_minimal.py --seed S` for each seed in its own process, one after another (so each
    has the machine to itself), and what its summary.json says."""
    t0 = time.perf_counter()
    runs = []
    for seed in TRAIN_SEEDS:
        out = os.path.join(TRAIN_SEEDS_DIR, str(seed))
        cmd = [sys.executable, "gspo_minimal.py", "--seed", str(seed), "--out", out]
        started = time.perf_counter()
        res = subprocess.run(cmd, capture_output=True, text=True)
        if res.returncode != 0:
            fail(f"seed {seed} ended with exit code {res.returncode}: {res.stderr.strip()[-300:]}", 1)
        summary = read_json(os.path.join(out, "summary.json"))
        runs.append({"seed": seed, "command": " ".join(cmd[1:]), "process_seconds": time.perf_counter() - started,
                     **{k: summary[k] for k in ("wall_seconds", "rl_seconds", "warmup_steps", "accuracy_before_rl",
                                                "accuracy_after_rl", "rl_tokens_per_second", "host")}})
        print(f"seed {seed}: {summary['accuracy_before_rl']:.3f} -> {summary['accuracy_after_rl']:.3f} in "
              f"{summary['wall_seconds']:.0f} s", flush=True)
    walls = [r["wall_seconds"] for r in runs]
    return {"runs": runs, "wall_seconds_median": statistics.median(walls), "wall_seconds_range": [min(walls), max(walls)],
            "accuracy_after_rl": [r["accuracy_after_rl"] for r in runs], "seconds_total": time.perf_counter() - t0}


# ---------------------------------------------------------------------------------------------
# Sampler benchmark: the hand-written loop against transformers' generate.
# ---------------------------------------------------------------------------------------------
def bench_sampler(repeats: int = 15) -> dict:
    t0 = time.perf_counter()
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
    write_json("runs/sampler/sampler.json", res, "python studies/speed.py sampler",
               time.perf_counter() - t0)
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
    texts = [g.ADD2.prompt(a, b) for a, b in problems(cfg.prompts_per_step, random.Random(0))
             for _ in range(cfg.group_size)]
    ids, attn = g.encode_prompts(tok, texts, "cpu")
    gen_cfg = GenerationConfig(do_sample=True, temperature=1.0, top_k=None, top_p=None,
                               max_new_tokens=cfg.max_new_tokens, eos_token_id=tok.eos_token_id,
                               pad_token_id=tok.pad_token_id)

    def ours():
        return g.sample_completions(model, ids, attn, cfg.max_new_tokens, tok.eos_token_id,
                                    tok.pad_token_id, temperature=1.0)

    def ours_grouped():                  # as rollouts call it: each prompt run once per group
        return g.sample_completions(model, ids, attn, cfg.max_new_tokens, tok.eos_token_id,
                                    tok.pad_token_id, temperature=1.0, group_size=cfg.group_size)

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


# ---------------------------------------------------------------------------------------------
# token_logprobs at a real vocabulary: extra memory and time, ours against the one-shot formula
# and TRL's selective_log_softmax, each variant in a fresh process of its own.
# ---------------------------------------------------------------------------------------------
LOGPROB_SHAPE = (8, 1024, 49152)        # (B, T, V): 8 answers of 1,024 tokens, SmolLM2's vocabulary
LOGPROB_REPEATS = 3
LOGPROB_VARIANTS = ("ours", "one_shot", "trl")        # what `_logprobs VARIANT DTYPE` accepts
LOGPROB_DTYPES = ("float32", "bfloat16")


def logprobs_variant(name: str, dtype_name: str) -> dict:
    """One variant on (8, 1024, 49152) random logits: peak resident memory above what the process
    held just before the call (logits included), median seconds of LOGPROB_REPEATS calls, and the
    largest error against a float64 log-softmax of the same logits. Linux only (/proc)."""
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype_name]
    B, T, V = LOGPROB_SHAPE
    gen = torch.Generator().manual_seed(0)
    logits = (torch.randn(B, T, V, generator=gen) * 3).to(dtype)
    tokens = torch.randint(0, V, (B, T), generator=gen)
    if name == "trl":
        from trl.trainer.utils import selective_log_softmax as fn
    elif name == "one_shot":            # the formula before chunking: a float32 copy of everything
        def fn(x, t):
            return torch.log_softmax(x.to(torch.promote_types(x.dtype, torch.float32)), -1) \
                .gather(-1, t[..., None])[..., 0]
    else:
        fn = g.token_logprobs
    with torch.no_grad():
        fn(logits[:1, :4], tokens[:1, :4])                        # warm-up: kernels, imports
        peaks, times = [], []
        for _ in range(LOGPROB_REPEATS):
            reset_peak_rss()
            base = status_kib("VmRSS")
            t0 = time.perf_counter()
            out = fn(logits, tokens)
            times.append(time.perf_counter() - t0)
            peaks.append(status_kib("VmHWM") - base)
            del out
        out = fn(logits, tokens)
        ref = torch.cat([torch.log_softmax(row.double(), -1).gather(-1, t[:, None])[:, 0][None]
                         for row, t in zip(logits, tokens)])
    return {"variant": name, "dtype": dtype_name, "out_dtype": str(out.dtype).replace("torch.", ""),
            "extra_mib": max(peaks) / 1024, "seconds": statistics.median(times),
            "max_abs_err_vs_float64": (out.double() - ref).abs().max().item()}


def measure_logprobs(trl_python: str | None = None) -> dict:
    """Every variant in a fresh process; the trl variant's in `trl_python` (an interpreter with TRL,
    as make pretrained's .venv-pretrained has none), else in this one."""
    t0 = time.perf_counter()
    variants = [(n, d) for n in ("ours", "one_shot", "trl") for d in ("float32", "bfloat16")]
    rows = []
    for name, dtype in variants:
        python = trl_python if name == "trl" and trl_python else sys.executable
        res = subprocess.run([python, __file__, "_logprobs", name, dtype],
                             capture_output=True, text=True)
        if res.returncode != 0:
            print(f"{name} {dtype}: skipped ({res.stderr.strip().splitlines()[-1]})", flush=True)
            continue
        rows.append(json.loads(res.stdout.strip().splitlines()[-1]))
    if not rows:
        fail("every token_logprobs variant failed: nothing measured, nothing written", 1)
    out = {"shape": list(LOGPROB_SHAPE), "repeats": LOGPROB_REPEATS, "seed": 0,
           "threads": torch.get_num_threads(), "rows": rows}
    write_json("runs/logprobs/token_logprobs.json", out, "python studies/speed.py logprobs",
               time.perf_counter() - t0)
    print(f"token log-probs of {LOGPROB_SHAPE} logits, {torch.get_num_threads()} threads, "
          f"median of {LOGPROB_REPEATS}:")
    print(f"{'variant':10s} {'logits':9s} {'result':9s} {'extra MiB':>10s} {'seconds':>8s} "
          f"{'max err vs float64':>19s}")
    for r in rows:
        print(f"{r['variant']:10s} {r['dtype']:9s} {r['out_dtype']:9s} {r['extra_mib']:10.0f} "
              f"{r['seconds']:8.3f} {r['max_abs_err_vs_float64']:19.2e}")
    print("runs/logprobs/token_logprobs.json")
    return out


@cli
def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "_logprobs":                  # child process of measure_logprobs
        if len(argv) != 3 or argv[1] not in LOGPROB_VARIANTS or argv[2] not in LOGPROB_DTYPES:
            fail(f"usage: python studies/speed.py _logprobs {{{','.join(LOGPROB_VARIANTS)}}} "
                 f"{{{','.join(LOGPROB_DTYPES)}}}")
        if argv[1] == "trl":
            need("trl", "the trl variant", "pip install -r requirements-trl.txt")
        print(json.dumps(g.finite_or_null(logprobs_variant(argv[1], argv[2])), allow_nan=False))
        return 0
    parser = Parser(description=__doc__.splitlines()[0])
    parser.add_argument("what", choices=["profile", "train-seeds", "sampler", "logprobs"])
    args = parser.parse_args(argv)
    if args.what == "train-seeds":
        res = train_seeds()
        write_json("figures/train_seeds.json", res, "python studies/speed.py train-seeds", res.pop("seconds_total"))
        print("figures/train_seeds.json")
        return 0
    if args.what == "profile":
        from transformers.utils import logging as hf_logging
        hf_logging.disable_progress_bar()
        res = profile_cycle()
        write_json("figures/profile.json", res, "python studies/speed.py profile", res.pop("seconds_total"))
        print_profile(res)
        print("figures/profile.json")
        return 0
    if args.what == "logprobs":
        measure_logprobs()
        return 0
    from transformers.utils import logging as hf_logging
    hf_logging.disable_progress_bar()
    bench_sampler()
    return 0


if __name__ == "__main__":
    sys.exit(main())

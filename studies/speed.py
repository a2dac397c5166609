"""Speed and memory of two pieces of gspo_minimal.py, each against what a library would use.

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
from studies.common import (Parser, cli, fail, load_checkpoint, need, problems, reset_peak_rss,  # noqa: E402
                            status_kib, write_json)


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
    texts = [g.prompt_text("add2", a, b) for a, b in problems(cfg.prompts_per_step, random.Random(0))
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
    parser.add_argument("what", choices=["sampler", "logprobs"])
    args = parser.parse_args(argv)
    if args.what == "logprobs":
        measure_logprobs()
        return 0
    from transformers.utils import logging as hf_logging
    hf_logging.disable_progress_bar()
    bench_sampler()
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The engine gap against length on a real inference engine: llama.cpp decoding the trainer's
weights, at theta = theta_old, no training (make engine's lens with llama.cpp as the sampler).

    .venv-engine/bin/python studies/llamacpp.py prototype   # each part's rate at small sizes:
        figures/engine_llamacpp_prototype.json (minutes), read to fix SIZES before the run
    .venv-engine/bin/python studies/llamacpp.py             # make engine-llamacpp: every model,
        setting and view a part kept in runs/engine_llamacpp/, then figures/engine_llamacpp.json
        and engine_llamacpp.png (at most 45 minutes on 2 cores; an interrupted run resumes)
    .venv-engine/bin/python studies/llamacpp.py redraw      # the figure again from the JSON

make engine (studies/engine.py) measured the lens on a stand-in: the trainer's own model cast to
bfloat16 or float16, run by the same PyTorch code. Here the sampler is llama.cpp (gspo_lab's
LlamaCppEngine): the trainer's float32 weights written as a GGUF file at f16, bf16 or q8_0, its KV
cache at f16 (llama.cpp's default), its own kernels and its own sampler chain (temperature 1, a
seeded draw from the full softmax). Each sequence is drawn by llama.cpp token by token, as an engine
decodes, and its record is log_softmax of llama.cpp's logits at the sampled token. The trainer
(float32, the same weights) then reads the same tokens in one pass: d_t = log p_t(y_t) - log q_t(y_t)
from the record, and the exact k_t = KL(q_t || p_t) over the vocabulary (gspo_lab.token_kl) from
llama.cpp's logits of one full pass over the same tokens (the record's token-by-token decode with its
cache differs from that pass in the last bits; `record_minus_full_pass` says by how much). The bf16
torch copy goes beside it on the same prompts (engine.paired_decode, its own draws), so that the real
engine and its stand-in are read by the same analysis: `length_law` with EOS suppressed on both
sides (view `law`: every prefix one point, text run past its natural end) and `natural_view` with EOS
allowed (view `natural`: the answers training sees). engine.py's docstring derives the two facts the
analysis stands on (E_q d_t = -k_t; the centred gaps are martingale differences).

What it cannot show: ggml's CPU kernels are not vLLM's or SGLang's GPU kernels; the tiny models'
answers are 3-4 tokens and their whole room 58 to 114; SmolLM2 is one small pretrained model.
"""
from __future__ import annotations

import os
import random
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

import gspo_lab as g  # noqa: E402
from studies import engine as lens  # noqa: E402
from studies.common import Parser, cli, fail, kept_part, read_json, write_json  # noqa: E402

# The files this target writes into figures/ (left out of its dirty check).
OUTPUTS = ("figures/engine_llamacpp.json", "figures/engine_llamacpp.png", "figures/engine_llamacpp_prototype.json")
FOLDER = "runs/engine_llamacpp"
PROTOTYPE_JSON = "figures/engine_llamacpp_prototype.json"
JSON = "figures/engine_llamacpp.json"
MODELS = ("add2", "addwork", "smollm2")
# setting -> (llama.cpp's weights, its KV cache), or None: the bf16 torch copy (make engine's bfloat16)
SETTINGS_OF = {"llama.cpp_f16": ("f16", "f16"), "llama.cpp_bf16": ("bf16", "f16"), "llama.cpp_q8_0": ("q8_0", "f16"),
               "torch_bfloat16": None}
VIEWS = lens.VIEWS
TEMPERATURE = 1.0
Z, N_BOOT = lens.Z, lens.N_BOOT
SEED = 1                          # the prototype uses seed 0
THREADS = 2                       # llama.cpp's threads and torch's: this machine's two cores


@torch.no_grad()
def engine_decode(engine, trainer, prompt_ids, prompt_mask, length: int, eos_id: int, pad_id: int, *,
                  suppress_eos: bool = True, seed: int = 0) -> dict:
    """`engine` (a synced gspo_lab.LlamaCppEngine) samples `length` tokens per row; the float32 `trainer`
    reads them. The keys of engine.paired_decode: (B, L) float64 `d` = log p(y_t) - log q(y_t) (q the
    engine's record) and `k` = KL(q_t || p_t) (q from llama.cpp's full pass over the same tokens), bool
    `alive` (False after a row's EOS; all True with `suppress_eos`, EOS then -inf on both sides, both
    distributions renormalised without it), the `tokens` and the record `logq`; and (B, L) float64
    `full_minus_record`: llama.cpp's full-pass log-prob of each token less its record."""
    tokens, record = engine.sample(prompt_ids, prompt_mask, length, eos_id, pad_id, temperature=TEMPERATURE,
                                   seed=seed, banned=eos_id if suppress_eos else None)     # (B, L) each
    alive = g.completion_mask(tokens, eos_id)                                               # (B, L)
    V = trainer.get_output_embeddings().weight.shape[0]
    rows = max(1, g.KL_ELEMENTS // (tokens.shape[1] * V))          # pieces of rows: SmolLM2's 49,152 logits
    d, k, gap = [], [], []
    for i in range(0, len(tokens), rows):
        args = prompt_ids[i:i + rows], prompt_mask[i:i + rows], tokens[i:i + rows]
        p_logits, q_logits = g.completion_logits(trainer, *args).float(), engine.logits(*args)   # (b, L, V) each
        if suppress_eos:
            p_logits[..., eos_id] = q_logits[..., eos_id] = -float("inf")
        pick = args[2][..., None]
        logp = torch.log_softmax(p_logits / TEMPERATURE, -1).gather(-1, pick).squeeze(-1)          # (b, L)
        full = torch.log_softmax(q_logits / TEMPERATURE, -1).gather(-1, pick).squeeze(-1)          # (b, L)
        d.append(logp.double() - record[i:i + rows].double())
        gap.append(full.double() - record[i:i + rows].double())
        k.append(g.token_kl(q_logits, p_logits, TEMPERATURE))
    zero = lambda x: torch.where(alive, torch.cat(x), 0.0)          # nothing after a row's EOS
    return {"d": zero(d), "k": zero(k), "alive": alive, "tokens": tokens, "logq": record.double(),
            "full_minus_record": zero(gap)}


def part(name: str, setting: str, view: str, size: dict, seed: int) -> dict:
    """One model, setting and view: `rows` sequences from the same prompts (engine.model_and_prompts at
    `seed`), decoded `batch` at a time, then make engine's analysis of the view."""
    rng = random.Random(seed)
    torch.manual_seed(seed)
    torch.set_num_threads(THREADS)
    model, tok, ids, attn, room = lens.model_and_prompts(name, size["rows"], rng)
    length = min(size["length"] or room, room)
    suppress = view == "law"
    pieces, engine = [], None
    t0 = time.perf_counter()           # the decode's own time: loading (or first making) the model aside
    try:
        if SETTINGS_OF[setting] is None:
            copy = lens.sampler_of(model, "bfloat16")
        else:
            engine = g.LlamaCppEngine(*SETTINGS_OF[setting], threads=THREADS)
            engine.sync(model)
        for i in range(0, size["rows"], size["batch"]):
            piece = ids[i:i + size["batch"]], attn[i:i + size["batch"]]
            if engine is None:
                pieces.append(lens.paired_decode(copy, model, *piece, length, tok.eos_token_id, suppress_eos=suppress))
            else:
                pieces.append(engine_decode(engine, model, *piece, length, tok.eos_token_id, tok.pad_token_id,
                                            suppress_eos=suppress, seed=seed * 1000 + i))
    finally:
        if engine is not None:
            engine.close()
    width = max(p["d"].shape[1] for p in pieces)       # natural pieces stop when their rows have all ended

    def joined(key, fill):
        return torch.cat([torch.nn.functional.pad(p[key], (0, width - p[key].shape[1]), value=fill) for p in pieces])
    d, k, alive = joined("d", 0.0), joined("k", 0.0), joined("alive", False)
    out = {"model": name, "setting": setting, "view": view, "rows": size["rows"], "length": length,
           "tokens": int(alive.sum()), "decode_seconds": time.perf_counter() - t0}
    if engine is not None:
        gap = joined("full_minus_record", 0.0)[alive]
        out["record_minus_full_pass"] = {"mean": -gap.mean().item(), "mean_abs": gap.abs().mean().item(),
                                         "max_abs": gap.abs().max().item()}
    if view == "law":
        return {**out, **lens.length_law(d, k, Z, N_BOOT, seed)}
    return {**out, **lens.natural_view(d, alive, length)}


# ---------------------------------------------------------------------------------------------
# The prototype: how fast each part runs here, so that the full run's sizes fit its budget.
# ---------------------------------------------------------------------------------------------
# SmolLM2 at 32 rows, the batch the run decodes: CPU decoding is memory-bound, so 8 rows' rate would
# understate 32 rows' (make engine's prototype: 15-19 tokens/s at 4 rows, 85 at 32).
PROTOTYPE = {"add2": {"rows": 64, "length": 32, "batch": 64}, "addwork": {"rows": 32, "length": 64, "batch": 32},
             "smollm2": {"rows": 32, "length": 64, "batch": 32}}


def prototype(models: list[str]) -> dict:
    """Each model and setting at PROTOTYPE's sizes, view `law` (every row at full length), a kept part
    in runs/engine_llamacpp/prototype/; the result holds each part's tokens per second."""
    folder = os.path.join(FOLDER, "prototype")
    parts = {}
    for name in models:
        for setting in SETTINGS_OF:
            pid = f"{name}_{setting}"
            r = kept_part(folder, "llamacpp", pid, lambda: part(name, setting, "law", PROTOTYPE[name], 0),
                          own_peak=True, settings={**PROTOTYPE[name], "setting": setting})
            parts[pid] = {"model": name, "setting": setting, **PROTOTYPE[name], "tokens": r["tokens"],
                          "seconds": r["seconds"], "decode_seconds": r["decode_seconds"],
                          "tokens_per_second": r["tokens"] / r["decode_seconds"],
                          "peak_rss_mb": r["peak_rss_mb"], "kl_floor": r["kl_floor"]}
            print(f"{pid}: {parts[pid]['tokens_per_second']:.0f} tokens/s, K {r['kl_floor']:.2e}", flush=True)
    return {"sizes": PROTOTYPE, "parts": parts}


# ---------------------------------------------------------------------------------------------
# make engine-llamacpp: the sizes, fixed from the prototype before the run, and its parts.
# ---------------------------------------------------------------------------------------------
# The prototype (figures/engine_llamacpp_prototype.json) scored 2,200-2,400 tokens/s of llama.cpp's
# decoding and scoring on the tiny models and 50-64 on SmolLM2 at 32 rows (the bf16 copy 3,900-6,300
# and 90). So the tiny models take make engine's sizes, and SmolLM2 24 rows of 256 tokens per view and
# setting (make engine's 32 x 512 would take over an hour here): `projected_seconds` puts the whole at
# 19 minutes, and make engine's full run took 1.6 times its projection (attention over longer text).
# `length` None: as far as the model's positions allow after the prompt (add2 58, addwork 114).
# `batch`: rows decoded together, 64 (the prototype timed 64 on add2, 32 on addwork). In llama.cpp's
# unified KV cache each token attends over every row's cells, so a piece costs rows^2 x length^2: a
# first run at 256 rows took 150 s for add2's 59,392 tokens at each setting, 6 times the rate the
# prototype measured, and ran out of memory on addwork (one micro-batch of its 33,000 cells; since
# then LLAMA_UBATCH_MAX bounds it). Rows, lengths and the seed are as fixed before that run.
SIZES = {"add2": {"rows": 1024, "length": None, "batch": 64},
         "addwork": {"rows": 512, "length": None, "batch": 64},
         "smollm2": {"rows": 24, "length": 256, "batch": 24}}
SETTINGS = {"sizes": SIZES, "views": list(VIEWS), "z": Z, "n_boot": N_BOOT, "seed": SEED, "threads": THREADS,
            "temperature": TEMPERATURE, "settings": {s: (None if w is None else {"weights": w[0], "kv": w[1]})
                                                     for s, w in SETTINGS_OF.items()},
            "gspo_band": list(lens.GSPO_BAND), "smollm2_prompts": lens.SMOLLM_PROMPTS,
            "trainer": "float32, the same weights (theta = theta_old); llama.cpp's GGUF written from them",
            "engine": "llama.cpp through llama-cpp-python (requirements-engine.txt), native CPU options off"}


def projected_seconds(proto: dict) -> float:
    """The run's decoding time from the prototype's rates (tokens per second of decoding and scoring, per
    model and setting), both views at full length. A projection: attention over 256 tokens costs more
    than over 64, and loading each part's model is left out."""
    total = 0.0
    for name, size in SIZES.items():
        length = size["length"] or lens.ROOM.get(name, 64)
        for setting in SETTINGS_OF:
            total += len(VIEWS) * size["rows"] * length / proto["parts"][f"{name}_{setting}"]["tokens_per_second"]
    return total


def part_name(name: str, setting: str, view: str) -> str:
    return f"{name}_{setting}_{view}"


def measure(models: list[str]) -> None:
    for name in models:
        for setting in SETTINGS_OF:
            for view in VIEWS:
                pid = part_name(name, setting, view)
                r = kept_part(FOLDER, "llamacpp", pid, lambda: part(name, setting, view, SIZES[name], SEED),
                              own_peak=True, settings={"size": SIZES[name], "setting": setting, "view": view,
                                                       "seed": SEED, "z": Z, "n_boot": N_BOOT})
                print(f"{pid}: {r['tokens']} tokens in {r['seconds']:.0f} s, peak {r['peak_rss_mb']:.0f} MiB", flush=True)


def assemble() -> dict:
    """engine_llamacpp.json: every part read back, per model and setting make engine's keys (the view
    `law` at the top, `natural` under its own key); `engine_seconds` sums the parts' own seconds."""
    models, hosts, seconds = {}, {}, 0.0
    for name in MODELS:
        for setting in SETTINGS_OF:
            entry = {}
            for view in VIEWS:
                r = read_json(os.path.join(FOLDER, part_name(name, setting, view) + ".json"))
                hosts[part_name(name, setting, view)] = r["host"]
                seconds += r["seconds"]
                keep = {k: v for k, v in r.items() if k not in ("command", "measured_at_commit", "dirty", "dirty_paths",
                                                                "versions", "threads", "host", "model", "setting",
                                                                "view", "part_settings")}
                entry.update(keep if view == "law" else {"natural": keep})
            models.setdefault(name, {})[setting] = entry
    return {"engine_seconds": seconds, "settings": SETTINGS, "models": models, "part_hosts": hosts}


COLOURS = {"llama.cpp_f16": "#0072B2", "llama.cpp_bf16": "#D55E00", "llama.cpp_q8_0": "#CC79A7",
           "torch_bfloat16": "#7F7F7F"}


def plot(result: dict, path: str = "figures/engine_llamacpp.png") -> None:
    """make engine's picture for the real engine: mean |log s| against prefix length, one panel per model,
    a line per setting (the torch bf16 copy grey, dashed), each one's exact KL floor dotted, GSPO's band."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, len(result["models"]), figsize=(5 * len(result["models"]), 4), sharey=True,
                             squeeze=False)
    for ax, (name, by) in zip(axes[0], result["models"].items()):
        for setting, r in by.items():
            ls = "--" if setting.startswith("torch") else "-"
            ax.plot(r["n"], r["mean_abs_log_s"], color=COLOURS[setting], ls=ls, label=setting)
            ax.axhline(r["kl_floor"], color=COLOURS[setting], ls=":", lw=1)
        ax.axhspan(1e-6, -lens.GSPO_BAND[0], color="grey", alpha=0.15)
        ax.axhline(-lens.GSPO_BAND[0], color="black", lw=1, label="GSPO band (3e-4 / 4e-4)")
        ax.set(xscale="log", yscale="log", ylim=(1e-6, 0.5), xlabel="prefix length n (tokens, EOS suppressed)",
               title=f"{name} ({next(iter(by.values()))['sequences']} sequences per setting)")
    axes[0][0].set_ylabel("mean |log s| over the first n tokens")
    axes[0][0].legend(fontsize=7, title="dotted: each setting's exact KL floor", title_fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


@cli
def main(argv=None) -> int:
    parser = Parser(description=__doc__.splitlines()[0])
    parser.add_argument("what", nargs="?", default=None, choices=["prototype", "redraw"],
                        help="prototype: figures/engine_llamacpp_prototype.json; redraw: the figure from the JSON; "
                             "none: make engine-llamacpp")
    parser.add_argument("--models", default=",".join(MODELS), help="comma-separated: add2, addwork, smollm2")
    args = parser.parse_args(argv)
    models = args.models.split(",")
    if any(m not in MODELS for m in models):
        fail(f"--models takes add2, addwork and smollm2, got {args.models}")
    g.engine_modules()                                  # the engine extra, or one line naming it
    from transformers.utils import logging as hf_logging
    hf_logging.disable_progress_bar()
    t0 = time.perf_counter()
    if args.what == "prototype":
        result = prototype(models)
        write_json(PROTOTYPE_JSON, {"projected_seconds": projected_seconds(result) if models == list(MODELS) else None,
                                    **result}, "python studies/llamacpp.py prototype", time.perf_counter() - t0)
        print(f"wrote {PROTOTYPE_JSON}")
        return 0
    if args.what == "redraw":
        plot(read_json(JSON))
        return 0
    if os.path.exists(PROTOTYPE_JSON) and read_json(PROTOTYPE_JSON).get("projected_seconds"):
        print(f"make engine-llamacpp: about {projected_seconds(read_json(PROTOTYPE_JSON)) / 60:.0f} min projected "
              f"from {PROTOTYPE_JSON}", flush=True)
    measure(models)
    if models != list(MODELS):
        return 0
    result = assemble()
    plot(result)
    write_json(JSON, result, "make engine-llamacpp", result["engine_seconds"])
    print(f"wrote {JSON} and figures/engine_llamacpp.png ({result['engine_seconds'] / 60:.0f} min)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

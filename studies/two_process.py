"""Two processes, run for real: TRL's GRPOTrainer as GSPO on N = 2 processes against N = 1.

    torchrun --standalone --nproc_per_node 2 studies/two_process.py OUT --processes 2   # gloo, CPU
    python studies/two_process.py OUT --processes 1

The question: does tutorial.md section 15's mapping of make train's batch onto N processes
(per_device_train_batch_size = 64 / N, steps_per_generation = 4, gradient_accumulation_steps = 1,
num_generations = 8) give the same optimiser step on two processes as on one? Each run builds the
tiny model from a fixed seed, feeds GRPOTrainer one fixed rollout (`fixed_rollout`: 32 prompts x
8 completions with their rewards, fixed in advance) and takes one optimiser step. Every process
writes OUT/rank{r}.json (its world size, its share of the rollout and of step 1, the rows and
advantages step 1 saw, a checksum of its starting weights) and OUT/grad_rank{r}.pt: the gradient of
step 1 after backward, before clipping, which under DDP is the all-reduced one every rank holds.
test_trl.py runs both (accelerate 1.15's `accelerate launch --cpu` starts one process whatever
--num_processes says, so torchrun starts these), compares the two gradients, and compares
the lab's rl_update (gspo_minimal's at its defaults) on the same rollout. A run on N processes stops with exit code 1 unless
torch.distributed reports a world of N.

Everything is TRL's own code (tokenising, rewards gathered across ranks, group advantages, the
pi_old pass, the loss, DDP's all-reduce) but two seams:
  * sampling: `rollout_func`, TRL's hook for a custom rollout, hands back the fixed completions,
    and their fixed rewards reach the reward function as a column it returns.
  * the minibatches: TRL shuffles each rank's share of the rollout (torch.randperm) before cutting
    it into steps_per_generation minibatches, so which completions make step 1 depends on N and on
    the random state: a 2-process step 1 holds 32 random completions from each rank's 128, a
    1-process one 64 of all 256: equal in distribution, not in value, so the two step-1 gradients
    differ by a minibatch's sampling noise (on this rollout by 1.16 times the 1-process one's
    norm, measured with TRL's shuffle left in). `deal` replaces that shuffle: group k goes
    to step k mod 4, on every rank. A rank holds whole groups, 128 / 8 = 16 of them on each of 2
    ranks, group 16r + j being its local group j, and 16 is a multiple of 4, so step 1 holds
    groups 0, 4, ..., 28 for N = 1 and N = 2 alike.
"""
from __future__ import annotations

import os
import random
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))   # gspo_minimal

import torch  # noqa: E402

import gspo_lab as g  # noqa: E402
from studies import common  # noqa: E402
from studies.common import Parser, cli, fail, need, write_json  # noqa: E402

SEED = 0                                 # the tiny model's weights and the fixed rollout
CFG = g.Config()                         # make train's settings: 32 prompts x 8, 4 minibatches
G, STEPS = CFG.group_size, CFG.minibatches


# ---------------------------------------------------------------------------------------------
# The fixed rollout: 32 add2 prompts, 8 completions each, rewards from gspo_minimal.reward.
# ---------------------------------------------------------------------------------------------
def fixed_rollout(tokenizer) -> list[dict]:
    """One rollout, drawn once from SEED: per prompt, its G completions (token ids cut after the
    first EOS, as TRL hands them to a reward function) and their rewards. Group j holds 5j mod 9
    right answers, so step 1's groups (0, 4, ..., 28) hold 0, 2, 4, 6, 8, 1, 3, 5: both kinds of
    flat group and every spread between. A wrong answer is a wrong number, a bare EOS, or six
    digits with no EOS (cut at max_new_tokens: reward 0): 1 to 6 tokens."""
    rng = random.Random(SEED)
    eos = tokenizer.eos_token_id

    def ids(text: str) -> list[int]:
        return tokenizer(text, add_special_tokens=False).input_ids
    problems: dict[tuple[int, int], None] = {}            # distinct prompts, in the order drawn
    while len(problems) < CFG.prompts_per_step:
        problems[g.ADD2.draw(rng)] = None
    groups = []
    for j, (a, b) in enumerate(problems):
        answer = g.TASKS["add2"].answer(a, b)
        right = [ids(answer) + [eos]] * (5 * j % 9)
        wrong = [[ids(str((a + b + rng.randint(1, 50)) % 199)) + [eos],          # never a + b
                  [eos],
                  ids("".join(rng.choice("0123456789") for _ in range(CFG.max_new_tokens)))
                  ][k % 3] for k in range(G - len(right))]
        completions = right + wrong
        rng.shuffle(completions)
        groups.append({"prompt": g.TASKS["add2"].prompt(a, b), "completions": completions,
                       "rewards": [g.reward(ids, answer, tokenizer) for ids in completions]})
        assert sum(groups[-1]["rewards"]) == len(right), groups[-1]
    return groups


def dealt_order(rows: int) -> torch.Tensor:
    """A rank's rows (whole groups in order) reordered so that cutting them into STEPS equal
    minibatches puts group k in minibatch k mod STEPS."""
    return torch.arange(rows).reshape(-1, STEPS, G).transpose(0, 1).reshape(-1)


def dealt_chunks(n_rows: int, group_size: int, minibatches: int, device) -> list[torch.Tensor]:
    """The same deal in the shape of gspo_lab.group_chunks (row indices per minibatch), so that the lab's
    rl_update's first minibatch holds the groups TRL's step 1 holds."""
    assert (group_size, minibatches) == (G, STEPS)
    return list(dealt_order(n_rows).to(device).reshape(minibatches, -1))


def deal(batch: dict) -> dict:
    """In place of trl's shuffle_sequence_dict: every row-indexed value in `dealt_order`."""
    rows = len(next(v for v in batch.values() if v is not None))
    order = dealt_order(rows)

    def permute(v):
        if v is None or (isinstance(v, torch.Tensor) and v.ndim == 0):
            return v
        return v[order] if isinstance(v, torch.Tensor) else [v[i] for i in order]
    return {key: permute(value) for key, value in batch.items()}


def tiny_model():
    """The built-in tokenizer and tiny model, its weights from SEED."""
    torch.manual_seed(SEED)
    tokenizer = g.build_char_tokenizer()
    return g.build_tiny_model(tokenizer), tokenizer


def weights_checksum(model) -> list[float]:
    """Sum and sum of squares of every weight, in float64: the starting points compared."""
    flat = torch.cat([p.detach().double().flatten() for p in model.parameters()])
    return [flat.sum().item(), flat.square().sum().item()]


# ---------------------------------------------------------------------------------------------
# The run: make trl's GRPOConfig with section 15's mapping for N processes, one optimiser step.
# ---------------------------------------------------------------------------------------------
def n_process_config(n: int, out: str):
    """make trl's GRPOConfig for make train's settings (studies/trl_compare.grpo_config), mapped
    onto n processes as tutorial.md section 15 says: per_device_train_batch_size = 64 / n, the
    rest unchanged; one optimiser step."""
    from studies.trl_compare import grpo_config
    one = grpo_config(CFG, rollouts=1, out=out, device=torch.device("cpu"))
    assert one.per_device_train_batch_size % n == 0, f"{n} processes do not divide 64"
    return grpo_config(CFG, rollouts=1, out=out, device=torch.device("cpu"),
                       per_device_train_batch_size=one.per_device_train_batch_size // n, max_steps=1)


def fixed_rollout_trainer(n: int, out: str):
    """GRPOTrainer on the fixed rollout, recording what step 1 saw and its gradient."""
    import trl.trainer.grpo_trainer as grpo_module
    from datasets import Dataset
    from transformers import PrinterCallback
    from trl import GRPOTrainer

    grpo_module.shuffle_sequence_dict = deal       # the one seam in TRL's own code (docstring)
    model, tokenizer = tiny_model()
    groups = fixed_rollout(tokenizer)
    table = {grp["prompt"]: grp for grp in groups}

    def rollout_func(prompts: list[str], trainer) -> dict:
        """This rank's prompts, each G times in a row, answered from the table."""
        trainer.rollout_rows += len(prompts)
        seen: dict[str, int] = {}
        completions, rewards = [], []
        for prompt in prompts:
            k = seen[prompt] = seen.get(prompt, -1) + 1
            completions.append(table[prompt]["completions"][k])
            rewards.append(table[prompt]["rewards"][k])
        return {"prompt_ids": trainer.processing_class(text=prompts)["input_ids"],
                "completion_ids": completions, "logprobs": None, "fixed_reward": rewards}

    def fixed_reward(completions, fixed_reward, **kwargs) -> list[float]:
        return fixed_reward

    class FirstStep(GRPOTrainer):
        """Records the rows and advantages of the first minibatch and the gradient after its
        backward (all-reduced under DDP), before clipping and the optimiser step."""
        step1, gradient, rollout_rows = None, None, 0

        def _compute_loss(self, model, inputs):
            if self.step1 is None:
                self.step1 = {key: inputs[key].tolist() for key in
                              ("prompt_ids", "completion_ids", "completion_mask", "advantages")}
            return super()._compute_loss(model, inputs)

        def training_step(self, model, inputs, num_items_in_batch):
            loss = super().training_step(model, inputs, num_items_in_batch)
            if self.gradient is None:
                self.gradient = {name: p.grad.detach().clone() for name, p in
                                 self.accelerator.unwrap_model(model).named_parameters()}
            return loss

    dataset = Dataset.from_dict({"prompt": [grp["prompt"] for grp in groups]})
    trainer = FirstStep(model=model, reward_funcs=fixed_reward, args=n_process_config(n, out),
                        train_dataset=dataset, processing_class=tokenizer, rollout_func=rollout_func)
    trainer.remove_callback(PrinterCallback)       # its end-of-training dict
    return trainer


def world_size() -> int:
    import torch.distributed as dist
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


@cli
def main(argv=None) -> int:
    parser = Parser(prog="python studies/two_process.py",
                    description="One optimiser step of TRL's GRPOTrainer as GSPO on a fixed rollout, "
                                "on N processes (start N > 1 with torchrun)")
    parser.add_argument("out", help="folder for rank{r}.json and grad_rank{r}.pt")
    parser.add_argument("--processes", type=int, required=True,
                        help="N: the world size the run must have")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    need("trl", "studies/two_process.py", "make test-trl installs it in .venv-trl")
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")     # rollout_func is marked experimental
    from studies.trl_compare import quiet_libraries
    quiet_libraries()
    t0 = time.perf_counter()
    out = os.path.join(common.started_in, args.out)      # cli runs us from the repository root
    trainer = fixed_rollout_trainer(args.processes, os.path.join(out, "trl_output"))
    if world_size() != args.processes:         # the trainer has set up torch.distributed by now
        fail(f"expected a world of {args.processes} processes, torch.distributed reports "
             f"{world_size()} (start N > 1 with torchrun --nproc_per_node N)", 1)
    rank = trainer.accelerator.process_index
    start = weights_checksum(trainer.model)
    trainer.train()
    torch.save(trainer.gradient, os.path.join(out, f"grad_rank{rank}.pt"))
    write_json(os.path.join(out, f"rank{rank}.json"), {
        "world_size": world_size(), "rank": rank, "start_checksum": start,
        **{key: getattr(trainer.args, key) for key in (
            "per_device_train_batch_size", "steps_per_generation", "generation_batch_size",
            "gradient_accumulation_steps", "num_generations")},
        "rollout_rows": trainer.rollout_rows, "step1": trainer.step1},
        command=(f"torchrun --nproc_per_node {args.processes} " if args.processes > 1 else "python ")
        + f"studies/two_process.py {args.out} --processes {args.processes}",
        seconds=time.perf_counter() - t0)
    return 0


if __name__ == "__main__":
    sys.exit(main())

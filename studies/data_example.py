"""The --data example: subtraction asked in words, written as a JSONL file that the script trains on.

    python studies/data_example.py runs/data/subtract.jsonl             # 500 rows, the same every time
    python studies/data_example.py runs/data/subtract.jsonl --rows 400  # another size (at most 527)

It serves one claim: training on a dataset of your own needs a file, not a change to the code
(tutorial.md, section 13). Each line is {"prompt": "What is 17 minus 5? Answer with a number.",
"answer": "12"}: a - b for 2 <= a <= 32 and 1 <= b <= a, each subtraction at most once (so no
held-out problem is trained on in other words), in one of three phrasings, drawn from a fixed seed. SmolLM2-135M-Instruct answers in a sentence of its own, which the
last-number reward reads (`--reward last-number`). The numbers are small on purpose: the model
gets some of these right when sampled, and RL learns only from groups that hold both right and
wrong answers; " Answer with a number." keeps its sentences short
enough for --max-new-tokens 32. Nothing is downloaded and no model is loaded. A path is taken from
the folder the command was started in; a file already there is kept, unless it holds exactly these
rows.
"""
from __future__ import annotations

import json
import os
import random
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))   # gspo_minimal, studies

from studies import common  # noqa: E402
from studies.common import Parser, cli, fail  # noqa: E402

SEED = 0
PHRASINGS = ("What is {a} minus {b}?", "Subtract {b} from {a}.", "What do you get if you take {b} away from {a}?")
QUESTIONS = [(a, b) for a in range(2, 33) for b in range(1, a + 1)]       # 527 subtractions
COMMAND = ("gspo_lab.py --model \"$GGUF\" --data {out} --reward last-number --test-size 100 --val-size 50 "
           "--warmup-max-steps 0 --steps 12 --prompts-per-step 4 --group-size 16 --max-new-tokens 32 "
           "--temperature 0.3 --lr 1e-5 --eval-every 12")       # tutorial.md section 13's


def subtraction_rows(n: int, seed: int = SEED) -> list[dict]:
    """n of the 527 QUESTIONS as rows {"prompt", "answer"}, drawn without repeats from `seed`, each
    asked in one of the PHRASINGS."""
    rng = random.Random(seed)
    return [{"prompt": rng.choice(PHRASINGS).format(a=a, b=b) + " Answer with a number.", "answer": str(a - b)}
            for a, b in rng.sample(QUESTIONS, n)]


def holds(path: str, text: str) -> bool:
    """Whether `path` is a file holding exactly `text`."""
    try:
        with open(path, encoding="utf-8") as f:
            return f.read() == text
    except (OSError, UnicodeDecodeError):
        return False


@cli
def main(argv: list[str] | None = None) -> int:
    parser = Parser(description="Write the --data example: subtraction asked in words, as JSONL.")
    parser.add_argument("out", help="the JSONL file to write")
    parser.add_argument("--rows", type=int, default=500, help=f"how many rows (1 to {len(QUESTIONS)})")
    args = parser.parse_args(argv)
    if not 1 <= args.rows <= len(QUESTIONS):
        fail(f"--rows must be between 1 and {len(QUESTIONS)}, got {args.rows}")
    out = os.path.join(common.started_in, args.out)       # cli runs from the repository root
    text = "".join(json.dumps(row, allow_nan=False) + "\n" for row in subtraction_rows(args.rows))
    if os.path.lexists(out) and not holds(out, text):
        fail(f"{args.out} exists and holds something else: left as it is; choose another path")
    os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
    with open(out + ".tmp", "w", encoding="utf-8") as f:
        f.write(text)
    os.replace(out + ".tmp", out)
    print(f"{args.out}: {args.rows} rows; train on it (GGUF: tutorial.md section 13) with\n"
          f"  .venv-pretrained/bin/python {COMMAND.format(out=args.out)} --out runs/subtract")
    return 0


if __name__ == "__main__":
    sys.exit(main())

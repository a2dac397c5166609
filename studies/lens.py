"""The perplexity lens made visible: how much gradient each objective gives a response's tokens.

    python studies/lens.py          # figures/relatives_weight.png, in seconds, no runs needed

Every objective in gspo_minimal.py and the lab moves log pi(y_t) in the direction A * grad log pi(y_t), times a
weight that depends on how far the policy has moved: on the token's own log-ratio
delta_t = log pi_new(y_t) - log pi_old(y_t) (GRPO, GMPO, SAPO, CISPO), or on the response's
log s = H_old - H_new, the drop in per-token cross-entropy (GSPO, SAPO at sequence level, VESPO,
whose weight is a function of the unnormalised log W = |y| log s). This file draws that weight,
for A > 0 and A < 0, as the functions of gspo_minimal.py and the lab compute it: by autograd, on a response
whose tokens all have the same log-ratio, divided by the plain on-policy policy gradient's
A / |y|, so that every curve is 1 where the policy has not moved.

The claim it serves is a reading, not a measurement: the relatives differ in where and how sharply
they stop the gradient, and GSPO's band (3e-4 / 4e-4 nats per token) is a step at 0 on any scale a
token-level method lives on. LUSPO's weight is |y| times GSPO's and is not drawn.
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

import gspo_lab as g  # noqa: E402
from studies.common import Parser, cli  # noqa: E402

FIG = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "figures",
                   "relatives_weight.png")

# The files this target writes into figures/: its own outputs, left out of its dirty check
# (gspo_minimal.tree_state, taken by studies.common.cli when it starts).
OUTPUTS = ("figures/relatives_weight.png",)

LENGTH = 8                                         # |y| of the response the weights are read from
TOKEN_RANGE, SEQUENCE_RANGE = 0.6, 0.06            # x-axis half-widths, nats per token
TOKEN_LEVEL = {"GRPO (0.2 / 0.27)": g.grpo_loss, "GMPO (log-space 0.4)": g.gmpo_loss,
               "SAPO, token": g.sapo_loss, "CISPO (cap 5)": g.cispo_loss}
SEQUENCE_LEVEL = {"GSPO (3e-4 / 4e-4)": g.gspo_loss,
                  "SAPO, sequence": lambda *a: g.sapo_loss(*a, level="sequence"),
                  f"VESPO, |y| = {LENGTH}": g.vespo_loss,
                  "VESPO, |y| = 32": g.vespo_loss}


def gradient_weight(loss_fn, log_ratio: torch.Tensor, sign: float, length: int = LENGTH) -> torch.Tensor:
    """(N,) the weight loss_fn puts on A grad log pi(y_t) for a response of `length` tokens, each
    with log-ratio log_ratio[n], relative to the on-policy policy gradient's A / |y| (float64)."""
    n = log_ratio.numel()
    logp_old = torch.full((n, length), -1.0, dtype=torch.float64)               # (N, L)
    logp_new = (logp_old + log_ratio[:, None]).requires_grad_(True)             # (N, L)
    adv = torch.full((n,), sign, dtype=torch.float64)                           # (N,)
    mask = torch.ones(n, length, dtype=torch.bool)
    loss_fn(logp_new, logp_old, adv, mask).backward()
    # each row's own gradient, undoing the batch mean (1/N) and the token mean (1/|y|)
    return -logp_new.grad[:, 0] * n * length / sign


def weights(points: int = 601) -> dict:
    """{"token"|"sequence": {"x": (points,), name: {"A > 0": (points,), "A < 0": (points,)}}}."""
    out = {}
    for level, fns, half in (("token", TOKEN_LEVEL, TOKEN_RANGE), ("sequence", SEQUENCE_LEVEL, SEQUENCE_RANGE)):
        x = torch.linspace(-half, half, points, dtype=torch.float64)
        out[level] = {"x": x}
        for name, fn in fns.items():
            length = 32 if name.endswith("32") else LENGTH
            out[level][name] = {side: gradient_weight(fn, x, sign, length)
                                for side, sign in (("A > 0", 1.0), ("A < 0", -1.0))}
    return out


def plot(w: dict, path: str = FIG) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(2, 2, figsize=(12, 7.5), sharey="row")
    styles = ["-", "--", "-.", ":"]
    for col, (level, label) in enumerate((("token", "token log-ratio  log w_t = log pi_new(y_t) - log pi_old(y_t)"),
                                          ("sequence", "sequence log-ratio  log s = H_old - H_new  (nats per token)"))):
        x = w[level]["x"].numpy()
        for row, side in enumerate(("A > 0", "A < 0")):
            ax = axes[row, col]
            for style, name in zip(styles, [k for k in w[level] if k != "x"]):
                ax.plot(x, w[level][name][side].numpy(), style, lw=2, label=name)
            ax.axvline(0, color="grey", lw=0.8)
            ax.axhline(1, color="grey", lw=0.8, ls=":")
            ax.set_title(f"{level}-level objectives, {side}", fontsize=11)
            ax.set_xlabel(label)
            ax.grid(alpha=0.3)
            ax.set_ylim(-0.1, 2.6)
            if col == 0:
                ax.set_ylabel("weight on A grad log pi(y_t)\n(1 = on-policy policy gradient)")
            ax.legend(fontsize=8, loc="upper left" if side == "A > 0" else "upper right")
    fig.suptitle("Gradient weight of each objective against how far the policy moved "
                 f"(a response of |y| = {LENGTH} tokens, all at the same log-ratio; drawn from gspo_minimal.py "
                 "by autograd).\nLeft of 0 the new policy is more perplexed by the response, right of 0 less. "
                 "GSPO's band (3e-4 / 4e-4) is the step at 0. LUSPO = |y| x GSPO, not drawn.", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


@cli
def main(argv=None) -> int:
    Parser(description=__doc__.splitlines()[0]).parse_args(argv)
    plot(weights())
    print(f"wrote {os.path.relpath(FIG)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

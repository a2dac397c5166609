"""Property-based checks of the GSPO identities and of everything the objective relies on.

Each test is one claim, named as the claim, and checks the code against an independent formulation:
a literal loop, an exact enumeration, a float64 recomputation, or an analytic gradient.
Derivations: tutorial.md sections 2-5 (the identity s = PPL_old/PPL_new = exp(H_old - H_new), the
variance formula, the fixed-length bias bound) and the GSPO paper's equations 2, 5, 7, 10 and 13-14.
A passing property checks many drawn cases; it does not prove the claim.

Profiles (conftest.py): `ci` is derandomized with 100 examples a property (`make test`); `thorough`
draws 2,000 (`make test-thorough`). Corners are pinned with @example so that they are always run.
"""
import itertools
import math

import pytest
import torch
from hypothesis import assume, example, given
from hypothesis import strategies as st

import gspo_lab as lab
import gspo_minimal as g

F = torch.nn.functional

F32, F64 = torch.float32, torch.float64
EPS_LOW, EPS_HIGH = 3e-4, 4e-4


# ---------------------------------------------------------------------------------------------
# A batch: two policies' logits over a small vocabulary, sampled tokens, a mask with padding on
# either side, advantages. Tensors come from a seeded generator (hypothesis shrinks the seed and the
# shapes, and prints them): building every element through hypothesis would be slow for no gain.
# ---------------------------------------------------------------------------------------------
class Batch:
    def __init__(self, B, T, V, lengths, left_pad, scale, drift, seed, dtype, garbage=None):
        self.args = dict(B=B, T=T, V=V, lengths=lengths, left_pad=left_pad, scale=scale,
                         drift=drift, seed=seed, dtype=dtype, garbage=garbage)
        self.B, self.T, self.dtype, self.left_pad, self.garbage = B, T, dtype, left_pad, garbage
        gen = torch.Generator().manual_seed(seed)
        self.logits_old = (torch.randn(B, T, V, generator=gen, dtype=F64) * scale).to(dtype)
        # the new policy = the old one moved by `drift`: small drifts keep s near 1, large ones don't
        self.logits_new = (self.logits_old.to(F64)
                           + torch.randn(B, T, V, generator=gen, dtype=F64) * drift).to(dtype)
        self.tokens = torch.randint(0, V, (B, T), generator=gen)
        pos = torch.arange(T)
        lengths = torch.tensor(lengths)
        self.mask = (pos >= T - lengths[:, None]) if left_pad else (pos < lengths[:, None])
        self.adv = torch.randn(B, generator=gen, dtype=F64).to(dtype)

    def retyped(self, dtype):
        return Batch(**{**self.args, "dtype": dtype})

    def on_policy(self):
        """The same batch with theta = theta_old."""
        b = Batch(**self.args)
        b.logits_new = b.logits_old
        return b

    def logp(self, which="new", grad=False):
        logits = (self.logits_new if which == "new" else self.logits_old).clone()
        logits.requires_grad_(grad)
        lp = g.token_logprobs(logits, self.tokens)
        if self.garbage is not None:          # what padding might hold in someone's trainer
            lp = torch.where(self.mask, lp, torch.tensor(self.garbage, dtype=self.dtype))
        return (lp, logits) if grad else lp

    def __repr__(self):
        return f"Batch({', '.join(f'{k}={v}' for k, v in self.args.items())})"


@st.composite
def batches(draw, max_b=5, max_t=12, dtypes=(F32, F64), scales=(0.1, 1.0, 5.0, 30.0),
            drifts=(1e-5, 1e-3, 0.1, 1.0, 5.0), min_len=0):
    B = draw(st.integers(1, max_b))
    T = draw(st.integers(1, max_t))
    return Batch(B=B, T=T, V=draw(st.integers(2, 6)),
                 lengths=draw(st.lists(st.integers(min(min_len, T), T), min_size=B, max_size=B)),
                 left_pad=draw(st.booleans()), scale=draw(st.sampled_from(scales)),
                 drift=draw(st.sampled_from(drifts)), seed=draw(st.integers(0, 2**32 - 1)),
                 dtype=draw(st.sampled_from(dtypes)),
                 garbage=draw(st.sampled_from([None, float("nan"), float("inf"), -float("inf")])))


# Corners every profile runs: length 1, an empty row, log-ratios of tens of nats (drift 5 on logits
# of scale 30), NaN and +-inf padding, float32 (or the dtype a test asks for), both padding sides.
CORNERS = [
    Batch(1, 1, 3, [1], False, 1.0, 0.1, 0, F32),
    Batch(3, 4, 3, [0, 4, 2], False, 1.0, 0.1, 1, F32, garbage=float("nan")),
    Batch(2, 6, 5, [6, 3], True, 30.0, 5.0, 2, F32, garbage=-float("inf")),
    Batch(2, 6, 5, [6, 1], False, 30.0, 5.0, 3, F32, garbage=float("inf")),
    Batch(4, 3, 2, [1, 2, 3, 1], True, 1.0, 1e-4, 4, F32),
]


def with_corners(dtype=None, min_len=0, extra=()):
    """Pin every corner batch (retyped to `dtype` if given) as an explicit @example."""
    def deco(test):
        for corner in CORNERS:
            if min(corner.args["lengths"]) < min_len:
                continue
            test = example(corner.retyped(dtype) if dtype else corner, *extra)(test)
        return test
    return deco


def unit_roundoff(dtype):
    return torch.finfo(dtype).eps / 2


# ---------------------------------------------------------------------------------------------
# 1. The identity itself, from logits of two policies.
# ---------------------------------------------------------------------------------------------
def identity_tolerance(b: Batch, lp_new, lp_old):
    """Relative round-off bound for comparing two forms of s (round-off grows with |H| and |y|).

    Each form rounds a masked mean of n numbers of size |logp| (pairwise summation: about
    (log2 n + 1) u |logp| absolute error each), one subtraction (u |dH|), and one exp, which turns
    an absolute error e in its argument into a relative error e, plus its own u. The factor 4 covers
    the two means of each form and the division of two exps in the PPL form.
    """
    u = unit_roundoff(b.dtype)
    keep = b.mask
    size = (torch.where(keep, lp_new.abs(), 0).sum(-1) + torch.where(keep, lp_old.abs(), 0).sum(-1))
    size = size.to(F64) / keep.sum(-1).clamp(min=1)
    n = keep.sum(-1).clamp(min=1).to(F64)
    return 4 * u * ((torch.log2(n) + 2) * size + 4)


@given(batches())
@with_corners()
def test_ratio_equals_exp_cross_entropy_difference(b):
    lp_new, lp_old = b.logp("new"), b.logp("old")
    s = g.importance_ratio(lp_new, lp_old, b.mask).to(F64)
    ppl_old, ppl_new = g.perplexity(lp_old, b.mask), g.perplexity(lp_new, b.mask)
    h_old, h_new = g.cross_entropy(lp_old, b.mask), g.cross_entropy(lp_new, b.mask)
    tol = identity_tolerance(b, lp_new, lp_old)
    finite = torch.isfinite(ppl_old) & torch.isfinite(ppl_new) & (s > 0) & torch.isfinite(s)
    ppl_form = (ppl_old / ppl_new).to(F64)
    ent_form = torch.exp(h_old - h_new).to(F64)
    rel_ppl = (ppl_form / s - 1).abs()
    rel_ent = (ent_form / s - 1).abs()
    assert (rel_ppl[finite] <= tol[finite]).all(), f"s != PPL_old/PPL_new: {rel_ppl} > {tol}"
    assert (rel_ent[finite] <= tol[finite]).all(), f"s != exp(H_old - H_new): {rel_ent} > {tol}"
    # Where a perplexity overflows (H > 88.7 in float32) the forms are compared in log space:
    # log s == log PPL_old - log PPL_new == H_old - H_new, to the same absolute round-off.
    gap = (g.sequence_log_ratio(lp_new, lp_old, b.mask) - (h_old - h_new)).abs().to(F64)
    assert (gap <= tol).all(), f"log s != H_old - H_new: {gap} > {tol}"


@given(batches(dtypes=(F32,), scales=(100.0, 300.0), drifts=(1.0,), min_len=1))
def test_perplexity_overflows_to_inf_exactly_when_the_cross_entropy_exceeds_the_float_range(b):
    lp = b.logp("old")
    h = g.cross_entropy(lp, b.mask)
    ppl = g.perplexity(lp, b.mask)
    limit = math.log(torch.finfo(F32).max)                        # 88.72
    assume(((h - limit).abs() > 1e-3).all())
    assert torch.equal(torch.isinf(ppl), h > limit), "PPL must be +inf exactly when H > 88.72"
    assert torch.isfinite(g.sequence_log_ratio(b.logp("new"), lp, b.mask)).all()


# ---------------------------------------------------------------------------------------------
# 2. s is the geometric mean of token ratios; long rows and extreme ratios stay finite and correct.
# ---------------------------------------------------------------------------------------------
@given(batches(dtypes=(F64,), scales=(0.1, 1.0, 3.0), drifts=(1e-3, 0.1, 1.0), min_len=1))
def test_ratio_equals_literal_geometric_mean_of_token_ratios(b):
    lp_new, lp_old = b.logp("new"), b.logp("old")
    s = g.importance_ratio(lp_new, lp_old, b.mask)
    for i in range(b.B):
        prod, n = 1.0, 0
        for t in range(b.T):
            if b.mask[i, t]:
                prod *= math.exp(lp_new[i, t].item()) / math.exp(lp_old[i, t].item())
                n += 1
        assert s[i].item() == pytest.approx(prod ** (1 / n), rel=1e-12), "s is not the geometric mean"


@pytest.mark.parametrize("dtype", [F32, F64])
@pytest.mark.parametrize("length", [1, 1000, 32_768])
@pytest.mark.parametrize("seed", [0, 1])
def test_long_rows_and_extreme_log_ratios_stay_finite_and_correct(dtype, length, seed):
    gen = torch.Generator().manual_seed(seed)
    # per-token log-ratios up to +-50 nats, log-probs down to -60: a product of probabilities
    # would be exp(-60 * 32768) = 0 in any float format
    delta = (torch.rand(2, length, generator=gen, dtype=F64) * 100 - 50)
    lp_old = -torch.rand(2, length, generator=gen, dtype=F64) * 60
    lp_new = lp_old + delta
    lp_old, lp_new = lp_old.to(dtype), lp_new.to(dtype)
    mask = torch.ones(2, length, dtype=torch.bool)
    log_s = g.sequence_log_ratio(lp_new, lp_old, mask)
    s = g.importance_ratio(lp_new, lp_old, mask)
    h = g.cross_entropy(lp_old, mask)
    # reference: exactly rounded sums (math.fsum) of the same float inputs
    exact = [math.fsum((lp_new[i].double() - lp_old[i].double()).tolist()) / length for i in range(2)]
    exact_h = [-math.fsum(lp_old[i].double().tolist()) / length for i in range(2)]
    u = unit_roundoff(dtype)
    bound = 4 * u * (math.log2(length) + 2) * 110          # |logp| <= 110 per token
    assert torch.isfinite(s).all() and torch.isfinite(h).all()
    for i in range(2):
        assert abs(log_s[i].item() - exact[i]) <= bound
        assert abs(h[i].item() - exact_h[i]) <= bound
        assert s[i].item() == pytest.approx(math.exp(exact[i]), rel=bound + 2 * u)
    naive = torch.exp(lp_new.double()).prod(-1)             # the formula a reader might write
    if length > 20:
        assert (naive == 0).all(), "the literal product should underflow: why we use log space"


# ---------------------------------------------------------------------------------------------
# 3-4. Masked positions never matter; empty rows contribute nothing.
# ---------------------------------------------------------------------------------------------
OUTPUTS = {
    "masked_mean": lambda new, old, adv, mask: g.masked_mean(new, mask),
    "sequence_log_ratio": lambda new, old, adv, mask: g.sequence_log_ratio(new, old, mask),
    "importance_ratio": lambda new, old, adv, mask: g.importance_ratio(new, old, mask),
    "cross_entropy": lambda new, old, adv, mask: g.cross_entropy(new, mask),
    "perplexity": lambda new, old, adv, mask: g.perplexity(new, mask),
    "gspo_loss": g.gspo_loss, "gspo_token_loss": g.gspo_token_loss, "grpo_loss": g.grpo_loss,
    "gmpo_loss": lab.gmpo_loss, "sapo_loss": lab.sapo_loss,
    "sapo_loss_sequence": lambda *a: lab.sapo_loss(*a, level="sequence"),
    "cispo_loss": lab.cispo_loss, "luspo_loss": lab.luspo_loss, "vespo_loss": lab.vespo_loss,
    **{f"{name}_{agg}": (lambda fn, agg: lambda *a: fn(*a, aggregation=agg))(fn, agg)
       for name, fn in (("gspo_loss", lab.gspo_loss), ("gspo_token_loss", lab.gspo_token_loss),
                        ("grpo_loss", lab.grpo_loss)) for agg in ("dapo", "dr_grpo")},
}


def all_outputs(lp_new, lp_old, adv, mask):
    return {name: fn(lp_new, lp_old, adv, mask) for name, fn in OUTPUTS.items()}


@given(batches(), st.sampled_from([float("nan"), float("inf"), -float("inf"), 1e30]))
@with_corners(extra=(float("nan"),))
@with_corners(dtype=F64, extra=(-float("inf"),))
def test_masked_positions_never_change_a_result_or_gradient(b, junk):
    clean_new, clean_old = b.logp("new"), b.logp("old")
    clean_new = torch.where(b.mask, clean_new, 0).detach()
    clean_old = torch.where(b.mask, clean_old, 0).detach()
    dirty_new = torch.where(b.mask, clean_new, junk).detach()
    dirty_old = torch.where(b.mask, clean_old, -junk).detach()
    for name, fn in OUTPUTS.items():
        results = []
        for new, old in ((clean_new, clean_old), (dirty_new, dirty_old)):
            new = new.clone().requires_grad_(True)
            out = fn(new, old, b.adv, b.mask)
            out.sum().backward()
            results.append((out.detach(), new.grad))
        (v1, g1), (v2, g2) = results
        assert torch.equal(v1, v2), f"{name}: a masked value ({junk}) reached the result"
        assert torch.equal(g1, g2), f"{name}: a masked value ({junk}) reached the gradient"
        assert (g2[~b.mask] == 0).all(), f"{name}: a masked position got a gradient"


@example(junk=1.0)
@given(st.sampled_from([0.0, 1.0, float("nan")]))
def test_mask_may_be_bool_int_or_float_with_the_same_results(junk):
    b = CORNERS[1]
    lp_new = torch.where(b.mask, b.logp("new"), junk)          # whatever sits under the padding
    lp_old = torch.where(b.mask, b.logp("old"), junk)
    ref = all_outputs(lp_new, lp_old, b.adv, b.mask)
    for mask in (b.mask.long(), b.mask.int(), b.mask.float(), b.mask.double()):
        got = all_outputs(lp_new, lp_old, b.adv, mask)
        for name in ref:
            assert torch.equal(ref[name], got[name]), f"{name} differs for mask dtype {mask.dtype}"


@given(batches(dtypes=(F64,), min_len=1))
@with_corners(dtype=F64, min_len=1)
def test_empty_rows_give_ratio_one_zero_cross_entropy_and_no_loss_or_gradient(b):
    lp_new, lp_old = b.logp("new"), b.logp("old")
    mask = b.mask.clone()
    mask[0] = False                                             # row 0 is now empty
    assert g.importance_ratio(lp_new, lp_old, mask)[0].item() == 1.0
    assert g.cross_entropy(lp_new, mask)[0].item() == 0.0
    assert g.sequence_log_ratio(lp_new, lp_old, mask)[0].item() == 0.0
    for loss_fn in (g.gspo_loss, g.gspo_token_loss, g.grpo_loss):
        new = lp_new.detach().clone().requires_grad_(True)
        loss = loss_fn(new, lp_old, b.adv, mask)
        loss.backward()
        assert (new.grad[0] == 0).all(), f"{loss_fn.__name__}: the empty row got a gradient"
        rest = loss_fn(lp_new[1:], lp_old[1:], b.adv[1:], mask[1:]) if b.B > 1 else torch.tensor(0.0)
        # the empty row adds nothing to the sum, but the mean still divides by B (the paper's 1/G)
        expect = rest * (b.B - 1) / b.B
        assert loss.item() == pytest.approx(expect.item(), rel=1e-9, abs=1e-12), loss_fn.__name__


# ---------------------------------------------------------------------------------------------
# 5. Row order and padding side do not matter.
# ---------------------------------------------------------------------------------------------
def loss_tolerance(loss_fn, lp_new, lp_old, adv, mask):
    """Round-off bound for the same loss summed in another order: u times the size of the terms.

    Each row's term is at most max(ratio, 1 + eps) |A| (a sequence ratio for GSPO, the largest
    token ratio for GRPO), itself known to a relative u (log2 T + 2) |logp|-sized error.
    """
    u = unit_roundoff(lp_new.dtype)
    keep = mask != 0
    delta = torch.where(keep, lp_new - lp_old, 0)
    if loss_fn is g.grpo_loss:
        ratio = torch.where(keep, delta.exp(), 0).amax(-1)
    else:
        ratio = g.importance_ratio(lp_new, lp_old, mask)
    size = (torch.where(keep, lp_new.abs() + lp_old.abs(), 0).amax(-1) + 1)
    terms = ratio.clamp(min=1.001) * adv.abs() * (math.log2(mask.shape[-1]) + 2) * size
    return 8 * u * terms.sum().item() / len(adv) + 8 * u


@given(batches(dtypes=(F64,)), st.randoms(use_true_random=False))
@with_corners(dtype=F64, extra=(__import__("random").Random(0),))
def test_losses_are_invariant_to_row_order_and_padding_side(b, rnd):
    lp_new, lp_old = b.logp("new"), b.logp("old")
    perm = list(range(b.B))
    rnd.shuffle(perm)
    perm = torch.tensor(perm)
    flipped = Batch(**{**b.args, "left_pad": not b.left_pad})    # the same rows, padded on the other side
    # realign: the same values, moved to where the other padding side puts them
    f_new, f_old = torch.zeros_like(lp_new), torch.zeros_like(lp_old)
    for i in range(b.B):
        f_new[i][flipped.mask[i]] = lp_new[i][b.mask[i]]
        f_old[i][flipped.mask[i]] = lp_old[i][b.mask[i]]
    for fn in (g.gspo_loss, g.gspo_token_loss, g.grpo_loss):
        ref = fn(lp_new, lp_old, b.adv, b.mask).item()
        tol = loss_tolerance(fn, lp_new, lp_old, b.adv, b.mask)
        permuted = fn(lp_new[perm], lp_old[perm], b.adv[perm], b.mask[perm]).item()
        other_side = fn(f_new, f_old, b.adv, flipped.mask).item()
        assert abs(permuted - ref) <= tol, f"{fn.__name__} depends on row order"
        assert abs(other_side - ref) <= tol, f"{fn.__name__} depends on the padding side"


# ---------------------------------------------------------------------------------------------
# 6. s > 1 exactly when the new policy is less perplexed by the response.
# ---------------------------------------------------------------------------------------------
@given(batches(min_len=1))
@with_corners(min_len=1)
def test_ratio_above_one_exactly_when_new_policy_is_less_perplexed(b):
    lp_new, lp_old = b.logp("new"), b.logp("old")
    s = g.importance_ratio(lp_new, lp_old, b.mask)
    delta_h = g.cross_entropy(lp_old, b.mask) - g.cross_entropy(lp_new, b.mask)
    ppl_old, ppl_new = g.perplexity(lp_old, b.mask), g.perplexity(lp_new, b.mask)
    tol = identity_tolerance(b, lp_new, lp_old)
    clear = (delta_h.abs().to(F64) > 2 * tol) & ((s.to(F64) - 1).abs() > 2 * tol)  # off the knife edge
    assert torch.equal((s > 1)[clear], (delta_h > 0)[clear]), "s > 1 must mean H_new < H_old"
    both = clear & torch.isfinite(ppl_old) & torch.isfinite(ppl_new)
    assert torch.equal((s > 1)[both], (ppl_new < ppl_old)[both]), "s > 1 must mean PPL_new < PPL_old"


# ---------------------------------------------------------------------------------------------
# 7. Exact enumeration over every sequence of a small vocabulary.
# ---------------------------------------------------------------------------------------------
def random_policy(V, L, gen, scale):
    """A policy over all prefixes of length < L: prefix tuple -> log-probabilities (V,), float64."""
    return {prefix: torch.log_softmax(torch.randn(V, generator=gen, dtype=F64) * scale, -1)
            for n in range(L) for prefix in itertools.product(range(V), repeat=n)}


def enumerate_sequences(old, new, V, L):
    """Every sequence of length L with its per-token log-probs under both policies: (V^L, L) each."""
    seqs = list(itertools.product(range(V), repeat=L))
    lp_old = torch.tensor([[old[y[:t]][y[t]].item() for t in range(L)] for y in seqs], dtype=F64)
    lp_new = torch.tensor([[new[y[:t]][y[t]].item() for t in range(L)] for y in seqs], dtype=F64)
    return seqs, lp_old, lp_new


@given(st.integers(2, 3), st.integers(1, 4), st.integers(0, 2**32 - 1),
       st.sampled_from([0.1, 1.0, 3.0]), st.sampled_from([0.01, 0.3, 2.0]))
def test_exact_enumeration_unbiased_product_jensen_bound_and_kl_identity(V, L, seed, scale, drift):
    gen = torch.Generator().manual_seed(seed)
    old = random_policy(V, L, gen, scale)
    new = {k: torch.log_softmax(v + torch.randn(V, generator=gen, dtype=F64) * drift, -1)
           for k, v in old.items()}
    seqs, lp_old, lp_new = enumerate_sequences(old, new, V, L)
    mask = torch.ones_like(lp_old, dtype=torch.bool)
    p_old = lp_old.sum(-1).exp()                                     # (V^L,) pi_old(y)
    assert p_old.sum().item() == pytest.approx(1.0, abs=1e-12)
    # E_old[prod_t w_t] = sum_y pi_new(y) = 1: sequence-level importance sampling is unbiased
    prod_w = (lp_new - lp_old).sum(-1).exp()
    assert (p_old * prod_w).sum().item() == pytest.approx(1.0, abs=1e-12)
    # E_old[s] <= 1 at fixed length (Jensen: s is the L-th root of an unbiased weight)
    s = g.importance_ratio(lp_new, lp_old, mask)
    assert (p_old * s).sum().item() <= 1 + 1e-12
    # E_old[log s] = -(1/L) sum_t E_ctx~old[ KL(pi_old(.|ctx) || pi_new(.|ctx)) ]
    e_log_s = (p_old * g.sequence_log_ratio(lp_new, lp_old, mask)).sum().item()
    kl_sum = 0.0
    for prefix, lo in old.items():                                   # every context, weighted by
        p_ctx = math.exp(sum(old[prefix[:t]][prefix[t]].item() for t in range(len(prefix))))
        kl_sum += p_ctx * (lo.exp() * (lo - new[prefix])).sum().item()   # its probability under old
    assert e_log_s == pytest.approx(-kl_sum / L, rel=1e-9, abs=1e-12)


def test_with_variable_lengths_the_expected_ratio_can_exceed_one():
    # tutorial.md section 4: pi_old stops at once (EOS) with p 0.5, else emits 100 tokens;
    # pi_new stops with p 0.6. Two possible responses, all other tokens deterministic.
    L = 100
    lp_old = torch.zeros(2, L, dtype=F64)
    lp_new = torch.zeros(2, L, dtype=F64)
    lp_old[0, 0], lp_new[0, 0] = math.log(0.5), math.log(0.6)       # "EOS", length 1
    lp_old[1, 0], lp_new[1, 0] = math.log(0.5), math.log(0.4)       # long response, length 100
    mask = torch.zeros(2, L, dtype=torch.bool)
    mask[0, 0], mask[1] = True, True
    s = g.importance_ratio(lp_new, lp_old, mask)
    expected = 0.5 * (0.6 / 0.5) + 0.5 * (0.4 / 0.5) ** (1 / L)
    e_s = (torch.tensor([0.5, 0.5], dtype=F64) * s).sum().item()
    assert e_s == pytest.approx(expected, rel=1e-12)
    assert e_s > 1.09, "with EOS the 1/|y| differs per response and Jensen's bound no longer holds"


# ---------------------------------------------------------------------------------------------
# 7b. The sampler-trainer gap, by exact enumeration. y is drawn from a sampler q; the trainer p
# scores it. Per position t: d_t = log p(y_t|ctx) - log q(y_t|ctx), k_t = KL(q(.|ctx) || p(.|ctx)).
# Given the context, E_q[d_t] = -k_t, so e_t = d_t + k_t has mean 0 given the past (martingale
# differences): the gaps' sum has mean -E[sum k_t] whatever the stopping rule, and at a fixed length
# the e_t are uncorrelated. With EOS, 1/|y| weights each response differently, and the
# length-normalised mean of d is not minus the length-normalised mean of k.
# ---------------------------------------------------------------------------------------------
def stopped_paths(q, p, V, L, eos=0):
    """Every response a sampler q can give, stopping at EOS (token `eos`; None: never) or at L tokens,
    with its probability under q and its per-position d_t and k_t: [(prob, [d_t], [k_t])]."""
    out = []

    def walk(prefix, prob, ds, ks):
        lq, lp = q[prefix], p[prefix]
        k = (lq.exp() * (lq - lp)).sum().item()                      # KL(q || p) at this context
        for y in range(V):
            step = (prob * lq[y].exp().item(), ds + [(lp[y] - lq[y]).item()], ks + [k])
            if y == eos or len(prefix) + 1 == L:
                out.append(step)
            else:
                walk(prefix + (y,), *step)
    walk((), 1.0, [], [])
    return out


def two_policies(V, L, seed, scale, drift):
    gen = torch.Generator().manual_seed(seed)
    q = random_policy(V, L, gen, scale)
    p = {k: torch.log_softmax(v + torch.randn(V, generator=gen, dtype=F64) * drift, -1) for k, v in q.items()}
    return q, p


@given(st.integers(2, 3), st.integers(1, 5), st.integers(0, 2**32 - 1),
       st.sampled_from([0.3, 1.0, 3.0]), st.sampled_from([0.01, 0.3, 2.0]))
def test_the_gap_sums_to_minus_the_kl_whatever_the_stopping_rule(V, L, seed, scale, drift):
    """E_q[sum_t d_t] = -E_q[sum_t k_t] exactly, with EOS stopping responses at different lengths."""
    q, p = two_policies(V, L, seed, scale, drift)
    paths = stopped_paths(q, p, V, L, eos=0)
    assert sum(w for w, _, _ in paths) == pytest.approx(1.0, abs=1e-12)
    gap = sum(w * sum(d) for w, d, _ in paths)
    kl = sum(w * sum(k) for w, _, k in paths)
    assert gap == pytest.approx(-kl, rel=1e-9, abs=1e-13), "E[sum d] != -E[sum k] with EOS"


@given(st.integers(2, 3), st.integers(2, 4), st.integers(0, 2**32 - 1),
       st.sampled_from([0.3, 1.0, 3.0]), st.sampled_from([0.01, 0.3, 2.0]))
def test_at_a_fixed_length_log_s_is_minus_the_mean_kl_plus_uncorrelated_noise(V, L, seed, scale, drift):
    """No EOS, every response L tokens: E_q[log s] = -E_q[K] with K = (1/L) sum_t k_t, and the
    centred gaps e_t = d_t + k_t are uncorrelated, so Var(log s + K) = (1/L^2) sum_t E[e_t^2]."""
    q, p = two_policies(V, L, seed, scale, drift)
    paths = stopped_paths(q, p, V, L, eos=None)
    assert all(len(d) == L for _, d, _ in paths)
    e_log_s = sum(w * sum(d) / L for w, d, _ in paths)
    assert e_log_s == pytest.approx(-sum(w * sum(k) / L for w, _, k in paths), rel=1e-9, abs=1e-13)
    e = [(w, [dt + kt for dt, kt in zip(d, k)]) for w, d, k in paths]
    scale2 = max(sum(w * x[t] ** 2 for w, x in e) for t in range(L))
    for a in range(L):
        assert abs(sum(w * x[a] for w, x in e)) <= 1e-11 * (1 + scale2)               # E[e_t] = 0
        for b in range(a + 1, L):
            assert abs(sum(w * x[a] * x[b] for w, x in e)) <= 1e-11 * (1 + scale2), (a, b)   # Cov = 0
    var = sum(w * (sum(x) / L) ** 2 for w, x in e)                   # E[(log s + K)^2], its mean is 0
    assert var == pytest.approx(sum(w * x[t] ** 2 for w, x in e for t in range(L)) / L ** 2, rel=1e-9, abs=1e-15)


def test_with_eos_the_length_normalised_gap_is_not_minus_the_mean_kl():
    """A counterexample: EOS (token 0) or one other token, at most 3 tokens. The sampler stops at
    once with probability 0.5, the trainer with 0.9; later contexts agree. The sum identity holds,
    but the short responses, weighted 1/|y| = 1, carry the whole gap: E_q[log s] != -E_q[K]."""
    V, L = 2, 3
    q = {c: torch.log(torch.tensor([0.5, 0.5], dtype=F64)) for n in range(L) for c in itertools.product(range(V), repeat=n)}
    p = dict(q)
    p[()] = torch.log(torch.tensor([0.9, 0.1], dtype=F64))              # they differ only at the start
    paths = stopped_paths(q, p, V, L, eos=0)
    assert sum(w * sum(d) for w, d, _ in paths) == pytest.approx(-sum(w * sum(k) for w, _, k in paths), rel=1e-12)
    e_log_s = sum(w * sum(d) / len(d) for w, d, _ in paths)
    minus_k = -sum(w * sum(k) / len(k) for w, _, k in paths)
    assert abs(e_log_s - minus_k) > 0.05, (e_log_s, minus_k)


# ---------------------------------------------------------------------------------------------
# 8. Variance: geometric averaging divides the log-ratio's variance by L (independent tokens).
# ---------------------------------------------------------------------------------------------
@given(st.integers(1, 64), st.sampled_from([0.01, 0.1, 1.0]), st.integers(0, 2**32 - 1))
def test_variance_of_log_ratio_is_sigma2_over_length_for_independent_tokens(L, sigma, seed):
    N = 4000
    gen = torch.Generator().manual_seed(seed)
    delta = torch.randn(N, L, generator=gen, dtype=F64) * sigma     # independent token log-ratios
    mask = torch.ones(N, L, dtype=torch.bool)
    log_s = g.sequence_log_ratio(delta, torch.zeros_like(delta), mask)
    unnormalised = delta.sum(-1)
    # a sample variance of N normal draws has relative standard deviation sqrt(2 / (N - 1));
    # 6 of them leaves a false alarm rate below 1e-8 per example
    tol = 6 * math.sqrt(2 / (N - 1))
    assert log_s.var().item() == pytest.approx(sigma**2 / L, rel=tol), "Var(log s) != sigma^2/L"
    assert unnormalised.var().item() == pytest.approx(L * sigma**2, rel=tol), "Var(sum) != L sigma^2"


@given(st.integers(2, 64), st.sampled_from([-0.5, 0.3, 0.9]), st.integers(0, 2**32 - 1))
def test_variance_with_autocorrelation_follows_the_general_formula(L, phi, seed):
    # AR(1) log-ratios: gamma_k = sigma^2 phi^k, stationary start
    N, sigma = 4000, 0.2
    gen = torch.Generator().manual_seed(seed)
    noise = torch.randn(N, L, generator=gen, dtype=F64) * sigma * math.sqrt(1 - phi**2)
    delta = torch.empty(N, L, dtype=F64)
    delta[:, 0] = torch.randn(N, generator=gen, dtype=F64) * sigma
    for t in range(1, L):
        delta[:, t] = phi * delta[:, t - 1] + noise[:, t]
    log_s = g.sequence_log_ratio(delta, torch.zeros_like(delta), torch.ones(N, L, dtype=torch.bool))
    theory = (L * sigma**2 + 2 * sum((L - k) * sigma**2 * phi**k for k in range(1, L))) / L**2
    # the draws are correlated, so the sampling error of the variance grows with the correlation
    tol = 6 * math.sqrt(2 / (N - 1)) * math.sqrt((1 + abs(phi)) / (1 - abs(phi)))
    assert log_s.var().item() == pytest.approx(theory, rel=tol)


# ---------------------------------------------------------------------------------------------
# 9-12. The gradient, GSPO-token, on-policy equality, clip semantics.
# ---------------------------------------------------------------------------------------------
def grad_of(loss_fn, b: Batch, adv=None, **kw):
    lp_new, logits = b.logp("new", grad=True)
    loss = loss_fn(lp_new, b.logp("old"), b.adv if adv is None else adv, b.mask, **kw)
    loss.backward()
    return loss.detach(), logits.grad


def dlogp_dlogits(b: Batch):
    """Analytic gradient of log softmax(z)[y] w.r.t. z: onehot(y) - softmax(z). (B, T, V)"""
    p = torch.softmax(b.logits_new.to(F64), -1)
    return F.one_hot(b.tokens, p.shape[-1]).to(F64) - p


f64_batches = batches(dtypes=(F64,), scales=(0.3, 1.0, 3.0), drifts=(1e-5, 1e-4, 1e-3, 0.1))


@given(f64_batches)
@with_corners(dtype=F64)
def test_gspo_gradient_is_eq10_for_unclipped_and_exactly_zero_for_clipped_sequences(b):
    s = g.importance_ratio(b.logp("new"), b.logp("old"), b.mask)
    assume(((s - (1 + EPS_HIGH)).abs() > 1e-9).all() and ((s - (1 - EPS_LOW)).abs() > 1e-9).all())
    _, grad = grad_of(g.gspo_loss, b)
    clipped = ((b.adv > 0) & (s > 1 + EPS_HIGH)) | ((b.adv < 0) & (s < 1 - EPS_LOW))
    n = b.mask.sum(-1).clamp(min=1)
    # eq. (10): d/dtheta of -(1/B) sum_i s_i A_i  ->  -(1/B) s_i A_i (1/|y_i|) sum_t grad log pi
    weight = torch.where(clipped, 0.0, -s * b.adv / (n * b.B))                # (B,)
    expect = weight[:, None, None] * torch.where(b.mask[..., None], dlogp_dlogits(b), 0)
    assert torch.allclose(grad, expect, rtol=1e-9, atol=1e-15), "gradient is not eq. (10)"
    assert (grad[clipped] == 0).all(), "a sequence clipped on its active side must get exactly 0"


@given(f64_batches)
def test_gspo_token_equals_gspo_in_value_and_gradient_with_sequence_advantages(b):
    v1, g1 = grad_of(g.gspo_loss, b)
    v2, g2 = grad_of(g.gspo_token_loss, b)
    v3, g3 = grad_of(g.gspo_token_loss, b, adv=b.adv[:, None].expand(b.B, b.T).clone())
    assert v1.item() == pytest.approx(v2.item(), rel=1e-12, abs=1e-15)
    assert v1.item() == pytest.approx(v3.item(), rel=1e-12, abs=1e-15)
    assert torch.allclose(g1, g2, rtol=1e-10, atol=1e-15), "eqs. 15-17: same gradient as GSPO"
    assert torch.allclose(g1, g3, rtol=1e-10, atol=1e-15)


@given(f64_batches, st.integers(0, 2**32 - 1))
def test_gspo_token_with_per_token_advantages_matches_its_definition(b, seed):
    adv = torch.randn(b.B, b.T, generator=torch.Generator().manual_seed(seed), dtype=F64)
    value, grad = grad_of(g.gspo_token_loss, b, adv=adv)
    s = g.importance_ratio(b.logp("new"), b.logp("old"), b.mask)
    assume(((s - (1 + EPS_HIGH)).abs() > 1e-9).all() and ((s - (1 - EPS_LOW)).abs() > 1e-9).all())
    d = dlogp_dlogits(b)
    expect_v, expect_g = 0.0, torch.zeros_like(grad)
    for i in range(b.B):                          # literal loop over eqs. (13-14)
        n = int(b.mask[i].sum())
        for t in range(b.T):
            if not b.mask[i, t]:
                continue
            si, a = s[i].item(), adv[i, t].item()
            clipped_s = min(max(si, 1 - EPS_LOW), 1 + EPS_HIGH)
            expect_v -= min(si * a, clipped_s * a) / (n * b.B)
            active = (a > 0 and si > 1 + EPS_HIGH) or (a < 0 and si < 1 - EPS_LOW)
            if not active:                        # d s_it = s_i * d log pi(y_it)
                expect_g[i, t] = -si * a / (n * b.B) * d[i, t]
    assert value.item() == pytest.approx(expect_v, rel=1e-10, abs=1e-15)
    assert torch.allclose(grad, expect_g, rtol=1e-9, atol=1e-15)


@given(f64_batches)
@with_corners(dtype=F64)
def test_on_policy_gspo_gspo_token_and_grpo_have_the_same_gradient(b):
    on = b.on_policy()                                 # theta = theta_old
    grads = [grad_of(fn, on)[1] for fn in (g.gspo_loss, g.gspo_token_loss, g.grpo_loss)]
    n = on.mask.sum(-1).clamp(min=1)
    p = torch.softmax(on.logits_new, -1)
    d = F.one_hot(on.tokens, p.shape[-1]).to(F64) - p
    expect = (-on.adv / (n * on.B))[:, None, None] * torch.where(on.mask[..., None], d, 0)
    for name, grad in zip(("gspo", "gspo-token", "grpo"), grads):
        assert torch.allclose(grad, expect, rtol=1e-10, atol=1e-15), f"{name} differs on-policy"


@given(batches(drifts=(1e-5, 1e-4, 1e-3, 0.1)))
@with_corners()
def test_clipped_objective_is_min_of_sA_and_one_sided_bound(b):
    lp_new, lp_old = b.logp("new"), b.logp("old")
    s = g.importance_ratio(lp_new, lp_old, b.mask).to(F64)
    A = b.adv.to(F64)
    # Spinning Up's form: min(sA, clip(s)A) == min(sA, g(A)), g(A) = (1+eps_high)A if A >= 0
    g_of_a = torch.where(A >= 0, (1 + EPS_HIGH) * A, (1 - EPS_LOW) * A)
    nonempty = b.mask.any(-1)
    expect = -torch.where(nonempty, torch.minimum(s * A, g_of_a), 0).sum() / b.B
    got = g.gspo_loss(lp_new, lp_old, b.adv, b.mask).to(F64)
    u = unit_roundoff(b.dtype)
    assert got.item() == pytest.approx(expect.item(), rel=16 * u, abs=16 * u * A.abs().max().item())


@given(batches(dtypes=(F64,), drifts=(1e-5, 1e-4, 1e-3, 0.1)))
@with_corners(dtype=F64)
def test_clip_changes_s_exactly_when_cross_entropy_gap_leaves_the_nat_band(b):
    lp_new, lp_old = b.logp("new"), b.logp("old")
    s = g.importance_ratio(lp_new, lp_old, b.mask)
    delta_h = g.cross_entropy(lp_old, b.mask) - g.cross_entropy(lp_new, b.mask)
    lo, hi = math.log(1 - EPS_LOW), math.log(1 + EPS_HIGH)          # [-3.0005e-4, 3.9992e-4] nats
    # generated values are kept 1e-9 away from the band edges: on the edge the float comparison
    # itself is decided by round-off
    assume((((delta_h - lo).abs() > 1e-9) & ((delta_h - hi).abs() > 1e-9)).all())
    changed = s.clamp(1 - EPS_LOW, 1 + EPS_HIGH) != s
    outside = (delta_h < lo) | (delta_h > hi)
    assert torch.equal(changed, outside), "clip must act exactly outside [ln(1-eps_low), ln(1+eps_high)]"


@given(batches(dtypes=(F64,), drifts=(1e-5, 1e-4, 1e-3, 0.1)))
@with_corners(dtype=F64)
def test_gradient_vanishes_exactly_on_the_active_side_of_the_band(b):
    lp_old = b.logp("old")
    lp_new = b.logp("new").detach().requires_grad_(True)
    g.gspo_loss(lp_new, lp_old, b.adv, b.mask).backward()
    delta_h = g.cross_entropy(lp_old, b.mask) - g.cross_entropy(lp_new.detach(), b.mask)
    lo, hi = math.log(1 - EPS_LOW), math.log(1 + EPS_HIGH)
    assume((((delta_h - lo).abs() > 1e-9) & ((delta_h - hi).abs() > 1e-9)).all())
    zero = (lp_new.grad == 0).all(-1)
    A = b.adv
    empty = ~b.mask.any(-1)
    expect_zero = empty | (A == 0) | ((A > 0) & (delta_h > hi)) | ((A < 0) & (delta_h < lo))
    assert torch.equal(zero, expect_zero), "zero gradient must mean: clipped on the active side"


# ---------------------------------------------------------------------------------------------
# 13. Group advantages.
# ---------------------------------------------------------------------------------------------
rewards_st = st.lists(st.lists(st.sampled_from([0.0, 0.1, 0.5, 1.0, -2.0, 3.7]), min_size=2,
                               max_size=8), min_size=1, max_size=5)


def grouped(groups):
    G = min(map(len, groups))
    return torch.tensor([r[:G] for r in groups], dtype=F64), G


@given(rewards_st)
@example([[0.1] * 3, [1.0, 0.0, 1.0]])   # mean(0.1, 0.1, 0.1) != 0.1 in float64: round-off, not signal
def test_group_advantages_are_centred_unit_std_and_exactly_zero_for_flat_groups(groups):
    r, G = grouped(groups)
    A = g.group_advantages(r.flatten(), G).reshape(r.shape)
    for i in range(len(r)):
        std = r[i].std().item()
        if len(set(r[i].tolist())) == 1:    # detected, not left to (r - mean) / (0 + eps)
            assert (A[i] == 0).all(), "a flat group must give exactly 0"
            continue
        assert abs(A[i].mean().item()) < 1e-12
        assert A[i].std().item() == pytest.approx(std / (std + 1e-6), rel=1e-12)


@given(rewards_st, st.floats(0.01, 100), st.floats(-100, 100))
def test_group_advantages_are_invariant_to_affine_reward_changes(groups, a, c):
    r, G = grouped(groups)
    A = g.group_advantages(r.flatten(), G)
    A2 = g.group_advantages((a * r + c).flatten(), G)
    std = r.std(dim=1).repeat_interleave(G)
    # (r - m)/(std + eps) against (r - m)/(std + eps/a): they differ by the eps alone
    bound = A.abs() * 1e-6 * (1 + 1 / a) / torch.where(std > 0, std, 1) + 1e-9
    assert ((A - A2).abs() <= bound).all()


@given(rewards_st, st.randoms(use_true_random=False))
def test_group_advantages_follow_permutations_and_groups_are_independent(groups, rnd):
    r, G = grouped(groups)
    A = g.group_advantages(r.flatten(), G).reshape(r.shape)
    perm = list(range(G))
    rnd.shuffle(perm)
    A_perm = g.group_advantages(r[:, perm].flatten(), G).reshape(r.shape)
    assert torch.allclose(A_perm, A[:, perm], rtol=1e-12, atol=1e-12), "not permutation-equivariant"
    changed = r.clone()
    changed[0] = torch.tensor([rnd.uniform(-5, 5) for _ in range(G)], dtype=F64)
    A_changed = g.group_advantages(changed.flatten(), G).reshape(r.shape)
    assert torch.equal(A_changed[1:], A[1:]), "one group's rewards changed another group"


def test_group_advantages_reject_a_batch_that_is_not_whole_groups():
    with pytest.raises(ValueError):
        g.group_advantages(torch.zeros(7), 4)
    with pytest.raises(ValueError):
        g.group_advantages(torch.zeros(4), 1)


# ---------------------------------------------------------------------------------------------
# 14-16. Micro-batching, token log-probs, and the defining difference from GRPO.
# ---------------------------------------------------------------------------------------------
@given(batches(dtypes=(F64,), max_b=8), st.sampled_from([1, 2, 4, 8]))
def test_micro_batched_gradient_equals_full_batch_gradient(b, k):
    assume(b.B % k == 0)
    full_loss, full_grad = grad_of(g.gspo_loss, b)
    lp_new, logits = b.logp("new", grad=True)
    lp_old = b.logp("old")
    step = b.B // k
    for j in range(0, b.B, step):                 # gradient accumulation: mean over micro-batches
        sl = slice(j, j + step)
        (g.gspo_loss(lp_new[sl], lp_old[sl], b.adv[sl], b.mask[sl]) / k).backward(retain_graph=True)
    assert torch.allclose(logits.grad, full_grad, rtol=1e-10, atol=1e-15)


@given(batches(), st.sampled_from([-1e3, -7.5, 0.0, 3.25, 1e3]))
@with_corners(extra=(1e3,))
@with_corners(dtype=F64, extra=(-7.5,))
def test_token_logprobs_is_log_softmax_gather_and_shift_invariant(b, c):
    logits = b.logits_old
    lp = g.token_logprobs(logits, b.tokens)
    for i, t in itertools.product(range(b.B), range(b.T)):      # literal log-sum-exp per position
        z = logits[i, t].double().tolist()
        m = max(z)
        ref = z[b.tokens[i, t]] - m - math.log(math.fsum(math.exp(v - m) for v in z))
        assert lp[i, t].item() == pytest.approx(ref, rel=1e-5, abs=1e-5)
    shifted = g.token_logprobs(logits + c, b.tokens)
    u = unit_roundoff(logits.dtype)
    # adding c re-rounds each logit by up to u(|z| + |c|); log_softmax passes that on, twice
    tol = 4 * u * (logits.abs().amax(-1) + abs(c)) + 4 * u * lp.abs()
    assert ((shifted - lp).abs() <= tol).all()


@given(st.integers(1, 4), st.integers(1, 9), st.integers(1, 300), st.integers(1, 4000),
       st.sampled_from([torch.float32, torch.float64]), st.sampled_from([0.1, 5.0, 80.0]),
       st.integers(0, 2 ** 16))
@example(2, 3, 49, 1, torch.float32, 80.0, 0)                # one position per chunk
@example(1, 9, 300, 301, torch.float64, 5.0, 1)              # chunks that cut across rows
def test_token_logprobs_in_chunks_is_bit_identical_to_one_log_softmax(B, T, V, chunk, dtype,
                                                                      scale, seed):
    gen = torch.Generator().manual_seed(seed)
    logits = (torch.randn(B, T, V, generator=gen, dtype=torch.float64) * scale).to(dtype)
    tokens = torch.randint(0, V, (B, T), generator=gen)
    weights = torch.randn(B, T, generator=gen, dtype=torch.float64).to(dtype)

    def value_and_grad(fn):
        x = logits.clone().requires_grad_(True)
        lp = fn(x)
        (lp * weights).sum().backward()
        return lp.detach(), x.grad

    one_shot = value_and_grad(lambda x: torch.log_softmax(x, -1).gather(-1, tokens[..., None])[..., 0])
    chunked = value_and_grad(lambda x: g.token_logprobs(x, tokens, chunk_elements=chunk))
    assert torch.equal(chunked[0], one_shot[0]), "values differ from log_softmax + gather"
    assert torch.equal(chunked[1], one_shot[1]), "gradients differ from log_softmax + gather"


@given(st.integers(1, 3), st.integers(1, 6), st.integers(2, 200), st.integers(1, 700),
       st.integers(0, 2 ** 16))
def test_token_logprobs_of_bf16_logits_are_the_float32_log_probs_of_the_same_logits(B, T, V, chunk,
                                                                                   seed):
    gen = torch.Generator().manual_seed(seed)
    logits = (torch.randn(B, T, V, generator=gen) * 10).to(torch.bfloat16)
    tokens = torch.randint(0, V, (B, T), generator=gen)
    lp = g.token_logprobs(logits, tokens, chunk_elements=chunk)
    assert lp.dtype == torch.float32                 # never rounded to bf16's 8 significant bits
    ref = torch.log_softmax(logits.float(), -1).gather(-1, tokens[..., None])[..., 0]
    assert torch.equal(lp, ref)


def test_one_wild_token_is_clipped_by_grpo_but_not_gspo_and_the_reverse():
    L = 50
    mask = torch.ones(1, L, dtype=torch.bool)
    A = torch.tensor([1.0], dtype=F64)
    lp_old = torch.full((1, L), -2.0, dtype=F64)
    # one token's probability rises e-fold while the other 49 give it back: s = 1 exactly
    delta = torch.full((1, L), -1.0 / (L - 1), dtype=F64)
    delta[0, 0] = 1.0
    lp_new = (lp_old + delta).requires_grad_(True)
    s = g.importance_ratio(lp_new, lp_old, mask)
    assert s.item() == pytest.approx(1.0, abs=1e-12)
    g.grpo_loss(lp_new, lp_old, A, mask).backward()
    assert lp_new.grad[0, 0] == 0 and (lp_new.grad[0, 1:] != 0).all(), "GRPO clips the wild token"
    lp_new.grad = None
    g.gspo_loss(lp_new, lp_old, A, mask).backward()
    assert (lp_new.grad != 0).all(), "GSPO keeps the whole sequence: s is inside its band"
    # the reverse: every token moves a little, 0.01 nats, far inside GRPO's [-0.22, 0.24] band,
    # yet together they move s = e^0.01 = 1.01 beyond GSPO's 1 + 4e-4
    lp_new = (lp_old + 0.01).requires_grad_(True)
    g.grpo_loss(lp_new, lp_old, A, mask).backward()
    assert (lp_new.grad != 0).all(), "GRPO clips nothing"
    lp_new.grad = None
    g.gspo_loss(lp_new, lp_old, A, mask).backward()
    assert (lp_new.grad == 0).all(), "GSPO clips the whole sequence"


# ---------------------------------------------------------------------------------------------
# 17. Relatives of GSPO: what each reduces to, its on-policy gradient, masks and empty rows.
# ---------------------------------------------------------------------------------------------
RELATIVES = {
    "gmpo": lab.gmpo_loss,
    "sapo": lab.sapo_loss,
    "sapo-seq": lambda *a, **k: lab.sapo_loss(*a, level="sequence", **k),
    "cispo": lab.cispo_loss,
    "luspo": lab.luspo_loss,
    "vespo": lab.vespo_loss,
}
PER_TOKEN_SUM = {"cispo", "vespo"}        # normalised by a token count, not by the number of rows


@given(batches(dtypes=(F64,), min_len=1))
@with_corners(dtype=F64, min_len=1)
def test_relatives_give_an_empty_row_no_loss_and_no_gradient(b):
    lp_new, lp_old = b.logp("new"), b.logp("old")
    mask = b.mask.clone()
    mask[0] = False
    for name, fn in RELATIVES.items():
        new = lp_new.detach().clone().requires_grad_(True)
        loss = fn(new, lp_old, b.adv, mask)
        loss.backward()
        assert (new.grad[0] == 0).all(), f"{name}: the empty row got a gradient"
        rest = fn(lp_new[1:], lp_old[1:], b.adv[1:], mask[1:]) if b.B > 1 else torch.tensor(0.0)
        expect = rest if name in PER_TOKEN_SUM else rest * (b.B - 1) / b.B
        assert loss.item() == pytest.approx(expect.item(), rel=1e-9, abs=1e-12), name


@given(f64_batches)
@with_corners(dtype=F64)
def test_relatives_on_policy_are_the_policy_gradient_up_to_their_aggregation(b):
    """At theta = theta_old every ratio is 1, every gate and weight is at its centre: GMPO and both
    SAPOs give GSPO's gradient; LUSPO |y_i| times it; CISPO and VESPO, normalised by tokens,
    B |y_i| / sum|y| times it."""
    on = b.on_policy()
    _, base = grad_of(g.gspo_loss, on)
    n = on.mask.sum(-1).to(F64)
    scale = {"gmpo": torch.ones_like(n), "sapo": torch.ones_like(n), "sapo-seq": torch.ones_like(n),
             "luspo": n, "cispo": on.B * n / n.sum().clamp(min=1), "vespo": on.B * n / n.sum().clamp(min=1)}
    for name, fn in RELATIVES.items():
        _, grad = grad_of(fn, on)
        assert torch.allclose(grad, base * scale[name][:, None, None], rtol=1e-10, atol=1e-15), name


@given(f64_batches)
def test_gmpo_without_clipping_is_the_plain_sequence_ratio_objective(b):
    lp_new, lp_old = b.logp("new"), b.logp("old")
    s = g.importance_ratio(lp_new, lp_old, b.mask)
    nonempty = b.mask.any(-1)
    expect = -torch.where(nonempty, s * b.adv, 0).sum() / b.B
    got = lab.gmpo_loss(lp_new, lp_old, b.adv, b.mask, eps=(math.inf, math.inf))
    assert got.item() == pytest.approx(expect.item(), rel=1e-12, abs=1e-15)


def literal_rows(b: Batch, lp_new, lp_old):
    """(the row's per-token log-ratios as Python floats, its advantage) for each non-empty row: the
    raw material of the literal loops below, which rebuild a loss without any tensor code."""
    for i in range(b.B):
        d = [(lp_new[i, t] - lp_old[i, t]).item() for t in range(b.T) if b.mask[i, t]]
        if d:
            yield d, b.adv[i].item()


@given(f64_batches)
def test_gmpo_clips_each_token_log_ratio_on_the_pessimistic_side(b):
    """A literal loop over GMPO's definition: tokens clipped in log space, then the geometric mean."""
    lp_new, lp_old = b.logp("new"), b.logp("old")
    e_lo, e_hi = 2e-3, 1e-3
    got = lab.gmpo_loss(lp_new, lp_old, b.adv, b.mask, eps=(e_lo, e_hi))
    total = 0.0
    for d, a in literal_rows(b, lp_new, lp_old):
        c = [min(x, min(max(x, -e_lo), e_hi)) if a > 0 else max(x, min(max(x, -e_lo), e_hi)) for x in d]
        total += math.exp(sum(c) / len(c)) * a
    assert got.item() == pytest.approx(-total / b.B, rel=1e-10, abs=1e-15)


@given(batches(dtypes=(F64,), min_len=1), st.integers(1, 9))
def test_luspo_on_equal_lengths_is_gspo_times_that_length(b, L):
    T = max(b.T, L)
    lp_new = F.pad(torch.where(b.mask, b.logp("new"), -1.0), (0, T - b.T), value=-1.0)   # finite
    lp_old = F.pad(torch.where(b.mask, b.logp("old"), -2.0), (0, T - b.T), value=-2.0)
    mask = torch.zeros(b.B, T, dtype=torch.bool)
    mask[:, :L] = True
    luspo = lab.luspo_loss(lp_new, lp_old, b.adv, mask)
    gspo = g.gspo_loss(lp_new, lp_old, b.adv, mask)
    assert luspo.item() == pytest.approx(L * gspo.item(), rel=1e-12, abs=1e-15)


@given(f64_batches, st.integers(1, 4), st.integers(0, 16))
@with_corners(dtype=F64, extra=(4, 0))
def test_luspo_is_gspo_under_the_token_weighted_aggregations(b, minibatches, extra_width):
    """LUSPO = -(1/B) sum_i |y_i| l_i, and GSPO under dapo is -(1/N) sum_i |y_i| l_i, under dr_grpo
    -(1/(B W)) sum_i |y_i| l_i: so luspo = (N/B) gspo(dapo) = W gspo(dr_grpo), in value and gradient.
    N is what the training loop passes (the rollout's tokens / minibatches), so N/B is the rollout's
    mean length; W is max_new_tokens (at least the mask's width)."""
    N, W = max(b.mask.sum().item() / minibatches, 1.0), b.T + extra_width   # as if 1-4 minibatches
    value, grad = grad_of(lab.luspo_loss, b)
    for scale, kw in ((N / b.B, dict(aggregation="dapo", num_tokens=N)),
                      (W, dict(aggregation="dr_grpo", max_tokens=W))):
        v, gr = grad_of(lab.gspo_loss, b, **kw)
        assert (scale * v).item() == pytest.approx(value.item(), rel=1e-10, abs=1e-14), kw
        assert torch.allclose(scale * gr, grad, rtol=1e-9, atol=1e-14), kw


@pytest.mark.parametrize("level", ["token", "sequence"])
@given(batches(dtypes=(F64,), drifts=(1e-3, 0.1, 1.0)))
@with_corners(dtype=F64)
def test_sapo_in_float64_uses_its_temperatures_exactly(level, b):
    """tau_neg = 1.05 is not a float32 number: built in float32 it would be 1.0499999523, and the
    float64 loss would be off by about 3e-8 relative. A literal loop in Python floats agrees to 1e-12."""
    lp_new, lp_old = b.logp("new"), b.logp("old")
    got = lab.sapo_loss(lp_new, lp_old, b.adv, b.mask, level=level)
    f = lambda r, a: 1 / (1 + math.exp(-(1.0 if a > 0 else 1.05) * (r - 1))) * 4 / (1.0 if a > 0 else 1.05) * a
    total = 0.0
    for d, a in literal_rows(b, lp_new, lp_old):
        total += f(math.exp(sum(d) / len(d)), a) if level == "sequence" else \
            sum(f(math.exp(x), a) for x in d) / len(d)
    assert got.item() == pytest.approx(-total / b.B, rel=1e-12, abs=1e-15)


@pytest.mark.parametrize("level", ["token", "sequence"])
@given(batches(dtypes=(F64,), scales=(0.3, 1.0), drifts=(0.1, 0.5), min_len=1))
def test_sapo_gate_width_goes_from_the_plain_ratio_gradient_to_nothing(level, b):
    """f(r) = sigmoid(tau (r - 1)) 4 / tau has slope 4 sigmoid (1 - sigmoid): 1 for every r as tau
    -> 0 (the unclipped ratio objective), and 0 for every r != 1 as tau grows (a trust region of
    zero width)."""
    lp_new, lp_old = b.logp("new"), b.logp("old")

    def grad(loss):
        new = lp_new.detach().clone().requires_grad_(True)
        loss(new).backward()
        return new.grad
    if level == "token":
        plain = lambda new: -g.masked_mean(torch.exp(torch.where(b.mask, new - lp_old, 0))
                                           * b.adv[:, None], b.mask).mean()
    else:
        plain = lambda new: -(g.importance_ratio(new, lp_old, b.mask) * b.adv).mean()
    narrow = grad(lambda new: lab.sapo_loss(new, lp_old, b.adv, b.mask, tau=(1e-8, 1e-8), level=level))
    assert torch.allclose(narrow, grad(plain), rtol=1e-9, atol=1e-15)
    delta = torch.where(b.mask, lp_new - lp_old, 0)
    moved = g.masked_mean(delta, b.mask) if level == "sequence" else delta[b.mask]
    assume((moved.abs() > 1e-3).all())                  # r != 1 everywhere the gate is looked at
    wide = grad(lambda new: lab.sapo_loss(new, lp_old, b.adv, b.mask, tau=(1e5, 1e5), level=level))
    assert wide.abs().max().item() < 1e-12 * max(1.0, b.adv.abs().max().item())


@given(f64_batches, st.floats(1.001, 10.0))
def test_cispo_caps_the_weight_but_keeps_every_tokens_gradient(b, cap):
    lp_new, lp_old = b.logp("new"), b.logp("old")
    new = lp_new.detach().clone().requires_grad_(True)
    lab.cispo_loss(new, lp_old, b.adv, b.mask, cap=cap).backward()
    w = torch.exp(torch.where(b.mask, lp_new - lp_old, 0)).clamp(max=cap)
    expect = torch.where(b.mask, -w * b.adv[:, None] / b.mask.sum().clamp(min=1), 0)
    assert torch.allclose(new.grad, expect, rtol=1e-12, atol=1e-15)    # no token's gradient is cut


@given(f64_batches)
def test_vespo_weight_is_the_gamma_function_of_the_unnormalised_ratio(b):
    lp_new, lp_old = b.logp("new"), b.logp("old")
    new = lp_new.detach().clone().requires_grad_(True)
    lab.vespo_loss(new, lp_old, b.adv, b.mask).backward()
    n = b.mask.sum(-1).to(F64)
    W = g.importance_ratio(lp_new, lp_old, b.mask) ** n                  # s ** |y| = PPL_old/PPL_new ** |y|
    k = torch.where(b.adv >= 0, 2.0, 3.0).to(F64)
    lam = torch.where(b.adv >= 0, 3.0, 2.0).to(F64)
    phi = W ** k * torch.exp(lam * (1 - W))
    expect = torch.where(b.mask, -(phi * b.adv)[:, None] / n.sum().clamp(min=1), 0)
    assert torch.allclose(new.grad, expect, rtol=1e-9, atol=1e-15)


def test_vespo_weight_vanishes_without_overflow_for_extreme_sequence_ratios():
    T = 4096
    mask = torch.ones(2, T, dtype=torch.bool)
    old = torch.zeros(2, T, dtype=F64)
    new = torch.stack([torch.full((T,), 50.0), torch.full((T,), -50.0)]).to(F64).requires_grad_(True)
    loss = lab.vespo_loss(new, old, torch.tensor([1.0, -1.0], dtype=F64), mask)
    loss.backward()
    assert torch.isfinite(loss) and (new.grad == 0).all()       # phi(W) = 0 at W = e^(+-204800)


@given(batches(dtypes=(F64,)), st.floats(-0.5, 0.5))
def test_off_policy_mask_drops_exactly_the_drifted_responses_with_negative_advantage(b, delta):
    lp_new, lp_old = b.logp("new"), b.logp("old")
    keep = lab.off_policy_sequence_mask(lp_new, lp_old, b.adv, b.mask, delta)
    # (1/|y|) sum_t (log pi_old - log pi_new) = H_new - H_old = log(PPL_new / PPL_old) = -log s
    drift = g.cross_entropy(lp_new, b.mask) - g.cross_entropy(lp_old, b.mask)
    expect = (b.adv >= 0) | (drift <= delta)
    close = (drift - delta).abs() < 1e-12                   # two ways of rounding the same mean
    assert torch.equal(keep[~close], expect[~close])
    for junk in (float("nan"), float("inf"), 1e30):         # masked positions never decide
        dirty = lab.off_policy_sequence_mask(torch.where(b.mask, lp_new, junk),
                                           torch.where(b.mask, lp_old, -junk), b.adv, b.mask, delta)
        assert torch.equal(dirty, keep)


# ---------------------------------------------------------------------------------------------
# Aggregation (--aggregation) and Dr. GRPO's advantage (--scale-rewards none).
# ---------------------------------------------------------------------------------------------
# the lab's three losses, which take every aggregation (at "paper" they are gspo_minimal's)
AGGREGATED = {"gspo": lab.gspo_loss, "gspo-token": lab.gspo_token_loss, "grpo": lab.grpo_loss}


@given(f64_batches)
@with_corners(dtype=F64)
def test_dapo_weights_each_sequence_gradient_by_its_length_over_the_mean_length(b):
    """The aggregation trap: with a sequence-level ratio, dapo = sum_i |y_i| l_i / sum_i |y_i|, so
    sequence i's gradient is the paper's times B |y_i| / sum_j |y_j| (|y_i| / mean |y|)."""
    n = b.mask.sum(-1).to(F64)
    weight = b.B * n / n.sum().clamp(min=1)
    for name in ("gspo", "gspo-token"):
        _, paper = grad_of(AGGREGATED[name], b)
        _, dapo = grad_of(AGGREGATED[name], b, aggregation="dapo")
        assert torch.allclose(dapo, paper * weight[:, None, None], rtol=1e-9, atol=1e-15), name


@given(f64_batches)
@with_corners(dtype=F64)
def test_dapo_sums_grpos_token_terms_where_the_paper_averages_each_row(b):
    lp_new, lp_old = b.logp("new"), b.logp("old")
    w = torch.where(b.mask, lp_new - lp_old, 0).exp()
    term = torch.minimum(w * b.adv[:, None], w.clamp(0.8, 1.27) * b.adv[:, None])      # (B, T)
    total, n = torch.where(b.mask, term, 0).sum(), b.mask.sum()
    for agg, denominator in (("dapo", n.clamp(min=1)), ("dr_grpo", b.B * b.T), ("dapo", 7.5)):
        kw = {"num_tokens": denominator} if denominator == 7.5 else {}
        loss = lab.grpo_loss(lp_new, lp_old, b.adv, b.mask, aggregation=agg, **kw)
        assert loss.item() == pytest.approx(-(total / denominator).item(), rel=1e-10, abs=1e-15), agg


@given(f64_batches, st.integers(1, 12))
def test_on_equal_lengths_every_aggregation_is_the_papers(b, L):
    """All rows |y| = L: dapo's sum_i L l_i / (B L) and dr_grpo's with max_tokens = L are (1/B) sum_i l_i."""
    b = Batch(**{**b.args, "garbage": None})                 # this test draws its own mask
    mask = torch.arange(b.T)[None, :].expand(b.B, b.T) < min(L, b.T)
    lp_new, lp_old = b.logp("new"), b.logp("old")
    for name, fn in AGGREGATED.items():
        paper = fn(lp_new, lp_old, b.adv, mask)
        for agg in ("dapo", "dr_grpo"):
            other = fn(lp_new, lp_old, b.adv, mask, aggregation=agg, max_tokens=min(L, b.T))
            assert other.item() == pytest.approx(paper.item(), rel=1e-10, abs=1e-14), (name, agg)


@given(batches(dtypes=(F64,), min_len=1))
def test_every_aggregation_gives_an_empty_row_no_gradient(b):
    mask = b.mask.clone()
    mask[0] = False
    for name, fn in AGGREGATED.items():
        for agg in lab.AGGREGATIONS:
            new = b.logp("new").detach().clone().requires_grad_(True)
            fn(new, b.logp("old"), b.adv, mask, aggregation=agg).backward()
            assert (new.grad[0] == 0).all(), (name, agg)


def test_an_unknown_aggregation_is_refused():
    b = CORNERS[1]
    with pytest.raises(ValueError, match="aggregation"):
        lab.gspo_loss(b.logp("new"), b.logp("old"), b.adv, b.mask, aggregation="token")


@given(rewards_st)
@example([[0.1] * 3, [1.0, 0.0, 1.0]])
def test_dr_grpo_advantages_are_the_centred_rewards_and_exactly_zero_for_flat_groups(groups):
    r, G = grouped(groups)
    A = lab.group_advantages(r.flatten(), G, scale=False).reshape(r.shape)
    for i in range(len(r)):
        if len(set(r[i].tolist())) == 1:
            assert (A[i] == 0).all(), "a flat group must give exactly 0"
        else:                                        # the reference: r - mean(r), no division
            ref = [x - sum(r[i].tolist()) / G for x in r[i].tolist()]
            assert A[i].tolist() == pytest.approx(ref, rel=1e-12, abs=1e-15)
    scaled = g.group_advantages(r.flatten(), G).reshape(r.shape)
    std = r.std(dim=1, keepdim=True)
    assert torch.allclose(scaled * (std + 1e-6), A, rtol=1e-12, atol=1e-15)   # the one difference


@given(K=st.floats(0, 2e-3), sigma=st.floats(0, 0.1), n=st.integers(1, 48), seed=st.integers(0, 2 ** 64 - 1))
def test_the_synthetic_gap_gives_log_s_of_mean_minus_k_and_variance_sigma_squared_over_n(K, sigma, n, seed):
    """At theta = theta_old log s is the mean of a response's gaps: over 4,000 responses of n tokens
    (and EOS-padded columns past them), its mean is -K within 5 standard errors and its variance
    SIGMA^2 / n within 5 of its own; the global random stream is untouched and the draws repeat."""
    B, T = 4000, n + 3
    mask = torch.arange(T)[None, :].expand(B, T) < n                        # n tokens, then padding
    cfg = lab.Config(seed=seed, record_noise=f"{K!r},{sigma!r}")
    state = torch.get_rng_state()
    d = lab.synthetic_gap(mask, cfg)
    assert torch.equal(torch.get_rng_state(), state) and (d[~mask] == 0).all()
    # log s = mean_t (d_t - 0), in float64, so that no reduction's width (AVX-512, AVX2, scalar)
    # enters; the d_t are float32, and rounding -K to float32 moves their mean by at most
    # 2^-24 K = 1.2e-10 (K <= 2e-3), under the 1e-9 slack
    log_s = g.sequence_log_ratio(d.double(), torch.zeros_like(d, dtype=torch.float64), mask)
    se = sigma / math.sqrt(n * B)
    assert abs(log_s.mean().item() + K) <= 5 * se + 1e-9
    assert log_s.var().item() == pytest.approx(sigma ** 2 / n, rel=5 * math.sqrt(2 / (B - 1)), abs=1e-12)
    assert torch.equal(lab.synthetic_gap(mask, lab.Config(seed=seed, record_noise=cfg.record_noise)), d)

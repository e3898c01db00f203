"""fastlm.losses against float64 references written out term by term (TRL's formulas for DPO), their
shift invariance, masks, and sequence_logprobs' values and gradients against logits + log_softmax +
gather (through the Triton interpreter on CPU)."""

import math

import pytest
import torch
import torch.nn.functional as F

import fastlm
from fastlm.losses import DPO_LOSS_TYPES
from ops.reference import check_against_float64, unit_roundoff

RELATIVE = 1e-6  # the target: loss values within 1e-6 relative of float64
# fp32 sequence log-probabilities: matmuls and sums in other orders than torch's (the chunks')
FP32_ALLOWANCE = 1e-6


def log_sigmoid(x: float) -> float:
    """log sigmoid(x) = -log(1 + e^-x), in the form that neither overflows nor cancels."""
    return -math.log1p(math.exp(-x)) if x >= 0 else x - math.log1p(math.exp(x))


def assert_relative(got: torch.Tensor, expected: float) -> None:
    assert abs(got.item() - expected) <= RELATIVE * abs(expected), (got.item(), expected)


def rewards(*shape, scale=3.0):
    """fp32 rewards of std ``scale``: many pairs far from a tie, some near one."""
    return torch.randn(*shape) * scale


# ----------------------------------------------------------------------------------------------
# Bradley-Terry and ranking
# ----------------------------------------------------------------------------------------------


def bradley_terry_float64(chosen, rejected, margin):
    terms = [-log_sigmoid(c - r - m) for c, r, m in zip(chosen.tolist(), rejected.tolist(), margin, strict=True)]
    return sum(terms) / len(terms)


@pytest.mark.parametrize("margin", [0.0, 0.5, "tensor"])
@pytest.mark.parametrize("batch", [1, 13])  # one pair; a prime number of pairs
def test_bradley_terry_matches_float64(batch, margin):
    chosen, rejected = rewards(batch), rewards(batch)
    margins = torch.rand(batch) if margin == "tensor" else margin
    expected = bradley_terry_float64(
        chosen.double(), rejected.double(), margins.tolist() if margin == "tensor" else [margin] * batch
    )
    got = fastlm.bradley_terry_loss(chosen, rejected, margins)
    assert got.dtype == torch.float32
    assert_relative(got, expected)


def test_bradley_terry_is_stable_far_from_a_tie():
    """Reward gaps of +-200: log(sigmoid(.)) would give -inf (and an infinite loss) in fp32."""
    chosen, rejected = torch.tensor([0.0, 200.0]), torch.tensor([200.0, 0.0])
    assert_relative(fastlm.bradley_terry_loss(chosen, rejected), bradley_terry_float64(chosen, rejected, [0.0, 0.0]))


def ranking_float64(rewards, mask):
    row_losses = []
    for row, keep in zip(rewards.double().tolist(), mask.tolist(), strict=True):
        ranked = [r for r, k in zip(row, keep, strict=True) if k]
        pairs = [-log_sigmoid(ranked[i] - ranked[j]) for i in range(len(ranked)) for j in range(i + 1, len(ranked))]
        if pairs:
            row_losses.append(sum(pairs) / len(pairs))
    return sum(row_losses) / len(row_losses)


@pytest.mark.parametrize("k", [2, 5])  # one pair per row (Bradley-Terry); 10 pairs
def test_ranking_matches_float64(k):
    r = rewards(7, k)
    mask = torch.ones(7, k, dtype=torch.bool)
    assert_relative(fastlm.ranking_loss(r), ranking_float64(r, mask))


def test_ranking_skips_masked_columns_and_rows_without_pairs():
    """Padding anywhere in a row; a row left with one response has no pair and no weight."""
    r = rewards(4, 5)
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 0, 1, 1, 0], [1, 1, 0, 0, 0], [0, 0, 1, 0, 0]], dtype=torch.bool)
    assert_relative(fastlm.ranking_loss(r, mask), ranking_float64(r, mask))
    # what padding holds does not matter, not even NaN, for the loss or the gradients
    padded = r.masked_fill(~mask, float("nan")).requires_grad_()
    loss = fastlm.ranking_loss(padded, mask)
    assert loss.item() == fastlm.ranking_loss(r, mask).item()
    loss.backward()
    assert torch.isfinite(padded.grad).all() and (padded.grad[~mask] == 0).all()


def test_ranking_of_two_is_bradley_terry():
    r = rewards(9, 2).double()
    torch.testing.assert_close(fastlm.ranking_loss(r), fastlm.bradley_terry_loss(r[:, 0], r[:, 1]), rtol=1e-15, atol=0)


@pytest.mark.parametrize("trial", range(5))
def test_shifting_every_reward_of_a_prompt_changes_nothing(trial):
    """A constant, and any per-prompt function, added to the rewards: shifts up to 1e4 (float64)."""
    chosen, rejected, ranked = rewards(11).double(), rewards(11).double(), rewards(11, 4).double()
    constant = (torch.rand(()) * 2 - 1) * 1e4
    per_prompt = (torch.rand(11, dtype=torch.float64) * 2 - 1) * 1e4
    bt = fastlm.bradley_terry_loss(chosen, rejected)
    ranking = fastlm.ranking_loss(ranked)
    for shift in (constant, per_prompt):
        assert_relative(fastlm.bradley_terry_loss(chosen + shift, rejected + shift), bt.item())
        assert_relative(fastlm.ranking_loss(ranked + shift.reshape(-1, 1)), ranking.item())


# ----------------------------------------------------------------------------------------------
# DPO
# ----------------------------------------------------------------------------------------------


def dpo_float64(pc, pr, rc, rr, beta, eps, loss_type):
    """TRL's DPOTrainer.dpo_loss, term by term in float64: the mean loss and the rewards."""
    losses = []
    for a, b, c, d in zip(pc.tolist(), pr.tolist(), rc.tolist(), rr.tolist(), strict=True):
        logits = (a - b) - (c - d)
        if loss_type == "sigmoid":
            loss = -log_sigmoid(beta * logits) * (1 - eps) - log_sigmoid(-beta * logits) * eps
        elif loss_type == "robust":
            loss = (-log_sigmoid(beta * logits) * (1 - eps) + log_sigmoid(-beta * logits) * eps) / (1 - 2 * eps)
        elif loss_type == "hinge":
            loss = max(0.0, 1 - beta * logits)
        else:  # ipo
            loss = (logits - 1 / (2 * beta)) ** 2
        losses.append(loss)
    chosen_rewards = [beta * (a - c) for a, c in zip(pc.tolist(), rc.tolist(), strict=True)]
    rejected_rewards = [beta * (b - d) for b, d in zip(pr.tolist(), rr.tolist(), strict=True)]
    return sum(losses) / len(losses), chosen_rewards, rejected_rewards


def logps(batch):
    """Sequence log-probabilities of tens of tokens: negative, tens to hundreds."""
    return -torch.rand(batch) * 200


@pytest.mark.parametrize(
    "loss_type,label_smoothing",
    [("sigmoid", 0.0), ("sigmoid", 0.1), ("robust", 0.0), ("robust", 0.2), ("hinge", 0.0), ("ipo", 0.0)],
)
@pytest.mark.parametrize("beta", [0.1, 0.5])
def test_dpo_matches_trl_formulas_in_float64(loss_type, label_smoothing, beta):
    inputs = [logps(13) for _ in range(4)]
    # the policy close to the reference, as in training: |h| of a few units, where hinge is not flat
    inputs[2], inputs[3] = inputs[0] + torch.randn(13), inputs[1] + torch.randn(13)
    expected, chosen, rejected = dpo_float64(*(t.double() for t in inputs), beta, label_smoothing, loss_type)
    out = fastlm.dpo_loss(*inputs, beta=beta, label_smoothing=label_smoothing, loss_type=loss_type)
    assert_relative(out.loss, expected)
    # the rewards are beta times differences of logps of ~100: fp32 rounding of the inputs' difference
    torch.testing.assert_close(
        out.chosen_rewards.double(), torch.tensor(chosen, dtype=torch.float64), rtol=1e-6, atol=beta * 200 * 2**-24
    )
    torch.testing.assert_close(
        out.rejected_rewards.double(), torch.tensor(rejected, dtype=torch.float64), rtol=1e-6, atol=beta * 200 * 2**-24
    )


@pytest.mark.parametrize("loss_type", DPO_LOSS_TYPES)
def test_dpo_gradients_reach_the_policy_only(loss_type):
    policy = [logps(5).double().requires_grad_() for _ in range(2)]
    reference = [(p.detach() + torch.randn(5, dtype=torch.float64)).requires_grad_() for p in policy]
    fastlm.dpo_loss(*policy, *reference, beta=0.3, loss_type=loss_type).loss.backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in policy)
    assert all(r.grad is None for r in reference)
    # the loss depends on h only: the two policy gradients are opposite
    torch.testing.assert_close(policy[0].grad, -policy[1].grad)


def test_dpo_is_unchanged_by_shifts_of_a_pair():
    """Adding c_b to both policy log-probabilities of pair b (or to both reference ones) leaves h."""
    inputs = [logps(7).double() for _ in range(4)]
    shift = (torch.rand(7, dtype=torch.float64) * 2 - 1) * 1e4
    expected = fastlm.dpo_loss(*inputs).loss.item()
    pc, pr, rc, rr = inputs
    assert_relative(fastlm.dpo_loss(pc + shift, pr + shift, rc, rr).loss, expected)
    assert_relative(fastlm.dpo_loss(pc, pr, rc - shift, rr - shift).loss, expected)


# ----------------------------------------------------------------------------------------------
# sequence_logprobs and linear_dpo_loss
# ----------------------------------------------------------------------------------------------

# 3 sequences of 7 positions: 21 tokens, chunks of 8 leave a partial last chunk; width 13 (prime);
# vocabulary 131: just above a 128 tile, so the kernels' last block is mostly masked.
B, T, D, V = 3, 7, 13, 131


def lm_inputs(batch=B):
    """hidden (batch, T, D), weight (V, D), bias (V,), targets (batch, T), mask (batch, T) with
    prompt and padding positions masked out (and a fully masked sequence last, when batch > 2).
    Logits of std ~3. Padding targets hold -1: out of range, so reading them would fail."""
    hidden = torch.randn(batch, T, D)
    weight = torch.randn(V, D) * 3 / D**0.5
    bias = torch.randn(V)
    targets = torch.randint(0, V, (batch, T))
    starts, ends = torch.randint(0, 3, (batch, 1)), torch.randint(4, T + 1, (batch, 1))
    position = torch.arange(T)
    mask = (position >= starts) & (position < ends)
    if batch > 2:
        mask[-1] = False
    targets[position >= ends.expand(batch, T)] = -1
    return hidden, weight, bias, targets, mask


def sequence_logprobs_ref(hidden, weight, bias, targets, mask):
    """The plain computation: logits, log_softmax, gather, masked sums; (2, B): sums and means."""
    logprobs = F.log_softmax(F.linear(hidden, weight, bias), dim=-1)  # (B, T, V)
    picked = logprobs.gather(-1, targets.clamp(min=0).unsqueeze(-1)).squeeze(-1)  # (B, T)
    total = torch.where(mask, picked, 0.0).sum(1)
    return torch.stack([total, total / mask.sum(1).clamp(min=1)])


@pytest.mark.parametrize("with_bias", [True, False])
def test_sequence_logprobs_and_gradients_match_float64(with_bias):
    hidden, weight, bias, targets, mask = lm_inputs()
    inputs = [t.clone().requires_grad_() for t in (hidden, weight, bias if with_bias else None) if t is not None]
    if not with_bias:
        inputs.append(None)

    def ours(h, w, b):
        out = fastlm.sequence_logprobs(h, w, targets, mask, b, chunk_rows=8)
        assert torch.equal(out.tokens, mask.sum(1))
        return torch.stack([out.sum, out.mean])

    out = check_against_float64(
        ours, lambda h, w, b: sequence_logprobs_ref(h, w, b, targets, mask), inputs, FP32_ALLOWANCE
    )
    assert (out[:, -1] == 0).all()  # the fully masked sequence: no tokens, sum and mean 0
    assert (out[:, :-1] < 0).all()


def test_sequence_logprobs_without_mask_counts_every_token():
    hidden, weight, bias, targets, _ = lm_inputs()
    targets = targets.clamp(min=0)
    out = fastlm.sequence_logprobs(hidden, weight, targets, bias=bias)
    full = torch.ones(B, T, dtype=torch.bool)
    ref = sequence_logprobs_ref(hidden.double(), weight.double(), bias.double(), targets, full)
    torch.testing.assert_close(torch.stack([out.sum, out.mean]).double(), ref, rtol=1e-5, atol=0)
    assert (out.tokens == T).all()


@pytest.mark.parametrize("average_logps", [False, True])
def test_linear_dpo_loss_is_dpo_on_the_sequence_logprobs(average_logps):
    """Chosen rows then rejected rows in one batch; loss and gradients as the unfused computation."""
    hidden, weight, bias, targets, mask = lm_inputs(batch=4)
    ref_chosen, ref_rejected = -torch.rand(2) * 20, -torch.rand(2) * 20
    which = 1 if average_logps else 0

    def ours(h, w, b):
        out = fastlm.linear_dpo_loss(
            h, w, targets, mask, ref_chosen, ref_rejected, b, beta=0.2, average_logps=average_logps, chunk_rows=8
        )
        return out.loss

    def reference(h, w, b):
        policy = sequence_logprobs_ref(h, w, b, targets, mask)[which]
        c, r, rc, rr = policy[:2], policy[2:], ref_chosen.to(h.dtype), ref_rejected.to(h.dtype)
        return -F.logsigmoid(0.2 * ((c - r) - (rc - rr))).mean()

    inputs = [t.clone().requires_grad_() for t in (hidden, weight, bias)]
    check_against_float64(ours, reference, inputs, FP32_ALLOWANCE)


def dpo_reference(policy, ref_chosen, ref_rejected, beta, eps, loss_type):
    """TRL's per-pair formulas, written out, on policy (2B,) sequence log-probabilities."""
    c, r = policy.chunk(2)
    h = (c - r) - (ref_chosen.to(policy.dtype) - ref_rejected.to(policy.dtype))
    losses = {
        "sigmoid": -(1 - eps) * F.logsigmoid(beta * h) - eps * F.logsigmoid(-beta * h),
        "robust": (-(1 - eps) * F.logsigmoid(beta * h) + eps * F.logsigmoid(-beta * h)) / (1 - 2 * eps),
        "hinge": F.relu(1 - beta * h),
        "ipo": (h - 1 / (2 * beta)) ** 2,
    }[loss_type]
    return losses.mean()


@pytest.mark.parametrize(
    "loss_type,eps,average_logps,group_rows",
    [
        ("sigmoid", 0.0, False, 2 * T),  # one pair per group
        ("sigmoid", 0.1, True, 4 * T),  # two pairs per group
        ("robust", 0.2, False, 6 * T),  # groups of three pairs and one
        ("hinge", 0.0, True, None),  # the default: every pair in one group
        ("ipo", 0.0, False, 2 * T + 1),
    ],
)
def test_one_pass_dpo_loss_and_gradients_match_float64(loss_type, eps, average_logps, group_rows):
    """Without a bias, groups of whole pairs in one pass: loss, rewards and gradients as the unfused
    computation in float64, for every loss type and group size (4 pairs, one fully masked)."""
    hidden, weight, _, targets, mask = lm_inputs(batch=8)
    ref_chosen, ref_rejected = -torch.rand(4) * 20, -torch.rand(4) * 20
    which = 1 if average_logps else 0
    beta = 0.5 if loss_type == "hinge" else 0.2  # hinge: most pairs inside the margin, so gradients flow
    options = dict(beta=beta, label_smoothing=eps, loss_type=loss_type, average_logps=average_logps)

    def ours(h, w, b):
        out = fastlm.linear_dpo_loss(h, w, targets, mask, ref_chosen, ref_rejected, chunk_rows=group_rows, **options)
        assert type(out.loss.grad_fn).__name__ == "LinearPairLossFunctionBackward"
        policy = sequence_logprobs_ref(h.double(), w.double(), None, targets, mask)[which]
        rewards = beta * (policy - torch.cat((ref_chosen, ref_rejected)).double())
        torch.testing.assert_close(
            torch.cat((out.chosen_rewards, out.rejected_rewards)).double(), rewards, rtol=1e-5, atol=1e-6
        )
        return out.loss * 3  # an upstream gradient other than 1 reaches the gradients kept from the forward

    def reference(h, w, b):
        policy = sequence_logprobs_ref(h, w, b, targets, mask)[which]
        return dpo_reference(policy, ref_chosen, ref_rejected, beta, eps, loss_type) * 3

    inputs = [t.clone().requires_grad_() for t in (hidden, weight)] + [None]
    check_against_float64(ours, reference, inputs, FP32_ALLOWANCE)


@pytest.mark.parametrize("case", ["no-mask-with-ignored-targets", "no-pairs", "no-tokens"])
def test_one_pass_and_two_pass_dpo_agree_at_the_edges(case):
    """The paths with and without gradients give the same loss and rewards: -100 targets without a
    mask count as tokens of the mean (sequence_logprobs' rule), no pairs give NaN (a mean over
    nothing), empty responses give log-probabilities 0."""
    batch, length = {"no-mask-with-ignored-targets": (4, T), "no-pairs": (0, T), "no-tokens": (4, 0)}[case]
    hidden, weight = torch.randn(batch, length, D), torch.randn(V, D) * 3 / D**0.5
    targets = torch.randint(0, V, (batch, length))
    targets[:, : length // 2] = -100
    refs = -torch.rand(2, batch // 2) * 20

    def run(grad: bool):
        with torch.set_grad_enabled(grad):
            h = hidden.clone().requires_grad_()
            out = fastlm.linear_dpo_loss(h, weight, targets, None, *refs, beta=0.2, average_logps=True)
            return torch.cat((out.loss.detach().view(1), out.chosen_rewards, out.rejected_rewards))

    with_grad, without = run(True), run(False)
    torch.testing.assert_close(with_grad, without, rtol=1e-5, atol=1e-6, equal_nan=True)
    assert with_grad[0].isnan() == (batch == 0)


def test_dpo_with_a_chunk_below_one_pair_takes_the_two_pass_path():
    """chunk_rows below a pair's 2T rows bounds the memory: the log-probabilities' own backward."""
    hidden, weight, _, targets, mask = lm_inputs(batch=4)
    hidden.requires_grad_()
    out = fastlm.linear_dpo_loss(hidden, weight, targets, mask, torch.zeros(2), torch.zeros(2), chunk_rows=2 * T - 1)
    assert type(out.loss.grad_fn).__name__ != "LinearPairLossFunctionBackward"


# ----------------------------------------------------------------------------------------------
# Bad inputs: one clear error naming the argument
# ----------------------------------------------------------------------------------------------

R = torch.zeros(3)
H, W, TG = torch.zeros(2, 3, 4), torch.zeros(5, 4), torch.zeros(2, 3, dtype=torch.long)


@pytest.mark.parametrize(
    "call,error,message",
    [
        (
            lambda: fastlm.bradley_terry_loss(R, torch.zeros(4)),
            ValueError,
            r"one shape.*chosen \(3,\), rejected \(4,\)",
        ),
        (lambda: fastlm.bradley_terry_loss(R.long(), R), TypeError, "chosen must have dtype"),
        (lambda: fastlm.bradley_terry_loss(R, R, float("nan")), ValueError, "margin must be a finite number"),
        (lambda: fastlm.ranking_loss(R), ValueError, r"rewards must be 2-D, got shape \(3,\)"),
        (lambda: fastlm.ranking_loss(R.view(1, 3), R.view(1, 3)), TypeError, "mask must have dtype in \\(bool\\)"),
        (lambda: fastlm.dpo_loss(R, R, R, R, loss_type="kto"), ValueError, "loss_type must be one of sigmoid, ipo"),
        (lambda: fastlm.dpo_loss(R, R, R, R, beta=0), ValueError, "beta must be a finite number > 0"),
        (lambda: fastlm.dpo_loss(R, R, R, R, label_smoothing=0.1, loss_type="ipo"), ValueError, "ipo takes no label"),
        (lambda: fastlm.dpo_loss(R, R, R, R, label_smoothing=0.1, loss_type="hinge"), ValueError, "hinge takes no"),
        (lambda: fastlm.dpo_loss(R, R, R, R, label_smoothing=0.5, loss_type="robust"), ValueError, "below 0.5"),
        (lambda: fastlm.dpo_loss(R, R, R, R[:2]), ValueError, r"ref_rejected_logps \(2,\)"),
        (lambda: fastlm.sequence_logprobs(H[0], W, TG), ValueError, "hidden must be 3-D"),
        (lambda: fastlm.sequence_logprobs(H, W, TG[:, :2]), ValueError, r"targets must have shape \(2, 3\)"),
        (lambda: fastlm.sequence_logprobs(H, W, TG, TG), TypeError, "mask must have dtype"),
        (lambda: fastlm.sequence_logprobs(H, W, TG, chunk_rows=0), ValueError, "chunk_rows must be an int >= 1"),
        (
            lambda: fastlm.linear_dpo_loss(H[:1], W, TG[:1], TG[:1] > 0, R, R),
            ValueError,
            r"hidden must be \(2B, T, d\)",
        ),
        (
            lambda: fastlm.linear_dpo_loss(H.clone().requires_grad_(), W, TG, TG > 0, R, R),
            ValueError,
            r"ref_chosen_logps must have shape \(1,\), one per pair, got \(3,\)",
        ),
    ],
)
def test_bad_argument_raises_one_clear_error_naming_it(call, error, message):
    with pytest.raises(error, match=message):
        call()


@pytest.mark.gpu
def test_gpu_bf16_sequence_logprobs_match_float64():
    """The CUDA kernels at bf16 with a vocabulary of many tiles: values and gradients at least as close
    to float64 as the plain computation in bf16 (which rounds the logits and log-softmax to bf16)."""
    batch, length, width, vocab = 4, 129, 64, 32003  # odd length and vocabulary: partial tiles and chunks
    hidden = torch.randn(batch, length, width, device="cuda").bfloat16().requires_grad_()
    weight = (torch.randn(vocab, width, device="cuda") * 3 / width**0.5).bfloat16().requires_grad_()
    targets = torch.randint(0, vocab, (batch, length), device="cuda")
    mask = torch.rand(batch, length, device="cuda") < 0.7

    def ours(h, w, b):
        out = fastlm.sequence_logprobs(h, w, targets, mask, chunk_rows=128)
        return torch.stack([out.sum, out.mean])

    check_against_float64(
        ours,
        lambda h, w, b: sequence_logprobs_ref(h, w, b, targets, mask),
        [hidden, weight, None],
        unit_roundoff(torch.bfloat16) / 8,
    )


@pytest.mark.gpu
def test_gpu_bf16_one_pass_dpo_matches_float64():
    """The one-pass DPO on the CUDA kernels at bf16, pairs split across groups: loss and gradients as
    close to float64 as the log-probabilities' own kernels are."""
    pairs, length, width, vocab = 3, 129, 64, 32003
    hidden = torch.randn(2 * pairs, length, width, device="cuda").bfloat16().requires_grad_()
    weight = (torch.randn(vocab, width, device="cuda") * 3 / width**0.5).bfloat16().requires_grad_()
    targets = torch.randint(0, vocab, (2 * pairs, length), device="cuda")
    mask = torch.rand(2 * pairs, length, device="cuda") < 0.7
    ref_chosen, ref_rejected = -torch.rand(pairs, device="cuda") * 900, -torch.rand(pairs, device="cuda") * 900

    def ours(h, w, b):
        out = fastlm.linear_dpo_loss(h, w, targets, mask, ref_chosen, ref_rejected, beta=0.01, chunk_rows=4 * length)
        assert type(out.loss.grad_fn).__name__ == "LinearPairLossFunctionBackward"
        return out.loss

    def reference(h, w, b):
        policy = sequence_logprobs_ref(h, w, b, targets, mask)[0]
        return dpo_reference(policy, ref_chosen, ref_rejected, 0.01, 0.0, "sigmoid")

    check_against_float64(ours, reference, [hidden, weight, None], unit_roundoff(torch.bfloat16) / 8)

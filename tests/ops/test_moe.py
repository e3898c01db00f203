"""Mixture of experts: `moe_experts` (output, the gradients of x, both expert weights and the routing
weights) against transformers' eager loop in float64, for each gating and dtype, with uneven, empty
and overfull experts, top-k = E, pairs of no expert, strided weights; the sort; the routers;
determinism, compile, errors."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from fastlm.ops.moe import ExpertOrder, expert_order, moe_experts, moe_experts_ref, route
from fastlm.ops.moe import experts as op
from fastlm.ops.moe.routing import ROUTINGS

from .launches import compiled_code_launches
from .reference import check_against_float64, unit_roundoff
from .test_cross_entropy import poisoned_outputs  # noqa: F401 (a fixture)

# How far fastlm's normwise error may pass the eager loop's (both against float64). fp32: the same
# products summed in another order. bf16: the loop rounds every product, gating and weighted sum
# to bf16, fastlm the same intermediates (GU, H, Y) and sums the K expert outputs in fp32.
ALLOWANCE = {torch.float32: 1e-6, torch.bfloat16: unit_roundoff(torch.bfloat16) / 4}


def _inputs(tokens=12, d=24, inter=20, experts=4, k=2, dtype=torch.float32, seed=0, index=None, device="cpu"):
    """x (T, D), gate_up (E, 2I, D), down (E, D, I), routing weights (T, K), all requiring grad, and
    top_k_index (T, K): random distinct experts per token unless given."""
    generator = torch.Generator().manual_seed(seed)

    def randn(*shape, scale=1.0):
        return (torch.randn(shape, generator=generator) * scale).to(device, dtype).requires_grad_()

    x = randn(tokens, d)
    gate_up, down = randn(experts, 2 * inter, d, scale=d**-0.5), randn(experts, d, inter, scale=inter**-0.5)
    if index is None:
        index = torch.rand(tokens, experts, generator=generator).argsort(dim=1)[:, :k]
    weights = torch.rand(index.shape, generator=generator).softmax(dim=-1).to(device, dtype).requires_grad_()
    return x, gate_up, down, weights, index.to(device)


def _check(x, gate_up, down, weights, index, activation="silu"):
    """fastlm against the eager loop and float64, output and the four gradients."""
    check_against_float64(
        lambda x, gate_up, down, weights: moe_experts(x, gate_up, down, index, weights, activation),
        lambda x, gate_up, down, weights: moe_experts_ref(x, gate_up, down, index, weights, activation),
        (x, gate_up, down, weights),
        ALLOWANCE[x.dtype],
    )


@pytest.mark.parametrize("dtype", list(ALLOWANCE), ids=str)
@pytest.mark.parametrize("activation", op.ACTIVATIONS)
def test_matches_float64(activation, dtype):
    _check(*_inputs(dtype=dtype), activation=activation)


ROUTES = {
    # uneven counts, two experts that no token picks
    "empty experts": torch.tensor([[0, 3], [3, 0], [0, 5], [5, 3], [3, 5]]),
    "one token": torch.tensor([[2, 1]]),
    # 40 pairs of one expert: three of the interpreter's 16-row tiles, the last partial
    "overfull expert": torch.tensor([[1]] * 40),
    "top-k = E": torch.tensor([[0, 1, 2, 3, 4, 5]] * 3),
    # pairs of experts held elsewhere (transformers' expert parallelism marks them so): nothing added
    "pairs of no expert": torch.tensor([[-1, 2], [6, 0], [2, -1], [0, 2]]),
}


@pytest.mark.parametrize("index", list(ROUTES.values()), ids=list(ROUTES))
def test_routes_of_every_shape(index):
    _check(*_inputs(tokens=index.shape[0], experts=6, index=index)[:4], index)


@pytest.mark.usefixtures("poisoned_outputs")
def test_strided_weights_and_gelu():
    """Transposed copies of the expert weights (a checkpoint stored (E, D, 2I)), every output
    written (NaN-filled allocations), exact GELU."""
    x, gate_up, down, weights, index = _inputs()
    gate_up_t = gate_up.detach().transpose(1, 2).contiguous().transpose(1, 2).requires_grad_()
    down_t = down.detach().transpose(1, 2).contiguous().transpose(1, 2).requires_grad_()
    assert not gate_up_t.is_contiguous() and not down_t.is_contiguous()
    _check(x, gate_up_t, down_t, weights, index, "gelu")


def test_no_tokens():
    x, gate_up, down, weights, index = _inputs(tokens=0)
    out = moe_experts(x, gate_up, down, index, weights)
    out.sum().backward()
    assert out.shape == (0, 24) and gate_up.grad.abs().sum() == 0 and down.grad.abs().sum() == 0


def test_backward_is_deterministic():
    x, gate_up, down, weights, index = _inputs(tokens=20, k=2)
    runs = [torch.autograd.grad(moe_experts(x, gate_up, down, index, weights).sum(), (x, gate_up, down, weights))]
    runs.append(torch.autograd.grad(moe_experts(x, gate_up, down, index, weights).sum(), (x, gate_up, down, weights)))
    for first, second in zip(*runs, strict=True):
        assert torch.equal(first, second)


def test_expert_order_groups_pairs_by_expert_stably():
    index = torch.tensor([[2, 0], [0, 2], [1, -1], [0, 3]])
    plan = expert_order(index, 3)
    assert isinstance(plan, ExpertOrder)
    assert plan.offsets.tolist() == [1, 4, 5, 7]  # the -1 pair first, then experts 0, 1, 2; the 3 last
    assert plan.order.tolist() == [5, 1, 2, 6, 4, 0, 3, 7]  # pair t K + j; ties in pair order
    assert plan.tokens.tolist() == [p // 2 for p in plan.order.tolist()]
    assert all(plan.order[plan.positions.view(-1)[p]] == p for p in range(8))
    assert plan.tokens.dtype == plan.positions.dtype == plan.offsets.dtype == torch.int32


def test_reference_path_without_interpreter(monkeypatch):
    """CPU without TRITON_INTERPRET takes the eager loop: the same values."""
    inputs = _inputs()
    expected = moe_experts(*inputs[:3], inputs[4], inputs[3])
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    torch.testing.assert_close(moe_experts(*inputs[:3], inputs[4], inputs[3]), expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("interpreted", [True, False], ids=["kernels", "pytorch-paths"])
def test_compiles_without_graph_breaks(interpreted, monkeypatch):
    """Traced, the op runs the kernels (here in the interpreter) or, where they do not run, the
    primitives' PyTorch paths: the same gradients as eager, pairs of no expert included."""
    x, gate_up, down, weights, index = _inputs(tokens=5, experts=6, index=ROUTES["pairs of no expert"][[0, 1, 2, 3, 0]])
    if not interpreted:
        monkeypatch.delenv("TRITON_INTERPRET", raising=False)

    def loss(x, gate_up, down, weights):
        return moe_experts(x, gate_up, down, index, weights).square().sum()

    compiled = torch.compile(loss, fullgraph=True, backend="aot_eager")
    got = torch.autograd.grad(compiled(x, gate_up, down, weights), (x, gate_up, down, weights))
    expected = torch.autograd.grad(loss(x, gate_up, down, weights), (x, gate_up, down, weights))
    for ours, theirs in zip(got, expected, strict=True):
        torch.testing.assert_close(ours, theirs)


def test_ops_pass_opcheck():
    x, gate_up, down, weights, index = (t.detach() for t in _inputs(tokens=5, d=16, inter=16))
    torch.library.opcheck(op._forward_op, (x, gate_up, down, index, weights, "silu"))


BAD = [
    (lambda x, gu, dn, w, i: (x[0], gu, dn, i, w), ValueError, "expected x"),
    (lambda x, gu, dn, w, i: (x, gu[:, :-1], dn, i, w), ValueError, "gate_up must be"),
    (lambda x, gu, dn, w, i: (x, gu, dn, i[:-1], w), ValueError, "top_k_index and top_k_weights"),
    (lambda x, gu, dn, w, i: (x, gu, dn, i.float(), w), TypeError, "top_k_index"),
    (lambda x, gu, dn, w, i: (x, gu.double(), dn, i, w), TypeError, "gate_up and down"),
]


@pytest.mark.parametrize("bad, error, message", BAD, ids=[message for _, _, message in BAD])
def test_bad_inputs_raise_clear_errors(bad, error, message):
    with pytest.raises(error, match=message):
        moe_experts(*bad(*_inputs()))
    with pytest.raises(ValueError, match="activation must be one of"):
        moe_experts(*_inputs()[:3], _inputs()[4], _inputs()[3], activation="relu")


# Each kernel built for sm90 at the H100 / H200 tiles, in a process without the interpreter (no GPU
# needed): what the interpreter does not check (tl.dot's tile shapes, the layouts the MMA takes)
SM90_BUILD = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from fastlm.ops.moe import grouped_matmul as gm, permute

SHARED_MEMORY = 232448  # bytes an H100 / H200 SM gives one program

def build(kernel, signature, constexprs, config=None):
    options = {"num_warps": config.num_warps, "num_stages": config.num_stages} if config else {}
    signature = {**signature, **dict.fromkeys(constexprs, "constexpr")}
    source = ASTSource(kernel, signature=signature, constexprs=constexprs)
    compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options)
    assert compiled.metadata.shared <= SHARED_MEMORY, (kernel.__name__, signature["A" if "A" in signature else "G"],
                                                       compiled.metadata.shared)
    print(kernel.__name__)

ints = lambda *names: dict.fromkeys(names, "i32")
for dtype, size, precision in (("*bf16", 2, "ieee"), ("*fp32", 4, "ieee")):
    signature = {"A": dtype, "B": dtype, "C": dtype, "GU": dtype, "A_ROWS": "*i32", "ROW_SCALE": "*fp32",
                 "OFFSETS": "*i32", "TILE_ENDS": "*i32",
                 **ints("M_TILES", "N", "K", "E", "stride_am", "stride_ak", "stride_be", "stride_bn", "stride_bk")}
    for epilogue in ("none", "glu", "glu_backward"):
        c = gm.grouped_matmul_config(90, gm._matmul_kind(epilogue), size)
        build(gm._grouped_matmul_kernel, signature, {"EPILOGUE": epilogue, "ACTIVATION": "silu", "GATHER": True,
              "SCALE": True, "PRECISION": precision, "BLOCK_M": c.block_m, "BLOCK_N": c.block_n,
              "BLOCK_K": c.block_k, "BLOCK_E": 128, "GROUP_M": c.group}, c)
    c = gm.grouped_matmul_config(90, "weight_grad", size)
    signature = {"G": dtype, "X": dtype, "DB": dtype, "G_ROWS": "*i32", "X_ROWS": "*i32", "ROW_SCALE": "*fp32",
                 "OFFSETS": "*i32", **ints("N", "K", "stride_gm", "stride_gn", "stride_xm", "stride_xk")}
    build(gm._grouped_weight_grad_kernel, signature, {"GATHER_G": True, "GATHER_X": True, "SCALE": True,
          "PRECISION": precision, "BLOCK_M": c.block_m, "BLOCK_N": c.block_n, "BLOCK_K": c.block_k,
          "GROUP_N": c.group}, c)
pairs = {"POSITIONS": "*i32", "EXPERTS": "*i64"}
build(permute._combine_kernel, {"Y": "*bf16", **pairs, "WEIGHTS": "*fp32", "OUT": "*bf16", **ints("T", "D", "K", "E")},
      {"WEIGHTED": True, "BLOCK_T": 16, "BLOCK_D": 256})
build(permute._combine_weight_grad_kernel, {"DOUT": "*bf16", "Y": "*bf16", **pairs, "DWEIGHTS": "*fp32",
      **ints("T", "D", "K", "E")}, {"BLOCK_T": 16, "BLOCK_D": 256, "BLOCK_K": 8})
"""


def test_kernels_build_for_hopper():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    src = str(Path(op.__file__).parents[3])
    env["PYTHONPATH"] = os.pathsep.join([src, *filter(None, [env.get("PYTHONPATH")])])
    out = subprocess.run([sys.executable, "-c", SM90_BUILD], env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-3000:]
    grouped = ["_grouped_matmul_kernel"] * 3 + ["_grouped_weight_grad_kernel"]
    assert out.stdout.split() == [*grouped, *grouped, "_combine_kernel", "_combine_weight_grad_kernel"]


# ----------------------------------------------------------------------------------------------
# On a GPU: the sm90 tiles (128-row expert tiles), launched by Triton and by Inductor
# ----------------------------------------------------------------------------------------------

GPU_SHAPES = {
    # Qwen3-30B-A3B's routing (128 experts, top-8) at a narrower width: 32 pairs per expert on
    # average, so every expert's tile is partial and some experts get none
    "128 experts top-8": dict(tokens=512, d=256, inter=192, experts=128, k=8),
    # Mixtral's (8 experts, top-2): 250 pairs per expert, two tiles each, widths past one tile
    "8 experts top-2": dict(tokens=1000, d=320, inter=448, experts=8, k=2),
}


@pytest.mark.gpu
@pytest.mark.parametrize("shape", list(GPU_SHAPES.values()), ids=list(GPU_SHAPES))
@pytest.mark.parametrize("dtype", list(ALLOWANCE), ids=str)
def test_gpu_matches_float64(dtype, shape):
    _check(*_inputs(**shape, dtype=dtype, device="cuda"))


@pytest.mark.gpu
def test_gpu_skewed_routes():
    """Every token's first choice is expert 3 (600 pairs, five tiles, the last partial), the second
    random among the others; experts 0 and 7 get none."""
    second = torch.tensor([1, 2, 4, 5, 6]).repeat(120)
    index = torch.stack([torch.full((600,), 3), second], dim=1)
    x, gate_up, down, weights, _ = _inputs(tokens=600, d=128, inter=96, experts=8, dtype=torch.bfloat16, device="cuda")
    _check(x, gate_up, down, weights, index.cuda())


@pytest.mark.gpu
def test_gpu_backward_is_deterministic():
    inputs = _inputs(**GPU_SHAPES["128 experts top-8"], dtype=torch.bfloat16, device="cuda")
    x, gate_up, down, weights, index = inputs
    leaves = (x, gate_up, down, weights)
    first, second = (
        torch.autograd.grad(moe_experts(x, gate_up, down, index, weights).square().sum(), leaves) for _ in range(2)
    )
    for a, b in zip(first, second, strict=True):
        assert torch.equal(a, b)


@pytest.mark.gpu
def test_gpu_inductor_launches_the_kernels_from_its_code():
    x, gate_up, down, weights, index = _inputs(**GPU_SHAPES["8 experts top-2"], device="cuda")

    def layer(x, gate_up, down, weights):
        return moe_experts(x, gate_up, down, index, weights) * 2

    compiled_code_launches(
        layer,
        (x, gate_up, down, weights),
        kernels=("_grouped_matmul_kernel", "_grouped_weight_grad_kernel", "_combine_kernel"),
        ops=("fastlm.moe_experts_forward", "fastlm.moe_experts_backward"),
    )
    check_against_float64(
        torch.compile(layer, fullgraph=True),
        lambda x, gate_up, down, weights: moe_experts_ref(x, gate_up, down, index, weights) * 2,
        (x, gate_up, down, weights),
        ALLOWANCE[torch.float32],
    )


# ----------------------------------------------------------------------------------------------
# Routing
# ----------------------------------------------------------------------------------------------


def _families_routing(logits, k, routing, normalize, bias):
    """The routers as transformers' modeling files write them (Mixtral / Qwen3-MoE, GPT-OSS,
    DeepSeek-V3 without groups), in float64."""
    logits = logits.double()
    if routing == "softmax_topk":
        weights, index = torch.topk(F.softmax(logits, dim=-1), k, dim=-1)
    elif routing == "topk_softmax":
        top, index = torch.topk(logits, k, dim=-1)
        weights = F.softmax(top, dim=-1)
    else:
        scores = logits.sigmoid()
        index = torch.topk(scores + bias.double(), k, dim=-1)[1]
        weights = scores.gather(1, index)
    if normalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, index


@pytest.mark.parametrize("normalize", [False, True])
@pytest.mark.parametrize("routing", ROUTINGS)
def test_routings_match_the_families(routing, normalize):
    logits = torch.randn(9, 8, dtype=torch.bfloat16, requires_grad=True)
    bias = torch.randn(8) if routing == "sigmoid_bias" else None
    weights, index = route(logits, 3, routing, normalize, bias, scale=2.5)
    expected_weights, expected_index = _families_routing(logits.detach(), 3, routing, normalize, bias)
    assert weights.dtype == torch.float32 and torch.equal(index, expected_index)
    torch.testing.assert_close(weights.double(), 2.5 * expected_weights, rtol=1e-6, atol=1e-7)
    (grad,) = torch.autograd.grad(weights.sum(), logits)
    assert torch.isfinite(grad).all()


def test_bad_routing_arguments():
    logits = torch.randn(4, 6)
    for kwargs, message in (
        ({"k": 7}, "k must be in"),
        ({"k": 2, "routing": "top1"}, "routing must be one of"),
        ({"k": 2, "bias": torch.zeros(6)}, "a bias goes with"),
        ({"k": 2, "routing": "sigmoid_bias", "bias": torch.zeros(5)}, "bias must be"),
    ):
        with pytest.raises(ValueError, match=message):
            route(logits, **kwargs)

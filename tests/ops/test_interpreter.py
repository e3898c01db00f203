"""bf16 kernels give the GPU's numbers under the Triton interpreter, with nothing patched by tests."""

import os
import subprocess
import sys

import pytest
import torch
import triton
import triton.language as tl

from fastlm.ops import interpreter

# The kernel tests below check the interpreter's arithmetic; on a GPU machine the kernels compile
# for the GPU instead (its bf16 division and fma round in their own way).
interpreted = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="runs under TRITON_INTERPRET=1")

# One bf16 operation per OP, on (N,) tensors; the result is stored as bf16.
OPERATIONS = [
    "add",
    "sub",
    "mul",
    "div",
    "fma",
    "neg",
    "times 2.5",
    "greater",
    "round fp32",
    "round fp32 rtne",
    "from int",
    "sum",
]


@triton.jit
def _bf16_operation_kernel(X, Y, OUT, N: tl.constexpr, OP: tl.constexpr):
    offsets = tl.arange(0, N)
    x = tl.load(X + offsets)  # bf16
    y = tl.load(Y + offsets)  # bf16
    if OP == 0:
        out = x + y
    elif OP == 1:
        out = x - y
    elif OP == 2:
        out = x * y
    elif OP == 3:
        out = x / y
    elif OP == 4:
        out = tl.fma(x, y, x)
    elif OP == 5:
        out = -x
    elif OP == 6:
        out = x * 2.5  # a bf16 constant
    elif OP == 7:
        out = (x > y).to(tl.bfloat16)
    elif OP == 8:
        # x (1 + 1.5 * 2^-9): between two bf16 neighbours, nearer the upper one
        out = (x.to(tl.float32) * 1.0029296875).to(tl.bfloat16)
    elif OP == 9:
        out = (x.to(tl.float32) * 1.0029296875).to(tl.bfloat16, fp_downcast_rounding="rtne")
    elif OP == 10:
        out = offsets.to(tl.bfloat16)
    else:
        out = tl.zeros((N,), tl.bfloat16) + tl.sum(x, axis=0)
    tl.store(OUT + offsets, out)


def _torch_operation(name, x, y):
    """torch's bf16 result: the exact (fp32) result rounded once, as the GPU's bf16 instructions do."""
    xf, yf = x.float(), y.float()
    exact = {
        "add": xf + yf,
        "sub": xf - yf,
        "mul": xf * yf,
        "div": xf / yf,
        "fma": xf * yf + xf,
        "neg": -xf,
        "times 2.5": xf * 2.5,
        "greater": (xf > yf).float(),
        "round fp32": xf * 1.0029296875,
        "round fp32 rtne": xf * 1.0029296875,
        "from int": torch.arange(len(x)).float(),
        "sum": xf.sum().expand(len(x)),
    }[name]
    return exact.bfloat16()


@interpreted
@pytest.mark.parametrize("name", OPERATIONS)
def test_bf16_operations_round_like_the_gpu(name):
    # 64 values spread over magnitudes and signs, so that integer arithmetic on the bit patterns,
    # truncation instead of rounding, or a comparison of unsigned patterns would show
    x = (torch.randn(64) * torch.logspace(-3, 3, 64)).bfloat16()
    y = (torch.randn(64) * 5).bfloat16()
    out = torch.full((64,), float("nan"), dtype=torch.bfloat16)
    _bf16_operation_kernel[(1,)](x, y, out, N=64, OP=OPERATIONS.index(name))
    assert torch.equal(out, _torch_operation(name, x, y))


@triton.jit
def _bf16_dot_kernel(A, B, C, M: tl.constexpr, N: tl.constexpr, K: tl.constexpr):
    rows, cols, inner = tl.arange(0, M), tl.arange(0, N), tl.arange(0, K)
    a = tl.load(A + rows[:, None] * K + inner[None, :])
    b = tl.load(B + inner[:, None] * N + cols[None, :])
    tl.store(C + rows[:, None] * N + cols[None, :], tl.dot(a, b))  # fp32 accumulator


@interpreted
def test_bf16_dot_is_exact_products_summed_in_fp32():
    a, b = (torch.randn(16, 32) * 4).bfloat16(), torch.randn(32, 16).bfloat16()
    c = torch.empty(16, 16)
    _bf16_dot_kernel[(1,)](a, b, c, M=16, N=16, K=32)
    torch.testing.assert_close(c.double(), a.double() @ b.double(), rtol=1e-6, atol=1e-5)


def test_rounding_to_bf16_is_to_nearest_even_and_keeps_specials():
    # ties to even (down, then up), above a tie, overflow to inf, infinities, an fp32 subnormal, -0
    values = torch.tensor(
        [1.0 + 2**-8, 1.0 + 3 * 2**-8, -(1.0 + 2**-8 + 2**-20), 3.4e38, float("inf"), -float("inf"), 1e-40, -0.0]
    )
    bits = torch.from_numpy(interpreter.narrow(values.numpy()).view("int16"))
    assert torch.equal(bits, values.bfloat16().view(torch.int16))
    widened = torch.from_numpy(interpreter.widen(bits.numpy().view("uint16")))
    assert torch.equal(widened.view(torch.int32), values.bfloat16().float().view(torch.int32))
    nan = interpreter.narrow(torch.tensor([float("nan"), -float("nan")]).numpy())  # payloads vary by device
    assert torch.from_numpy(interpreter.widen(nan)).isnan().all()


def test_applying_twice_changes_nothing():
    from triton.runtime.interpreter import InterpreterBuilder

    interpreter.apply()  # done on import under the interpreter; here the first time on a GPU machine
    before = dict(vars(InterpreterBuilder))
    interpreter.apply()
    assert dict(vars(InterpreterBuilder)) == before


# A user's process: nothing but `import fastlm`, the interpreter on, bf16 attention and RMSNorm on CPU.
USER_PROCESS = """
import torch, fastlm
from fastlm.ops.flash_attention import flash_attention_ref
torch.manual_seed(0)
q, k, v = (torch.randn(1, 2, 37, 32).bfloat16() for _ in range(3))
out = fastlm.flash_attention(q, k, v, causal=True)
want = flash_attention_ref(q.double(), k.double(), v.double(), causal=True)
x, w = torch.randn(5, 96).bfloat16(), torch.randn(96).bfloat16()
norm = fastlm.rms_norm(x, w)
norm_want = torch.nn.functional.rms_norm(x.double(), (96,), w.double(), 1e-5)
print((out.double() - want).abs().max().item(), (norm.double() - norm_want).abs().max().item())
"""


def test_a_plain_import_runs_bf16_kernels_correctly_on_cpu():
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": os.pathsep.join(sys.path)}
    done = subprocess.run([sys.executable, "-c", USER_PROCESS], capture_output=True, text=True, env=env, check=True)
    attention_error, norm_error = map(float, done.stdout.split())
    assert attention_error < 2e-2  # bf16 rounding of O (|O| < 2) and of P before P @ V
    assert norm_error < 4e-2  # one bf16 rounding of outputs up to ~4

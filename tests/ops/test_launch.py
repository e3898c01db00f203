"""The direct launch's bookkeeping, which is plain Python (the launches themselves: GPU tests of
each op, `assert_direct_launch_matches_dispatcher`)."""

import torch
import triton.language as tl
from triton.runtime.jit import JITFunction

from fastlm.ops.launch import EagerKernel, _specialization


def _kernel(X, Y, n, scale, BLOCK: tl.constexpr, FLAG: tl.constexpr = True):
    pass


def test_key_separates_what_triton_compiles_apart():
    # 0, 0.0 and False hash alike in Python but are i32, fp32 and i1 arguments to Triton
    assert len({_specialization((value,)) for value in (0, 0.0, False)}) == 3
    assert len({_specialization((value,)) for value in (1, 1.0, True)}) == 3
    memory = torch.empty(8)
    # Triton specializes pointers on 16-byte alignment and on dtype
    assert _specialization((memory,)) != _specialization((memory[1:],))
    assert _specialization((memory,)) != _specialization((memory.view(torch.int32),))
    # one entry per shape: integers by value
    assert _specialization((16,)) != _specialization((32,))


def test_entry_records_the_constexprs_in_signature_order():
    kernel = EagerKernel(JITFunction(_kernel))
    binary = object()
    x = torch.empty(4)
    # defaults fill constexprs that were not passed; options such as num_warps are not parameters
    assert kernel._entry(binary, (x, x, 4, 0.5), {"BLOCK": 64, "num_warps": 4}) == (binary, (64, True))
    assert kernel._entry(binary, (x, x, 4, 0.5), {"FLAG": False, "BLOCK": 8}) == (binary, (8, False))
    # a call shape the direct launch cannot replay: every call goes through Triton
    assert kernel._entry(binary, (x, x, 4), {"scale": 0.5, "BLOCK": 64}) is None  # runtime argument by keyword
    assert kernel._entry(binary, (x, x, 4, 0.5, 64), {}) is None  # constexpr passed positionally
    assert kernel._entry(binary, (x, x, 4, 0.5), {}) is None  # constexpr without a default missing

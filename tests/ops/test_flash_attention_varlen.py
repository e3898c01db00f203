"""fastlm.flash_attention_varlen (packed documents) against the float64 reference, document by document.

Output and (dq, dk, dv) are compared on fresh random inputs. On CPU the Triton kernels run through
the interpreter on documents of a few dozen tokens; the `gpu` tests repeat the checks on long-tailed
lengths of thousands of tokens, and check that one document runs exactly as the dense kernels do.
"""

import dataclasses

import pytest
import torch

import fastlm
from fastlm.ops.flash_attention import (
    AttentionConfig,
    AttentionTiles,
    check_window,
    flash_attention_varlen_ref,
)
from fastlm.ops.flash_attention.api import _FlashAttentionKernels, _FlashAttentionTiled
from fastlm.ops.flash_attention.kernels import (
    _flash_backward_dkdv_kernel,
    _flash_backward_dq_kernel,
    _flash_forward_kernel,
)
from fastlm.ops.flash_attention.tiled import TORCH_TILE

from .launches import assert_direct_launch_matches_dispatcher, compiled_code_launches
from .reference import check_against_float64
from .test_flash_attention import ALLOWANCE, SMALL_TILES


def cumulative(lengths, device) -> torch.Tensor:
    """int32 cumulative lengths (documents + 1,) of documents of ``lengths``."""
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=device)


def make_packed(q_lengths, k_lengths, heads, kv_heads, dim, dtype, device):
    """Packed q (total_q, H, D), k and v (total_k, Hkv, D) requiring grad, and the cumulative lengths."""
    q = torch.randn(sum(q_lengths), heads, dim, device=device, dtype=dtype)
    k = torch.randn(sum(k_lengths), kv_heads, dim, device=device, dtype=dtype)
    v = torch.randn(sum(k_lengths), kv_heads, dim, device=device, dtype=dtype)
    return [t.requires_grad_(True) for t in (q, k, v)], cumulative(q_lengths, device), cumulative(k_lengths, device)


def check_varlen(run, q, k, v, cu_q, cu_k, causal, window=None):
    """``run(q, k, v)``'s output and gradients against `flash_attention_varlen_ref`, as the dense
    tests check theirs (the same allowances)."""
    max_q, max_k = int((cu_q[1:] - cu_q[:-1]).max()), int((cu_k[1:] - cu_k[:-1]).max())

    def reference(q, k, v):
        return flash_attention_varlen_ref(q, k, v, cu_q, cu_k, max_q, max_k, causal=causal, window=window).to(q.dtype)

    out = check_against_float64(run, reference, (q, k, v), *ALLOWANCE[q.dtype])
    assert out.dtype == q.dtype and out.shape == q.shape


def packed_kernels(cu_q, cu_k, causal, window, config=None, scale=None):
    """The kernels' autograd.Function on packed inputs, as ``run(q, k, v)``."""

    def run(q, k, v):
        max_k = int((cu_k[1:] - cu_k[:-1]).max())
        return _FlashAttentionKernels.apply(
            q, k, v, causal, scale or q.shape[-1] ** -0.5, config, check_window(window), cu_q, cu_k, max_k
        )

    return run


# (query lengths, key lengths, causal, window). SMALL_TILES' edges are 16 and 32 rows, so 40 runs a
# whole, a diagonal and a partial tile; 0 and 1 are the degenerate documents (a spare slot each);
# different query and key lengths align the ends (causal) and leave queries of an empty key
# document with no key (output 0), keys of an empty query document with no query (dk = dv = 0).
CASES = [
    pytest.param([5, 0, 40, 1, 17], None, True, None, id="self-causal"),
    pytest.param([5, 0, 40, 1, 17], None, False, None, id="self-full"),
    pytest.param([3, 0, 20, 1, 9], [7, 5, 0, 16, 9], False, None, id="cross-full"),
    pytest.param([3, 20, 1, 16], [7, 31, 2, 16], True, None, id="cross-causal"),
    pytest.param([5, 0, 40, 1, 17], None, True, (4, -1), id="self-causal-window4"),
    pytest.param([3, 0, 20, 1, 9], [7, 5, 0, 16, 9], False, (2, 3), id="cross-window2-3"),
    pytest.param([40, 7], None, False, (1, 0), id="self-window1-0"),
    # (not all of length 1: there dq and dk are 0 exactly, and the normwise error would be absolute)
    pytest.param([1, 1, 1, 6, 1, 1, 9, 1, 1], None, True, None, id="length-1-documents"),
]


@pytest.mark.parametrize("q_lengths,k_lengths,causal,window", CASES)
def test_kernels_match_reference(q_lengths, k_lengths, causal, window, device):
    (q, k, v), cu_q, cu_k = make_packed(q_lengths, k_lengths or q_lengths, 4, 2, 16, torch.float32, device)
    check_varlen(packed_kernels(cu_q, cu_k, causal, window, SMALL_TILES), q, k, v, cu_q, cu_k, causal, window)


@pytest.mark.parametrize("q_lengths,k_lengths,causal,window", [CASES[0], CASES[2], CASES[5]])
def test_torch_twin_matches_reference(q_lengths, k_lengths, causal, window):
    (q, k, v), cu_q, cu_k = make_packed(q_lengths, k_lengths or q_lengths, 4, 2, 16, torch.float32, "cpu")

    def twin(q, k, v):
        return _FlashAttentionTiled.apply(q, k, v, causal, 0.25, TORCH_TILE, check_window(window), cu_q, cu_k)

    check_varlen(twin, q, k, v, cu_q, cu_k, causal, window)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_with_default_tiles(dtype, device):
    """The public function, its default tiles, head dim 64 (the short-sequence table's entry)."""
    (q, k, v), cu_q, cu_k = make_packed([37, 0, 70, 1], [37, 0, 70, 1], 2, 1, 64, dtype, device)

    def run(q, k, v):
        return fastlm.flash_attention_varlen(q, k, v, cu_q, cu_k, 70, 70, causal=True, window=(30, -1))

    check_varlen(run, q, k, v, cu_q, cu_k, True, (30, -1))


def test_more_documents_than_one_lookup_chunk(device):
    """More than 128 documents (DOC_CHUNK: a program's lookup reads the cumulative lengths in chunks
    of that many), most of them shorter than a tile: every tile finds its document."""
    lengths = torch.randint(0, 3, (130,)).tolist()
    (q, k, v), cu_q, cu_k = make_packed(lengths, lengths, 1, 1, 16, torch.float32, device)
    check_varlen(packed_kernels(cu_q, cu_k, True, None), q, k, v, cu_q, cu_k, True)


@pytest.mark.parametrize("q_lengths,k_lengths,causal,window", [CASES[0], CASES[2], CASES[5]])
def test_forward_through_descriptors_gives_the_pointer_forwards_bits(q_lengths, k_lengths, causal, window, device):
    """Descriptors made per document and head (the sm90 forward at head dim 128) give the pointer
    loads' bits: documents shorter than a tile, empty ones on either side, queries without keys."""
    (q, k, v), cu_q, cu_k = make_packed(q_lengths, k_lengths or q_lengths, 4, 2, 16, torch.float32, device)
    outputs = [
        packed_kernels(cu_q, cu_k, causal, window, dataclasses.replace(SMALL_TILES, forward_descriptors=tma))(q, k, v)
        for tma in (True, False)
    ]
    assert torch.equal(*outputs)


@pytest.mark.parametrize("descriptors", [False, True], ids=["pointers", "descriptors"])
def test_documents_never_see_each_other(descriptors, device):
    """NaN in every input row of one document (as 0 * NaN it would reach any row whose program
    loads it) leaves the other documents' outputs and gradients exact: each program loads its own
    document's rows only, also where documents share a tile of the packed tensors."""
    lengths = [13, 20, 19]
    (q, k, v), cu, _ = make_packed(lengths, lengths, 2, 1, 16, torch.float32, device)
    poisoned = [t.detach().clone() for t in (q, k, v)]
    for t in poisoned:
        t[13:33] = float("nan")
    poisoned = [t.requires_grad_(True) for t in poisoned]
    grad_out = torch.randn(q.shape, device=device)
    config = dataclasses.replace(SMALL_TILES, forward_descriptors=descriptors)
    out = packed_kernels(cu, cu, True, None, config)(*poisoned)
    got = (out, *torch.autograd.grad(out, poisoned, grad_out))
    doubles = [t.detach().double().requires_grad_(True) for t in (q, k, v)]
    ref = flash_attention_varlen_ref(*doubles, cu, cu, 20, 20, causal=True)
    want = (ref, *torch.autograd.grad(ref, doubles, grad_out.double()))
    others = torch.cat([torch.arange(13), torch.arange(33, 52)])
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, want, strict=True):
        torch.testing.assert_close(a[others].double(), b[others], atol=1e-5, rtol=1e-5, msg=name)
        assert a[13:33].isnan().all(), name  # the poisoned document itself


def test_outputs_are_fully_written(device):
    """Outputs come from torch.empty; NaN-filled blocks freed first so an unwritten row shows up
    (empty documents, spare slots of the packed grid, keys no query sees)."""
    for _ in range(4):
        torch.full((70, 3, 32), float("nan"), device=device)
    (q, k, v), cu_q, cu_k = make_packed([30, 0, 1, 39], [0, 12, 1, 57], 3, 3, 32, torch.float32, device)
    out = fastlm.flash_attention_varlen(q, k, v, cu_q, cu_k, 39, 57, causal=True, window=(3, -1))
    out.backward(torch.randn_like(out))
    assert all(torch.isfinite(t).all() for t in (out, q.grad, k.grad, v.grad))
    assert torch.equal(out[:30], torch.zeros(30, 3, 32, device=device))  # a document without keys
    assert torch.equal(k.grad[:12], torch.zeros(12, 3, 32, device=device))  # keys without queries


def test_saves_l_q_k_v_o_and_the_lengths(device):
    """Saved for backward: L of shape (H, total_q) in fp32, the logsumexp of each document's scores,
    then q, k, v, O and the two cumulative lengths; nothing else."""
    (q, k, v), cu, _ = make_packed([6, 11], [6, 11], 2, 2, 16, torch.float32, device)
    out = fastlm.flash_attention_varlen(q, k, v, cu, cu, 11, 11)
    lse, *rest = out.grad_fn.saved_tensors
    assert len(rest) == 6 and all(a is b for a, b in zip(rest, (q, k, v, None, cu, cu), strict=True) if b is not None)
    assert torch.equal(rest[3], out)
    assert lse.shape == (2, 17) and lse.dtype == torch.float32
    for start, end in ((0, 6), (6, 17)):
        scores = torch.einsum("qhd,khd->hqk", q[start:end].double(), k[start:end].double()) / 4
        torch.testing.assert_close(lse[:, start:end].double(), torch.logsumexp(scores, -1), atol=1e-5, rtol=1e-5)


def test_registered_op_passes_opcheck(device):
    (q, k, v), cu_q, cu_k = make_packed([9, 0, 14], [5, 3, 14], 2, 1, 16, torch.float32, device)
    torch.library.opcheck(torch.ops.fastlm.flash_attention_forward, (q, k, v, cu_q, cu_k, 14, True, 0.3, 4, -1))


def _packed_inputs():
    (q, k, v), cu, _ = make_packed([3, 5], [3, 5], 2, 1, 16, torch.float32, "cpu")
    return q, k, v, cu, cu, 5, 5


@pytest.mark.parametrize("change,error,message", [
    (dict(q=torch.randn(1, 8, 2, 16)), ValueError, r"q must be packed as \(total_q, H, D\)"),
    (dict(v=torch.randn(8, 2, 16)), ValueError, r"k and v must be packed as \(total_k, Hkv, D\) of one shape"),
    (dict(k=torch.randn(8, 3, 16), v=torch.randn(8, 3, 16)), ValueError, "must be a multiple of key/value heads"),
    (dict(cu_seqlens_q=torch.tensor([0, 3, 8])), TypeError, "cu_seqlens_q must be int32 cumulative lengths"),
    (dict(cu_seqlens_k=[0, 3, 8]), TypeError, "cu_seqlens_k must be a torch.Tensor"),
    (dict(cu_seqlens_q=torch.tensor([[0, 3, 8]], dtype=torch.int32)), ValueError, "cu_seqlens_q must be a contiguous"),
    (dict(cu_seqlens_k=torch.zeros(0, dtype=torch.int32)), ValueError, "cu_seqlens_k must be a contiguous 1-D"),
    (dict(cu_seqlens_q=torch.tensor([0, 9, 3, 9, 8, 9], dtype=torch.int32)[::2]), ValueError, "contiguous"),
    (dict(cu_seqlens_k=torch.tensor([0, 3, 8], dtype=torch.int32, device="meta")), ValueError, "on q's device"),
    (dict(cu_seqlens_k=torch.tensor([0, 8], dtype=torch.int32)), ValueError, "must list the same documents"),
    (dict(max_seqlen_q=-1), ValueError, "max_seqlen_q must be an int >= 0"),
    (dict(max_seqlen_k=5.0), TypeError, "max_seqlen_k must be an int"),
    (dict(causal=1), TypeError, "causal must be True or False"),
    (dict(window=(-2, 0)), ValueError, r"window sides must be ints >= 0, or -1 for no limit"),
    (dict(window=(1.5, 0)), TypeError, "window's left must be an int"),
    (dict(window=4), TypeError, r"window must be None or a pair \(left, right\)"),
    (dict(window=(1, 2, 3)), TypeError, r"window must be None or a pair \(left, right\)"),
])  # fmt: skip
def test_bad_arguments_raise_one_clear_error(change, error, message):
    names = ("q", "k", "v", "cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k")
    arguments = dict(zip(names, _packed_inputs(), strict=True)) | change
    with pytest.raises(error, match=message):
        fastlm.flash_attention_varlen(**arguments)


@pytest.mark.parametrize("cu_seqlens,max_seqlen,message", [
    ([1, 3, 8], 5, r"must rise from 0 to 8 without falling"),
    ([0, 5, 3, 8], 5, r"must rise from 0 to 8 without falling"),
    ([0, 3, 7], 5, r"must rise from 0 to 8 without falling"),
    ([0, 3, 8], 4, r"holds a document of 5 rows, longer than max_seqlen \(4\)"),
])  # fmt: skip
def test_reference_checks_the_lengths(cu_seqlens, max_seqlen, message):
    q, k, v, *_ = _packed_inputs()
    cu = torch.tensor(cu_seqlens, dtype=torch.int32)
    with pytest.raises(ValueError, match=message):
        flash_attention_varlen_ref(q, k, v, cu, cu, max_seqlen, max_seqlen)


def test_dense_window_arguments_are_checked():
    q = torch.randn(1, 8, 16)
    with pytest.raises(TypeError, match="window's right must be an int"):
        fastlm.flash_attention(q, q, q, window=(3, torch.tensor(2)))
    with pytest.raises(ValueError, match="window sides must be ints >= 0"):
        fastlm.flash_attention(q, q, q, window=[0, -3])


# --- GPU: long-tailed lengths, realistic sizes --------------------------------------------------

KERNELS = (_flash_forward_kernel, _flash_backward_dq_kernel, _flash_backward_dkdv_kernel)


def long_tailed_lengths(total: int, seed: int) -> list[int]:
    """Document lengths drawn from a long-tailed (log-normal) distribution summing to ``total``, with
    the degenerate lengths 0 and 1 among them."""
    generator = torch.Generator().manual_seed(seed)
    lengths, left = [0, 1], total - 1
    while left > 0:
        length = min(left, max(1, int(torch.empty(1).log_normal_(5.0, 1.5, generator=generator))))
        lengths.append(length)
        left -= length
    return lengths


# (head dim, dtype, causal, window, q and k lengths differ)
GPU_CASES = [
    (128, torch.bfloat16, True, None, False),
    (64, torch.bfloat16, True, None, False),
    (128, torch.float16, False, None, False),
    (64, torch.float32, True, None, False),
    (128, torch.bfloat16, True, (256, -1), False),
    (64, torch.bfloat16, False, (64, 64), True),
    (128, torch.bfloat16, True, None, True),
]


@pytest.mark.gpu
@pytest.mark.parametrize("dim,dtype,causal,window,cross", GPU_CASES)
def test_gpu_matches_reference(dim, dtype, causal, window, cross):
    q_lengths = long_tailed_lengths(8192, seed=dim)
    k_lengths = [length + (i % 3) * 50 for i, length in enumerate(q_lengths)] if cross else q_lengths
    (q, k, v), cu_q, cu_k = make_packed(q_lengths, k_lengths, 8, 2, dim, dtype, "cuda")

    def run(q, k, v):
        return fastlm.flash_attention_varlen(
            q, k, v, cu_q, cu_k, max(q_lengths), max(k_lengths), causal=causal, window=window
        )

    check_varlen(run, q, k, v, cu_q, cu_k, causal, window)


@pytest.mark.gpu
@pytest.mark.parametrize("length", [4096, 1031])  # above SHORT_SEQ (long-sequence tiles) and below
@pytest.mark.parametrize("head_dim", [128, 64])  # both have short-sequence tiles of their own
def test_gpu_one_document_runs_as_dense(length, head_dim):
    """One packed document gives the dense kernels' bits: same tiles, same order of every sum."""
    (q, k, v), cu, _ = make_packed([length], [length], 8, 2, head_dim, torch.bfloat16, "cuda")
    grad_out = torch.randn(q.shape, device="cuda", dtype=torch.bfloat16)
    packed = fastlm.flash_attention_varlen(q, k, v, cu, cu, length, length, causal=True, window=(700, -1))
    packed_grads = torch.autograd.grad(packed, (q, k, v), grad_out)
    dense_inputs = [t.detach().transpose(0, 1).unsqueeze(0).requires_grad_(True) for t in (q, k, v)]
    dense = fastlm.flash_attention(*dense_inputs, causal=True, window=(700, -1))
    dense_grads = torch.autograd.grad(dense, dense_inputs, grad_out.transpose(0, 1).unsqueeze(0))
    for name, a, b in zip(("out", "dq", "dk", "dv"), (packed, *packed_grads), (dense, *dense_grads), strict=True):
        assert torch.equal(a, b[0].transpose(0, 1)), name


@pytest.mark.gpu
def test_gpu_backward_bit_identical():
    lengths = long_tailed_lengths(16384, seed=1)
    (q, k, v), cu, _ = make_packed(lengths, lengths, 16, 4, 128, torch.bfloat16, "cuda")
    grad_out = torch.randn(q.shape, device="cuda", dtype=torch.bfloat16)

    def grads():
        out = fastlm.flash_attention_varlen(q, k, v, cu, cu, max(lengths), max(lengths), causal=True)
        return torch.autograd.grad(out, (q, k, v), grad_out)

    runs = [grads() for _ in range(3)]
    assert all(torch.equal(a, b) for later in runs[1:] for a, b in zip(runs[0], later, strict=True))


@pytest.mark.gpu
def test_gpu_compiled_launches_the_kernels_and_matches_eager():
    """Inductor launches the same kernels from its own code, and gives the eager path's bits."""
    lengths = long_tailed_lengths(4096, seed=2)
    (q, k, v), cu, _ = make_packed(lengths, lengths, 4, 2, 64, torch.bfloat16, "cuda")

    def attend(q, k, v):
        return fastlm.flash_attention_varlen(
            q * 2, k, v, cu, cu, max(lengths), max(lengths), causal=True, window=(128, -1)
        )

    compiled_code_launches(
        attend,
        (q, k, v),
        kernels=[kernel.__name__ for kernel in KERNELS],
        ops=("fastlm.flash_attention_forward", "fastlm.flash_attention_backward"),
    )
    grad_out = torch.randn(q.shape, device="cuda", dtype=torch.bfloat16)
    torch._dynamo.reset()
    runs = []
    for fn in (attend, torch.compile(attend, fullgraph=True)):
        out = fn(q, k, v)
        runs.append((out, *torch.autograd.grad(out, (q, k, v), grad_out)))
    for name, eager, compiled in zip(("out", "dq", "dk", "dv"), *runs, strict=True):
        assert torch.equal(eager, compiled), name


@pytest.mark.gpu
def test_gpu_direct_launch_matches_triton_dispatch(monkeypatch):
    """The direct launches give Triton's dispatcher's bits on packed inputs with a row stride that
    is not the dense one ((total, H, D + 1) memory)."""
    lengths = long_tailed_lengths(3000, seed=3)
    total = sum(lengths)
    q, k, v = (
        torch.randn(total, heads, 65, device="cuda", dtype=torch.bfloat16)[..., :64].requires_grad_(True)
        for heads in (4, 2, 2)
    )
    cu = cumulative(lengths, "cuda")
    grad_out = torch.randn(q.shape, device="cuda", dtype=torch.bfloat16)

    def forward_and_grads():
        out = fastlm.flash_attention_varlen(q, k, v, cu, cu, max(lengths), max(lengths), causal=True)
        return out, *torch.autograd.grad(out, (q, k, v), grad_out)

    assert_direct_launch_matches_dispatcher(forward_and_grads, KERNELS, monkeypatch)
    check_varlen(
        lambda *a: fastlm.flash_attention_varlen(*a, cu, cu, max(lengths), max(lengths), causal=True),
        q,
        k,
        v,
        cu,
        cu,
        True,
    )


@pytest.mark.gpu
def test_gpu_explicit_small_tiles():
    """Tiles far smaller than the defaults over many documents: slots and boundaries on every edge."""
    lengths = long_tailed_lengths(2048, seed=4)
    (q, k, v), cu, _ = make_packed(lengths, lengths, 4, 2, 64, torch.bfloat16, "cuda")
    config = AttentionConfig(AttentionTiles(16, 32, 4, 1), AttentionTiles(32, 16, 4, 1), AttentionTiles(16, 16, 2, 1))
    check_varlen(packed_kernels(cu, cu, True, (100, -1), config), q, k, v, cu, cu, True, (100, -1))

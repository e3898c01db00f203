"""fastlm.flash_attention_varlen (packed documents) against the float64 reference, document by document.

Output and (dq, dk, dv) are compared on fresh random inputs. On CPU the Triton kernels run through
the interpreter on documents of a few dozen tokens; the `gpu` tests repeat the checks on long-tailed
lengths of thousands of tokens, and check that one document runs exactly as the dense kernels do.
"""

import dataclasses
import json
import os
import re
import subprocess
import sys

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import fastlm
from fastlm.ops.flash_attention import (
    AttentionConfig,
    AttentionTiles,
    check_window,
    flash_attention_varlen_ref,
    tiled,
)
from fastlm.ops.flash_attention.api import _FlashAttentionKernels, _FlashAttentionTiled
from fastlm.ops.flash_attention.kernels import (
    _flash_backward_dkdv_kernel,
    _flash_backward_dq_kernel,
    _flash_forward_kernel,
)

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


def check_varlen(run, q, k, v, cu_q, cu_k, causal, window=None, softcap=None):
    """``run(q, k, v)``'s output and gradients against `flash_attention_varlen_ref`, as the dense
    tests check theirs (the same allowances)."""
    max_q, max_k = int((cu_q[1:] - cu_q[:-1]).max()), int((cu_k[1:] - cu_k[:-1]).max())
    options = dict(causal=causal, window=window, softcap=softcap)

    def reference(q, k, v):
        return flash_attention_varlen_ref(q, k, v, cu_q, cu_k, max_q, max_k, **options).to(q.dtype)

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


@pytest.mark.parametrize("path", ["device", "tiled-every-tile"])
def test_softcap_matches_reference(path, device, monkeypatch):
    """Softcapped scores (0.5: most bend) in packed documents, on the device's path and on the
    tiled twin's plan of every tile (what torch.compile traces on a CPU)."""
    if path == "tiled-every-tile":
        device = torch.device("cpu")
        monkeypatch.delenv("TRITON_INTERPRET", raising=False)
        monkeypatch.setattr(tiled, "is_traced", lambda tensor: True)
    (q, k, v), cu_q, cu_k = make_packed([5, 0, 40, 1, 17], [5, 0, 40, 1, 17], 4, 2, 16, torch.float32, device)

    def run(q, k, v):
        return fastlm.flash_attention_varlen(q, k, v, cu_q, cu_k, 40, 40, causal=True, window=(9, 0), softcap=0.5)

    check_varlen(run, q, k, v, cu_q, cu_k, True, (9, 0), softcap=0.5)


@pytest.mark.parametrize("plan", ["host", "every-tile"])
@pytest.mark.parametrize("q_lengths,k_lengths,causal,window", CASES)
def test_torch_twin_matches_reference(q_lengths, k_lengths, causal, window, plan, monkeypatch):
    """The tiled twin (the CPU path) with the key tiles it finds from the cumulative lengths on the
    host, and with the every-tile plan it takes while torch.compile traces."""
    if plan == "every-tile":
        monkeypatch.setattr(tiled, "is_traced", lambda tensor: True)
    (q, k, v), cu_q, cu_k = make_packed(q_lengths, k_lengths or q_lengths, 4, 2, 16, torch.float32, "cpu")

    def twin(q, k, v):  # tiles of 16 rows: several per document here, as in the kernels' SMALL_TILES
        return _FlashAttentionTiled.apply(q, k, v, causal, 0.25, 16, check_window(window), cu_q, cu_k)

    check_varlen(twin, q, k, v, cu_q, cu_k, causal, window)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("q_lengths,k_lengths,causal,window", CASES)
def test_eager_cpu_path_matches_reference(q_lengths, k_lengths, causal, window, dtype, monkeypatch):
    """The public function on CPU tensors without the interpreter: torch's SDPA on the documents
    gathered by length (sdpa.py), to the kernels' allowances."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    (q, k, v), cu_q, cu_k = make_packed(q_lengths, k_lengths or q_lengths, 4, 2, 16, dtype, "cpu")
    max_q, max_k = max(q_lengths), max(k_lengths or q_lengths)

    def run(q, k, v):
        return fastlm.flash_attention_varlen(q, k, v, cu_q, cu_k, max_q, max_k, causal=causal, window=window)

    check_varlen(run, q, k, v, cu_q, cu_k, causal, window)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_with_default_tiles(dtype, device):
    """The public function, its default tiles, head dim 64 (the short-sequence table's entry)."""
    (q, k, v), cu_q, cu_k = make_packed([37, 0, 70, 1], [37, 0, 70, 1], 2, 1, 64, dtype, device)

    def run(q, k, v):
        return fastlm.flash_attention_varlen(q, k, v, cu_q, cu_k, 70, 70, causal=True, window=(30, -1))

    check_varlen(run, q, k, v, cu_q, cu_k, True, (30, -1))


@pytest.mark.slow
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
    ([1, 3, 8], 5, r"cu_seqlens_q must rise from 0 to 8 \(q's rows\) without falling, but it starts at 1"),
    ([0, 5, 3, 8], 5, r"cu_seqlens_q must rise .* but it falls from 5 to 3 at entry 2"),
    ([0, 3, 7], 5, r"cu_seqlens_q must rise .* but it ends at 7, leaving rows 7 to 7 in no document"),
    ([0, 3, 8], 4, r"max_seqlen_q \(4\) must be at least the longest document's length, got a document of 5 rows"),
])  # fmt: skip
def test_reference_checks_the_lengths(cu_seqlens, max_seqlen, message):
    q, k, v, *_ = _packed_inputs()
    cu = torch.tensor(cu_seqlens, dtype=torch.int32)
    with pytest.raises(ValueError, match=message):
        flash_attention_varlen_ref(q, k, v, cu, cu, max_seqlen, max_seqlen)


# Cumulative lengths that break the rules, over 20 rows of q, k and v (the cases that were found:
# past the end, which read and wrote out of bounds under the interpreter; a first length of 1,
# where the interpreter left row 0 unwritten and the PyTorch path attended; a fall; an end below
# the rows, an IndexError on the PyTorch path and unwritten rows on the other), a max_seqlen below
# the longest document, and the same on the keys' side of cross-attention. Each: (cu_seqlens_q,
# cu_seqlens_k (None: the same), max_seqlen_q, max_seqlen_k, the message).
BAD_LENGTHS = {
    "ends-past-the-rows": ([0, 10, 30], None, 20, 20, r"cu_seqlens_q must rise from 0 to 20 \(q's rows\) without "
                           r"falling, but it ends at 30, past q's last row"),
    "starts-at-1": ([1, 10, 20], None, 20, 20, r"cu_seqlens_q must rise .* but it starts at 1"),
    "falls": ([0, 15, 10, 20], None, 20, 20, r"cu_seqlens_q must rise .* but it falls from 15 to 10 at entry 2"),
    "ends-below-the-rows": ([0, 10, 15], None, 20, 20,
                            r"cu_seqlens_q must rise .* but it ends at 15, leaving rows 15 to 19 in no document"),
    "max-seqlen-below-the-longest": ([0, 10, 20], None, 9, 9,
                                     r"max_seqlen_q \(9\) must be at least the longest document's length, got a "
                                     r"document of 10 rows in cu_seqlens_q"),
    "keys-end-past-the-rows": ([0, 10, 20], [0, 5, 25], 10, 20, r"cu_seqlens_k must rise from 0 to 20 \(k's rows\) "
                               r"without falling, but it ends at 25"),
    "keys-max-seqlen-below-the-longest": ([0, 10, 20], [0, 4, 20], 10, 10,
                                          r"max_seqlen_k \(10\) must be at least the longest document's length, got "
                                          r"a document of 16 rows in cu_seqlens_k"),
}  # fmt: skip

# Valid lengths at the edges of the rules: empty documents inside and at the end (as the model pads
# its count of documents), a max_seqlen above the longest document, no documents over no rows.
GOOD_LENGTHS = {
    "empty-documents": ([0, 0, 7, 7, 20, 20, 20], None, 13, 13),
    "max-seqlen-above-the-longest": ([0, 10, 20], [0, 3, 20], 64, 64),
}

# Runs in a child process (a bad length could crash the interpreter: a read or write out of bounds
# kills the process, not only the call) with TRITON_INTERPRET set or not; prints one JSON line per
# case as it goes (an error of any type is a result), so a crash still shows which case it was.
_CHILD = """
import json, sys, torch, fastlm
cases = json.loads(sys.argv[1])
for name, (cu_q, cu_k, max_q, max_k) in cases.items():
    torch.manual_seed(0)
    rows = 20 if cu_q[-1] else 0  # 20, or none for no documents
    q, k, v = (torch.randn(rows, 2, 16, requires_grad=True) for _ in range(3))
    tensors = [torch.tensor(c, dtype=torch.int32) for c in (cu_q, cu_k or cu_q)]
    try:
        out = fastlm.flash_attention_varlen(q, k, v, *tensors, max_q, max_k, causal=True)
        out.sum().backward()
        result = {"output": out.tolist(), "grads": [t.grad.tolist() for t in (q, k, v)]}
    except Exception as error:  # any error, so that the next cases still run
        result = {"error": f"{type(error).__name__}: {error}"}
    print(json.dumps({name: result}), flush=True)
"""


def _start_child(cases: dict, interpreted: bool) -> subprocess.Popen:
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    if interpreted:
        env["TRITON_INTERPRET"] = "1"
    command = [sys.executable, "-c", _CHILD, json.dumps(cases)]
    return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


def _results(child: subprocess.Popen, cases: dict) -> dict:
    stdout, stderr = child.communicate(timeout=300)
    results = {}
    for line in stdout.splitlines():
        results.update(json.loads(line))
    # a case the child never reported is the one it died in, or came after it
    died = {"error": f"the child process died (rc {child.returncode}) here or before: {stderr[-500:]}"}
    return {name: results.get(name, died) for name in cases}


@pytest.fixture(scope="module")
def both_cpu_paths() -> dict:
    """{path: {case: result}} for BAD_LENGTHS and GOOD_LENGTHS on the PyTorch path and the Triton
    interpreter, each in a child process, the two at once (two in all, not one per case: a process
    start costs seconds; the two tests below take them all, so that a worker starts them once)."""
    good = GOOD_LENGTHS | {"no-documents": ([0], None, 0, 0)}  # first: a crash in a bad case takes the rest
    cases = good | {name: case[:4] for name, case in BAD_LENGTHS.items()}
    children = {path: _start_child(cases, path == "interpreter") for path in ("pytorch", "interpreter")}
    return {path: _results(child, cases) for path, child in children.items()}


def test_bad_lengths_raise_one_clear_error_on_both_cpu_paths(both_cpu_paths):
    """Checked before any kernel or tile runs, whichever path takes CPU tensors: one ValueError that
    names the argument and the fault, the same on both."""
    for case, (*_, message) in BAD_LENGTHS.items():
        results = [both_cpu_paths[path][case] for path in ("pytorch", "interpreter")]
        for result in results:
            assert "error" in result, f"{case}: accepted: {str(result)[:200]}"
            assert re.match("ValueError: " + message, result["error"]), f"{case}: {result['error']}"
        assert results[0] == results[1], case


def test_lengths_at_the_rules_edges_give_one_result_on_both_cpu_paths(both_cpu_paths):
    """Accepted, with the same output and gradients from the PyTorch path and the interpreter."""
    for case in [*GOOD_LENGTHS, "no-documents"]:
        results = [both_cpu_paths[path][case] for path in ("pytorch", "interpreter")]
        assert all("error" not in result for result in results), (case, results)
        for name in ("output", "grads"):
            expected = torch.tensor(results[1][name])
            torch.testing.assert_close(torch.tensor(results[0][name]), expected, atol=1e-5, rtol=1e-5, msg=case)


def test_check_must_be_a_flag():
    with pytest.raises(TypeError, match="check must be True or False"):
        fastlm.flash_attention_varlen(*_packed_inputs(), check=1)


class _CountOps(TorchDispatchMode):
    """Counts the aten operations run under it, forward and backward: the Python-level work of the
    PyTorch path, whatever the machine's speed."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += 1
        return func(*args, **(kwargs or {}))


def _reference_path_ops(rows: int, pattern: list[int], causal: bool, window) -> int:
    """aten operations of a forward and backward of `flash_attention_varlen` on ``rows`` rows of 128
    tokens, each cut into documents of ``pattern``'s lengths."""
    lengths = pattern * rows
    (q, k, v), cu, _ = make_packed(lengths, lengths, 4, 2, 16, torch.float32, "cpu")
    with _CountOps() as counter:
        out = fastlm.flash_attention_varlen(q, k, v, cu, cu, 128, 128, causal=causal, window=window)
        out.backward(torch.ones_like(out))
    return counter.count


@pytest.mark.parametrize("pattern", [
    pytest.param([5, 1, 40, 17, 33, 32], id="mixed"),  # tiles holding several documents, and parts of one
    pytest.param([128], id="one-per-row"),  # the longest documents the model's rows hold
    pytest.param([1] * 128, id="length-1"),  # a document per token
])  # fmt: skip
@pytest.mark.parametrize(
    "causal,window", [(True, None), (False, None), (True, (20, -1))], ids=["causal", "full", "window"]
)
def test_reference_path_work_grows_with_documents_not_with_rows(pattern, causal, window, monkeypatch):
    """The PyTorch path of packed documents (CPU without TRITON_INTERPRET) runs one batched call per
    distinct document length, not one per document or per pair of tiles of the whole batch: 16 rows
    of the same documents take the operations 2 rows take, 128 documents of length 1 per row those of
    one (a loop over every pair of tiles of the batch made a training step of 16 x 128 tokens take
    minutes instead of a fraction of a second). Counted, not timed: a busy machine cannot make it
    flaky."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    few, many = (_reference_path_ops(rows, pattern, causal, window) for rows in (2, 16))
    assert many <= few * 1.1 + 20, (few, many)
    assert many < 400, many  # at most about 60 operations per distinct length, 6 of them here


def test_compiled_varlen_recompiles_once_for_any_number_of_documents(monkeypatch):
    """torch.compile over batches of 2 to 64 documents (cu_seqlens of varying length, as Hugging
    Face's padding-free collator makes them; the model pads its count to powers of two): the first
    change of length compiles once more, with that length dynamic (automatic dynamic shapes), and
    every later count reuses that graph. The graph holds the op, not a per-document loop, so on the
    GPU too the count never re-specializes the trace (the kernels take it as a runtime argument)."""
    from torch._dynamo.testing import CompileCounterWithBackend

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # the op runs the PyTorch path: quicker here

    def attend(q, k, v, cu):
        return fastlm.flash_attention_varlen(q, k, v, cu, cu, 64, 64, causal=True)

    torch._dynamo.reset()
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(attend, backend=counter, fullgraph=True)
    q, k, v = (torch.randn(128, 2, 16, requires_grad=True) for _ in range(3))
    for documents in (2, 3, 5, 8, 13, 64, 4):
        lengths = [128 // documents] * (documents - 1)
        cu = cumulative([*lengths, 128 - sum(lengths)], "cpu")
        out = compiled(q, k, v, cu)
        grads = torch.autograd.grad(out.sum(), (q, k, v))
        want = attend(q, k, v, cu)
        torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)
        for got, expected in zip(grads, torch.autograd.grad(want.sum(), (q, k, v)), strict=True):
            torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    assert counter.frame_count == 2


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


@pytest.mark.gpu
def test_gpu_lengths_are_trusted_unless_checked():
    """CUDA cumulative lengths: read with ``check=True`` only (one sync, then the CPU's errors);
    without it a forward and backward never wait for the GPU."""
    q, k, v = (torch.randn(20, 2, 16, device="cuda", requires_grad=True) for _ in range(3))
    for cu_seqlens, max_seqlen, message in (
        ([0, 10, 15], 20, "but it ends at 15, leaving rows 15 to 19 in no document"),
        ([0, 10, 30], 20, "but it ends at 30, past q's last row"),
        ([0, 10, 20], 9, r"max_seqlen_q \(9\) must be at least"),
    ):
        cu = torch.tensor(cu_seqlens, dtype=torch.int32, device="cuda")
        with pytest.raises(ValueError, match=message):
            fastlm.flash_attention_varlen(q, k, v, cu, cu, max_seqlen, max_seqlen, causal=True, check=True)
    cu = cumulative([10, 10], "cuda")
    fastlm.flash_attention_varlen(q, k, v, cu, cu, 10, 10, check=True).sum().backward()  # warm: compiled
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        fastlm.flash_attention_varlen(q, k, v, cu, cu, 10, 10).sum().backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")


@pytest.mark.gpu
def test_gpu_kernels_specialize_on_the_document_count_twice_at_most():
    """Eager launches over batches of 2 to 100 documents (the same rows, tiles and strides): Triton
    specializes an int argument on being 1 and on dividing by 16, so the document count makes at
    most two binaries per kernel here (counts that divide by 16, the others), not one per count:
    one more than after the first batch (the process's other tests may have compiled others)."""
    counts = (2, 3, 5, 16, 17, 32, 64, 100, 7)
    (q, k, v), _, _ = make_packed([1024], [1024], 4, 2, 64, torch.bfloat16, "cuda")
    binaries = {}
    for documents in counts:
        lengths = [1024 // documents] * (documents - 1)
        cu = cumulative([*lengths, 1024 - sum(lengths)], "cuda")
        out = fastlm.flash_attention_varlen(q, k, v, cu, cu, 1024, 1024, causal=True)
        out.sum().backward()
        binaries[documents] = [len(kernel.device_caches[torch.cuda.current_device()][0]) for kernel in KERNELS]
    grown = [last - first for first, last in zip(binaries[counts[0]], binaries[counts[-1]], strict=True)]
    assert all(extra <= 1 for extra in grown), binaries


def _compiled_over_document_counts(counts, capacity: int | None) -> int:
    """Frames Inductor compiles for packed batches of 1024 rows in ``counts`` documents, each batch's
    cumulative lengths padded with empty documents to ``capacity`` (None: as they are); checks each
    batch against eager."""
    from torch._dynamo.testing import CompileCounterWithBackend

    def attend(q, k, v, cu):
        return fastlm.flash_attention_varlen(q, k, v, cu, cu, 256, 256, causal=True)

    torch._dynamo.reset()
    counter = CompileCounterWithBackend("inductor")
    compiled = torch.compile(attend, backend=counter, fullgraph=True)
    (q, k, v), _, _ = make_packed([1024], [1024], 4, 2, 64, torch.bfloat16, "cuda")
    for documents in counts:
        lengths = [1024 // documents] * (documents - 1)
        lengths = [*lengths, 1024 - sum(lengths)]
        cu = cumulative(lengths + [0] * ((capacity or documents) - documents), "cuda")
        out = compiled(q, k, v, cu)
        out.sum().backward()
        torch.testing.assert_close(out, attend(q, k, v, cu), atol=2e-2, rtol=2e-2)
    return counter.frame_count


@pytest.mark.gpu
def test_gpu_compiled_compiles_once_for_any_number_of_documents_in_a_fixed_capacity():
    """Inductor over batches of 4 to 64 documents, their cumulative lengths padded with empty
    documents to one length (as `fastlm.data.documents.cu_seqlens` pads them): one compile."""
    assert _compiled_over_document_counts((4, 5, 8, 13, 64, 6), capacity=64) == 1


@pytest.mark.gpu
@pytest.mark.xfail(
    torch.__version__.startswith("2.11."),
    reason="torch 2.11's Inductor fails to copy a kernel argument of dynamic length (cu_seqlens, which "
    "it counts as written) in decompose_triton_kernel_wrapper_functional",
    strict=True,
)
def test_gpu_compiled_recompiles_once_for_a_changing_number_of_documents():
    """Unpadded cumulative lengths: one compile more at the first change of their length (that dim
    made dynamic), none after it."""
    assert _compiled_over_document_counts((4, 5, 8, 13, 64, 6), capacity=None) == 2

"""Every public op and module constructor, fed each kind of bad argument: one clear error naming it.

Each row: the call, the error type, and a pattern the message must match, which contains the name
of the argument at fault. The calls run on small CPU tensors: every check here happens on the host,
before any kernel (targets' range is read on CPU only; on CUDA such a row's loss is NaN instead,
tested in test_cross_entropy.py).
"""

import pytest
import torch

import fastlm
from fastlm.layers import CrossEntropyLoss, LayerNorm, LinearCrossEntropyLoss, RMSNorm
from fastlm.ops.cross_entropy import cross_entropy_backward, cross_entropy_forward
from fastlm.ops.flash_attention import FlashAttentionTorch, FlashAttentionTriton
from fastlm.ops.rotary import rotary_embedding
from fastlm.ops.weighted_sum import weighted_sum


def _logits(*shape, dtype=torch.float32):
    return torch.randn(*shape or (4, 10), dtype=dtype)


def _targets(*values):
    return torch.tensor(values or (1, 2, 3, 0))


def _qkv(q_shape=(1, 2, 8, 16), kv_shape=None, dtype=torch.float32):
    kv_shape = kv_shape or q_shape
    return torch.randn(q_shape, dtype=dtype), torch.randn(kv_shape, dtype=dtype), torch.randn(kv_shape, dtype=dtype)


def _cu_seqlens():
    """Cumulative lengths of two documents of 4 rows, for q and for k."""
    return torch.tensor([[0, 4, 8]] * 2, dtype=torch.int32)


def _non_leaf_logits():
    return torch.randn(4, 10, requires_grad=True) * 1


def _expanded_logits():
    return (torch.randn(1, 10, requires_grad=True) * 1).expand(4, 10)  # every row the same memory


def _linear_xent(**change):
    """fastlm.linear_cross_entropy on hidden (6, 8), weight (10, 8), bias (10,), with ``change``."""
    arguments = dict(hidden=torch.randn(6, 8), weight=torch.randn(10, 8), targets=_targets(1, 2, 3, 0, 4, 5),
                     bias=torch.randn(10)) | change  # fmt: skip
    tensors = [arguments.pop(name) for name in ("hidden", "weight", "targets", "bias")]
    return fastlm.linear_cross_entropy(*tensors, **arguments)


X, W = torch.randn(3, 8), torch.randn(8)
U, KERNEL = torch.randn(2, 5, 8), torch.randn(8, 4)
Q, COS = torch.randn(1, 2, 3, 4), torch.randn(3, 2)  # rotary: (B, H, N, D) and a (N, D/2) table

# (id, call, error, message pattern: names the argument)
CASES = [
    # cross_entropy: tensors, shapes, dtypes, devices
    ("xent logits list", lambda: fastlm.cross_entropy([[0.0]], _targets(0)), TypeError,
     "logits must be a torch.Tensor"),
    ("xent targets None", lambda: fastlm.cross_entropy(_logits(), None), TypeError, "targets must be a torch.Tensor"),
    ("xent logits 3-D", lambda: fastlm.cross_entropy(_logits(2, 4, 10), _targets(0, 1)), ValueError,
     "logits must be 2-D"),
    ("xent logits 1-D", lambda: fastlm.cross_entropy(_logits(10), _targets()), ValueError, "logits must be 2-D"),
    ("xent logits fp64", lambda: fastlm.cross_entropy(_logits(dtype=torch.float64), _targets()), TypeError,
     "logits must have dtype"),
    ("xent logits int", lambda: fastlm.cross_entropy(torch.ones(4, 10, dtype=torch.int32), _targets()), TypeError,
     "logits must have dtype"),
    ("xent targets float", lambda: fastlm.cross_entropy(_logits(), torch.zeros(4)), TypeError,
     "targets must hold integer class indices"),
    ("xent targets bool", lambda: fastlm.cross_entropy(_logits(), torch.zeros(4, dtype=torch.bool)), TypeError,
     "targets must hold integer class indices"),
    ("xent targets int16", lambda: fastlm.cross_entropy(_logits(), torch.zeros(4, dtype=torch.int16)), TypeError,
     "targets must have dtype"),
    ("xent targets short", lambda: fastlm.cross_entropy(_logits(), _targets(1, 2, 3)), ValueError,
     r"targets must have shape \(4,\)"),
    ("xent targets 2-D", lambda: fastlm.cross_entropy(_logits(), torch.zeros(4, 1, dtype=torch.long)), ValueError,
     r"targets must have shape \(4,\)"),
    ("xent V=0", lambda: fastlm.cross_entropy(_logits(4, 0), _targets()), ValueError, "logits must have at least one"),
    ("xent target = V", lambda: fastlm.cross_entropy(_logits(), _targets(0, 1, 10, 2)), ValueError,
     r"targets must lie in \[0, 10\).*found 10"),
    ("xent target -1", lambda: fastlm.cross_entropy(_logits(), _targets(0, -1, 3, 2)), ValueError,
     r"targets must lie in .*found -1"),
    ("xent targets on meta", lambda: fastlm.cross_entropy(_logits(), _targets().to("meta")), ValueError,
     "one device, got logits on cpu, targets on meta"),
    # cross_entropy: options
    ("xent ignore_index 2.7", lambda: fastlm.cross_entropy(_logits(), _targets(), ignore_index=2.7), TypeError,
     "ignore_index must be an int, got float 2.7"),
    ("xent ignore_index str", lambda: fastlm.cross_entropy(_logits(), _targets(), ignore_index="-100"), TypeError,
     "ignore_index must be an int"),
    ("xent ignore_index True", lambda: fastlm.cross_entropy(_logits(), _targets(), ignore_index=True), TypeError,
     "ignore_index must be an int"),
    ("xent ignore_index tensor", lambda: fastlm.cross_entropy(_logits(), _targets(), ignore_index=torch.tensor(3)),
     TypeError, "ignore_index must be an int"),
    ("xent ignore_index None", lambda: fastlm.cross_entropy(_logits(), _targets(), ignore_index=None), TypeError,
     "ignore_index must be an int"),
    ("xent reduction avg", lambda: fastlm.cross_entropy(_logits(), _targets(), reduction="avg"), ValueError,
     "reduction must be one of"),
    ("xent reduction None", lambda: fastlm.cross_entropy(_logits(), _targets(), reduction=None), ValueError,
     "reduction must be one of"),
    ("xent label_smoothing 1.5", lambda: fastlm.cross_entropy(_logits(), _targets(), label_smoothing=1.5), ValueError,
     r"label_smoothing must be a finite number in \[0.0, 1.0\], got 1.5"),
    ("xent label_smoothing -0.1", lambda: fastlm.cross_entropy(_logits(), _targets(), label_smoothing=-0.1),
     ValueError, "label_smoothing must be a finite number"),
    ("xent label_smoothing nan", lambda: fastlm.cross_entropy(_logits(), _targets(), label_smoothing=float("nan")),
     ValueError, "label_smoothing must be a finite number"),
    ("xent label_smoothing str", lambda: fastlm.cross_entropy(_logits(), _targets(), label_smoothing="0.1"),
     TypeError, "label_smoothing must be a number"),
    ("xent label_smoothing tensor",
     lambda: fastlm.cross_entropy(_logits(), _targets(), label_smoothing=torch.tensor(0.1)), TypeError,
     "label_smoothing must be a number"),
    ("xent z_loss -1", lambda: fastlm.cross_entropy(_logits(), _targets(), z_loss=-1.0), ValueError,
     "z_loss must be a finite number >= 0.0"),
    ("xent z_loss inf", lambda: fastlm.cross_entropy(_logits(), _targets(), z_loss=float("inf")), ValueError,
     "z_loss must be a finite number"),
    ("xent z_loss nan", lambda: fastlm.cross_entropy(_logits(), _targets(), z_loss=float("nan")), ValueError,
     "z_loss must be a finite number"),
    ("xent fused str", lambda: fastlm.cross_entropy(_logits(), _targets(), fused="no"), TypeError,
     "fused must be True or False"),
    ("xent inplace None", lambda: fastlm.cross_entropy(_logits(), _targets(), inplace=None), TypeError,
     "inplace must be True or False"),
    ("xent inplace unfused", lambda: fastlm.cross_entropy(_logits(), _targets(), fused=False, inplace=True),
     ValueError, "inplace=True needs fused=True"),
    ("xent inplace leaf", lambda: fastlm.cross_entropy(_logits().requires_grad_(), _targets(), inplace=True),
     ValueError, "logits must not be a leaf"),
    ("xent inplace expanded", lambda: fastlm.cross_entropy(_expanded_logits(), _targets(), inplace=True), ValueError,
     r"inplace=True writes the gradient over logits, whose elements share memory \(strides \(0, 1\)"),
    # the two user-loop functions
    ("xent forward logits 3-D", lambda: cross_entropy_forward(_logits(2, 4, 10), _targets(0, 1)), ValueError,
     "logits must be 2-D"),
    ("xent backward grad_output shape", lambda: cross_entropy_backward(_logits(), _targets(), torch.ones(3)),
     ValueError, r"grad_output must have shape \(4,\)"),
    ("xent backward grad_output int",
     lambda: cross_entropy_backward(_logits(), _targets(), torch.ones(4, dtype=torch.long)), TypeError,
     "grad_output must be a floating-point tensor"),
    ("xent backward grad_output None", lambda: cross_entropy_backward(_logits(), _targets(), None), TypeError,
     "grad_output must be a torch.Tensor"),
    ("xent backward grad_output meta", lambda: cross_entropy_backward(_logits(), _targets(), torch.ones(4).to("meta")),
     ValueError, "grad_output on meta"),
    # flash_attention: tensors, shapes, heads, dtypes, devices, options
    ("attention q list", lambda: fastlm.flash_attention([1.0], *_qkv()[1:]), TypeError, "q must be a torch.Tensor"),
    ("attention k None", lambda: fastlm.flash_attention(_qkv()[0], None, _qkv()[2]), TypeError,
     "k must be a torch.Tensor"),
    ("attention v ndarray", lambda: fastlm.flash_attention(*_qkv()[:2], _qkv()[2].numpy()), TypeError,
     "v must be a torch.Tensor"),
    ("attention 2-D", lambda: fastlm.flash_attention(*_qkv((8, 16))), ValueError, r"q must be \(B, N, D\) or"),
    ("attention 5-D", lambda: fastlm.flash_attention(*_qkv((1, 1, 1, 8, 16))), ValueError, r"q must be \(B, N, D\)"),
    ("attention ranks differ", lambda: fastlm.flash_attention(*_qkv((2, 4, 8, 16), (2, 8, 16))), ValueError,
     "q, k and v must have the same number of dims"),
    ("attention k, v differ",
     lambda: fastlm.flash_attention(torch.randn(2, 8, 16), torch.randn(2, 8, 16), torch.randn(2, 9, 16)),
     ValueError, "k and v must have the same shape"),
    ("attention batch", lambda: fastlm.flash_attention(*_qkv((2, 8, 16), (3, 8, 16))), ValueError,
     "q and k must have the same batch size"),
    ("attention head dims", lambda: fastlm.flash_attention(*_qkv((2, 8, 16), (2, 8, 32))), ValueError,
     "q and k must have the same head dim"),
    ("attention D=0", lambda: fastlm.flash_attention(*_qkv((2, 8, 0))), ValueError, "head dim must lie in"),
    ("attention D=512", lambda: fastlm.flash_attention(*_qkv((2, 8, 512))), ValueError, "head dim must lie in"),
    ("attention H=6, Hkv=4", lambda: fastlm.flash_attention(*_qkv((2, 6, 8, 16), (2, 4, 8, 16))), ValueError,
     r"query heads \(6\) must be a multiple of key/value heads \(4\)"),
    ("attention H=2, Hkv=0", lambda: fastlm.flash_attention(*_qkv((2, 2, 8, 16), (2, 0, 8, 16))), ValueError,
     r"query heads \(2\) must be a multiple of key/value heads \(0\)"),
    ("attention fp64", lambda: fastlm.flash_attention(*_qkv(dtype=torch.float64)), TypeError, "q must have dtype"),
    ("attention k int", lambda: fastlm.flash_attention(_qkv()[0], torch.ones(1, 2, 8, 16, dtype=torch.int64),
                                                       _qkv()[2]), TypeError, "k must have dtype"),
    ("attention mixed dtypes", lambda: fastlm.flash_attention(_qkv()[0], *_qkv(dtype=torch.float16)[1:]), TypeError,
     "q, k and v must share a dtype"),
    ("attention v on meta", lambda: fastlm.flash_attention(*_qkv()[:2], _qkv()[2].to("meta")), ValueError,
     "v on meta"),
    ("attention scale 0", lambda: fastlm.flash_attention(*_qkv(), scale=0.0), ValueError,
     "scale must be a finite number > 0"),
    ("attention scale -1", lambda: fastlm.flash_attention(*_qkv(), scale=-1), ValueError, "scale must be a finite"),
    ("attention scale inf", lambda: fastlm.flash_attention(*_qkv(), scale=float("inf")), ValueError,
     "scale must be a finite"),
    ("attention scale nan", lambda: fastlm.flash_attention(*_qkv(), scale=float("nan")), ValueError,
     "scale must be a finite"),
    ("attention scale tensor", lambda: fastlm.flash_attention(*_qkv(), scale=torch.tensor(0.5)), TypeError,
     "scale must be a number"),
    ("attention causal str", lambda: fastlm.flash_attention(*_qkv(), causal="yes"), TypeError,
     "causal must be True or False"),
    ("attention causal None", lambda: fastlm.flash_attention(*_qkv(), causal=None), TypeError,
     "causal must be True or False"),
    ("attention twin is_causal 1", lambda: FlashAttentionTorch.apply(*_qkv(), 1), TypeError,
     "is_causal must be True or False"),
    ("attention twin D=0", lambda: FlashAttentionTorch.apply(*_qkv((2, 8, 0))), ValueError, "head dim must lie in"),
    ("attention kernels head dims", lambda: FlashAttentionTriton.apply(*_qkv((2, 8, 16), (2, 8, 32))), ValueError,
     "q and k must have the same head dim"),
    ("attention window -2", lambda: fastlm.flash_attention(*_qkv(), window=(-2, 0)), ValueError,
     "window sides must be ints >= 0, or -1"),
    ("attention varlen 4-D q", lambda: fastlm.flash_attention_varlen(*_qkv(), *_cu_seqlens(), 8, 8), ValueError,
     r"q must be packed as \(total_q, H, D\)"),
    ("attention varlen cu int64",
     lambda: fastlm.flash_attention_varlen(*_qkv((8, 2, 16)), *_cu_seqlens().long(), 8, 8), TypeError,
     "cu_seqlens_q must be int32"),
    # values of CPU cumulative lengths: always read (free on the host); only those that could not
    # make the interpreter read out of bounds before they were (tests/ops/test_flash_attention_varlen.py
    # runs the others in a child process)
    ("attention varlen cu starts at 1",
     lambda: fastlm.flash_attention_varlen(*_qkv((8, 2, 16)), *torch.tensor([[1, 4, 8]] * 2, dtype=torch.int32), 8, 8),
     ValueError, r"cu_seqlens_q must rise from 0 to 8 \(q's rows\) without falling, but it starts at 1"),
    ("attention varlen max_seqlen_k short",
     lambda: fastlm.flash_attention_varlen(*_qkv((8, 2, 16)), *_cu_seqlens(), 4, 3), ValueError,
     r"max_seqlen_k \(3\) must be at least the longest document's length"),
    ("attention varlen check 1",
     lambda: fastlm.flash_attention_varlen(*_qkv((8, 2, 16)), *_cu_seqlens(), 4, 4, check=1), TypeError,
     "check must be True or False"),
    # layer_norm / rms_norm
    ("layer_norm x list", lambda: fastlm.layer_norm([1.0, 2.0]), TypeError, "x must be a torch.Tensor"),
    ("layer_norm x 0-d", lambda: fastlm.layer_norm(torch.randn(())), ValueError, "x must have at least one dimension"),
    ("layer_norm x fp64", lambda: fastlm.layer_norm(X.double()), TypeError, "x must have dtype"),
    ("layer_norm x int", lambda: fastlm.layer_norm(X.int()), TypeError, "x must have dtype"),
    ("layer_norm weight shape", lambda: fastlm.layer_norm(X, torch.randn(5)), ValueError,
     r"weight must have shape \(8,\)"),
    ("layer_norm weight 2-D", lambda: fastlm.layer_norm(X, torch.randn(1, 8)), ValueError,
     r"weight must have shape \(8,\)"),
    ("layer_norm weight int", lambda: fastlm.layer_norm(X, W.int()), TypeError, "weight must have dtype"),
    ("layer_norm weight list", lambda: fastlm.layer_norm(X, [1.0] * 8), TypeError,
     "weight must be a torch.Tensor or None"),
    ("layer_norm weight on meta", lambda: fastlm.layer_norm(X, W.to("meta")), ValueError, "weight on meta"),
    ("layer_norm bias shape", lambda: fastlm.layer_norm(X, W, torch.randn(3)), ValueError, r"bias must have shape"),
    ("layer_norm bias float", lambda: fastlm.layer_norm(X, W, 0.0), TypeError, "bias must be a torch.Tensor or None"),
    ("layer_norm eps -1", lambda: fastlm.layer_norm(X, W, None, -1e-5), ValueError,
     "eps must be a finite number >= 0.0"),
    ("layer_norm eps nan", lambda: fastlm.layer_norm(X, eps=float("nan")), ValueError, "eps must be a finite"),
    ("layer_norm out_dtype int", lambda: fastlm.layer_norm(X, out_dtype=torch.int32), TypeError,
     "out_dtype must be one of"),
    ("layer_norm out_dtype str", lambda: fastlm.layer_norm(X, out_dtype="bf16"), TypeError, "out_dtype must be one of"),
    ("rms_norm bias in the eps slot", lambda: fastlm.rms_norm(X, W, torch.randn(8)), TypeError,
     "eps must be a number"),
    ("rms_norm eps str", lambda: fastlm.rms_norm(X, W, "1e-5"), TypeError, "eps must be a number"),
    ("rms_norm eps inf", lambda: fastlm.rms_norm(X, W, float("inf")), ValueError, "eps must be a finite"),
    ("rms_norm weight shape", lambda: fastlm.rms_norm(X, torch.randn(9)), ValueError, r"weight must have shape \(8,\)"),
    ("rms_norm x None", lambda: fastlm.rms_norm(None, W), TypeError, "x must be a torch.Tensor"),
    ("rms_norm weight_offset str", lambda: fastlm.rms_norm(X, W, weight_offset="1"), TypeError,
     "weight_offset must be a number"),
    ("rms_norm weight_offset nan", lambda: fastlm.rms_norm(X, W, weight_offset=float("nan")), ValueError,
     "weight_offset must be a finite number"),
    ("rms_norm weight_offset without a weight", lambda: fastlm.rms_norm(X, None, weight_offset=1.0), ValueError,
     "weight_offset needs a weight"),
    # masked_softmax
    ("softmax x list", lambda: fastlm.masked_softmax([1.0]), TypeError, "x must be a torch.Tensor"),
    ("softmax x 0-d", lambda: fastlm.masked_softmax(torch.randn(())), ValueError,
     r"x must have shape \(\.\.\., Sq, Sk\)"),
    ("softmax causal 1-D", lambda: fastlm.masked_softmax(torch.randn(4), causal=True), ValueError,
     r"x must have shape \(\.\.\., Sq, Sk\) for causal=True"),
    ("softmax x int", lambda: fastlm.masked_softmax(torch.ones(2, 2, dtype=torch.int64)), TypeError,
     "x must have dtype"),
    ("softmax mask bool", lambda: fastlm.masked_softmax(X, torch.ones(3, 8, dtype=torch.bool)), TypeError,
     "mask must have dtype"),
    ("softmax mask shape", lambda: fastlm.masked_softmax(torch.randn(2, 3, 4), torch.zeros(5)), ValueError,
     "mask of shape .* does not broadcast to x's shape"),
    ("softmax mask bigger", lambda: fastlm.masked_softmax(torch.randn(3, 4), torch.zeros(2, 3, 4)), ValueError,
     "mask of shape .* does not broadcast"),
    ("softmax mask list", lambda: fastlm.masked_softmax(X, [0.0] * 8), TypeError,
     "mask must be a torch.Tensor or None"),
    ("softmax mask on meta", lambda: fastlm.masked_softmax(X, torch.zeros(8).to("meta")), ValueError, "mask on meta"),
    ("softmax scale nan", lambda: fastlm.masked_softmax(X, scale=float("nan")), ValueError, "scale must be a finite"),
    ("softmax scale inf", lambda: fastlm.masked_softmax(X, scale=float("inf")), ValueError, "scale must be a finite"),
    ("softmax scale tensor", lambda: fastlm.masked_softmax(X, scale=torch.tensor(2.0)), TypeError,
     "scale must be a number"),
    ("softmax causal str", lambda: fastlm.masked_softmax(X, causal="true"), TypeError, "causal must be True or False"),
    # causal_conv1d
    ("conv u list", lambda: fastlm.causal_conv1d([[[1.0]]], KERNEL), TypeError, "u must be a torch.Tensor"),
    ("conv weight None", lambda: fastlm.causal_conv1d(U, None), TypeError, "weight must be a torch.Tensor"),
    ("conv bias float", lambda: fastlm.causal_conv1d(U, KERNEL, 0.5), TypeError, "bias must be a torch.Tensor or None"),
    ("conv u 2-D", lambda: fastlm.causal_conv1d(U[0], KERNEL), ValueError, r"u must have shape \(B, L, D\)"),
    ("conv weight channels", lambda: fastlm.causal_conv1d(U, torch.randn(5, 4)), ValueError,
     r"weight must have shape \(D, K\) = \(8, K\)"),
    ("conv weight 1-D", lambda: fastlm.causal_conv1d(U, torch.randn(8)), ValueError, "weight must have shape"),
    ("conv K=0", lambda: fastlm.causal_conv1d(U, torch.randn(8, 0)), ValueError, r"weight's kernel size K .*got 0"),
    ("conv K=9", lambda: fastlm.causal_conv1d(U, torch.randn(8, 9)), ValueError, r"weight's kernel size K .*got 9"),
    ("conv bias shape", lambda: fastlm.causal_conv1d(U, KERNEL, torch.randn(3)), ValueError,
     r"bias must have shape \(8,\)"),
    ("conv activation relu", lambda: fastlm.causal_conv1d(U, KERNEL, None, "relu"), ValueError,
     "activation must be None or 'silu'"),
    ("conv activation 1", lambda: fastlm.causal_conv1d(U, KERNEL, None, 1), ValueError, "activation must be None"),
    ("conv backend cpu", lambda: fastlm.causal_conv1d(U, KERNEL, backend="cpu"), ValueError, "backend must be one of"),
    ("conv backend cuda on CPU", lambda: fastlm.causal_conv1d(U, KERNEL, backend="cuda"), ValueError,
     "backend='cuda' needs CUDA tensors"),
    ("conv u int", lambda: fastlm.causal_conv1d(U.long(), KERNEL), TypeError, "u must have dtype"),
    ("conv weight fp64", lambda: fastlm.causal_conv1d(U, KERNEL.double()), TypeError, "weight must have dtype"),
    ("conv weight on meta", lambda: fastlm.causal_conv1d(U, KERNEL.to("meta")), ValueError, "weight on meta"),
    ("conv 65536 sequences", lambda: fastlm.causal_conv1d(torch.randn(65536, 1, 1), torch.randn(1, 2)), ValueError,
     "u may hold at most 65535 sequences"),
    # rotary_embedding
    ("rotary q list", lambda: rotary_embedding([1.0], Q, COS, COS), TypeError, "q must be a torch.Tensor"),
    ("rotary odd head dim", lambda: rotary_embedding(Q[..., :3], Q[..., :3], COS, COS), ValueError,
     "head dim must be even"),
    ("rotary tables short", lambda: rotary_embedding(Q, Q, COS[:1], COS[:1]), ValueError, "cos and sin must be"),
    ("rotary sin fp16", lambda: rotary_embedding(Q, Q, COS, COS.half()), TypeError, "sin must be an fp32 table"),
    ("rotary k on meta", lambda: rotary_embedding(Q, Q.to("meta"), COS, COS), ValueError, "k on meta"),
    # swiglu
    ("swiglu gate list", lambda: fastlm.swiglu([1.0], X), TypeError, "gate must be a torch.Tensor"),
    ("swiglu gate 0-d", lambda: fastlm.swiglu(X[0, 0], X[0, 0]), ValueError, "gate must have at least one dimension"),
    ("swiglu up shape", lambda: fastlm.swiglu(X, X[:, :5]), ValueError, r"up must have gate's shape \(3, 8\)"),
    ("swiglu gate fp64", lambda: fastlm.swiglu(X.double(), X.double()), TypeError, "gate must have dtype"),
    ("swiglu up bf16", lambda: fastlm.swiglu(X, X.bfloat16()), TypeError, "up must have gate's dtype"),
    ("swiglu up on meta", lambda: fastlm.swiglu(X, X.to("meta")), ValueError, "up on meta"),
    # geglu: swiglu's checks, and its approximate
    ("geglu up shape", lambda: fastlm.geglu(X, X[:, :5]), ValueError, r"up must have gate's shape \(3, 8\)"),
    ("geglu up bf16", lambda: fastlm.geglu(X, X.bfloat16()), TypeError, "up must have gate's dtype"),
    ("geglu approximate", lambda: fastlm.geglu(X, X, approximate="erf"), ValueError,
     "approximate must be 'tanh' or 'none', got 'erf'"),
    # weighted_sum
    ("weighted_sum x list", lambda: weighted_sum([1.0], W), TypeError, "x must be a torch.Tensor"),
    ("weighted_sum w None", lambda: weighted_sum(X, None), TypeError, "w must be a torch.Tensor"),
    ("weighted_sum x 0-d", lambda: weighted_sum(torch.randn(()), W), ValueError, "x must have at least one dimension"),
    ("weighted_sum w shape", lambda: weighted_sum(X, torch.randn(5)), ValueError, r"w must have shape \(8,\)"),
    ("weighted_sum x int", lambda: weighted_sum(X.int(), W), TypeError, "x must have dtype"),
    ("weighted_sum w fp64", lambda: weighted_sum(X, W.double()), TypeError, "w must have dtype"),
    ("weighted_sum w on meta", lambda: weighted_sum(X, W.to("meta")), ValueError, "w on meta"),
    # linear_cross_entropy: tensors, shapes, dtypes, devices, options
    ("linear_xent hidden 1-D", lambda: _linear_xent(hidden=torch.randn(6)), ValueError, r"hidden must be 2-D"),
    ("linear_xent hidden 3-D", lambda: _linear_xent(hidden=torch.randn(1, 6, 8)), ValueError, "hidden must be 2-D"),
    ("linear_xent weight width", lambda: _linear_xent(weight=torch.randn(10, 9)), ValueError,
     r"weight must have shape \(vocab, 8\)"),
    ("linear_xent weight empty", lambda: _linear_xent(weight=torch.randn(0, 8)), ValueError, "at least one row"),
    ("linear_xent bias shape", lambda: _linear_xent(bias=torch.randn(11)), ValueError, r"bias must have shape \(10,\)"),
    ("linear_xent targets shape", lambda: _linear_xent(targets=_targets(1, 2)), ValueError,
     r"targets must have shape \(6,\)"),
    ("linear_xent targets float", lambda: _linear_xent(targets=torch.zeros(6)), TypeError,
     "targets must hold integer class indices"),
    ("linear_xent targets range", lambda: _linear_xent(targets=torch.full((6,), 10)), ValueError,
     r"targets must lie in \[0, 10\)"),
    ("linear_xent hidden fp64", lambda: _linear_xent(hidden=torch.randn(6, 8, dtype=torch.float64)), TypeError,
     "hidden must have dtype"),
    ("linear_xent dtypes differ", lambda: _linear_xent(weight=torch.randn(10, 8).bfloat16()), TypeError,
     "hidden float32, weight bfloat16"),
    ("linear_xent hidden list", lambda: _linear_xent(hidden=[[0.0] * 8] * 6), TypeError,
     "hidden must be a torch.Tensor"),
    ("linear_xent targets on meta", lambda: _linear_xent(targets=torch.zeros(6, dtype=torch.long, device="meta")),
     ValueError, "on one device"),
    ("linear_xent reduction", lambda: _linear_xent(reduction="avg"), ValueError, "reduction must be one of"),
    ("linear_xent ignore_index float", lambda: _linear_xent(ignore_index=-100.0), TypeError,
     "ignore_index must be an int"),
    ("linear_xent label_smoothing", lambda: _linear_xent(label_smoothing=1.5), ValueError,
     r"label_smoothing must be a finite number in \[0.0, 1.0\]"),
    ("linear_xent z_loss", lambda: _linear_xent(z_loss=-1e-4), ValueError, "z_loss must be a finite number"),
    ("linear_xent softcap 0", lambda: _linear_xent(softcap=0.0), ValueError, "softcap must be a finite number > 0"),
    ("linear_xent softcap inf", lambda: _linear_xent(softcap=float("inf")), ValueError, "softcap must be a finite"),
    ("linear_xent chunk_rows 0", lambda: _linear_xent(chunk_rows=0), ValueError, "chunk_rows must be an int >= 1"),
    ("linear_xent chunk_rows float", lambda: _linear_xent(chunk_rows=8.0), TypeError, "chunk_rows must be an int"),
    ("LinearCrossEntropyLoss softcap", lambda: LinearCrossEntropyLoss(softcap=-1.0), ValueError,
     "softcap must be a finite number > 0"),
    ("LinearCrossEntropyLoss ignore_index", lambda: LinearCrossEntropyLoss(ignore_index="x"), TypeError,
     "ignore_index must be an int"),
    # fp8_linear: tensors, shapes, dtypes
    ("fp8_linear x list", lambda: fastlm.fp8_linear([1.0] * 16, torch.randn(16, 16)), TypeError,
     "x must be a torch.Tensor"),
    ("fp8_linear weight int", lambda: fastlm.fp8_linear(torch.randn(2, 16), torch.ones(16, 16, dtype=torch.int64)),
     TypeError, "weight must have dtype"),
    ("fp8_linear K 24", lambda: fastlm.fp8_linear(torch.randn(2, 24), torch.randn(16, 24)), ValueError,
     "K and N multiples of 16"),
    ("fp8_linear bias (8,)", lambda: fastlm.fp8_linear(torch.randn(2, 16), torch.randn(16, 16), torch.randn(8)),
     ValueError, r"bias must be \(N,\)"),
    # module constructors
    ("CrossEntropyLoss ignore_index 2.7", lambda: CrossEntropyLoss(ignore_index=2.7), TypeError,
     "ignore_index must be an int"),
    ("CrossEntropyLoss reduction", lambda: CrossEntropyLoss(reduction="avg"), ValueError, "reduction must be one of"),
    ("CrossEntropyLoss label_smoothing", lambda: CrossEntropyLoss(label_smoothing=2.0), ValueError,
     "label_smoothing must be a finite number"),
    ("CrossEntropyLoss z_loss", lambda: CrossEntropyLoss(z_loss=-1e-4), ValueError, "z_loss must be a finite"),
    ("CrossEntropyLoss fused", lambda: CrossEntropyLoss(fused="yes"), TypeError, "fused must be True or False"),
    ("CrossEntropyLoss inplace unfused", lambda: CrossEntropyLoss(fused=False, inplace=True), ValueError,
     "inplace=True needs fused=True"),
    ("LayerNorm d 2.5", lambda: LayerNorm(2.5), TypeError, "d must be an int"),
    ("LayerNorm d -1", lambda: LayerNorm(-1), ValueError, "d must be an int >= 0, got -1"),
    ("LayerNorm eps -1", lambda: LayerNorm(8, eps=-1.0), ValueError, "eps must be a finite number >= 0.0"),
    ("LayerNorm eps tensor", lambda: LayerNorm(8, eps=torch.tensor(1e-5)), TypeError, "eps must be a number"),
    ("LayerNorm bias str", lambda: LayerNorm(8, bias="no"), TypeError, "bias must be True or False"),
    ("LayerNorm elementwise_affine None", lambda: LayerNorm(8, elementwise_affine=None), TypeError,
     "elementwise_affine must be True or False"),
    ("RMSNorm d str", lambda: RMSNorm("8"), TypeError, "d must be an int"),
    ("RMSNorm eps nan", lambda: RMSNorm(8, eps=float("nan")), ValueError, "eps must be a finite"),
    ("RMSNorm elementwise_affine 0", lambda: RMSNorm(8, elementwise_affine=0), TypeError,
     "elementwise_affine must be True or False"),
]  # fmt: skip


@pytest.mark.parametrize("call,error,message", [pytest.param(*case[1:], id=case[0]) for case in CASES])
def test_bad_argument_raises_one_clear_error_naming_it(call, error, message):
    with pytest.raises(error, match=message):
        call()


def test_the_table_reaches_every_public_op_and_module():
    """Each name fastlm exports, the user-loop functions, and each module: at least one row."""
    ids = " ".join(case[0] for case in CASES)
    for prefix in ("xent", "xent forward", "xent backward", "linear_xent", "attention", "attention twin",
                   "attention kernels", "attention window", "attention varlen", "layer_norm", "rms_norm", "softmax",
                   "conv", "rotary", "swiglu", "geglu", "weighted_sum", "fp8_linear", "CrossEntropyLoss", "LayerNorm",
                   "RMSNorm", "LinearCrossEntropyLoss"):  # fmt: skip
        assert f"{prefix} " in ids, prefix
    # the Hugging Face patch's bad inputs (models it does not support) are tested in tests/integrations,
    # the losses' in tests/test_losses.py
    losses = {"bradley_terry_loss", "dpo_loss", "linear_dpo_loss", "ranking_loss", "sequence_logprobs"}
    ops = set(fastlm.__all__) - {"apply_fastlm", "revert_fastlm"} - losses
    assert ops == {"causal_conv1d", "cross_entropy", "flash_attention", "flash_attention_varlen", "fp8_linear", "geglu",
                   "layer_norm", "linear_cross_entropy", "masked_softmax", "rms_norm", "rotary_embedding",
                   "swiglu"}  # fmt: skip


def test_correct_values_of_other_types_pass():
    """numpy scalars and ints where floats are expected work as their Python values do."""
    np = pytest.importorskip("numpy")
    logits, targets = _logits(), _targets()
    expected = fastlm.cross_entropy(logits, targets, ignore_index=3, label_smoothing=0.1)
    got = fastlm.cross_entropy(logits, targets, ignore_index=np.int64(3), label_smoothing=np.float32(0.1))
    torch.testing.assert_close(got, expected)
    torch.testing.assert_close(fastlm.rms_norm(X, W, 0), fastlm.rms_norm(X, W, 0.0))
    torch.testing.assert_close(fastlm.masked_softmax(X, scale=np.float64(2.0)), fastlm.masked_softmax(X, scale=2.0))

"""A linear layer whose three matmuls run in FP8 with tensorwise scales: `fp8_linear`.

    x (..., K), weight (N, K), bias (N,) or None;  y = x W^T + b  in x's dtype

Each operand is quantized with one scale per tensor, from its current absolute maximum (no scale
history to keep or checkpoint), as torchao's tensorwise float8 training does:

    s_t = FMAX / amax(|t|)      t8 = clamp(t s_t, -FMAX, FMAX) as FP8      t ~= t8 / s_t

inputs and weights in e4m3 (FMAX 448, 3 mantissa bits), the output gradient in e5m2 (FMAX 57344:
gradients span more range, need fewer bits). The matmuls are ``torch._scaled_mm`` (cuBLASLt on
sm89+ GPUs, PyTorch's own kernel on a CPU), which multiplies FP8 tiles, accumulates in fp32 and
applies both inverse scales:

    forward   y  = (x8 w8^T) / (s_x s_w)                 e4m3 x e4m3
    backward  dx = (g8 w8) / (s_g s_w)                   e5m2 x e4m3
              dw = (g8^T x8) / (s_g s_x)                 e5m2 x e4m3,   db = sum of g over rows

The forward saves x8 and w8 (one byte per element; the layer's input in bf16 would take two) and
their scales. An all-zero tensor gets scale FMAX / tiny and quantizes to zeros. Cost beyond the
matmuls: one amax pass and one cast pass over each operand per direction (the weight's quantized
again for no step: w8 is saved), which torch.compile fuses with their producers.

cuBLASLt's FP8 matmuls take inner and output dims that are multiples of 16: `fp8_linear` asks that
of K and N, and pads the rows M of the weight gradient's inner dim with zero rows where needed.
"""

from __future__ import annotations

import torch

from fastlm.ops.common import check_dtype, check_optional_tensor, check_same_device, check_tensor, device_arch

E4M3 = torch.float8_e4m3fn
E5M2 = torch.float8_e5m2
# the smallest amax a scale is taken from: an all-zero tensor quantizes to zeros, not NaN
AMAX_FLOOR = 1e-12
# dims of both matmul operands that cuBLASLt's FP8 kernels take: multiples of 16
FP8_MULTIPLE = 16
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# the first GPUs with FP8 tensor cores: Ada (8.9) and Hopper (9.0)
FP8_ARCH = 89


def quantize(t: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(t8, inverse scale): ``t`` scaled by FMAX / amax(|t|), clamped and cast to the FP8 ``dtype``,
    and the fp32 scalar that undoes the scale (t ~= t8 * inverse)."""
    fmax = torch.finfo(dtype).max
    amax = t.detach().abs().amax().float().clamp(min=AMAX_FLOOR)
    scale = fmax / amax
    t8 = (t.float() * scale).clamp(-fmax, fmax).to(dtype).contiguous()  # row-major, as the matmuls take it
    return t8, scale.reciprocal()


def _column_major(t: torch.Tensor) -> torch.Tensor:
    """The same matrix laid out column-major, as ``torch._scaled_mm`` takes its second operand."""
    return t.t().contiguous().t()


def _padded_rows(t8: torch.Tensor, multiple: int) -> torch.Tensor:
    """``t8`` (M, ...) with zero rows appended up to a multiple of ``multiple`` (the bytes of 0.0 in
    both FP8 formats are zeros); ``t8`` itself where M is one already."""
    missing = -t8.shape[0] % multiple
    if not missing:
        return t8
    return torch.cat([t8.view(torch.uint8), t8.new_zeros((missing, *t8.shape[1:]), dtype=torch.uint8)]).view(t8.dtype)


def _scaled_mm(a8, a_inverse, b8, b_inverse, out_dtype) -> torch.Tensor:
    """(a8 * a_inverse) @ (b8 * b_inverse) in ``out_dtype``, accumulated in fp32."""
    return torch._scaled_mm(a8, _column_major(b8), scale_a=a_inverse, scale_b=b_inverse, out_dtype=out_dtype)


class _FP8Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])
        x8, x_inverse = quantize(rows, E4M3)
        w8, w_inverse = quantize(weight, E4M3)
        out = _scaled_mm(x8, x_inverse, w8.t(), w_inverse, x.dtype)
        if bias is not None:
            out = out + bias.to(x.dtype)
        ctx.save_for_backward(x8, x_inverse, w8, w_inverse)
        ctx.shapes = (x.shape, x.dtype, weight.dtype, None if bias is None else bias.dtype)
        return out.view(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        x8, x_inverse, w8, w_inverse = ctx.saved_tensors
        x_shape, x_dtype, w_dtype, b_dtype = ctx.shapes
        g = grad_out.reshape(-1, grad_out.shape[-1])
        g8, g_inverse = quantize(g, E5M2)
        dx = dw = db = None
        if ctx.needs_input_grad[0]:
            dx = _scaled_mm(g8, g_inverse, w8, w_inverse, x_dtype).view(x_shape)
        if ctx.needs_input_grad[1]:
            g8_rows, x8_rows = _padded_rows(g8, FP8_MULTIPLE), _padded_rows(x8, FP8_MULTIPLE)  # M: the inner dim
            dw = _scaled_mm(g8_rows.t().contiguous(), g_inverse, x8_rows, x_inverse, torch.float32).to(w_dtype)
        if b_dtype is not None and ctx.needs_input_grad[2]:
            db = g.sum(0, dtype=torch.float32).to(b_dtype)
        return dx, dw, db


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` with its forward and backward matmuls in FP8, tensorwise
    scales (module docstring): x (..., K), weight (N, K), bias (N,); K and N multiples of 16.
    Returns (..., N) in x's dtype. Under autocast, pass x in the autocast dtype."""
    check_tensor("x", x)
    check_tensor("weight", weight)
    check_optional_tensor("bias", bias)
    for name, tensor in (("x", x), ("weight", weight)):
        check_dtype(name, tensor, DTYPES)
    if weight.dim() != 2 or x.dim() < 1 or x.shape[-1] != weight.shape[1]:
        raise ValueError(f"x (..., K) and weight (N, K) must share K, got {tuple(x.shape)} and {tuple(weight.shape)}")
    if bias is not None and tuple(bias.shape) != (weight.shape[0],):
        raise ValueError(f"bias must be (N,) = ({weight.shape[0]},), got {tuple(bias.shape)}")
    N, K = weight.shape
    if K % FP8_MULTIPLE or N % FP8_MULTIPLE:
        raise ValueError(f"fp8_linear needs K and N multiples of {FP8_MULTIPLE} (FP8 matmuls), got K {K}, N {N}")
    if weight.device != x.device or (bias is not None and bias.device != x.device):
        check_same_device(x=x, weight=weight, **({} if bias is None else {"bias": bias}))
    if x.device.type == "cuda" and device_arch(x.device) < FP8_ARCH:
        raise ValueError(
            f"fp8_linear needs a GPU with FP8 tensor cores (compute capability 8.9 or later), got "
            f"{torch.cuda.get_device_name(x.device)} ({device_arch(x.device) / 10:.1f})"
        )
    if x.numel() == 0:  # no rows: nothing to scale by (amax of nothing)
        return torch.nn.functional.linear(x, weight.to(x.dtype), None if bias is None else bias.to(x.dtype))
    return _FP8Linear.apply(x, weight, bias)

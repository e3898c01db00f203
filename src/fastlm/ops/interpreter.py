"""bfloat16 in the Triton interpreter (TRITON_INTERPRET=1) computed as the GPU computes it.

Triton 3.6's interpreter holds a bf16 tensor as the uint16 bit patterns of its values, and several
of its operations apply numpy to those integers as if they were the numbers:

    tl.dot                       integer matmul of the bit patterns (flash attention: outputs ~1e9)
    + - * / fma, comparisons     integer arithmetic / comparison of the bit patterns
    -x (Triton >= 3.7)           integer negation of the bit patterns (3.6 subtracts from 0)
    tl.sum                       an integer sum of the bit patterns
    fp32 -> bf16 (`.to`)         truncates the mantissa where the GPU rounds to nearest even (and
                                 with an explicit "rtne", rounds ties up and drops the carry)
    int / bool -> bf16           converts the integer to the bit pattern, not to the number
    bf16 constants (x * 2.5)     no builder method: an AttributeError

On the GPU every bf16 operation gives its exact result rounded to bf16 (nearest even), and tl.dot
multiplies bf16 exactly and accumulates in fp32. `apply()` makes the interpreter do the same: it
wraps those builder methods so bf16 operands are widened to fp32 (exact), the operation runs in
fp32, and a bf16 result is rounded to nearest even. Other dtypes take the interpreter's own code.
A tl.sum of bf16 is accumulated in fp32 and rounded once (the GPU's order of bf16 additions is not
reproduced). bf16 atomics stay unsupported: the interpreter raises for them.

Applied by `fastlm.ops` on import when TRITON_INTERPRET=1; idempotent; a Triton whose interpreter
lacks these classes is left as it is.
"""

from __future__ import annotations

import functools

import numpy as np

_APPLIED_MARK = "_fastlm_bf16"


def widen(bits: np.ndarray) -> np.ndarray:
    """bf16 bit patterns (uint16) -> their values as fp32, exactly."""
    return (np.asarray(bits).astype(np.uint32) << 16).view(np.float32)


def narrow(values: np.ndarray) -> np.ndarray:
    """fp32 values -> bf16 bit patterns (uint16), rounded to nearest even as the GPU's cvt.rn.bf16.f32;
    NaN stays NaN (a quiet NaN of the same sign), overflow goes to inf."""
    values = np.asarray(values, dtype=np.float32)
    bits = values.view(np.uint32)
    rounded = (bits + np.uint32(0x7FFF) + ((bits >> 16) & np.uint32(1))) >> 16
    return np.where(np.isnan(values), (bits >> 16) | np.uint32(0x40), rounded).astype(np.uint16)


def apply() -> None:
    """Patch the interpreter's builder and reductions (once; later calls do nothing)."""
    try:
        from triton.runtime import interpreter
    except ImportError:
        return
    builder = getattr(interpreter, "InterpreterBuilder", None)
    needed = (builder, getattr(interpreter, "TensorHandle", None), getattr(interpreter, "ReduceOps", None))
    if any(part is None for part in needed) or getattr(builder, _APPLIED_MARK, False):
        return
    _patch(interpreter)
    setattr(builder, _APPLIED_MARK, True)


def _patch(interpreter) -> None:
    tl = interpreter.tl
    bf16, fp32 = tl.bfloat16, tl.float32
    builder, handle_type = interpreter.InterpreterBuilder, interpreter.TensorHandle

    def is_bf16(handle) -> bool:
        return handle.dtype.scalar == bf16

    def value(handle) -> np.ndarray:
        """The numbers a handle holds (bf16 widened to fp32)."""
        return widen(handle.data) if is_bf16(handle) else handle.data

    def result(data: np.ndarray):
        """A bf16 handle from fp32 results, or a bool handle from comparisons."""
        if data.dtype == np.bool_:
            return handle_type(data, tl.int1)
        return handle_type(narrow(data), bf16)

    def wrap(owner, name, fixed):
        """owner.name(self, *args) becomes fixed(original, self, *args)."""
        original = getattr(owner, name)

        @functools.wraps(original)
        def method(self, *args):
            return fixed(original, self, *args)

        setattr(owner, name, method)

    def binary_op(original, self, lhs, rhs, op):
        if not (is_bf16(lhs) or is_bf16(rhs)):
            return original(self, lhs, rhs, op)
        return result(op(value(lhs), value(rhs)))

    def unary_op(original, self, arg, op):
        if not is_bf16(arg):
            return original(self, arg, op)
        return result(op(value(arg)))

    def create_fma(original, self, x, y, z):
        if not (is_bf16(x) or is_bf16(y) or is_bf16(z)):
            return original(self, x, y, z)
        return result(value(x) * value(y) + value(z))

    def cast_impl(original, self, src, dst_type):
        if not (is_bf16(src) or dst_type.scalar == bf16):
            return original(self, src, dst_type)
        data = value(src)
        if dst_type.scalar == bf16:
            return handle_type(narrow(data.astype(np.float32)), bf16)
        return handle_type(data.astype(interpreter._get_np_dtype(dst_type)), dst_type.scalar)

    def create_fp_to_fp(original, self, src, dst_type, rounding_mode):
        # `.to(tl.bfloat16, fp_downcast_rounding="rtne")`: the interpreter's own rounding rounds ties
        # up and loses the carry into the exponent
        if not (
            dst_type.scalar == bf16
            and rounding_mode == interpreter._ir.ROUNDING_MODE.RTNE
            and src.dtype.scalar in (tl.float16, fp32, tl.float64)
        ):
            return original(self, src, dst_type, rounding_mode)
        return handle_type(narrow(src.data.astype(np.float32)), bf16)

    def create_dot(original, self, a, b, d, input_precision, max_num_imprecise_acc):
        # bf16 x bf16 products are exact in fp32; the accumulator d is fp32 already
        if is_bf16(a):
            a = handle_type(widen(a.data), fp32)
        if is_bf16(b):
            b = handle_type(widen(b.data), fp32)
        return original(self, a, b, d, input_precision, max_num_imprecise_acc)

    wrap(builder, "binary_op", binary_op)  # every float binary op and comparison goes through it
    wrap(builder, "unary_op", unary_op)  # negation (Triton >= 3.7); math functions refuse bf16
    wrap(builder, "create_fma", create_fma)
    wrap(builder, "cast_impl", cast_impl)  # the create_*_to_* casts call self.cast_impl: they see the wrapper
    wrap(builder, "create_fp_to_fp", create_fp_to_fp)
    wrap(builder, "create_dot", create_dot)
    builder.get_bf16 = lambda self, number: handle_type(narrow(np.array([number], dtype=np.float32)), bf16)

    def reduce_sum(original, self, input):
        # (scans need nothing: tl.cumsum / tl.cumprod hand the interpreter bf16 already widened)
        if input.dtype.scalar != bf16:
            return original(self, input)
        total = original(self, self.to_tensor(widen(input.handle.data), fp32))
        return self.to_tensor(narrow(total.handle.data), input.dtype)

    wrap(interpreter.ReduceOps, "sum", reduce_sum)

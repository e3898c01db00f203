"""Constants the Triton kernels read as globals: `tl.constexpr` values, which Triton folds into the
compiled code (a kernel may read no other kind of global)."""

import triton.language as tl

LOG2E = tl.constexpr(1.4426950408889634)  # log2(e): exp(x) = exp2(x * LOG2E), as the hardware computes it
LN2 = tl.constexpr(0.6931471805599453)  # ln(2): log(x) = log2(x) * LN2
# GELU: exact x Phi(x) = x (1 + erf(x / sqrt(2))) / 2, Phi' = exp(-x^2 / 2) / sqrt(2 pi); tanh form
# (1 + tanh(k)) / 2 = sigmoid(2 k), k = sqrt(2 / pi) (x + 0.044715 x^3)
SQRT_HALF = tl.constexpr(0.7071067811865476)  # 1 / sqrt(2)
INV_SQRT_2PI = tl.constexpr(0.3989422804014327)  # 1 / sqrt(2 pi)
SQRT_8_OVER_PI = tl.constexpr(1.5957691216057308)  # 2 sqrt(2 / pi): 2 k = SQRT_8_OVER_PI (x + GELU_CUBIC x^3)
GELU_CUBIC = tl.constexpr(0.044715)

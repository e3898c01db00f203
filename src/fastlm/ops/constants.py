"""Constants the Triton kernels read as globals: `tl.constexpr` values, which Triton folds into the
compiled code (a kernel may read no other kind of global)."""

import triton.language as tl

LOG2E = tl.constexpr(1.4426950408889634)  # log2(e): exp(x) = exp2(x * LOG2E), as the hardware computes it
LN2 = tl.constexpr(0.6931471805599453)  # ln(2): log(x) = log2(x) * LN2

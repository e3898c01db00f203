"""One file per op: Triton kernels, launchers, autograd, the public functional, its reference."""

import os

if os.environ.get("TRITON_INTERPRET") == "1":  # CPU runs of the kernels: bf16 as the GPU computes it
    from fastlm.ops import interpreter

    interpreter.apply()

"""One file per op: Triton kernels, launchers, autograd, the public functional, its reference."""

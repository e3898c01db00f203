"""Sweep tile sizes, warps and pipeline stages of the FlashAttention kernels on the GPU.

For each shape (batch, heads, tokens; causal), head dim and dtype it times the forward kernel and
the backward with one kernel's tiles varied at a time (the others at the GPU's default
`attention_config` for that shape), printing one JSON line per configuration (median ms and
TFLOP/s, forward FLOPs 2*B*H*N^2*D causal, backward 2.5x), PyTorch's SDPA backends at the same
shape for reference (bf16/fp16 only), then, on stderr, the best AttentionConfig found as a Python
expression: an entry of the architecture's table in fastlm/ops/flash_attention/config.py.
With --packed each shape is (rows, heads, tokens per row) of packed documents, the long-tailed
lengths of `fastlm bench attention --sweep varlen`, 16-bit only, over fewer candidates (FLOPs: the
per-document causal work).
Usage: python benchmarks/tune_attention.py [--shapes 8,16,4096 4,12,512] [--head-dims 128,64]
       [--dtypes bfloat16,float32] [--packed] > tune_attention.jsonl
"""

import argparse
import dataclasses
import itertools
import json
import sys

import torch
import triton.testing

from fastlm.bench.attention import Documents
from fastlm.ops import flash_attention as fa
from fastlm.ops.common import device_arch

# (BLOCK_M queries, BLOCK_N keys) candidates for 16-bit inputs; fp32 tiles must stay smaller.
TILES_16BIT = [(32, 32), (32, 64), (64, 32), (64, 64), (128, 32), (128, 64), (64, 128), (128, 128)]
FORWARD = {
    2: list(itertools.product(TILES_16BIT, [4, 8], [2, 3, 4])),
    4: list(itertools.product([(32, 32), (64, 32), (64, 64), (32, 64)], [4, 8], [1, 2])),
}
BACKWARD = {
    2: list(itertools.product(TILES_16BIT, [4, 8], [2, 3])),
    4: list(itertools.product([(16, 32), (32, 32), (32, 64), (64, 32), (64, 64)], [4, 8], [1, 2])),
}
# Packed documents, 16-bit: the tiles around each kernel's dense winners
PACKED_FORWARD = list(itertools.product([(64, 64), (128, 64), (64, 128), (128, 128)], [4, 8], [2, 3]))
PACKED_BACKWARD = list(itertools.product([(32, 64), (64, 32), (64, 64), (128, 64), (64, 128)], [4, 8], [2, 3]))


def bench(fn):
    try:
        return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")
    except Exception as error:  # out of shared memory or registers
        return str(error).splitlines()[0][:160]


def emit(kernel, shape, dim, dtype, ms, flops, **settings):
    result = {"ms": ms, "tflops": flops / ms / 1e9} if isinstance(ms, float) else {"error": ms}
    batch, heads, seq = shape
    print(
        json.dumps(
            {
                "kernel": kernel,
                "batch": batch,
                "heads": heads,
                "seq": seq,
                "head_dim": dim,
                "dtype": str(dtype).removeprefix("torch."),
                **settings,
                **result,
            }
        ),
        flush=True,
    )


def sweep(kernel, default, candidates, run, shape, dim, dtype, flops, **labels) -> fa.AttentionTiles:
    """Time ``run(config)`` with ``kernel``'s tiles set to each candidate; the fastest tiles. ``labels``
    go into every record."""
    best, best_ms = getattr(default, kernel), float("inf")
    for (block_m, block_n), warps, stages in candidates:
        tiles = fa.AttentionTiles(block_m, block_n, warps, stages)
        config = dataclasses.replace(default, **{kernel: tiles})
        ms = bench(lambda config=config: run(config))
        tile_settings = dict(block_m=block_m, block_n=block_n, warps=warps, stages=stages)
        emit(kernel, shape, dim, dtype, ms, flops, **labels, **tile_settings)
        if isinstance(ms, float) and ms < best_ms:
            best, best_ms = tiles, ms
    return best


def sdpa_reference(q, k, v, do, shape, dim, dtype, fwd_flops):
    """PyTorch's flash and cuDNN SDPA backends at the same shape: forward and forward + backward."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    for name, backend in (("sdpa-flash", SDPBackend.FLASH_ATTENTION), ("sdpa-cudnn", SDPBackend.CUDNN_ATTENTION)):
        with sdpa_kernel(backend):

            def forward():
                return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)

            def forward_backward():
                forward().backward(do)

            emit(f"{name} forward", shape, dim, dtype, bench(forward), fwd_flops)
            emit(f"{name} fwd+bwd", shape, dim, dtype, bench(forward_backward), 3.5 * fwd_flops)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", default=["8,16,4096"], help="batch,heads,tokens (default: %(default)s)")
    parser.add_argument("--head-dims", default="128,64", help="(default: %(default)s)")
    parser.add_argument("--dtypes", default="bfloat16,float32", help="(default: %(default)s)")
    parser.add_argument("--packed", action="store_true", help="shapes are rows,heads,tokens of packed documents")
    args = parser.parse_args()
    arch = device_arch(torch.device("cuda"))
    shapes = [tuple(int(x) for x in shape.split(",")) for shape in args.shapes]
    dtypes = [getattr(torch, name) for name in args.dtypes.split(",")]
    dims = [int(d) for d in args.head_dims.split(",")]
    for shape, dtype, dim in itertools.product(shapes, dtypes, dims):
        batch, heads, seq = shape
        size = min(dtype.itemsize, 4)
        scale = dim**-0.5
        if args.packed:
            docs = Documents(batch, heads, seq, dim, dtype)
            lengths = docs.lengths()
            cu = torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32, device="cuda")
            q, k, v, do = (torch.randn(batch * seq, heads, dim, device="cuda", dtype=dtype) for _ in range(4))
            packing = dict(cu_seqlens_q=cu, cu_seqlens_k=cu)
            fwd_flops, keys = docs.masked_flops, max(lengths)
            forward_candidates, backward_candidates = PACKED_FORWARD, PACKED_BACKWARD
        else:
            q, k, v, do = (torch.randn(batch, heads, seq, dim, device="cuda", dtype=dtype) for _ in range(4))
            packing, fwd_flops, keys = {}, 2 * batch * heads * seq * seq * dim, seq
            forward_candidates, backward_candidates = FORWARD[size], BACKWARD[size]
        default = fa.attention_config(arch, dtype, dim, keys)
        o, lse = fa._launch_forward(q, k, v, True, scale, default, **packing)
        if size == 2 and not args.packed:
            sdpa_reference(q, k, v, do, shape, dim, dtype, fwd_flops)

        def forward(config):
            return fa._launch_forward(q, k, v, True, scale, config, **packing)

        def backward(config):
            return fa._launch_backward(do, q, k, v, o, lse, True, scale, config, **packing)

        labels = {"packed": args.packed}
        emit("default forward", shape, dim, dtype, bench(lambda: forward(default)), fwd_flops, **labels)
        emit("default backward", shape, dim, dtype, bench(lambda: backward(default)), 2.5 * fwd_flops, **labels)
        best = {
            name: sweep(name, default, candidates, run, shape, dim, dtype, flops, **labels)
            for name, candidates, run, flops in (
                ("forward", forward_candidates, forward, fwd_flops),
                ("dkdv", backward_candidates, backward, 2.5 * fwd_flops),
                ("dq", backward_candidates, backward, 2.5 * fwd_flops),
            )
        }
        print(
            f"sm{arch} {str(dtype).removeprefix('torch.')} head dim {dim}, {batch}x{heads}x{seq}: "
            f"{fa.AttentionConfig(**best, forward_descriptors=default.forward_descriptors)!r}",
            file=sys.stderr,
        )


if __name__ == "__main__":
    main()

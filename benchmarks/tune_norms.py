"""Sweep the row-tile size, elements per warp, backward grid, looped-backward rows per chunk, the
wide-row dw / db kernel and the partial-sum tile of the LayerNorm / RMSNorm kernels.

The benchmark shapes of `fastlm bench norms`, bf16 and fp32. Prints one JSON line per
configuration with the median ms and the GB/s of the minimum-bytes model; the constants at the
top of fastlm/ops/layer_norm.py's launchers come from these runs.
Usage: python benchmarks/tune_norms.py [--sweep fwd,bwd,param,sum] [WIDTH ...] > tune_norms.jsonl
(only the shapes of those widths; only the named sweeps)
"""

import argparse
import functools
import itertools
import json

import torch
import triton.testing

from fastlm.bench.norms import GPU_SHAPES, norm_bytes
from fastlm.ops import layer_norm as ln


def report(stage, kind, m, d, dtype, config, fn):
    nbytes = norm_bytes(m, d, dtype.itemsize, kind, stage)
    try:
        ms = triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")
        result = {"ms": ms, "gbps": nbytes / ms / 1e6}
    except Exception as error:  # a configuration that does not compile (registers, shared memory)
        result = {"error": str(error)[:200]}
    print(
        json.dumps({"stage": stage, "kind": kind, "m": m, "d": d, "dtype": str(dtype)[6:], **config, **result}),
        flush=True,
    )


def main():
    settings = (
        "FORWARD_TILE",
        "FORWARD_PER_WARP",
        "BACKWARD_TILE",
        "BACKWARD_PER_WARP",
        "BACKWARD_PROGRAMS_PER_SM",
        "LOOPED_BYTES_PER_SM",
        "LOOPED_BACKWARD_ROWS",
        "SUM_BLOCK_P",
        "SUM_BLOCK_D",
        "PARAM_GRAD_BLOCK_M",
        "PARAM_GRAD_BLOCK_D",
        "PARAM_GRAD_WARPS",
        "PARAM_GRAD_GROUPS",
    )
    defaults = {name: getattr(ln, name) for name in settings}
    parser = argparse.ArgumentParser(description="Sweep the launch constants of the LayerNorm / RMSNorm kernels.")
    parser.add_argument(
        "--sweep",
        default="fwd,bwd,param,sum",
        help="comma-separated: fwd, bwd, param (dw / db of wide rows), sum (partial sums)",
    )
    parser.add_argument("widths", nargs="*", type=int, help="only the benchmark shapes of these row widths")
    args = parser.parse_args()
    sweeps = set(args.sweep.split(","))
    shapes = [(m, d) for m, d in GPU_SHAPES if not args.widths or d in args.widths]
    for (m, d), dtype, kind in itertools.product(shapes, (torch.bfloat16, torch.float32), ("layer", "rms")):
        rms = kind == "rms"
        x = torch.randn(m, d, device="cuda", dtype=dtype)
        w = torch.randn(d, device="cuda", dtype=dtype)
        b = None if rms else torch.randn(d, device="cuda", dtype=dtype)
        dy = torch.randn_like(x)
        for tile, per_warp in itertools.product((2048, 4096, 8192, 16384), (256, 512, 1024)) if "fwd" in sweeps else ():
            ln.FORWARD_TILE, ln.FORWARD_PER_WARP = tile, per_warp
            forward = functools.partial(ln._forward, x, w, b, 1e-5, rms, x.dtype)
            report("fwd", kind, m, d, dtype, {"tile": tile, "per_warp": per_warp}, forward)
        _, mean, rstd = ln._forward(x, w, b, 1e-5, rms, x.dtype)
        looped = not ln.backward_config(d, m, x.device, dtype.itemsize, rms).single_pass
        for config in _backward_configs(looped) if "bwd" in sweeps else ():
            ln.BACKWARD_TILE, ln.BACKWARD_PER_WARP = config["tile"], config["per_warp"]
            ln.BACKWARD_PROGRAMS_PER_SM = config["per_sm"]
            ln.LOOPED_BYTES_PER_SM = config["per_sm"] * 2 * ln.BACKWARD_BLOCK_MAX * dtype.itemsize
            ln.LOOPED_BACKWARD_ROWS = config["looped_rows"]
            backward = functools.partial(ln._backward, dy, x, w, mean, rstd, rms, True, not rms)
            report("bwd", kind, m, d, dtype, config, backward)
        for name, value in defaults.items():
            setattr(ln, name, value)
        # the dw / db kernel of the looped backward: tile, warps, row groups
        for (block_m, block_d), warps, groups in PARAM_CONFIGS if "param" in sweeps and looped else ():
            ln.PARAM_GRAD_BLOCK_M, ln.PARAM_GRAD_BLOCK_D, ln.PARAM_GRAD_WARPS = block_m, block_d, warps
            ln.PARAM_GRAD_GROUPS = groups
            backward = functools.partial(ln._backward, dy, x, w, mean, rstd, rms, True, not rms)
            config = {"param_block_m": block_m, "param_block_d": block_d, "param_warps": warps, "param_groups": groups}
            report("bwd", kind, m, d, dtype, config, backward)
        for name, value in defaults.items():
            setattr(ln, name, value)
        # the partial-row sum after the default backward: (partial rows per step, columns per program)
        for sum_p, sum_d in SUM_CONFIGS if "sum" in sweeps else ():
            ln.SUM_BLOCK_P, ln.SUM_BLOCK_D = sum_p, sum_d
            backward = functools.partial(ln._backward, dy, x, w, mean, rstd, rms, True, not rms)
            report("bwd", kind, m, d, dtype, {"sum_block_p": sum_p, "sum_block_d": sum_d}, backward)
        for name, value in defaults.items():
            setattr(ln, name, value)


PARAM_CONFIGS = tuple(itertools.product(((8, 512), (16, 256), (32, 128)), (4, 8), (16, 32, 64, 128)))
SUM_CONFIGS = ((32, 128), (64, 64), (128, 32), (64, 32), (128, 16), (256, 16))


def _backward_configs(looped: bool):
    """Single-pass rows: tile x elements per warp x programs per SM. Looped rows (too wide for one
    pass), where tile and elements per warp do not apply: programs per SM x rows per chunk."""
    if looped:
        grid = itertools.product((ln.BACKWARD_TILE,), (ln.BACKWARD_PER_WARP,), (1, 2, 4), (1, 2, 4, 8))
    else:
        grid = itertools.product((2048, 4096, 8192), (256, 512), (1, 2, 4), (ln.LOOPED_BACKWARD_ROWS,))
    return [dict(zip(("tile", "per_warp", "per_sm", "looped_rows"), values, strict=True)) for values in grid]


if __name__ == "__main__":
    main()

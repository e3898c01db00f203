"""Sweep the launch settings of the LayerNorm / RMSNorm kernels (fastlm.ops.layer_norm.NormConfig):
row-tile size, elements per warp, backward grid, looped-backward rows per chunk, the wide-row dw / db
kernel and the dw / db sums (inside the backward's launch or in a separate kernel).

The benchmark shapes of `fastlm bench norms`, bf16 and fp32, each configuration passed to the
launchers (no module state changes). Prints one JSON line per configuration with the median ms and
the GB/s of the minimum-bytes model, then, on stderr, per sweep the configuration with the best
geometric mean of GB/s over the shapes it ran (the dw / db sums: per row width), as a NormConfig
expression for `norm_config`'s table.
Usage: python benchmarks/tune_norms.py [--sweep fwd,bwd,param,sum] [--shapes 2048,768 ...] [--dtypes bf16]
       [--graph] [WIDTH ...] > tune_norms.jsonl
(only the shapes of those widths; only the named sweeps; --shapes: rows,width pairs instead of the
benchmark's, e.g. a model's tokens per step and d_model)
"""

import argparse
import collections
import dataclasses
import functools
import itertools
import json
import math
import sys

import torch
import triton.testing

from fastlm.bench.norms import GPU_SHAPES, norm_bytes
from fastlm.ops import layer_norm as ln
from fastlm.ops.common import device_arch, multiprocessors

PARAM_CONFIGS = tuple(itertools.product(((8, 512), (16, 256), (32, 128)), (4, 8), (16, 32, 64, 128)))
FUSED_SUM_CONFIGS = tuple(itertools.product((4, 8, 16, 32), (64, 128, 256, 512, 1024)))
SEPARATE_SUM_CONFIGS = ((32, 128), (64, 64), (128, 32), (64, 32), (128, 16), (256, 16))


def report(stage, kind, m, d, dtype, settings, fn, graph: bool) -> float | None:
    """Time ``fn``, print its record, return its GB/s (None when it does not compile). ``graph``:
    replayed as a CUDA graph (no launch cost, inputs left in L2 as a model's previous kernel
    leaves them), what steadies the few-microsecond kernels of a model's rows; else do_bench's
    median, with L2 flushed before each call."""
    nbytes = norm_bytes(m, d, dtype.itemsize, kind, stage)
    try:
        if graph:
            fn()  # compile outside the capture
            ms = triton.testing.do_bench_cudagraph(fn, rep=100, return_mode="median")
        else:
            ms = triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")
        result = {"ms": ms, "gbps": nbytes / ms / 1e6, "graph": graph}
    except Exception as error:  # a configuration that does not compile (registers, shared memory)
        result = {"error": str(error)[:200]}
    print(
        json.dumps({"stage": stage, "kind": kind, "m": m, "d": d, "dtype": str(dtype)[6:], **settings, **result}),
        flush=True,
    )
    return result.get("gbps")


def sweeps(base: ln.NormConfig, looped: bool, dtype: torch.dtype, chosen: set[str]):
    """(sweep, stage, settings as recorded, config) per configuration to time for one shape."""
    for tile, per_warp in itertools.product((2048, 4096, 8192, 16384), (256, 512, 1024)) if "fwd" in chosen else ():
        yield (
            "fwd",
            "fwd",
            {"tile": tile, "per_warp": per_warp},
            dataclasses.replace(base, forward_tile=tile, forward_per_warp=per_warp),
        )
    for settings in _backward_settings(base, looped) if "bwd" in chosen else ():
        yield (
            "bwd",
            "bwd",
            settings,
            dataclasses.replace(
                base,
                backward_tile=settings["tile"],
                backward_per_warp=settings["per_warp"],
                backward_programs_per_sm=settings["per_sm"],
                looped_bytes_per_sm=settings["per_sm"] * 2 * base.backward_block_max * dtype.itemsize,
                looped_backward_rows=settings["looped_rows"],
            ),
        )
    # the dw / db kernel of the looped backward: tile, warps, row groups
    for (block_m, block_d), warps, groups in PARAM_CONFIGS if "param" in chosen and looped else ():
        settings = {"param_block_m": block_m, "param_block_d": block_d, "param_warps": warps, "param_groups": groups}
        yield (
            "param",
            "bwd",
            settings,
            dataclasses.replace(
                base,
                param_grad_block_m=block_m,
                param_grad_block_d=block_d,
                param_grad_warps=warps,
                param_grad_groups=groups,
            ),
        )
    # the dw / db sums of single-pass rows, inside the backward's launch at every width (partial rows
    # per group, columns per step) or in the separate kernel (partial rows, columns per step): which
    # is faster at each width sets fused_sum_max_d
    for group, block_d in FUSED_SUM_CONFIGS if "sum" in chosen and not looped else ():
        settings = {"fused_sum": True, "sum_group": group, "sum_block_d": block_d}
        yield (
            "sum",
            "bwd",
            settings,
            dataclasses.replace(base, fused_sum_max_d=1 << 30, fused_sum_group=group, fused_sum_block_d=block_d),
        )
    for block_p, block_d in SEPARATE_SUM_CONFIGS if "sum" in chosen and not looped else ():
        settings = {"fused_sum": False, "sum_block_p": block_p, "sum_block_d": block_d}
        yield (
            "sum",
            "bwd",
            settings,
            dataclasses.replace(base, fused_sum_max_d=0, sum_block_p=block_p, sum_block_d=block_d),
        )


def _backward_settings(base: ln.NormConfig, looped: bool) -> list[dict]:
    """Single-pass rows: tile x elements per warp x programs per SM. Looped rows (too wide for one
    pass), where tile and elements per warp do not apply: programs per SM x rows per chunk."""
    if looped:
        grid = itertools.product((base.backward_tile,), (base.backward_per_warp,), (1, 2, 4), (1, 2, 4, 8))
    else:
        grid = itertools.product((2048, 4096, 8192), (256, 512), (1, 2, 4), (base.looped_backward_rows,))
    return [dict(zip(("tile", "per_warp", "per_sm", "looped_rows"), values, strict=True)) for values in grid]


def main():
    parser = argparse.ArgumentParser(description="Sweep the launch settings of the LayerNorm / RMSNorm kernels.")
    parser.add_argument(
        "--sweep",
        default="fwd,bwd,param,sum",
        help="comma-separated: fwd, bwd, param (dw / db of wide rows), sum (dw / db sums in the backward)",
    )
    parser.add_argument(
        "--shapes", nargs="+", default=None, help="rows,width pairs to time (default: the shapes of fastlm bench norms)"
    )
    parser.add_argument("--dtypes", default="bf16,fp32", help="comma list of bf16, fp32 (default: %(default)s)")
    parser.add_argument("--graph", action="store_true", help="time CUDA-graph replays (see report)")
    parser.add_argument("widths", nargs="*", type=int, help="only the benchmark shapes of these row widths")
    args = parser.parse_args()
    chosen = set(args.sweep.split(","))
    device = torch.device("cuda")
    base = ln.norm_config(device_arch(device))
    shapes = [tuple(int(x) for x in shape.split(",")) for shape in args.shapes] if args.shapes else GPU_SHAPES
    shapes = [(m, d) for m, d in shapes if not args.widths or d in args.widths]
    dtypes = [{"bf16": torch.bfloat16, "fp32": torch.float32}[name] for name in args.dtypes.split(",")]
    # (sweep, config) -> log GB/s per shape that ran it; sweeps of looped rows summarized apart
    log_gbps = collections.defaultdict(list)
    for (m, d), dtype, kind in itertools.product(shapes, dtypes, ("layer", "rms")):
        rms = kind == "rms"
        x = torch.randn(m, d, device=device, dtype=dtype)
        w = torch.randn(d, device=device, dtype=dtype)
        b = None if rms else torch.randn(d, device=device, dtype=dtype)
        dy = torch.randn_like(x)
        _, mean, rstd = ln._forward(x, w, b, 1e-5, rms, x.dtype)
        tiles, _ = ln.backward_tiles(base, d, m, dtype.itemsize, rms, multiprocessors(device.index or 0))
        looped = not tiles.single_pass
        for sweep, stage, settings, config in sweeps(base, looped, dtype, chosen):
            if stage == "fwd":
                fn = functools.partial(ln._forward, x, w, b, 1e-5, rms, x.dtype, config=config)
            else:
                fn = functools.partial(ln._backward, dy, x, w, mean, rstd, rms, True, not rms, config=config)
            gbps = report(stage, kind, m, d, dtype, settings, fn, args.graph)
            if sweep == "sum":  # (fused or not: per width)
                name = f"sum at width {d}"
            else:
                name = f"{sweep} (looped rows)" if looped and stage == "bwd" else sweep
            log_gbps[name, config].append(math.log(gbps) if gbps else -math.inf)
    for sweep in sorted({sweep for sweep, _ in log_gbps}):
        candidates = {config: logs for (name, config), logs in log_gbps.items() if name == sweep}
        best = max(candidates, key=lambda config: sum(candidates[config]))
        print(f"# best {sweep}: {best!r}", file=sys.stderr)


if __name__ == "__main__":
    main()

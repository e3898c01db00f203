"""Sweep blocks, warps and the fused grid of the cross-entropy kernels on the GPU.

B=4096, bf16, through the launchers with explicit `XentConfig`s. Prints one JSON line per
configuration with the median ms and the GB/s of the kernel's cost-model bytes, then (on stderr)
the configuration with the best geometric mean over the vocabularies, as a Python expression:
the sm90 entry of fastlm/ops/cross_entropy/config.py's table comes from these runs.
Usage: python benchmarks/tune_xent.py [--kernels forward,backward,fused] > tune.jsonl
"""

import argparse
import dataclasses
import functools
import itertools
import json
import math
import sys

import torch
import triton.testing

from fastlm.ops import cross_entropy as ce
from fastlm.ops.common import cdiv, device_arch, multiprocessors

BATCH = 4096
VOCABS = (32000, 50264, 128256)


def report(kernel, vocab, settings, fn, nbytes):
    """Time ``fn``, print its record, return the median ms (inf when it does not compile)."""
    try:
        ms = triton.testing.do_bench(fn, warmup=50, rep=200, return_mode="median")
        result = {"ms": ms, "gbps": nbytes / ms / 1e6}
    except Exception as error:  # a configuration that does not compile (registers, shared memory)
        ms, result = math.inf, {"error": str(error)[:200]}
    print(json.dumps({"kernel": kernel, "vocab": vocab, **settings, **result}), flush=True)
    return ms


def main():
    parser = argparse.ArgumentParser(description="Sweep the cross-entropy kernels' launch settings.")
    parser.add_argument("--kernels", default="forward,backward,fused", help="comma list (default: %(default)s)")
    kernels = set(parser.parse_args().kernels.split(","))
    device = torch.device("cuda")
    sms = multiprocessors(0)
    base = ce.cross_entropy_config(device_arch(device), torch.bfloat16, max(VOCABS))
    # per kernel: a candidate's config fields -> its ms at each vocabulary
    times: dict[str, dict[tuple, list[float]]] = {"forward": {}, "backward": {}, "fused": {}}
    for vocab in VOCABS:
        logits = torch.randn(BATCH, vocab, device="cuda", dtype=torch.bfloat16)
        targets = torch.randint(0, vocab, (BATCH,), device="cuda")
        _, lse = ce._forward(logits, targets, -100, 0.0, 0.0, base)
        ones = torch.ones(BATCH, device="cuda")
        row_bytes = 2 * BATCH * vocab
        for block, warps in itertools.product((4096, 8192, 16384), (4, 8)) if "forward" in kernels else ():
            config = dataclasses.replace(base, forward_block=block, forward_warps=warps)
            forward = functools.partial(ce._forward, logits, targets, -100, 0.0, 0.0, config)
            ms = report("forward", vocab, {"block": block, "warps": warps}, forward, row_bytes)
            times["forward"].setdefault((("forward_block", block), ("forward_warps", warps)), []).append(ms)
        for block, warps in itertools.product((2048, 4096, 8192), (4, 8)) if "backward" in kernels else ():
            config = dataclasses.replace(base, backward_block=block, backward_warps=warps)
            backward = functools.partial(ce._backward, logits, targets, lse, ones, -100, 0.0, 0.0, config)
            ms = report("backward", vocab, {"block": block, "warps": warps}, backward, 2 * row_bytes)
            times["backward"].setdefault((("backward_block", block), ("backward_warps", warps)), []).append(ms)
        # programs per SM; cdiv(BATCH, sms): one program per row (not persistent)
        fused_grid = itertools.product((4096, 8192, 16384), (4, 8, 16), (1, 2, 4, cdiv(BATCH, sms)))
        for block, warps, per_sm in fused_grid if "fused" in kernels else ():
            config = dataclasses.replace(base, fused_block=block, fused_warps=warps, fused_programs_per_sm=per_sm)
            fused = functools.partial(ce._fused, logits, targets, None, -100, 0.0, 0.0, False, None, config)
            settings = {"block": block, "warps": warps, "per_sm": per_sm, "programs": min(BATCH, per_sm * sms)}
            ms = report("fused", vocab, settings, fused, 2 * row_bytes)
            key = (("fused_block", block), ("fused_warps", warps), ("fused_programs_per_sm", per_sm))
            times["fused"].setdefault(key, []).append(ms)
    best = {}
    for candidates in (candidates for candidates in times.values() if candidates):
        fields = min(candidates, key=lambda key: math.fsum(math.log(ms) for ms in candidates[key]))
        best.update(fields)
    print(f"best: {dataclasses.replace(base, **best)!r}", file=sys.stderr)


if __name__ == "__main__":
    main()

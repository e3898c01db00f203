"""Sweep tile sizes, warps and (fused) grid sizes of the cross-entropy kernels on the GPU.

B=4096, bf16. Prints one JSON line per configuration with the median ms and the GB/s of the
kernel's cost-model bytes; the constants at the top of fastlm/ops/cross_entropy.py's launchers
are set from these runs. Usage: python benchmarks/tune_xent.py > tune.jsonl
"""

import itertools
import json

import torch
import triton
import triton.testing

from fastlm.ops import cross_entropy as ce

BATCH = 4096
VOCABS = (32000, 50264, 128256)


def report(kernel, vocab, config, fn, nbytes):
    try:
        ms = triton.testing.do_bench(fn, warmup=50, rep=200, return_mode="median")
        result = {"ms": ms, "gbps": nbytes / ms / 1e6}
    except Exception as error:  # a configuration that does not compile (registers, shared memory)
        result = {"error": str(error)[:200]}
    print(json.dumps({"kernel": kernel, "vocab": vocab, **config, **result}), flush=True)


def main():
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for vocab in VOCABS:
        logits = torch.randn(BATCH, vocab, device="cuda", dtype=torch.bfloat16)
        targets = torch.randint(0, vocab, (BATCH,), device="cuda")
        losses, lse = torch.empty(BATCH, device="cuda"), torch.empty(BATCH, device="cuda")
        grad, ones = torch.empty_like(logits), torch.ones(BATCH, device="cuda")
        row_bytes = 2 * BATCH * vocab
        flags = dict(HAS_SMOOTHING=False, HAS_Z_LOSS=False)
        for block, warps in itertools.product((4096, 8192, 16384), (4, 8)):
            config = dict(BLOCK_V=block, num_warps=warps, **flags)
            report(
                "forward",
                vocab,
                {"block": block, "warps": warps},
                lambda: ce._cross_entropy_forward_kernel[(BATCH,)](
                    logits, vocab, 1, targets, 1, losses, lse, vocab, -100, 0.0, 0.0, **config
                ),
                row_bytes,
            )
        for block, warps in itertools.product((2048, 4096, 8192), (4, 8)):
            config = dict(BLOCK_V=block, num_warps=warps, **flags)
            grid = (BATCH, triton.cdiv(vocab, block))
            report(
                "backward",
                vocab,
                {"block": block, "warps": warps},
                lambda: ce._cross_entropy_backward_kernel[grid](
                    logits, vocab, 1, targets, 1, lse, ones, 1, grad, vocab, -100, 0.0, 0.0, **config
                ),
                2 * row_bytes,
            )
        for block, warps, per_sm in itertools.product((4096, 8192, 16384), (4, 8, 16), (1, 2, 4, 0)):
            config = dict(BLOCK_V=block, num_warps=warps, HAS_ROW_SCALE=False, **flags)
            programs = BATCH if per_sm == 0 else per_sm * sms
            report(
                "fused",
                vocab,
                {"block": block, "warps": warps, "programs": programs},
                lambda: ce._cross_entropy_fused_kernel[(programs,)](
                    logits,
                    vocab,
                    1,
                    targets,
                    1,
                    None,
                    0,
                    losses,
                    grad,
                    vocab,
                    1,
                    BATCH,
                    vocab,
                    -100,
                    0.0,
                    0.0,
                    **config,
                ),
                2 * row_bytes,
            )


if __name__ == "__main__":
    main()

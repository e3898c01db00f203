"""`fastlm bench train`: the training loop of `fastlm train` once per kernel set, on the same data
from the same initial weights: wall time, steady-state tokens/s and MFU, and the loss curves.

The runs see the same batches in the same order, so their curves differ only by the kernels'
rounding and should lie on top of each other; the times show what the fused kernels buy in a
whole training run (data loading, optimizer, evaluation and logging included). Each run writes its
log and plot to OUT/<kernels>/ (one process, fresh runs, no checkpoints); the comparison adds
OUT/kernels.png (both curves) and appends one record per run to OUT/results/train_kernels.jsonl.
"""

from __future__ import annotations

import argparse
import sys
import timeit
from collections.abc import Sequence

from fastlm import train
from fastlm.data.prepare import DataError
from fastlm.harness.records import append_records, with_environment
from fastlm.train_log import loss_plot, read_log
from fastlm.train_options import UsageError

RESULTS_FILE = "train_kernels.jsonl"


def compare_kernels(args: argparse.Namespace, kernel_sets: Sequence[str]) -> list[dict]:
    """Train once per kernel set with the options of ``args`` (checked as `fastlm train` checks
    them); one record per run: kernels, wall_s, tokens_per_s, mfu, the last training and held-out
    losses, and the configuration. Raises UsageError / DataError like `train.train`."""
    if args.parallel != "none" or args.resume:
        raise UsageError("the kernel benchmark trains fresh runs in one process: it takes neither --parallel "
                               "nor --resume")  # fmt: skip
    # the options as given (--out, --checkpoint-every), before each run's overrides below hide them
    train.check_arguments(train.resolve_defaults(argparse.Namespace(**{**vars(args), "kernels": kernel_sets[0]})), 1)
    runs, records = {}, []
    for kernels in kernel_sets:
        fresh = {"kernels": kernels, "out": args.out / kernels, "checkpoint_every": 0, "overwrite": True}
        run_args = train.resolve_defaults(argparse.Namespace(**{**vars(args), **fresh}))
        train.check_arguments(run_args, world=1)
        start = timeit.default_timer()
        result = train.train(run_args)
        wall_s = timeit.default_timer() - start
        runs[kernels] = read_log(run_args.out / "log.jsonl")
        records.append(with_environment({
            "op": "train_kernels", "kernels": kernels, "wall_s": wall_s, "steps": result["step"],
            "tokens_per_s": result["tokens_per_s"], "mfu": result["mfu"], "peak_memory_gib": result["peak_memory_gib"],
            "final_loss": result["losses"][-1], "eval_loss": result["eval"][-1][1],
            "config": {k: str(v) if k in ("data", "out") else v for k, v in vars(run_args).items()},
        }))  # fmt: skip
    append_records(args.out / "results" / RESULTS_FILE, records)
    first = records[0]
    title = f"{first['config']['preset']} on {args.data.name}, each kernel set from the same start · {first['gpu']}"
    loss_plot(args.out / "kernels.png", runs, title)
    return records


def run(args: argparse.Namespace) -> int:
    """`fastlm bench train`: print one line per kernel set; 0, or 2 after a one-line error."""
    try:
        records = compare_kernels(args, args.kernels)
    except (UsageError, DataError) as error:
        print(f"{args.prog}: error: {error}", flush=True, file=sys.stderr)
        return 2
    for r in records:
        mfu = f", MFU {r['mfu']:.1%}" if r["mfu"] is not None else ""
        print(f"{r['kernels']} kernels: {r['wall_s']:.1f} s for {r['steps']} steps, {r['tokens_per_s']:,.0f} tokens/s"
              f"{mfu}; final training loss {r['final_loss']:.4f}, held-out loss {r['eval_loss']:.4f}",
              flush=True)  # fmt: skip
    print(f"wrote {args.out / 'kernels.png'} and {args.out / 'results' / RESULTS_FILE}", flush=True)
    return 0

"""Collect runs of `fastlm train`: a table of their throughput and losses, how far each loss curve
lies from the first run's, one plot of all curves, and (with --results) one record per run.

    python benchmarks/train_records.py runs/1gpu runs/2gpu-ddp runs/2gpu-fsdp \
        --plot benchmarks/reports/train_loss.png --results benchmarks/results/train.jsonl

A run is an OUT folder of `fastlm train` (its run.json and log.jsonl). The curve difference compares
per-step training losses (log every step to have them all) with the first run's, step by step:
`max rel diff` is the largest |loss - reference| / reference over the steps both have, `last-10 rel
diff` the same for the mean of the last 10 steps, the number that "agree within 1%" speaks of. A
record is run.json without its per-step losses (log.jsonl keeps them), plus the run's folder and
the tokens/s of each log interval.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from fastlm.train.log import loss_plot, read_log
from fastlm.utils.records import append_records


def _load(out: Path) -> dict:
    run = json.loads((out / "run.json").read_text())
    if run.get("result") is None:
        raise SystemExit(f"{out}/run.json has no result: the run did not finish")
    return run


def _tail_mean(losses: list[float], n: int = 10) -> float:
    return sum(losses[-n:]) / len(losses[-n:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", type=Path, nargs="+", help="OUT folders of fastlm train; the first is the reference")
    parser.add_argument("--plot", type=Path, default=None, help="write every run's loss curves here (default: none)")
    parser.add_argument("--results", type=Path, default=None, help="append one record per run (default: none)")
    args = parser.parse_args()
    runs = {out: _load(out) for out in args.runs}
    reference = runs[args.runs[0]]["result"]["losses"]
    print(
        "| run | processes | parallel | kernels | steps | tokens/s | MFU | peak GiB | last-10 train loss | "
        "eval loss | max rel diff | last-10 rel diff |"
    )
    print("|" + " --- |" * 12)
    for out, run in runs.items():
        result, config = run["result"], run["config"]
        losses = result["losses"]
        common = min(len(losses), len(reference))
        max_diff = max(abs(a - b) / b for a, b in zip(losses[:common], reference[:common], strict=True))
        tail_diff = abs(_tail_mean(losses[:common]) - _tail_mean(reference[:common])) / _tail_mean(reference[:common])
        mfu = f"{result['mfu']:.1%}" if result["mfu"] is not None else "-"
        memory = f"{result['peak_memory_gib']:.2f}" if result["peak_memory_gib"] is not None else "-"
        print(
            f"| {out.name} | {run['world_size']} | {config['parallel']} | {config['kernels']} | {result['step']} | "
            f"{result['tokens_per_s']:,.0f} | {mfu} | {memory} | {_tail_mean(losses):.4f} | "
            f"{result['eval'][-1][1]:.4f} | {max_diff:.3%} | {tail_diff:.3%} |"
        )
    if args.plot:
        title = f"{len(runs)} run{'s' * (len(runs) > 1)} · {runs[args.runs[0]]['gpu']}"
        loss_plot(args.plot, {out.name: read_log(out / "log.jsonl") for out in runs}, title)
        print(f"wrote {args.plot}")
    if args.results:
        records = []
        for out, run in runs.items():
            result = {k: v for k, v in run["result"].items() if k != "losses"}
            result["last10_train_loss"] = _tail_mean(run["result"]["losses"])
            # the spread inside a run (the first interval pays for compilation)
            log = read_log(out / "log.jsonl")
            result["interval_tokens_per_s"] = [round(r["tokens_per_s"], 1) for r in log if "tokens_per_s" in r]
            records.append({**run, "result": result, "out": str(out)})
        append_records(args.results, records)
        print(f"appended {len(records)} record(s) to {args.results}")


if __name__ == "__main__":
    main()

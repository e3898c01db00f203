"""The scaling table of `benchmarks/train_run.sh PART=speed` records: each multi-process run's
tokens/s against the one-process run of its round and kernels, per (processes, parallel, kernels)
the median and range over rounds; one bar chart of the medians with the ranges as error bars.

    python benchmarks/train_scaling.py benchmarks/results/train.jsonl --sha ac4d06c \
        --md benchmarks/reports/train_scaling.md --plot benchmarks/reports/train_scaling.png

A run belongs to a round by its folder's name as train_run.sh writes it,
speed-<kernels>-r<round>-<processes><parallel> (speed-<kernels>-r<round>-1 for one process; the r
may be left out). The records of one table come from one machine start (one GPU; --sha names its
commits, several where one start compared commits in the same rounds; --after / --before pick one
start's runs where one commit ran on two), so its rows share their baselines' conditions.
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import re
import statistics
from collections import defaultdict
from pathlib import Path

from fastlm.utils.plots import save_figure
from fastlm.utils.records import read_records

RUN_NAME = re.compile(r"speed-(?P<kernels>\w+)-r?(?P<round>\w+)-(?P<procs>\d+)(?P<parallel>[\w-]*)$")


def scaling_rows(records: list[dict]) -> list[dict]:
    """One row per (processes, parallel, kernels): the ratios of its rounds to their one-process runs."""
    runs = {}
    for record in records:
        match = RUN_NAME.search(record["out"])
        if match:
            key = (match["kernels"], match["round"], int(match["procs"]), match["parallel"] or "none")
            if key in runs:  # two machine starts under one git sha, which --sha cannot tell apart
                raise SystemExit(f"two records of the run {record['out']}: one table takes one machine start's runs")
            runs[key] = record["result"]["tokens_per_s"]
    groups = defaultdict(list)
    for (kernels, round_, procs, parallel), tokens_per_s in runs.items():
        baseline = runs.get((kernels, round_, 1, "none"))
        if procs > 1 and baseline:
            groups[(procs, parallel, kernels)].append((tokens_per_s, tokens_per_s / baseline))
    one = defaultdict(list)
    for (kernels, _, procs, _), tokens_per_s in runs.items():
        if procs == 1:
            one[kernels].append(tokens_per_s)
    rows = [
        {"procs": 1, "parallel": "none", "kernels": k, "tokens_per_s": v, "ratios": [1.0] * len(v)}
        for k, v in sorted(one.items(), key=lambda item: item[0] != "torch")
    ]
    order = sorted(groups.items(), key=lambda item: (item[0][0], item[0][2] != "torch"))  # by GPUs, torch first
    for (procs, parallel, kernels), values in order:
        rows.append(
            {
                "procs": procs,
                "parallel": parallel,
                "kernels": kernels,
                "tokens_per_s": [v[0] for v in values],
                "ratios": [v[1] for v in values],
            }
        )
    return rows


def markdown(rows: list[dict], title: str, note: str = "") -> str:
    lines = [
        f"{title}\n",
        *([f"{note}\n"] if note else []),
        "| GPUs | parallel | kernels | rounds | tokens/s (median) | range | vs one GPU (median) | range |",
        "|" + " --- |" * 8,
    ]
    for row in rows:
        tps, ratios = row["tokens_per_s"], row["ratios"]
        spread = f"{min(ratios):.2f}-{max(ratios):.2f}x"
        lines.append(
            f"| {row['procs']} | {row['parallel']} | {row['kernels']} | {len(tps)} | {statistics.median(tps):,.0f} | "
            f"{min(tps):,.0f}-{max(tps):,.0f} | {statistics.median(ratios):.2f}x | {spread} |"
        )
    return "\n".join(lines) + "\n"


def plot(rows: list[dict], path: Path, title: str) -> Path:
    """Horizontal bars (one per multi-process row, top to bottom in the table's order) so that long
    labels stay readable; dotted lines at the ideal scaling of each process count."""
    import matplotlib.pyplot as plt

    multi = [row for row in rows if row["procs"] > 1]
    fig, ax = plt.subplots(figsize=(8, 1.2 + 0.35 * len(multi)))
    labels = [f"{row['procs']} GPUs {row['parallel']} ({row['kernels']})" for row in multi]
    medians = [statistics.median(row["ratios"]) for row in multi]
    low = [m - min(row["ratios"]) for m, row in zip(medians, multi, strict=True)]
    high = [max(row["ratios"]) - m for m, row in zip(medians, multi, strict=True)]
    colors = ["tab:blue" if row["kernels"] == "torch" else "tab:orange" for row in multi]
    positions = range(len(multi) - 1, -1, -1)
    ax.barh(positions, medians, xerr=[low, high], capsize=3, color=colors)
    for y, median, row in zip(positions, medians, multi, strict=True):  # past the range's bar
        ax.text(max(row["ratios"]) + 0.04, y, f"{median:.2f}x", va="center", fontsize=7)
    for procs in sorted({row["procs"] for row in multi}):
        ax.axvline(procs, color="gray", linestyle=":", linewidth=1)
    ax.set_yticks(list(positions), labels, fontsize=8)
    ax.set_xlabel("tokens/s vs one GPU (median, range)")
    ax.set_title(title.replace(" · git ", "\ngit "), fontsize=9)  # long sha lists on a line of their own
    return save_figure(fig, path, dpi=120)


def utc(text: str) -> dt.datetime:
    """An ISO date or time; one without a time zone is UTC, as the records' dates are."""
    when = dt.datetime.fromisoformat(text)
    return when if when.tzinfo else when.replace(tzinfo=dt.timezone.utc)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("records", type=Path, help="train.jsonl of train_run.sh / train_records.py")
    parser.add_argument(
        "--sha", required=True, help="the git sha of the records to take, or a comma list (one machine start's runs)"
    )
    parser.add_argument("--after", default="", help="only records dated from this ISO time on (UTC)")
    parser.add_argument("--before", default="", help="only records dated before this ISO time (UTC)")
    parser.add_argument("--md", type=Path, default=None, help="write the table here (default: print only)")
    parser.add_argument("--plot", type=Path, default=None, help="write the bar chart here (default: none)")
    parser.add_argument("--note", default="", help="a paragraph under the table's title (how the runs differ)")
    args = parser.parse_args()
    shas = args.sha.split(",")
    records = [r for r in read_records(args.records) if r.get("git_sha") in shas]
    if args.after or args.before:
        after, before = utc(args.after or "0001-01-01"), utc(args.before or "9999-12-31")
        records = [r for r in records if after <= utc(r["date"]) < before]
    if not records:
        raise SystemExit(f"no records of git {args.sha} in {args.records}")
    machines = sorted({(r["gpu"], r["torch"], r["triton"]) for r in records})
    if len(machines) != 1:
        raise SystemExit(
            f"records of git {args.sha} come from {len(machines)} setups ({machines}): one table takes one"
        )
    gpu, torch_version, triton_version = machines[0]
    title = f"fastlm train scaling · {gpu} · torch {torch_version}, Triton {triton_version} · git {args.sha}"
    rows = scaling_rows(records)
    table = markdown(rows, title, args.note)
    print(table)
    if args.plot:
        print(f"wrote {plot(rows, args.plot, title)}")
    if args.md:
        chart = f"\n![scaling]({os.path.relpath(args.plot, args.md.parent)})\n" if args.plot else ""
        args.md.write_text(table + chart)


if __name__ == "__main__":
    main()

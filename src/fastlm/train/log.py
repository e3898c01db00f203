"""The log of a training run: a line per log interval (above a progress bar on a terminal), the
same numbers as JSON lines in OUT/log.jsonl, and the loss curves as OUT/loss.png (a mixture of
experts also the load of its experts as OUT/experts.png).

A record of log.jsonl, one per log interval and one per evaluation that falls between them:
    step             optimizer steps done (skipped ones included)
    loss             mean training loss of the interval's steps (nats per token, over all ranks);
                     under --skip-non-finite of those not skipped, absent when all were; of a
                     mixture of experts the language model's, router_loss taken out
    router_loss      a mixture of experts: what its routers added to the loss, per forward
                     (--router-aux-coef x aux_loss)
    aux_loss         a mixture of experts: its blocks' mean load-balancing loss, per forward
                     (`fastlm.ops.moe.load_balancing_loss`; --experts-per-token when balanced)
    expert_load      a mixture of experts: per MoE block, the choices of its busiest expert over
                     the mean per expert in the interval (1 when balanced; E when one takes all)
    lr               the learning rate of the interval's last step
    grad_norm        global gradient norm of the interval's last step, before clipping (under
                     --skip-non-finite of its last step not skipped, absent when all were)
    skipped          under --skip-non-finite: the interval's steps whose loss or gradient norm was
                     not finite, which made no update
    tokens           tokens trained on so far (steps x global batch)
    tokens_per_s     over the interval, all ranks together; the first interval pays for compilation
    mfu              model FLOPs utilization per GPU (fastlm.analysis.model); null without a known GPU
    peak_memory_gib  rank 0's peak allocated CUDA memory since training began; null on CPU
    elapsed_s        since this process started training
    eval_loss        mean loss on the held-out windows, when evaluated at this step
    eval_accuracy    `fastlm train reward`: pairwise accuracy on the held-out rankings, when evaluated

The files of a run in OUT (RUN_FILES) belong to one run: a new run starts only in an OUT without
them, or with --overwrite, which moves them to OUT/previous-<time>-<suffix>/ (`set_aside`) and
deletes that folder once the new run has committed its first checkpoint (`discard_set_aside`): a
new run stopped before then leaves the old one whole.
"""

from __future__ import annotations

import json
import shutil
import statistics
import tempfile
import time
import uuid
from collections.abc import Mapping, Sequence
from pathlib import Path

import torch

from fastlm.model.config import ModelConfig
from fastlm.utils.progress import Progress, progress

RUN_FILES = ("log.jsonl", "run.json", "loss.png", "experts.png", "checkpoints")
SET_ASIDE_PREFIX = "previous-"


def run_files(out: Path, names: tuple[str, ...] = RUN_FILES) -> list[str]:
    """The ``names`` (a run's files) that exist in ``out``."""
    return [name for name in names if (Path(out) / name).exists()]


def set_aside(out: Path, names: tuple[str, ...] = RUN_FILES) -> Path | None:
    """Move the run files (``names``) of ``out`` into a new OUT/previous-* folder; returns it (None
    when there were none to move)."""
    names = run_files(out, names)
    if not names:
        return None
    aside = Path(tempfile.mkdtemp(prefix=f"{SET_ASIDE_PREFIX}{time.strftime('%Y%m%dT%H%M%S')}-", dir=out))
    for name in names:
        (Path(out) / name).rename(aside / name)
    return aside


def set_aside_runs(out: Path) -> list[Path]:
    """The folders of runs that --overwrite set aside in ``out``, oldest first."""
    return sorted(p for p in Path(out).glob(f"{SET_ASIDE_PREFIX}*") if p.is_dir()) if Path(out).is_dir() else []


def discard_set_aside(out: Path) -> None:
    """Delete the runs set aside in ``out``: the run that replaced them has a checkpoint (or ended)."""
    for folder in set_aside_runs(out):
        shutil.rmtree(folder)


def new_run_id() -> str:
    """A training run's id: its start time (UTC) and a random suffix."""
    return f"{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}-{uuid.uuid4().hex[:8]}"


def run_id(out: Path) -> str | None:
    """The run id that OUT/run.json records; None without one."""
    path = Path(out) / "run.json"
    return json.loads(path.read_text()).get("run_id") if path.exists() else None


def format_record(record: dict, steps: int) -> str:
    """The log line of a record: 'step 10/300 | loss 3.1416 | lr 6.00e-04 | ...'."""
    fields = [f"step {record['step']}/{steps}"]
    formats = (
        ("loss", "loss {:.4f}"),
        ("eval_loss", "eval loss {:.4f}"),
        ("eval_accuracy", "eval accuracy {:.1%}"),
        ("lr", "lr {:.2e}"),
        ("grad_norm", "grad norm {}"),
        ("aux_loss", "aux loss {:.3f}"),
        ("skipped", "{} skipped"),
        ("tokens_per_s", "{:,.0f} tokens/s"),
        ("mfu", "MFU {:.1%}"),
        ("peak_memory_gib", "peak memory {:.2f} GiB"),
    )
    shown = {key: value for key, value in record.items() if value is not None}
    if not record.get("skipped"):  # log.jsonl records the 0s of --skip-non-finite; the line omits them
        shown.pop("skipped", None)
    if "grad_norm" in shown:  # a vanishing norm shows as such, not as 0.000
        norm = shown["grad_norm"]
        shown["grad_norm"] = f"{norm:.2e}" if 0 < abs(norm) < 1e-3 else f"{norm:.3f}"
    fields += [text.format(shown[key]) for key, text in formats if key in shown]
    loads = [load for load in record.get("expert_load", ()) if load is not None]
    if loads:
        fields.append(f"busiest expert {max(loads):.2f}x the mean")
    return " | ".join(fields)


def read_log(path: Path) -> list[dict]:
    """The records of a log.jsonl; [] when it does not exist."""
    if not Path(path).exists():
        return []
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


class TrainLog:
    """Rank 0's log (``enabled``; every other rank's calls do nothing). A resumed run keeps the
    records up to its checkpoint's step and drops those that a stopped run wrote after it."""

    def __init__(self, path: Path, steps: int, start_step: int, enabled: bool) -> None:
        self.path, self.steps, self.start_step, self.enabled = Path(path), steps, start_step, enabled
        self._bar: Progress | None = None
        self._context = None

    def __enter__(self) -> TrainLog:
        if self.enabled:
            kept = [r for r in read_log(self.path) if r["step"] <= self.start_step] if self.start_step else []
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.path.write_text("".join(json.dumps(r) + "\n" for r in kept))
            self._context = progress("training", total=self.steps, completed=self.start_step)
            self._bar = self._context.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        if self._context is not None:
            self._context.__exit__(*exc)

    def advance(self) -> None:
        if self._bar is not None:
            self._bar.advance()

    def note(self, line: str) -> None:
        if self._bar is not None:
            self._bar.note(line)

    def write(self, record: dict) -> None:
        """Append ``record`` to log.jsonl and show its line."""
        if self._bar is not None:
            with self.path.open("a") as f:
                f.write(json.dumps(record) + "\n")
            self._bar.note(format_record(record, self.steps))


def loss_plot(path: Path, runs: Mapping[str, Sequence[dict]], title: str) -> Path:
    """Training loss (lines) and held-out loss (markers) per step of each named run's records."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from fastlm.utils.plots import save_figure

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for index, (name, records) in enumerate(runs.items()):
        color = f"C{index}"
        train = [(r["step"], r["loss"]) for r in records if "loss" in r]
        held_out = [(r["step"], r["eval_loss"]) for r in records if "eval_loss" in r]
        if train:
            ax.plot(*zip(*train, strict=True), color=color, linewidth=1, label=f"{name} train".strip())
        if held_out:
            label = f"{name} held-out".strip()
            ax.plot(*zip(*held_out, strict=True), color=color, marker="o", linestyle="--", label=label)
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats per token)")
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend()
    return save_figure(fig, Path(path), dpi=120)


def expert_load_plot(path: Path, records: Sequence[dict], title: str) -> Path | None:
    """Each MoE block's expert_load per step (the busiest expert over the mean); None (nothing
    drawn) without such records."""
    loads = [(r["step"], r["expert_load"]) for r in records if "expert_load" in r]
    if not loads:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from fastlm.utils.plots import save_figure

    fig, ax = plt.subplots(figsize=(8, 4.5))
    steps = [step for step, _ in loads]
    for block in range(len(loads[0][1])):
        ax.plot(steps, [load[block] for _, load in loads], linewidth=1, label=f"MoE block {block}")
    ax.axhline(1.0, color="gray", linestyle=":", linewidth=1)
    ax.set_xlabel("step")
    ax.set_ylabel("busiest expert's tokens / mean")
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    if len(loads[0][1]) <= 12:
        ax.legend(fontsize=8)
    return save_figure(fig, Path(path), dpi=120)


class Throughput:
    """Tokens/s, MFU and peak memory of log intervals, timed on the host between synchronizations."""

    def __init__(self, model_cfg: ModelConfig, world: int, device: torch.device) -> None:
        from fastlm.analysis.model import flops_per_token
        from fastlm.devices import spec_for_device_name

        self.device, self.world = device, world
        self.spec = spec_for_device_name(torch.cuda.get_device_name(device)) if device.type == "cuda" else None
        self.flops_per_token = flops_per_token(model_cfg, "train", seq_len=model_cfg.context_length)
        self.began = time.perf_counter()
        self.intervals: list[dict] = []
        self._start = self.began

    def start(self) -> None:
        self._start = time.perf_counter()

    def interval(self, tokens: int) -> dict:
        """The record fields of the interval since `start` that trained ``tokens`` tokens."""
        now = time.perf_counter()
        tokens_per_s = tokens / (now - self._start)
        mfu = None
        if self.spec is not None:
            mfu = self.flops_per_token * tokens_per_s / (self.world * self.spec.matmul_tflops * 1e12)
        memory = torch.cuda.max_memory_allocated(self.device) / 2**30 if self.device.type == "cuda" else None
        fields = {"tokens_per_s": tokens_per_s, "mfu": mfu, "peak_memory_gib": memory, "elapsed_s": now - self.began}
        self.intervals.append(fields)
        return fields

    def steady_state(self) -> dict:
        """Medians over the intervals after the first (which pays for compilation and warm-up), and
        the peak memory at the end."""
        steady = self.intervals[1:] or self.intervals
        if not steady:
            return {"tokens_per_s": None, "mfu": None, "peak_memory_gib": None}
        mfu = [i["mfu"] for i in steady if i["mfu"] is not None]
        return {
            "tokens_per_s": statistics.median(i["tokens_per_s"] for i in steady),
            "mfu": statistics.median(mfu) if mfu else None,
            "peak_memory_gib": steady[-1]["peak_memory_gib"],
        }

"""Profile steady-state steps of `fastlm train` (on every rank, under torchrun too), a diagnosis of
where a step's time goes: python3 benchmarks/profile_train_step.py TRAIN_ARGS...

After WAIT optimizer steps (compilation, warm-up; default 20), WARMUP steps (default 2) then ACTIVE
steps (default 3) are traced, counted by a global optimizer post-step hook. Every rank prints one
line of its GPU's timeline per step (`fastlm.bench.distributed.timeline.Timeline.usage`: compute,
communication, exposed communication, overlap, idle) and, with RESULTS=FILE, appends it as a
record; a rank whose GPU idles while the others communicate is the one the collectives wait for.
Rank 0 also prints its tables of device time per kernel and host time per op. Every rank writes its
trace to TRACE_DIR (default /tmp/fastlm-trace), for a trace viewer.
"""

import os
import sys
from pathlib import Path

from torch.autograd import DeviceType
from torch.optim.optimizer import register_optimizer_step_post_hook
from torch.profiler import ProfilerActivity, profile, schedule, tensorboard_trace_handler

from fastlm.bench.distributed.timeline import gpu_timeline
from fastlm.train import loop
from fastlm.utils.records import append_records, with_environment


def main(argv: list[str]) -> int:
    wait, warmup, active = (int(os.environ.get(k, d)) for k, d in (("WAIT", 20), ("WARMUP", 2), ("ACTIVE", 3)))
    trace_dir = os.environ.get("TRACE_DIR", "/tmp/fastlm-trace")
    rank = int(os.environ.get("RANK", "0"))
    profiler = profile(
        activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA],
        schedule=schedule(wait=wait, warmup=warmup, active=active, repeat=1),  # one trace, not one per cycle
        on_trace_ready=tensorboard_trace_handler(trace_dir, worker_name=f"rank{rank}"),
    )
    stepped = []  # the first optimizer that steps: ShardedOptimizer's inner one steps too

    def count_step(optimizer, *_) -> None:
        if not stepped:
            stepped.append(optimizer)
        if optimizer is stepped[0]:
            profiler.step()

    hook = register_optimizer_step_post_hook(count_step)
    try:
        with profiler:
            status = loop.main(argv)
    finally:
        hook.remove()
    events = profiler.profiler.kineto_results.events() if profiler.profiler else []
    if any(event.device_type() == DeviceType.CUDA for event in events):
        usage = gpu_timeline(events).usage(active)
        print(
            f"rank {rank}: per step {usage['span_ms']:.1f} ms of kernels' span: compute {usage['compute_ms']:.1f}, "
            f"communication {usage['comm_ms']:.1f} (exposed {usage['exposed_comm_ms']:.1f}, "
            f"overlap {usage['overlap'] or 0:.0%}), idle {usage['idle_ms']:.1f} ms",
            flush=True,
        )
        if os.environ.get("RESULTS"):
            record = {"op": "profile_train_step", "rank": rank, "argv": argv, "steps": active, **usage}
            append_records(Path(os.environ["RESULTS"]), [with_environment(record)])
    if rank == 0:
        averages = profiler.key_averages()
        print(f"{active} traced steps on rank 0")
        print(averages.table(sort_by="self_device_time_total", row_limit=25, max_name_column_width=60))
        print(averages.table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=60))
    return status


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""Profile steady-state steps of `fastlm train` (on every rank, under torchrun too), a diagnosis of
where a step's time goes: python3 benchmarks/profile_train_step.py TRAIN_ARGS...

After WAIT optimizer steps (compilation, warm-up; default 20), WARMUP steps (default 2) then ACTIVE
steps (default 3) are traced, counted by a global optimizer post-step hook. Rank 0 prints its table
of device time per kernel and of host time per op; every rank writes its trace to TRACE_DIR
(default /tmp/fastlm-trace), for a trace viewer.
"""

import os
import sys

from torch.optim.optimizer import register_optimizer_step_post_hook
from torch.profiler import ProfilerActivity, profile, schedule, tensorboard_trace_handler

from fastlm.train import loop


def main(argv: list[str]) -> int:
    wait, warmup, active = (int(os.environ.get(k, d)) for k, d in (("WAIT", 20), ("WARMUP", 2), ("ACTIVE", 3)))
    trace_dir = os.environ.get("TRACE_DIR", "/tmp/fastlm-trace")
    profiler = profile(
        activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA],
        schedule=schedule(wait=wait, warmup=warmup, active=active),
        on_trace_ready=tensorboard_trace_handler(trace_dir, worker_name=f"rank{os.environ.get('RANK', '0')}"),
    )
    hook = register_optimizer_step_post_hook(lambda *_: profiler.step())
    try:
        with profiler:
            status = loop.main(argv)
    finally:
        hook.remove()
    if os.environ.get("RANK", "0") == "0":
        events = profiler.key_averages()
        print(f"{active} traced steps on rank 0")
        print(events.table(sort_by="self_device_time_total", row_limit=25, max_name_column_width=60))
        print(events.table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=60))
    return status


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

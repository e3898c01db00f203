"""The distributed benchmarks (`fastlm bench allreduce`, `fastlm bench ddp`): all-reduce bandwidth,
the data-parallel step per gradient synchronization, its GPU timeline and report. The runtime they
measure is `fastlm.distributed`."""

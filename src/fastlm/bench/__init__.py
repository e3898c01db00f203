"""One module per benchmark: a `fastlm.harness.benchmark.Benchmark` (cases, implementations, a
measurement and a report section) that `fastlm.harness.runner` runs."""

"""What every measuring tool shares: timing, records, ceilings, tables, plots, model steps and the
benchmark runner. It sits below `bench`, `profile`, `analysis` and the distributed benchmarks, and
imports none of them."""

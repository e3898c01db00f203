"""The benchmark framework every measuring tool shares: timing, ceilings, model steps and the
benchmark runner (records, tables and plots are `fastlm.utils`'). It sits below `bench` and
`profile` and imports neither; training imports nothing of it."""

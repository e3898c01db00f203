"""Small helpers shared by training, the benchmarks and the command line: progress, plots,
records, tables, output folders and the one error class for a user's mistake. They import nothing
of the benchmark framework."""

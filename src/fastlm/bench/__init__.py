"""One benchmark harness for every op: timing, result records, ceilings, tables and plots."""

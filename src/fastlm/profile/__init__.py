"""Profiling helpers: what the compiler generates, where time and memory go."""

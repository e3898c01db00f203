"""Napkin math: FLOPs, bytes, arithmetic intensity and lower bounds on time, per op."""

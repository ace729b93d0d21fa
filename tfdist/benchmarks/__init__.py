"""Benchmarks: library functions that return rows; experiments/benchmark.py writes them out."""

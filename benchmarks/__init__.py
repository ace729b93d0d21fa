"""Benchmarks: library functions that return rows; benchmarks/__main__.py writes them out."""

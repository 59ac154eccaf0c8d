"""Microbenchmarks (pytest-benchmark) of the ops, every implementation side by side: ``pytest bench/micro``."""

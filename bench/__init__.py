"""Benchmark scripts, run as files (python bench/throughput.py); a package for imports and mypy."""

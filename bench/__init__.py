"""Benchmarks (not tests). Run them as modules from the repository root, e.g. `python -m bench.run --quick`."""

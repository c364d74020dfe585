"""Benchmarks: ``python -m rdkeras.bench <name> [--quick]``. Ratios are measured side by side in one run."""

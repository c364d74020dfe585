"""Helpers for tests and benchmarks that need a machine set up in a special way (network namespaces)."""

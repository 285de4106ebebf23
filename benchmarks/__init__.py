"""Benchmark scenarios, run by ``dataplane bench`` (not installed with the package)."""

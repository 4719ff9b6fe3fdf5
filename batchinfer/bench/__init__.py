"""Benchmarks: kernel microbenchmarks and end-to-end workloads."""

"""Benchmarks, each reachable as `jspec bench NAME`."""

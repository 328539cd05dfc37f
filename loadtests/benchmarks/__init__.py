"""Benchmarks and measurements: each prints a table and writes JSON (`--out`)."""

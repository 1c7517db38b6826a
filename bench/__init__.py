"""Benchmarks and the tools they need (the vLLM simulator lives in `bench.sim`)."""

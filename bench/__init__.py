"""The benchmarks: each `python -m bench.NAME` measures one part of the portal, here or on a lent
GPU, and records its own section of BENCHMARKS.md. May import any of the project; only tests import it."""

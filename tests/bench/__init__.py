"""Tests of the benchmarks: the trace simulator, bench.gpu and the device kit."""

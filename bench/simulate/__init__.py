"""`python -m bench.simulate`: the trace simulator as a benchmark, every policy on one synthetic
trace. A thin command line over scheduling.simulation, which holds the simulator itself."""

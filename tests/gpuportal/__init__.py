"""Tests of the project package: the wire contract, `up` and its stack, the command line, metrics
and outages, and the shape of the code itself (its import graph, its prose)."""

"""Tests of the data plane: replica processes (lifecycle, serving, the preemption barrier, the
arena, the KV pool, paged generation), node agents, adoption and failover pairs."""

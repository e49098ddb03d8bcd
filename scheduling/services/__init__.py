"""The control plane's write side: every change to the books (deploy, scale, sleep, wake, preempt,
failover, what nodes and replicas report) is a service here, taking locks in scheduling.locks's
one order. Layered without a cycle, `reports` on top; only gpuportal.wire leads to the data plane."""

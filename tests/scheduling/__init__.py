"""Tests of the control plane: the API and /v1, placement and the ledger, fairness and preemption,
sleep and wake, crash loops and reconciling, the dashboard and the capacity planner."""

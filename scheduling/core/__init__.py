"""The control plane's decisions, pure: functions over plain dataclasses (a snapshot of GPUs in, a
plan out), with no database, no Django and no clock of their own, so that hypothesis can test
them and the capacity planner's simulator can run them. What writes the books is
scheduling.services; a test holds this package to importing no Django."""

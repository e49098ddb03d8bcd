"""The capacity planner's simulator, first a benchmark and now a product feature: the portal's own
placement, fairness and memory code on a simulated clock. Pure: no ORM, no Django settings, no
Celery; `bench.simulate` is a command line over it and `scheduling.services.capacity` feeds it the
live portal's catalogue and recorded traffic."""

"""`manage.py plan` and `export_trace` (the capacity planner and recorded traffic on the command
line) and `record_restart` (the Event `up` records when one of its processes is started again)."""

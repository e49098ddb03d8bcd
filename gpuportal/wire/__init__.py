"""What the control plane (scheduling) and the data plane (inference) share, and nothing else:
Django-free, so a replica process (and the CLI) imports it without Django. The state machines
(states), the deployment settings (deployment_spec), the commands to node agents (commands) and
their calls back (control, node_reports, replies), the request-queue protocol in Redis
(requestqueue), the sizing formula (memory) and the figures replicas publish (kvstats)."""

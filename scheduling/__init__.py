"""The control plane: the books of nodes, GPUs, deployments and replicas (models, the ledger),
placement, fairness, the dashboard and the Celery tasks that act on them. It reaches the data
plane only through gpuportal.wire and never imports inference."""

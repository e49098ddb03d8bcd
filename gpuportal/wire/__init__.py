"""What the control plane (scheduling) and the data plane (inference) share, and nothing else:
Django-free, so a replica process imports it without Django. Today the request-queue
protocol in Redis (requestqueue) and the KV-pool figures replicas publish (kvstats)."""

"""The data plane: node agents, the replica processes they supervise and what runs inside them
(loaders, the KV block pool, batching, sleep and wake through host arenas). It reaches the control
plane only through gpuportal.wire and never imports scheduling."""

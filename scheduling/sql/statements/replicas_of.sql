-- A deployment's replicas as a delete stops them: (id, state, node name or None).
-- Parameter: the locked deployments' ids.
SELECT r.id, r.state, n.name FROM scheduling_replica r LEFT JOIN scheduling_node n ON n.id = r.node_id
WHERE r.deployment_id = ANY(%s)

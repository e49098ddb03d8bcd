-- The replicas of a batch of scale calls' deployments that count or may be stopped, newest
-- first. Not the gone ones: nothing here counts or stops them, and their rows pile up until
-- swept. {gone} is filled with the gone states (gpuportal.wire.states.GONE) when the statement is
-- read. Parameter: the locked deployments' ids.
SELECT r.deployment_id, r.id, r.state, r.role, n.name, r.host_bytes FROM scheduling_replica r
LEFT JOIN scheduling_node n ON n.id = r.node_id
WHERE r.deployment_id = ANY(%s) AND r.state NOT IN ({gone})
ORDER BY r.created_at DESC

-- What a request's admission needs of its deployment, in one round trip: its loader, whether a
-- replica is awake (or standing by) on a node, and whether one serves. Parameters: the awake
-- states, the serving state, the deployment's name.
SELECT d.loader,
       EXISTS (SELECT 1 FROM scheduling_replica r
               WHERE r.deployment_id = d.id AND r.state = ANY(%s) AND r.node_id IS NOT NULL),
       EXISTS (SELECT 1 FROM scheduling_replica r WHERE r.deployment_id = d.id AND r.state = %s)
FROM scheduling_deployment d
WHERE d.name = %s

-- Each scaled deployment's new count, for the whole batch in one statement.
-- Parameters: the time, the deployments' ids, their counts.
UPDATE scheduling_deployment d SET replicas_wanted = v.wanted, updated_at = %s
FROM unnest(%s::bigint[], %s::int[]) AS v(id, wanted) WHERE d.id = v.id

-- Several replicas moved to one state. The rows are locked first, in primary-key order (the
-- global lock order, scheduling.locks): an UPDATE alone locks them in whatever order its scan
-- meets them. A request's wait for a drain (wake_when_asleep) ends as the replica leaves
-- draining. Parameters: the state, the time, the draining state, the state again, the draining
-- state again, the replicas' ids.
UPDATE scheduling_replica r SET state = %s, updated_at = %s,
    wake_when_asleep = r.wake_when_asleep AND r.state = %s AND %s = %s
FROM (SELECT id FROM scheduling_replica WHERE id = ANY(%s) ORDER BY id FOR UPDATE) locked
WHERE r.id = locked.id

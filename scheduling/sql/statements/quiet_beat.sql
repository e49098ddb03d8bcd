-- The beat of a node whose agent runs nothing, recorded in one statement: its last heartbeat, where
-- the beat has nothing else to do. That is: the node is not offline (coming back is the full
-- beat's), the books hold no replica of it that has not ended (none to write off, nor a lost
-- command to look for), and its GPUs' figures already say what the beat's books would (no
-- over-commit; free: what NVML says, or on a virtual GPU all of it). Returns the node's id, or no
-- row: then the full beat runs (scheduling.services.nodes.heartbeat).
-- Parameters: %(now)s; %(name)s; %(offline)s, the offline status; %(ended)s, the ended states (an
-- array); %(free)s, NVML's free bytes by GPU index as a JSON object, or null.
UPDATE scheduling_node AS n SET last_heartbeat = %(now)s
WHERE n.name = %(name)s
  AND n.status <> %(offline)s
  AND NOT EXISTS (
      SELECT 1 FROM scheduling_replica AS r WHERE r.node_id = n.id AND r.state <> ALL (%(ended)s)
  )
  AND NOT EXISTS (
      SELECT 1 FROM scheduling_gpu AS g
      WHERE g.node_id = n.id
        AND (g.overcommit_bytes <> 0
             OR g.nvml_free_bytes IS DISTINCT FROM
                coalesce((%(free)s::jsonb ->> g.index::text)::bigint, g.total_bytes))
  )
RETURNING n.id

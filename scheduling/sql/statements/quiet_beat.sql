-- The beat of a node whose agent runs nothing, recorded in one statement: its last heartbeat, where
-- the beat has nothing else to do. That is: the node is not offline (coming back is the full
-- beat's), the books hold no replica of it that has not ended (none to write off, nor a lost
-- command to look for), and its GPUs' figures already say what the beat's books would: no
-- over-commit; other tenants' use within the tolerance of the recorded figure (as
-- scheduling.core.books.foreign_to_record judges it: past it, the full beat records the change);
-- the warm spare's slot as said; free: what NVML says, or on a virtual GPU all of it less other
-- tenants' use. Returns the node's id, or no row: then the full beat runs
-- (scheduling.services.nodes.heartbeat).
-- Parameters: %(now)s; %(name)s; %(offline)s, the offline status; %(ended)s, the ended states (an
-- array); %(free)s, %(foreign)s and %(spare)s, NVML's free bytes, other tenants' use (never
-- below 0) and the warm spares' slots by GPU index, each a JSON object or null (not said); %(floor)s and %(share)s, the
-- books' tolerance: its floor in bytes, and the share of a figure (1 in it) past which a change is
-- never noise (scheduling.core.books.tolerance).
UPDATE scheduling_node AS n SET last_heartbeat = %(now)s
WHERE n.name = %(name)s
  AND n.status <> %(offline)s
  AND NOT EXISTS (
      SELECT 1 FROM scheduling_replica AS r WHERE r.node_id = n.id AND r.state <> ALL (%(ended)s)
  )
  AND NOT EXISTS (
      SELECT 1
      FROM scheduling_gpu AS g
      CROSS JOIN LATERAL (
          SELECT (%(foreign)s::jsonb ->> g.index::text)::bigint AS seen
      ) AS f
      WHERE g.node_id = n.id
        AND (g.overcommit_bytes <> 0
             OR (f.seen IS NOT NULL AND f.seen <> g.foreign_bytes
                 AND (f.seen = 0
                      OR abs(f.seen - g.foreign_bytes) > greatest(%(floor)s, greatest(f.seen, g.foreign_bytes) / %(share)s)))
             OR (%(spare)s::jsonb IS NOT NULL
                 AND g.spare_bytes <> least(coalesce((%(spare)s::jsonb ->> g.index::text)::bigint, 0), g.foreign_bytes))
             OR g.nvml_free_bytes IS DISTINCT FROM
                coalesce((%(free)s::jsonb ->> g.index::text)::bigint, greatest(0, g.total_bytes - g.foreign_bytes)))
  )
RETURNING n.id

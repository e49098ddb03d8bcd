-- A block of Events as one JSON document that the server reads into rows: one short statement
-- whatever their number, which the server prepares once. {columns}, {selected} and {typed} are
-- filled from scheduling.events' column list when the statement is read. Parameter: the JSON
-- array of the Events.
INSERT INTO scheduling_event ({columns})
SELECT {selected} FROM jsonb_to_recordset(%s::jsonb) AS x({typed})

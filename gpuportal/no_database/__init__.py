"""A database backend for a process that has no database: a node agent not told DATABASE_URL.
Anything that would open a connection raises, naming why, rather than reach a default server."""

"""`manage.py up` (the whole portal on one machine), `agent` (a node agent) and `ensure_admin`
(the first admin): the project's commands, which start the stack's processes."""

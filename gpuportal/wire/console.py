"""What the portal's processes say to the operator watching `up`: one line for each deploy and
delete, each replica that comes to serve (a load or a wake done), falls asleep or fails, marked so
that `up`'s console shows it among the warnings and errors it shows (it hides other INFO lines
unless --verbose). Django-free: the control plane writes the mark, `up` looks for it."""

from __future__ import annotations

MARK = "[gpuportal]"

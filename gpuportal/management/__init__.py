"""Where Django finds the project's own management commands (in `commands`)."""

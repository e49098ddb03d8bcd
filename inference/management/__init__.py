"""Where Django finds the data plane's management commands (in `commands`)."""

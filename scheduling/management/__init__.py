"""Where Django finds the control plane's management commands (in `commands`)."""

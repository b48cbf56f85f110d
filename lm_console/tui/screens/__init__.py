"""Modal screens of the console: help, load shape, engine unavailable."""

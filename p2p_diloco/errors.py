"""Errors the command line reports as one line with exit code 2 (``ConfigError`` lives with the config)."""


class JoinError(RuntimeError):
    """This node could not reach any initial peer (or start its transport) within the allowed time."""

"""Errors the command line reports as one line with exit code 2 (``ConfigError`` lives with the config)."""


class JoinError(RuntimeError):
    """This node could not reach any initial peer (or start its transport) within the allowed time."""


def first_line(e: BaseException) -> str:
    """The first line of an exception's message (its type name if it has none): for one-line error reports."""
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__

"""Errors the command line reports as one line with exit code 2 (``ConfigError`` lives with the config), and
text helpers for such reports."""


class JoinError(RuntimeError):
    """This node could not reach any initial peer (or start its transport) within the allowed time."""


def first_line(e: BaseException) -> str:
    """The first line of an exception's message (its type name if it has none): for one-line error reports."""
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def printable(text: str) -> str:
    """``text`` safe to print on a terminal: control characters other than newline and tab shown as U+FFFD (a
    byte-level model may emit any byte, escape sequences included)."""
    return "".join(ch if ch in "\n\t" or ch.isprintable() else "\ufffd" for ch in text)

"""The embedded offline corpus: English text built from what ships with every CPython installation."""

from __future__ import annotations

import functools
import inspect
import re
import sysconfig
from pathlib import Path


# Pure-Python stdlib modules rich in English docstrings, present in every CPython (missing ones are skipped,
# e.g. after a module moved between versions). Paths relative to the stdlib folder, without ".py".
_DOC_MODULES = (
    "_pydecimal", "argparse", "asyncio/events", "asyncio/tasks", "collections/__init__", "configparser",
    "contextlib", "dataclasses", "datetime", "difflib", "doctest", "email/message", "enum", "fractions",
    "functools", "heapq", "http/server", "imaplib", "inspect", "ipaddress", "json/__init__",
    "logging/__init__", "logging/handlers", "mailbox", "numbers", "optparse", "pathlib", "pydoc", "queue",
    "random", "re/__init__", "shutil", "smtplib", "socket", "ssl", "statistics", "subprocess", "tarfile",
    "tempfile", "textwrap", "threading", "traceback", "typing", "unittest/case", "unittest/mock",
    "urllib/parse", "urllib/request", "xml/etree/ElementTree", "zipfile",
)
_TRIPLE_QUOTED = re.compile(r'"""(.*?)"""|\'\'\'(.*?)\'\'\'', re.S)
_MIN_DOCSTRING_CHARS = 200  # shorter strings are mostly one-liners and code fragments


@functools.cache
def embedded_documents() -> tuple[str, ...]:
    """The embedded corpus as documents: Python's help topics (``pydoc_data``), then long docstrings of the
    stdlib modules in ``_DOC_MODULES``. About 1 MB of English on CPython 3.11; identical on every machine with
    the same Python version (everything is iterated in sorted order). Takes ~0.1 s; cached in-process."""
    from pydoc_data.topics import topics

    docs = [topics[key] for key in sorted(topics)]
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    for module in sorted(_DOC_MODULES):
        path = stdlib / f"{module}.py"
        if path.is_file():
            docs.extend(_long_docstrings(path.read_text(encoding="utf-8")))
    return tuple(docs)


def _long_docstrings(source: str) -> list[str]:
    # a regex instead of ast.parse: 40x faster, and the few non-docstring triple-quoted strings are harmless text
    found = (inspect.cleandoc(a or b) for a, b in _TRIPLE_QUOTED.findall(source))
    return [s for s in found if len(s) >= _MIN_DOCSTRING_CHARS]


@functools.cache
def embedded_corpus() -> str:
    """The embedded corpus as one string: every document followed by a newline."""
    return "".join(d + "\n" for d in embedded_documents())

"""Offline corpora built from what ships with every CPython installation: no download, same text for the same Python.

- ``embedded`` (the demo's): about 1 MB of English: Python's help topics and long stdlib docstrings.
- ``stdlib`` (the convergence study's): about 10 MB: the help topics and the full source of the pure-Python
  standard library (code, comments and docstrings).
"""

from __future__ import annotations

import functools
import hashlib
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


# Folders some distributions strip or ship separately (the python.org Docker images delete tests; Debian also splits
# off idlelib, tkinter, lib2to3, distutils, ensurepip, venv): tests are always skipped; the rest count when present.
_SKIPPED_DIRS = frozenset({"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__"})
# Sources that describe one build rather than the language (paths, compiler flags), charmap tables, and the help
# topics' own source (its text is included once, as the topics themselves).
_SKIPPED_FILES = ("_sysconfigdata", "sitecustomize.py", "pydoc_data/topics.py", "encodings/")


@functools.cache
def stdlib_documents() -> tuple[str, ...]:
    """The ``stdlib`` corpus as documents: Python's help topics (sorted by key), then every pure-Python stdlib
    module's source, one document per file, ordered by the sha256 of its path so that any tail of the corpus (the
    held-out share) is a sample of all packages. 10.4 MB on CPython 3.11.7 (about 8 MB where a distribution split
    off idlelib, tkinter, lib2to3 and distutils); identical for the same CPython build. Takes ~0.5 s; cached."""
    from pydoc_data.topics import topics

    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = []
    for path in stdlib.rglob("*.py"):
        rel = path.relative_to(stdlib).as_posix()
        parts = rel.split("/")
        if _SKIPPED_DIRS.intersection(parts[:-1]) or parts[0].startswith("config-") or parts[-1].startswith(
                "test_") or any(rel.startswith(s) or parts[-1].startswith(s) for s in _SKIPPED_FILES):
            continue
        files.append((hashlib.sha256(rel.encode()).hexdigest(), path))
    sources = [path.read_text(encoding="utf-8", errors="replace") for _, path in sorted(files)]
    return tuple([topics[key] for key in sorted(topics)] + sources)

"""One metrics sink interface: records are flat dicts with namespaced keys (``train/loss``, ``outer/allreduce_s``)."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any


class MetricsSink:
    """Receives one record per event; the base class drops everything (the null sink)."""

    def log(self, record: dict[str, Any]) -> None:
        pass

    def close(self) -> None:
        pass


class JsonlSink(MetricsSink):
    """Appends one JSON line per record to ``path``, flushed at once so a crash loses nothing already logged."""

    def __init__(self, path: str | os.PathLike):
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        self._file = open(path, "a", buffering=1)

    def log(self, record: dict[str, Any]) -> None:
        self._file.write(json.dumps({"time": time.time(), **record}) + "\n")

    def close(self) -> None:
        if not self._file.closed:
            self._file.close()


def read_jsonl(path: str | os.PathLike) -> list[dict[str, Any]]:
    """Every complete record of a JSONL file (a torn last line, from a killed writer, is skipped)."""
    records = []
    if not Path(path).is_file():
        return records
    for line in Path(path).read_text().splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return records

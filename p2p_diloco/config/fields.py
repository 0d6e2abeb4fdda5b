"""The field helper every config section is declared with, and the error every bad value raises."""

from __future__ import annotations

from dataclasses import field
from typing import Any, Callable, Literal, Optional, Union

AUTO = "auto"
FloatOrAuto = Union[float, Literal["auto"]]
"""The type of a field whose value is a float, or "auto": derived from the run's other settings at start."""


class ConfigError(ValueError):
    """A bad configuration value; the message names the key and fits on one line."""


def _f(default: Any, help: str, unit: str = "", check: Optional[Callable[[Any], bool]] = None, rule: str = "",
       choices: tuple = (), shared: bool = False) -> Any:
    """A config field with its documentation and validation attached as metadata.

    ``shared``: a run setting, which every peer of a run must hold equal (published in the DHT; a joiner adopts the
    run's value or is refused, see :func:`first_difference`); otherwise a setting of this machine alone. A new field
    that changes what peers compute together (the model, the data, the math of a round) must be ``shared=True``.
    """
    meta = {"help": help, "unit": unit, "check": check, "rule": rule, "choices": choices, "shared": shared}
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata=meta)
    return field(default=default, metadata=meta)


def _positive(x) -> bool:
    return x is None or x > 0


def _non_negative(x) -> bool:
    return x is None or x >= 0

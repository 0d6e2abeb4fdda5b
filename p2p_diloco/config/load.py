"""Loading a config: TOML files and ``--section.key=value`` overrides coerced to each field's type and checked;
``--help`` text; the run settings (``shared`` fields) every peer of a run holds equal; TOML output."""

from __future__ import annotations

import dataclasses
import difflib
import json
import sys
import textwrap
import types
import typing
from pathlib import Path
from typing import Any, Collection, Optional

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on Python 3.10 only
    import tomli as tomllib

from p2p_diloco.config.fields import AUTO, ConfigError, FloatOrAuto
from p2p_diloco.config.sections import SECTIONS, Config


# ---------------------------------------------------------------------------------------------- value coercion

def _unwrap_optional(tp) -> tuple[Any, bool]:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1:
            return args[0], True
    return tp, False


def _type_name(tp) -> str:
    if tp == FloatOrAuto:
        return "float or 'auto'"
    base, optional = _unwrap_optional(tp)
    name = "list of strings" if typing.get_origin(base) is list else getattr(base, "__name__", str(base))
    return f"{name} or none" if optional else name


def _coerce(key: str, tp, value, from_text: bool):
    """Convert ``value`` (TOML-typed, or a string from the command line) to ``tp``; raise ConfigError otherwise."""
    base, optional = _unwrap_optional(tp)
    if isinstance(value, str) and optional and value.strip().lower() in ("none", "null", ""):
        return None  # TOML has no null: "none" stands for it in files too
    if value is None:
        if optional:
            return None
        raise ConfigError(f"{key}: expected {_type_name(tp)}, got none")
    bad = ConfigError(f"{key}: expected {_type_name(tp)}, got {value!r}")
    if base == FloatOrAuto:
        if isinstance(value, str) and value.strip().lower() == AUTO:
            return AUTO
        base = float
    if base is bool:
        if isinstance(value, bool):
            return value
        if from_text and isinstance(value, str) and value.lower() in ("true", "false", "1", "0", "yes", "no"):
            return value.lower() in ("true", "1", "yes")
        raise bad
    if base is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if from_text and isinstance(value, str):
            try:
                return int(value)
            except ValueError:
                raise bad from None
        raise bad
    if base is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if from_text and isinstance(value, str):
            try:
                return float(value)
            except ValueError:
                raise bad from None
        raise bad
    if base is str:
        if isinstance(value, str):
            return value
        raise bad
    if typing.get_origin(base) is list:
        if from_text and isinstance(value, str):
            value = [v.strip() for v in value.split(",") if v.strip()]
        if isinstance(value, list) and all(isinstance(v, str) for v in value):
            return list(value)
        raise bad
    raise bad  # pragma: no cover - every field type is handled above


def _set(cfg: Config, dotted: str, value, from_text: bool) -> None:
    section_name, _, key = dotted.partition(".")
    if section_name not in SECTIONS or not key:
        raise ConfigError(f"unknown config key '{dotted}'"
                          + _did_you_mean(dotted, f" (sections: {', '.join(SECTIONS)})"))
    section = getattr(cfg, section_name)
    fields = {f.name: f for f in dataclasses.fields(section)}
    if key not in fields:
        raise ConfigError(f"unknown config key '{dotted}'"
                          + _did_you_mean(dotted, f" (keys of [{section_name}]: {', '.join(fields)})"))
    f = fields[key]
    tp = typing.get_type_hints(type(section))[key]
    coerced = _coerce(dotted, tp, value, from_text)
    meta = f.metadata
    if meta.get("choices") and coerced is not None and coerced not in meta["choices"]:
        raise ConfigError(f"{dotted}: expected one of {', '.join(meta['choices'])}, got {coerced!r}")
    if meta.get("check") is not None and coerced is not None and not meta["check"](coerced):
        raise ConfigError(f"{dotted}: {meta['rule']}, got {coerced!r}")
    setattr(section, key, coerced)


def all_keys() -> list[str]:
    """Every dotted key, in section and field order."""
    return [f"{name}.{f.name}" for name, tp in SECTIONS.items() for f in dataclasses.fields(tp)]


def suggest_keys(text: str) -> list[str]:
    """The config keys ``text`` (a dotted key, or a bare name such as ``inner_steps``) most likely meant: a key
    spelt nearly the same (difflib), else the keys of that name in any section, else the closest name; [] if
    nothing is close."""
    text = text.replace("-", "_")
    keys = all_keys()
    close = difflib.get_close_matches(text, keys, n=1, cutoff=0.8)  # a typo: inner.lrr, modle.name
    if close:
        return close
    name = text.rpartition(".")[2]
    same_name = [k for k in keys if k.rpartition(".")[2] == name]  # the wrong section, or no section
    if same_name:
        return same_name
    names = difflib.get_close_matches(name, [k.rpartition(".")[2] for k in keys], n=1, cutoff=0.85)
    return [k for k in keys if k.rpartition(".")[2] in names]


def _did_you_mean(dotted: str, otherwise: str) -> str:
    suggestions = suggest_keys(dotted)
    return f": did you mean {' or '.join(suggestions)}?" if suggestions else otherwise


# ---------------------------------------------------------------------------------------------- public API

COMMAND_LINE = "the command line"
"""Where a key came from, in :func:`load_config`'s ``sources``, when a flag set it."""


def load_config(path: Optional[str | Path | list] = None, overrides: Optional[dict[str, str]] = None,
                defaults: Optional[dict[str, Any]] = None, given: Optional[set[str]] = None,
                sources: Optional[dict[str, str]] = None) -> Config:
    """Field defaults, then typed ``defaults`` (a subcommand's own), then the TOML file(s) at ``path`` (a later file
    wins over an earlier one), then ``overrides`` (strings from the command line): each layer wins over the ones
    before it. ``given``, if passed, receives the dotted keys that the files and overrides set; ``sources``, if passed,
    maps each of them to where it was set last (a file's path, or :data:`COMMAND_LINE`). An error in a file names
    the file."""
    cfg = Config()
    for dotted, value in (defaults or {}).items():
        _set(cfg, dotted, value, from_text=False)
    paths = [] if path is None else list(path) if isinstance(path, (list, tuple)) else [path]
    for one in paths:
        for dotted, value in _read_toml(Path(one)):
            try:
                _set(cfg, dotted, value, from_text=False)
            except ConfigError as e:
                raise ConfigError(f"{one}: {e}") from None
            _note(dotted, str(one), given, sources)
    for dotted, value in (overrides or {}).items():
        _set(cfg, dotted, value, from_text=True)
        _note(dotted, COMMAND_LINE, given, sources)
    _check_consistency(cfg)
    return cfg


def _note(dotted: str, source: str, given: Optional[set[str]], sources: Optional[dict[str, str]]) -> None:
    if given is not None:
        given.add(dotted)
    if sources is not None:
        sources[dotted] = source


def _read_toml(path: Path) -> list[tuple[str, Any]]:
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    try:
        data = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path}: invalid TOML: {e}") from None
    items = []
    for section_name, section in data.items():
        if not isinstance(section, dict):
            raise ConfigError(f"{path}: unknown config key '{section_name}' (put keys under a [section])"
                              if section_name not in SECTIONS else f"{path}: {section_name}: expected a table")
        items += [(f"{section_name}.{key}", value) for key, value in section.items()]
    return items


def _check_consistency(cfg: Config) -> None:
    if cfg.network.secret is not None and cfg.network.secret_file is not None:
        raise ConfigError("network.secret, network.secret_file: set one of them, not both")
    if cfg.averaging.min_group_size > cfg.averaging.target_group_size:
        raise ConfigError("averaging.min_group_size: must not exceed averaging.target_group_size")
    if cfg.averaging.request_timeout >= cfg.averaging.matchmaking_time:
        raise ConfigError("averaging.request_timeout: must be below averaging.matchmaking_time")
    d = cfg.diloco
    if d.min_inner_steps > d.inner_steps:
        raise ConfigError("diloco.min_inner_steps: must not exceed diloco.inner_steps")
    if d.outer_optimizer == "delayed_nesterov" and d.dn_delay is None:
        raise ConfigError("diloco.dn_delay: required with diloco.outer_optimizer=delayed_nesterov (the number of "
                          "peers you expect in a round)")
    if d.overlap == "eager" and d.outer_optimizer not in ("nesterov", "sgd"):
        raise ConfigError(f"diloco.overlap: eager needs an outer step linear in the average (nesterov or sgd), not "
                          f"diloco.outer_optimizer={d.outer_optimizer}")
    if d.overlap_steps and d.overlap != "delayed":
        raise ConfigError(f"diloco.overlap_steps: settling after {d.overlap_steps} inner steps needs "
                          f"diloco.overlap=delayed, not {d.overlap}")
    if d.dn_delay is not None and d.dn_c > 1 / d.dn_delay:
        raise ConfigError(f"diloco.dn_c: must be in [0, 1/dn_delay] = [0, {1 / d.dn_delay:g}], got {d.dn_c!r}")


def parse_overrides(args: list[str]) -> tuple[dict[str, str], list[str]]:
    """Split ``--section.key=value`` / ``--section.key value`` from other arguments."""
    overrides: dict[str, str] = {}
    rest: list[str] = []
    i = 0
    while i < len(args):
        arg = args[i]
        if arg.startswith("--") and "." in arg.split("=", 1)[0]:
            name, eq, value = arg[2:].partition("=")
            if not eq:
                if i + 1 >= len(args):
                    raise ConfigError(f"{name}: missing value")
                i += 1
                value = args[i]
            overrides[name.replace("-", "_")] = value
        else:
            rest.append(arg)
        i += 1
    return overrides, rest


COMMON_KEYS = ("model.name", "model.init_from", "data.dataset", "data.tokenizer", "inner.lr", "inner.batch_size",
               "diloco.inner_steps", "averaging.codec", "network.initial_peers", "network.host_maddrs",
               "network.announce_maddrs", "network.identity_path", "network.secret_file", "run.run_id", "run.name",
               "run.run_dir", "run.rounds", "run.device")
"""The keys a command's ``--help`` shows (``--help-all`` and ``p2p-diloco config list`` show every key)."""

TESTING_SECTIONS = ("fault",)
"""Sections for tests and benchmarks only: shown by ``--help-all`` and ``config list``, never by ``--help``."""


def describe(sections: Optional[list[str]] = None, defaults: Optional[dict[str, Any]] = None,
             keys: Optional[Collection[str]] = None) -> str:
    """Every key of ``sections`` (None: all) with its type, default (a subcommand's own ``defaults`` included), unit,
    whether it is a run setting (shared by every peer of a run; the others are machine settings) and help, for
    ``--help-all``. With ``keys``, only those, one line each (key, default and the help shortened), for ``--help``."""
    lines = []
    defaults = load_config(defaults=defaults)
    for section_name, section_type in SECTIONS.items():
        if sections is not None and section_name not in sections:
            continue
        if keys is None:
            lines.append(f"[{section_name}]  {section_type.__doc__.strip()}")
        hints = typing.get_type_hints(section_type)
        for f in dataclasses.fields(section_type):
            default = getattr(getattr(defaults, section_name), f.name)
            flag = f"  --{section_name}.{f.name}={_show(default)}"
            if keys is not None:
                if f"{section_name}.{f.name}" in keys:
                    lines.append(_one_line(flag, f.metadata["help"]))
                continue
            unit = f" [{f.metadata['unit']}]" if f.metadata.get("unit") else ""
            choices = f" (one of: {', '.join(f.metadata['choices'])})" if f.metadata.get("choices") else ""
            scope = "  run setting" if f.metadata.get("shared") else ""
            lines.append(f"{flag}  ({_type_name(hints[f.name])}){unit}{scope}")
            lines.append(f"      {f.metadata['help']}{choices}")
    return "\n".join(lines)


def _one_line(flag: str, help_text: str, width: int = 110) -> str:
    flag = flag.ljust(38) if len(flag) < 38 else flag + "  "
    return flag + textwrap.shorten(help_text, max(width - len(flag), 30), placeholder=" ...")


def _show(value) -> str:
    if value is None:
        return "none"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, list):
        return ",".join(value)
    return str(value)


# ---------------------------------------------------------------------------------------------- run vs machine

def shared_keys() -> list[str]:
    """Dotted keys of every run setting (``shared`` fields), in section and field order."""
    return [f"{name}.{f.name}" for name, tp in SECTIONS.items() for f in dataclasses.fields(tp)
            if f.metadata.get("shared")]


def shared_settings(cfg: Config) -> dict[str, Any]:
    """The run settings of ``cfg``: what every peer of the run must hold equal (JSON-able values)."""
    return {key: _get(cfg, key) for key in shared_keys()}


def _get(cfg: Config, dotted: str) -> Any:
    section, _, key = dotted.partition(".")
    value = getattr(getattr(cfg, section), key)
    return list(value) if isinstance(value, list) else value


def set_value(cfg: Config, dotted: str, value: Any) -> None:
    """Set one key of ``cfg`` from a typed value (as from TOML), validated as on load."""
    _set(cfg, dotted, value, from_text=False)


def copy_config(cfg: Config) -> Config:
    return dataclasses.replace(cfg, **{name: dataclasses.replace(getattr(cfg, name)) for name in SECTIONS})


def check_config(cfg: Config) -> None:
    """The checks across keys that :func:`load_config` makes (after changing a loaded config)."""
    _check_consistency(cfg)


def show_value(value: Any) -> str:
    return _show(value)


def dump_toml(cfg: Config) -> str:
    """The whole config as TOML that :func:`load_config` reads back to an equal Config (None is written "none")."""
    lines = []
    for section_name in SECTIONS:
        lines.append(f"[{section_name}]")
        for key, value in dataclasses.asdict(getattr(cfg, section_name)).items():
            lines.append(f"{key} = {_toml_value(value)}")
        lines.append("")
    return "\n".join(lines)


def _toml_value(value) -> str:
    if value is None:
        return '"none"'
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    return json.dumps(value)  # a JSON string is a valid TOML basic string


def config_from_dict(data: dict) -> Config:
    """The inverse of :meth:`Config.to_dict` (e.g. the config saved in a checkpoint), validated like a file."""
    flat = {f"{section}.{key}": value for section, values in data.items() for key, value in values.items()}
    return load_config(defaults=flat)

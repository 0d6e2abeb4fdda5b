"""Write the reference pages from the code: docs/reference/config.md from the config sections
(p2p_diloco/config/sections.py: every key with its type, unit, default, run or machine setting, allowed values and
help) and docs/reference/cli.md from the argparse parser of p2p_diloco/cli.py (every command, argument and flag).

Run it after changing a config field or a command:

    python tools/gen_reference.py            # rewrite both pages
    python tools/gen_reference.py --check    # exit 1, naming the stale pages, if they differ from the code

tests/test_docs.py fails while the committed pages differ from what this writes.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import types
import typing
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # the checkout's package, installed or not

from p2p_diloco.config import SECTIONS, FloatOrAuto, load_config, show_value  # noqa: E402

CONFIG_PAGE = ROOT / "docs" / "reference" / "config.md"
CLI_PAGE = ROOT / "docs" / "reference" / "cli.md"
COMMAND = "python tools/gen_reference.py"
GENERATED = f"<!-- Generated from the code by `{COMMAND}`: do not edit by hand. -->"


def command_defaults() -> dict[str, dict]:
    """The commands that start from defaults of their own, and those defaults (key -> value), as the parser holds
    them (``key_defaults`` of a command's parser)."""
    return {name: sub.key_defaults for name, _, sub in _commands(_parser()) if getattr(sub, "key_defaults", None)}


# ---------------------------------------------------------------------------------------------- markdown helpers

def _cell(text: str) -> str:
    """Text that stays inside one table cell, shown as written (``<peer id>`` is no HTML tag)."""
    return " ".join(str(text).split()).replace("|", "\\|").replace("<", "&lt;").replace(">", "&gt;")


def _code(text: str) -> str:
    text = str(text)
    return f"`` {text} ``" if "`" in text else f"`{text}`"


def _sentence(text: str) -> str:
    return text if text.endswith((".", "?", "!")) else text + "."


def _value(value) -> str:
    """A value as written on the command line (``none``, ``true``, comma-joined lists), in code."""
    if value == []:
        return "`[]` (empty)"
    if isinstance(value, str) and (not value or value != value.strip()):
        return _code(json.dumps(value, ensure_ascii=False))  # quoted: an empty string, or one whose spaces matter
    return _code(show_value(value))


def _type_name(tp) -> str:
    if tp == FloatOrAuto:
        return "float or `auto`"
    args = typing.get_args(tp)
    optional = typing.get_origin(tp) in (typing.Union, types.UnionType) and type(None) in args
    if optional:
        tp = next(a for a in args if a is not type(None))
    name = "list of strings" if typing.get_origin(tp) is list else getattr(tp, "__name__", str(tp))
    return f"{name} or `none`" if optional else name


# ---------------------------------------------------------------------------------------------- config.md

def config_reference() -> str:
    defaults = load_config()
    lines = ["# Configuration reference", "", GENERATED, "",
             "Every key can be set in a TOML file, under its `[section]` (`--config FILE`; repeat the flag to layer "
             "files, later files win), or on the command line as `--section.key=value`, which overrides the files. "
             "`none` unsets a key that allows it (in TOML: `\"none\"`); lists are comma-separated on the command "
             "line.", "",
             "**run** settings are the run's own: every peer of a run holds the same value; a peer that joins adopts "
             "the values the run published for the keys it did not set, and is refused when one it set differs. "
             "**machine** settings are this machine's alone. `p2p-diloco COMMAND --help` prints the same keys.", "",
             "Sections: " + " · ".join(f"[{name}](#{name})" for name in SECTIONS), ""]
    for name, section in SECTIONS.items():
        lines += [f"## {name}", "", " ".join(section.__doc__.split()), "",
                  "| key | type | default | setting | description |", "|---|---|---|---|---|"]
        hints = typing.get_type_hints(section)
        for f in dataclasses.fields(section):
            meta = f.metadata
            unit = f", {meta['unit']}" if meta.get("unit") else ""
            allowed = ""
            if meta.get("choices"):
                allowed = " One of: " + ", ".join(_code(c) for c in meta["choices"]) + "."
            elif meta.get("rule"):
                allowed = f" Allowed: {meta['rule']}."
            lines.append(f"| `{name}.{f.name}` | {_type_name(hints[f.name])}{_cell(unit)} | "
                         f"{_value(getattr(getattr(defaults, name), f.name))} | "
                         f"{'run' if meta.get('shared') else 'machine'} | {_cell(_sentence(meta['help']) + allowed)} |")
        lines.append("")
    lines += ["## Defaults of particular commands", "",
              "These commands start from other defaults for a few keys (files and flags still override them):", "",
              "| command | key | default |", "|---|---|---|"]
    for command, values in command_defaults().items():
        lines += [f"| `p2p-diloco {command}` | `{key}` | {_value(value)} |" for key, value in values.items()
                  if value != getattr(getattr(defaults, key.split(".")[0]), key.split(".")[1])]
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------------------------- cli.md

def _parser() -> argparse.ArgumentParser:
    from p2p_diloco import cli

    return cli._parser()


def _commands(parser: argparse.ArgumentParser) -> list[tuple[str, str, argparse.ArgumentParser]]:
    """(name, one-line help, parser) of each subcommand, in the order ``--help`` lists them."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            helps = {a.dest: a.help for a in action._choices_actions}
            return [(name, helps.get(name) or "", sub) for name, sub in action.choices.items()]
    return []


def _help(action: argparse.Action, prog: str) -> str:
    text = action.help or ""
    if "%" in text:  # argparse's own expansion: %(default)s and the like
        params = {k: v for k, v in vars(action).items() if v is not argparse.SUPPRESS}
        params.update(prog=prog, default=show_value(action.default))
        text = text % params
    return _cell(text)


def _argument(action: argparse.Action) -> str:
    if action.nargs == 0:
        return ""
    metavar = action.metavar or action.dest.upper()
    metavar = " ".join(metavar) if isinstance(metavar, tuple) else metavar
    if action.choices is not None and not action.metavar:
        metavar = "{" + ",".join(str(c) for c in action.choices) + "}"
    text = {"?": f"[{metavar}]", "*": f"[{metavar} ...]", "+": f"{metavar} [...]"}.get(action.nargs, metavar)
    kind = f" ({action.type.__name__})" if action.type in (int, float) else ""
    return _code(text) + kind


def _notes(action: argparse.Action) -> str:
    notes = []
    if action.required and action.option_strings:
        notes.append("required")
    if isinstance(action, argparse._AppendAction):
        notes.append("repeatable")
    if action.nargs == "?" and action.const is not None and action.option_strings:
        notes.append(f"alone: {_code(show_value(action.const))}")
    shown = not any(action.default is v for v in (None, False, argparse.SUPPRESS)) and action.nargs != 0
    if shown:
        notes.append(f"default {_code(show_value(action.default))}")
    return "; ".join(notes)


def _options_table(parser: argparse.ArgumentParser, positional: bool) -> list[str]:
    rows = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction) or action.help == argparse.SUPPRESS:
            continue
        if bool(action.option_strings) == positional:
            continue
        name = action.dest.upper() if positional and not action.metavar else (action.metavar or action.dest)
        names = ", ".join(f"`{o}`" for o in action.option_strings) if not positional else f"`{name}`"
        rows.append(f"| {names} | {_argument(action)} | {_notes(action)} | "
                    f"{_help(action, parser.prog)} |")
    if not rows:
        return []
    header = ["| argument | form | notes | description |"] if positional else ["| flag | value | notes | description |"]
    return header + ["|---|---|---|---|"] + rows + [""]


def _config_keys(sub: argparse.ArgumentParser) -> str:
    """Which config keys a command reads, as its parser holds them (cli_parser.CommandParser's ``key_sections``:
    None every section, [] none; ``key_exclude``: keys the command sets itself)."""
    sections = getattr(sub, "key_sections", [] if sub.get_default("reads_config") is False else None)
    if sections == []:
        return "Takes no config keys."
    if sections is None:
        text = "Config keys: every key of the [configuration reference](config.md)"
    else:
        text = "Config keys: those of " + ", ".join(f"[[{name}]](config.md#{name})" for name in sections)
    text += ", in `--config FILE` or as `--section.key=value`"
    excluded = getattr(sub, "key_exclude", ())
    if excluded:
        text += "; except " + ", ".join(f"`{key}`" for key in excluded) + ", which the command sets itself"
    return text + "."


def cli_reference() -> str:
    parser = _parser()
    commands = _commands(parser)
    lines = ["# Command-line reference", "", GENERATED, "", _cell(parser.description or ""), "",
             "```", f"{parser.prog} COMMAND [flags] [--config FILE ...] [--section.key=value ...]", "```", "",
             "Commands: " + " · ".join(f"[{name}](#{parser.prog}-{name})" for name, _, _ in commands), "",
             f"## {parser.prog}", ""] + _options_table(parser, positional=False)
    for name, summary, sub in commands:
        lines += [f"## {sub.prog}", "", _cell(sub.description or summary), ""]
        lines += _options_table(sub, positional=True) + _options_table(sub, positional=False)
        lines += [_config_keys(sub), ""]
    return "\n".join(lines).rstrip("\n") + "\n"


# ---------------------------------------------------------------------------------------------- main

def render() -> dict[Path, str]:
    """Each reference page and the text the code gives it now."""
    return {CONFIG_PAGE: config_reference(), CLI_PAGE: cli_reference()}


def main(argv: typing.Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description="Write docs/reference/config.md and cli.md from the code.")
    parser.add_argument("--check", action="store_true", help="write nothing; exit 1 if a page differs from the code")
    args = parser.parse_args(argv)
    stale = []
    for path, text in render().items():
        current = path.read_text() if path.exists() else None
        if current == text:
            continue
        stale.append(path.relative_to(ROOT))
        if not args.check:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
    if args.check and stale:
        print(f"stale: {', '.join(map(str, stale))}; regenerate with: {COMMAND}", file=sys.stderr)
        return 1
    for path in stale:
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

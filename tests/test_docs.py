"""What the project says about itself matches the code: the generated reference pages are current, the pages name
files that exist and link to pages and headings that exist, their config tables state the code's defaults, and
pyproject.toml declares every package p2p_diloco imports.

Which text counts as a repository path (:func:`path_problems`): the code of a page (inline code spans, and the
lines of fenced code blocks: commands, imports) is split on whitespace; each word, without surrounding quotes and punctuation, and without a trailing
``:LINE``, ``::test_name`` or ``#anchor``, names a file of the repository when
  * its first ``/``-separated part is a top-level entry of the repository (``p2p_diloco/...``, ``tests/...``,
    ``benchmarks/...``, ``docs/...``, ``peers/...``, ``bootstrap/...``, ``tools/...``, ``README.md``, ...): it must
    exist from the repository's root (a ``*`` pattern must match something);
  * it ends in ``.py`` and its first part is a subpackage of p2p_diloco (``train/outer.py``, as the pages name
    modules): it must exist under p2p_diloco/;
  * it is a bare ``NAME.py`` or ``NAME.md``: a file of that name must exist somewhere in the repository;
  * it is a dotted module name starting ``p2p_diloco.``: the module must exist (and a last part that is no module
    must be a top-level name of the module).
Words with placeholders (``<``, ``{``, ``…``, ``...``), absolute paths, URLs and flags are not paths. Run
folders (``runs/...``, ``run_dir/...``) and metric names (``train/loss``) match none of the rules.
"""

from __future__ import annotations

import ast
import difflib
import functools
import os
import importlib.metadata
import importlib.util
import re
import subprocess
import sys
import unicodedata
from pathlib import Path
from urllib.parse import unquote

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "p2p_diloco"
REGENERATE = "python tools/gen_reference.py"


def pages() -> list[Path]:
    """README.md, docs/**/*.md and benchmarks/**/*.md."""
    found = [ROOT / "README.md"] + sorted((ROOT / "docs").rglob("*.md")) + sorted((ROOT / "benchmarks").rglob("*.md"))
    return [p for p in found if p.is_file()]


@functools.lru_cache(maxsize=None)
def _generator():
    spec = importlib.util.spec_from_file_location("gen_reference", ROOT / "tools" / "gen_reference.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# ---------------------------------------------------------------------------------------------- markdown reading

FENCE = re.compile(r"^\s*(```|~~~)")


def prose_lines(text: str, fenced_ones: bool = False) -> list[tuple[int, str]]:
    """(line number, line) of the lines outside fenced code blocks (or, ``fenced_ones``, inside them)."""
    out, fenced = [], False
    for number, line in enumerate(text.splitlines(), 1):
        if FENCE.match(line):
            fenced = not fenced
        elif fenced == fenced_ones:
            out.append((number, line))
    return out


CODE_SPAN = re.compile(r"(`+)(.+?)\1")
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")


def code_spans(text: str) -> list[tuple[int, str]]:
    """(line, code) of the inline code spans and of the lines of fenced code blocks."""
    spans = [(n, m.group(2).strip()) for n, line in prose_lines(text) for m in CODE_SPAN.finditer(line)]
    return sorted(spans + prose_lines(text, fenced_ones=True))


REFERENCE_LINK = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*<?([^\s>]+)")


def links(text: str) -> list[tuple[int, str]]:
    """(line, target) of the Markdown links, images and link definitions outside code."""
    found = []
    for number, line in prose_lines(text):
        line = CODE_SPAN.sub("", line)
        found += [(number, m.group(1)) for m in LINK.finditer(line)]
        found += [(number, m.group(1)) for m in REFERENCE_LINK.finditer(line)]
    return found


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: its text, lower-case, without punctuation but - and _, spaces made -."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link's text only
    text = re.sub(r"<[^>]+>", "", text).strip().lower()  # and no HTML tags
    kept = "".join(c for c in text if c in "-_ " or unicodedata.category(c)[0] in "LNM")
    return kept.replace(" ", "-")


def anchors(text: str) -> set[str]:
    found, seen = set(), {}
    for _, line in prose_lines(text):
        heading = re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)
        if heading:
            base = slug(heading.group(1))
            found.add(f"{base}-{seen[base]}" if base in seen else base)
            seen[base] = seen.get(base, 0) + 1
        found.update(re.findall(r"<a\s+(?:name|id)=\"([^\"]+)\"", line))
    return found


# ---------------------------------------------------------------------------------------------- the path rule

def _tracked_top_level() -> set[str]:
    """The top-level entries git tracks (not run folders or build outputs lying in a checkout)."""
    try:
        names = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):  # not a git checkout
        return set()
    return {name.split("/")[0] for name in names.split()}


@functools.lru_cache(maxsize=None)
def _file_names() -> set[str]:
    """The names of the files of the checkout, outside hidden folders, run folders and build outputs."""
    names = set()
    for folder, dirs, files in os.walk(ROOT):
        dirs[:] = [d for d in dirs if not d.startswith(".") and d not in ("runs", "build", "dist", "__pycache__")
                   and not d.endswith(".egg-info")]
        names.update(files)
    return names


TOP_LEVEL = _tracked_top_level() | {"p2p_diloco", "tests", "benchmarks", "docs", "peers", "bootstrap", "tools"}
SUBPACKAGES = {p.name for p in PACKAGE.iterdir() if (p / "__init__.py").exists()}
PLACEHOLDER = re.compile(r"[<>{}…*?]|\.\.\.")


def _exists(base: Path, path: str) -> bool:
    if "*" in path:
        return any(base.glob(path))
    return (base / path).exists()


def _module_exists(dotted: str) -> bool:
    parts, path = dotted.split("."), ROOT
    for i, part in enumerate(parts):
        if (path / part).is_dir():
            path = path / part
            continue
        if (path / f"{part}.py").is_file():
            rest = parts[i + 1:]
            return not rest or (len(rest) == 1 and rest[0] in _top_level_names(path / f"{part}.py"))
        return i > 0 and len(parts) == i + 1 and parts[i] in _top_level_names(path / "__init__.py")
    return True


def _top_level_names(source: Path) -> set[str]:
    if not source.exists():
        return set()
    names = set()
    for node in ast.parse(source.read_text()).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names.update(t.id for t in targets if isinstance(t, ast.Name))
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
    return names


def missing_path(word: str) -> str | None:
    """Why ``word`` names a repository file that does not exist, or None (it exists, or is no repository path)."""
    word = word.strip("\"'()[],;:!")
    word = re.sub(r"(::[\w\[\]-]+|:\d+(-\d+)?|#[\w-]+)$", "", word)
    if not word or word.startswith(("/", "~", "-", "$", ".")) or "://" in word or "=" in word:
        return None
    if PLACEHOLDER.search(word.replace("*", "")) or re.search(r"[^\w./*-]", word):
        return None
    if word.startswith("p2p_diloco.") and "/" not in word and not word.endswith((".py", ".md", ".json")):
        return None if _module_exists(word) else "no such module"
    first = word.split("/")[0]
    if first in TOP_LEVEL and (first == word or "/" in word):
        return None if _exists(ROOT, word.rstrip("/")) else "no such file in the repository"
    if "/" in word and word.endswith(".py") and first in SUBPACKAGES:
        return None if _exists(PACKAGE, word) else "no such module under p2p_diloco/"
    if "/" not in word and re.fullmatch(r"[\w.-]+\.(py|md)", word):
        return None if word in _file_names() else "no file of that name in the repository"
    return None


def path_problems(text: str) -> list[str]:
    """'line N: `path` (why)' for each backticked repository path of a page's ``text`` that does not exist."""
    problems = []
    for number, span in code_spans(text):
        for word in span.split():
            why = missing_path(word)
            if why:
                problems.append(f"line {number}: `{word}` ({why})")
    return problems


def link_problems(page: Path, text: str) -> list[str]:
    """'line N: target (why)' for each relative link of ``page`` whose file or heading does not exist."""
    problems = []
    for number, target in links(text):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # https:, mailto:
            continue
        path, _, anchor = unquote(target).partition("#")
        file = page if not path else (ROOT / path.lstrip("/") if path.startswith("/") else page.parent / path)
        if not file.exists():
            problems.append(f"line {number}: {target} (no such file)")
        elif anchor and file.suffix == ".md" and anchor not in anchors(text if not path else file.read_text()):
            problems.append(f"line {number}: {target} (no heading #{anchor} in {file.name})")
    return problems


def default_problems(text: str) -> list[str]:
    """'line N: ...' for each table row ``| `section.key` | `value` |`` whose value is not the key's default."""
    from p2p_diloco.config import load_config, show_value

    defaults = _generator().command_defaults()
    code = load_config()
    problems = []
    for number, line in prose_lines(text):
        row = re.match(r"\|\s*`(\w+)\.(\w+)`\s*\|\s*`([^`]*)`\s*\|", line)
        if not row or not hasattr(code, row.group(1)) or not hasattr(getattr(code, row.group(1)), row.group(2)):
            continue
        key, stated = f"{row.group(1)}.{row.group(2)}", row.group(3)
        allowed = {show_value(getattr(getattr(code, row.group(1)), row.group(2)))}
        allowed |= {show_value(d[key]) for d in defaults.values() if key in d}
        if stated not in allowed and stated.strip('"') not in allowed:
            problems.append(f"line {number}: {key} default `{stated}`, the code says `{' or '.join(sorted(allowed))}`")
    return problems


def _report(kind: str, problems: dict[Path, list[str]]) -> str:
    lines = [f"{page.relative_to(ROOT)}: {p}" for page, found in problems.items() for p in found]
    return f"{len(lines)} {kind}:\n" + "\n".join(lines)


# ---------------------------------------------------------------------------------------------- the tests

@pytest.mark.timeout(120)
def test_the_reference_pages_are_generated_from_the_current_code():
    stale = []
    for path, text in _generator().render().items():
        if not path.exists():
            stale.append(f"{path.relative_to(ROOT)} is missing")
            continue
        current = path.read_text()
        if current != text:
            diff = difflib.unified_diff(current.splitlines(), text.splitlines(), "committed", "from the code",
                                        n=0, lineterm="")
            stale.append(f"{path.relative_to(ROOT)} differs from the code:\n" + "\n".join(list(diff)[:12]))
    assert not stale, "\n".join(stale) + f"\nregenerate the reference with: {REGENERATE}"


@pytest.mark.timeout(60)
def test_every_backticked_repository_path_exists():
    problems = {page: path_problems(page.read_text()) for page in pages()}
    assert not any(problems.values()), _report("paths that do not exist", problems)


@pytest.mark.timeout(60)
def test_every_relative_link_and_anchor_resolves():
    problems = {page: link_problems(page, page.read_text()) for page in pages()}
    assert not any(problems.values()), _report("broken links", problems)


@pytest.mark.timeout(60)
def test_config_tables_state_the_codes_defaults():
    problems = {page: default_problems(page.read_text()) for page in pages()}
    assert not any(problems.values()), _report("defaults that differ from the code", problems)


def _imported_top_level_modules() -> set[str]:
    names = set()
    for source in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(source.read_text())):
            if isinstance(node, ast.Import):
                names.update(a.name.split(".")[0] for a in node.names)
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names.add(node.module.split(".")[0])
    return names - set(sys.stdlib_module_names) - {"p2p_diloco"}


def _normalized(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


@pytest.mark.timeout(60)
def test_pyproject_declares_every_package_p2p_diloco_imports():
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        import tomli as tomllib
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    requirements = project["dependencies"] + [r for extra in project["optional-dependencies"].values() for r in extra]
    declared = {_normalized(re.match(r"[A-Za-z0-9_.-]+", r).group()) for r in requirements}
    distributions = importlib.metadata.packages_distributions()
    undeclared = {}
    for module in sorted(_imported_top_level_modules()):
        names = {_normalized(d) for d in distributions.get(module, [module])}
        if not names & declared:
            undeclared[module] = sorted(names)
    assert not undeclared, f"imported by p2p_diloco but not in pyproject.toml: {undeclared} (module: distributions)"

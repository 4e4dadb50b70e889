"""Writes docs/reference/cli.md from the `fngate` console script's own parser, so that the reference
names every command and flag as the code has them: `python scripts/cli_reference.py` after changing
a flag (tests/test_docs.py fails while the committed page and the parser disagree).

It runs with fngate installed (.venv/bin/python), not in the docs site's environment: MkDocs builds
the page as committed, and never imports fngate.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import re
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PAGE = ROOT / "docs" / "reference" / "cli.md"
WIDTH = 100
"""The width usage lines are wrapped at: fixed, so the page is the same on every terminal."""

HEADER = """\
# Command line: `fngate`

<!-- Made by scripts/cli_reference.py from the parser (fngate.cli.main.build_parser); do not edit:
     run `.venv/bin/python scripts/cli_reference.py` after changing a flag. -->

Every command and flag of the `fngate` console script, as its parser has them. `fngate COMMAND
--help` prints the same on a terminal. Settings that a flag does not cover come from `FNGATE_*`
variables ([settings](settings.md)).

"""


def parsers() -> tuple[argparse.ArgumentParser, Callable[[list[str]], int]]:
    """The console script's parser, and `fngate k8s render`'s entry point (its flags are its own)."""
    from fngate.cli.main import build_parser
    from fngate.k8s import main as render_main

    return build_parser(), render_main


def render() -> str:
    parser, render_main = parsers()
    lines = [HEADER.rstrip("\n"), ""]
    lines += _text(parser.description or "")
    lines += ["", *_usage(parser), ""]
    if parser.epilog:
        lines += [*_text(parser.epilog), ""]
    lines += _table(parser)
    lines += ["", "Commands:", ""]
    commands = list(_commands(parser))
    for path, _, summary in commands:
        lines.append(f"- [`{' '.join(path)}`](#{_anchor(path)}): {_escaped(summary)}")
    for path, sub, summary in commands:
        level = "#" * min(len(path), 4)
        lines += ["", f"{level} {' '.join(path)}", ""]
        lines += _text(sub.description or summary)
        lines += ["", *_usage(sub), ""]
        lines += _table(sub)
        if path == ["fngate", "k8s"]:
            lines += ["", *_render_help(render_main)]
    return "\n".join(lines).rstrip("\n") + "\n"


def _commands(
    parser: argparse.ArgumentParser, path: list[str] | None = None
) -> Iterator[tuple[list[str], argparse.ArgumentParser, str]]:
    """Every subcommand, depth first, with its path and its one-line help."""
    path = path or [parser.prog]
    for action in parser._actions:
        if not isinstance(action, argparse._SubParsersAction):
            continue
        helps = {choice.dest: choice.help or "" for choice in action._choices_actions}
        for name, sub in action.choices.items():
            here = [*path, name]
            yield here, sub, helps.get(name, "")
            yield from _commands(sub, here)


def _usage(parser: argparse.ArgumentParser) -> list[str]:
    formatter = argparse.HelpFormatter(parser.prog, width=WIDTH)
    formatter.add_usage(parser.usage, parser._actions, parser._mutually_exclusive_groups)
    return ["```text", formatter.format_help().strip(), "```"]


def _table(parser: argparse.ArgumentParser) -> list[str]:
    rows = []
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction | argparse._SubParsersAction):
            continue
        rows.append(f"| `{_invocation(action)}` | {_meaning(action)} |")
    if not rows:
        return ["No arguments."]
    return ["| argument | meaning |", "| --- | --- |", *rows]


def _invocation(action: argparse.Action) -> str:
    value = _metavar(action)
    if not action.option_strings:
        return value
    if action.nargs == 0:
        return ", ".join(action.option_strings)
    return ", ".join(f"{option} {value}" for option in action.option_strings)


def _metavar(action: argparse.Action) -> str:
    if action.metavar is not None:
        name = action.metavar if isinstance(action.metavar, str) else " ".join(action.metavar)
    elif action.choices is not None:
        name = "{" + ",".join(str(choice) for choice in action.choices) + "}"
    elif action.option_strings:
        name = action.dest.upper()
    else:
        name = action.dest
    forms = {"?": f"[{name}]", "*": f"[{name} ...]", "+": f"{name} [{name} ...]", argparse.REMAINDER: "..."}
    return forms.get(action.nargs, name) if isinstance(action.nargs, str) else name


def _meaning(action: argparse.Action) -> str:
    text = action.help % {**vars(action), "prog": ""} if action.help else ""
    notes = []
    if action.required and action.option_strings:
        notes.append("required")
    if isinstance(action, argparse._AppendAction):
        notes.append("repeat for several")
    if _shows_default(action, text):
        notes.append(f"default: `{action.default}`")
    shown = _escaped(text)
    if notes:
        shown = f"{shown} ({'; '.join(notes)})" if shown else "; ".join(notes).capitalize()
    return shown or "&nbsp;"


def _shows_default(action: argparse.Action, text: str) -> bool:
    """The default where the help does not state it in words (those stated in words may depend on
    the machine: its cores, its home folder)."""
    if action.nargs == 0 or action.default in (None, argparse.SUPPRESS, "", []):
        return False
    return "default" not in text.lower()


def _render_help(render_main: Callable[[list[str]], int]) -> list[str]:
    """`fngate k8s render --help`, as it prints it: its parser is built inside its main."""
    out = io.StringIO()
    columns = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = str(WIDTH)
    try:
        with contextlib.redirect_stdout(out), contextlib.suppress(SystemExit):
            render_main(["--help"])
    finally:
        if columns is None:
            del os.environ["COLUMNS"]
        else:
            os.environ["COLUMNS"] = columns
    return ["`fngate k8s render --help`:", "", "```text", out.getvalue().rstrip(), "```"]


def _text(text: str) -> list[str]:
    return [_escaped(" ".join(text.split()))] if text.strip() else []


def _escaped(text: str) -> str:
    """Markdown that shows `text` as written: code spans kept, HTML and emphasis characters
    escaped outside them, and table cells unbroken."""
    pieces = re.split(r"(`[^`]*`)", text)
    for index in range(0, len(pieces), 2):
        piece = pieces[index].replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
        pieces[index] = re.sub(r"([*_\[\]|\\])", r"\\\1", piece)
    return "".join(pieces)


def _anchor(path: list[str]) -> str:
    return "-".join(path)


def main(argv: list[str]) -> int:
    if argv not in ([], ["--check"]):
        print("usage: python scripts/cli_reference.py [--check]", file=sys.stderr)
        return 2
    text = render()
    if argv == ["--check"]:
        same = PAGE.read_text(encoding="utf-8") == text
        print("docs/reference/cli.md is up to date" if same else "docs/reference/cli.md is stale")
        return 0 if same else 1
    PAGE.parent.mkdir(parents=True, exist_ok=True)
    PAGE.write_text(text, encoding="utf-8")
    print("wrote docs/reference/cli.md")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))  # this checkout's fngate, whatever else is installed
    sys.exit(main(sys.argv[1:]))

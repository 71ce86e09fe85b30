"""`--help` of every command and group, readable at any width: click's plain layout, one section per
help panel (Model, Speculative decoding, ...), then a group's commands. A flag name is never cut (one
wider than the first column puts its help on the next line), and a switch shows no value. Rich's table layout, Typer's
default, squeezes long names such as `--speculative-num-draft-tokens, --draft-tokens` into an
ellipsis at 80 columns.
"""

from __future__ import annotations

from typing import Any

from rich.text import Text
from typer import Context
from typer.core import TyperCommand

OPTIONS = "Options"


class ReadableCommand(TyperCommand):
    def format_help(self, ctx: Context, formatter: Any) -> None:
        write_help(self, ctx, formatter)


def write_help(command: Any, ctx: Context, formatter: Any) -> None:
    command.format_usage(ctx, formatter)
    _write_doc(Text.from_markup(command.help or "").plain, formatter)
    sections: dict[str, list[tuple[str, str]]] = {}
    for param in command.get_params(ctx):
        record = param.get_help_record(ctx)
        if record is not None:
            sections.setdefault(getattr(param, "rich_help_panel", None) or OPTIONS, []).append(record)
    for title in sorted(sections, key=lambda t: t != OPTIONS):    # the general options first
        with formatter.section(title):
            formatter.write_dl(sections[title])
    if hasattr(command, "format_commands"):
        command.format_commands(ctx, formatter)


def _write_doc(doc: str, formatter: Any) -> None:
    """The docstring's paragraphs rewrapped to the width; indented lines (examples) kept as they are."""
    for paragraph in doc.strip().split("\n\n"):
        formatter.write_paragraph()
        with formatter.indentation():
            text: list[str] = []
            for line in paragraph.splitlines() + [" "]:         # the sentinel flushes the last text
                if line.startswith(" "):
                    if text:
                        formatter.write_text(" ".join(text))
                        text = []
                    if line.strip():
                        formatter.write(f"{'':>{formatter.current_indent}}{line}\n")
                else:
                    text.append(line)

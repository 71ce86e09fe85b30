"""How the CLI reports user errors: one red `error: ...` line on stderr and exit status 2, no traceback."""

from __future__ import annotations

import functools
from typing import Any, Callable, NoReturn, TypeVar

import typer
from rich.console import Console
from rich.markup import escape

from engine.errors import SpecError

F = TypeVar("F", bound=Callable[..., Any])

# Exit status for every user error, the same as click's for a bad flag.
USAGE_ERROR = 2

_stderr = Console(stderr=True, highlight=False, soft_wrap=True)


def print_error(message: str) -> None:
    _stderr.print(f"[bold red]error:[/bold red] {escape(message)}")


def fail(message: str) -> NoReturn:
    """Print `error: message` and exit with status 2."""
    print_error(message)
    raise typer.Exit(USAGE_ERROR)


def reports_user_errors(func: F) -> F:
    """Turn a SpecError raised by the command (or while building its ServerArgs) into `error: ...`, exit 2."""

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return func(*args, **kwargs)
        except SpecError as exc:
            fail(" ".join(str(exc).split()) or type(exc).__name__)

    return wrapper  # type: ignore[return-value]

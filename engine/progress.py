"""Progress of slow start-up steps (converting a GGUF file, building kernels): a rich progress bar on
a terminal, where nobody would otherwise know whether the server is working; elsewhere (logs, CI) the
step's own log lines say what runs."""

from __future__ import annotations

import sys
from typing import Iterable, Iterator, Optional, TypeVar

T = TypeVar("T")


def progress(items: Iterable[T], description: str, total: Optional[int] = None) -> Iterator[T]:
    """`items`, with a transient progress bar on stderr while they are consumed (a terminal only)."""
    if not sys.stderr.isatty():
        yield from items
        return
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=Console(stderr=True), transient=True) as bar:
        yield from bar.track(items, total=total, description=description)

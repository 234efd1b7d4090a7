"""One shared rich console and progress-bar factory, so every command looks and logs alike."""

from __future__ import annotations

import contextlib
import sys

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

# Logs and CI have no terminal width: give tables room instead of rich's 80 columns.
console = Console(stderr=False, highlight=False, soft_wrap=True, width=None if sys.stdout.isatty() else 140)
err_console = Console(stderr=True, highlight=False, soft_wrap=True)


def warn(message: str) -> None:
    """One line (never wrapped: a log is grepped), the message taken literally (no markup)."""
    err_console.print("[yellow]warning:[/yellow] ", end="")
    err_console.print(" ".join(str(message).split()), markup=False)


def make_progress(*extra_columns, enabled: bool = True) -> Progress:
    """A progress bar; hidden when disabled or when output is not a terminal (CI, logs)."""
    return Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        *extra_columns,
        TimeElapsedColumn(),
        TimeRemainingColumn(),
        console=console,
        disable=not enabled or not sys.stdout.isatty(),
        transient=False,
    )


def render_text(*renderables) -> str:
    """Tables and text as plain text (no colour), e.g. for a file beside a run's JSON."""
    from io import StringIO

    out = Console(file=StringIO(), width=140, color_system=None, highlight=False, soft_wrap=True)
    for r in renderables:
        out.print(r)
    return out.file.getvalue()


@contextlib.contextmanager
def working(message: str):
    """Say what a long step is doing: one line in a log, a spinner on a terminal."""
    if not sys.stdout.isatty():
        console.print(message)
        yield
        return
    with console.status(message, spinner="dots"):
        yield

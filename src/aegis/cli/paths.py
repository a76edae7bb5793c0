"""The path options' checks, run as the command line is read: a path the command cannot use is
one readable line and exit 2 before anything starts (typer callbacks)."""

from __future__ import annotations

from pathlib import Path

import typer


def made_dir(path: Path | None) -> Path | None:
    """A directory the command writes into, made now (with its parents): one it cannot make is a
    usage error before anything runs, not a traceback once the job has run."""
    if path is not None:
        if path.exists() and not path.is_dir():
            raise typer.BadParameter(f"{path} is not a directory")
        try:
            path.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise typer.BadParameter(f"cannot make directory {path}: {exc.strerror}") from None
    return path


def writable_file(path: Path | None) -> Path | None:
    """A file the command writes at its end: its directory made now, and not a directory itself."""
    if path is not None:
        if path.is_dir():
            raise typer.BadParameter(f"{path} is a directory")
        made_dir(path.parent)
    return path


def readable_file(path: str | None) -> str | None:
    """A file the command reads: readable now, or one line saying why not."""
    if path is not None:
        try:
            with open(path, "rb"):
                pass
        except OSError as exc:
            raise typer.BadParameter(f"cannot read {path}: {exc.strerror}") from None
    return path

"""Option pieces shared by several commands."""

from __future__ import annotations

from pathlib import Path

import click


def make_parent(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    """Callback of a file option written when a long command ends (`--json`): its folder is made now, as
    `export` makes its output's, so a missing folder never turns finished figures into a traceback, and
    one that cannot be made stops the command before any work."""
    if value is not None:
        parent = Path(value).parent
        try:
            parent.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise click.BadParameter(
                f"cannot create its folder {parent} ({e.strerror or e})", ctx, param
            ) from None
    return value


def output_folder(ctx: click.Context, param: click.Parameter, value: str | None) -> Path | None:
    """Callback of an output folder given as a string: an empty one (a quoted unset shell variable,
    "$OUT") is refused, where Path("") would quietly be the current folder."""
    if value is None:
        return None
    if not value.strip():
        raise click.BadParameter("empty; expected a folder", ctx, param)
    return Path(value)

"""The one error type commands raise for mistakes a user can make, and the checks that raise it."""

from pathlib import Path


class CliError(Exception):
    """A user-facing error: printed as one line, exit status 2."""


def require_positive(args, *names: str) -> None:
    """CliError `--name must be positive, got V` for the first of the flags (argparse dests) below 1.

    A dest the subcommand does not have is skipped.
    """
    for name in names:
        value = getattr(args, name, 1)
        if value < 1:
            raise CliError(f"--{name.replace('_', '-')} must be positive, got {value}")


def require_output_folder(flag: str, path: str) -> None:
    """CliError unless `path` is a folder or can become one: checked before a long run that writes it at the end."""
    p = Path(path)
    existing = next((q for q in (p, *p.parents) if q.exists()), None)
    if existing is not None and not existing.is_dir():
        where = "" if existing == p else f" ({existing} is a file)"
        raise CliError(f"{flag} {path}: not a folder{where}")


def require_output_file(flag: str, path: str | None) -> None:
    """CliError unless the file `path` (None: flag not given) can be written in an existing folder.

    Checked before a long run that writes it at the end, so that a typo does not cost the run.
    """
    if path is None:
        return
    p = Path(path)
    if p.is_dir():
        raise CliError(f"{flag} {path}: is a folder")
    if not p.parent.is_dir():
        raise CliError(f"{flag} {path}: no folder {p.parent}")

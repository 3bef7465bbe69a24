"""The one error type commands raise for mistakes a user can make."""


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

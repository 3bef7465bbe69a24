"""The one error type commands raise for mistakes a user can make."""


class CliError(Exception):
    """A user-facing error: printed as one line, exit status 2."""

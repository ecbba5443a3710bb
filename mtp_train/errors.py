"""User-facing errors: the CLI prints their message on one line and exits with code 2, no traceback."""


class UserError(Exception):
    """Bad input from the user (a file, a key, an option). The message names what was wrong and what was expected."""

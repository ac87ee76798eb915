"""User-facing errors: the CLI prints `error: <message>` and exits with `exit_code`."""


class SharpiError(Exception):
    """A problem with the user's input (file, flag, model) rather than a bug in sharpi."""

    exit_code = 1


class UsageError(SharpiError):
    """Invalid flags or flag combinations (llama.cpp exits 2 for these too)."""

    exit_code = 2

"""The one exception type users see: its message is a single line that names the problem."""

__all__ = ["M3CompileError"]


class M3CompileError(Exception):
    """Bad input or an unsupported model: the CLI prints the message on one line and exits with status 2."""

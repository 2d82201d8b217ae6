"""The one exception type spmd raises for problems in the user's step or inputs."""


class SpmdCompileError(RuntimeError):
    """A train step cannot be compiled as written; the message says what to change."""

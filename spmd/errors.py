"""The two exception types spmd raises: one for a step it cannot compile, one for a mistake in its settings."""


class SpmdCompileError(RuntimeError):
    """A train step cannot be compiled as written (a graph problem); the message says what to change."""


class SpmdConfigError(ValueError):
    """An argument of ``spmd.DataParallel``, ``spmd.compile`` or ``spmd.shard`` is not one spmd accepts;
    raised where it is written, before anything runs. The message names the argument and what to pass."""

"""The two exception types spmd raises: one for a step it cannot compile, one for a mistake in its settings."""


class SpmdCompileError(RuntimeError):
    """A train step cannot be compiled as written (a graph problem); the message says what to change."""


class SpmdConfigError(ValueError):
    """An argument of ``spmd.DataParallel``, ``spmd.compile`` or ``spmd.shard`` is not one spmd accepts;
    raised where it is written, before anything runs. The message names the argument and what to pass."""


_SUBJECT = "spmd.compile: train_step "


def naming_the_step(err: BaseException, name: str) -> None:
    """Say ``name``, the compiled function's own name, where ``err``'s message opens with the generic
    ``spmd.compile: train_step`` (messages are written before the step they will be about is known)."""
    if isinstance(err, SpmdCompileError) and name != "train_step" and err.args and isinstance(err.args[0], str) \
            and err.args[0].startswith(_SUBJECT):
        err.args = (f"spmd.compile: {name} {err.args[0][len(_SUBJECT):]}", *err.args[1:])

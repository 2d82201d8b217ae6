"""The two exception types spmd raises: one for a step it cannot compile, one for a mistake in its settings; and
the step's own name in what spmd says of it (errors and warnings are written before the step is known)."""

import contextlib
import contextvars
from typing import Iterator, Optional


class SpmdCompileError(RuntimeError):
    """A train step cannot be compiled as written (a graph problem); the message says what to change."""


class SpmdConfigError(ValueError):
    """An argument of ``spmd.DataParallel``, ``spmd.compile`` or ``spmd.shard`` is not one spmd accepts;
    raised where it is written, before anything runs. The message names the argument and what to pass."""


_SUBJECT = "spmd.compile: train_step "
_SUBJECTS = (_SUBJECT, "spmd.compile: the step ")
_COMPILING: contextvars.ContextVar[Optional[str]] = contextvars.ContextVar("spmd_compiling", default=None)


@contextlib.contextmanager
def compiling(name: str) -> Iterator[None]:
    """Within the block, the step being compiled is the function called ``name``: ``named`` says it."""
    token = _COMPILING.set(name)
    try:
        yield
    finally:
        _COMPILING.reset(token)


def named(message: str) -> str:
    """``message`` with its generic subject (``spmd.compile: the step``, ``spmd.compile: train_step``) replaced by
    the name of the function being compiled (``compiling``), where one is."""
    name = _COMPILING.get()
    for subject in _SUBJECTS if name is not None else ():
        if message.startswith(subject):
            return f"spmd.compile: {name} {message[len(subject):]}"
    return message


def naming_the_step(err: BaseException, name: str) -> None:
    """Say ``name``, the compiled function's own name, where ``err``'s message opens with the generic
    ``spmd.compile: train_step`` (messages are written before the step they will be about is known)."""
    if isinstance(err, SpmdCompileError) and name != "train_step" and err.args and isinstance(err.args[0], str) \
            and err.args[0].startswith(_SUBJECT):
        err.args = (f"spmd.compile: {name} {err.args[0][len(_SUBJECT):]}", *err.args[1:])

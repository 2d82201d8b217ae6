"""Trace through what the user compiled with ``torch.compile``: the step is traced as the original code.

A model may hold a ``torch.compile``d block (an ``OptimizedModule``, which holds the block as
``_orig_mod``), a block whose ``compile()`` was called (``nn.Module.__call__`` then runs
``_compiled_call_impl``), and the step may call a ``torch.compile``d function (a loss). Run as
they are while the step is traced, Dynamo compiles them on the fake tensors and Inductor's kernels
then read their data pointers. ``run_originals`` points each compiled callable the step reaches at
its original for the length of the trace: an ``OptimizedModule``'s ``forward`` at ``_orig_mod``, a
module's ``_compiled_call_impl`` at None, and a compiled function (``_torchdynamo_orig_callable``)
held by a name in the step's globals or closure, in the globals of its modules' code, by a module's
class or by a module, at what it compiled. So the whole step lands in the one graph spmd lowers, and
``torch.compile`` calls that torch makes itself while the step runs (flex_attention lifts the
tensors its ``score_mod`` and ``mask_mod`` close over that way) keep working. Afterwards every
name and attribute holds what it held.

``plain_name`` names a parameter as the user's model names it without the wrapper
(``blocks.0._orig_mod.fc.weight`` is ``blocks.0.fc.weight``, as torch.distributed.checkpoint names it).
"""

from __future__ import annotations

import contextlib
import functools
import types
from typing import Callable, Iterator

import torch.nn as nn

ORIG_MOD = "_orig_mod"  # where an OptimizedModule holds the module it compiled


def _is_compiled_function(value) -> bool:
    return isinstance(value, types.FunctionType) and original_callable(value) is not value


def _is_users(obj) -> bool:
    return (getattr(obj, "__module__", None) or "").split(".")[0] != "torch"


def _user_classes(modules: list[nn.Module]) -> list[type]:
    """The classes, and their bases, of the modules in ``modules``' trees that torch does not define."""
    found = {base: None for root in modules for m in root.modules() for base in type(m).__mro__
             if base is not object and _is_users(base)}
    return list(found)


def _user_namespaces(fn: Callable, classes: list[type]) -> list[dict]:
    """The dicts the step ``fn`` and its modules' code look names up in: ``fn``'s globals and the globals
    of the functions ``classes`` define."""
    namespaces = [getattr(fn, "__globals__", None)] + [value.__globals__ for cls in classes
                                                         for value in vars(cls).values()
                                                         if isinstance(value, types.FunctionType)]
    return list({id(ns): ns for ns in namespaces if ns is not None}.values())


@contextlib.contextmanager
def run_originals(fn: Callable, modules: list[nn.Module]) -> Iterator[None]:
    """Inside: every compiled callable the step ``fn`` (with ``modules``) reaches runs its original code."""
    undo: list[Callable[[], None]] = []

    def swap(table: dict, key: str, value) -> None:
        old = table[key]
        table[key] = value
        undo.append(functools.partial(table.__setitem__, key, old))

    try:
        for module in {id(m): m for root in modules for m in root.modules()}.values():
            attributes = vars(module)
            if is_compiled_module(module) and "forward" in attributes:
                swap(attributes, "forward", module._orig_mod.__call__)
            if attributes.get("_compiled_call_impl") is not None:
                swap(attributes, "_compiled_call_impl", None)
            for key, value in list(attributes.items()):
                if _is_compiled_function(value):
                    swap(attributes, key, original_callable(value))
        classes = _user_classes(modules)
        for cls in classes:
            for key, value in list(vars(cls).items()):
                if _is_compiled_function(value):  # a method decorated with @torch.compile
                    setattr(cls, key, original_callable(value))
                    undo.append(functools.partial(setattr, cls, key, value))
        for namespace in _user_namespaces(fn, classes):
            for key, value in list(namespace.items()):
                if _is_compiled_function(value):
                    swap(namespace, key, original_callable(value))
        for cell in getattr(fn, "__closure__", None) or ():
            with contextlib.suppress(ValueError):  # an empty cell
                if _is_compiled_function(cell.cell_contents):
                    value = cell.cell_contents
                    cell.cell_contents = original_callable(value)
                    undo.append(functools.partial(setattr, cell, "cell_contents", value))
        yield
    finally:
        for restore in reversed(undo):
            restore()


def is_compiled_module(module: nn.Module) -> bool:
    """True for the wrapper ``torch.compile(module)`` returns (an ``OptimizedModule``)."""
    from torch._dynamo.eval_frame import OptimizedModule

    return isinstance(module, OptimizedModule)


def original_callable(fn):
    """What a ``torch.compile``d function compiled (``fn`` itself when it is not one)."""
    return getattr(fn, "_torchdynamo_orig_callable", None) or fn


def plain_name(name: str) -> str:
    """``name`` (a dotted path in a module tree) without the steps into compiled wrappers."""
    return ".".join(part for part in name.split(".") if part != ORIG_MOD) if ORIG_MOD in name else name

"""Trace through what the user compiled with ``torch.compile``: the step is traced as the original code.

A model may hold a ``torch.compile``d block (an ``OptimizedModule``, which holds the block as
``_orig_mod``), a block whose ``compile()`` was called (``nn.Module.__call__`` then runs
``_compiled_call_impl``), and the step may call a ``torch.compile``d function (a loss). Run as
they are while the step is traced, Dynamo compiles them on the fake tensors and Inductor's kernels
then read their data pointers. ``run_originals`` makes every compiled callable run its original
code for the length of the trace (torch's ``force_eager`` stance: the same as calling
``_orig_mod``, ``_call_impl`` or ``_torchdynamo_orig_callable`` directly), so the whole step
lands in the one graph spmd lowers; the compiled callables are left as they were.

``plain_name`` names a parameter as the user's model names it without the wrapper
(``blocks.0._orig_mod.fc.weight`` is ``blocks.0.fc.weight``, as torch.distributed.checkpoint names it).
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn as nn

ORIG_MOD = "_orig_mod"  # where an OptimizedModule holds the module it compiled


def run_originals() -> contextlib.AbstractContextManager:
    """Every ``torch.compile``d module or function runs its original code inside this context."""
    return torch.compiler.set_stance("force_eager")


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

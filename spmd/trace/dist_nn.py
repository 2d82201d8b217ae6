"""``torch.distributed.nn.functional``'s differentiable collectives, traced as functional collectives.

Models gather features across ranks with autograd (OpenCLIP's contrastive loss calls
``torch.distributed.nn.all_gather``). Those functions call the in-place c10d collectives,
which a trace cannot hold, and refuse outright while anything is being compiled.
``traceable_collectives`` points ``all_gather``, ``all_reduce`` and ``reduce_scatter`` of
``torch.distributed.nn`` (and of its ``functional`` module) at versions that compute the same
values with the same autograd from ``torch.ops._c10d_functional`` ops, for the length of the
trace:

* ``all_gather(t)``: every rank's ``t`` (one ``all_gather_into_tensor``); backward: the sum over
  the ranks of the gradients of this rank's ``t`` (``reduce_scatter_tensor``), as torch's;
* ``all_reduce(t, op)``: the reduction; backward: the gradient reduced with the same ``op``, as torch's;
* ``reduce_scatter(output, inputs, op)``: this rank's reduction of ``inputs`` (its result is returned;
  ``output`` is not written); backward: the gradient gathered to every input (``all_gather``), as torch's.

A function imported by name before the trace (``from torch.distributed.nn.functional import
all_gather``) stays torch's, which torch refuses while tracing, as it refuses the others
(``broadcast``, ``all_to_all``, ...); ``trace_errors.translate`` then says how to call it or what to use instead.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch
import torch.distributed as dist

from ..errors import SpmdCompileError

c10d = torch.ops._c10d_functional
_OPS = {"SUM": "sum", "AVG": "avg", "MAX": "max", "MIN": "min", "PRODUCT": "product"}


def _group_name(group) -> str:
    return (group or dist.distributed_c10d._get_default_group()).group_name


def _op_name(op) -> str:
    name = _OPS.get(getattr(op, "name", str(op)).rsplit(".", 1)[-1])
    if name is None:
        raise SpmdCompileError(f"spmd.compile: train_step reduces with {op} in a torch.distributed.nn collective; "
                               f"a traced one reduces with {sorted(_OPS)}. Use one of those.")
    return name


def _gather(tensor: torch.Tensor, size: int, group_name: str) -> tuple[torch.Tensor, ...]:
    flat = tensor.contiguous().reshape(-1)
    out = c10d.wait_tensor(c10d.all_gather_into_tensor(flat, size, group_name))
    return tuple(t.view(tensor.shape) for t in out.view(size, -1).unbind(0))


def _reduce_scatter(pieces: list[torch.Tensor], op: str, size: int, group_name: str) -> torch.Tensor:
    flat = torch.stack([p.contiguous() for p in pieces]).reshape(-1)
    return c10d.wait_tensor(c10d.reduce_scatter_tensor(flat, op, size, group_name)).view(pieces[0].shape)


class _AllGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, group_name, size, tensor):
        ctx.group_name, ctx.size = group_name, size
        return _gather(tensor, size, group_name)

    @staticmethod
    def backward(ctx, *grads):
        like = next(g for g in grads if g is not None)
        grads = [torch.zeros_like(like) if g is None else g for g in grads]
        return None, None, _reduce_scatter(grads, "sum", ctx.size, ctx.group_name)


class _AllReduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, group_name, op, tensor):
        ctx.group_name, ctx.op = group_name, op
        return c10d.wait_tensor(c10d.all_reduce(tensor.contiguous(), op, group_name))

    @staticmethod
    def backward(ctx, grad):
        return None, None, c10d.wait_tensor(c10d.all_reduce(grad.contiguous(), ctx.op, ctx.group_name))


class _ReduceScatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, group_name, op, size, *inputs):
        ctx.group_name, ctx.size = group_name, size
        return _reduce_scatter(list(inputs), op, size, group_name)

    @staticmethod
    def backward(ctx, grad):
        return (None, None, None, *_gather(grad, ctx.size, ctx.group_name))


def all_gather(tensor, group=None):
    """``torch.distributed.nn.functional.all_gather`` as traced ops (see the module docstring)."""
    return _AllGather.apply(_group_name(group), dist.get_world_size(group), tensor)


def all_reduce(tensor, op=dist.ReduceOp.SUM, group=None):
    """``torch.distributed.nn.functional.all_reduce`` as traced ops (see the module docstring)."""
    return _AllReduce.apply(_group_name(group), _op_name(op), tensor)


def reduce_scatter(output, input_list, op=dist.ReduceOp.SUM, group=None):
    """``torch.distributed.nn.functional.reduce_scatter`` as traced ops (see the module docstring)."""
    return _ReduceScatter.apply(_group_name(group), _op_name(op), dist.get_world_size(group), *input_list)


_TRACEABLE = {"all_gather": all_gather, "all_reduce": all_reduce, "reduce_scatter": reduce_scatter}
TRACEABLE_DIST_NN = tuple(_TRACEABLE)


@contextlib.contextmanager
def traceable_collectives() -> Iterator[None]:
    """Inside: ``torch.distributed.nn``'s ``all_gather``, ``all_reduce`` and ``reduce_scatter`` are this module's."""
    if not dist.is_available():
        yield
        return
    import torch.distributed.nn as dist_nn
    import torch.distributed.nn.functional as dist_nn_functional

    saved = [(module, name, getattr(module, name)) for module in (dist_nn, dist_nn_functional)
             for name in TRACEABLE_DIST_NN if hasattr(module, name)]
    try:
        for module, name, _ in saved:
            setattr(module, name, _TRACEABLE[name])
        yield
    finally:
        for module, name, original in saved:
            setattr(module, name, original)

"""What replicate puts into a trace: a marker on each gradient and on each forward's buffers.

``tag_gradients`` (entered while the step is traced) wraps each trained parameter's
gradient in ``spmd::tag_grad``, which ``spmd.parallel.replicate.expand`` turns into an
all_reduce; a parameter this rank computes no gradient for, while others do, gets a
zero one (``_ZeroGradsForUnused``). ``buffers_synced_before_forward`` puts
``spmd::sync_buffers`` before each forward, which ``expand`` turns into a broadcast of
rank 0's buffers.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

from ..trace.accumulation import take_entry_grad

@torch.library.custom_op("spmd::tag_grad", mutates_args=())
def tag_grad(grad: torch.Tensor, param_index: int) -> torch.Tensor:
    """Identity marker on the gradient of trained parameter ``param_index``."""
    return grad.clone()


@tag_grad.register_fake
def _(grad, param_index):
    return torch.empty_like(grad)


TAG_GRAD = torch.ops.spmd.tag_grad.default


def tagged(grad: torch.Tensor, param: torch.Tensor, param_index: int) -> torch.Tensor:
    """``grad`` of ``param`` wrapped in ``tag_grad``; a DTensor gradient (a tensor-parallel parameter's)
    is first brought to its parameter's placements, as FSDP2 and DDP bring it before they reduce over
    the data-parallel ranks (a sequence-parallel norm's gradient arrives as ``Partial``: one all_reduce
    over its mesh), and its local tensor is tagged: the data-parallel reduction adds local tensors."""
    if not isinstance(grad, DTensor):
        return tag_grad(grad, param_index)
    if isinstance(param, DTensor) and grad.placements != param.placements:
        grad = grad.redistribute(param.device_mesh, param.placements)
    return DTensor(tag_grad(grad._local_tensor, param_index), grad._spec, requires_grad=False)


@torch.library.custom_op("spmd::sync_buffers", mutates_args=())
def sync_buffers_marker(buffers: list[torch.Tensor], names: str) -> list[torch.Tensor]:
    """Marker: the values of a module's ``buffers`` that its forward must start from.

    Identity when run; the parallel mode replaces it (replicate: rank 0's values, broadcast).
    ``names``: the buffers' names, comma-separated, for messages.
    """
    return [b.clone() for b in buffers]


@sync_buffers_marker.register_fake
def _(buffers, names):
    return [torch.empty_like(b) for b in buffers]


SYNC_BUFFERS = torch.ops.spmd.sync_buffers.default


def _sync_buffers_before_forward(prefix: str):
    """A forward pre-hook: overwrite the module's buffers with ``sync_buffers_marker`` of them, as DDP does."""

    def hook(module, args):
        named = list(module.named_buffers())
        if named:
            bufs = [b for _, b in named]
            with torch.no_grad():
                torch._foreach_copy_(bufs, sync_buffers_marker(bufs, ",".join(prefix + n for n, _ in named)))

    return hook


class _ZeroGradsForUnused:
    """Give the listed trained parameters a zero gradient in every backward that computes none for them.

    ``on_grad(i)`` runs in each gradient hook; at the end of that backward the missing
    ones get ``tag_grad(zeros)``, reduced like any other gradient (DDP's
    ``find_unused_parameters=True``: a gradient some rank does not compute is zero there).
    """

    def __init__(self, params: list, indices: frozenset):
        self.params, self.indices = params, indices
        self.seen: set[int] = set()
        self.queued = False

    def on_grad(self, i: int) -> None:
        if self.indices and not self.queued:
            torch.autograd.Variable._execution_engine.queue_callback(self.fill)
            self.queued = True
        self.seen.add(i)

    def fill(self) -> None:
        for i in sorted(self.indices - self.seen):
            p = self.params[i]
            old = take_entry_grad(p)
            zero = tagged(torch.zeros_like(p) if old is None else old + torch.zeros_like(p), p, i)
            p.grad = zero if p.grad is None else p.grad + zero
        self.seen, self.queued = set(), False


def tag_gradients(state, params: list[torch.Tensor],
                  zero_grads_for: frozenset = frozenset()) -> contextlib.AbstractContextManager:
    """Tag each trained parameter's gradient with ``spmd::tag_grad`` (what replicate expands).

    ``zero_grads_for``: indices of trained parameters that get a zero gradient in a backward
    that computes none for them (``_ZeroGradsForUnused``). A gradient the parameter held when
    the step was called (``spmd.trace.accumulation``) is added to its first new one before the tag.
    """
    unused = _ZeroGradsForUnused(params, frozenset(zero_grads_for))

    def on_grad(g, i):
        unused.on_grad(i)
        old = take_entry_grad(params[i])  # accumulated in earlier calls: reduce the sum, as DDP does
        return tagged(g if old is None else old + g, params[i], i)

    for i, p in enumerate(params):
        if state.param_trained[i]:
            p.register_hook(lambda g, i=i: on_grad(g, i))
    return contextlib.nullcontext()


@contextlib.contextmanager
def buffers_synced_before_forward(modules: list[nn.Module]) -> Iterator[None]:
    """While tracing: each call of one of ``modules`` first overwrites its buffers with
    ``sync_buffers_marker`` of them (``SYNC_BUFFERS`` in the graph), as DDP's forward does."""
    handles = [mod.register_forward_pre_hook(_sync_buffers_before_forward(f"m{m}." if len(modules) > 1 else ""))
               for m, mod in enumerate(modules)]
    try:
        yield
    finally:
        for h in handles:
            h.remove()

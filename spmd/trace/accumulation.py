"""Gradient accumulation across calls: gradients a step finds on its parameters, and those it leaves.

A training loop that accumulates over micro-batches calls a forward-and-backward step
(no optimizer step) k-1 times and then a step that also updates, as DDP users write
with ``no_sync()``. In eager mode each backward adds into ``param.grad``. A compiled
step does the same with explicit graph inputs and outputs:

* a parameter that holds ``.grad`` when the step is called passes it as a graph input
  (after the user's tensors, ``Role.GRAD``); tracing puts the traced input into the
  traced parameter's ``.grad``, so the backward adds into it as eager autograd does
  (replicate first adds it to the new gradient and reduces the sum, as DDP reduces
  the accumulated gradient in the call that syncs);
* a step that calls no ``optimizer.step()`` may leave gradients: each one the step
  leaves (a new tensor) is a graph output after the user's, put back into
  ``param.grad`` after the run; the replicate mode drops its gradient collectives from
  such a step (``LEAVES_GRADS``), so the gradients stay this rank's own (``no_sync``).
  The sharded modes reduce-scatter in every call, as FSDP2 does while gradient sync is
  on: gradients kept between calls are sharded (1/N of the unsharded ones);
* a parameter whose gradient the step clears (``zero_grad``) has none after the run.

Which parameters hold a gradient is part of the step's signature: the first call with
gradients present traces again, later ones reuse that graph.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Optional

import torch
from torch.distributed.tensor import DTensor

from ..errors import SpmdCompileError
from ..graph_utils.meta import ROLE, Role

LEAVES_GRADS = "spmd_leaves_grads"  # gm.meta key: the step leaves gradients (no optimizer step, no_sync)

LOOP_INSIDE = ("To accumulate over micro-batches, either call a step without an optimizer step (forward and "
               "backward only) for all but the last micro-batch and then the step that updates, or loop over "
               "the micro-batches inside one step (loss.backward() per micro-batch, then optim.step()).")


@dataclass
class GradPlan:
    """How one compiled graph takes and leaves gradients.

    ``inputs``: parameter indices whose ``.grad`` the graph takes (in this order, after the
    user's tensors). ``outputs``: parameter indices whose new ``.grad`` the graph returns (after
    the user's outputs), with ``specs`` (the DTensor spec of each, or None). ``kept``: parameters
    whose entry gradient is updated in place (or untouched) and stays. Every other parameter
    that held a gradient has none after the run. ``no_sync``: the graph leaves gradients and
    calls no optimizer step, so they stay this rank's own until the call that updates.
    ``cleared``: parameters holding a gradient on entry that the graph never reads (the step
    clears it first, ``optim.zero_grad()`` before the backward): not graph inputs, let go of
    before the run (``let_go``), as eager's ``zero_grad`` frees them before the forward.
    """

    inputs: tuple[int, ...] = ()
    outputs: tuple[int, ...] = ()
    specs: list = field(default_factory=list)
    kept: frozenset = frozenset()
    no_sync: bool = False
    cleared: tuple[int, ...] = ()

    def __bool__(self) -> bool:
        return bool(self.inputs or self.outputs)

    def entry_grads(self, params: list[torch.Tensor]) -> list[torch.Tensor]:
        """The graph's gradient inputs: the local tensors of ``params``' gradients, in ``inputs`` order."""
        return [_local(params[i].grad) for i in self.inputs]

    def let_go(self, params: list[torch.Tensor]) -> None:
        """Drop the gradients on entry that the step clears before reading (``cleared``)."""
        for i in self.cleared:
            params[i].grad = None

    def leave(self, params: list[torch.Tensor], outs: list) -> None:
        """Put the gradients the run left (``outs``: the graph's gradient outputs) into ``params``."""
        for i in self.inputs:
            if i not in self.kept:
                params[i].grad = None
        for i, out, spec in zip(self.outputs, outs, self.specs):
            params[i].grad = out if spec is None else DTensor(out, spec, requires_grad=False)


def drop_unread_entry_grads(gm: torch.fx.GraphModule, plan: GradPlan) -> GradPlan:
    """``plan`` without the gradients on entry that ``gm`` never reads, their placeholders removed from ``gm``
    (its ``Role.GRAD`` placeholders, in ``plan.inputs`` order). Held through the run, they would add a whole
    model's gradients to the step's peak where eager's ``zero_grad`` has freed them; one the step leaves
    untouched (``kept``) stays on its parameter, the others are let go of before the run (``cleared``)."""
    placeholders = [n for n in gm.graph.find_nodes(op="placeholder") if n.meta.get(ROLE) is Role.GRAD]
    unread = [i for i, node in zip(plan.inputs, placeholders) if not node.users]
    if not unread:
        return plan
    for i, node in zip(plan.inputs, placeholders):
        if not node.users:
            gm.graph.erase_node(node)
    return dataclasses.replace(plan, inputs=tuple(i for i in plan.inputs if i not in unread),
                               cleared=tuple(i for i in unread if i not in plan.kept))


def _local(t: torch.Tensor) -> torch.Tensor:
    return t._local_tensor if isinstance(t, DTensor) else t


def grads_on_entry(names: list[str], params: list[torch.Tensor]) -> tuple[int, ...]:
    """Indices of the parameters holding a gradient; refuses one a graph cannot take as an input."""
    held = tuple(i for i, p in enumerate(params) if p.grad is not None)
    for i in held:
        p, g = params[i], params[i].grad
        if g.layout != torch.strided or isinstance(g, DTensor) != isinstance(p, DTensor) or g.shape != p.shape:
            raise SpmdCompileError(
                f"spmd.compile: parameter {names[i]} holds a gradient the compiled step cannot take "
                f"({'sparse' if g.layout != torch.strided else type(g).__name__} of shape {tuple(g.shape)}). "
                "Call optim.zero_grad() before the step. " + LOOP_INSIDE)
    return held


def grads_signature(names: list[str], params: list[torch.Tensor]) -> dict[str, tuple]:
    """The signature entries of the gradients ``params`` hold: a graph takes them as inputs."""
    return {f"gradient of {names[i]}": (tuple(params[i].grad.shape), params[i].grad.dtype, params[i].grad.device)
            for i in range(len(params)) if params[i].grad is not None}


def plan_left_grads(entry: dict[int, torch.Tensor], params: list[torch.Tensor],
                    stepped: bool) -> tuple[GradPlan, list[torch.Tensor]]:
    """After the traced step: the ``GradPlan`` and the traced gradients it returns.

    ``entry``: parameter index -> the traced gradient it held on entry. ``stepped``: the step
    called an optimizer's ``step()``. The gradients a step that updates leaves (it clears them
    first, ``optim.zero_grad(); loss.backward(); optim.step()``, or zeroes them in place,
    ``zero_grad(set_to_none=False)``) are reduced ones, as DDP and FSDP2 leave theirs.
    """
    left = [i for i, p in enumerate(params) if p.grad is not None and p.grad is not entry.get(i)]
    kept = frozenset(i for i, g in entry.items() if params[i].grad is g)
    grads = [params[i].grad for i in left]
    plan = GradPlan(tuple(entry), tuple(left), [g._spec if isinstance(g, DTensor) else None for g in grads], kept,
                    no_sync=bool(left) and not stepped)
    return plan, [_local(g) for g in grads]


_ENTRY = "_spmd_entry_grad"


def mark_entry_grad(grad: torch.Tensor) -> torch.Tensor:
    """Mark ``grad`` (a traced gradient input) as one its parameter held when the step was called."""
    setattr(grad, _ENTRY, True)
    return grad


def take_entry_grad(param: torch.Tensor) -> Optional[torch.Tensor]:
    """The gradient ``param`` held when the step was called, removed from it; else None.

    Replicate calls this in a gradient hook: the entry gradient is added to the new one before
    the sum is reduced, as DDP reduces the accumulated gradient. A gradient an earlier backward
    of the same step left (a loop inside the step) was reduced already and stays.
    """
    grad = param.grad
    if grad is None or not getattr(grad, _ENTRY, False):
        return None
    param.grad = None
    return grad

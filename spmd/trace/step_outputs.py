"""What a compiled step may return, and how its values come back to the caller.

A step returns any pytree of tensors, Python numbers and None. A ``DTensor`` (what a
sharded step's ``clip_grad_norm_`` returns, as under FSDP2) leaves the graph as its local
tensor and is wrapped again, with the same mesh and placements, after the run: the caller
gets what eager FSDP2 gives (a partial value included: ``.full_tensor()`` reduces it then,
as in eager). Anything else (another tensor subclass, strings, objects) is refused
while tracing, naming its type.

A parameter, buffer, held tensor or optimizer state tensor the step returns itself
(``return loss, model.fc.weight``) is not a graph output: the caller gets the live object,
as from eager, which later steps update in place. A view of one (``p.detach()``, ``p[0]``)
is a new tensor holding its value after the step.

A hyperparameter returned as read (``return loss, optim.param_groups[0]["lr"]``) is not a graph output either:
the caller gets the call's Python number, as from eager (``HyperOutput``), and one read after a scheduler's
``step()`` in the step gets the value that step set after the call (``spmd.trace.scheduled_values``).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from ..errors import SpmdCompileError
from .scheduled_values import ScheduledValue

_NUMBERS = (int, float, bool)


def _refused(v: Any) -> bool:
    if v is None or isinstance(v, (DTensor, ScheduledValue)):
        return False
    if isinstance(v, torch.Tensor):
        return is_traceable_wrapper_subclass(v) or v.layout != torch.strided
    return not isinstance(v, _NUMBERS)


@dataclasses.dataclass(frozen=True)
class HyperOutput:
    """A hyperparameter returned as read (``return loss, optim.param_groups[0]["lr"]``): eager returns its Python
    number, the value of ``slot`` in the call (``CompiledStep.group_values``), not the graph's 0-dim tensor."""

    slot: int


def graph_outputs(flat: list, owned: dict[int, int], fn_name: str = "train_step", hypers: dict[int, int] = {}
                  ) -> tuple[list, dict[int, Any], dict[int, Any]]:
    """(the graph's outputs for ``flat``, position -> DTensor spec of each DTensor among them, position ->
    index in ``StepState.owned_tensors`` of each tensor the state owns, or the ``ScheduledValue`` returned, read
    after the call: their outputs are None).

    ``owned``: id of each traced tensor the state owns (a DTensor's local one) -> its index; ``hypers``: id of
    each traced hyperparameter -> its slot (returned, a ``HyperOutput``: eager's Python number).
    Raises ``SpmdCompileError`` naming each value the step cannot return.
    """
    bad = sorted({type(v).__name__ if not isinstance(v, torch.Tensor) or is_traceable_wrapper_subclass(v)
                  else f"{v.layout} tensor" for v in flat if _refused(v)})
    if bad:
        raise SpmdCompileError(
            f"spmd.compile: {fn_name} returns values of type {bad}, which a compiled step cannot return. Return "
            "tensors (DTensors included), Python numbers or None, in any nesting of tuples, lists and dicts; "
            "compute anything else from them after the step."
        )
    values = [v._local_tensor if isinstance(v, DTensor) else v for v in flat]
    live = {i: owned[id(v)] for i, v in enumerate(values) if isinstance(v, torch.Tensor) and id(v) in owned}
    live.update((i, v) for i, v in enumerate(values) if isinstance(v, ScheduledValue))
    live.update((i, HyperOutput(hypers[id(v)])) for i, v in enumerate(values) if id(v) in hypers)
    specs = {i: v._spec for i, v in enumerate(flat) if isinstance(v, DTensor) and i not in live}
    return [None if i in live else v.detach() if isinstance(v, torch.Tensor) else v
            for i, v in enumerate(values)], specs, live


def rewrap(outs: list, specs: dict[int, Any], live: dict[int, Any], owned: list[torch.Tensor],
           hyper_values: list[float] = ()) -> list:
    """The step's outputs with each DTensor rebuilt from its local tensor (``graph_outputs``' specs) and each
    tensor the state owns put in (``live``: position -> index in ``owned``, ``StepState.owned_tensors``), or the
    value a scheduler's step set after the call (a ``ScheduledValue`` there), or the call's value of a
    hyperparameter (a ``HyperOutput``, of ``hyper_values``)."""
    for i, spec in specs.items():
        outs[i] = DTensor(outs[i], spec, requires_grad=False)
    for i, k in live.items():
        outs[i] = (k.read() if isinstance(k, ScheduledValue) else hyper_values[k.slot] if isinstance(k, HyperOutput)
                   else owned[k])
    return outs

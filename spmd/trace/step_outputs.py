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
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from ..errors import SpmdCompileError

_NUMBERS = (int, float, bool)


def _refused(v: Any) -> bool:
    if v is None or isinstance(v, DTensor):
        return False
    if isinstance(v, torch.Tensor):
        return is_traceable_wrapper_subclass(v) or v.layout != torch.strided
    return not isinstance(v, _NUMBERS)


def graph_outputs(flat: list, owned: dict[int, int], fn_name: str = "train_step"
                  ) -> tuple[list, dict[int, Any], dict[int, int]]:
    """(the graph's outputs for ``flat``, position -> DTensor spec of each DTensor among them, position ->
    index in ``StepState.owned_tensors`` of each tensor the state owns: its output is None).

    ``owned``: id of each traced tensor the state owns (a DTensor's local one) -> its index.
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
    specs = {i: v._spec for i, v in enumerate(flat) if isinstance(v, DTensor) and i not in live}
    return [None if i in live else v.detach() if isinstance(v, torch.Tensor) else v
            for i, v in enumerate(values)], specs, live


def rewrap(outs: list, specs: dict[int, Any], live: dict[int, int], owned: list[torch.Tensor]) -> list:
    """The step's outputs with each DTensor rebuilt from its local tensor (``graph_outputs``' specs) and each
    tensor the state owns put in (``live``: position -> index in ``owned``, ``StepState.owned_tensors``)."""
    for i, spec in specs.items():
        outs[i] = DTensor(outs[i], spec, requires_grad=False)
    for i, k in live.items():
        outs[i] = owned[k]
    return outs

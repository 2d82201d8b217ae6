"""What a compiled step specialises on, by name (``Signatures``): the state's signature and that of each
leaf of the step's arguments, modules and optimizers by a serial number never reused. The per-call machinery
(``spmd.step.call_path``) keys its compiled steps by it and names what changed when a step retraces.
"""

from __future__ import annotations

import dataclasses
import itertools
import weakref
from typing import Any

import torch
import torch.nn as nn
import torch.utils._pytree as pytree
from torch.distributed.tensor import DTensor

from ..optim.amp_scaler import GradScaler, scaler_signature
from ..trace.accumulation import grads_signature
from ..trace.step_state import StepState, sharding_signature, tensor_signature
from .dependencies import ambient


def input_name(path: tuple) -> str:
    """``input 2``, ``input 'batch'``, ``input 1[0]``: a leaf of ``(args, kwargs)`` in the user's terms."""
    (where, first), rest = path[:2], path[2:]
    head = str(first.idx) if where.idx == 0 else repr(first.key)
    return f"input {head}{pytree.keystr(rest) if rest else ''}"


class Signatures:
    """The signatures of one compiled step's calls. Modules and optimizers are named by serial number,
    never reused (unlike ``id()``): a new object is a new signature."""

    def __init__(self) -> None:
        self._serials: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._next_serial = itertools.count()

    def serial(self, obj: Any) -> str:
        if obj not in self._serials:
            self._serials[obj] = next(self._next_serial)
        return f"{type(obj).__name__} #{self._serials[obj]}"

    def of(self, state: StepState, args: tuple, kwargs: dict) -> dict[str, Any]:
        """Everything the traced graph specialises on, by name: the state's (``StepState.signature``)
        and the step's own arguments' (``input 2``: shape, dtype, ... of a tensor; value of a number)."""
        sig = state.signature()
        sig.update(ambient())  # grad mode, autocast, ... around the call (spmd.step.dependencies)
        sig.update(grads_signature(state.param_names, state.params))
        leaves = pytree.tree_flatten_with_path((args, kwargs))[0]
        for path, leaf in leaves:
            sig[input_name(path)] = self.leaf(leaf)
        passed = {id(leaf) for _, leaf in leaves}
        reached = [self.serial(o) for o in (*state.modules, *state.optimizers, *state.scalers) if id(o) not in passed]
        if reached:  # through self, a container, the closure or a global (spmd.trace.step_reach): objects as inputs
            sig["reached"] = tuple(reached)
        return sig

    def leaf(self, leaf: Any, depth: int = 4) -> Any:
        """What the traced graph specialises on in one leaf of the step's arguments (and, ``depth`` levels
        down, in the fields of a dataclass among them and the containers under those)."""
        if isinstance(leaf, DTensor):  # its local tensor is the graph input
            return tensor_signature(leaf), tensor_signature(leaf._local_tensor), sharding_signature(leaf._spec)
        if isinstance(leaf, torch.Tensor):
            return tensor_signature(leaf)
        if isinstance(leaf, (nn.Module, torch.optim.Optimizer)):
            return self.serial(leaf)
        if isinstance(leaf, GradScaler):
            return self.serial(leaf), scaler_signature(leaf)
        if leaf is None or type(leaf) in (int, float, bool, str):
            return repr(leaf)
        if depth and isinstance(leaf, (list, tuple)):
            return type(leaf).__name__, tuple(self.leaf(v, depth - 1) for v in leaf)
        if depth and isinstance(leaf, dict):
            return "dict", tuple((repr(k), self.leaf(v, depth - 1)) for k, v in leaf.items())
        if depth and dataclasses.is_dataclass(leaf) and not isinstance(leaf, type):
            # field by field: its repr would show the values of the tensors it holds (an EMA), which change
            return type(leaf).__name__, tuple((f.name, self.leaf(getattr(leaf, f.name), depth - 1))
                                              for f in dataclasses.fields(leaf))
        return f"{type(leaf).__name__}: {leaf!r}"

"""``StateCheck``: tell cheaply whether a train step's modules and optimizers are as they were.

``CompiledTrainStep`` builds a ``StepState`` and its named signature only when a call may
differ from the last one; a training loop that passes the same model and optimizer on
every call is recognised by this check instead (``spmd.step.call_path.CallPath.repeat_last_call``).
"""

from __future__ import annotations

import operator
import weakref
from typing import Any, Callable, Optional

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

from ..optim.hyperparams import LearnedFacts, group_signature, hyper_items
from ..trace.block_masks import is_block_mask
from ..trace.step_state import TENSOR_FIELDS, StepState, sharding_signature

_METADATA = operator.attrgetter(*TENSOR_FIELDS)  # tensor_signature's fields, compared without building tuples
_TABLE_WALKS = ("named_parameters", "named_buffers", "named_modules", "_named_members")


def _lists_its_tables(cls: type) -> bool:
    """True if modules of class ``cls`` list their parameters, buffers and submodules as ``nn.Module`` does."""
    return all(getattr(cls, name) is getattr(nn.Module, name) for name in _TABLE_WALKS)


def _tensor_attribute_names(module: nn.Module) -> list[str]:
    """Attributes read as buffers: tensors, and flex_attention masks (whose tensors are; ``spmd.trace.block_masks``)."""
    return [key for key, value in vars(module).items() if isinstance(value, torch.Tensor) or is_block_mask(value)]


def _contents(modules: list[nn.Module], optimizers: list[torch.optim.Optimizer],
              attributes: list[list[str]]) -> tuple[list, list]:
    """(keys, held): what a ``StepState`` of these is built from.

    ``keys`` (compared with ``==``): each module's type and ``training`` flag, the names in
    its parameter, buffer and submodule tables, the number of its attributes, and the
    lengths of every table, group and state dict.
    ``held`` (compared by identity): what those tables hold, each module's tensor attributes
    (``attributes``: their names, module by module), each param group and its parameters,
    each parameter with optimizer state, its state dict and the state's values.
    """
    keys: list = []
    held: list = []
    for mod, names in zip(modules, attributes):
        keys.append(type(mod))
        keys.append(mod.training)
        attrs = vars(mod)
        keys.append(len(attrs))
        if names:
            held += [attrs.get(name) for name in names]
        for table in (mod._parameters, mod._buffers, mod._modules):
            keys += table
            keys.append(len(table))
            held += table.values()
    for optim in optimizers:
        keys.append(len(optim.param_groups))
        for group in optim.param_groups:
            held.append(group)
            keys.append(len(group["params"]))
            held += group["params"]
        keys.append(len(optim.state))
        held += optim.state
        held += optim.state.values()
        for st in optim.state.values():
            keys += st
            keys.append(len(st))
            held += st.values()
    return keys, held


def _grad_key(p: torch.Tensor) -> Optional[tuple]:
    """What a graph specialises on in ``p``'s gradient (``accumulation.grads_signature``), or None."""
    g = p.grad
    return None if g is None else (g.shape, g.dtype, g.device, type(g))


def _dtype_of(value: Any) -> Optional[torch.dtype]:
    return value.dtype if torch.is_tensor(value) else None


def _group_facts(optim: torch.optim.Optimizer, group: dict, learned: LearnedFacts) -> tuple[tuple, list[float]]:
    """What a trace specialises on in ``group`` (each hyperparameter slot's key, index and
    tensor dtype, and ``group_signature`` under the step's ``learned`` facts), and the slots' current values."""
    items = hyper_items(group)
    slots = tuple((key, index, _dtype_of(group[key] if index is None else group[key][index]))
                  for key, index, _ in items)
    return (slots, group_signature(optim, group, learned, items)), [value for _, _, value in items]


class StateCheck:
    """Tells, cheaply, whether a ``StepState`` built now would be the one it was made from.

    A training loop passes the same model and optimizer on every call, and building a
    ``StepState`` and its named ``signature`` again (a walk of every module and of every
    optimizer's state, a name per tensor) costs far more than the step needs.
    ``hypers_if_unchanged`` instead compares what the state is made of (``_contents``)
    with what it was: names and types with ``==``, held objects by identity, non-tensor
    optimizer state by ``repr`` and each tensor's ``TENSOR_FIELDS`` (and a DTensor's requires_grad and
    spec) as the signature does, and each param group's ``_group_facts``. Anything it
    cannot vouch for reads as changed: a module whose class lists its parameters in its
    own way is never vouched for. A module's tensor attributes (read as buffers) are held by
    name; an attribute added or removed changes the module's attribute count.

    It references the modules and optimizers weakly (``on_free`` is called when one is
    freed), but holds what they hold (submodules, tensors): drop the check to let those go.
    """

    def __init__(self, state: StepState, on_free: Optional[Callable] = None):
        roots = {id(m) for m in state.modules}
        below = {id(m): m for root in state.modules for m in root.modules() if id(m) not in roots}
        self._owners = [weakref.ref(obj, on_free) for obj in (*state.modules, *state.optimizers)]
        self._n_modules = len(state.modules)
        self._submodules = list(below.values())
        self._vouched = all(map(_lists_its_tables, {type(m) for m in (*state.modules, *self._submodules)}))
        self._attributes = list(map(_tensor_attribute_names, (*state.modules, *self._submodules)))
        self._keys, self._held = _contents([*state.modules, *self._submodules], state.optimizers, self._attributes)
        self._consts = [(st, key, repr(v)) for o in state.optimizers for st in o.state.values()
                        for key, v in st.items() if not isinstance(v, torch.Tensor)]
        self.params = state.params
        self._grads = list(map(_grad_key, self.params))
        tensors = self.owned = state.owned_tensors()
        self.flat = state.flat_tensors()  # the graph's leading inputs, as ``StepState.flat_tensors``
        self._metadata = list(map(_METADATA, self.flat))
        # a DTensor's spec and its own requires_grad (its local tensor, the graph input, never requires one)
        self._shardings = [(i, t, (sharding_signature(t._spec), t.requires_grad))
                           for i, t in enumerate(tensors) if isinstance(t, DTensor)]
        self._learned = state.learned
        self._groups = [_group_facts(o, g, self._learned)[0] for o in state.optimizers for g in o.param_groups]

    def hypers_if_unchanged(self) -> Optional[list[float]]:
        """``StepState.hyper_values()`` of the state now if nothing else about it changed, else None.

        Also None when which parameters hold a gradient, or its metadata, changed: a graph takes
        the gradients held on entry as inputs (``spmd.trace.accumulation``).
        """
        owners = [ref() for ref in self._owners]
        if not self._vouched or any(obj is None for obj in owners):
            return None
        modules, optimizers = owners[:self._n_modules], owners[self._n_modules:]
        keys, held = _contents([*modules, *self._submodules], optimizers, self._attributes)
        if keys != self._keys or len(held) != len(self._held) or not all(map(operator.is_, held, self._held)):
            return None
        if any(repr(st[key]) != before for st, key, before in self._consts):
            return None
        if list(map(_METADATA, self.flat)) != self._metadata:
            return None
        if any(t._local_tensor is not self.flat[i] or (sharding_signature(t._spec), t.requires_grad) != s
               for i, t, s in self._shardings):
            return None
        if list(map(_grad_key, self.params)) != self._grads:
            return None
        groups, values = [], []
        for optim in optimizers:
            for group in optim.param_groups:
                facts, group_values = _group_facts(optim, group, self._learned)
                groups.append(facts)
                values += group_values
        return values if groups == self._groups else None

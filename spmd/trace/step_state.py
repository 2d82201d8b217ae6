"""What a train step owns: its modules, optimizers, and the tensors they hold.

``StepState`` finds the ``nn.Module``s and ``Optimizer``s among a train step's
arguments and lays their tensors out in one fixed order (parameters, buffers,
optimizer state), which is the order of the compiled graph's leading inputs. The
real tensors are passed to the graph on every call, so updates land in place and
edits the user makes between steps are always seen. A module's plain tensor attribute
(neither parameter nor buffer) counts as a buffer: a graph input, in the signature. So does a
tensor the step reaches outside its arguments and its modules (``spmd.trace.step_reach``: an EMA
kept on ``self`` or in a closure), a *held tensor*: tracing puts its traced stand-in where it lies
(``held_slots``), and the graph updates it in place as it updates a buffer.
A module's flex_attention ``BlockMask`` attribute counts its tensors so too (``spmd.trace.block_masks``).
Tensors are named as the user's model names them: a ``torch.compile``d block's wrapper adds no
``_orig_mod`` step (``spmd.trace.user_compiled``).

A ``DTensor`` (a sharded parameter or its optimizer state) enters the graph as its
local tensor; tracing wraps the traced local tensor back into a ``DTensor`` with the
same spec (``as_dtensors``), so the step sees what it sees in eager mode.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any, Iterator, Optional, Sequence

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

from ..errors import SpmdCompileError
from ..optim.amp_scaler import SCALER_TENSORS, scaler_signature
from ..optim.hyperparams import LearnedFacts, group_signature, hyper_items, read
from .step_reach import Place, Reach
from .block_masks import mask_signature, mask_tensors, module_block_masks
from .user_compiled import plain_name


# what a buffer slot of the state is (``StepState.buffer_kinds``): a module's buffer, a module's plain tensor
# attribute, or a tensor the step reaches outside its arguments and modules (``spmd.trace.step_reach``)
BUFFER, ATTRIBUTE, HELD = "buffer", "tensor attribute", "held tensor"


@dataclass(frozen=True)
class HyperSlot:
    """One numeric hyperparameter of a param group, a graph input (``Role.HYPER``).

    ``index`` is the position inside a tuple value (``betas``), else None. ``dtype`` is
    float64, the dtype eager's Python-float scalar math runs in (a tensor value keeps its
    own dtype, as eager computes with it), except a fused CUDA kernel's ``lr`` (those
    kernels read it as float32). ``device``: where the group's step
    counters live (CPU for a non-capturable CUDA optimizer), else its parameters' device.
    """

    optim: int
    group: int
    key: str
    index: Optional[int]
    dtype: torch.dtype
    device: torch.device

    @property
    def name(self) -> str:
        suffix = "" if self.index is None else f".{self.index}"
        return f"opt{self.optim}.group{self.group}.{self.key}{suffix}"


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """The tensor a graph input holds for ``t``: its local tensor if ``t`` is a DTensor, else ``t``."""
    return t._local_tensor if isinstance(t, DTensor) else t


def _spec(t: torch.Tensor):
    return t._spec if isinstance(t, DTensor) else None


def sharding_signature(spec) -> tuple:
    """What a graph specialises on in a DTensor's spec: its global shape, placements and mesh (as the
    values ``mesh_signature`` gives, not the ``DeviceMesh`` object)."""
    return tuple(spec.shape), spec.placements, mesh_signature(spec.mesh)


# mesh -> mesh_signature(mesh), a memo (the fast path builds sharding signatures on every call); weak, so it
# holds only live meshes
_MESHES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def mesh_signature(mesh) -> tuple:
    """A ``DeviceMesh`` as values: device type, shape, dim names and rank layout, the same on every rank
    and in every process (``DeviceMesh`` equality compares these, and the creating thread)."""
    sig = _MESHES.get(mesh)
    if sig is None:
        sig = _MESHES[mesh] = (mesh.device_type, tuple(mesh.shape), tuple(mesh.mesh_dim_names or ()),
                               tuple(mesh.mesh.flatten().tolist()))
    return sig


def find_modules_and_optimizers(found: Reach) -> tuple[list[nn.Module], list[torch.optim.Optimizer]]:
    """The distinct modules and optimizers a step reaches (``spmd.trace.step_reach``), in the order found."""
    if not found.modules:
        raise SpmdCompileError(
            "spmd.compile: train_step reaches no nn.Module: none is among its arguments, held by an object among "
            "them, by its self, its closure or the globals it names. Pass the model you train as an argument, "
            "e.g. train_step(model, optim, batch)."
        )
    return found.modules, found.optimizers


class StepState:
    """The parameters, buffers and optimizer state of one compiled train step, in graph order.

    ``learned``: what the step's traces learned about its optimizers' hyperparameters
    (``spmd.optim.hyperparams.LearnedFacts``), owned by the step: its traces record into it and its signature
    reads it. None: facts of this state alone (a state no step holds, as the optimizer probe's).
    """

    def __init__(self, modules: list[nn.Module], optimizers: list[torch.optim.Optimizer], scalers: Sequence = (),
                 held: Sequence[tuple[str, torch.Tensor, list[Place]]] = (), learned: Optional[LearnedFacts] = None):
        self.modules = modules
        self.learned = learned if learned is not None else LearnedFacts()
        self.optimizers = optimizers
        self.scalers = list(scalers)  # enabled GradScalers: their tensors follow the optimizer state
        self.held = list(held)  # (name, tensor, places) of each tensor the step reaches outside its arguments
        self.params: list[torch.Tensor] = []
        self.param_names: list[str] = []
        self.buffers: list[torch.Tensor] = []
        self.buffer_names: list[str] = []
        # per buffer: BUFFER, ATTRIBUTE (a module's plain tensor attribute, ``self.scale = torch.tensor(2.0)``)
        # or HELD; all are read like buffers
        self.buffer_kinds: list[str] = []
        self._param_index: dict[int, int] = {}
        self._buffer_index: dict[int, int] = {}
        self._module_params: list[tuple[nn.Module, list[tuple[str, int]]]] = []
        self._module_buffers: dict[int, list[tuple[str, int]]] = {}
        # a module's flex_attention BlockMask attribute: (module, attribute, [(mask attribute, buffer index)]);
        # its tensors are read like tensor attributes (``spmd.trace.block_masks``)
        self.block_masks: list[tuple[nn.Module, str, list[tuple[str, int]]]] = []
        self.block_mask_names: list[str] = []
        for m_idx, mod in enumerate(modules):
            prefix = f"m{m_idx}." if len(modules) > 1 else ""
            names = []
            for name, p in mod.named_parameters(remove_duplicate=False):
                if id(p) not in self._param_index:
                    self._param_index[id(p)] = len(self.params)
                    self.params.append(p)
                    self.param_names.append(prefix + plain_name(name))
                names.append((name, self._param_index[id(p)]))
            self._module_params.append((mod, names))
            bnames = []
            named = list(mod.named_buffers(remove_duplicate=False))
            for k, (name, b) in enumerate([*named, *tensor_attributes(mod)]):
                if id(b) not in self._buffer_index:
                    self._add_buffer(prefix + plain_name(name), b, BUFFER if k < len(named) else ATTRIBUTE)
                bnames.append((name, self._buffer_index[id(b)]))
            self._module_buffers[id(mod)] = bnames
            for name, sub, key, mask in module_block_masks(mod):
                held = []
                for attr, t in mask_tensors(mask):
                    if id(t) not in self._buffer_index:
                        self._add_buffer(f"{prefix}{plain_name(name)}.{attr}", t, ATTRIBUTE)
                    held.append((attr, self._buffer_index[id(t)]))
                self.block_masks.append((sub, key, held))
                self.block_mask_names.append(prefix + plain_name(name))
        owned = {id(v) for o in optimizers for st in o.state.values() for v in st.values() if torch.is_tensor(v)}
        owned.update(id(getattr(s, key)) for s in scalers for key in SCALER_TENSORS)
        for name, t, _ in self.held:
            if id(t) not in self._param_index and id(t) not in self._buffer_index and id(t) not in owned:
                self._add_buffer(name, t, HELD)
        self.buffer_specs = [_spec(b) for b in self.buffers]

        self.group_param_indices: list[list[list[int]]] = []
        owner: dict[int, str] = {}
        for o_idx, optim in enumerate(optimizers):
            groups = []
            for g_idx, group in enumerate(optim.param_groups):
                indices = []
                for p in group["params"]:
                    if id(p) not in self._param_index:
                        raise SpmdCompileError(
                            "spmd.compile: an optimizer updates a parameter that belongs to none of the "
                            "modules train_step reaches (its arguments, self, closure, globals). Pass every "
                            "module whose parameters it trains, or keep a loose parameter in an nn.Module."
                        )
                    if id(p) in owner:
                        raise SpmdCompileError(
                            f"spmd.compile: parameter {self.param_names[self._param_index[id(p)]]} is in more "
                            "than one optimizer or param group; give each parameter to one group."
                        )
                    owner[id(p)] = f"{o_idx}.{g_idx}"
                    indices.append(self._param_index[id(p)])
                groups.append(indices)
            self.group_param_indices.append(groups)

        self.param_trained = [p.requires_grad for p in self.params]
        self.param_specs = [_spec(p) for p in self.params]
        # optimizer state tensors, param by param, keys sorted
        self.state_tensors: list[torch.Tensor] = []
        self.state_names: list[str] = []
        self._state_layout: list[list[tuple[str, Any]]] = []  # per param: (key, index-or-constant)
        by_param = {}
        for optim in optimizers:
            for p, st in optim.state.items():
                by_param[id(p)] = st
        # Eager reads a non-capturable optimizer's 0-dim state (step counters) as Python numbers;
        # a capturable one computes with it as tensors, in their dtype (``spmd.optim.hyperparams``).
        capturable = {id(p) for o in optimizers for g in o.param_groups if g.get("capturable") for p in g["params"]}
        self.state_read_as_number: list[bool] = []
        for i, p in enumerate(self.params):
            layout = []
            for key in sorted(by_param.get(id(p), {})):
                value = by_param[id(p)][key]
                if torch.is_tensor(value):
                    layout.append((key, ("tensor", len(self.state_tensors))))
                    self.state_tensors.append(value)
                    self.state_names.append(f"{self.param_names[i]}.{key}")
                    self.state_read_as_number.append(id(p) not in capturable)
                else:
                    layout.append((key, ("const", value)))
            self._state_layout.append(layout)
        for k, scaler in enumerate(self.scalers):
            for key in SCALER_TENSORS:
                self.state_tensors.append(getattr(scaler, key))
                self.state_names.append(f"scaler{k}.{key.lstrip('_')}")
                self.state_read_as_number.append(False)
        self.state_specs = [_spec(t) for t in self.state_tensors]
        self._group_items = {(o, g): hyper_items(group) for o, optim in enumerate(optimizers)
                             for g, group in enumerate(optim.param_groups)}
        self.hyper_slots: list[HyperSlot] = self._hyper_slots()
        flat = {id(t): i for i, t in enumerate((*self.params, *self.buffers, *self.state_tensors))}
        # where each held tensor lies, and its position in ``flat_tensors``: tracing puts the traced one there
        self.held_slots: list[tuple[list[Place], int]] = [(places, flat[id(t)]) for _, t, places in self.held]

    def _add_buffer(self, name: str, tensor: torch.Tensor, kind: str) -> None:
        self._buffer_index[id(tensor)] = len(self.buffers)
        self.buffers.append(tensor)
        self.buffer_names.append(name)
        self.buffer_kinds.append(kind)

    def again(self) -> "StepState":
        """The state laid out anew from the same objects (after optimizer state was created, or
        parameters replaced)."""
        return StepState(self.modules, self.optimizers, self.scalers, self.held, self.learned)

    # -- layout helpers used by tracing ----------------------------------------
    def module_param_names(self) -> Iterator[tuple[nn.Module, list[tuple[str, int]]]]:
        return iter(self._module_params)

    def module_buffer_names(self, mod: nn.Module) -> list[tuple[str, int]]:
        return self._module_buffers[id(mod)]

    def as_dtensors(self, traced: list[torch.Tensor], specs: list, requires_grad: list[bool] | None = None
                    ) -> list[torch.Tensor]:
        """``traced`` local tensors wrapped as DTensors where ``specs`` has a spec (leaves: ``requires_grad``)."""
        out = []
        for i, (t, spec) in enumerate(zip(traced, specs)):
            if spec is not None:
                t = DTensor(t, spec, requires_grad=bool(requires_grad and requires_grad[i]))
            out.append(t)
        return out

    def rebuild_optimizer_states(self, state_tensors: list, params: list) -> list[dict]:
        """Per-parameter state dicts whose tensors are ``state_tensors`` (traced ones)."""
        states = []
        for layout in self._state_layout:
            st = {}
            for key, (kind, value) in layout:
                st[key] = state_tensors[value] if kind == "tensor" else value
            states.append(st)
        return states

    def _group_device(self, optim: torch.optim.Optimizer, indices: list[int]) -> torch.device:
        if not indices:
            return torch.device("cpu")
        step = optim.state.get(self.params[indices[0]], {}).get("step")
        return step.device if torch.is_tensor(step) else self.params[indices[0]].device

    def _hyper_slots(self) -> list[HyperSlot]:
        slots = []
        for o_idx, optim in enumerate(self.optimizers):
            for g_idx, group in enumerate(optim.param_groups):
                device = self._group_device(optim, self.group_param_indices[o_idx][g_idx])
                fused_cuda_lr = bool(group.get("fused")) and device.type == "cuda"
                for key, index, _ in self._group_items[(o_idx, g_idx)]:
                    value = group[key] if index is None else group[key][index]
                    dtype = value.dtype if torch.is_tensor(value) else torch.float64  # eager computes in it
                    dtype = torch.float32 if fused_cuda_lr and key == "lr" else dtype
                    slots.append(HyperSlot(o_idx, g_idx, key, index, dtype, device))
        return slots

    # -- per call ----------------------------------------------------------------
    def owned_tensors(self) -> list[torch.Tensor]:
        """The parameters, buffers (held tensors included) and optimizer state tensors, DTensors as they are, in
        graph order: what the step returns where it returns one of them (``spmd.trace.step_outputs``)."""
        return [*self.params, *self.buffers, *self.state_tensors]

    def flat_tensors(self) -> list[torch.Tensor]:
        """The real tensors (local tensors of DTensors), in graph order, as the compiled graph's leading inputs."""
        return [local_tensor(t) for t in self.owned_tensors()]

    def hyper_values(self) -> list[float]:
        """The current value of each hyperparameter slot, in graph order."""
        groups = [o.param_groups for o in self.optimizers]
        return [read(groups[s.optim][s.group], s.key, s.index) for s in self.hyper_slots]

    def hyper_tensors(self) -> list[torch.Tensor]:
        """Fresh 0-dim tensors holding ``hyper_values()`` (dtype and device per slot)."""
        return [torch.tensor(v, dtype=s.dtype, device=s.device) for s, v in zip(self.hyper_slots, self.hyper_values())]

    def signature(self) -> dict[str, Any]:
        """Everything about the state that the traced graph specialises on, by name.

        A mapping, so that a retrace can say which component changed (``describe_changes``).
        Hyperparameter values are graph inputs and not part of it, except where a trace
        learned that it depends on them (``learned``, ``spmd.optim.hyperparams``): the outcome of each branch
        it took on a hyperparameter, and the value of each one it specialised on. A
        DTensor adds its global shape, placements and mesh.
        """
        sig: dict[str, Any] = {}
        for kinds, names, tensors, specs in (
                (["parameter"] * len(self.params), self.param_names, self.params, self.param_specs),
                (self.buffer_kinds, self.buffer_names, self.buffers, self.buffer_specs),
                (["optimizer state"] * len(self.state_tensors), self.state_names, self.state_tensors,
                 self.state_specs)):
            for kind, name, t, spec in zip(kinds, names, tensors, specs):
                sig[f"{kind} {name}"] = held_tensor_signature(t)
                if spec is not None:
                    sig[f"{kind} {name} sharding"] = sharding_signature(spec)
        for (o_idx, g_idx), items in self._group_items.items():
            optim = self.optimizers[o_idx]
            prefix = f"optimizer {o_idx} " if len(self.optimizers) > 1 else ""
            for what, value in group_signature(optim, optim.param_groups[g_idx], self.learned, items).items():
                sig[f"{prefix}param group {g_idx} {what}"] = value
        for k, scaler in enumerate(self.scalers):
            sig[f"grad scaler {k} settings"] = scaler_signature(scaler)
        for name, (mod, key, _) in zip(self.block_mask_names, self.block_masks):
            sig[f"block mask {name}"] = mask_signature(vars(mod)[key])
        sig["modules in training mode"] = training_modes(self.modules)
        sig["hyperparameter inputs"] = tuple((s.key, s.index, s.dtype, s.device) for s in self.hyper_slots)
        for name, layout in zip(self.param_names, self._state_layout):
            sig[f"optimizer state {name}"] = tuple(key for key, _ in layout)
            for key, (kind, v) in layout:
                if kind == "const":
                    sig[f"optimizer state {name}.{key}"] = repr(v)
        return sig


def tensor_attributes(module: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """(name, tensor) of each plain tensor attribute of ``module`` and its submodules (neither a
    parameter nor a buffer, e.g. ``self.scale = torch.tensor(2.0)``): the step reads them as it
    reads buffers, as graph inputs."""
    return [(f"{prefix}.{key}" if prefix else key, value)
            for prefix, sub in module.named_modules(remove_duplicate=False)
            for key, value in vars(sub).items() if isinstance(value, torch.Tensor) and not isinstance(value, DTensor)]


def training_modes(modules: list[nn.Module]) -> tuple[bool, ...]:
    """Each (sub)module's ``training`` flag, in ``modules()`` order: dropout, batch norm and any
    ``if self.training`` trace differently after ``model.eval()`` or ``model.train()``."""
    return tuple(m.training for mod in modules for m in mod.modules())


TENSOR_FIELDS = ("shape", "dtype", "device", "requires_grad")  # of a tensor the state holds: attributes
INPUT_FIELDS = (*TENSOR_FIELDS, "strides")  # of a tensor the step is called with: its layout too


def input_strides(t: torch.Tensor) -> Any:
    """An input's layout as a graph specialises on it: "contiguous", else its strides (0 where a dimension
    has one element, whose stride no kernel reads); a DTensor's local tensor's. A view made in the graph of
    a contiguous batch (``x.reshape``, traced as ``aten.view``) cannot view a transposed one."""
    local = t._local_tensor if isinstance(t, DTensor) else t
    if local.layout != torch.strided:
        return str(local.layout)
    if local.is_contiguous():
        return "contiguous"
    return tuple(s if n > 1 else 0 for s, n in zip(local.stride(), local.shape))


def tensor_signature(t: torch.Tensor) -> tuple:
    """What a graph specialises on in one input tensor, as a plain tuple of ``INPUT_FIELDS``
    (built for every tensor on every call, so as cheap as it gets)."""
    return tuple(t.shape), t.dtype, t.device, t.requires_grad, input_strides(t)


def held_tensor_signature(t: torch.Tensor) -> tuple:
    """What a graph specialises on in a tensor the step's state holds, a plain tuple of ``TENSOR_FIELDS``:
    for a DTensor, its local tensor's shape, dtype and device (the graph input) and the DTensor's own
    ``requires_grad`` (what the step reads: a frozen sharded parameter gets no gradient; its local
    tensor never requires one)."""
    local = t._local_tensor if isinstance(t, DTensor) else t
    return tuple(local.shape), local.dtype, local.device, t.requires_grad


def _is_tensor_signature(value: Any) -> bool:
    return (isinstance(value, tuple) and len(value) in (len(TENSOR_FIELDS), len(INPUT_FIELDS))
            and isinstance(value[1], torch.dtype))


def describe_changes(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    """What differs between two signatures, one phrase per component, in ``new``'s order.

    E.g. ``"param group 0 'momentum' changed 0.9 -> 0.85"``, ``"input 2 shape (4, 32) -> (8, 32)"``.
    """
    out = []
    for name, value in new.items():
        if name not in old:
            out.append(f"{name} is new")
        elif old[name] != value:
            before = old[name]
            if _is_tensor_signature(value) and _is_tensor_signature(before):
                out += [f"{name} {field} {a} -> {b}" for field, a, b in zip(INPUT_FIELDS, before, value) if a != b]
            else:
                out.append(f"{name} changed {before} -> {value}")
    out += [f"{name} is gone" for name in old if name not in new]
    return out

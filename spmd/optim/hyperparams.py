"""Optimizer hyperparameters as graph inputs, and what a trace assumed about them.

Every numeric value of a param group (``lr``, ``betas``, ``momentum``, ``weight_decay``,
``eps``, ...) enters the traced step as a 0-dim float64 tensor (``Role.HYPER``), the
dtype eager computes its Python-float scalar math in. A scheduler that changes one
between steps changes an input, not the graph. Bools, strings and None (``foreach``,
``nesterov``, ``amsgrad``, ...) select code paths and stay part of the signature.

Torch's optimizers are written for Python numbers. While tracing, ``HyperMode`` (a
``TorchFunctionMode``) lets them run on these tensors and compute what eager computes:

* A comparison of a hyperparameter with a number (``if momentum != 0``) evaluates on
  its current value and is recorded as a guard: the step retraces only when a guard's
  outcome changes, never for a value that keeps every branch.
* A hyperparameter that the code turns into a Python number (``int(t)``, ``t.item()``),
  or passes to a fused kernel's ``float`` argument, is used by value and *specialised*:
  its value joins the signature, so a change retraces.
* Ops that only take a number where a tensor now arrives (``alpha=``, ``value=``, a
  foreach op's scalar) are rewritten into the same arithmetic on tensors
  (``spmd.optim.hyper_rewrites``).
* Eager reads a non-capturable optimizer's 0-dim state (step counters, NAdam's
  ``mu_product``) as Python floats (``.item()``); traced, arithmetic on them runs in
  float64 too. An in-place update of such a 0-dim tensor casts its 0-dim operands to the
  tensor's dtype first, as a Python scalar would be.
* A capturable optimizer computes with its on-device 0-dim state as tensors: a
  hyperparameter meeting them takes their dtype, as a Python number does, and
  ``number / t`` is ``t.reciprocal() * number``, as eager's ``Tensor.__rtruediv__``.

Guards and specialisations are facts about the traced code for one optimizer class and set
of flags, learned by tracing it. They belong to the step that traced it (``LearnedFacts``, held by
the step's ``StepState``): its signature reads them before it traces again, and another step, whose
own code may read a hyperparameter another way, is not affected by them.
"""

from __future__ import annotations

import contextvars

import functools
import numbers
import operator
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
import torch.utils._pytree as pytree
from torch.overrides import TorchFunctionMode

from .._torch_version import add_dtensor_list_strategies
from ..graph_utils.optimizer_ops import fused_float_args
from .eager_foreach import EAGER_FOREACH, eager_foreach
from .hyper_rewrites import LIST_FORMS, REWRITES, is_scalar_tensor as _is_scalar_tensor
from .local_shards import on_local_shards

# --- which group values are hyperparameters -----------------------------------------


def _is_number(v) -> bool:
    kind = type(v)
    if kind is float or kind is int:
        return True
    if kind is bool or kind is str or v is None:
        return False
    if isinstance(v, numbers.Real):
        return True
    return isinstance(v, torch.Tensor) and v.dim() == 0 and v.is_floating_point() and not v.requires_grad


def hyper_items(group: dict) -> list[tuple[str, Optional[int], float]]:
    """``(key, index, value)`` for each numeric hyperparameter of ``group`` (index: position in a tuple like betas)."""
    out = []
    for key, value in group.items():
        if key == "params":
            continue
        if _is_number(value):
            out.append((key, None, float(value)))
        elif isinstance(value, (tuple, list)) and value and all(map(_is_number, value)):
            out.extend((key, i, float(v)) for i, v in enumerate(value))
    return out


def read(group: dict, key: str, index: Optional[int]) -> Optional[float]:
    """The current value of one hyperparameter (None if ``group`` has no such entry)."""
    value = group.get(key)
    if index is not None:
        value = value[index] if isinstance(value, (tuple, list)) and index < len(value) else None
    return None if value is None else float(value)


def flags(group: dict, items: Optional[list] = None) -> tuple:
    """The non-numeric values of ``group`` (implementation flags, names): a change retraces.

    ``items``: ``hyper_items(group)`` when the caller has it already.
    """
    numeric = {k for k, _, _ in (hyper_items(group) if items is None else items)}
    return tuple((k, repr(v)) for k, v in sorted(group.items()) if k != "params" and k not in numeric)


# Optimizers whose non-capturable step traces in eager's arrangement of the update, so the trace
# rounds as eager does in every dtype: the single-tensor step as written (under compile torch's
# ``_get_value`` hands it the step counter as a tensor), the foreach step as
# ``spmd.optim.eager_foreach`` computes it. Others trace their capturable arrangement, the same update
# computed on tensors (some read a value otherwise: RAdam, ASGD).
# Sharded parameters' in-place list ops run on their local tensors; False only inside the test hook
# ``spmd._testing.optimizer_list_ops_through_dtensor``, which compares the two.
LOCAL_SHARDS: contextvars.ContextVar[bool] = contextvars.ContextVar("spmd_local_shards", default=True)

_EAGER_ARRANGEMENT = (torch.optim.Adam, torch.optim.AdamW)


def traced_capturable(optim: torch.optim.Optimizer, group: dict):
    """The ``capturable`` flag ``group`` is traced with (its ``foreach`` already resolved): where
    eager's own non-capturable arrangement traces (``_EAGER_ARRANGEMENT``) False, or for a foreach
    group ``EAGER_FOREACH``; else True."""
    eager = (type(optim) in _EAGER_ARRANGEMENT and not group.get("fused")
             and not group.get("differentiable") and not group.get("capturable"))
    if not eager:
        return True
    return EAGER_FOREACH if group.get("foreach") else False


# --- what traces learned ----------------------------------------------------------------

_COMPARE = {"eq": operator.eq, "ne": operator.ne, "lt": operator.lt, "le": operator.le,
            "gt": operator.gt, "ge": operator.ge}


@dataclass
class Learned:
    """What traces of one optimizer class with one set of flags assumed about its hyperparameters."""

    guards: set = field(default_factory=set)      # (key, index, comparison name, constant)
    specialised: set = field(default_factory=set)  # (key, index)


@dataclass
class LearnedFacts:
    """What the traces of one compiled step learned about its optimizers' hyperparameters: a ``Learned`` per
    optimizer class and set of flags (``flags``).

    The step owns it: tracing records into it (``of``), the step's signature reads it (``group_signature``)
    and a kept trace stores the part its optimizers stood on (``spmd.step.trace_store``). Facts only grow: a
    guard once taken stays in the signature.
    """

    by_config: dict = field(default_factory=dict)  # (optimizer class, flags) -> Learned

    def of(self, optim: torch.optim.Optimizer, group: dict) -> Learned:
        """The facts of ``group``'s configuration, where a trace records what it assumes."""
        return self.by_config.setdefault((type(optim), flags(group)), Learned())

    def for_optimizers(self, optimizers: list) -> LearnedFacts:
        """A copy of the facts about these optimizers' param groups (what a trace of them stood on)."""
        keys = {(type(o), flags(g)) for o in optimizers for g in o.param_groups}
        return LearnedFacts({k: Learned(set(v.guards), set(v.specialised)) for k, v in self.by_config.items()
                             if k in keys})

    def update(self, other: LearnedFacts) -> None:
        """Add ``other``'s facts (a kept trace's, reused)."""
        for key, facts in other.by_config.items():
            known = self.by_config.setdefault(key, Learned())
            known.guards |= facts.guards
            known.specialised |= facts.specialised


def group_signature(optim: torch.optim.Optimizer, group: dict, learned: LearnedFacts,
                    items: Optional[list] = None) -> dict[str, Any]:
    """What a traced step specialises on in ``group``, by name: its flags (``'foreach'``), and where the
    step's traces learned them (``learned``), the outcome of each guard (``momentum != 0``) and each
    specialised value (``betas[0]``)."""
    group_flags = flags(group, items)
    sig: dict[str, Any] = {repr(k): v for k, v in group_flags}
    facts = learned.by_config.get((type(optim), group_flags))
    if facts is not None:
        sig.update(assumptions(group, facts))
    return sig


def assumptions(group: dict, facts: Learned) -> dict[str, Any]:
    """What ``facts`` assume of ``group``'s values now, by name: each guard's outcome (``momentum ne 0.0``)
    and each specialised value (``betas[0]``)."""
    sig: dict[str, Any] = {}
    for key, index, name, const in sorted(facts.guards, key=repr):
        value = read(group, key, index)
        sig[f"{_slot(key, index)} {name} {const}"] = value is not None and _COMPARE[name](value, const)
    for key, index in sorted(facts.specialised, key=repr):
        sig[_slot(key, index)] = read(group, key, index)
    return sig


def _slot(key: str, index: Optional[int]) -> str:
    return key if index is None else f"{key}[{index}]"


# --- tracing --------------------------------------------------------------------------


@dataclass
class TracedHyper:
    """A hyperparameter input of a trace: where it lives and its value at trace time."""

    facts: Learned
    key: str
    index: Optional[int]
    value: float


def _by_name(names: set[str], *owners) -> set:
    return {getattr(owner, n) for owner in owners for n in names if hasattr(owner, n)}


_COMPARISONS = {f: name for name in _COMPARE for f in _by_name({name, f"__{name}__"}, torch.Tensor, torch)}
_TO_NUMBER = {torch.Tensor.item: float, torch.Tensor.__float__: float, torch.Tensor.__int__: int,
              torch.Tensor.__index__: int, torch.Tensor.tolist: float}
_ARITHMETIC = {"add", "sub", "mul", "div", "true_divide", "pow", "neg", "sqrt", "reciprocal", "maximum",
               "minimum", "where", "clamp", "lerp", "rsub", "square", "exp", "log", "abs", "sign",
               "__add__", "__radd__", "__sub__", "__rsub__", "__mul__", "__rmul__", "__truediv__",
               "__rtruediv__", "__pow__", "__rpow__", "__neg__", "__abs__"}


_WHERE = _by_name({"where"}, torch.Tensor, torch)


def _name(func) -> str:
    return getattr(func, "__name__", "")


def _is_inplace(func) -> bool:
    name = _name(func)
    return (name.endswith("_") and not name.endswith("__")) or (name.startswith("__i") and name.endswith("__"))


class HyperMode(TorchFunctionMode):
    """Runs optimizer code on hyperparameter tensors as eager runs it on Python floats (module docstring).

    Active only inside ``Optimizer.step``. ``hypers`` maps ``id`` of each traced
    hyperparameter tensor to its ``TracedHyper``; ``state_scalars`` are the traced 0-dim
    optimizer state tensors (step counters, ...) that eager reads with ``.item()``.

    Both are Python numbers in eager, and so is anything computed from them alone
    (``numbers``). Where such a value meets 0-dim tensors that are not numbers (the
    on-device step counters of a capturable optimizer, a hyperparameter the user gave as a
    float32 tensor), eager's type promotion lets the tensor's dtype win; the traced float64
    value is cast to it, so the arithmetic runs in the dtype eager's does
    (``_as_python_numbers``). A hyperparameter input of a dtype other than float64 is such a
    tensor: a Python number enters the trace as float64, a tensor in its own dtype.

    Sharded parameters' in-place list ops run on their local tensors (``spmd.optim.local_shards``), unless
    the test hook ``spmd._testing.optimizer_list_ops_through_dtensor`` sends them through DTensor (to compare).
    """

    def __init__(self, hypers: dict[int, TracedHyper], state_scalars: list[torch.Tensor]):
        super().__init__()
        self.hypers = hypers
        self.state_scalars = {id(t) for t in state_scalars if t.dim() == 0 and t.is_floating_point()}
        self.numbers = set(hypers) | self.state_scalars
        self._alive = list(state_scalars)  # keeps the ids valid
        self._patches: list = []  # ``eager_foreach`` while active

    def __enter__(self):
        add_dtensor_list_strategies(LIST_FORMS)  # for DTensor parameters on torch 2.11: what ``REWRITES`` makes
        self._patches.append(eager_foreach())
        self._patches[-1].__enter__()
        return super().__enter__()

    def __exit__(self, exc_type, exc_value, traceback):
        try:
            return super().__exit__(exc_type, exc_value, traceback)
        finally:
            self._patches.pop().__exit__(None, None, None)

    def _hyper(self, v) -> Optional[TracedHyper]:
        return self.hypers.get(id(v)) if isinstance(v, torch.Tensor) else None

    def specialise(self, h: TracedHyper) -> float:
        h.facts.specialised.add((h.key, h.index))
        return h.value

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _COMPARISONS and len(args) == 2 and not kwargs:
            h = self._hyper(args[0])
            if h is not None and isinstance(args[1], numbers.Real):
                name = _COMPARISONS[func]
                h.facts.guards.add((h.key, h.index, name, float(args[1])))
                return _COMPARE[name](h.value, args[1])
        if func is torch.Tensor.to and args and self._hyper(args[0]) is not None:
            return self._moved_only(args, kwargs)
        if args and self._hyper(args[0]) is not None:
            h = self._hyper(args[0])
            if func is torch.Tensor.__bool__:
                h.facts.guards.add((h.key, h.index, "ne", 0.0))
                return h.value != 0
            if func in _TO_NUMBER:
                return _TO_NUMBER[func](self.specialise(h))
        fused = fused_float_args(func)
        if fused:
            kwargs = {k: self.specialise(self._hyper(v)) if k in fused and self._hyper(v) else v
                      for k, v in kwargs.items()}
        tensors = [x for x in pytree.tree_leaves((args, kwargs)) if isinstance(x, torch.Tensor)]
        for t in tensors:
            if id(t) in self.hypers and t.dtype != torch.float64:
                self.numbers.discard(id(t))  # a tensor in eager too (the user's float32 lr)
        numbers_only = bool(tensors) and all(id(t) in self.numbers for t in tensors)
        number_divides = (func in _DIVISIONS and len(args) == 2 and not kwargs and id(args[0]) in self.numbers
                          and isinstance(args[1], torch.Tensor) and id(args[1]) not in self.numbers)
        if not numbers_only:
            args, kwargs = self._as_python_numbers(tensors, args, kwargs, _is_inplace(func))
        if number_divides:  # eager: ``number / t`` is ``t.__rtruediv__(number)``, which is ``t.reciprocal() * number``
            return args[1].reciprocal() * args[0]
        if numbers_only and func in _REVERSE_DIVISIONS and len(args) == 2 and isinstance(args[1], numbers.Real):
            # eager: ``2 / x`` of two Python numbers, one division (not torch's reciprocal-then-multiply)
            out = torch.as_tensor(args[1], dtype=args[0].dtype, device=args[0].device).div(args[0])
            self.numbers.add(id(out))
            self._alive.append(out)
            return out
        args, kwargs = _scalar_dtypes(func, args, kwargs, self.state_scalars)
        args = _scalars_on_element_devices(func, args)
        rewrite = REWRITES.get(func)
        out = rewrite(func, args, kwargs) if rewrite is not None else NotImplemented
        if out is NotImplemented and LOCAL_SHARDS.get():
            out = on_local_shards(func, args, kwargs)
        if out is NotImplemented:
            out = func(*args, **kwargs)
        if (func in _WHERE and numbers_only and _is_scalar_tensor(out) and out.is_floating_point()
                and out.dtype != torch.float64):
            out = out.to(torch.float64)  # where(c, 0.0, 1.0): Python numbers in eager, not default-dtype tensors
        if numbers_only and not _is_inplace(func):
            made = [x for x in pytree.tree_leaves(out) if isinstance(x, torch.Tensor)]
            self.numbers.update(map(id, made))
            self._alive += made
        return out

    def _moved_only(self, args: tuple, kwargs: dict) -> torch.Tensor:
        """``hyper.to(device, dtype)``: eager holds a Python number there, which optimizer code converts
        only when it is a tensor (Adam's ``beta1.to(param.dtype)``); rounding it to a parameter's
        dtype would change the math. It moves to the device and keeps its dtype."""
        t = args[0]
        device = kwargs.get("device")
        for a in args[1:]:
            if isinstance(a, (torch.device, str)):
                device = a
            elif isinstance(a, torch.Tensor):
                device = a.device
        if device is None or torch.device(device) == t.device:
            return t
        out = t.to(torch.device(device))
        self.numbers.add(id(out))
        self._alive.append(out)
        return out

    def _as_python_numbers(self, tensors: list, args: tuple, kwargs: dict, inplace: bool) -> tuple[tuple, dict]:
        """Cast the floating number operands of an op whose other tensors are all 0-dim to those
        tensors' dtype, as a Python number takes the dtype of the tensor it meets; beside integer or bool
        tensors only, to the default dtype, as a Python float makes their result."""
        others = [t for t in tensors if id(t) not in self.numbers]
        if len(others) == len(tensors):
            return args, kwargs
        floats = [t.dtype for t in others if t.is_floating_point() or t.is_complex()]
        if not floats:  # integer or bool tensors: a Python float makes the result the default dtype
            target = torch.get_default_dtype()
        elif any(t.dim() != 0 for t in others):
            return args, kwargs  # a dimensioned floating tensor's dtype wins over a 0-dim one's already
        else:
            target = functools.reduce(torch.promote_types, floats)

        def cast(x):
            if isinstance(x, torch.Tensor) and id(x) in self.numbers and x.is_floating_point() and x.dtype != target:
                return x.to(target)
            return x

        if inplace and args:  # the target is written, not read as a number: it stays (a cast would write a copy)
            return (args[0], *pytree.tree_map(cast, args[1:])), pytree.tree_map(cast, kwargs)
        return pytree.tree_map(cast, args), pytree.tree_map(cast, kwargs)


_DIVISIONS = {torch.Tensor.__truediv__, torch.Tensor.__div__, torch.Tensor.div, torch.div, torch.true_divide}
_REVERSE_DIVISIONS = {torch.Tensor.__rtruediv__, torch.Tensor.__rdiv__}
_TENSOR1_OPS = {getattr(torch, n) for n in ("_foreach_addcmul", "_foreach_addcmul_", "_foreach_addcdiv",
                                             "_foreach_addcdiv_")}


def _scalars_on_element_devices(func, args: tuple) -> tuple:
    """``_foreach_addcmul``/``_foreach_addcdiv`` with the CPU 0-dim entries of ``tensor1`` moved to
    the device of ``self``'s element at the same position.

    Traced, values eager computes as Python numbers are 0-dim CPU tensors (arithmetic on the
    hyperparameters of a non-capturable optimizer). CUDA kernels take a CPU 0-dim operand
    in most positions, but not as these ops' ``tensor1``. The values stay the same; only
    where they live changes.
    """
    if func not in _TENSOR1_OPS or len(args) < 2:
        return args
    first, tensor1 = args[0], args[1]
    if not isinstance(first, (list, tuple)) or not isinstance(tensor1, (list, tuple)) or len(first) != len(tensor1):
        return args
    moved = [o.to(t.device) if _is_scalar_tensor(o) and o.device.type == "cpu" and isinstance(t, torch.Tensor)
             and t.device.type != "cpu" else o for t, o in zip(first, tensor1)]
    return (first, moved, *args[2:])


def _scalar_dtypes(func, args, kwargs, state_scalars: set[int]):
    """Arithmetic reads 0-dim state as float64; an in-place update casts 0-dim operands to its target's dtype."""
    if _is_inplace(func) and args:
        target = args[0]
        if isinstance(target, (list, tuple)) and len(args) > 1 and isinstance(args[1], (list, tuple)):
            other = [o.to(t.dtype) if _is_scalar_tensor(t) and _is_scalar_tensor(o) and o.dtype != t.dtype else o
                     for t, o in zip(target, args[1])]
            return (args[0], other, *args[2:]), kwargs
        if isinstance(target, (list, tuple)) and target and all(map(_is_scalar_tensor, target)):
            target = target[0]  # 0-dim targets of one dtype (a list of step counters): cast the scalar operand
        if _is_scalar_tensor(target):
            cast = (lambda o: o.to(target.dtype) if _is_scalar_tensor(o) and o.dtype != target.dtype else o)
            return (args[0], *map(cast, args[1:])), {k: cast(v) for k, v in kwargs.items()}
        return args, kwargs
    name = _name(func)
    if name not in _ARITHMETIC and not (name.startswith("_foreach_") and not _is_inplace(func)):
        return args, kwargs

    flat = [x for v in (*args, *kwargs.values()) for x in (v if isinstance(v, (list, tuple)) else [v])]
    if any(isinstance(x, torch.Tensor) and x.dtype == torch.float64 for x in flat):
        return args, kwargs  # a float64 operand: type promotion already computes in float64

    def up(v):
        if isinstance(v, (list, tuple)):
            return type(v)(up(x) for x in v)
        if id(v) in state_scalars and v.dtype != torch.float64:
            return v.to(torch.float64)
        return v

    return tuple(map(up, args)), {k: up(v) for k, v in kwargs.items()}

"""A hyperparameter the step's own code reads (``optim.param_groups[0]["lr"]``), as eager's Python number.

While a step is traced, every numeric hyperparameter of a param group is a 0-dim float64 tensor, an input of
the graph (``spmd.optim.hyperparams``), and ``HyperMode`` runs the optimizer's code on it as eager runs it on a
Python float. The step's own code may read one too: a loss scaled by the lr, a log line, a warmup test. In
eager it holds a Python number there, and a 0-dim float64 tensor behaves otherwise:

* type promotion: ``loss * lr`` of a 0-dim float32 loss is float32 in eager and was float64 traced, as was
  ``torch.arange(n) * lr``; ``torch.tensor(lr)`` is a tensor of the default dtype in eager;
* values: ``float(lr)``, ``math.sqrt(lr)``, ``f"{lr:.2e}"`` and ``if lr > 1e-3`` read its value, which
  failed as "reads the value of a tensor", a value the running step knows before it starts.

``HyperReads`` is a torch function mode over the step's code, paused inside ``Optimizer.step`` (where
``HyperMode`` runs). An op that touches a hyperparameter, or a number computed from them alone, goes through
``HyperMode``'s rules: arithmetic casts the number to the dtype of the tensors it meets, as type promotion does
for a Python number; a comparison with a number is a guard (the step is traced again only when its outcome
changes); a conversion to a Python number uses the value, which then joins the step's signature, so each new
value traces the step again. That is said once, at the line that read it, with the fix: keep it a tensor.
A number the step computes from hyperparameters alone (``1 - beta2``) carries its value too, so it converts
likewise; only one computed inside the optimizer's step has none, and converting it is refused.
"""

from __future__ import annotations

import contextlib
import sys
from typing import Callable, Iterator, Optional

import torch
import torch.utils._pytree as pytree
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import _disable_current_modes

from ..errors import SpmdCompileError
from ..optim.hyperparams import HyperMode, TracedHyper
from .host_reads import is_library, warn_at

_CONSTRUCTORS = {torch.tensor, torch.as_tensor}
_CONVERSIONS = {torch.Tensor.item, torch.Tensor.__float__, torch.Tensor.__int__, torch.Tensor.__index__,
                torch.Tensor.tolist, torch.Tensor.__bool__, torch.Tensor.__format__}


def _slot(h: TracedHyper) -> str:
    return repr(h.key) if h.index is None else f"{h.key!r}][{h.index}"


def _user_frame():
    """The innermost frame of the user's code on this thread's stack, or None (a library read it)."""
    frame = sys._getframe(2)
    while frame is not None and is_library(frame.f_globals.get("__name__") or ""):
        frame = frame.f_back
    return frame


class HyperReads(TorchFunctionMode):
    """Runs the step's own code on hyperparameter tensors as eager runs it on Python numbers (module docstring).

    ``rules`` is the trace's ``HyperMode``: its hyperparameters and the numbers computed from them alone.
    ``paused`` counts the ``Optimizer.step`` calls in progress, whose code ``rules`` sees itself. ``values``
    holds, for each number the step's code computed from hyperparameters alone (``1 - beta2``), its value (a
    real 0-dim tensor, computed as the graph computes it) and the hyperparameters it was computed from.
    """

    def __init__(self, rules: HyperMode):
        super().__init__()
        self.rules = rules
        self.paused = 0
        self.values: dict[int, tuple[torch.Tensor, tuple[TracedHyper, ...]]] = {}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.paused:
            return func(*args, **kwargs)
        if func in _CONVERSIONS and args and (id(args[0]) in self.rules.hypers or id(args[0]) in self.rules.numbers):
            return self._converted(func, args, kwargs)  # a hyperparameter kept as a tensor (a float32 lr) too
        if not self._touches_number(args, kwargs) or torch.compiler.is_dynamo_compiling():
            return func(*args, **kwargs)
        if func in _CONSTRUCTORS and args and id(args[0]) in self.rules.numbers:
            return self._constructed(func, args, kwargs)
        if args and id(args[0]) in self.rules.numbers and _out_of_place(func) is not None:
            func = _out_of_place(func)  # ``lr *= 0.5`` (``mul_``) rebinds a Python float: nothing is written
        out = self.rules.__torch_function__(func, types, args, kwargs)
        self._note_value(func, args, kwargs, out)
        return out

    def _touches_number(self, args: tuple, kwargs: dict) -> bool:
        numbers = self.rules.numbers
        for value in (*args, *kwargs.values()) if kwargs else args:
            if isinstance(value, (list, tuple)):
                if any(isinstance(v, torch.Tensor) and id(v) in numbers for v in value):
                    return True
            elif isinstance(value, torch.Tensor) and id(value) in numbers:
                return True
        return False

    def _value(self, t: torch.Tensor) -> Optional[tuple[torch.Tensor, tuple[TracedHyper, ...]]]:
        h = self.rules.hypers.get(id(t))
        if h is not None:
            with _real_tensors():
                return torch.tensor(h.value, dtype=t.dtype), (h,)
        return self.values.get(id(t))

    def _note_value(self, func, args: tuple, kwargs: dict, out) -> None:
        """Where every tensor ``func`` read is a number with a value, the value of each of its results."""
        read = [x for x in pytree.tree_leaves((args, kwargs)) if isinstance(x, torch.Tensor)]
        made = [x for x in pytree.tree_leaves(out) if isinstance(x, torch.Tensor)]
        known = {id(t): self._value(t) for t in read}
        if not made or None in known.values() or not all(id(t) in self.rules.numbers for t in made):
            return
        sources = tuple({id(h): h for _, hs in known.values() for h in hs}.values())
        real = (lambda x: known[id(x)][0] if isinstance(x, torch.Tensor) else x)
        with _real_tensors():
            values = [x for x in pytree.tree_leaves(func(*pytree.tree_map(real, args),
                                                         **pytree.tree_map(real, kwargs)))
                      if isinstance(x, torch.Tensor)]
        self.values.update((id(t), (v, sources)) for t, v in zip(made, values))

    def _constructed(self, func, args: tuple, kwargs: dict) -> torch.Tensor:
        """``torch.tensor(lr)``: a new tensor of the default dtype (or the one asked for), as of a Python number."""
        if len(args) > 1 or set(kwargs) - {"dtype", "device"}:
            return func(*args, **kwargs)
        number = args[0]
        dtype = kwargs.get("dtype") or (torch.get_default_dtype() if number.is_floating_point() else number.dtype)
        return number.detach().to(device=kwargs.get("device") or number.device, dtype=dtype, copy=True)

    def _converted(self, func, args: tuple, kwargs: dict):
        """A Python number from hyperparameters: its value, each of them specialised (said once at the reading
        line). A comparison's outcome read by ``if`` on a hyperparameter itself is a guard instead."""
        h = self.rules.hypers.get(id(args[0]))
        if func is torch.Tensor.__bool__ and h is not None:
            return self.rules.__torch_function__(func, (), args, kwargs)  # a guard: ``lr != 0``
        known = self._value(args[0])
        if known is None:
            raise _derived_number_read()
        value, sources = known
        frame = _user_frame()
        for source in sources:
            self.rules.specialise(source)
            if frame is not None:
                _warn_specialised(frame, source)
        with _real_tensors():
            return func(value, *args[1:], **kwargs)


def _out_of_place(func) -> Optional[Callable]:
    """``Tensor.add`` for ``Tensor.add_`` (what ``+=`` on a tensor calls), else None."""
    name = getattr(func, "__name__", "")
    if not name.endswith("_") or name.endswith("__"):
        return None
    return getattr(torch.Tensor, name[:-1], None)


@contextlib.contextmanager
def _real_tensors() -> Iterator[None]:
    """No tracer, fake tensor mode or torch function mode: ops on plain tensors compute values."""
    with _disable_current_modes(), torch._C.DisableTorchFunction():
        yield


def _warn_specialised(frame, h: TracedHyper) -> None:
    warn_at(frame, f"spmd.compile: the step reads the optimizer hyperparameter [{_slot(h)}] as a Python number "
                   f"at {frame.f_code.co_filename}:{frame.f_lineno} (float(), .item(), math, formatting or a test "
                   "of a value computed from it): the compiled step keeps the value it read, so each new value "
                   "traces the step again (an lr scheduler would retrace every call). Keep it a tensor, e.g. "
                   "loss * optim.param_groups[0]['lr'], which reads the value of each call as an input of the "
                   "compiled step, or read it outside the step.")


def _derived_number_read() -> SpmdCompileError:
    return SpmdCompileError(
        "spmd.compile: train_step reads as a Python number a value computed from an optimizer hyperparameter "
        "inside the optimizer's step; its value is known only as the step runs. Read the hyperparameter itself "
        "(float(optim.param_groups[0]['lr'])), or keep the value a tensor.")


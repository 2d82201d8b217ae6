"""What the user hears when the step does something a traced graph cannot hold.

A train step runs once, on fake tensors, while it is traced; torch then fails deep inside
with messages about its own machinery (``SymIntArrayRef expected to contain only concrete
integers``, ``FakeTensor.__format__``), or, worse, does not fail: ``print(loss)`` prints a
placeholder once and never again. ``reporting`` wraps the tracer so that:

* the errors torch raises for steps that cannot be one graph become ``SpmdCompileError``s
  naming the cause and the fix (``translate``): shapes that depend on tensor values
  (``nonzero``, ``x[mask]``, ``ctc_loss``: the aten op and the user's line that called it, where
  torch's traceback holds them), a tensor that is none of the step's inputs (a global), a
  ``torch.distributed.nn`` collective spmd does not trace, a tensor formatted as text, tensors on two devices, a
  tensor passed where torch needs a Python number (``pack_padded_sequence``'s lengths); a shape that
  depends on tensor values which fake tensors let through as a size symbol is refused alike, naming
  the op (``refuse_data_dependent_shapes``, on the traced graph);
* a tensor turned into text by the user's code while tracing (``print(loss)``) warns, once
  per place, that it printed a placeholder and will print nothing on later calls;
* torch's own log of the failed fake kernel (a long traceback on stderr) stays quiet while
  the error is translated; the original error remains the ``__cause__``. A translator that fails
  itself leaves torch's error as it was (``translated``).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import re
import sys
import traceback
import warnings
from typing import Callable, Iterator, Optional

import torch
import torch.fx as fx
import torch.utils._pytree as pytree

from .._torch_version import FAKE_DEVICE_MISMATCH_TEXTS
from ..errors import SpmdCompileError
from .host_reads import warn_at
from .dist_nn import TRACEABLE_DIST_NN

log = logging.getLogger(__name__)

_DATA_DEPENDENT_SHAPE = ("SymIntArrayRef expected to contain only concrete integers", "DynamicOutputShapeException",
                         "dynamic output shape", "unbacked symint", "Could not guard on data-dependent expression u",
                         "aten.nonzero", "aten.masked_select", "aten._unique")


# where torch's and spmd's code lives: a frame elsewhere is the user's
_LIBRARIES = tuple(os.path.dirname(sys.modules[name].__file__) + os.sep for name in ("torch", __package__.split(".")[0]))
# ops whose output has as many elements as some tensor values select: masking keeps the shape fixed
_SELECTING_OPS = ("aten.nonzero", "aten.argwhere", "aten.masked_select", "aten.index", "aten._unique", "aten._unique2",
                  "aten.unique_dim", "aten.unique_consecutive", "aten.repeat_interleave")


def op_name(op) -> str:
    """An aten op as users find it in torch's docs and traces: ``aten._ctc_loss`` (its overload packet)."""
    return str(getattr(op, "overloadpacket", op))


def user_line(tb) -> str:
    """`` at FILE:LINE (`code`)``: the innermost frame of traceback ``tb`` outside torch and spmd (the user's
    call into torch), or "" when there is none."""
    frames = [f for f in traceback.extract_tb(tb) if not f.filename.startswith(_LIBRARIES)]
    if not frames:
        return ""
    frame = frames[-1]
    return f" at {frame.filename}:{frame.lineno}" + (f" (`{frame.line}`)" if frame.line else "")


def data_dependent_shape_error(op=None, where: str = "") -> SpmdCompileError:
    """The refusal of a tensor whose shape depends on tensor values, naming ``op`` (the aten op that made it)
    and ``where`` (``user_line``) where known, and the fix for that kind of op."""
    selecting = op is None or op_name(op) in _SELECTING_OPS
    examples = " (like those of nonzero, boolean-mask indexing x[mask], masked_select, unique)" if selecting else ""
    made = "makes a tensor" if op is None else f"calls {op_name(op)}{where}, which makes a tensor"
    what = f"{made} whose shape depends on tensor values{examples}{where if op is None else ''}"
    if selecting:
        fix = ("Keep shapes fixed: compute on every element and mask the result, e.g. torch.where(mask, x, 0).sum() "
               "or (x * mask).sum() / mask.sum() instead of x[mask].sum().")
    else:
        fix = (f"To keep {op_name(op)}, make the call one opaque op: wrap the code that calls it in a "
               "torch.library.custom_op, with register_fake returning its output's shape (and register_autograd "
               "for its gradient).")
    return SpmdCompileError(f"spmd.compile: train_step {what}; a compiled step is one graph in which every shape "
                            f"is fixed when it is traced. {fix}")


def refuse_data_dependent_shapes(gm: fx.GraphModule) -> None:
    """Raise ``data_dependent_shape_error`` where a traced value's shape is a symbol the trace could not fix
    (fake tensors let ``x[mask]`` through with an unbacked size; the graph would not be one of fixed shapes)."""
    from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

    shaped = (torch.Tensor, torch.SymInt, torch.SymFloat, torch.SymBool)
    for node in gm.graph.nodes:
        for v in pytree.tree_leaves(node.meta.get("val")):
            # a tensor of plain int sizes, strides and offset holds no symbol: skip the symbolic walk
            static = isinstance(v, torch.Tensor) and not v._has_symbolic_sizes_strides
            if isinstance(v, shaped) and not static and free_unbacked_symbols(v):
                raise data_dependent_shape_error(node.target if node.op == "call_function" else None)


def translate(err: BaseException) -> Optional[SpmdCompileError]:
    """An ``SpmdCompileError`` naming the cause and the fix for an error torch raised while the step
    was traced, or None when ``err`` is not one this module knows."""
    from torch._subclasses.fake_tensor import DynamicOutputShapeException

    text = str(err)
    if isinstance(err, DynamicOutputShapeException) or any(m in text for m in _DATA_DEPENDENT_SHAPE):
        return data_dependent_shape_error(getattr(err, "func", None), user_line(err.__traceback__))
    refused = re.search(r"torch\.distributed\.nn\.functional\.(\w+) is not supported under torch\.compile"
                        r"(?:\. Use ([\w.]+) instead)?", text)
    if refused:
        name, where = refused.group(1), user_line(err.__traceback__)
        if name in TRACEABLE_DIST_NN:
            return SpmdCompileError(
                f"spmd.compile: train_step calls torch.distributed.nn.functional.{name}{where} through a name "
                "imported before the trace, which stays torch's untraceable version. Call it through its module, "
                f"as torch.distributed.nn.{name}(...) or torch.distributed.nn.functional.{name}(...), which spmd "
                "traces with its autograd.")
        return SpmdCompileError(
            f"spmd.compile: train_step calls torch.distributed.nn.functional.{name}{where}, whose in-place "
            f"collective a traced step cannot hold (spmd traces torch.distributed.nn's {', '.join(TRACEABLE_DIST_NN)}). "
            f"Use {refused.group(2) or 'a collective of torch.distributed._functional_collectives'} instead.")
    outside = re.search(r"Please convert all Tensors to FakeTensors first.*?Found in ([\w.]+)\(", text, re.S)
    if outside:
        return SpmdCompileError(
            f"spmd.compile: train_step computes with a tensor that is none of its inputs ({outside.group(1)}"
            f"{user_line(err.__traceback__)}): one held in a global, a closure or a container, which the compiled "
            "step would not read again. Pass it to train_step as an argument, or keep it on the model (a buffer, "
            "or a plain tensor attribute of a module; a flex_attention BlockMask as an argument or a module "
            "attribute), so that it enters the graph as an input.")
    if isinstance(err, TypeError) and re.search(r"but got (Fake)?Tensor|got FakeTensor", text):
        return SpmdCompileError(
            f"spmd.compile: train_step passes a tensor where torch needs a Python number, a size or a count"
            f"{user_line(err.__traceback__)} (e.g. pack_padded_sequence's lengths, which size the packed batch, or "
            "torch.zeros(n) with a tensor n): only the running step knows that value, and a compiled step is one "
            "graph in which every shape is fixed when it is traced. Keep shapes fixed: run on the padded batch and "
            "mask what lies past each length (an RNN over padded steps, then gather each row's last valid output), "
            "or pass the number to train_step as a Python int (each new value traces again).")
    if isinstance(err, TypeError) and "FakeTensor.__format__" in text:
        return SpmdCompileError(
            "spmd.compile: train_step formats a tensor as text (e.g. f'{loss:.3f}') while it is traced, when the "
            "tensor has no value yet. Return the tensor and format it after the step: "
            "loss = train_step(...); print(f'{loss.item():.3f}')."
        )
    if any(m in text for m in FAKE_DEVICE_MISMATCH_TEXTS):
        devices = sorted(set(re.findall(r"\b(cpu|meta|cuda(?::\d+)?|mps|xpu)\b", text)))
        return SpmdCompileError(
            f"spmd.compile: train_step computes with tensors on different devices ({' and '.join(devices)}). Move "
            "the batch to the model's device before calling train_step, and keep the model's parameters and "
            "buffers on one device (materialize a model built on the meta device first: "
            "model.to_empty(device=...) and initialize it, or load a state dict with assign=True)."
        )
    return None


def translated(translator: Callable[[BaseException], Optional[SpmdCompileError]],
               err: BaseException) -> Optional[SpmdCompileError]:
    """``translator(err)``, or None where the translator itself fails: the user then gets torch's own
    error, never one raised while explaining it (a translator's failure is logged)."""
    try:
        return translator(err)
    except Exception:  # noqa: BLE001 - whatever went wrong, torch's error is the one to raise
        log.warning("spmd: could not translate %s: %s", type(err).__name__, err, exc_info=True)
        return None


_TEXT_PLUMBING = tuple(os.path.join(os.path.dirname(torch.__file__), f) for f in ("_tensor.py", "_tensor_str.py",
                                                                                    "overrides.py")) + (
    os.path.join(os.path.dirname(__file__), "side_effects.py"),)  # its print, which calls the builtin


def _warn_at(frame, message: str) -> None:
    """Warn once per place, attributed to ``frame``'s line."""
    warnings.warn_explicit(message, UserWarning, frame.f_code.co_filename, frame.f_lineno,
                           module=frame.f_globals.get("__name__"),
                           registry=frame.f_globals.setdefault("__warningregistry__", {}))


def _text_asked_by_user() -> Optional[object]:
    """The user's frame when the user's own code asked for a tensor's text (``print(t)``, ``str(t)``,
    ``f'{t}'``: only torch's repr and format plumbing in between), else None (torch asked)."""
    frame = sys._getframe(2)
    while frame is not None and frame.f_code.co_filename in _TEXT_PLUMBING:
        frame = frame.f_back
    if frame is None or frame.f_code.co_filename.startswith(_LIBRARIES):
        return None
    return frame


@contextlib.contextmanager
def _warn_on_text() -> Iterator[None]:
    """Warn where the user's code turns a traced tensor into text (``print(loss)``, ``str(t)``)."""
    from torch._subclasses.fake_tensor import FakeTensor

    had_own = "__repr__" in FakeTensor.__dict__

    def __repr__(self, *args, **kwargs):
        frame = _text_asked_by_user()
        if frame is not None:
            warn_at(frame, "spmd.compile: train_step turns a tensor into text (print(loss), str(t), f'{t}') while "
                    "it is traced: it printed a placeholder (FakeTensor) once, and later calls, which run the "
                    "compiled graph, print nothing. Return the tensor and print it after the step: "
                    "loss = train_step(...); print(loss).")
        return torch.Tensor.__repr__(self, *args, **kwargs)

    if had_own:  # a newer torch with its own repr: leave it alone
        yield
        return
    FakeTensor.__repr__ = __repr__
    try:
        yield
    finally:
        del FakeTensor.__repr__


@contextlib.contextmanager
def _quiet(logger_name: str) -> Iterator[None]:
    logger = logging.getLogger(logger_name)
    level = logger.level
    logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        logger.setLevel(level)


def reporting(trace: Callable) -> Callable:
    """Wrap ``trace(fn, state, args, kwargs, ...)`` (``spmd.trace.capture.trace_train_step``) as the module
    docstring says; the traced result is returned unchanged."""

    @functools.wraps(trace)
    def traced_with_reports(fn, *args, **kwargs):
        try:
            with _warn_on_text(), _quiet("torch._subclasses.fake_tensor"):
                traced = trace(fn, *args, **kwargs)
        except SpmdCompileError:
            raise
        except Exception as err:
            better = translated(translate, err)
            if better is None:
                raise
            raise better from err
        return traced

    return traced_with_reports

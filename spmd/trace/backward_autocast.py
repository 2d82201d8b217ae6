"""The backward's autocast while a step is traced: each op's backward under its forward's, as ``torch.compile`` does.

Eager runs a backward under whatever autocast surrounds the ``backward()`` call: a step that calls it after its
``torch.autocast`` block runs every gradient op outside autocast. Most of them compute in their forward's dtypes
anyway (a bf16 matmul's gradient matmuls read bf16 values), but where the forward computed in float32 inside
the block (SDPA's math path casts q, k and v up) the gradient matmuls run in float32 too. ``torch.compile``
traces each compiled region's backward under the autocast the region's forward ran in
(``torch._functorch.config.backward_pass_autocast = "same_as_forward"``, its default), so those matmuls run in
bf16. spmd reads the same setting and gives the same result, op by op:

- ``"same_as_forward"``: each autograd node's backward runs under the autocast state (per device type: on or
  off, and the dtype) in which its forward ran. An op run inside ``torch.autocast(enabled=False)`` keeps
  autocast off in its backward.
- ``"off"``: every backward op runs without autocast (eager's result for a step calling ``backward()``
  outside its autocast block).
- a list of ``torch.amp.autocast`` keyword dicts: autocast off, then those on, for every backward op.

How: while the step runs under the tracer, a torch function mode notes the autocast state in which each new
autograd node was made (walking the outputs' nodes back to the ones already seen); a pre-hook on each node sets
that state for its backward and a hook after it restores the one before. The setting is part of the torch
settings a compiled step depends on (``spmd.step.dependencies.ambient``).
"""

from __future__ import annotations

import contextlib
import functools
import threading
from typing import Any, Callable, Iterator, Optional

import torch
import torch.utils._pytree as pytree
from torch.overrides import TorchFunctionMode

from ..errors import SpmdConfigError

# (enabled, dtype) for each device type autocast knows on this build, in ``_device_types()`` order
AutocastState = tuple[tuple[bool, torch.dtype], ...]


def setting() -> Any:
    """``torch._functorch.config.backward_pass_autocast``: "same_as_forward" (torch's default), "off" or a list
    of ``torch.amp.autocast`` keyword dicts."""
    import torch._functorch.config as functorch_config

    return getattr(functorch_config, "backward_pass_autocast", "same_as_forward")


@functools.cache
def _device_types() -> tuple[str, ...]:
    return tuple(d for d in ("cpu", "cuda", "xpu", "hpu", "mps") if torch.amp.is_autocast_available(d))


def current_state() -> AutocastState:
    """The autocast state of this thread, per device type."""
    return tuple((torch.is_autocast_enabled(d), torch.get_autocast_dtype(d)) for d in _device_types())


def _apply(state: AutocastState) -> None:
    for device, (enabled, dtype) in zip(_device_types(), state):
        torch.set_autocast_enabled(device, enabled)
        torch.set_autocast_dtype(device, dtype)


def _fixed_state(value: Any) -> AutocastState:
    """The state every backward op runs in under the setting ``value`` ("off" or a list of autocast kwargs)."""
    devices = _device_types()
    state = {d: (False, dtype) for d, (_, dtype) in zip(devices, current_state())}
    if value == "off":
        return tuple(state[d] for d in devices)
    if not isinstance(value, (list, tuple)) or not all(isinstance(k, dict) for k in value):
        raise SpmdConfigError(
            f"spmd.compile: torch._functorch.config.backward_pass_autocast is {value!r}; torch and spmd take "
            "\"same_as_forward\", \"off\" or a list of torch.amp.autocast keyword dicts, e.g. "
            "[{\"device_type\": \"cuda\", \"dtype\": torch.bfloat16}].")
    for kwargs in value:
        kwargs = dict(kwargs)
        device = kwargs.pop("device_type", None) or kwargs.pop("device", None)
        if device not in state:
            raise SpmdConfigError(
                f"spmd.compile: torch._functorch.config.backward_pass_autocast names the device type {device!r}, "
                f"which autocast does not support here ({', '.join(devices)}).")
        if kwargs.get("enabled", True):
            state[device] = (True, kwargs.get("dtype") or torch.get_autocast_dtype(device))
    return tuple(state[d] for d in devices)


def _grad_fn(value: Any) -> Any:
    """``value``'s autograd node, or None: not a tensor, made without one, or a view made under ``no_grad``
    whose base was edited in place (``emb.weight[0].zero_()`` after the optimizer step), whose node autograd
    refuses to make when asked, although eager, never asking, runs such an edit. No backward runs through it."""
    if not isinstance(value, torch.Tensor):
        return None
    try:
        return value.grad_fn
    except RuntimeError:
        return None


class _NotingAutocast(TorchFunctionMode):
    """Notes, for each autograd node made under it, the autocast state it was made in, and hooks the node so
    that its backward runs in ``fixed`` (when given) or in that state."""

    def __init__(self, fixed: Optional[AutocastState]):
        super().__init__()
        self.fixed = fixed
        self.seen: set = set()  # the nodes hooked already; holding them keeps each one's Python object the same
        # per thread (the autograd engine runs a device's nodes on that device's thread): what a pre-hook replaced
        self.saved = threading.local()
        self.hooks: list = []  # removed when the trace is over: a node's hook holds this mode, which holds the node

    def __torch_function__(self, func: Callable, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if torch.compiler.is_dynamo_compiling():  # Dynamo traces the modes it meets (torch's flex_attention on a
            return func(*args, **kwargs)           # GPU compiles its op inside the step): nothing to note there
        self._note(pytree.tree_leaves((args, kwargs)))  # nodes made by code no mode saw (a custom Function)
        out = func(*args, **kwargs)
        self._note(pytree.tree_leaves(out))
        return out

    def _note(self, values: list) -> None:
        frontier = [node for node in map(_grad_fn, values) if node is not None]
        if not frontier:
            return
        state = None
        while frontier:
            node = frontier.pop()
            if node is None or node in self.seen:
                continue
            state = state or (self.fixed or current_state())
            self.seen.add(node)
            if type(node).__name__ != "AccumulateGrad":  # a leaf's accumulation computes nothing autocast casts
                self.hooks += [node.register_prehook(self._enter(state)), node.register_hook(self._leave)]
            frontier.extend(next_node for next_node, _ in node.next_functions)

    def _enter(self, state: AutocastState) -> Callable:
        def enter(grad_outputs):
            # autocast's cache of casts outlives this node (nothing here leaves an autocast block): keep it off
            self._stack().append((current_state(), torch.is_autocast_cache_enabled()))
            torch.set_autocast_cache_enabled(False)
            _apply(state)
        return enter

    def _stack(self) -> list[tuple[AutocastState, bool]]:
        if not hasattr(self.saved, "stack"):
            self.saved.stack = []
        return self.saved.stack

    def _leave(self, grad_inputs, grad_outputs) -> None:
        if self._stack():
            state, cache = self._stack().pop()
            _apply(state)
            torch.set_autocast_cache_enabled(cache)

    def release(self) -> None:
        for hook in self.hooks:
            hook.remove()
        self.hooks.clear()
        self.seen.clear()


@contextlib.contextmanager
def backward_autocast() -> Iterator[None]:
    """Inside: autograd nodes made run their backward under the autocast ``setting()`` asks for (module
    docstring). The thread's autocast state is restored on exit, also after a backward that raised."""
    value = setting()
    fixed = None if value == "same_as_forward" else _fixed_state(value)
    before, cache = current_state(), torch.is_autocast_cache_enabled()
    mode = _NotingAutocast(fixed)
    try:
        with mode:
            yield
    finally:
        mode.release()
        _apply(before)
        torch.set_autocast_cache_enabled(cache)

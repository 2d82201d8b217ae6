"""A checkpoint's recompute reuses its forward's random draws, as eager's RNG restore makes it draw them again.

``torch.utils.checkpoint`` (reentrant or not) saves the global generator's state before the checkpointed
function runs (``torch.get_rng_state``, and the device module's for device tensors) and, when the backward
recomputes the function, restores it inside ``torch.random.fork_rng``: the recompute draws the forward's
dropout masks again, and the generator ends where it was. In a traced step every random op is a node that
draws from the global generator when the graph runs, in the order eager draws; a recompute traced as it
runs adds nodes drawing new masks, so the gradients would belong to another forward than the loss.

``replaying_restored_draws`` notes, while the step is traced, where in the graph each RNG state was handed
out (``get_rng_state``) and set (``set_rng_state``). When the step has run it reads each generator (CPU,
each device) as a sequence of draws, the graph's random nodes in order: a state handed out holds the
position its generator stood at, setting it moves back there, and setting a state the trace did not hand out
leaves the sequence (what follows draws as traced). A random node at a position already drawn is a recompute
drawing again what its forward drew there: it must be the same op on the same shapes and arguments (else the
trace is refused, naming the fix), and it becomes a copy of that draw, taken right after it (a Bernoulli
mask as bool; a dropout's output is its input times the forward's mask times ``1 / (1 - p)``, as ATen
computes it). The graph then draws exactly what eager's generator draws outside its forks, in the same
order, and keeps each reused draw from the forward to the backward. ``preserve_rng_state=False`` restores
nothing: the recompute draws anew, as in eager. A step that hands out no RNG state keeps its graph as
traced. No dispatch mode is involved: the step's ops run under the tracer alone (``flex_attention`` will not
trace under a mode of the user's kind).
"""

from __future__ import annotations

import contextlib
import operator
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Iterator, Optional

import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from torch.fx.experimental.proxy_tensor import disable_proxy_modes_tracing, get_proxy_mode

from ..errors import SpmdCompileError
from ..graph_utils.nodes import set_fake_val
from .host_reads import Patches

aten = torch.ops.aten
_BERNOULLI = (aten.bernoulli, aten.bernoulli_)  # draws of 0 and 1 only: kept as bool, exactly


@dataclass
class _Sequence:
    """A generator's draws (random nodes) in graph order; ``at``: the position it stands at (None: set to a
    state the trace did not hand out)."""

    draws: list = field(default_factory=list)
    at: Optional[int] = 0


def _arguments(op: torch._ops.OpOverload, args: tuple, kwargs: dict) -> Iterator[tuple[Any, Any]]:
    """(schema argument, value) for each argument of ``op``, defaults filled in."""
    for i, arg in enumerate(op._schema.arguments):
        if i < len(args):
            yield arg, args[i]
        else:
            yield arg, kwargs.get(arg.name, arg.default_value if arg.has_default_value() else None)


def _draws(op: torch._ops.OpOverload, args: tuple, kwargs: dict) -> bool:
    """Whether ``op`` draws from the global generator: a seeded op without its own generator, dropout in
    training with a rate, attention with a dropout rate."""
    if not isinstance(op, torch._ops.OpOverload) or torch.Tag.nondeterministic_seeded not in op.tags:
        return False
    for arg, value in _arguments(op, args, kwargs):
        if (arg.name == "generator" and value is not None) or (arg.name in ("train", "training") and not value):
            return False
        if arg.name == "dropout_p" and not value:
            return False
    return True


def _signature(op: torch._ops.OpOverload, args: tuple, kwargs: dict) -> tuple:
    """What a draw depends on besides the generator: each tensor's shape, strides, dtype and device, every
    other argument's value."""
    def describe(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            return ("tensor", tuple(value.shape), tuple(value.stride()), value.dtype, str(value.device))
        return value

    return tuple(pytree.tree_map(describe, value) for _, value in _arguments(op, args, kwargs))


def _generator_of(args: tuple, kwargs: dict) -> str:
    """The global generator an op draws from: that of its first tensor's device, or of its ``device``."""
    tensor = next((t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)), None)
    return _key(tensor.device if tensor is not None else torch.device(kwargs.get("device") or "cpu"))


def _key(device: torch.device) -> str:
    """``cpu`` or ``type:index`` (the current device where ``device`` names none)."""
    if device.type == "cpu":
        return "cpu"
    index = device.index if device.index is not None else torch.get_device_module(device.type).current_device()
    return f"{device.type}:{index}"


def _values(node: fx.Node) -> tuple[tuple, dict]:
    """``node``'s arguments with each node read as its traced value."""
    return fx.node.map_arg((node.args, node.kwargs), lambda n: n.meta.get("val"))


def _is_draw(node: fx.Node) -> bool:
    """Whether ``node`` draws from a global generator when the graph runs."""
    return node.op == "call_function" and _draws(node.target, *_values(node))


def _what(op: torch._ops.OpOverload, signature: tuple) -> str:
    """``op`` and the shapes of the tensors it was called on, for a message."""
    shapes = [list(value[1]) for value in signature if isinstance(value, tuple) and value[:1] == ("tensor",)]
    return f"{op} on shapes {shapes}" if shapes else f"{op}{signature}"


def _mismatch(forward: fx.Node, recompute: fx.Node) -> SpmdCompileError:
    drew = _what(forward.target, _signature(forward.target, *_values(forward)))
    draws = _what(recompute.target, _signature(recompute.target, *_values(recompute)))
    return SpmdCompileError(
        "spmd.compile: a function under torch.utils.checkpoint draws other random numbers when the backward "
        f"recomputes it than its forward drew: the forward drew {drew} where the recompute draws {draws}. "
        "Eager restores the RNG state checkpoint saved for the recompute, and spmd reuses the forward's draws "
        "there, so the recompute must draw what the forward drew, in the same order, on the same shapes. Make "
        "the checkpointed function draw the same way in both runs (no branch on torch.is_grad_enabled() or on a "
        "counter around a random op), or pass preserve_rng_state=False to checkpoint (the recompute then draws "
        "new numbers, in eager as in spmd).")


def _unreusable(recompute: fx.Node) -> SpmdCompileError:
    return SpmdCompileError(
        f"spmd.compile: a function under torch.utils.checkpoint draws random numbers with {recompute.target}, "
        "whose results spmd cannot take from the forward for the backward's recompute (eager restores the RNG "
        "state for it, so it draws them again). Pass preserve_rng_state=False to checkpoint (the recompute then "
        "draws new numbers, in eager as in spmd), or call the op outside the checkpointed function.")


class _Reuse:
    """Turns a recompute's draw node into a copy of its forward's draw (module docstring)."""

    def __init__(self, graph: fx.Graph):
        self.graph = graph
        self.copies: dict[fx.Node, fx.Node] = {}  # a forward's value -> its copy, taken right after it

    def _call(self, target, args: tuple, kwargs: Optional[dict] = None, like: Optional[fx.Node] = None) -> fx.Node:
        node = self.graph.call_function(target, args, kwargs or {})
        if like is not None:
            node.meta.update({k: v for k, v in like.meta.items() if k in ("stack_trace", "nn_module_stack")})
        set_fake_val(node)
        return node

    def copy_of(self, value: fx.Node, as_bool: bool) -> fx.Node:
        """A copy of ``value`` taken right after it (before anything writes over it): bool for 0-or-1 draws."""
        if value not in self.copies:
            with self.graph.inserting_after(value):
                self.copies[value] = (self._call(aten._to_copy.default, (value,), {"dtype": torch.bool}, value)
                                      if as_bool else self._call(aten.clone.default, (value,), like=value))
        return self.copies[value]

    def output(self, draw: fx.Node, index: int) -> fx.Node:
        """``draw``'s result ``index`` (its ``getitem`` node, made right after it where none reads it)."""
        found = [u for u in draw.users if u.target is operator.getitem and u.args[1] == index]
        if found:
            return found[0]
        with self.graph.inserting_after(draw):
            return self._call(operator.getitem, (draw, index))

    def reuse(self, forward: fx.Node, recompute: fx.Node) -> None:
        """Make ``recompute`` (the same op as ``forward``, on the same shapes) draw nothing and give what
        ``forward`` drew: an in-place draw copies it in, a draw that returns tensors returns copies of them."""
        op, schema = recompute.target, recompute.target._schema
        as_bool = op.overloadpacket in _BERNOULLI
        returns = schema.returns
        if op is aten.native_dropout.default:
            self._dropout(forward, recompute)
        elif len(returns) == 1 and returns[0].alias_info is not None and schema.arguments[0].alias_info is not None:
            recompute.target, recompute.kwargs = aten.copy_.default, {}  # drawn in place into its first argument
            recompute.args = (recompute.args[0], self.copy_of(forward, as_bool))
        elif all(r.alias_info is None for r in returns):
            if len(returns) == 1:
                pairs = [(forward, recompute)]
            elif all(u.target is operator.getitem for u in recompute.users):
                pairs = [(self.output(forward, u.args[1]), u) for u in list(recompute.users)]
            else:
                raise _unreusable(recompute)
            for value, reader in pairs:
                if not isinstance(value.meta.get("val"), torch.Tensor):
                    raise _unreusable(recompute)
                copy = self.copy_of(value, as_bool)
                reader.target, reader.args, reader.kwargs = (
                    (aten._to_copy.default, (copy,), {"dtype": reader.meta["val"].dtype}) if as_bool
                    else (aten.clone.default, (copy,), {}))
            if len(returns) > 1:
                self.graph.erase_node(recompute)
        else:
            raise _unreusable(recompute)

    def _dropout(self, forward: fx.Node, recompute: fx.Node) -> None:
        """A dropout's mask is the forward's; its output is its input times that mask times ``1 / (1 - p)``."""
        x, p = recompute.args[0], recompute.args[1] if len(recompute.args) > 1 else recompute.kwargs["p"]
        mask = self.output(forward, 1)
        readers = {u.args[1]: u for u in recompute.users if u.target is operator.getitem}
        if len(readers) != len(recompute.users):
            raise _unreusable(recompute)
        if 1 in readers:
            readers[1].target, readers[1].args, readers[1].kwargs = aten.clone.default, (mask,), {}
        if 0 in readers:
            with self.graph.inserting_before(readers[0]):
                kept = self._call(aten.mul.Tensor, (mask, x), like=recompute)
            readers[0].target, readers[0].kwargs = aten.mul.Tensor, {}
            readers[0].args = (kept, 1.0 / (1.0 - p) if p < 1 else 0.0)
        self.graph.erase_node(recompute)


def _reuse_restored_draws(graph: fx.Graph, events: list[tuple]) -> None:
    """Read ``graph``'s random nodes as each generator's sequence of draws, moved by ``events`` (``(node after
    which it happened, "get" or "set", generator, state)``), and make each draw at a position already drawn a
    copy of the draw there (module docstring)."""
    after = defaultdict(list)
    for event in events:
        after[event[0]].append(event[1:])
    sequences: dict[str, _Sequence] = defaultdict(_Sequence)
    handed: dict[int, tuple[torch.Tensor, str, int]] = {}  # id(state) -> (state, generator, position)
    reuse = _Reuse(graph)
    with disable_proxy_modes_tracing():  # the fake values of the nodes made here are computed, not traced
        for node in list(graph.nodes):
            if _is_draw(node):
                args, kwargs = _values(node)
                sequence = sequences[_generator_of(args, kwargs)]
                if sequence.at is not None:
                    position, sequence.at = sequence.at, sequence.at + 1
                    if position == len(sequence.draws):
                        sequence.draws.append(node)
                    else:
                        forward = sequence.draws[position]
                        if forward.target is not node.target or (_signature(forward.target, *_values(forward))
                                                                 != _signature(node.target, args, kwargs)):
                            raise _mismatch(forward, node)
                        reuse.reuse(forward, node)
            for kind, generator, state in after.get(node, ()):
                sequence = sequences[generator]
                if kind == "get":
                    if sequence.at is not None:
                        handed[id(state)] = (state, generator, sequence.at)
                elif id(state) in handed and handed[id(state)][0] is state:
                    sequence.at = handed[id(state)][2]
                else:
                    sequence.at = None
    graph.lint()


def _last_node() -> Optional[fx.Node]:
    """The node the tracer made last, or None outside a trace."""
    tracing = get_proxy_mode()
    return next(iter(reversed(tracing.tracer.graph.nodes)), None) if tracing is not None else None


@contextlib.contextmanager
def replaying_restored_draws() -> Iterator[None]:
    """While a step is traced: note where RNG states are handed out and set; when the step has run, make each
    draw a restored state repeats a copy of the draw it repeats (module docstring). Enter it inside the traced
    function (the graph it rewrites is the tracer's)."""
    events: list[tuple] = []  # (node after which, "get" or "set", generator, state); holds the states
    patches = Patches()

    def getter(original, generator_of):
        def get_rng_state(*args, **kwargs):
            state = original(*args, **kwargs)
            if (node := _last_node()) is not None:
                events.append((node, "get", generator_of(*args, **kwargs), state))
            return state
        return get_rng_state

    def setter(original, generator_of):
        def set_rng_state(state, *args, **kwargs):
            if (node := _last_node()) is not None:
                events.append((node, "set", generator_of(*args, **kwargs), state))
            return original(state, *args, **kwargs)
        return set_rng_state

    cpu = lambda *args, **kwargs: "cpu"  # noqa: E731
    on_device = lambda device="cuda", *args, **kwargs: _key(  # noqa: E731
        torch.device("cuda", device) if isinstance(device, int) else torch.device(device))
    tracer = getattr(get_proxy_mode(), "tracer", None)
    try:
        get, put = torch.random.get_rng_state, torch.random.set_rng_state
        for owner in (torch, torch.random):
            patches.set(owner, "get_rng_state", getter(get, cpu))
            patches.set(owner, "set_rng_state", setter(put, cpu))
        if hasattr(torch, "cuda") and hasattr(torch.cuda, "get_rng_state"):
            get, put = torch.cuda.get_rng_state, torch.cuda.set_rng_state
            patches.set(torch.cuda, "get_rng_state", getter(get, on_device))
            patches.set(torch.cuda, "set_rng_state", setter(put, on_device))
        yield
    finally:
        patches.restore()
    if tracer is not None and any(kind == "get" for _, kind, _, _ in events):
        _reuse_restored_draws(tracer.graph, events)

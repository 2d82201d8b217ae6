"""The optimizer-op catalog: which aten ops are fused or foreach optimizer ops, what they write, how they pair.

One table that tracing, functionalization, the passes and lowering all read. Everything
here is derived from the ops' schemas (``alias_info`` marks a written argument), so it
follows torch rather than restating it:

* ``FUSED``: the fused optimizer packets this torch has (``_fused_adam[_]``,
  ``_fused_adamw[_]``, ``_fused_sgd[_]``, ``_fused_adagrad[_]``), functional and in place;
  ``FUSED_ADAM`` the Adam/AdamW ones, whose list arguments are ``ADAM_LISTS``.
* ``written_args(op)``: positions of the arguments ``op`` writes; ``written_inputs(node)``
  the nodes a call writes.
* ``inplace_of(op)`` / ``functional_of(op)``: the in-place overload that computes a
  functional fused or foreach op's results into its written arguments (the functional
  op's k-th result is the in-place op's k-th written argument), and back; ``functional_of``
  also pairs another in-place op with its functional twin (``mul_`` -> ``mul``).

Ops are matched by ``OpOverload``/``OpOverloadPacket`` identity, never by node name.
"""

from __future__ import annotations

import functools
from typing import Optional

import torch
import torch.fx as fx

aten = torch.ops.aten
OpOverload = torch._ops.OpOverload

_FUSED_NAMES = ("_fused_adam", "_fused_adamw", "_fused_sgd", "_fused_adagrad")
# functional packet -> in-place packet, for the fused optimizers this torch provides
FUSED_PAIRS = {getattr(aten, n): getattr(aten, n + "_") for n in _FUSED_NAMES
               if hasattr(aten, n) and hasattr(aten, n + "_")}
FUSED = frozenset(FUSED_PAIRS) | frozenset(FUSED_PAIRS.values())
FUSED_ADAM = frozenset({aten._fused_adam, aten._fused_adam_, aten._fused_adamw, aten._fused_adamw_})
# the list arguments of a fused Adam/AdamW op, in order (the schema calls the first one ``self``)
ADAM_LISTS = ("params", "grads", "exp_avgs", "exp_avg_sqs", "max_exp_avg_sqs", "state_steps")


def _packet(op):
    return getattr(op, "overloadpacket", None)


def is_fused_optimizer(op) -> bool:
    """A fused optimizer op (any overload, functional or in place)."""
    return _packet(op) in FUSED


def is_fused_adam(op) -> bool:
    return _packet(op) in FUSED_ADAM


def is_foreach(op) -> bool:
    """An ``aten._foreach_*`` op, functional or in place."""
    return isinstance(op, OpOverload) and op.namespace == "aten" and op._opname.startswith("_foreach_")


def is_inplace(op) -> bool:
    """An op that writes one of its arguments (from its schema)."""
    return bool(written_args(op))


@functools.lru_cache(maxsize=None)
def written_args(op) -> tuple[int, ...]:
    """Schema positions of the arguments ``op`` writes (empty for a pure op or a non-op target)."""
    schema = getattr(op, "_schema", None)
    if not isinstance(op, OpOverload) or schema is None:
        return ()
    return tuple(i for i, a in enumerate(schema.arguments) if a.alias_info is not None and a.alias_info.is_write)


def written_inputs(node: fx.Node) -> list[fx.Node]:
    """The nodes whose storage ``node`` writes (``copy_`` destinations, in-place op arguments)."""
    if node.op != "call_function":
        return []
    out = []
    for i in written_args(node.target):
        arg = node.target._schema.arguments[i]
        value = node.args[i] if i < len(node.args) else node.kwargs.get(arg.name)
        values = value if isinstance(value, (list, tuple)) else [value]
        out += [v for v in values if isinstance(v, fx.Node)]
    return out


def _same_arguments(a: OpOverload, b: OpOverload) -> bool:
    return [x.name for x in a._schema.arguments] == [x.name for x in b._schema.arguments]


@functools.lru_cache(maxsize=None)
def inplace_of(op) -> Optional[OpOverload]:
    """The in-place overload computing functional fused/foreach ``op``'s results into its written arguments.

    None unless it exists, takes the same arguments, returns nothing, writes only
    tensor lists, and writes as many lists as ``op`` returns (result k is written list k).
    """
    if not isinstance(op, OpOverload) or op.namespace != "aten" or written_args(op):
        return None
    if op.overloadpacket in FUSED_PAIRS:
        packet = FUSED_PAIRS[op.overloadpacket]
    elif is_foreach(op):
        packet = getattr(aten, op._opname + "_", None)
    else:
        return None
    inplace = getattr(packet, op._overloadname, None) if packet is not None else None
    if inplace is None or inplace._schema.returns or not _same_arguments(op, inplace):
        return None
    written = written_args(inplace)
    if not written or not all(isinstance(inplace._schema.arguments[p].type, torch.ListType) for p in written):
        return None
    if len(op._schema.returns) != len(written):
        return None
    return inplace


@functools.lru_cache(maxsize=None)
def functional_of(op) -> Optional[OpOverload]:
    """The functional overload of in-place aten ``op``, or None.

    For a fused or foreach op, the inverse of ``inplace_of``. For another op ``foo_`` that writes
    its arguments' data (``mul_.Tensor``, ``_amp_update_scale_``; not ``t_`` or ``resize_``, which
    change a shape or storage) and returns nothing or one argument it writes, the overload of
    ``foo`` that takes the same arguments and returns one result per argument ``op`` writes, result
    k holding written argument k's new value (``mul.Tensor``).
    """
    if not isinstance(op, OpOverload) or op.namespace != "aten" or not written_args(op):
        return None
    functional_packets = {v: k for k, v in FUSED_PAIRS.items()}
    if op.overloadpacket in functional_packets:
        packet = functional_packets[op.overloadpacket]
    elif op._opname.endswith("_"):
        packet = getattr(aten, op._opname[:-1], None)
    else:
        return None
    functional = getattr(packet, op._overloadname, None) if packet is not None else None
    if functional is None:
        return None
    if op.overloadpacket in functional_packets or is_foreach(op):
        return functional if inplace_of(functional) is op else None
    returns = op._schema.returns
    other = (torch.Tag.inplace_view not in op.tags and (not returns or written_result(op) is not None)
             and not written_args(functional) and _same_arguments(op, functional)
             and len(functional._schema.returns) == len(written_args(op)))
    return functional if other else None


@functools.lru_cache(maxsize=None)
def written_result(op) -> Optional[int]:
    """The position of the written argument that ``op`` returns (``x.mul_(2)`` is ``x``: 0), or None."""
    schema = getattr(op, "_schema", None)
    if schema is None or len(schema.returns) != 1 or schema.returns[0].alias_info is None:
        return None
    returned = schema.returns[0].alias_info
    return next((p for p in written_args(op) if returned.is_write
                 and schema.arguments[p].alias_info.before_set == returned.before_set), None)


# The Python functions optimizers call (``torch._fused_adam_``): their ``float`` arguments take
# Python numbers only, so a hyperparameter passed there is used by value (``spmd.optim.hyperparams``).
_TORCH_FUNCTIONS = {getattr(torch, p._qualified_op_name.split("::")[1]): p for p in FUSED
                    if hasattr(torch, p._qualified_op_name.split("::")[1])}


def fused_float_args(func) -> frozenset[str]:
    """Names of the arguments that are ``float`` in every overload of fused-optimizer function ``func``."""
    packet = _TORCH_FUNCTIONS.get(func) if callable(func) else None
    if packet is None:
        return frozenset()
    return _float_args(packet)


@functools.lru_cache(maxsize=None)
def _float_args(packet) -> frozenset[str]:
    overloads = [getattr(packet, o) for o in packet.overloads() if not o.endswith("out")]
    names = [{a.name for a in o._schema.arguments if isinstance(a.type, torch.FloatType)} for o in overloads]
    return frozenset(set.intersection(*names)) if names else frozenset()


def fused_overloads() -> list[OpOverload]:
    """Every non-``out`` overload of every fused optimizer packet (e.g. for registering fake kernels)."""
    return [getattr(p, o) for p in sorted(FUSED, key=str) for o in p.overloads() if not o.endswith("out")]

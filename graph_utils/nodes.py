"""Finding nodes and collectives in an ``fx.Graph``, matched by op identity, never by name."""

from __future__ import annotations

import operator
from typing import Callable, Optional

import torch
import torch.fx as fx

c10d = torch.ops._c10d_functional

COLLECTIVE_OPS = frozenset({
    c10d.all_reduce.default,
    c10d.all_reduce_.default,
    c10d.all_gather_into_tensor.default,
    c10d.reduce_scatter_tensor.default,
    c10d.all_reduce_coalesced.default,
    c10d.all_gather_into_tensor_coalesced.default,
    c10d.reduce_scatter_tensor_coalesced.default,
    c10d.broadcast.default,
})
WAIT_OP = c10d.wait_tensor.default


def find_node(graph: fx.Graph, predicate: Callable[[fx.Node], bool], reverse: bool = False) -> list[fx.Node]:
    """All nodes of ``graph`` for which ``predicate`` holds, in graph order (or reversed)."""
    nodes = reversed(graph.nodes) if reverse else graph.nodes
    return [n for n in nodes if predicate(n)]


def node_order(graph: fx.Graph) -> dict[fx.Node, int]:
    """Each node's position in ``graph``: compare positions to ask which of two nodes runs first."""
    return {n: i for i, n in enumerate(graph.nodes)}


def first_reader_before(value: fx.Node, target: fx.Node, order: dict[fx.Node, int],
                        excluded=frozenset()) -> Optional[fx.Node]:
    """The first user of ``value`` (outside ``excluded``, in ``order``) if it runs before ``target``, else None:
    the node that would read a stale ``value`` if its update were deferred to run just before ``target``."""
    readers = [u for u in value.users if u not in excluded]
    first = min(readers, key=order.__getitem__, default=None)
    return first if first is not None and order[first] < order[target] else None


def eliminate_dead_nodes(graph: fx.Graph) -> bool:
    """Erase the pure nodes nothing reads, and the nodes only they read, as ``graph.eliminate_dead_code()``
    does (without its lint), then do the same in each subgraph the graph reads (a ``GraphModule`` its owning
    module holds, read by ``get_attr``), as torch's does; whether any node was erased.

    torch's asks every node of the graph whether it is impure, a check that looks the op up in several of
    torch's registries and is the larger part of a pass's clean-up on a whole-step graph (BENCHMARKS.md,
    "Round 33"), and lints the graph first, another walk over every node; this asks only the nodes without
    readers, then the inputs each erased node leaves without readers."""
    dead = [n for n in graph.nodes if not n.users and not n.is_impure()]
    erased = bool(dead)
    while dead:
        node = dead.pop()
        inputs = node.all_input_nodes
        graph.erase_node(node)
        dead.extend(a for a in inputs if not a.users and not a.is_impure())
    owner = graph.owning_module
    if owner is not None:
        for name in dict.fromkeys(n.target for n in graph.find_nodes(op="get_attr")):
            sub = getattr(owner, name, None) if isinstance(name, str) and "." not in name else None
            if isinstance(sub, fx.GraphModule) and eliminate_dead_nodes(sub.graph):
                sub.recompile()
                erased = True
    return erased


def get_output(graph: fx.Graph) -> fx.Node:
    """The graph's output node."""
    for node in reversed(graph.nodes):
        if node.op == "output":
            return node
    raise ValueError("graph has no output node")


def is_comm_node(node: fx.Node) -> bool:
    """True for a functional collective (all_reduce, all_gather, reduce_scatter, ...)."""
    return node.op == "call_function" and node.target in COLLECTIVE_OPS


def comm_group_name(comm: fx.Node) -> Optional[str]:
    """The process-group name a collective runs over (its ``group_name`` argument), or None where it is not a string."""
    at = [a.name for a in comm.target._schema.arguments].index("group_name")
    name = comm.args[at] if at < len(comm.args) else comm.kwargs.get("group_name")
    return name if isinstance(name, str) else None


def set_comm_group_name(comm: fx.Node, name: str) -> None:
    """Point a collective at the process group named ``name`` (its ``group_name`` argument)."""
    at = [a.name for a in comm.target._schema.arguments].index("group_name")
    if at < len(comm.args):
        comm.update_arg(at, name)
    else:
        comm.update_kwarg("group_name", name)


def is_all_reduce(node: fx.Node) -> bool:
    return node.op == "call_function" and node.target is c10d.all_reduce.default


def is_wait_node(node: fx.Node) -> bool:
    """True for ``_c10d_functional.wait_tensor``."""
    return node.op == "call_function" and node.target is WAIT_OP


def wait_of(comm: fx.Node) -> Optional[fx.Node]:
    """The ``wait_tensor`` on ``comm``'s result, or None."""
    return next((u for u in comm.users if is_wait_node(u)), None)


def waited_collective(wait: fx.Node) -> Optional[fx.Node]:
    """The collective a wait_tensor waits on (through the getitem of a coalesced collective)."""
    src = wait.args[0] if wait.args else None
    if isinstance(src, fx.Node) and src.op == "call_function" and src.target is operator.getitem:
        src = src.args[0]
    return src if isinstance(src, fx.Node) and is_comm_node(src) else None


def view_of_copy_op(target) -> Optional[torch._ops.OpOverload]:
    """``aten.t_copy`` -> ``aten.t`` (same overload): the view a functionalization's copying view copies, else None."""
    if not (isinstance(target, torch._ops.OpOverload) and target.namespace == "aten"
            and target._opname.endswith("_copy")):
        return None
    packet = getattr(torch.ops.aten, target._opname[: -len("_copy")], None)
    view = getattr(packet, target._overloadname, None) if packet is not None else None
    if view is None or not view.is_view:
        return None
    return view


# Operands an op reads only for their shape, dtype and device: ``nll_loss_backward`` scatters its result
# into zeros shaped like ``self`` (ATen's kernel and Inductor's decomposition both), never reading a value.
_SHAPE_ONLY_OPERANDS = {
    torch.ops.aten.nll_loss_backward.default: 1,
    torch.ops.aten.nll_loss2d_backward.default: 1,
}


def value_inputs(node: fx.Node) -> list[fx.Node]:
    """The input nodes whose values ``node`` reads: all of them but an operand read only for its shape
    (``nll_loss_backward``'s log-probabilities), unless another argument reads the same node."""
    index = _SHAPE_ONLY_OPERANDS.get(node.target)
    if index is None or len(node.args) <= index or not isinstance(node.args[index], fx.Node):
        return node.all_input_nodes
    shape_only = node.args[index]
    rest = node.args[:index] + node.args[index + 1:]
    read: set[fx.Node] = set()
    fx.node.map_arg((rest, node.kwargs), read.add)
    return [n for n in node.all_input_nodes if n is not shape_only or n in read]


def tensor_bytes(node: fx.Node) -> int:
    """Bytes of the tensor a node produces (0 when it has no tensor ``meta['val']``)."""
    val = node.meta.get("val")
    if isinstance(val, torch.Tensor):
        return val.numel() * val.element_size()
    return 0


def set_fake_val(node: fx.Node) -> None:
    """Fill ``node.meta['val']`` by running its op on its inputs' fake values.

    Every node a pass creates must carry a FakeTensor so later passes and lowering can
    read shapes and dtypes; this is the one place that computes it.
    """
    from torch._guards import detect_fake_mode

    if node.target is operator.getitem and isinstance(node.args[0], fx.Node) and "val" in node.args[0].meta:
        node.meta["val"] = node.args[0].meta["val"][node.args[1]]  # an element of a list result: no op to run
        return
    vals = [n.meta["val"] for n in node.all_input_nodes if "val" in n.meta]
    mode = detect_fake_mode(vals)
    args = fx.node.map_arg(node.args, lambda n: n.meta["val"])
    kwargs = fx.node.map_arg(node.kwargs, lambda n: n.meta["val"])
    if mode is None:
        from torch._subclasses.fake_tensor import FakeTensorMode

        mode = FakeTensorMode()
    with mode:
        node.meta["val"] = node.target(*args, **kwargs)

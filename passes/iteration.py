"""What a pass may rely on when a step graph spans iterations.

``spmd.IterGraph`` (the graph of an ``IterGraphModule``) implements this protocol; a
plain ``fx.Graph`` has no moves. Passes import it from here, so they never reach up
into ``spmd``.
"""

from __future__ import annotations

from typing import Iterable, Protocol, runtime_checkable

import torch.fx as fx


class IterMoveError(ValueError):
    """A cross-iteration move that would change what the step computes."""


@runtime_checkable
class IterationGraph(Protocol):
    """A graph whose nodes can be deferred into the next iteration."""

    moves: list

    def move_to_next_iter_before(self, nodes: Iterable[fx.Node], target_node: fx.Node) -> None:
        ...


def has_moves(graph: fx.Graph) -> bool:
    """True when ``graph`` already defers nodes to the next iteration."""
    return isinstance(graph, IterationGraph) and bool(graph.moves)


def refuse_after_moves(graph: fx.Graph, pass_name: str, what: str) -> None:
    """Raise ``ValueError`` if ``graph`` already has cross-iteration moves that ``pass_name`` would invalidate."""
    if has_moves(graph):
        raise ValueError(
            f"{pass_name}: the graph already defers nodes to the next iteration (move_to_next_iter_before), "
            f"and {what} would change the nodes those moves name. Apply {pass_name} before moving nodes "
            "across iterations."
        )

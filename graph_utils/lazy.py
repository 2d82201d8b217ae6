"""GraphModules that generate their Python code only when it is run or read.

A whole-step graph has thousands of nodes; generating and compiling its Python code
takes a few tenths of a second each time. Passes edit the graph many times and then
hand it to Inductor, which traces it once, so regenerating the code after every edit
is wasted work. ``torch.fx``'s lazy GraphModule (what Inductor itself uses for its
pattern graphs) makes ``recompile()`` only mark the code stale; the code is built on
the first call, or when ``.code`` or ``print`` reads it.
"""

from __future__ import annotations

import contextlib

import torch.fx as fx

try:  # private in torch; present since 2.3
    from torch.fx._lazy_graph_module import _LazyGraphModule, _use_lazy_graph_module
except ImportError:  # pragma: no cover - older or changed torch: plain, eager GraphModules
    _LazyGraphModule = _use_lazy_graph_module = None


def lazy_graph_module(root, graph: fx.Graph) -> fx.GraphModule:
    """``fx.GraphModule(root, graph)``, generating its code on first use instead of now."""
    return _LazyGraphModule(root, graph) if _LazyGraphModule is not None else fx.GraphModule(root, graph)


def make_lazy(gm: fx.GraphModule) -> fx.GraphModule:
    """``gm`` as a lazy GraphModule over the same graph (``gm`` itself if it already is one)."""
    if _LazyGraphModule is None or isinstance(gm, _LazyGraphModule):
        return gm
    return _LazyGraphModule(gm, gm.graph)


def lazy_graph_modules():
    """Context in which ``make_fx`` (and other torch tracers) return lazy GraphModules."""
    return _use_lazy_graph_module(True) if _use_lazy_graph_module is not None else contextlib.nullcontext()

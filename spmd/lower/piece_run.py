"""How the pieces of a cut step graph run: in turn, each on the values the plan says, letting go of each value after
the piece that reads it last (``PiecePlan``, from ``spmd.lower.piece_plan``), and each piece's outputs made as its
graph gives them before a later piece reads them (``as_their_graph_gives``; the whole graph's outputs too).

A piece may write into the values it was compiled to take as donated (``spmd.lower.donated_inputs``): nothing but
its input list holds them when it runs. Where one shares its memory with another value (Inductor returned an output
that is another output, or an input, as it is), it is handed over as a copy: which ones is the same every call,
found on the first.
"""

from __future__ import annotations

import logging
import math
from typing import Any, Callable, Optional, Sequence

import torch

from .piece_plan import PiecePlan
from .unread_state import HeldBack, holding

log = logging.getLogger(__name__)


def run_pieces(plan: PiecePlan, pieces: Sequence[Callable[[list], Any]]) -> Callable[[list], list]:
    """One callable (Inductor's boxed convention: called on a list of the graph's inputs, which it
    clears) that runs ``pieces`` (each in that convention) as ``plan`` says. A piece's output that comes back
    in another shape or dtype than its graph gives it is made so before a later piece, compiled for what the
    graph gives, reads it (``as_their_graph_gives``)."""
    steps = list(zip(pieces, plan.takes, plan.makes, plan.drops))
    conform = [as_their_graph_gives(plan.shapes[p] if plan.shapes else (), plan.dtypes[p] if plan.dtypes else (),
                                    f"piece {p}'s output") for p in range(len(steps))]

    copied: Optional[list[set[int]]] = None  # by piece, the donated values it takes as copies (found on a first call)

    def run(args: list) -> list:
        nonlocal copied
        values = dict(enumerate(args))
        args.clear()
        first = copied is None
        copied = copied if copied is not None else [set() for _ in steps]
        inputs_memory = _memory_of(values.values()) if first else set()
        held = holding()
        unread = _release_unread_state(held, values, plan.takes) if held is not None else {}
        try:
            for p, (piece, takes, makes, drops) in enumerate(steps):
                if p in unread:
                    held.restore(unread.pop(p))
                inputs = [values[i] for i in takes]
                for i in drops:
                    del values[i]
                if first and plan.donates and plan.donates[p]:
                    copied[p] = _shared_donations(plan.donates[p], takes, inputs, inputs_memory | _memory_of(
                        values.values()), p)
                for k, i in enumerate(takes) if copied[p] else ():  # mostly none: no loop per call
                    if i in copied[p]:
                        inputs[k] = inputs[k].clone()
                outputs = conform[p](piece(inputs))
                if p == len(steps) - 1:
                    return outputs
                values.update(zip(makes, outputs))
                # nothing but ``values`` holds a piece's outputs while the next runs: the piece reading one last
                # frees it as it goes (held here, BERT's loss gradient lived through the next piece:
                # BENCHMARKS.md, "Round 26")
                del outputs
            return []
        finally:
            for tensors in unread.values():  # read by no piece, or the run failed before its reader
                held.restore(tensors)

    return run


def _memory_of(tensors: Any) -> set[int]:
    """The addresses of the memory ``tensors`` (tensors or other values, ignored) live in."""
    return {t.untyped_storage().data_ptr() for t in tensors if isinstance(t, torch.Tensor) and t.numel()}


def _shared_donations(donated: Sequence[int], takes: Sequence[int], inputs: Sequence[Any], elsewhere: set[int],
                      piece: int) -> set[int]:
    """Which of piece ``piece``'s ``donated`` values share their memory with a value held ``elsewhere`` (the
    graph's inputs, values later pieces read) or with another of its ``inputs`` (taken as ``takes``): the piece
    must get those as copies, or it would write over the other value."""
    shared = set()
    for k, (i, value) in enumerate(zip(takes, inputs)):
        if i not in donated or not isinstance(value, torch.Tensor) or not value.numel():
            continue
        others = elsewhere | _memory_of(v for j, v in enumerate(inputs) if j != k)
        if value.untyped_storage().data_ptr() in others:
            log.info("spmd: piece %d's donated input %d shares its memory with another value; it is handed over "
                     "as a copy", piece, i)
            shared.add(i)
    return shared


def _release_unread_state(held: HeldBack, inputs: dict[int, Any], takes: Sequence[Sequence[int]]
                          ) -> dict[int, list[torch.Tensor]]:
    """Release the storage of each zero state tensor among the graph's ``inputs`` that no piece before the
    first one reading its storage reads (``spmd.lower.unread_state``); returns, by piece, the released
    tensors to make again before it runs (a storage no piece reads: before none, at the run's end)."""
    first_read: dict[int, int] = {}
    for p, taken in enumerate(takes):
        for i in taken:
            if i in inputs and isinstance(inputs[i], torch.Tensor):
                first_read.setdefault(inputs[i].untyped_storage()._cdata, p)
    unread: dict[int, list[torch.Tensor]] = {}
    for value in inputs.values():
        if not isinstance(value, torch.Tensor):
            continue
        p = first_read.get(value.untyped_storage()._cdata, len(takes))
        if p > 0 and held.release(value):
            unread.setdefault(p, []).append(value)
    return unread


def as_their_graph_gives(shapes: Sequence[Optional[tuple[int, ...]]], dtypes: Sequence[Optional[torch.dtype]],
                         what: str) -> Callable[[Sequence[Any]], Sequence[Any]]:
    """What makes a compiled graph's outputs as its graph gives them (``shapes``, ``dtypes``: each output's, None
    where not a tensor or not known), for the code that reads them next, compiled for what the graph gives. Which
    outputs need it is found on the first call. ``what``: the outputs in words, for the log (``"piece 2's output"``).

    * An output in another shape with as many elements is viewed in the graph's shape: torch 2.11's Inductor
      returns the result of a keepdim reduction it computes in a mix-order reduction kernel without its kept
      dimension (a layer norm's weight gradient, ``(1, n)`` returned as ``(n,)``; fixed in pytorch#177782),
      which inside one graph no kernel notices but which the next piece's input check refuses. Another number
      of elements is an error.
    * An output in another dtype is cast to the graph's: torch 2.11's Inductor rewrites a scatter into a
      constant tensor (``nll_loss_backward``'s one-hot gradient) as a ``where`` in float32, whatever the
      tensor's dtype (fixed in torch 2.13). Inside one graph that only computes in more precision; across a
      cut, the next piece, compiled for bfloat16, would read float32 bits as bfloat16, since Inductor checks
      the size and stride of each input it reads, not its dtype (BENCHMARKS.md, "Round 23")."""
    fixes: Optional[list[tuple[int, Optional[tuple[int, ...]], Optional[torch.dtype]]]] = None

    def conform(outputs: Sequence[Any]) -> Sequence[Any]:
        nonlocal fixes
        if fixes is None:
            fixes = _unlike_their_graph(outputs, shapes, dtypes, what)
        if not fixes:
            return outputs
        outputs = list(outputs)
        for k, shape, dtype in fixes:
            if shape is not None:
                outputs[k] = outputs[k].view(shape)
            if dtype is not None:
                outputs[k] = outputs[k].to(dtype)
        return outputs

    return conform


def _unlike_their_graph(outputs: Sequence[Any], shapes: Sequence[Optional[tuple[int, ...]]],
                        dtypes: Sequence[Optional[torch.dtype]], what: str
                        ) -> list[tuple[int, Optional[tuple[int, ...]], Optional[torch.dtype]]]:
    """(index, shape its graph gives it or None, dtype its graph gives it or None) for each of ``outputs`` that
    came back in another shape with as many elements, or in another dtype (see ``as_their_graph_gives``)."""
    if any(len(given) not in (0, len(outputs)) for given in (shapes, dtypes)):
        return []  # not output for output as the graph describes them: nothing to compare them with
    found = []
    for k, out in enumerate(outputs):
        if not isinstance(out, torch.Tensor):
            continue
        shape = shapes[k] if k < len(shapes) else None
        dtype = dtypes[k] if k < len(dtypes) else None
        reshape = shape is not None and tuple(out.shape) != shape
        if reshape and out.numel() != math.prod(shape):
            raise RuntimeError(f"spmd: {what} {k} of a graph compiled by Inductor came back with shape "
                               f"{tuple(out.shape)} where its graph gives {shape}: Inductor compiled it wrongly. "
                               "Compile the step whole (spmd.GraphModuleTransformation(enable_inductor=True, "
                               "compile_pieces=1) as gm_transformation) and report this.")
        recast = dtype is not None and out.dtype != dtype
        if reshape:
            log.info("spmd: %s %d came back with shape %s where its graph gives %s (Inductor's mix-order "
                     "reduction dropped a kept dimension); it is viewed in its graph's shape",
                     what, k, tuple(out.shape), shape)
        if recast:
            log.info("spmd: %s %d came back as %s where its graph gives %s (an Inductor rewrite changed its "
                     "dtype); it is cast to its graph's dtype", what, k, out.dtype, dtype)
        if reshape or recast:
            found.append((k, shape if reshape else None, dtype if recast else None))
    return found

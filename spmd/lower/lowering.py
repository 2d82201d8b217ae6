"""``Lowering``: how the graphs of a transformed step become what runs them, done before the first run.

A transformed step (an ``IterGraphModule`` after the passes) runs one graph per iteration kind
(``step``, or ``setup``/``main``/``cleanup``/``flush`` when nodes move across iterations). The
compile stage lowers every one of them ahead, on example inputs of the step's first call, and the
runner then only runs what it was given: Inductor's compiled code, maybe replayed as a CUDA graph
(``spmd.lower.cudagraphs``), or the FX graph itself when nothing is asked for.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence, Union

import torch
import torch.fx as fx

from ..errors import SpmdConfigError
from ..graph_utils.meta import NAME, ROLE, Role
from .compile_graph import device_of as _device_of
from .cudagraphs import CudaGraphRunner, cudagraph_obstacle
from .inductor import check_inductor_options, compile_with_inductor, start_compile_workers
from .inductor_code import KeptCode
from .rewrites import LEAN_PARTS, lowering_pipeline, prepare_for_inductor
from .worker_pool import Worker, WorkerPool

log = logging.getLogger(__name__)

# The most pieces of a graph ``Lowering(pieces="auto")`` compiles at once.
AUTO_PIECES = 4


@dataclass(frozen=True)
class Lowering:
    """What each graph of a step is lowered to; a value, so it can be compared and keyed.

    ``inductor``: compile each graph with TorchInductor (``spmd.lower.inductor``), keeping the
    collective and wait positions the passes chose. ``cudagraphs``: replay each graph as one CUDA
    graph from its second call on; ``"auto"`` where every input is on the GPU and its capture
    succeeds, else run it as it is, saying why once. ``inductor_comm_passes``: let Inductor's own
    comm passes place the collectives instead. ``inductor_options``: further Inductor config values,
    checked by ``check_inductor_options``. ``lean``: exact rewrites that take work out of the graph
    Inductor compiles (``spmd.lower.rewrites``): True for all of ``LEAN_PARTS`` (``"one_rank"``: a
    gradient all_reduce over a group of one rank and its bucket's copies leave the graph;
    ``"step_counts"``: a fused optimizer's step counts are added in place by one ATen call), False (the
    default here) for none; ``spmd.compile()``'s GPU default turns it on
    (``spmd.api.default_transformation``; the measurements are in BENCHMARKS.md). ``inductor_comm_passes``
    and one lean part by name exist to compare lowerings: a measurement sets them with
    ``spmd._testing.with_lowering``, ``GraphModuleTransformation`` does not take them. ``pieces``:
    compile up to this many pieces of each graph side by side, in this process and ``pieces - 1``
    worker processes (``spmd.lower.piece_compile``), or ``"auto"`` (``pieces_on``); the code is the same but
    for the cuts, which nothing fuses across.
    """

    inductor: bool = False
    cudagraphs: Union[bool, str] = False
    inductor_comm_passes: bool = False
    inductor_options: dict = field(default_factory=dict, hash=False)
    lean: Union[bool, str] = False
    pieces: Union[int, str] = 1

    def __post_init__(self):
        if self.inductor_comm_passes and not self.inductor:
            raise SpmdConfigError("Lowering: inductor_comm_passes=True needs enable_inductor=True (Inductor places "
                                  "the collectives only where it compiles the graph)")
        if self.inductor_options and not self.inductor:
            raise SpmdConfigError("GraphModuleTransformation: inductor_options need enable_inductor=True")
        if not (self.lean is True or self.lean is False or self.lean in LEAN_PARTS):
            raise SpmdConfigError(f"Lowering: lean must be True, False or one of {list(LEAN_PARTS)}, got {self.lean!r}")
        if self.lean and not self.inductor:
            raise SpmdConfigError("GraphModuleTransformation: lean_lowering changes what Inductor compiles and needs "
                                  "enable_inductor=True. Pass enable_inductor=True or drop lean_lowering.")
        if not (self.pieces == "auto" or (isinstance(self.pieces, int) and not isinstance(self.pieces, bool)
                                          and self.pieces >= 1)):
            raise SpmdConfigError(f"GraphModuleTransformation: compile_pieces must be a whole number of at least 1 or "
                                  f"'auto', got {self.pieces!r}")
        if self.pieces not in (1, "auto") and not self.inductor:
            raise SpmdConfigError("GraphModuleTransformation: compile_pieces splits what Inductor compiles and needs "
                                  "enable_inductor=True. Pass enable_inductor=True or drop compile_pieces.")
        if self.cudagraphs not in (True, False, "auto"):
            raise SpmdConfigError(f"GraphModuleTransformation: enable_cudagraphs must be True, False or 'auto', "
                                  f"got {self.cudagraphs!r}")
        object.__setattr__(self, "inductor_options", check_inductor_options(self.inductor_options))

    @property
    def compiles(self) -> bool:
        """True when lowering makes something other than the FX graph itself."""
        return bool(self.inductor or self.cudagraphs)

    def pieces_on(self, device: torch.device) -> int:
        """How many pieces of a graph compile at once on ``device`` (``pieces``; ``"auto"``: on a GPU, one per four
        of this rank's CPU cores (the machine's, shared by the ranks torchrun started here) up to
        ``AUTO_PIECES``, else 1)."""
        if not self.inductor:
            return 1
        if self.pieces != "auto":
            return self.pieces
        ranks_here = max(1, int(os.environ.get("LOCAL_WORLD_SIZE") or 1))  # the ranks torchrun started here
        cores = (os.cpu_count() or 1) // ranks_here
        return max(1, min(AUTO_PIECES, cores // 4)) if device.type == "cuda" else 1

    def rewrites(self) -> list:
        """The rewrites the graph Inductor gets goes through, in order (``spmd.lower.rewrites``; none without
        Inductor). Inductor's decompositions are among them: a graph compiled in pieces gets them piece by piece."""
        return lowering_pipeline(lean=self.lean, decompose=True) if self.inductor else []

    def graph_to_estimate(self, gm: fx.GraphModule) -> fx.Graph:
        """The graph a memory estimate of ``gm`` reads: under Inductor the graph Inductor gets, before its
        decompositions (rewrites move and copy values; what Inductor computes inside its readers is never
        allocated, which ``graph_utils.memory`` models on the undecomposed ops); else ``gm``'s own."""
        return prepare_for_inductor(gm, decompose=False, lean=self.lean).graph if self.inductor else gm.graph

    def start(self, device: torch.device, workers: WorkerPool) -> None:
        """Called before the step is traced: with Inductor on a GPU, its kernel-compile workers start
        now, while the step is traced and optimized (``start_compile_workers``), and so do the processes
        that compile all pieces but one of a graph compiled in pieces, in ``workers`` (its owner closes it once
        the step's graphs are lowered, ``IterGraphModule.lower``)."""
        if self.inductor and device.type == "cuda":
            start_compile_workers()
        if self.pieces_on(device) > 1:
            workers.start(self.pieces_on(device) - 1)

    def lower_graph(self, label: str, gm: fx.GraphModule, example_inputs: tuple, num_user_outputs: int,
                    kept: Optional[KeptCode] = None, workers: Sequence[Worker] = ()) -> tuple[Callable, Optional[KeptCode]]:
        """What runs one of the step's graphs (Inductor code for ``example_inputs``, maybe as a CUDA graph) and
        the Inductor code it runs (None without Inductor, or where the code cannot be kept). ``kept``: the code
        an earlier lowering of this graph returned, loaded instead of compiling (``compile_with_inductor``);
        loaded or compiled, it is wrapped alike. ``workers``: the compile workers running, for its pieces."""
        runner, code = (compile_with_inductor(gm, example_inputs, label, self.inductor_comm_passes,
                                              self.inductor_options, kept, lean=self.lean,
                                              pieces=self.pieces_on(_device_of(example_inputs)), workers=workers)
                        if self.inductor else (gm, None))
        auto = self.cudagraphs == "auto"
        if auto and (reason := cudagraph_obstacle(gm, example_inputs)):
            log.warning("spmd: the %s graph runs without CUDA graphs: %s", label, reason)
        elif self.cudagraphs:
            placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
            runner = CudaGraphRunner(runner, [n.meta.get(ROLE) in Role.STATIC for n in placeholders], num_user_outputs,
                                     label, fall_back=auto, unread=[not n.users for n in placeholders],
                                     names=[n.meta.get(NAME) for n in placeholders])
        return runner, code


def example_like(node: fx.Node, device_of: Optional[torch.device] = None) -> torch.Tensor:
    """An uninitialized tensor shaped, strided and typed as placeholder ``node``'s value, for lowering a
    graph whose input (a value carried between iterations) no call has made yet."""
    val = node.meta["val"]
    return torch.empty_strided(val.shape, val.stride(), dtype=val.dtype, device=device_of or val.device)

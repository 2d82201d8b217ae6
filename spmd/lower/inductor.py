"""Lower a step graph (or one of its setup/main/cleanup parts) through TorchInductor.

The whole graph goes to Inductor in one piece, functional collectives included, so
forward, backward and optimizer math fuse across layer boundaries. Two things keep
what our passes decided:

* Inductor's own communication reordering is switched off (``_INDUCTOR_CONFIG``):
  no compute/comm overlap reordering, no overlap scheduler, no FX bucketing, and no
  peak-memory reordering (it picks among BFS/DFS topological orders and would move
  collectives and waits). Collectives are issued, and waited on, in graph order.
* Inductor gets a copy of the graph rewritten by ``spmd.lower.rewrites`` (declared passes, run by the
  pass manager): in-place fused optimizer ops (``_fused_adamw_`` and friends, produced by
  ``remove_copy_from_optimizer``) become opaque custom ops (``spmd_lowering::*``) that declare their
  gradients read-only, which they are without a grad scaler, so Inductor calls them in place on the graph
  inputs and does not treat the gradient buckets they read as written; ``lean`` (``Lowering.lean``, off by
  default) adds exact rewrites that take work out of that graph (``LEAN_PARTS``).

The graph does not pass through ``compile_fx``'s AOT-autograd front end, which would
re-trace the whole step only to apply Inductor's decompositions to a graph that is
already functional: ``spmd.lower.decompose_for_inductor`` applies them node by node (the last rewrite) and
``inner_compile`` (``spmd.lower.compile_graph``) runs what ``compile_fx`` runs after its re-trace (joint-graph passes,
``compile_fx_inner``). Inductor orders in-place ops by its mutation tracking, so the
graph means what it means when run op by op. On the CPU ``compile_fx_inner`` looks the graph
up in Inductor's FX graph cache first (``spmd.lower.fx_cache`` says what that needs); the code
it returns is also handed back as data (``spmd.lower.inductor_code``), which a cached step keeps
and a restarted process loads instead of calling Inductor at all; on a GPU with Triton's compiled
kernels (``spmd.lower.triton_kernels``), which that process launches without Triton.

Compiling the compute regions between collectives separately would keep the schedule trivially
but cut fusion at every bucket boundary, materialize every tensor that crosses one and multiply
compile work by the number of regions. ``pieces`` (``spmd.lower.piece_compile``) cuts a graph a few
times only, to compile the pieces side by side; a collective may be in flight across a cut, its wait in a
later piece (``spmd.lower.piece_plan`` says what crosses with it).
"""

from __future__ import annotations

import logging
import pickle
import time
from typing import Any, Callable, Optional, Sequence, Union

import torch
import torch.fx as fx
import torch.utils._pytree as pytree

from .._torch_version import INDUCTOR_OPTION_SINCE, installed as installed_torch, tested_range
from ..compile_times import phase
from ..errors import SpmdCompileError
from ..graph_utils.nodes import is_comm_node, is_wait_node
from .compile_graph import device_of, inner_compile, uses_fx_graph_cache
from .inductor_code import KeptCode, code_of, load_kept
from .opaque_ops import wrapped_ops
from .rewrites import apply_inductor_decompositions, prepare_for_inductor
from .piece_plan import cut_obstacle
from .piece_run import as_their_graph_gives
from .piece_compile import compile_in_pieces
from .worker_pool import Worker

log = logging.getLogger(__name__)


# Inductor options that would move collectives or waits away from where our passes put them.
# ``reorder_for_peak_memory`` is among them only for a graph that holds a collective (``inductor_config``).
_INDUCTOR_CONFIG = {
    "reorder_for_compute_comm_overlap": False,
    "reorder_for_peak_memory": False,
    "_fuse_ddp_communication": False,
    "bucket_all_reduces_fx": "none",
    "aten_distributed_optimizations.enable_overlap_scheduling": False,
    "aten_distributed_optimizations.enable_simple_overlap": False,
}
# Options of the tables here that a supported torch may lack: name -> first (major, minor) expected to have it
# (spmd._torch_version keeps every such version fact).
_ABSENT_BEFORE = INDUCTOR_OPTION_SINCE

# Fewer kernel launches, numerics unchanged: a cat whose inputs all need a copy anyway (a unit's
# parameters cast for its gather, a gradient bucket's casts) becomes one kernel up to this many inputs
# (Inductor's default, 8, launches one copy kernel per input past it). Set where this torch has it.
_LAUNCH_CONFIG = {"max_pointwise_cat_inputs": 64}
# Less compile, the same code: Inductor's graph partitions exist for its own CUDA graphs, which our
# graphs never use (``compile_fx_inner(cudagraphs=False)``; CUDA graphs are ours, ``spmd.lower.cudagraphs``),
# so every node lands in one partition, generated as without partitions; but finding that partition's
# inputs walks every node's free symbols, over a second at 1.3B parameters. Set where this torch has it.
_COMPILE_TIME_CONFIG = {"graph_partition": False}
# Less memory, our order kept: on a graph compiled without autograd, as ours are, Inductor's post-grad
# ``reorder_for_locality`` moves every producer down to just before its last consumer. In a training step
# that holds big inputs alive for small outputs: the LM head's weight gradient (a (vocab, dim) mm of the
# (tokens, vocab) loss gradient) moved to the tied embedding's add at the end of the backward, and the
# loss's target pick to the step's output, after the backward, so the loss gradient could not be written
# over the logits. Our passes already place every node; a user may set it back through ``inductor_options``.
# A pointwise chain of more than ``realize_opcount_threshold`` ops (30 on a GPU) is stored before its next op:
# a bfloat16 loss's gradient (the log-softmax recomputed from the online softmax's statistics, rounded to
# bfloat16, its backward, the one-hot target) is such a chain, so its float32 result was stored and cast
# in a second step that reads no logits, and Inductor could not write the gradient over them (one more
# (tokens, vocab) buffer). At 60 the chain and its cast are one store.
_ORDER_CONFIG = {"reorder_for_locality": False, "realize_opcount_threshold": 60}


# For comparison only: Inductor's own overlap scheduler and bucketer decide where collectives go.
_INDUCTOR_COMM_PASSES_CONFIG = {
    "aten_distributed_optimizations.enable_overlap_scheduling": True,
    "aten_distributed_optimizations.collective_bucketing": True,  # off by default: 1 all_reduce per gradient
}


def inductor_config(inductor_comm_passes: bool = False, extra: Optional[dict] = None,
                    collectives: bool = True) -> dict:
    """Inductor options for our graphs.

    Default: keep our schedule (``_INDUCTOR_CONFIG``). ``collectives=False`` (a graph with no collective
    or wait): Inductor's memory-aware order of its kernels is left on (``reorder_for_peak_memory``, its
    default), as torch.compile has it: it moves nothing our passes placed for overlap, and takes the order
    of least estimated peak among ours and three others (docs/memory.md, "Lowering choices", says what it
    moves). ``inductor_comm_passes=True``:
    let Inductor's own comm passes schedule and bucket the collectives instead.
    Raises ``SpmdCompileError`` when this torch lacks one of the options (renamed or
    removed), except one ``_ABSENT_BEFORE`` says a torch this old may lack: Inductor
    would otherwise silently reorder the collectives our passes placed. ``_LAUNCH_CONFIG``
    ``_COMPILE_TIME_CONFIG`` and ``_ORDER_CONFIG`` are added where this torch has them, then ``extra`` (``check_inductor_options``).
    """
    import torch._inductor.config as config

    wanted = _INDUCTOR_COMM_PASSES_CONFIG if inductor_comm_passes else _INDUCTOR_CONFIG
    known = config.get_config_copy()
    version = installed_torch()
    missing = [k for k in wanted if k not in known and version >= _ABSENT_BEFORE.get(k, (0, 0))]
    if missing:
        raise SpmdCompileError(
            f"spmd.compile: this torch ({torch.__version__}) has no Inductor option {', '.join(missing)}, which "
            "spmd sets so that Inductor keeps the collective schedule our passes chose; it was probably renamed. "
            "Lowering without it could silently reorder communication. Use a torch version spmd is tested with "
            f"({tested_range()}), or run without Inductor (GraphModuleTransformation(enable_inductor=False))."
        )
    launch = {k: v for k, v in {**_LAUNCH_CONFIG, **_COMPILE_TIME_CONFIG, **_ORDER_CONFIG}.items() if k in known}
    ours = {k: v for k, v in wanted.items() if k in known}
    if not collectives and not inductor_comm_passes:
        ours.pop("reorder_for_peak_memory", None)
    return {**launch, **ours, **check_inductor_options(extra)}


def check_inductor_options(options: Optional[dict]) -> dict:
    """``options`` (Inductor config names and values, for ``GraphModuleTransformation(inductor_options=)``)
    if this torch has each and none moves collectives; else ``ValueError`` naming the option."""
    import torch._inductor.config as config

    options = dict(options or {})
    known = config.get_config_copy()
    unknown = sorted(k for k in options if k not in known)
    if unknown:
        raise ValueError(f"inductor_options: this torch ({torch.__version__}) has no Inductor option "
                         f"{', '.join(unknown)}; see torch/_inductor/config.py for the names it has.")
    ours = sorted(k for k in options if k in _INDUCTOR_CONFIG or k in _INDUCTOR_COMM_PASSES_CONFIG)
    if ours:
        raise ValueError(f"inductor_options: {', '.join(ours)} decide where collectives run, which spmd sets so "
                         "that Inductor keeps our passes' schedule: drop them. (A measurement that lets Inductor "
                         "schedule them sets inductor_comm_passes=True: spmd._testing.with_lowering.)")
    return options


def start_compile_workers() -> None:
    """Start Inductor's pool of Triton compile workers, as ``compile_fx`` does first thing for a GPU graph.

    Until the pool answers, Inductor compiles each kernel in this process, one after another;
    started while the step is traced, the workers are ready when its kernels are generated.
    """
    from torch._inductor.async_compile import AsyncCompile

    AsyncCompile.wakeup()


def _positional(compiled: Callable[[list], Any], gm: fx.GraphModule) -> Callable:
    """``compiled`` (Inductor's boxed convention: called on a list, which it may clear) called positionally, its
    outputs in the dtypes ``gm``'s graph gives them (``as_their_graph_gives``): a step's parts run as separate
    graphs (``spmd.step.iter_graph_module``), each compiled for the values the one before hands it as its graph
    says, and the user's outputs are as eager's. Its ``boxed`` attribute calls ``compiled`` on the list given,
    which a CUDA graph's capture uses so that its static buffers are let go at their last read
    (``spmd.lower.cudagraphs``)."""
    outputs = [n.meta.get("val") if isinstance(n, fx.Node) else None
               for n in pytree.tree_leaves(gm.graph.output_node().args[0])]
    conform = as_their_graph_gives((), [v.dtype if isinstance(v, torch.Tensor) else None for v in outputs], "output")

    def run(*args):
        return conform(compiled(list(args)))

    run.boxed = lambda args: conform(compiled(args))
    return run


def _portable_config(config) -> Optional[dict]:
    """Inductor's options that differ from their defaults now (ours and the user's), where they can be sent
    to a compile worker; None where one cannot (a custom pass, a callable), so nothing is compiled there."""
    try:
        changed = {k: v for k, v in config.get_config_copy().items() if not config._is_default(k)}
        pickle.dumps(changed)
    except Exception:  # noqa: BLE001 - an option that does not travel keeps the compile in this process
        return None
    return changed


def _in_pieces(prepared: fx.GraphModule, example_inputs: Sequence, label: str, pieces: int, fx_cache: bool, config,
               workers: Sequence[Worker]) -> Optional[tuple[Callable[[list], Any], Optional[KeptCode]]]:
    """``compile_in_pieces`` in twice as many pieces as there are processes to compile them (``workers`` and this
    one, at most ``pieces``), or None where the graph is compiled whole: no worker runs, the options cannot be
    sent, or the graph is not cut."""
    workers = list(workers)[:pieces - 1]
    processes = len(workers) + 1
    options = _portable_config(config) if processes > 1 else None
    if options is None:
        log.info("spmd: the %s graph is compiled whole: %s", label,
                 "no compile worker runs" if processes < 2 else "an Inductor option set here cannot be sent to one")
        return None
    made = compile_in_pieces(prepared, example_inputs, label, 2 * processes, options, fx_cache, wrapped_ops(prepared),
                             workers)
    if made is None:
        log.info("spmd: the %s graph is compiled whole: %s", label,
                 cut_obstacle(prepared.graph) or "it is too small to cut, or has no place to cut")
    return made


def compile_with_inductor(gm: fx.GraphModule, example_inputs: Sequence[torch.Tensor], label: str = "step",
                          inductor_comm_passes: bool = False, options: Optional[dict] = None,
                          kept: Optional[KeptCode] = None, lean: Union[bool, str] = False,
                          pieces: int = 1, workers: Sequence[Worker] = ()) -> tuple[Callable, Optional[KeptCode]]:
    """Compile ``gm`` with Inductor (Triton on CUDA, C++ on CPU), keeping its comm schedule.

    The graph updates parameters and optimizer state in place and is compiled as
    inference (no autograd), which is what it is: the backward is already in it.
    Inductor's decompositions are applied node by node (``spmd.lower.decompose_for_inductor``) and
    the graph goes straight to ``compile_fx_inner``: AOT autograd's re-trace of the whole
    step, which ``compile_fx`` would run first, has nothing left to do on a functional graph.
    ``inductor_comm_passes=True`` hands collective placement to Inductor's own passes
    (for comparing them with ours; see ``inductor_config``); ``options`` are further Inductor
    options (``check_inductor_options``); ``lean``: the exact rewrites ``prepare_for_inductor`` adds (``Lowering.lean``).
    ``pieces``: compile up to this many pieces of the graph side by side (``spmd.lower.piece_compile``), in
    this process and ``workers`` (compile workers running, ``spmd.lower.worker_pool``).

    Returns a callable taking the graph's inputs positionally and returning its outputs, and the code
    it runs (``InductorCode``, or ``PiecewiseCode`` for a graph compiled in pieces; None where that
    code cannot be kept). ``kept``: code an earlier compile of this graph returned; it is loaded instead
    of compiling, and compiled again where it does not load.
    """
    from torch._inductor import config

    start = time.perf_counter()
    device = device_of(example_inputs)
    fx_cache = uses_fx_graph_cache(device, options)
    collectives = any(is_comm_node(n) or is_wait_node(n) for n in gm.graph.nodes)
    with torch.no_grad(), config.patch(inductor_config(inductor_comm_passes, options, collectives)):
        loaded = load_kept(kept, device, label) if kept is not None else None
        if loaded is not None:
            log.info("spmd: loaded the %s graph's kept Inductor code in %.1f s", label, time.perf_counter() - start)
            return _positional(loaded, gm), kept
        with phase(f"lower/{label}/inductor_prepare"):
            prepared = prepare_for_inductor(gm, decompose=pieces < 2, lean=lean)
        made = _in_pieces(prepared, example_inputs, label, pieces, fx_cache, config, workers) if pieces > 1 else None
        if made is not None:
            return _positional(made[0], gm), made[1]
        if pieces > 1:
            with phase(f"lower/{label}/inductor_prepare"):
                apply_inductor_decompositions(prepared)
        with phase(f"lower/{label}/inductor_compile_fx"):
            compiled, cache, kernels = inner_compile(prepared, list(example_inputs), label, fx_cache)
    log.info("spmd: lowered the %s graph (%d nodes) through Inductor in %.1f s (FX graph cache: %s)", label,
             len(gm.graph.nodes), time.perf_counter() - start, cache)
    code = code_of(compiled, wrapped_ops(prepared), device.index if device.type == "cuda" else None, kernels)
    if code is None:
        log.info("spmd: the %s graph's Inductor code cannot be kept beside a cached step (it needs more than its "
                 "module: constants or script objects held on the side); a restart compiles it again", label)
    return _positional(compiled, gm), code

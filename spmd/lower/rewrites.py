"""The rewrites that make a step graph into the graph Inductor gets, as declared passes.

Inductor is not given the step graph the optimization passes made: ``prepare_for_inductor`` copies it
(the step graph stays as it is) and runs ``lowering_pipeline`` on the copy with ``spmd.passes.PassManager``,
the manager that runs the optimization passes. Each rewrite is a ``@graph_optimization_pass``: named, its
docstring saying what it does and why, its place in the order declared. They exist only for Inductor
(a fused kernel ATen runs better, an order Inductor would lose, its decompositions), so they run on
Inductor's copy rather than in a mode's pipeline.

Where graphs are dumped, the transform stage records each rewrite's result for every graph the step runs
(``NN_lower_<graph>_<pass>``); ``spmd.explain`` lists the rewrites after the optimization passes; a memory
estimate reads the graph this builds (``Lowering.graph_to_estimate``). A user's pass runs among the
optimization passes, before every rewrite here, so one declared to run after a rewrite is refused
(``refuse_constraints_on_rewrites``).
"""

from __future__ import annotations

import logging
from typing import Callable, Sequence, Union

import torch
import torch.fx as fx

from ..errors import SpmdConfigError
from ..graph_utils import lazy_graph_module
from ..graph_utils.meta import SEEDS_BEFORE
from ..graph_utils.nodes import view_of_copy_op
from ..graph_utils.optimizer_ops import is_foreach, is_fused_optimizer, is_inplace, written_inputs
from ..graph_utils.phases import seeds_before
from ..passes import PassManager, graph_optimization_pass, pass_info
from .decompose_for_inductor import decompose_for_inductor
from .input_casts import cast_inputs_again
from .attention_inputs import share_attention_inputs
from .reduced_inputs import share_reduced_inputs
from .conv_layouts import share_convolution_layouts
from .dropout_masks import keep_dropout_masks_as_bool
from .graph_constants import replace_constants_by_ops
from .loss_order import order_loss_backward_after_loss
from .loss_targets import write_loss_targets_once
from .matmul_order import run_freeing_matmuls_first
from .one_rank import drop_one_rank_all_reduces
from .opaque_ops import (
    BERNOULLI, EMBEDDING, EMBEDDING_BACKWARD, check_fused_optimizer_layouts, keeps_bernoulli_whole,
    keeps_embedding_backward_whole, keeps_gathered_lookup_whole, opaque_inplace_op, writes_grads,
)
from .pack_order import delay_early_pack_inputs
from .relu_masks import keep_relu_masks_as_bool
from .step_counts import count_batches_in_place, count_steps_in_place, is_batch_count, is_step_count

log = logging.getLogger(__name__)
aten = torch.ops.aten

# The exact rewrites ``Lowering.lean`` can add, by name: a gradient all_reduce over a group of one rank leaves
# the graph (``one_rank``); a fused optimizer's step counts are added in place by one ATen call (``step_counts``).
LEAN_PARTS = ("one_rank", "step_counts")


def lean_parts(lean: Union[bool, str]) -> frozenset[str]:
    """The rewrites of ``LEAN_PARTS`` that ``lean`` turns on: all for True, none for False, else the one it names."""
    return frozenset(LEAN_PARTS if lean is True else () if lean is False else (lean,))


def _call_functions(gm: fx.GraphModule) -> list[fx.Node]:
    return [n for n in gm.graph.nodes if n.op == "call_function"]


@graph_optimization_pass()
def add_step_counts_in_place(gm: fx.GraphModule) -> None:
    """Add a fused optimizer's step counts, and the batch norms' batch counts, in place, each kind in one ATen
    call (``Lowering.lean`` part ``"step_counts"``).

    Before: ``_foreach_add(counts, 1)`` (a batch count: ``add(count, 1)``) whose results are copied back into the
    counts at the end of the step. After: ``_foreach_add_`` on the counts (``spmd.lower.step_counts``), called
    through its ``opaque_inplace_op``: ATen runs it where Inductor would compile a foreach kernel with an input
    and an output per parameter, or a kernel per batch norm; the counts hold the same values.
    """
    made, batches = count_steps_in_place(gm.graph), count_batches_in_place(gm.graph)
    for node in _call_functions(gm):
        written = written_inputs(node)
        if (is_foreach(node.target) and is_inplace(node.target) and written
                and (all(map(is_step_count, written)) or all(map(is_batch_count, written)))):
            node.target = opaque_inplace_op(node.target)
    log.debug("spmd: %d step-count increments made in place, and %d batch counts", made, batches)


@graph_optimization_pass()
def turn_view_copies_into_views(gm: fx.GraphModule) -> None:
    """Turn each ``*_copy`` view op (``t_copy``, ``detach_copy``, ``lift_fresh_copy``, ...) into the view it copies.

    Our functionalization keeps views; a user's pass may not, and Inductor has no lowering for some
    (``detach_copy`` would run as a real copy of every gradient). A view reads its base as it is when read,
    as AOT autograd's functionalization would have re-derived it. A constant made in the step
    (``torch.tensor(2.0)``'s ``lift_fresh_copy``) is read as it is.
    """
    for node in _call_functions(gm):
        view = view_of_copy_op(node.target)
        if view is aten.lift_fresh.default:
            node.replace_all_uses_with(node.args[0])
            gm.graph.erase_node(node)
        elif view is not None:
            node.target = view


@graph_optimization_pass()
def make_constants_by_ops(gm: fx.GraphModule) -> None:
    """Make each tensor constant the step's code built from Python values, and the trace kept as a module
    attribute, by the op that makes it, where one op does (``spmd.lower.graph_constants``).

    Before: ``get_attr`` of an empty tensor (transformers' ``DynamicCache`` starting each attention layer's keys
    and values as ``torch.tensor([])``) or of one value throughout. After: ``aten.empty`` / ``aten.full`` of its
    shape, dtype and device, the same tensor. A graph holding a module attribute is compiled whole, since its
    pieces could not be sent to compile workers; without them Hugging Face decoders' steps are cut into pieces.
    """
    made = replace_constants_by_ops(gm)
    if made:
        log.debug("spmd: %d tensor constants made by ops", made)


def _wrappable_fused_optimizer(node: fx.Node) -> bool:
    """An in-place fused optimizer op that leaves its gradients alone.

    The fused kernels write gradients back only when unscaling them (``grad_scale``
    given, as ``GradScaler`` does); the opaque op declares them read-only, so such
    calls stay as they are.
    """
    target = node.target
    return (is_fused_optimizer(target) and is_inplace(target) and writes_grads(target)
            and node.kwargs.get("grad_scale") is None and node.kwargs.get("found_inf") is None)


@graph_optimization_pass()
def wrap_fused_optimizers(gm: fx.GraphModule) -> None:
    """Call each in-place fused optimizer op (``_fused_adamw_``, from ``remove_copy_from_optimizer``) through its
    ``opaque_inplace_op`` (``spmd.lower.opaque_ops``).

    The opaque op declares its gradients read-only, which they are without a grad scaler: Inductor calls it in
    place on the graph inputs and does not treat the gradient buckets it reads as written (a copy of each).
    """
    for node in _call_functions(gm):
        if _wrappable_fused_optimizer(node):
            node.target = opaque_inplace_op(node.target)


@graph_optimization_pass()
def keep_ops_whole(gm: fx.GraphModule) -> None:
    """Call three ops through ATen's kernel (``spmd.lower.opaque_ops``) where Inductor's lowering of them costs.

    * An embedding backward with a bfloat16 or float16 gradient becomes ``EMBEDDING_BACKWARD``: Inductor's
      decomposition would add a float32 buffer twice the gradient's size.
    * An embedding lookup into a gathered table becomes ``EMBEDDING``: Inductor would look the rows up again
      in the backward, keeping the gathered table alive there.
    * A ``bernoulli.p`` draw (a dropout mask traced on the CPU) becomes ``BERNOULLI``: Inductor's own lowering
      let the mask's readers run before the draw.
    """
    for node in _call_functions(gm):
        if keeps_embedding_backward_whole(node):
            node.target = EMBEDDING_BACKWARD
        elif keeps_gathered_lookup_whole(node):
            node.target = EMBEDDING
        elif keeps_bernoulli_whole(node):
            node.target = BERNOULLI


@graph_optimization_pass()
def keep_dropout_masks_in_bool(gm: fx.GraphModule) -> None:
    """Make each dropout mask the backward reads a bool buffer of its own (``spmd.lower.dropout_masks``), where
    Inductor would keep the float32 random draw it compares from the forward to the backward, four times the
    bytes (torch.compile keeps the mask: it is an output of its forward graph)."""
    log.debug("spmd: %d dropout masks kept as bool", keep_dropout_masks_as_bool(gm.graph))


@graph_optimization_pass()
def keep_relu_masks_in_bool(gm: fx.GraphModule) -> None:
    """Keep a bool mask of where a ReLU's output was zero in place of the output itself, where the backward reads
    it only for that (``spmd.lower.relu_masks``): half a bfloat16 output's bytes from the forward to the backward,
    as torch.compile's partitioner keeps it."""
    log.debug("spmd: %d ReLU outputs kept as bool masks", keep_relu_masks_as_bool(gm.graph))


@graph_optimization_pass()
def lay_out_convolution_inputs_once(gm: fx.GraphModule) -> None:
    """Give every reader of a convolution input or weight that its backward reads one channels-last copy
    (``spmd.lower.conv_layouts``), where Inductor optimizes the graph's layouts: it wrote each such value twice,
    channels-last for the convolution and in the traced strides for the backward, and kept both."""
    log.debug("spmd: %d convolution inputs laid out once", share_convolution_layouts(gm))


@graph_optimization_pass()
def write_attention_inputs_once(gm: fx.GraphModule) -> None:
    """Give an attention and its backward one buffer of each value both read (``spmd.lower.attention_inputs``):
    Inductor computed such a value (grouped-query attention's repeated keys, a causal mask) for each reader."""
    log.debug("spmd: %d attention inputs written once", share_attention_inputs(gm))


@graph_optimization_pass()
def write_reduced_inputs_once(gm: fx.GraphModule) -> None:
    """Give every reader of a pointwise value that the forward and the backward both reduce over (a norm's input,
    a residual) one buffer of it, written by the forward (``spmd.lower.reduced_inputs``): Inductor computed it
    again inline in readers on both sides, and fused the backward's reductions across layers."""
    log.debug("spmd: %d reduced inputs written once", share_reduced_inputs(gm))


@graph_optimization_pass()
def cast_convolution_inputs_again(gm: fx.GraphModule) -> None:
    """Make the small low-precision casts of graph inputs that a convolution backward reads (weights, the batch)
    again right before it, grouped into few kernels (``spmd.lower.input_casts``), instead of keeping the forward's
    casts through the backward's peak, as torch.compile's code keeps them."""
    log.debug("spmd: %d input casts made again in the backward", cast_inputs_again(gm.graph))


@graph_optimization_pass()
def start_loss_backward_after_loss(gm: fx.GraphModule) -> None:
    """Start each ``nll_loss_backward`` after its loss is computed (``spmd.lower.loss_order``), so the loss
    gradient is written over the logits instead of beside them."""
    log.debug("spmd: %d loss backwards ordered after their loss", order_loss_backward_after_loss(gm.graph))


@graph_optimization_pass()
def write_loss_targets_to_memory(gm: fx.GraphModule) -> None:
    """Give each loss its targets in memory (``spmd.lower.loss_targets``) where they are computed in the step
    (HF's shifted labels): the loss gradient's kernel then reads each row's target once instead of computing it
    at every element of the row."""
    log.debug("spmd: %d loss targets written to memory", write_loss_targets_once(gm.graph))


@graph_optimization_pass()
def start_packing_after_last_gradient(gm: fx.GraphModule) -> None:
    """Start a unit's reduce-scatter buffer once its last gradient exists (``spmd.lower.pack_order``), where
    Inductor would allocate it at the first gradient's cast and hold it through the unit's backward."""
    log.debug("spmd: %d early pack inputs delayed", delay_early_pack_inputs(gm.graph))


@graph_optimization_pass()
def free_matmul_inputs_first(gm: fx.GraphModule) -> None:
    """Of two matmuls side by side, run first the one that frees a large input (``spmd.lower.matmul_order``):
    the LM head's input gradient, the gathered weight's last reader, before its weight gradient."""
    log.debug("spmd: %d freeing matmuls moved first", run_freeing_matmuls_first(gm.graph))


@graph_optimization_pass()
def remove_one_rank_all_reduces(gm: fx.GraphModule) -> None:
    """Replace a gradient all_reduce over a group of one rank, its wait and its bucket's packing by the gradients
    themselves (``Lowering.lean`` part ``"one_rank"``; ``spmd.lower.one_rank``): on one GPU they compute nothing."""
    log.debug("spmd: %d one-rank all_reduces removed", drop_one_rank_all_reduces(gm.graph))


@graph_optimization_pass(apply_after=[add_step_counts_in_place, turn_view_copies_into_views, wrap_fused_optimizers,
                                      keep_ops_whole, keep_dropout_masks_in_bool, keep_relu_masks_in_bool,
                                      lay_out_convolution_inputs_once, write_attention_inputs_once,
                                      write_reduced_inputs_once, cast_convolution_inputs_again,
                                      start_loss_backward_after_loss, write_loss_targets_to_memory,
                                      start_packing_after_last_gradient, free_matmul_inputs_first,
                                      remove_one_rank_all_reduces])
def apply_inductor_decompositions(gm: fx.GraphModule) -> None:
    """Apply Inductor's decompositions node by node (``spmd.lower.decompose_for_inductor``), what AOT autograd's
    re-trace of the whole step would do first; last, since the rewrites before it look for ops it replaces."""
    decompose_for_inductor(gm.graph)


REWRITES = (add_step_counts_in_place, turn_view_copies_into_views, make_constants_by_ops, wrap_fused_optimizers,
            keep_ops_whole, keep_dropout_masks_in_bool, keep_relu_masks_in_bool, lay_out_convolution_inputs_once,
            write_attention_inputs_once, write_reduced_inputs_once, cast_convolution_inputs_again,
            start_loss_backward_after_loss, write_loss_targets_to_memory, start_packing_after_last_gradient,
            free_matmul_inputs_first, remove_one_rank_all_reduces, apply_inductor_decompositions)


def lowering_pipeline(*, lean: Union[bool, str], decompose: bool) -> list:
    """The rewrites Inductor's graph gets, in order: ``lean``'s step counts in place (``"step_counts"``) ->
    view copies as views -> constants made by ops -> fused optimizers opaque -> ops kept whole -> dropout masks
    kept in bool -> ReLU masks kept in bool -> convolution inputs laid out once -> attention inputs written once ->
    reduced inputs written once -> convolution inputs' casts made again in the backward -> loss backward after the
    loss -> loss targets in memory -> packing after the last gradient -> freeing matmuls first -> ``lean``'s
    one-rank all_reduces removed (``"one_rank"``) -> Inductor's decompositions (``decompose``)."""
    parts = lean_parts(lean)
    return [*([add_step_counts_in_place] if "step_counts" in parts else []), turn_view_copies_into_views,
            make_constants_by_ops, wrap_fused_optimizers, keep_ops_whole, keep_dropout_masks_in_bool,
            keep_relu_masks_in_bool, lay_out_convolution_inputs_once, write_attention_inputs_once,
            write_reduced_inputs_once,
            cast_convolution_inputs_again, start_loss_backward_after_loss, write_loss_targets_to_memory,
            start_packing_after_last_gradient, free_matmul_inputs_first,
            *([remove_one_rank_all_reduces] if "one_rank" in parts else []),
            *([apply_inductor_decompositions] if decompose else [])]


def prepare_for_inductor(gm: fx.GraphModule, decompose: bool = True, lean: Union[bool, str] = False,
                         dump_as: str = "") -> fx.GraphModule:
    """A copy of ``gm`` as Inductor gets it: ``lowering_pipeline(lean=lean, decompose=decompose)`` run on it by
    ``PassManager``; ``gm`` itself is not changed.

    ``lean``: ``Lowering.lean`` (True, False or one of ``LEAN_PARTS``). ``dump_as``: where given, each rewrite's
    result is offered to an active dump recording as ``<dump_as><pass>``; else nothing is recorded.

    Example::

        prepared = prepare_for_inductor(step_gm, lean=True)  # what compile_with_inductor compiles
    """
    graph = fx.Graph()
    graph.output(graph.graph_copy(gm.graph, {}))
    _name_ops_for_inductor(graph)
    _mark_forward_and_backward(graph)
    prepared = lazy_graph_module(gm, graph)
    PassManager(lowering_pipeline(lean=lean, decompose=decompose))(prepared, dump_prefix=dump_as or None)
    check_fused_optimizer_layouts(prepared)
    return prepared


def _name_ops_for_inductor(graph: fx.Graph) -> None:
    """Record each op node's op as its ``original_aten``, as AOT autograd's trace does, so that Inductor names
    each kernel by the ops it computes and lists them in the comment above it (``triton_per_fused_native_layer_norm_6``,
    ``Original ATen: [aten.native_layer_norm]``), where our traced nodes would give ``triton_per_fused_6`` and
    ``[]``. A decomposition's nodes inherit the op they decompose (``graph_utils.decompose_node.splice``)."""
    for node in graph.nodes:
        if node.op == "call_function" and isinstance(node.target, (torch._ops.OpOverload,
                                                                    torch._ops.HigherOrderOperator)):
            node.meta.setdefault("original_aten", node.target)


def _mark_forward_and_backward(graph: fx.Graph) -> None:
    """Stamp each op node with the gradient seeds before it (``SEEDS_BEFORE``), by which
    ``spmd.lower.recompute_fusion`` keeps each of Inductor's kernels on one side of a seed, as torch.compile's
    kernels are (it compiles a forward graph and a backward graph). Nothing in a graph without seeds."""
    sides = seeds_before(graph)
    if any(sides.values()):
        for node in graph.nodes:
            if node.op == "call_function":
                node.meta[SEEDS_BEFORE] = sides[node]


def refuse_constraints_on_rewrites(passes: Sequence[Callable]) -> None:
    """Refuse (``SpmdConfigError``) a user's pass that is a lowering rewrite, or declares one among its
    ``prerequisites`` or ``apply_after``: a user's pass runs among the optimization passes, on the step graph,
    and every rewrite runs after them, on Inductor's copy of it."""
    for p in passes:
        info = pass_info(p)
        if any(info is pass_info(r) for r in REWRITES):
            raise SpmdConfigError(
                f"GraphModuleTransformation: {info.name} is a lowering rewrite (spmd.lower.rewrites), which lowering "
                "runs on the graph Inductor gets; as an optimization pass it would rewrite the step graph itself. "
                f"Drop it from passes.")
        named = [(kind, q) for kind in ("prerequisites", "apply_after") for q in getattr(info, kind) if q in REWRITES]
        if named:
            kind, rewrite = named[0]
            raise SpmdConfigError(
                f"GraphModuleTransformation: pass {info.name} declares {kind}=[{pass_info(rewrite).name}], a lowering "
                "rewrite. The rewrites run on the copy of the step graph Inductor gets, after every optimization "
                f"pass, and {info.name} runs among the optimization passes, so it can never run after one. Drop "
                f"{pass_info(rewrite).name} from its {kind}; to see what the rewrites do, dump the step "
                "(SPMD_DUMP_DIR) or call spmd.explain.")

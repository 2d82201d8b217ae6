"""Refuse an expanded step that would leave a trained parameter untrained (``graph_utils.grad_coverage``).

Run on every mode's expanded graph, before anything runs: a parameter the step reads
whose gradient is never reduced over the ranks, or whose reduced gradient never reaches
its optimizer update, would silently stay where it is while the loss still falls.
"""

from __future__ import annotations

from ..errors import SpmdCompileError
from ..graph_utils.grad_coverage import gradient_gaps
from ..trace.accumulation import LEAVES_GRADS
from ..trace.step_state import StepState


def refuse_untrained_parameters(dp, gm, state: StepState) -> None:
    """Raise ``SpmdCompileError`` naming each trained parameter ``gm`` reads but does not train.

    Frozen parameters, parameters the step does not read, and (for the update) parameters
    no optimizer holds are not checked: eager gives them no update either. Without a
    process group a replicate step reduces nothing, so there is nothing to check, and
    neither does a replicate step that leaves its gradients for a later call (``no_sync``,
    ``spmd.trace.accumulation``): the step that updates reduces them.
    """
    if not dp.is_sharded and (dp.process_group() is None or gm.meta.get(LEAVES_GRADS, False)):
        return
    trained = [i for i, t in enumerate(state.param_trained) if t]
    optimized = {i for groups in state.group_param_indices for group in groups for i in group}
    gaps = gradient_gaps(gm.graph, trained, optimized)
    if not gaps:
        return
    unreduced = [g.name for g in gaps if g.problem == "not reduced"]
    unapplied = [g.name for g in gaps if g.problem == "not applied"]
    what = []
    if unreduced:
        what.append(f"reads trained parameters {unreduced} but reduces no gradient for them over the ranks")
    if unapplied:
        what.append(f"reduces the gradients of {unapplied} but never applies them in the optimizer's update")
    raise SpmdCompileError(
        f"spmd.compile: the {dp.parallel_style} step {' and '.join(what)}: they would silently never train while "
        "the loss still falls, so the step is refused. A parameter that should not train: freeze it "
        "(p.requires_grad_(False)) before the step. Otherwise, e.g. a hook or checkpoint that hides the "
        "parameters from autograd, please report it with spmd.explain(train_step)(...)'s output."
    )

"""Let Inductor's FX graph cache serve our step graphs across processes, and never wrongly.

``compile_fx_inner`` looks a graph up in Inductor's FX graph cache (on by default, under
``TORCHINDUCTOR_CACHE_DIR``) only when a tracing context holds the fake mode of its
inputs, with a ``ShapeEnv``: the cache keeps its entries' shape guards there. ``compile_fx``
gets one from Dynamo and AOT autograd; we call ``compile_fx_inner`` directly
(``spmd.lower.inductor``), so ``inductor_cache_context`` provides it. Without it Inductor
bypasses the cache ("No shape env") and every process compiles the whole step again.

What Inductor hashes: the graph's code (ops by name, constants, process-group names),
each input's shape, stride, dtype and device, Inductor's configuration (the options
``spmd.lower.inductor`` sets included), torch and compiler versions, the CPU or GPU. What
it does not: the definition of a custom op the code names. Ours (``spmd_lowering::*``,
see ``spmd.lower.opaque_ops.opaque_inplace_op``) are defined by spmd, and their schemas
say which arguments Inductor may treat as written; so their schemas go into the key
through ``torch.compiler.config.cache_key_tag``. Their Python implementations are looked
up when the compiled code runs, not baked into it. Nor does it see the fusion rules we patch
into its scheduler (``spmd.lower.foreach_fusion``, ``spmd.lower.recompute_fusion``) or the layout rule
we give its fallbacks (``spmd.lower.optimizer_layout``), or which inputs of a piece it may write into
(``spmd.lower.donated_inputs``), which the tag names for graphs they apply to.
"""

from __future__ import annotations

import contextlib
import hashlib
from typing import Iterator

import torch
import torch.fx as fx

from ..graph_utils.meta import RECOMPUTE_OF, SEEDS_BEFORE
from ..graph_utils.optimizer_ops import is_foreach, is_fused_optimizer
from .donated_inputs import DONATED_INPUTS_RULE, donated_positions
from .foreach_fusion import FOREACH_FUSION_RULE
from .optimizer_layout import FUSED_OPTIMIZER_LAYOUT_RULE
from .recompute_fusion import RECOMPUTE_FUSION_RULE

OPAQUE_NAMESPACE = "spmd_lowering"


def opaque_schemas(gm: fx.GraphModule) -> list[str]:
    """The schemas of the ``spmd_lowering`` ops ``gm`` calls, sorted: what the cache key must add."""
    return sorted({str(n.target._schema) for n in gm.graph.nodes
                   if n.op == "call_function" and isinstance(n.target, torch._ops.OpOverload)
                   and n.target.namespace == OPAQUE_NAMESPACE})


def _user_tag() -> str:
    """The user's ``cache_key_tag`` ("" where a deletion hid the setting: unittest.mock deletes, then restores)."""
    try:
        return torch.compiler.config.cache_key_tag
    except AttributeError:
        return ""


def _cache_key_tag(gm: fx.GraphModule) -> str:
    """The user's ``cache_key_tag`` followed by a digest of our ops' schemas and the names of the rules we
    compile the graph under: for foreach ops the fusion rule (``spmd.lower.foreach_fusion``), for fused
    optimizer ops (ATen's or ours) the layout rule (``spmd.lower.optimizer_layout``), for recomputed nodes or a
    backward the rule that keeps backward work in the backward (``spmd.lower.recompute_fusion``), for a piece
    with donated inputs the rule and their positions (``spmd.lower.donated_inputs``). Code Inductor made before a
    rule is not reused. The user's tag alone where none applies."""
    parts = [_user_tag()] if _user_tag() else []
    schemas = opaque_schemas(gm)
    if schemas:
        parts.append(f"{OPAQUE_NAMESPACE}:{hashlib.sha256(chr(10).join(schemas).encode()).hexdigest()[:16]}")
    if any(n.op == "call_function" and is_foreach(n.target) for n in gm.graph.nodes):
        parts.append(FOREACH_FUSION_RULE)
    if schemas or any(n.op == "call_function" and is_fused_optimizer(n.target) for n in gm.graph.nodes):
        parts.append(FUSED_OPTIMIZER_LAYOUT_RULE)
    if any(RECOMPUTE_OF in n.meta or n.meta.get(SEEDS_BEFORE) for n in gm.graph.nodes):
        parts.append(RECOMPUTE_FUSION_RULE)
    if donated := donated_positions(gm):
        parts.append(f"{DONATED_INPUTS_RULE}:{','.join(map(str, donated))}")
    return "|".join(parts)


def _lookups() -> dict[str, int]:
    from torch._dynamo.utils import counters

    return {outcome: counters["inductor"][f"fxgraph_cache_{outcome}"] for outcome in ("hit", "miss", "bypass")}


@contextlib.contextmanager
def inductor_cache_context(gm: fx.GraphModule, fake_mode) -> Iterator[dict]:
    """Around ``compile_fx_inner(gm, ...)``: a tracing context holding ``fake_mode`` (which must have a
    ``ShapeEnv``) so Inductor consults its FX graph cache, and a cache key that covers our custom ops.

    Yields a dict that holds, after the block, ``"fx_graph_cache"``: ``"hit"``, ``"miss"`` (compiled and
    stored), ``"bypass"`` (compiled, not cacheable: Inductor's log says why) or ``"off"`` (caching disabled).
    """
    result: dict = {}
    before = _lookups()
    tag = _cache_key_tag(gm)
    prior = _user_tag()
    # set and put back by value: ``config.patch`` would delete the setting on the way out, which hides it
    # from every later reader (Inductor's own cache key included) until someone sets it again
    torch.compiler.config.cache_key_tag = tag
    try:
        with torch._guards.tracing(torch._guards.TracingContext(fake_mode)):
            yield result
    finally:
        torch.compiler.config.cache_key_tag = prior
    after = _lookups()
    result["fx_graph_cache"] = next((k for k in after if after[k] > before[k]), "off")

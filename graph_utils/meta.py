"""The keys spmd writes into ``node.meta``, and the values of the role key.

Every module that reads or writes one of these imports it from here, so a key is
spelled in one place.

* ``ROLE``: on each placeholder of a step graph, what the input is (``Role``).
* ``NAME``: on each placeholder, the user's name for it (``"layers.0.weight"``,
  ``"layers.0.weight.exp_avg"``, ``"opt0.group1.lr"``, ``"input_1"``).
* ``GRAD_OF``: on a gradient collective and its wait, the index of the parameter
  whose gradient it reduces.
* ``BUCKET``: on a (fused) gradient collective and its wait, the parameter indices it
  reduces, in graph order.
* ``UNIT``: on a collective of a sharded mode and its wait, the index of the sharding
  unit it gathers or reduces (units in post-order, the root last).
* ``PHASE``: on a collective, where the step issues it: ``"forward"``, ``"backward"``
  or ``"optimizer"`` (set by the sharded modes' expansion; ``explain`` infers the rest).
* ``KEEP``: True on a forward gather whose unit keeps its parameters gathered until the
  backward (it does not reshard after forward: the root, shard_grad_op's units).
* ``CARRIES``: on a sharded mode's gather or reduce-scatter (and its wait), the indices of the
  parameters whose shards or gradients it carries, in order.
* ``RECOMPUTE_OF``: on a node ``passes.recompute`` added to the backward, the name of the
  forward node it computes again.
* ``SYNCED_BUFFERS``: on a buffer broadcast (``broadcast_buffers``) and its wait, the names
  of the buffers it carries.
* ``SEEDS_BEFORE``: on each op node of a graph prepared for Inductor (``spmd.lower.rewrites``), how many
  gradient seeds come before it in the step's order (``graph_utils.phases``): 0 in the forward, 1 after the
  first ``loss.backward()`` started. Inductor keeps a kernel on one side (``spmd.lower.recompute_fusion``).
* ``MESH_DIM``: on each collective, the name of the device-mesh dimension whose ranks it runs
  over (``"dp"``, ``"tp"``, a hybrid mesh's ``"replicate"``/``"shard"``; set by the expansion,
  ``spmd.parallel.group_roles``), absent for a group of no mesh the step knows.
* ``DONATED``: True on a placeholder of a piece of a cut step graph whose value nothing reads after the piece
  and nothing else holds (``spmd.lower.piece_plan``): Inductor may write the piece's values into its memory
  (``spmd.lower.donated_inputs``).
"""

from __future__ import annotations

ROLE = "spmd_role"
NAME = "spmd_name"
GRAD_OF = "spmd_grad_of"
BUCKET = "spmd_bucket"
UNIT = "spmd_unit"
PHASE = "spmd_phase"
KEEP = "spmd_keep"
SYNCED_BUFFERS = "spmd_synced_buffers"
CARRIES = "spmd_carries"
RECOMPUTE_OF = "spmd_recompute_of"
MESH_DIM = "spmd_mesh_dim"
SEEDS_BEFORE = "spmd_seeds_before"
DONATED = "spmd_donated"


class Role:
    """Values of ``meta[ROLE]``."""

    PARAM = "param"
    BUFFER = "buffer"
    STATE = "state"        # optimizer state
    HYPER = "hyper"        # an optimizer hyperparameter (lr, betas, ...) as a 0-dim tensor
    INPUT = "input"        # a tensor argument of the user's step
    GRAD = "grad"          # a gradient a parameter held when the step was called (spmd.trace.accumulation)
    CARRIED = "carried"    # a value carried into the next iteration by IterGraphModule

    PERSISTENT = (PARAM, BUFFER, STATE)        # live across steps; updated in place
    STATIC = (PARAM, BUFFER, STATE, HYPER)     # keep their storage between calls (CUDA graphs read them in place)

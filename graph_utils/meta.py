"""The keys spmd writes into ``node.meta``, and the values of the role key.

Every module that reads or writes one of these imports it from here, so a key is
spelled in one place.

* ``ROLE``: on each placeholder of a step graph, what the input is (``Role``).
* ``NAME``: on each placeholder, the user's name for it (``"layers.0.weight"``,
  ``"layers.0.weight.exp_avg"``, ``"lr_0"``, ``"input_1"``).
* ``GRAD_OF``: on a gradient collective and its wait, the index of the parameter
  whose gradient it reduces.
* ``BUCKET``: on a (fused) gradient collective and its wait, the parameter indices it
  reduces, in graph order.
* ``SYNCED_BUFFERS``: on a buffer broadcast (``broadcast_buffers``) and its wait, the names
  of the buffers it carries.
"""

from __future__ import annotations

ROLE = "spmd_role"
NAME = "spmd_name"
GRAD_OF = "spmd_grad_of"
BUCKET = "spmd_bucket"
SYNCED_BUFFERS = "spmd_synced_buffers"


class Role:
    """Values of ``meta[ROLE]``."""

    PARAM = "param"
    BUFFER = "buffer"
    STATE = "state"        # optimizer state
    HYPER = "hyper"        # an optimizer hyperparameter (lr, betas, ...) as a 0-dim tensor
    INPUT = "input"        # a tensor argument of the user's step
    CARRIED = "carried"    # a value carried into the next iteration by IterGraphModule

    PERSISTENT = (PARAM, BUFFER, STATE)        # live across steps; updated in place
    STATIC = (PARAM, BUFFER, STATE, HYPER)     # keep their storage between calls (CUDA graphs read them in place)

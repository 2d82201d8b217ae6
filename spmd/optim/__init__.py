"""The optimizer as traced: hyperparameters as 0-dim graph inputs and the rewrites that let optimizer
code take them (``hyperparams``, ``hyper_rewrites``), optimizer state created before the first trace
(``state``), Meta kernels for fused-optimizer overloads torch lacks (``meta_kernels``), and
``GradScaler``'s scale and skipped steps as graph ops (``amp_scaler``).
``spmd.trace`` uses these while capturing; the traced update goes on to ``spmd.checks``.
"""

from .amp_scaler import GradScaler
from .state import ensure_optimizer_state

__all__ = ["GradScaler", "ensure_optimizer_state"]

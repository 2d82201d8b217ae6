"""What a compiled step depends on, listed once, and what checks each part in this process and in a later one.

A compiled step runs the graphs one trace of the step made, lowered. Those graphs are a function of:

=====================================  ===========================================  ==========================================
what                                   before each call in this process             before a later process reuses a kept trace
=====================================  ===========================================  ==========================================
the arguments' tensors and numbers     the signature (``call_signature``)           the trace's guards (``trace_guards``)
the state: parameters, buffers,        the signature, then ``StateCheck`` on a      the trace's guards (shapes and dtypes,
optimizer state and settings           repeated call                                never contents)
the torch settings around the call     ``ambient`` (in the signature)               ``ambient`` (in the trace index)
(grad mode, autocast, default dtype,
determinism, matmul precision, the
backward's autocast)
Python values the trace read: globals  the trace's ``ValueWatch``                   the trace's guards, by value
of the user's code, closures, module
attributes and what they hold, hooks
the code: the user's source files,     unchanged within a process                   the trace's guards (file digests,
libraries, torch and spmd                                                           versions, spmd's source digest)
the rank, world size, parallel mode    the step's definition (fixed at the wrap)    the trace index
the transformation: its passes and     the step's definition (fixed at the wrap)    a kept transform's name (the kept trace's
settings                                                                            id, the passes, the settings), where only
                                                                                    spmd's passes run (``transform_store``)
=====================================  ===========================================  ==========================================

The lowered code is then keyed by the graphs themselves (``cache_key``), with ``ambient`` and the lowering's
settings: whatever shaped a graph is in its key. ``ambient`` is the one function every check above reads the
torch settings from.
"""

from __future__ import annotations

import torch

from ..trace.backward_autocast import setting as backward_autocast_setting

_AUTOCAST_DEVICES = ("cpu", "cuda")


def ambient() -> dict[str, str]:
    """The process and thread settings around a call that a trace or a lowering specialises on, by name, as
    text: grad and inference mode, autocast (per device: off, or its dtype), the default dtype, deterministic
    algorithms, float32 matmul precision, TF32, and the backward's autocast (``spmd.trace.backward_autocast``).
    Cheap (a few calls): read on every call."""
    return {
        "grad mode": "on" if torch.is_grad_enabled() else "off",
        "inference mode": "on" if torch.is_inference_mode_enabled() else "off",
        "autocast": ", ".join(f"{d} {str(torch.get_autocast_dtype(d)).removeprefix('torch.')}"
                              for d in _AUTOCAST_DEVICES if torch.is_autocast_enabled(d)) or "off",
        "default dtype": str(torch.get_default_dtype()),
        "deterministic algorithms": str(torch.are_deterministic_algorithms_enabled()),
        "float32 matmul precision": torch.get_float32_matmul_precision(),
        "tf32": f"matmul {torch.backends.cuda.matmul.allow_tf32}, cudnn {torch.backends.cudnn.allow_tf32}",
        "backward autocast": str(backward_autocast_setting()),
    }


__all__ = ["ambient"]

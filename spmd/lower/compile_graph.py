"""Inductor's half of compiling one of our graphs: from a functional, decomposed graph to what runs it.

``inner_compile`` runs what ``compile_fx`` would run after its AOT re-trace (joint-graph passes, then
``compile_fx_inner``); ``compile_piece`` first applies Inductor's decompositions to a graph that may
come without fake values (a piece of a step handed to another process, ``spmd.lower.worker_pool``).
Both take the graph's example inputs as tensors or as ``InputSpec``s: Inductor compiles from their
metadata alone.
"""

from __future__ import annotations

import contextlib
from typing import Any, Optional, Sequence

import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from torch._dispatch.python import enable_python_dispatcher

from ..compile_times import phase
from .rewrites import apply_inductor_decompositions
from .donated_inputs import donating_inputs
from .foreach_fusion import fusing_producers_safely
from .fx_cache import inductor_cache_context
from .kernel_names import short_kernel_names
from .optimizer_layout import fused_optimizer_layouts
from .piece_plan import InputSpec
from .recompute_fusion import backward_stays_in_the_backward
from .triton_kernels import collecting as collecting_triton_kernels

# Devices whose step graphs are looked up in Inductor's FX graph cache (``uses_fx_graph_cache``). Not the
# GPU: a restart runs the code kept beside the step (``spmd.lower.inductor_code``) and never reaches
# Inductor, while the tracing context the cache needs made a cold GPU compile slower (BENCHMARKS.md);
# ``inductor_options={"fx_graph_cache": True}`` asks for it there, to measure it.
FX_CACHE_DEVICES = ("cpu",)


def inner_compile(gm: fx.GraphModule, example_inputs: list, label: str,
                  fx_cache: bool) -> tuple[Any, str, Optional[bytes]]:
    """Inductor's post-AOT half on ``gm`` (already functional and decomposed; ``example_inputs``: tensors or
    ``InputSpec``s): joint-graph passes, then
    ``compile_fx_inner`` as an inference graph, as ``compile_fx`` would run them after its AOT re-trace,
    looked up in Inductor's FX graph cache first where ``fx_cache`` (``spmd.lower.fx_cache``).
    Returns what ``compile_fx_inner`` made (called on a list of the graph's inputs), the cache lookup's
    outcome and, on a GPU without that cache, its Triton kernels (``spmd.lower.triton_kernels``)."""
    from torch._inductor.compile_fx import _recursive_joint_graph_passes, compile_fx_inner
    from torch._inductor.utils import BoxedBool, output_node
    from torch._inductor.virtualized import V
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv
    from torch.fx.passes.fake_tensor_prop import FakeTensorProp

    # One fake mode for every value on the graph: our trace, the passes and the decompositions
    # each made theirs, and Inductor's pattern passes combine values they read off the nodes.
    # Its ShapeEnv (static shapes: no symbols) is where Inductor's FX graph cache keeps guards.
    mode = FakeTensorMode(allow_non_fake_inputs=True, shape_env=ShapeEnv() if fx_cache else None)
    with phase(f"lower/{label}/inductor_compile_fx/fake_prop"):
        fakes = fake_inputs(example_inputs, mode)
        with enable_python_dispatcher():
            FakeTensorProp(gm, mode=mode).propagate_dont_convert_inputs(*fakes)
    with phase(f"lower/{label}/inductor_compile_fx/joint_passes"), V.set_fake_mode(mode):
        gm = _recursive_joint_graph_passes(gm, input_device=device_of(example_inputs))
    outputs = output_node(gm)
    # every output is the user's (AOT would say the same of an inference graph): keep their strides
    outputs.meta["user_visible_output_idxs"] = [
        i for i, out in enumerate(pytree.arg_tree_leaves(*outputs.args)) if isinstance(out, fx.Node)]
    context = inductor_cache_context(gm, mode) if fx_cache else contextlib.nullcontext({"fx_graph_cache": "off"})
    # Triton's kernels kept with the code where the FX graph cache (which bundles them itself) is not used
    kernels = collecting_triton_kernels(not fx_cache and device_of(example_inputs).type == "cuda")
    with (phase(f"lower/{label}/inductor_compile_fx/compile_fx_inner"), context as cache, kernels as bundle,
          fusing_producers_safely(), fused_optimizer_layouts(), backward_stays_in_the_backward(),
          short_kernel_names(), donating_inputs()):
        # Inductor gets fake inputs, as from AOT autograd: it compiles from their metadata alone, and its
        # FX graph cache key would hash a real input by value (every parameter copied to the host)
        compiled = compile_fx_inner(gm, fakes, cudagraphs=BoxedBool(False), is_inference=True)
    return compiled, cache["fx_graph_cache"], (bundle[0] if bundle else None)


def device_of(example_inputs: Sequence) -> torch.device:
    """The accelerator the graph's inputs (tensors or ``InputSpec``s) live on, else the CPU."""
    devices = {t.device for t in example_inputs if isinstance(t, (torch.Tensor, InputSpec))}
    return next((d for d in devices if d.type != "cpu"), torch.device("cpu"))


def uses_fx_graph_cache(device: torch.device, options: Optional[dict]) -> bool:
    """Whether a graph on ``device`` is looked up in Inductor's FX graph cache: on the CPU unless
    ``options`` turn the cache off, on a GPU only where they turn it on (``FX_CACHE_DEVICES``)."""
    asked = (options or {}).get("fx_graph_cache")
    return asked is not False and (device.type in FX_CACHE_DEVICES or asked is True)


def fake_inputs(inputs: Sequence, mode) -> list:
    """Fake tensors in ``mode`` for ``inputs`` (tensors, ``InputSpec``s or constants, kept as they are)."""
    return [mode.from_tensor(t, static_shapes=True) if isinstance(t, torch.Tensor)
            else t.fake(mode) if isinstance(t, InputSpec) else t for t in inputs]


def compile_piece(gm: fx.GraphModule, inputs: Sequence, label: str, fx_cache: bool) -> tuple[Any, str, Optional[bytes]]:
    """``inner_compile`` of ``gm`` (functional, not yet decomposed) after Inductor's decompositions, which read
    every node's fake value: where a node has none (a graph sent from another process), they are
    propagated from ``inputs`` first."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.passes.fake_tensor_prop import FakeTensorProp

    with phase(f"lower/{label}/inductor_prepare"):
        if any(n.op != "output" and "val" not in n.meta for n in gm.graph.nodes):
            mode = FakeTensorMode(allow_non_fake_inputs=True)
            with enable_python_dispatcher():
                FakeTensorProp(gm, mode=mode).propagate_dont_convert_inputs(*fake_inputs(inputs, mode))
        apply_inductor_decompositions(gm)  # the last lowering rewrite, here piece by piece
    with phase(f"lower/{label}/inductor_compile_fx"):
        return inner_compile(gm, list(inputs), label, fx_cache)

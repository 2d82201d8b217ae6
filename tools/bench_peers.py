"""The sharded peers ``spmd bench`` measures spmd's sharded modes against: FSDP2 and torchtitan's SimpleFSDP.

Each function here applies one peer to a plain model the way its authors do, with the
same units as spmd's sharded modes (one per ``unit_class`` module, the root takes the
rest); ``bench_modes`` registers the modes built from them.

* ``fsdp2``: ``fully_shard`` on each unit, then on the root (FSDP2's docs, torchtitan's
  ``apply_fsdp``); ``compile_units=True`` first compiles each unit in place, as
  torchtitan's ``apply_compile`` does (a whole-model compile of FSDP2 breaks the graph
  at every unit).
* ``simple_fsdp``: SimpleFSDP (torchtitan's ``experiments/graph_trainer/simple_fsdp.py``,
  arXiv 2411.00284): every parameter a ``Shard(0)`` DTensor whose use all-gathers it
  and whose gradient is reduce-scattered, inside one ``torch.compile`` of the whole
  model. With ``bucket=True`` the compiler groups those collectives per unit and
  prefetches them (torch's ``manual_overlap_bucketing``, torchtitan's
  ``transformer_block_bucketing``); without it every parameter has its own collectives.
  Under ``torch.compile`` the gathered parameters live from forward to backward (torchtitan
  re-gathers in backward only in its own whole-step tracer), so its memory compares
  with ``shard_grad_op``'s rather than ``fully_shard``'s.
  Three traps of its ``data_parallel`` are handled here: it sums gradients over the ranks
  (the caller divides its loss by the world size to train as DDP does), it gives each
  module a parameter of its own, so tied weights come apart, and its new parameters all
  require gradients, frozen ones too (``simple_fsdp`` ties and freezes them again).

torchtitan is not a dependency of spmd: SimpleFSDP loads only when torchtitan is
importable (``simple_fsdp_unavailable`` says why not); ``WHEEL_INSTALL`` is how the GPU
suite installs it without a network.
"""

from __future__ import annotations

import functools
from typing import Optional

import torch
import torch.nn as nn
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

# torchtitan and the three packages its simple_fsdp module imports (through torchtitan.protocols),
# installed without their declared dependencies (training-pipeline extras SimpleFSDP does not use)
SIMPLE_FSDP_WHEELS = ("torchtitan==0.3.0", "spmd_types==0.2.3", "tyro", "docstring_parser")
WHEEL_DIR, SITE_DIR = ".whl", "/tmp/site"
PIP_INSTALL = ("pip", "install", "-q", "--upgrade", "--no-index", "--no-deps", "--target", SITE_DIR)  # + the wheels
WHEEL_INSTALL = f"python3 -m {' '.join(PIP_INSTALL)} {WHEEL_DIR}/*.whl"


def units(model: nn.Module, unit_class: type) -> list[nn.Module]:
    """The ``unit_class`` modules of ``model``, in module order."""
    return [m for m in model.modules() if isinstance(m, unit_class)]


def fsdp2(model: nn.Module, unit_class: type, mp_policy: Optional[MixedPrecisionPolicy],
          compile_units: bool = False, backend: str = "inductor") -> nn.Module:
    """``model`` with FSDP2's ``fully_shard`` on each ``unit_class`` module, then on the root (in place)."""
    kwargs = dict(mp_policy=mp_policy or MixedPrecisionPolicy())
    for unit in units(model, unit_class):
        if compile_units:
            unit.compile(backend=backend, fullgraph=True)
        fully_shard(unit, **kwargs)
    fully_shard(model, **kwargs)
    return model


@functools.cache
def _load_simple_fsdp():
    """torchtitan's simple_fsdp module, or the exception importing it raised."""
    try:
        from torchtitan.experiments.graph_trainer import simple_fsdp
    except Exception as err:  # noqa: BLE001 - any import failure makes the peer unavailable, with its reason
        return err
    return simple_fsdp


def simple_fsdp_unavailable() -> Optional[str]:
    """Why SimpleFSDP cannot be loaded here, or None."""
    loaded = _load_simple_fsdp()
    if not isinstance(loaded, Exception):
        return None
    first_line = (str(loaded).splitlines() or [""])[0]
    return (f"SimpleFSDP needs torchtitan ({type(loaded).__name__}: {first_line}); "
            f"put the wheels of {', '.join(SIMPLE_FSDP_WHEELS)} in {WHEEL_DIR}/, run `{WHEEL_INSTALL}` and "
            f"set PYTHONPATH={SITE_DIR} (spmd bench --suite gpu does both when {WHEEL_DIR}/ exists)")


def _tied(model: nn.Module) -> list[list[tuple[nn.Module, str]]]:
    """The (module, attribute) places of each parameter held in more than one place."""
    places: dict[int, list[tuple[nn.Module, str]]] = {}
    for module in model.modules():
        for attr, p in module._parameters.items():
            if p is not None:
                places.setdefault(id(p), []).append((module, attr))
    return [where for where in places.values() if len(where) > 1]


def simple_fsdp(model: nn.Module, mesh, mp_policy: Optional[MixedPrecisionPolicy]) -> nn.Module:
    """``model`` under SimpleFSDP's ``fully_shard`` over ``mesh`` (in place), its tied weights tied again
    and its frozen parameters frozen again.

    Gradients come out summed over the ranks, not averaged.
    """
    sf = _load_simple_fsdp()
    tied = _tied(model)
    frozen = {name for name, p in model.named_parameters() if not p.requires_grad}
    policy = None if mp_policy is None else sf.MixedPrecisionPolicy(param_dtype=mp_policy.param_dtype,
                                                                     reduce_dtype=mp_policy.reduce_dtype)
    model = sf.data_parallel(model, mesh, "fully_shard", mp_policy=policy)
    for (first, first_attr), *others in tied:
        for module, attr in others:
            module._parameters[attr] = first._parameters[first_attr]
    for name, p in model.named_parameters():
        p.requires_grad_(name not in frozen)
    return model


def compile_simple_fsdp(model: nn.Module, unit_class: type, bucket: bool, backend: str) -> nn.Module:
    """A SimpleFSDP ``model`` compiled whole, as torchtitan compiles it; ``bucket``: its collectives per unit."""
    if not bucket:
        return torch.compile(model, backend=backend, fullgraph=True)
    return _compile_bucketed(model, bucket_plans(model, unit_class), backend)


def bucket_plans(model: nn.Module, unit_class: type) -> list:
    """The bucket plan of the units: one bucket for the root's modules (the children that hold
    parameters and no unit), then each unit's qualified name."""
    unit_set = set(units(model, unit_class))
    root = [name for name, child in model.named_children()
            if not any(m in unit_set for m in child.modules()) and any(True for _ in child.parameters())]
    return ([root] if root else []) + [name for name, m in model.named_modules() if m in unit_set]


def bucketing_unavailable() -> Optional[str]:
    """Why this torch lacks the bucketing pass SimpleFSDP's ``simple_fsdp`` mode compiles with, or None."""
    try:
        from torch._inductor.fx_passes.overlap_manual_scheduling import manual_overlap_bucketing  # noqa: F401
    except ImportError as err:
        return f"torch {torch.__version__} has no manual_overlap_bucketing for SimpleFSDP ({err})"
    return None


def _compile_bucketed(model: nn.Module, plans: list, backend: str) -> nn.Module:
    """``torch.compile`` of ``model`` with SimpleFSDP's collectives bucketed per entry of ``plans``.

    As torchtitan's ``transformer_block_bucketing`` applies it: after AOT autograd's
    partitioning on the forward and backward graphs (``aot_eager``), or as Inductor's
    post-grad pass with Inductor's own reordering off (given as ``options``, so other
    compiled modes in this process keep Inductor's defaults).
    """
    from torch._inductor.fx_passes.overlap_manual_scheduling import manual_overlap_bucketing

    if backend == "aot_eager":
        from torch._dynamo.backends.common import aot_autograd

        def bucket(gm, example_inputs=None):
            manual_overlap_bucketing(gm, module_bucket_plans=plans, insert_overlap_deps=False)
            gm.recompile()
            return gm

        compiler = aot_autograd(fw_compiler=bucket, bw_compiler=bucket, keep_inference_input_mutations=True)
        return torch.compile(model, backend=compiler, fullgraph=True)

    def post_grad(graph):
        manual_overlap_bucketing(graph.owning_module, module_bucket_plans=plans, insert_overlap_deps=True)

    options = dict(post_grad_custom_post_pass=post_grad, allow_buffer_reuse=False, reorder_for_peak_memory=False,
                   reorder_for_compute_comm_overlap=False)
    return torch.compile(model, backend=backend, fullgraph=True, options=options)

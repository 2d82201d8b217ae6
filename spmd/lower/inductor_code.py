"""Inductor's compiled code for one of our graphs as data, so a restarted process runs it without Inductor.

What ``compile_fx_inner`` makes for a graph is a Python module (``CompiledFxGraph.source_code``) whose
``call(args)`` runs the graph: its kernels are written into it as source and compiled when it is loaded,
through Triton's cache on a GPU and Inductor's C++ cache on the CPU, so a machine whose caches are warm
loads them in a moment and one whose caches are cold compiles them again, correctly. Keeping that module
in the compile cache, keyed by the graph, spares a restart everything after its trace: preparing the graph for Inductor,
propagating fake values, the joint-graph passes, Inductor's lowering, scheduling and code generation.
Its bytecode is kept beside its source in Inductor's cache (``keep_bytecode``), so loading it compiles no
Python either (Inductor's own loader compiles a module's source on every load).

A graph whose compiled form needs more than its module (constants held on the side, script objects) is
not kept: ``code_of`` returns None and the graph is compiled on each restart, as before.

Inductor writes the CUDA device it compiled for into the module (device guards, streams, each kernel's
device properties). Ranks of one job run the same graph on different devices, so code compiled on
``cuda:0`` is moved to another device before it is loaded there (``relocated``): every place that names
the device is rewritten, and code that names a device in a form not known here is refused (compiled again).
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import logging
import os
import py_compile
import re
import sys
from dataclasses import dataclass, replace
from types import ModuleType
from typing import Any, Callable, Optional, Union

import torch

from ..compile_times import phase
from .autotune_choices import chosen_configs, loaded_namespace, pin_loaded
from .graph_wire import op_named
from .opaque_ops import opaque_inplace_op
from .piece_plan import PiecePlan
from .piece_run import run_pieces
from .triton_kernels import emit as emit_triton_kernels

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class InductorCode:
    """What runs one compiled graph: Inductor's module source and how its inputs must be aligned."""

    source: str
    linemap: tuple
    inputs_to_check: tuple  # inputs the kernels assume aligned: a misaligned one is copied first
    mutated_inputs: tuple  # inputs the graph writes: a copied one is written back
    wrapped_ops: tuple = ()  # names of the ops the code calls as ``spmd_lowering`` ops (defined before loading)
    cuda_index: Optional[int] = None  # the CUDA device the source names (None: it runs on the CPU)
    triton_kernels: Optional[bytes] = None  # its compiled Triton kernels (``spmd.lower.triton_kernels``)
    # (kernel name, config) each Triton kernel ran after the first run (``spmd.lower.autotune_choices``)
    autotuned: tuple = ()


@dataclass(frozen=True)
class PiecewiseCode:
    """What runs a graph compiled in pieces (``spmd.lower.piece_compile``): each piece's code and how they run."""

    pieces: tuple[InductorCode, ...]
    plan: PiecePlan


KeptCode = Union[InductorCode, PiecewiseCode]


def _empty(value: Any) -> bool:
    return value is None or len(value) == 0


def code_of(compiled: Any, wrapped_ops: tuple = (), cuda_index: Optional[int] = None,
            triton_kernels: Optional[bytes] = None) -> Optional[InductorCode]:
    """``compiled`` (what ``compile_fx_inner`` returned for inputs on CUDA device ``cuda_index``, or None for
    the CPU; ``wrapped_ops``: the names of the ops its graph called through
    ``spmd.lower.opaque_ops.opaque_inplace_op``; ``triton_kernels``: its kernels as
    ``spmd.lower.triton_kernels.collecting`` kept them) as an ``InductorCode``, or None where its module
    alone does not run it (it holds constants or script objects on the side, or this torch names its parts
    otherwise)."""
    needed = ("source_code", "inputs_to_check", "mutated_input_idxs")
    if not all(hasattr(compiled, name) for name in needed) or not isinstance(compiled.source_code, str):
        return None
    if not all(_empty(getattr(compiled, name, None))
               for name in ("constants", "torchbind_constants", "opaque_value_type_classes", "frozen_param_names")):
        return None
    mutated = tuple(sorted(compiled.mutated_input_idxs))
    checked = tuple(compiled.inputs_to_check)
    if getattr(compiled, "_defers_input_alignment", False):
        # the module copies a misaligned input it only reads itself; the wrapper handles the written ones (as
        # Inductor's own post-compile step wraps them), which must be copied back
        checked = tuple(i for i in checked if i in mutated)
    return InductorCode(compiled.source_code, tuple(getattr(compiled, "cache_linemap", None) or ()), checked, mutated,
                        tuple(wrapped_ops), cuda_index, triton_kernels)


# Where Inductor's Python wrapper and its Triton kernels name a CUDA device (group 1: the index).
_DEVICE_NAMES = (
    r"torch\.cuda\._DeviceGuard\((\d+)\)",
    r"torch\.cuda\.set_device\((\d+)\)",
    r"get_raw_stream\((\d+)\)",
    r"device\(type='cuda', index=(\d+)\)",
    r"DeviceProperties\(type='cuda', index=(\d+)",
    r"""['"]cuda:(\d+)['"]""",
)
_DEVICE_NAME = re.compile("|".join(f"(?:{p})" for p in _DEVICE_NAMES))


class NotRelocatable(ValueError):
    """The code names its CUDA device in a way ``relocated`` does not rewrite safely."""


def relocated(code: InductorCode, cuda_index: Optional[int]) -> InductorCode:
    """``code`` for CUDA device ``cuda_index`` (the same GPU model; the step key says so): ``code`` itself
    where it already runs there; ``NotRelocatable`` where it names another device than the one it was
    compiled for, or runs on the CPU while CUDA is asked for (or the other way round)."""
    if code.cuda_index == cuda_index:
        return code
    if code.cuda_index is None or cuda_index is None:
        raise NotRelocatable(f"compiled for {_where(code.cuda_index)}, asked for {_where(cuda_index)}")

    def rewrite(match: re.Match) -> str:
        index = next(int(g) for g in match.groups() if g is not None)
        if index != code.cuda_index:
            raise NotRelocatable(f"it names cuda:{index} besides cuda:{code.cuda_index}, the device it was compiled for")
        start, end = next(match.span(i) for i, g in enumerate(match.groups(), 1) if g is not None)
        whole = match.group(0)
        return whole[: start - match.start()] + str(cuda_index) + whole[end - match.start():]

    source = _DEVICE_NAME.sub(rewrite, code.source)
    return replace(code, source=source, cuda_index=cuda_index)


def _where(index: Optional[int]) -> str:
    return "the CPU" if index is None else f"cuda:{index}"


def load_code(code: InductorCode, phase: Callable[[str], Any]) -> Callable[[list], Any]:
    """A callable running ``code`` on a list of the graph's inputs (Inductor's boxed convention: it may
    clear the list), compiling its kernels now where the kernel caches do not hold them. ``phase(name)``:
    a context timing each part (``spmd.compile_times.phase``): importing Inductor's loader, writing the
    module, and running it (which defines its kernels)."""
    with phase("import"):
        from torch._inductor.codecache import PyCodeCache
        from torch._inductor.utils import align_inputs_from_check_idxs
        from torch.utils._ordered_set import OrderedSet

    with phase("write"):
        key, path = PyCodeCache.write(code.source)
    with phase("module"):
        module = _load_module(PyCodeCache, key, path, list(code.linemap))
    pinned = pin_loaded(vars(module), dict(code.autotuned))
    if pinned:
        log.info("spmd: %d kernels launch the config autotuning chose before, without benchmarking again", pinned)
    return align_inputs_from_check_idxs(module.call, list(code.inputs_to_check), OrderedSet(code.mutated_inputs))


def _module_name(key: str) -> str:
    return f"torch._inductor.runtime.compile_tasks.{key}"  # the name Inductor's own loader gives the module


def _load_module(code_cache: Any, key: str, path: str, linemap: list) -> ModuleType:
    """The module Inductor's code cache (``code_cache``: ``PyCodeCache``) wrote at ``path``, loaded and recorded
    as its ``load_by_key_path`` does, but with its code object from Python's import machinery
    (``SourceFileLoader.get_code``): it reads the bytecode kept in ``__pycache__`` beside the source
    (``keep_bytecode``) instead of compiling the source again, and writes it there where it is missing (also
    under ``PYTHONDONTWRITEBYTECODE``). Inductor's loader compiles the source on every load: for a large step's
    modules, that was a good part of a restart's loading. A module this process loaded already is returned as it is, as Inductor does."""
    loaded = getattr(code_cache, "modules_no_attr", None)
    if isinstance(loaded, dict) and path in loaded:
        return loaded[path]
    name = _module_name(key)
    _write_bytecode(path, only_if_missing=True)  # a cache whose bytecode was lost regains it here
    bytecode = importlib.machinery.SourceFileLoader(name, path).get_code(name)
    module = ModuleType(name)
    module.__file__ = path
    module.key = key
    exec(bytecode, vars(module))
    sys.modules[name] = module
    # Inductor's bookkeeping, as its loader keeps it, where this torch has it (a module's line map for its
    # errors, and its modules by path, which ``autotune_choices.loaded_namespace`` reads)
    if isinstance(getattr(code_cache, "linemaps", None), dict):
        code_cache.linemaps[path] = list(zip(*linemap))
    if isinstance(loaded, dict):
        loaded[path] = module
    if isinstance(getattr(code_cache, "modules", None), list):
        code_cache.modules.append(module)
    return module


def keep_bytecode(codes: dict[str, KeptCode]) -> None:
    """Compile each module of ``codes`` (by graph label, as the compile cache keeps them) into its bytecode in
    ``__pycache__`` beside its source in Inductor's cache, where a restarted process that loads it finds it
    (``_load_module``). Called where the code is kept. Written also where Python writes no bytecode for
    imports (``PYTHONDONTWRITEBYTECODE``, set in many containers): it is a cache's file, as Inductor's compiled
    kernels beside it are. A module whose bytecode cannot be written is loaded from its source."""
    from torch._inductor.codecache import PyCodeCache

    for code in codes.values():
        for piece in code.pieces if isinstance(code, PiecewiseCode) else (code,):
            _write_bytecode(PyCodeCache.write(piece.source)[1])


def _write_bytecode(path: str, only_if_missing: bool = False) -> None:
    """Compile the module at ``path`` into its bytecode in ``__pycache__`` beside it (see ``keep_bytecode``);
    ``only_if_missing``: not where that bytecode is there already. A failure is logged: only a restart's
    loading is then not spared."""
    cached = importlib.util.cache_from_source(path)
    if only_if_missing and os.path.exists(cached):
        return
    try:
        py_compile.compile(path, cfile=cached, doraise=True)
    except Exception as err:  # noqa: BLE001 - see above
        log.info("spmd: a kept module's bytecode is not written (%s: %s)", type(err).__name__, err)


def load_kept(code: KeptCode, device: torch.device, label: str) -> Optional[Callable[[list], Any]]:
    """What runs ``code`` (kept from an earlier compile of this graph, ``spmd.lower.inductor_code``) on
    ``device`` (Inductor's boxed convention: called on a list of the graph's inputs), or None where it does
    not load there (said once; the graph is then compiled)."""
    if isinstance(code, PiecewiseCode):
        pieces = [load_kept(piece, device, f"{label}/{i}") for i, piece in enumerate(code.pieces)]
        return None if any(p is None for p in pieces) else run_pieces(code.plan, pieces)
    try:
        with phase(f"lower/{label}/inductor_code_load"):
            if code.triton_kernels is not None and device.type == "cuda":
                with phase(f"lower/{label}/inductor_code_load/triton_kernels"):
                    launched = emit_triton_kernels(code.triton_kernels, code.cuda_index, device.index,
                                                   dict(code.autotuned))
                log.info("spmd: %d of the %s graph's kernels are launched as compiled before", launched, label)
            code = relocated(code, device.index if device.type == "cuda" else None)
            for name in code.wrapped_ops:  # the code calls them by name: define them first
                opaque_inplace_op(op_named(name))
            return load_code(code, lambda part: phase(f"lower/{label}/inductor_code_load/{part}"))
    except Exception as err:  # noqa: BLE001 - a kept module that does not load is a miss, not a failure
        log.warning("spmd: the kept Inductor code of the %s graph did not load (%s: %s); compiling it again",
                    label, type(err).__name__, err)
        return None


def with_autotuned(codes: dict[str, KeptCode], device: torch.device) -> dict[str, KeptCode]:
    """``codes`` (by graph label, as a step's lowering made them and it ran them once on ``device``) with the
    Triton config each kernel of their loaded modules runs now (``InductorCode.autotuned``), so a restart
    launches the same configs (``load_kept``). CPU code, and code whose module this process does not hold,
    stays as it is."""
    def tuned(code: KeptCode) -> KeptCode:
        if isinstance(code, PiecewiseCode):
            return replace(code, pieces=tuple(tuned(piece) for piece in code.pieces))
        if code.cuda_index is None or device.type != "cuda":
            return code
        try:
            namespace = loaded_namespace(relocated(code, device.index).source)
        except NotRelocatable:
            return code
        chosen = chosen_configs(namespace) if namespace is not None else ()
        return replace(code, autotuned=chosen) if chosen else code

    return {label: tuned(code) for label, code in codes.items()}

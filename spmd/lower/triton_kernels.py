"""Triton's compiled kernels kept with a GPU graph's Inductor code, so a restarted process launches them at once.

Loading Inductor's module for a GPU graph defines each kernel through ``async_compile.triton``. With
Triton's cache warm that still builds every kernel's launcher through Triton, one after another, most of
loading a kept GPU step's code (BENCHMARKS.md, "Round 5"). ``torch.compile``'s warm
path skips it: its FX graph cache entry holds Inductor's ``TritonBundle``, each kernel's Triton cache files
and a statically launchable copy of its autotuner, which it writes back into Triton's cache and into the
table ``async_compile.triton`` looks in before compiling anything.

Our GPU graphs do not go through that cache (``spmd.lower.compile_graph.FX_CACHE_DEVICES``), and Inductor
bundles kernels only around a cache miss, so ``collecting`` runs Inductor's ``TritonBundler`` around our
compile and ``emit`` hands the bundle back before the kept module is loaded. The bundle is kept pickled:
one that does not load (a cubin gone, another torch) costs only time, as the kernels are then compiled
from Triton's cache or their source. A bundle is only used on the device it was compiled for: a kernel's
source names its device, so code moved to another GPU (``spmd.lower.inductor_code.relocated``) looks its
kernels up under other keys; the Triton cache files still spare that GPU's compile.
"""

from __future__ import annotations

import contextlib
import logging
import pickle
from dataclasses import replace
from typing import Iterator, Optional

from .autotune_choices import pin_bundled

log = logging.getLogger(__name__)


@contextlib.contextmanager
def collecting(enabled: bool) -> Iterator[list]:
    """Around an Inductor compile: yields a list that, after the block, holds the pickled ``TritonBundle`` of
    the kernels compiled in it; stays empty where ``enabled`` is False, or Inductor bundles nothing here
    (its caches forced off, another compile already bundling, a torch without the bundler)."""
    found: list = []
    bundler = _bundler() if enabled else None
    if bundler is None:
        yield found
        return
    from torch._inductor import config

    with config.patch(bundle_triton_into_fx_graph_cache=True):
        if not bundler.is_enabled() or bundler._entries is not None:
            yield found
            return
        bundler.begin_compile()
        try:
            yield found
            found.extend(_collected(bundler))
        finally:
            bundler.end_compile()


def _collected(bundler: type) -> list:
    """The kernels ``bundler`` saw, as a one-item list holding the pickled bundle (none where it cannot)."""
    try:
        bundle, _ = bundler.collect()
        return [pickle.dumps(bundle, protocol=pickle.HIGHEST_PROTOCOL)]
    except Exception as err:  # noqa: BLE001 - the code runs as compiled; only its kernels are not kept
        log.info("spmd: Triton's kernels are not kept with the code (%s: %s)", type(err).__name__, err)
        return []


def emit(bundle: bytes, compiled_on: int, running_on: int, chosen: Optional[dict] = None) -> int:
    """Write ``bundle`` (from ``collecting``, made on CUDA device ``compiled_on``) back into Triton's cache
    for device ``running_on`` and, where the two are the same, into the table the module's kernels are
    looked up in, each kernel named in ``chosen`` (kernel name -> config, ``spmd.lower.autotune_choices``)
    with only that config's binary. Returns how many kernels will be launched without Triton (0 where the
    bundle does not load)."""
    bundler = _bundler()
    if bundler is None:
        return 0
    from torch._inductor import config

    try:
        loaded = pickle.loads(bundle)
        if running_on != compiled_on:
            loaded = replace(loaded, static_autotuners=[],
                             kernel_artifacts=[replace(a, device=running_on) for a in loaded.kernel_artifacts])
        pinned = pin_bundled(loaded.static_autotuners, chosen or {})
        if pinned:
            log.info("spmd: %d kept kernels launch the config autotuning chose before, without benchmarking again",
                     pinned)
        with config.patch(bundle_triton_into_fx_graph_cache=True):
            meta = bundler.read_and_emit(loaded)
    except Exception as err:  # noqa: BLE001 - a bundle that does not load is compiled as without it
        log.info("spmd: Triton's kept kernels did not load (%s: %s); compiling them", type(err).__name__, err)
        return 0
    return len(meta.statically_launched_kernel_names) if meta is not None else 0


def _bundler() -> Optional[type]:
    try:
        from torch._inductor.triton_bundler import TritonBundler
    except ImportError:
        return None
    return TritonBundler

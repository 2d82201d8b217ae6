"""The Triton config each of a GPU graph's kernels was autotuned to, kept with its code, so a restarted process
launches the same one without benchmarking again.

Inductor compiles some Triton kernels in several configs (block sizes, warps, stages) and times them all on
their first launch (``CachingAutotuner.autotune_to_one_config``). It keeps the winner in its autotune cache
for most kernels, not all: a restarted process that loaded a UNet's kept code still timed some kernels again
(BENCHMARKS.md, "Round 29", counts them), after loading every candidate's binary. A reduction's block size also decides
its summation order, so a process that picks another config computes other last bits than the one before.

So after a step's first run, ``chosen_configs`` reads which config each kernel of a loaded module runs, and
``spmd.lower.inductor_code.with_autotuned`` keeps that with the code (``InductorCode.autotuned``). Loading the
code again, ``pin_bundled`` keeps only that config's binary of each statically launchable kernel Triton's
bundle brings back (``spmd.lower.triton_kernels.emit``), and ``pin_loaded`` cuts every other kernel of the
module to it. A kernel whose chosen config is not among its candidates is left as Inductor made it: it is
timed on its first launch, as without this.
"""

from __future__ import annotations

from typing import Any, Iterable, Optional


def config_key(config: Any) -> str:
    """A Triton ``Config`` as a string equal across processes for an equal config: its block sizes and the
    launch settings it has."""
    parts = [f"{name}={value}" for name, value in sorted(getattr(config, "kwargs", {}).items())]
    parts += [f"{name}={getattr(config, name)}" for name in ("num_warps", "num_stages", "num_ctas", "maxnreg")
              if getattr(config, name, None) is not None]
    return ",".join(parts)


def _autotuner_type() -> Optional[type]:
    try:
        from torch._inductor.runtime.triton_heuristics import CachingAutotuner
    except ImportError:  # a torch built without Triton support
        return None
    return CachingAutotuner


def kernels_in(namespace: dict) -> dict[str, Any]:
    """The Triton kernels an Inductor module defines (name -> its ``CachingAutotuner``), from its globals."""
    autotuner = _autotuner_type()
    if autotuner is None:
        return {}
    return {name: value for name, value in namespace.items() if isinstance(value, autotuner)}


def chosen_configs(namespace: dict) -> tuple[tuple[str, str], ...]:
    """(kernel name, ``config_key``) of each kernel of the module ``namespace`` that runs one config now: after
    its first launch, what autotuning chose (or its only config). Kernels not launched yet are left out."""
    chosen = []
    for name, kernel in sorted(kernels_in(namespace).items()):
        launchers = getattr(kernel, "launchers", None) or []
        if len(launchers) == 1 and getattr(launchers[0], "config", None) is not None:
            chosen.append((name, config_key(launchers[0].config)))
    return tuple(chosen)


def _only(candidates: Iterable[Any], key: str, config_of) -> Optional[list]:
    """``[the candidate whose config is key]`` among more than one, else None (nothing to cut)."""
    candidates = list(candidates)
    if len(candidates) < 2:
        return None
    matching = [c for c in candidates if config_key(config_of(c)) == key]
    return matching[:1] or None


def _pin(kernel: Any, key: str) -> bool:
    """Cut ``kernel`` to its candidate of config ``key``, at whatever point of loading it is: its launchers
    where it made them, else its compiled binaries, else its configs. True where it was cut."""
    for attribute, config_of in (("launchers", lambda launcher: launcher.config),
                                 ("compile_results", lambda result: result.config),
                                 ("configs", lambda config: config)):
        candidates = getattr(kernel, attribute, None)
        if candidates:
            kept = _only(candidates, key, config_of)
            if kept is not None:
                setattr(kernel, attribute, kept)
            return kept is not None
    return False


def pin_loaded(namespace: dict, chosen: dict[str, str]) -> int:
    """Cut each kernel of the loaded module ``namespace`` that ``chosen`` names (kernel name -> ``config_key``)
    and that has several candidates to the chosen one. Returns how many were cut."""
    if not chosen:
        return 0
    return sum(_pin(kernel, chosen[name]) for name, kernel in kernels_in(namespace).items() if name in chosen)


def pin_bundled(static_autotuners: list, chosen: dict[str, str]) -> int:
    """Keep only the chosen config's binary of each statically launchable kernel in a Triton bundle
    (``TritonBundle.static_autotuners``, before Inductor emits it), so loading launches no other candidate's
    binary. Returns how many were cut."""
    cut = 0
    for entry in static_autotuners:
        key = chosen.get(getattr(entry, "kernel_name", None))
        kernel = getattr(entry, "kernel", None)
        results = getattr(kernel, "compile_results", None)
        if key is None or not results:
            continue
        kept = _only(results, key, lambda result: result.config)
        if kept is not None:
            kernel.compile_results = kept
            cut += 1
    return cut


def loaded_namespace(source: str) -> Optional[dict]:
    """The globals of the module Inductor's code cache loaded from ``source`` in this process (compiled here, or
    loaded from kept code), or None where it holds none."""
    try:
        from torch._inductor.codecache import PyCodeCache

        _, path = PyCodeCache.write(source)
    except Exception:  # noqa: BLE001 - a torch whose code cache differs: nothing is pinned
        return None
    module = getattr(PyCodeCache, "modules_no_attr", {}).get(path)
    if module is None:
        module = next((m for m in reversed(getattr(PyCodeCache, "modules", []))
                       if getattr(m, "__file__", None) == path), None)
    return vars(module) if module is not None else None

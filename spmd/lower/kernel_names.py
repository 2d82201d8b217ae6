"""Triton kernel names short enough for Inductor's static launcher to find the kernels' binaries.

Inductor names a fused Triton kernel after every operator fused into it. Triton keeps a compiled kernel's
files under that name cut to 150 characters (``triton.compiler.compile``), while Inductor's static launcher
looks for the binary under the whole name (``StaticTritonCompileResult.can_statically_launch``; seen in
torch 2.11, the same code in 2.13). A kernel named longer is refused ("Cubin path not found"), so it is left
out of the statically launchable kernels kept with a GPU graph's code (``spmd.lower.triton_kernels``), and a
restarted process compiles it again, in the process, one after another: the seconds T5's restarted first call
spent in ``async_compile.precompile`` (BENCHMARKS.md, "Round 54"), where its attention kernels fuse dozens of
operators each.

``short_kernel_names`` cuts the fused part of each name while our graphs compile, at an underscore, so
that the whole name (``triton_<kind>_<fused>_<number>``) stays within Triton's limit. The number Inductor
appends still tells kernels apart, and a profile still shows the operators whose names sort first. (torch 2.13
has a hook for this, ``InductorChoices.customize_fused_kernel_name``; torch 2.11 has none, so the name function
the Triton code generator calls is wrapped instead.)
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

# Triton's cut (150 characters) less "triton_" and the kind ("red_", "per_", "poi_"...) before the fused
# part and room for "_<number>" after it.
LONGEST_FUSED_NAME = 120


def shortened(fused_name: str, longest: int = LONGEST_FUSED_NAME) -> str:
    """``fused_name`` (``fused_<op>_<op>...``) cut to at most ``longest`` characters at an underscore;
    unchanged where it is short enough."""
    if len(fused_name) <= longest:
        return fused_name
    cut = fused_name.rfind("_", 0, longest + 1)
    return fused_name[:cut if cut > len("fused") else longest].rstrip("_")


@contextlib.contextmanager
def short_kernel_names() -> Iterator[None]:
    """Within the block, Inductor's Triton kernels get names Triton keeps whole (see the module docstring);
    outside it, Inductor names them as it did."""
    try:
        from torch._inductor.codegen import triton as triton_codegen
    except ImportError:  # pragma: no cover - a torch without Inductor's Triton code generator
        yield
        return
    original = triton_codegen.get_fused_kernel_name

    def get_fused_kernel_name(*args: Any, **kwargs: Any) -> str:
        return shortened(original(*args, **kwargs))

    triton_codegen.get_fused_kernel_name = get_fused_kernel_name
    try:
        yield
    finally:
        triton_codegen.get_fused_kernel_name = original

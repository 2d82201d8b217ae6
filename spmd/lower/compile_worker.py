"""A compile worker's life (``spmd.lower.worker_pool``): ``python -m spmd.lower.compile_worker``.

It imports torch, Inductor and spmd, then answers each job sent on its stdin with the piece's
``InductorCode`` (or why there is none) on its stdout, until stdin closes.

On a GPU a worker generates code and compiles no Triton kernel (``_code_only``): the process that loads
the code compiles them in its own pool of kernel compilers, which is running already, where a worker's
would first have to start (and until it answers, Inductor compiles kernels one after another). So a
worker starts no such pool either: Inductor would start one on its first GPU graph, a process and its
compilers importing torch for nothing, beside the kernels being compiled for the step.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
import traceback
from typing import Any, Iterator

from .worker_pool import Job, _receive, _send


def _stand_in_groups(groups: dict) -> None:
    """Register a fake process group of each size under each name in ``groups`` (name -> size) not known yet:
    Inductor looks the groups of a graph's collectives up by name while it compiles, and runs none."""
    import torch.distributed as dist
    from torch._C._distributed_c10d import _register_process_group
    from torch.distributed.distributed_c10d import _get_group_size_by_name

    missing = {}
    for name, size in groups.items():
        try:
            _get_group_size_by_name(name)
        except (RuntimeError, ValueError):
            missing[name] = size
    if not missing:
        return
    if not dist.is_initialized():
        from torch.testing._internal.distributed.fake_pg import FakeStore

        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=max(missing.values()))
    world = dist.get_world_size()
    for name, size in missing.items():
        if size > world:
            raise RuntimeError(f"process group {name} has {size} ranks, more than this worker's fake world ({world})")
        _register_process_group(name, dist.new_group(ranks=list(range(size))))


@contextlib.contextmanager
def _code_only(device) -> Iterator[None]:
    """On a GPU: Inductor's code is generated and loaded, but each Triton kernel it defines is left undefined
    (``None``) instead of compiled, and no pool of kernel compilers is started (one compile thread); the
    code is only sent on, and where it is loaded the kernels are compiled."""
    if device.type != "cuda":
        yield
        return
    from torch._inductor import config
    from torch._inductor.async_compile import AsyncCompile

    compile_kernel = AsyncCompile.triton
    AsyncCompile.triton = lambda self, *args, **kwargs: None
    try:
        with config.patch(compile_threads=1):
            yield
    finally:
        AsyncCompile.triton = compile_kernel


def _compile(job: Job) -> tuple[Any, dict[str, float]]:
    """In a worker: the ``InductorCode`` of ``job``'s piece (None where it cannot be kept) and the seconds each
    phase of its compile took (``spmd.compile_times``)."""
    import torch
    from torch._inductor import config

    from ..compile_times import phase, recording
    from .compile_graph import compile_piece, device_of
    from .graph_wire import from_bytes, op_named
    from .inductor_code import code_of
    from .opaque_ops import opaque_inplace_op

    times: dict[str, float] = {}
    with recording(times), phase(f"lower/{job.label}/worker"):
        _stand_in_groups(job.groups)
        for name in job.wrapped_ops:  # the graph calls them by name: define them first
            opaque_inplace_op(op_named(name))
        gm = from_bytes(job.graph)
        device = device_of(job.inputs)
        with torch.no_grad(), config.patch(job.options), _code_only(device):
            compiled, _, _ = compile_piece(gm, job.inputs, job.label, job.fx_cache)
    return code_of(compiled, job.wrapped_ops, device.index if device.type == "cuda" else None), times


def main() -> None:
    """A worker's life: answer each job sent on stdin, until it closes (or nobody reads the answers)."""
    started = time.perf_counter()
    requests, answers = sys.stdin.buffer, os.fdopen(os.dup(sys.stdout.fileno()), "wb")
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())  # anything printed goes to stderr, not into an answer
    import spmd  # noqa: F401 - defines spmd's ops, which the pieces call
    import torch._inductor.compile_fx  # noqa: F401 - Inductor, imported before the first job comes

    try:
        _send(answers, ("ready", time.perf_counter() - started))
        while True:
            try:
                job = _receive(requests)
            except EOFError:
                return
            try:
                answer = ("done", _compile(job))
            except Exception as err:  # noqa: BLE001 - any failure is reported; the piece is compiled elsewhere
                answer = ("failed", f"{type(err).__name__}: {err}\n{traceback.format_exc(limit=-4)}")
            _send(answers, answer)
    except BrokenPipeError:  # the step no longer needs this worker
        return


if __name__ == "__main__":
    main()

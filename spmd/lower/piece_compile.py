"""A prepared step graph compiled in pieces, side by side: the others in worker processes, one here.

``compile_in_pieces`` cuts the graph (``spmd.lower.piece_plan``), shares the pieces out, heaviest first,
between the worker processes (``spmd.lower.worker_pool``) and this one, and loads the workers' code
as a restarted process loads kept code (``spmd.lower.inductor_code.load_kept``).
A piece whose worker fails, or that cannot be sent, is compiled here after the others: slower, never
wrong. What it returns is one callable and one ``PiecewiseCode``, kept and loaded as a whole graph's
code is.
"""

from __future__ import annotations

import collections
import logging
import queue
import threading
import time
from dataclasses import replace
from typing import Any, Callable, Optional, Sequence

import torch
import torch.fx as fx

from .. import compile_times
from ..compile_times import phase
from ..graph_utils.nodes import comm_group_name, is_comm_node
from . import worker_pool
from .compile_graph import compile_piece, device_of
from .graph_wire import NotWireable, to_bytes
from .inductor_code import InductorCode, PiecewiseCode, code_of, load_kept
from .piece_places import weight
from .piece_plan import cut
from .piece_run import run_pieces
from .piece_report import log_crossings
from .triton_kernels import collecting as collecting_triton_kernels

log = logging.getLogger(__name__)

# Past this many seconds without an answer, a worker's piece is compiled here instead.
WORKER_TIMEOUT_S = 1800.0


def _groups_of(graph: fx.Graph) -> dict[str, int]:
    """The size of each process group the collectives of ``graph`` name, by name."""
    from torch.distributed.distributed_c10d import _get_group_size_by_name

    names = {comm_group_name(n) for n in graph.nodes if is_comm_node(n)}
    return {name: _get_group_size_by_name(name) for name in names if name is not None}


def _compile_here(gm: fx.GraphModule, specs: list, label: str, fx_cache: bool, wrapped: tuple,
                  device: torch.device) -> tuple[Callable[[list], Any], Optional[InductorCode]]:
    compiled, _, kernels = compile_piece(gm, specs, label, fx_cache)
    return compiled, code_of(compiled, wrapped, device.index if device.type == "cuda" else None, kernels)


def _load_from_worker(code: InductorCode, device: torch.device,
                      label: str) -> tuple[Optional[Callable[[list], Any]], InductorCode]:
    """A worker's code for a piece loaded here (None where it does not load), and that code as it is kept.

    A worker on a GPU leaves its Triton kernels to this process (``spmd.lower.compile_worker``), which
    compiles them as it loads the code: they are collected there and kept with it, as a piece compiled
    here keeps its own, so a restarted process launches them without Triton (without them, loading the
    workers' pieces was most of a warm first call: BENCHMARKS.md, "Round 13")."""
    with collecting_triton_kernels(device.type == "cuda") as kernels:
        runner = load_kept(code, device, label)
    return runner, replace(code, triton_kernels=kernels[0]) if kernels else code


def compile_in_pieces(prepared: fx.GraphModule, example_inputs: Sequence, label: str, count: int, options: dict,
                      fx_cache: bool, wrapped: tuple, workers: Sequence[worker_pool.Worker] = (),
                      ) -> Optional[tuple[Callable[[list], Any], Optional[PiecewiseCode]]]:
    """``prepared`` (functional, not decomposed) compiled in at most ``count`` pieces under Inductor ``options``:
    (a callable on a list of its inputs, its ``PiecewiseCode`` or None where a piece's code cannot be
    kept), or None where the graph is not cut (``spmd.lower.piece_plan.cut``). ``wrapped``: the names of the
    ops the graph calls through ``opaque_inplace_op``; ``workers``: the compile workers that take pieces beside
    this process (``spmd.lower.worker_pool``).

    The pieces are shared out heaviest first (``piece_places.weight``): each worker, once it has started, and
    this process take the heaviest piece nobody has taken, until none is left; so a worker that starts late
    or runs slowly takes fewer, none waits on another, and the piece that takes longest is not left to
    whoever comes free last (fully_shard's backward piece is the heaviest by far, and this process, taking
    pieces from the back, came to it last while the workers had nothing left: BENCHMARKS.md, "Round 13")."""
    with phase(f"lower/{label}/cut"):
        made = cut(prepared, count, example_inputs)
    if made is None:
        return None
    modules, specs, plan = made
    log_crossings(label, modules, specs, plan)
    device = device_of(example_inputs)
    start = time.perf_counter()
    weights = [weight(m) for m in modules]  # before Inductor, which rewrites the graphs it compiles here
    untaken = collections.deque(sorted(range(len(modules)), key=lambda i: -weights[i]))
    lock = threading.Lock()
    answers: queue.Queue = queue.Queue()
    workers = list(workers)
    timeline: list[tuple[int, str, float, float]] = []  # (piece, where, taken at, done at), seconds from start
    ready_at: list[float] = []  # when each worker was ready, seconds from start

    def serve(worker: worker_pool.Worker) -> None:
        """A worker's thread: take the heaviest piece nobody has taken, until none is left or the worker fails."""
        if not worker.ready():
            return
        ready_at.append(time.perf_counter() - start)
        while True:
            with lock:
                if not untaken:
                    return
                i = untaken.popleft()
            try:
                job = worker_pool.Job(f"{label}/{i}", to_bytes(modules[i].graph), specs[i], options, wrapped,
                                          fx_cache, _groups_of(modules[i].graph))
            except NotWireable as err:
                answers.put((i, "failed", f"it cannot be sent to a worker: {err}"))
                continue
            taken = time.perf_counter() - start
            status, answer = worker.compile(job)
            timeline.append((i, f"worker {workers.index(worker)}", taken, time.perf_counter() - start))
            answers.put((i, status, answer if status == "done" else f"its worker failed: {answer}"))
            if status != "done":
                return

    threads = [threading.Thread(target=serve, args=(w,), name="spmd-compile-worker", daemon=True) for w in workers]
    for thread in threads:
        thread.start()
    runners: list[Optional[Callable]] = [None] * len(modules)
    codes: list[Optional[InductorCode]] = [None] * len(modules)
    here = 0

    def compile_here(i: int) -> None:
        nonlocal here
        taken = time.perf_counter() - start
        runners[i], codes[i] = _compile_here(modules[i], specs[i], f"{label}/{i}", fx_cache, wrapped, device)
        timeline.append((i, "here", taken, time.perf_counter() - start))
        here += 1

    def settle(i: int, status: str, answer: Any) -> None:
        """Piece ``i`` from its worker's answer: its code loaded, or (said why) compiled here."""
        if status == "done" and answer[0] is not None:
            with phase(f"lower/{label}/load"):
                runners[i], loaded = _load_from_worker(answer[0], device, f"{label}/{i}")
            if runners[i] is not None:
                codes[i] = loaded
                compile_times.add(answer[1])
                return
        why = answer if status != "done" else "its worker's code cannot be kept or does not load"
        log.warning("spmd: piece %d of the %s graph is compiled here: %s", i, label, why)
        compile_here(i)

    for _ in range(len(modules)):  # each turn settles one piece
        try:
            answered = answers.get_nowait()
        except queue.Empty:
            with lock:
                mine = untaken.popleft() if untaken else None
            if mine is not None:
                compile_here(mine)
                continue
            with phase(f"lower/{label}/wait"):
                try:
                    answered = answers.get(timeout=WORKER_TIMEOUT_S)
                except queue.Empty:
                    answered = None
        if answered is None:  # nothing answers: every piece not compiled yet is compiled here
            log.warning("spmd: no compile worker answered within %.0f s; the %s graph's other pieces are compiled "
                        "here", WORKER_TIMEOUT_S, label)
            for worker in workers:
                worker.kill()
            for j in range(len(modules)):
                if runners[j] is None:
                    compile_here(j)
            break
        settle(*answered)
    if ready_at:  # how long this process compiled alone: what starting the workers sooner would save
        compile_times.add({f"lower/{label}/workers_ready": max(ready_at)})
    log.info("spmd: the %s graph compiled in %d pieces (weights %s) in %.1f s, %d of them in this process; workers "
             "ready after %s s; (piece, where, taken at s, done at s): %s", label, len(modules), weights,
             time.perf_counter() - start, here, [round(r, 2) for r in ready_at],
             [(i, who, round(a, 2), round(b, 2)) for i, who, a, b in sorted(timeline, key=lambda t: t[2])])
    kept = PiecewiseCode(tuple(codes), plan) if all(c is not None for c in codes) else None
    return run_pieces(plan, runners), kept

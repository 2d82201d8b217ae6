"""Run a test body in N real gloo processes (spawned), failing the test if any rank fails."""

from __future__ import annotations

import os
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _worker(rank: int, world_size: int, init_file: str, backend: str, fn, args):
    torch.set_num_threads(1)
    if backend == "nccl":
        os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # never use NVLink multicast
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank, world_size=world_size)
    fn(rank, world_size, *args)
    # Tear down together: a rank that destroys its group while a peer is still inside a
    # collective aborts the peer ("terminate called without an active exception").
    dist.barrier()
    dist.destroy_process_group()
    # Every check of this rank has passed. Skip interpreter finalization: under load, C++
    # static destructors at exit sometimes abort ("terminate called without an active
    # exception") after a successful run, which would fail a test that passed.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_distributed(fn, *args, world_size: int = 2, backend: str = "gloo") -> None:
    """Call ``fn(rank, world_size, *args)`` in ``world_size`` processes (gloo, or nccl: one GPU each)."""
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_worker, args=(world_size, os.path.join(tmp, "store"), backend, fn, args),
                 nprocs=world_size, join=True)


class single_process_group:
    """A gloo group of world size 1 in this process (for graph structure tests)."""

    def __enter__(self):
        self._tmp = tempfile.TemporaryDirectory()
        dist.init_process_group("gloo", init_method=f"file://{self._tmp.name}/store", rank=0, world_size=1)
        return self

    def __exit__(self, *exc):
        dist.destroy_process_group()
        self._tmp.cleanup()

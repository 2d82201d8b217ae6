"""One launcher for every ``spmd`` subcommand: run a function on every rank of a process group.

``launch(fn, *args)`` calls ``fn(rank, world_size, device, *args)`` on every rank, with the
default process group initialized around it:

* under ``torchrun`` (``RANK`` and ``WORLD_SIZE`` in the environment) in this process, on
  ``cuda:$LOCAL_RANK`` with NCCL when CUDA is available, else on the CPU with gloo;
* otherwise in ``nproc`` new processes: one per GPU with NCCL (default: every local GPU),
  spawned (CUDA cannot be used in a forked child), or, without a GPU, 2 gloo CPU processes
  sharing the cores, forked from a fork server that imported torch once. Not forked from
  this process itself: a process that has run threads (Inductor's compile workers,
  OpenMP, a test runner) can leave a forked child holding a lock no thread will release.

NVLink multicast stays off (``NCCL_NVLS_ENABLE=0`` and the symmetric-memory switches), as the
GPU machines this project runs on require. ``fn`` must be a module-level function (spawned
processes import it by name) and may return an exit status; ``launch`` returns the first
non-zero one, or 0.
"""

from __future__ import annotations

import os
import socket
import sys
from typing import Callable, Optional

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

_NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}

RankFn = Callable[..., Optional[int]]


def under_torchrun() -> bool:
    """True when this process is one rank of a ``torchrun`` launch."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def default_nproc() -> int:
    """One process per local GPU, or 2 CPU processes without a GPU."""
    return torch.cuda.device_count() if torch.cuda.is_available() else 2


def launch(fn: RankFn, *args, nproc: Optional[int] = None) -> int:
    """Run ``fn(rank, world_size, device, *args)`` on every rank; the exit status (0: all ranks succeeded)."""
    os.environ.update(_NO_MULTICAST)
    if under_torchrun():
        if nproc is not None:
            print("spmd: under torchrun, --nproc is ignored (torchrun sets the world size)", file=sys.stderr)
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        return _run_rank(rank, world, int(os.environ.get("LOCAL_RANK", rank)), fn, args, "env://")
    n_gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    nproc = nproc or default_nproc()
    if n_gpus and nproc > n_gpus:
        print(f"spmd: --nproc {nproc} but only {n_gpus} GPUs here (one process per GPU). Pass --nproc {n_gpus} "
              "or fewer.", file=sys.stderr)
        return 2
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        init = f"tcp://127.0.0.1:{s.getsockname()[1]}"
    if not n_gpus:
        mp.get_context("forkserver").set_forkserver_preload(["torch", "torch.distributed", "spmd"])
    try:
        mp.start_processes(_spawned, args=(nproc, fn, args, init), nprocs=nproc, join=True,
                           start_method="spawn" if n_gpus else "forkserver")
    except mp.ProcessExitedException as err:
        return err.exit_code if err.exit_code and err.exit_code > 0 else 1
    except mp.ProcessRaisedException as err:
        print(f"spmd: a rank failed:\n{err}", file=sys.stderr)
        return 1
    return 0


def _run_rank(rank: int, world: int, local_rank: int, fn: RankFn, args: tuple, init_method: str) -> int:
    if torch.cuda.is_available():
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", init_method=init_method, rank=rank, world_size=world, device_id=device)
    else:
        device = torch.device("cpu")
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
        dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world)
    try:
        rc = fn(rank, world, device, *args) or 0
        # Tear down together: a rank that destroys its group while a peer is still inside a
        # collective aborts the peer.
        dist.barrier()
    finally:
        dist.destroy_process_group()
    return rc


def _thread_lock_for_tqdm() -> None:
    """Where tqdm is installed, torch.fx.Interpreter makes a (disabled) tqdm bar on every run, and tqdm's first bar
    makes a multiprocessing lock: a spawned rank that skips finalization leaves it behind, and the parent's
    resource tracker warns of a "leaked semaphore". A rank's bars are its own: a thread lock serves them."""
    import importlib.util
    import threading

    if importlib.util.find_spec("tqdm") is not None:
        import tqdm

        tqdm.tqdm.set_lock(threading.RLock())


def _spawned(rank: int, world: int, fn: RankFn, args: tuple, init_method: str) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world))
    _thread_lock_for_tqdm()
    rc = _run_rank(rank, world, rank, fn, args, init_method)
    # This rank is done. Skip interpreter finalization: C++ static destructors at exit sometimes
    # abort ("terminate called without an active exception") after a successful run.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(rc)

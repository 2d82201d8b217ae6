"""Optimizer state that is still all zeros takes no memory on the first call until a piece of the step reads it.

spmd creates an optimizer's state before the first trace, as zeros (``spmd.optim.state``): the traced step
takes it as a graph input. Eager PyTorch and ``torch.compile`` make it inside ``optimizer.step()``, after the
backward has freed the activations, so their first step's peak holds no optimizer state; spmd's first call held
it from the forward's start through the backward, where the step peaks (BENCHMARKS.md, "Round 43").

On the first call, ``zero_until_read`` names the state created that way; a step cut into pieces
(``spmd.lower.piece_run.run_pieces``) lets the storage of each such tensor go before its first piece and
makes it again, zeroed, right before the first piece that reads it (on one GPU the optimizer's pieces, after
the backward). The tensors stay the same Python objects: only their storage is freed and made again, so the
step's code, which reads a tensor's data where it is at each call, sees zeros, as it would have. Later calls
change nothing: the state then holds values, and a CUDA graph captured on the second call reads it where it
now lives. A tensor is released only if it is all zeros when the run starts (checked once, one synchronisation,
and only by a step cut into pieces), and every released tensor is made again before its run returns or raises, so a
failed call leaves the user's optimizer state as it was: zeros.
"""

from __future__ import annotations

import contextlib
from typing import Iterator, Optional, Sequence

import torch

# Tensors smaller than this are not worth a free and an allocation (a step counter, a scalar state).
MIN_HELD_BYTES = 1 << 16

_holding: Optional["HeldBack"] = None


def _storage_key(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata


class HeldBack:
    """The zero state tensors a first call may release until read (``zero_until_read``), by storage, and
    those released now, to be made again (``restore``)."""

    def __init__(self, tensors: Sequence[torch.Tensor]):
        self.tensors = [t for t in tensors if t.untyped_storage().nbytes() >= MIN_HELD_BYTES]
        self._zero: Optional[set[int]] = None  # found when first asked: a step run whole never asks
        self.released: dict[int, tuple[torch.UntypedStorage, int]] = {}  # storage key -> (storage, its bytes)

    @property
    def zero(self) -> set[int]:
        """The storages of the tensors that hold only zeros now."""
        if self._zero is None:
            self._zero = {_storage_key(t) for t, zero in zip(self.tensors, _all_zero(self.tensors)) if zero}
        return self._zero

    def release(self, t: torch.Tensor) -> bool:
        """Free ``t``'s storage if it is one of the zero ones and not released yet; True if it now is released."""
        key = _storage_key(t)
        if key in self.released:
            return True
        if key not in self.zero:
            return False
        storage = t.untyped_storage()
        self.released[key] = (storage, storage.nbytes())
        storage.resize_(0)
        return True

    def restore(self, tensors: Sequence[torch.Tensor]) -> None:
        """Make the storage of each of ``tensors`` that was released again, all zeros."""
        _remake_zeros([entry for t in tensors if (entry := self.released.pop(_storage_key(t), None)) is not None])

    def restore_all(self) -> None:
        """Make every released storage again, all zeros."""
        entries, self.released = list(self.released.values()), {}
        _remake_zeros(entries)


# The memory pool of each GPU that zero state made again on a first call is allocated in, for the process.
_pools: dict[torch.device, "torch.cuda.MemPool"] = {}


def _remake_zeros(entries: Sequence[tuple[torch.UntypedStorage, int]]) -> None:
    """Each (storage, its bytes) given its bytes again, all zeros. On a GPU they are allocated in a memory pool of
    their own (``_pools``), as when the state was made before the trace: the caching allocator would otherwise
    hand them blocks the step's activations freed, and count a block's whole size where it is somewhat larger than
    asked, on every call after the first (BENCHMARKS.md, "Round 43")."""
    for storage, nbytes in entries:
        device = storage.device
        if device.type == "cuda":
            pool = _pools.get(device)
            if pool is None:
                pool = _pools[device] = torch.cuda.MemPool()
            with torch.cuda.use_mem_pool(pool, device):
                storage.resize_(nbytes)
        else:
            storage.resize_(nbytes)
        torch.empty(0, dtype=torch.uint8, device=device).set_(storage, 0, (nbytes,), (1,)).zero_()


def _all_zero(tensors: Sequence[torch.Tensor]) -> list[bool]:
    """Whether each of ``tensors`` holds only zeros, with one synchronisation per device."""
    zero: dict[int, bool] = {}
    by_device: dict[torch.device, list[int]] = {}
    for i, t in enumerate(tensors):
        by_device.setdefault(t.device, []).append(i)
    for indices in by_device.values():
        flags = torch.stack([tensors[i].detach().any() for i in indices]).tolist()  # NaN counts as nonzero
        zero.update((i, not nonzero) for i, nonzero in zip(indices, flags))
    return [zero[i] for i in range(len(tensors))]


@contextlib.contextmanager
def zero_until_read(tensors: Sequence[torch.Tensor]) -> Iterator[Optional[HeldBack]]:
    """For the block (a step's first call): each of ``tensors`` still all zeros may have its storage released by
    ``run_pieces`` until a piece reads it. Every released one is made again, zeros, by the end of the block."""
    global _holding
    if not tensors or _holding is not None:
        yield None
        return
    held = _holding = HeldBack(tensors)
    try:
        yield held
    finally:
        _holding = None
        held.restore_all()


def holding() -> Optional[HeldBack]:
    """The state a first call holds back (``zero_until_read``), or None outside one."""
    return _holding

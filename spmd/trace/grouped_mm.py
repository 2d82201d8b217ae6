"""Mixture-of-experts grouped matmuls traced with shapes that do not depend on the routing.

A MoE layer sorts its ``S`` (token, expert) rows by expert and multiplies each expert's run of rows by
that expert's weight: ``out[offs[e-1]:offs[e]] = input[offs[e-1]:offs[e]] @ weight[e]``. Where
``torch._grouped_mm`` is not used (any dtype but bfloat16 while compiling), transformers calls its own
custom op, ``transformers::grouped_mm_fallback``, which loops over the experts with ``offs.tolist()``.
Its forward is opaque to a trace, but the Python backward that transformers up to 5.17 registers for
it runs that loop under the tracer, where ``offs`` is a fake tensor with no values, and the trace
stops (``transformers/integrations/moe.py``, ``_grouped_mm_fallback_backward``). Transformers 5.24
makes the backward a second opaque op, which traces but reads ``offs`` on the host at every call of
the compiled step (a device sync, and no CUDA graph can hold it).

``traceable_grouped_mm`` points ``torch.ops.transformers.grouped_mm_fallback``, for the length of the
trace, at ``grouped_mm``, which computes the loop's values with shapes that depend only on the
arguments' (a few tiles of rows per expert, one batched matmul, about a quarter more than the loop's
matmul work), so its backward is plain ops and no host read is left. ``torch._grouped_mm``, which
does only the loop's work, is traceable in bfloat16 only (its fake kernel refuses other dtypes, and
for those CUDA's kernel copies ``offs`` to the host too); transformers calls it directly there.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Iterator

import torch


BLOCKS_PER_EXPERT = 4  # row blocks per expert: the tiles do about (1 + 1 / 4) times the loop's matmul work


def grouped_mm(input: torch.Tensor, weight: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """``input`` (S, K) rows grouped by the cumulative counts ``offs`` (E,), times ``weight`` (E, K, N): (S, N).

    Row ``r`` with ``offs[e-1] <= r < offs[e]`` is ``input[r] @ weight[e]``; rows from ``offs[-1]`` on are
    zero. Differentiable in ``input`` and ``weight``; no shape depends on the values of ``offs``. Computed in
    the arguments' dtype under autocast too, as the library op and ``torch._grouped_mm`` compute.

    The rows are cut into ``B = BLOCKS_PER_EXPERT * E`` blocks of ``ceil(S / B)``; since they are sorted by
    expert, the (block, expert) pairs that meet number at most ``B + E - 1`` (a block's experts are a run,
    and neighbouring blocks share at most the one at their border). Each such tile multiplies its block by
    its expert's weight and keeps the rows that expert owns: one batched matmul of about
    ``1 + 1 / BLOCKS_PER_EXPERT`` times the loop's work. A row's value is the one matmul row the loop
    computes (the other tiles of its block add exact zeros). The tiles' weights are gathered for the
    matmul and gathered again in the backward, never kept (``_TileMatmul``).
    """
    rows, experts = input.size(0), weight.size(0)
    block = max(1, -(-rows // (BLOCKS_PER_EXPERT * experts)))
    blocks = max(1, -(-rows // block))
    tiles, device = blocks + experts - 1, input.device
    # each row's expert: how many offsets are <= its index (``experts`` past offs[-1], padding included)
    expert_of = (torch.arange(blocks * block, device=device, dtype=offs.dtype).unsqueeze(1) >= offs).sum(1)
    by_block = expert_of.view(blocks, block)
    first, count = by_block[:, 0], (by_block[:, -1].clamp(max=experts - 1) - by_block[:, 0] + 1).clamp(min=0)
    end = count.cumsum(0)  # the tiles of block b are end[b] - count[b] .. end[b] - 1
    tile = torch.arange(tiles, device=device)
    tile_block = (tile.unsqueeze(1) >= end).sum(1)  # ``blocks`` for the spare tiles past the last one
    used = tile_block < blocks
    tile_block = tile_block.clamp(max=blocks - 1)
    tile_expert = (first[tile_block] + tile - (end - count)[tile_block]).clamp(0, experts - 1)
    owned = used.unsqueeze(1) & (by_block[tile_block] == tile_expert.unsqueeze(1))  # (tiles, block)
    padded = torch.cat([input, input.new_zeros(blocks * block - rows, input.size(1))]).view(blocks, block, -1)
    device_type = device.type
    with (torch.autocast(device_type, enabled=False) if torch.amp.is_autocast_available(device_type)
          else contextlib.nullcontext()):
        products = torch.where(owned.unsqueeze(2), _TileMatmul.apply(padded[tile_block], weight, tile_expert), 0)
    out = input.new_zeros(blocks, block, weight.size(2)).index_add(0, tile_block, products)
    return out.view(blocks * block, -1)[:rows]


class _TileMatmul(torch.autograd.Function):
    """``bmm(tile_rows, weight[tile_expert])`` that keeps ``weight``, not its gathered copy, for the backward.

    The gathered weights are ``tiles x K x N``, several times the experts' own: kept for the backward they
    were the MoE step's largest saved tensors. Gathering them again costs one read of each tile's weight.
    An expert's gradient is the sum of its tiles' (an ``index_add``: on a GPU in no fixed order, a float
    reassociation of the loop's one matmul).
    """

    @staticmethod
    def forward(ctx, tile_rows: torch.Tensor, weight: torch.Tensor, tile_expert: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(tile_rows, weight, tile_expert)
        return torch.bmm(tile_rows, weight.index_select(0, tile_expert))

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        tile_rows, weight, tile_expert = ctx.saved_tensors
        grad_rows = torch.bmm(grad, weight.index_select(0, tile_expert).transpose(1, 2))
        grad_tiles = torch.bmm(tile_rows.transpose(1, 2), grad)
        grad_weight = torch.zeros_like(weight).index_add(0, tile_expert, grad_tiles)
        return grad_rows, grad_weight, None


# Library ops with ``grouped_mm``'s contract (arguments input, weight, offs) whose autograd or kernel
# reads ``offs`` on the host, by qualified name.
_GROUPED_MM_OPS: dict[str, Callable[..., torch.Tensor]] = {"transformers::grouped_mm_fallback": grouped_mm}


@contextlib.contextmanager
def traceable_grouped_mm() -> Iterator[None]:
    """Inside: ``torch.ops.<namespace>.<name>`` of each registered op of ``_GROUPED_MM_OPS`` is its traceable form.

    The libraries call these ops by that attribute (``torch.ops.transformers.grouped_mm_fallback(...)``); an
    ``OpOverload`` held from before the trace stays the op. Afterwards the attributes hold the ops again.
    """
    found = []
    for qualified, traceable in _GROUPED_MM_OPS.items():
        namespace, name = qualified.split("::")
        ops = getattr(torch.ops, namespace)
        packet = getattr(ops, name, None)  # None where no library loaded defines it
        if packet is not None:
            found.append((ops, name, packet, traceable))
    try:
        for ops, name, _, traceable in found:
            setattr(ops, name, traceable)
        yield
    finally:
        for ops, name, packet, _ in found:
            setattr(ops, name, packet)

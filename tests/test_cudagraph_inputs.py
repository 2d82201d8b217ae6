"""A captured step's static buffers (the batch, values carried between iterations) live in its CUDA graph's
memory pool, held only by the captured code (``spmd.lower.cudagraphs``): what the graph allocates after a
buffer's last read reuses its memory, and a carried output that lands there still reaches the next call."""

from __future__ import annotations

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from spmd.lower.cudagraphs import CudaGraphRunner
from spmd.lower.inductor import compile_with_inductor


N = 1 << 22  # float32 elements of the batch: 16 MiB


def _boxed(step):
    """``step`` (called on a list, which it clears) called positionally too, as ``spmd.lower.inductor`` wraps
    Inductor's code."""
    def run(*args):
        return step(list(args))

    run.boxed = step
    return run


def _cast_then_widen(args: list) -> tuple:
    """The batch read once, by a cast, first; a new float32 value as large as it made after that."""
    (x,) = args
    args.clear()
    half = x.to(torch.bfloat16)
    del x
    widened = half.float()
    return (widened.sum(),)


def _capture_peak(runner: CudaGraphRunner, x: torch.Tensor) -> int:
    """Bytes allocated above the start at the peak of ``runner``'s capture (its second call) on ``x``."""
    runner(x)  # warm-up, uncaptured
    torch.cuda.synchronize()
    start = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    runner(x)
    torch.cuda.synchronize()
    assert runner.captures == 1
    return torch.cuda.max_memory_allocated() - start


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_batch_read_first_leaves_its_buffer_to_what_the_graph_allocates_after():
    x = torch.randn(N, device="cuda")
    reused = CudaGraphRunner(_boxed(_cast_then_widen), persistent=[False], num_user_outputs=1)
    held = CudaGraphRunner(lambda x: _cast_then_widen([x]), persistent=[False], num_user_outputs=1)
    bytes_reused, bytes_held = _capture_peak(reused, x), _capture_peak(held, x)
    # the buffer (4 N bytes), the cast (2 N) and the widened cast (4 N): on the buffer's memory, or beside it
    assert bytes_reused < 8 * N <= 10 * N <= bytes_held, (bytes_reused, bytes_held)
    for seed in range(3):  # replays on new batches compute what the step computes
        x = torch.randn(N, device="cuda", generator=torch.Generator("cuda").manual_seed(seed))
        (total,) = reused(x)
        torch.testing.assert_close(total, _cast_then_widen([x.clone()])[0])


def _carry(args: list) -> tuple:
    """The batch's last read first; the carried value made while the one carried in is still read, so it lands
    on the batch's buffer."""
    x, carried = args
    args.clear()
    total = x.sum()
    del x
    out = torch.add(total, carried, alpha=0.5)  # one allocation, while ``carried`` is still held
    del carried
    return total * 1, out


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_carried_output_on_the_batchs_buffer_reaches_the_next_call_intact():
    runner = CudaGraphRunner(_boxed(_carry), persistent=[False, False], num_user_outputs=1)
    gen = torch.Generator("cuda").manual_seed(0)
    carried = expected = torch.randn(N, device="cuda", generator=gen)
    for call in range(5):
        x = torch.randn(N, device="cuda", generator=gen)
        want_total, expected = _carry([x.clone(), expected.clone()])
        total, carried = runner(x, carried)
        torch.testing.assert_close(total, want_total)
        torch.testing.assert_close(carried, expected)
        if call:  # captured on the second call: the carried value did land on the batch's buffer
            assert runner.carried_over_inputs


def test_inductors_code_called_boxed_lets_go_of_the_list_it_is_handed():
    """What the capture relies on, checked with Inductor's C++ code (its wrapper clears the list as the Triton one
    does): ``.boxed`` hands the list itself to the code, which empties it, so a static buffer in it has no owner
    but the code's own variables."""
    def step(x):
        return (x.sin() * 2,)

    gm = make_fx(step)(torch.randn(8))
    run, _ = compile_with_inductor(gm, [torch.randn(8)])
    x = torch.randn(8)
    handed = [x.clone()]
    (out,) = run.boxed(handed)
    assert handed == []
    torch.testing.assert_close(out, step(x)[0])
    torch.testing.assert_close(run(x)[0], step(x)[0])  # positionally, as before

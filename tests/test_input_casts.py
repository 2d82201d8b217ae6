"""A convolution weight's (and the batch's) low-precision cast is made again in the backward (spmd.lower.input_casts)."""

from __future__ import annotations

import operator

import pytest
import torch
import torch.nn as nn

import spmd
from spmd.graph_utils.phases import saved_for_backward

aten = torch.ops.aten


class _ConvNet(nn.Module):
    """Two convolutions and a linear head, channels-last, as a small ResNet trains under autocast."""

    def __init__(self):
        super().__init__()
        self.first = nn.Conv2d(3, 16, 3, padding=1)
        self.second = nn.Conv2d(16, 16, 3, padding=1)
        self.head = nn.Linear(16, 10)

    def forward(self, x):
        h = torch.relu(self.second(torch.relu(self.first(x))))
        return self.head(h.mean((2, 3)))


def _autocast_step(model, optim, x):
    with torch.autocast(x.device.type, dtype=torch.bfloat16):
        loss = model(x).float().square().mean()
    loss.backward()
    optim.step()
    optim.zero_grad()
    return loss


def _steps(train_step=None, device="cpu"):
    """Three compiled steps of ``train_step`` (default ``_autocast_step``): the graph Inductor got, the losses and the
    parameters. On the CPU: SGD momentum, our passes and Inductor; on "cuda" what a GPU user gets: fused capturable
    AdamW and ``spmd.compile()``'s GPU default (lean lowering, pieces, CUDA graphs)."""
    from spmd.lower.rewrites import prepare_for_inductor
    from spmd.step.transformation import default_transformation

    torch.manual_seed(0)
    model = _ConvNet().to(device, memory_format=torch.channels_last)
    x = torch.randn(4, 3, 16, 16, device=device).to(memory_format=torch.channels_last)
    if device == "cuda":
        optim = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True, capturable=True)
        transformation = default_transformation("cuda")
    else:
        optim = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        transformation = spmd.GraphModuleTransformation(enable_graph_optimization=True, enable_inductor=True)
    step = spmd.compile(gm_transformation=transformation)(train_step or _autocast_step)
    runner = step.trace(model, optim, x).transform().runner
    lowered = prepare_for_inductor(torch.fx.GraphModule(runner, runner.graph), decompose=False,
                                   lean=device == "cuda")
    losses = [step(model, optim, x * k) for k in (1, 2)]
    captures = step.cuda_graph_captures  # on a GPU the second call captures (the first warms up)
    losses.append(step(model, optim, x * 3))
    assert step.cuda_graph_captures == captures and captures >= (device == "cuda"), "captured again"
    return lowered.graph, losses, [p.detach().clone() for p in model.parameters()]


def _kept_casts(graph) -> list:
    """The casts of graph inputs kept from the forward for a convolution backward to read."""
    from spmd.lower.input_casts import is_narrowing_cast

    return [n for n, readers in saved_for_backward(graph).items() if is_narrowing_cast(n)
            and any(r.target is aten.convolution_backward.default for r in readers)]


def test_the_casts_a_convolution_backward_reads_are_made_again_there_in_one_kernel_and_the_step_is_unchanged(
        monkeypatch):
    """Under bfloat16 autocast both convolutions' weight casts and the batch's cast were kept from the forward to
    the backward; now none is: one ``_foreach_copy`` of the three inputs in the backward makes them again. The step
    computes the same, bit for bit, over three SGD-momentum steps, and trains as eager does (to bfloat16 noise:
    Inductor and eager round the bfloat16 convolutions differently)."""
    import spmd.lower.rewrites as rewrites

    graph, losses, params = _steps()
    monkeypatch.setattr(rewrites, "cast_inputs_again", lambda graph: 0)
    kept_graph, kept_losses, kept_params = _steps()

    kept = _kept_casts(kept_graph)
    assert [n.meta["val"].dim() for n in kept] == [4, 4, 4], kept  # the two weights and the batch
    assert not _kept_casts(graph)
    copies = graph.find_nodes(op="call_function", target=aten._foreach_copy.default)
    assert len(copies) == 1 and len(copies[0].args[1]) == 3
    assert all(u.target is operator.getitem for u in copies[0].users)
    assert all(map(torch.equal, losses, kept_losses))
    assert all(map(torch.equal, params, kept_params))
    torch.manual_seed(0)
    model = _ConvNet().to(memory_format=torch.channels_last)
    optim = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    x = torch.randn(4, 3, 16, 16).to(memory_format=torch.channels_last)
    eager = [_autocast_step(model, optim, x * (k + 1)).detach() for k in range(3)]
    torch.testing.assert_close(torch.stack(losses), torch.stack(eager), rtol=1e-5, atol=0)
    for p, q in zip(params, model.parameters()):
        torch.testing.assert_close(p, q.detach(), rtol=0, atol=2e-4)


def test_casts_beyond_a_group_are_each_made_again_by_a_cast_of_their_own(monkeypatch):
    """With no room to group, each cast is made again by its own ``_to_copy``, right before the convolution
    backward that reads it (its views beside it)."""
    import spmd.lower.rewrites as rewrites
    from spmd.graph_utils.meta import RECOMPUTE_OF
    from spmd.lower.input_casts import cast_inputs_again, should_cast_again

    monkeypatch.setattr(rewrites, "cast_inputs_again", lambda graph: 0)
    graph, _, _ = _steps()
    assert cast_inputs_again(graph, should_cast_again, group_bytes=0) == 3
    assert not graph.find_nodes(op="call_function", target=aten._foreach_copy.default)
    again = [n for n in graph.nodes if RECOMPUTE_OF in n.meta and n.target is aten._to_copy.default
             and n.args[0].op == "placeholder"]
    assert len(again) == 3
    for cast in again:
        node = cast.next
        while RECOMPUTE_OF in node.meta:
            node = node.next
        assert node.target is aten.convolution_backward.default, node
    assert not _kept_casts(graph)


def _two_backwards_step(model, optim, x):
    """Two micro-batches, each with its own backward, then one update."""
    total = 0.0
    for half in x.chunk(2):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(half).float().square().mean()
        loss.backward()
        total = total + loss.detach()
    optim.step()
    optim.zero_grad()
    return total


def test_each_backward_of_a_step_makes_its_own_casts_and_the_step_is_unchanged(monkeypatch):
    """A step with two backwards (gradient accumulation inside the step): each backward makes the casts again for
    itself, right before its own readers; losses and parameters are those of the step keeping the casts."""
    import spmd.lower.rewrites as rewrites

    graph, losses, params = _steps(_two_backwards_step)
    monkeypatch.setattr(rewrites, "cast_inputs_again", lambda graph: 0)
    _, kept_losses, kept_params = _steps(_two_backwards_step)
    copies = graph.find_nodes(op="call_function", target=aten._foreach_copy.default)
    assert len(copies) == 2 and not _kept_casts(graph)
    assert all(map(torch.equal, losses, kept_losses))
    assert all(map(torch.equal, params, kept_params))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_a_gpu_the_casts_made_again_train_as_the_kept_ones(monkeypatch):
    """The GPU default (lean lowering, pieces, CUDA graphs, fused capturable AdamW): no cast a convolution backward
    reads is kept, one foreach copy makes them, and three steps give the losses and parameters of the step that
    keeps them, bit for bit, without capturing a CUDA graph again."""
    import spmd.lower.rewrites as rewrites

    graph, losses, params = _steps(device="cuda")
    monkeypatch.setattr(rewrites, "cast_inputs_again", lambda graph: 0)
    kept_graph, kept_losses, kept_params = _steps(device="cuda")
    assert len(_kept_casts(kept_graph)) == 3 and not _kept_casts(graph)
    assert len(graph.find_nodes(op="call_function", target=aten._foreach_copy.default)) == 1
    assert all(map(torch.equal, losses, kept_losses))
    assert all(map(torch.equal, params, kept_params))

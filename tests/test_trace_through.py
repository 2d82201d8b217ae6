"""A step traces through what users already have: ``torch.compile``d blocks and functions.

Written as users write them: a block wrapped by ``torch.compile(block)`` and assigned back into
the model, a block whose ``compile()`` was called, a ``torch.compile``d loss function the step
calls. Each is traced as its original code and trains as the uncompiled model does under DDP
or FSDP2 (float64, several steps); the wrapper's ``_orig_mod`` adds nothing to the names the
step gives its tensors, and the cache key holds no Dynamo state.
"""

from __future__ import annotations

import copy
import re

import pytest
import torch
from torch._subclasses.fake_tensor import is_fake
import torch.nn as nn
import torch.distributed.nn
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate
from torch.distributed.nn.functional import all_gather as imported_all_gather
from torch.nn.parallel import DistributedDataParallel as DDP

import spmd
from spmd.step.cache_key import function_digest
from spmd.trace import StepState
from tests.dist import run_distributed, single_process_group
from tests.shard_helpers import batches, block_policy, clipped_step, fsdp2_twin, full_params, gpt, optimizer, plain_step

F64 = torch.float64
TOL = 1e-10


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(4, 8)
        self.block = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8))
        self.head = nn.Sequential(nn.Linear(8, 8), nn.GELU())
        self.out = nn.Linear(8, 2)

    def forward(self, x):
        return self.out(self.head(self.block(self.inp(x))))


def updated(optim, loss):
    """The end of each step here: backward, the optimizer's step, zero_grad; returns ``loss``."""
    loss.backward()
    optim.step()
    optim.zero_grad()
    return loss


def _square_error(y, target):
    return (y - target).square().mean()


square_error = torch.compile(_square_error)  # compiled once, at import, as a user's module does


def compiled_loss_step(model, optim, x, target):
    return updated(optim, square_error(model(x), target))


def eager_loss_step(model, optim, x, target):
    return updated(optim, _square_error(model(x), target))


def _compiled_net(seed: int = 0) -> tuple[Net, Net]:
    """A Net with a compiled block, a block whose compile() was called, and its uncompiled twin."""
    torch.manual_seed(seed)
    model = Net().to(F64)
    twin = copy.deepcopy(model)
    model.block = torch.compile(model.block)
    model.head.compile()
    return model, twin


def _replicate_against_ddp(rank, world_size):
    model, twin = _compiled_net()
    ddp = DDP(twin)
    optim = torch.optim.AdamW(model.parameters(), lr=0.01)
    ref_optim = torch.optim.AdamW(ddp.parameters(), lr=0.01)
    step = spmd.compile(parallel_mode=spmd.DataParallel("replicate"))(compiled_loss_step)
    gen = torch.Generator().manual_seed(rank)
    worst = 0.0
    for _ in range(4):
        x, target = torch.randn(3, 4, generator=gen, dtype=F64), torch.randn(3, 2, generator=gen, dtype=F64)
        loss = step(model, optim, x, target)
        worst = max(worst, (loss - eager_loss_step(ddp, ref_optim, x, target).detach()).abs().item())
    params = max((p - q).abs().max().item() for p, q in zip(model.parameters(), twin.parameters()))
    assert worst <= TOL and params <= TOL, f"loss diff {worst}, param diff {params}"
    assert step.trace_count == 1
    assert isinstance(model.block, torch._dynamo.eval_frame.OptimizedModule)  # left as the user made it
    assert model.head._compiled_call_impl is not None


def test_compiled_blocks_and_loss_train_as_ddp_on_two_ranks():
    run_distributed(_replicate_against_ddp)


def _fully_shard_against_fsdp2(rank, world_size):
    model = gpt(F64)
    ref = fsdp2_twin(model)
    model.blocks[0] = torch.compile(model.blocks[0])
    model.blocks[1].compile()
    mode = spmd.DataParallel("fully_shard", wrap_policy=block_policy())
    spmd.shard(model, mode)
    optim, ref_optim = optimizer(model, "adamw"), optimizer(ref, "adamw")
    step = spmd.compile(parallel_mode=mode)(plain_step)
    worst = 0.0
    for idx, targets in batches(rank, 3):
        worst = max(worst, (step(model, optim, idx, targets) - plain_step(ref, ref_optim, idx, targets)).abs().item())
    ours, theirs = full_params(model), full_params(ref)
    params = max((p - q).abs().max().item() for p, q in zip(ours.values(), theirs.values()))
    assert worst <= TOL and params <= TOL, f"loss diff {worst}, param diff {params}"
    units = model._spmd_shard_plan.units  # the compiled block is a unit as FSDP2's twin's block is
    assert [u.fqn for u in units] == ["blocks.0._orig_mod", "blocks.1", ""], [u.fqn for u in units]


def test_compiled_blocks_train_as_fsdp2_under_fully_shard():
    run_distributed(_fully_shard_against_fsdp2)


class CompiledInside(nn.Module):
    """A method decorated with @torch.compile and a compiled function held as an attribute."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.squash = torch.compile(torch.tanh)

    @torch.compile
    def mix(self, x):
        return self.fc(x) * 2 + x

    def forward(self, x):
        return self.squash(self.mix(x))


def test_a_compiled_method_and_attribute_are_traced_as_their_originals_and_put_back():
    torch.manual_seed(0)
    model = CompiledInside().to(F64)
    twin = copy.deepcopy(model)
    optim, ref_optim = (torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, twin))
    compiled_mix, compiled_squash = vars(CompiledInside)["mix"], model.squash
    step = spmd.compile()(eager_loss_step)
    for _ in range(3):
        x, target = torch.randn(3, 4, dtype=F64), torch.randn(3, 4, dtype=F64)
        loss = step(model, optim, x, target)
        with torch.compiler.set_stance("force_eager"):  # the reference runs the same code eagerly
            assert (loss - eager_loss_step(twin, ref_optim, x, target)).abs() <= TOL
    assert vars(CompiledInside)["mix"] is compiled_mix and model.squash is compiled_squash


def test_a_compiled_block_adds_nothing_to_the_names_of_the_steps_tensors():
    model, twin = _compiled_net()
    state = StepState([model], [torch.optim.SGD(model.parameters(), lr=0.1)])
    assert state.param_names == [n for n, _ in twin.named_parameters()]


def test_a_step_function_is_described_by_the_code_its_compiled_function_compiled():
    def digest(expression):
        namespace = {"__name__": "user_steps", "torch": torch}
        exec(f"def loss_fn(y):\n    return {expression}\n", namespace)
        namespace["compiled"] = torch.compile(namespace["loss_fn"])
        exec("def step(model, optim, x):\n    return compiled(model(x))\n", namespace)
        return function_digest(namespace["step"])

    assert digest("y.square().mean()") == digest("y.square().mean()")  # no Dynamo state in it
    assert digest("y.square().mean()") != digest("y.abs().mean()")


# --- a refusal names the op and the user's line -------------------------------------------------------


def ctc_step(model, optim, x, targets):
    return updated(optim, F.ctc_loss(model(x).log_softmax(-1), targets, [6, 6], [3, 2]))  # lengths as Python ints


def test_a_data_dependent_op_is_refused_by_name_at_the_users_line():
    torch.manual_seed(0)
    model = nn.Linear(4, 5).to(F64)
    before = copy.deepcopy(model.state_dict())
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    line = ctc_step.__code__.co_firstlineno + 1
    with pytest.raises(spmd.SpmdCompileError, match=rf"calls aten\._ctc_loss at {re.escape(__file__)}:{line} "
                       r"\(`return updated\(optim, F\.ctc_loss\(.*torch\.library\.custom_op"):
        spmd.compile()(ctc_step)(model, optim, torch.randn(6, 2, 4, dtype=F64), torch.randint(1, 5, (2, 3)))
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items()) and not optim.state


@torch.library.custom_op("spmd_tests::ctc_loss", mutates_args=())
def opaque_ctc(log_probs: torch.Tensor, targets: torch.Tensor, input_lengths: list[int],
               target_lengths: list[int]) -> torch.Tensor:
    return F.ctc_loss(log_probs, targets, input_lengths, target_lengths)


@opaque_ctc.register_fake
def _(log_probs, targets, input_lengths, target_lengths):
    return log_probs.new_empty(())


@torch.library.custom_op("spmd_tests::ctc_loss_backward", mutates_args=())
def opaque_ctc_backward(grad: torch.Tensor, log_probs: torch.Tensor, targets: torch.Tensor, input_lengths: list[int],
                        target_lengths: list[int]) -> torch.Tensor:
    with torch.inference_mode(False), torch.enable_grad():
        leaf = log_probs.detach().clone().requires_grad_()
        return torch.autograd.grad(F.ctc_loss(leaf, targets, input_lengths, target_lengths), leaf, grad)[0]


@opaque_ctc_backward.register_fake
def _(grad, log_probs, targets, input_lengths, target_lengths):
    return torch.empty_like(log_probs)


def _save_ctc(ctx, inputs, output):
    ctx.save_for_backward(*inputs[:2])
    ctx.lengths = inputs[2:]


opaque_ctc.register_autograd(lambda ctx, grad: (opaque_ctc_backward(grad, *ctx.saved_tensors, *ctx.lengths),
                                                None, None, None), setup_context=_save_ctc)


def test_the_fix_the_refusal_names_trains_as_eager():
    def step(model, optim, x, targets, ctc):
        loss = ctc(model(x).log_softmax(-1), targets, [6, 6], [3, 2])
        loss.backward()
        optim.step()
        optim.zero_grad()
        return loss

    torch.manual_seed(0)
    model = nn.Linear(4, 5).to(F64)
    ref = copy.deepcopy(model)
    optim, ref_optim = (torch.optim.AdamW(m.parameters(), lr=0.01) for m in (model, ref))
    compiled = spmd.compile()(step)
    for _ in range(3):
        x, targets = torch.randn(6, 2, 4, dtype=F64), torch.randint(1, 5, (2, 3))
        assert (compiled(model, optim, x, targets, opaque_ctc) - step(ref, ref_optim, x, targets, F.ctc_loss)).abs() <= TOL
    assert max((p - q).abs().max().item() for p, q in zip(model.parameters(), ref.parameters())) <= TOL


# --- a 0-dim parameter under the sharded modes --------------------------------------------------------


class Scale(nn.Module):
    def __init__(self, value: float):
        super().__init__()
        self.scale = nn.Parameter(torch.tensor(value))

    def forward(self, x):
        return x * self.scale


class TwoTowers(nn.Module):
    """CLIP in miniature: two towers and a 0-dim ``logit_scale`` at the root; one tower holds a 0-dim scale too."""

    def __init__(self):
        super().__init__()
        self.image = nn.Sequential(nn.Linear(4, 8), Scale(0.5), nn.Tanh(), nn.Linear(8, 6))
        self.text = nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 6))
        self.logit_scale = nn.Parameter(torch.tensor(2.0))

    def forward(self, x, y):
        a, b = F.normalize(self.image(x), dim=-1), F.normalize(self.text(y), dim=-1)
        logits = self.logit_scale.exp() * a @ b.t()
        labels = torch.arange(len(x))
        return (F.cross_entropy(logits, labels) + F.cross_entropy(logits.t(), labels)) / 2


def towers_side_by_side(step, body, ours: tuple, theirs: tuple, rank: int, steps: int):
    """``step(*ours, x, y)`` (compiled) beside ``body(*theirs, x, y)`` (eager) on this rank's batches for the
    towers: the largest difference of their outputs, and the last batch."""
    gen = torch.Generator().manual_seed(rank)
    worst = 0.0
    for _ in range(steps):
        x, y = torch.randn(3, 4, generator=gen, dtype=F64), torch.randn(3, 5, generator=gen, dtype=F64)
        pairs = zip(step(*ours, x, y), body(*theirs, x, y))
        worst = max(worst, *[(a - b.detach()).abs().item() for a, b in pairs])
    return worst, (x, y)


def _zero_dim_parameters_against_ddp(rank, world_size, style):
    torch.manual_seed(0)
    model = TwoTowers().to(F64)
    ddp = DDP(copy.deepcopy(model))
    mesh = init_device_mesh("cpu", (1, world_size)) if style == "hybrid_shard" else None
    mode = spmd.DataParallel(style, wrap_policy={nn.Sequential}, mesh=mesh)
    spmd.shard(model, mode)
    assert set(model.state_dict()["logit_scale"].placements) == {Replicate()}
    optim, ref_optim = (torch.optim.AdamW(m.parameters(), lr=0.05) for m in (model, ddp))
    step = spmd.compile(parallel_mode=mode)(clipped_step)
    worst, (x, y) = towers_side_by_side(step, clipped_step, (model, optim), (ddp, ref_optim), rank, 4)
    params = max((full_params(model)[n] - p).abs().max().item() for n, p in ddp.module.named_parameters())
    assert worst <= TOL and params <= TOL, f"{style}: loss/norm diff {worst}, param diff {params}"
    with torch.no_grad():  # eager use outside the step (spmd.parallel.eager_hooks) replicates it too
        assert (model(x, y) - ddp.module(x, y)).abs().item() <= TOL
    model(x, y).backward()  # an eager backward all-reduces its gradient as the step does
    ddp(x, y).backward()
    assert (model.logit_scale.grad.full_tensor() - ddp.module.logit_scale.grad).abs().item() <= TOL


@pytest.mark.parametrize("style", ["fully_shard", "shard_grad_op", "hybrid_shard"])
def test_a_zero_dim_parameter_is_replicated_under_the_sharded_modes_and_trains_as_ddp(style):
    run_distributed(_zero_dim_parameters_against_ddp, style)


# --- torch.distributed.nn's collectives -----------------------------------------------------------------


def gathered_contrastive_step(model, optim, x, y):
    """OpenCLIP's loss with gather_with_grad and local_loss: this rank's features against every rank's,
    differentiable through torch.distributed.nn (each rank's loss differs, so the gradients that reach a rank
    from the others count)."""
    a, b = model(x, y)
    all_a = torch.cat(torch.distributed.nn.all_gather(a))
    all_b = torch.cat(torch.distributed.nn.all_gather(b))
    scale = model.logit_scale.exp()
    labels = torch.arange(len(a)) + len(a) * torch.distributed.get_rank()
    loss = (F.cross_entropy(scale * a @ all_b.t(), labels) + F.cross_entropy(scale * b @ all_a.t(), labels)) / 2
    total = torch.distributed.nn.functional.all_reduce(loss.detach() * 1.0)  # a summed loss, for logging
    pieces = torch.distributed.nn.functional.reduce_scatter(torch.empty_like(a), [a * k for k in range(2)])
    loss = loss + pieces.square().mean()
    loss.backward()
    optim.step()
    optim.zero_grad()
    return loss, total


class Towers(TwoTowers):
    def forward(self, x, y):
        return F.normalize(self.image(x), dim=-1), F.normalize(self.text(y), dim=-1)


def _dist_nn_against_eager(rank, world_size):
    torch.manual_seed(0)
    model = Towers().to(F64)
    ddp = DDP(copy.deepcopy(model))
    ddp.logit_scale = ddp.module.logit_scale
    optim, ref_optim = (torch.optim.AdamW(m.parameters(), lr=0.05) for m in (model, ddp))
    step = spmd.compile(parallel_mode=spmd.DataParallel("replicate"))(gathered_contrastive_step)
    worst, _ = towers_side_by_side(step, gathered_contrastive_step, (model, optim), (ddp, ref_optim), rank, 3)
    params = max((p - q).abs().max().item() for p, q in zip(model.parameters(), ddp.module.parameters()))
    assert worst <= TOL and params <= TOL, f"loss diff {worst}, param diff {params}"
    assert step.trace_count == 1


def test_torch_distributed_nn_collectives_trace_with_their_autograd_on_two_ranks():
    run_distributed(_dist_nn_against_eager)


def broadcast_step(model, optim, x):
    return updated(optim, torch.distributed.nn.broadcast(model(x), 0).sum())


def imported_all_gather_step(model, optim, x):
    return updated(optim, torch.cat(imported_all_gather(model(x))).sum())


@pytest.mark.parametrize("body, expected", [
    (broadcast_step, r"calls torch\.distributed\.nn\.functional\.broadcast at .*test_trace_through\.py:\d+ .*"
                     r"Use torch\.distributed\._functional_collectives\.broadcast instead"),
    (imported_all_gather_step, r"all_gather at .* through a name imported before the trace.* as "
                               r"torch\.distributed\.nn\.all_gather\(\.\.\.\)"),
])
def test_a_torch_distributed_nn_collective_spmd_cannot_trace_is_refused_with_the_fix(body, expected):
    with single_process_group():
        model = nn.Linear(4, 2).to(F64)
        before = copy.deepcopy(model.state_dict())
        with pytest.raises(spmd.SpmdCompileError, match=expected):
            spmd.compile()(body)(model, torch.optim.SGD(model.parameters(), lr=0.1), torch.randn(3, 4, dtype=F64))
        assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


# --- flex_attention with a BlockMask built outside the step -------------------------------------------


def document_mask(documents: list[int], causal: bool = False):
    """A mask that lets each position attend within its document (ids in the mask_mod's closure), and with
    ``causal`` only to earlier positions (``and_masks``: the ids one closure deeper)."""
    from torch.nn.attention.flex_attention import and_masks, create_block_mask

    ids = torch.tensor(documents)

    def same_document(b, h, q, kv):
        return ids[q] == ids[kv]

    def earlier(b, h, q, kv):
        return q >= kv

    mask_mod = and_masks(earlier, same_document) if causal else same_document
    return create_block_mask(mask_mod, None, None, 8, 8, device="cpu", BLOCK_SIZE=4)


class FlexAttention(nn.Module):
    """Attention over the input's heads (no gradient into q, k, v: CPU flex_attention has no backward),
    projected by a trained Linear; the mask is the module's unless the step passes one."""

    def __init__(self, mask=None):
        super().__init__()
        self.out = nn.Linear(8, 8)
        self.mask = mask

    def forward(self, x, mask=None):
        from torch.nn.attention.flex_attention import flex_attention

        q, k, v = x.view(1, 8, 3, 2, 4).permute(2, 0, 3, 1, 4)
        y = flex_attention(q, k, v, block_mask=self.mask if mask is None else mask)
        return self.out(y.transpose(1, 2).reshape(1, 8, 8))


def flex_step(model, optim, x, mask=None):
    return updated(optim, model(x, mask).square().mean())


@pytest.mark.parametrize("causal", [False, True], ids=["documents", "causal documents"])
@pytest.mark.parametrize("held", [True, False], ids=["held by the model", "passed in"])
def test_a_block_mask_built_outside_the_step_is_an_input_and_trains_as_eager(held, causal):
    masks = [document_mask(ids, causal) for ids in ([0, 0, 0, 1, 1, 1, 1, 1], [0, 0, 0, 0, 0, 1, 1, 1], [0] * 8)]
    torch.manual_seed(0)
    model = FlexAttention(masks[0] if held else None).to(F64)
    ref = copy.deepcopy(model)
    optim, ref_optim = (torch.optim.AdamW(m.parameters(), lr=0.05) for m in (model, ref))
    step = spmd.compile()(flex_step)
    gen = torch.Generator().manual_seed(0)
    for mask in (*masks, masks[0]):  # a new mask each call, of one layout and mask_mod code: the same graph
        if held:
            model.mask = ref.mask = mask
        x = torch.randn(1, 8, 24, generator=gen, dtype=F64)
        extra = () if held else (mask,)
        loss, expected = step(model, optim, x, *extra), flex_step(ref, ref_optim, x, *extra)
        assert (loss - expected).abs().item() <= TOL
    assert max((p - q).abs().max().item() for p, q in zip(model.parameters(), ref.parameters())) <= TOL
    assert step.trace_count == 1
    assert model.mask is (masks[0] if held else None)  # the user's mask, as it was
    assert not is_fake(masks[0].kv_num_blocks)


def test_documents_change_the_result():  # what the test above relies on: the masks differ in what they compute
    x = torch.randn(1, 8, 24, dtype=F64)
    model = FlexAttention().to(F64)
    assert (model(x, document_mask([0, 0, 0, 1, 1, 1, 1, 1])) - model(x, document_mask([0] * 8))).abs().max() > 1e-3


def test_dynamo_run_inside_a_trace_still_knows_numpys_draws_and_tensor_item_after_it():
    """A flex_attention runs Dynamo inside the trace, where numpy's draws and ``Tensor.item`` stand patched; the
    lookups Dynamo computes once per process must name the real ones, not the patches freed after the trace
    (``host_reads._settle_dynamo_lookups``: a later function at a freed patch's address was taken for numpy's)."""
    import numpy as np
    from torch._dynamo import trace_rules

    trace_rules._numpy_function_ids.function_ids = None  # not computed yet, as in a fresh process
    trace_rules._numpy_function_ids.function_names = None
    trace_rules.get_tensor_method.cache_clear()
    torch.manual_seed(0)
    model = FlexAttention(document_mask([0, 0, 0, 1, 1, 1, 1, 1], causal=True)).to(F64)
    spmd.compile()(flex_step)(model, torch.optim.AdamW(model.parameters(), lr=0.05), torch.randn(1, 8, 24, dtype=F64))
    assert id(np.random.rand) in trace_rules._numpy_function_ids()
    assert torch.Tensor.item in trace_rules.get_tensor_method()


class FlexAttentionTrained(nn.Module):
    """Attention whose q, k, v are trained (flex_attention's backward: CUDA only)."""

    def __init__(self):
        super().__init__()
        self.qkv, self.out = nn.Linear(8, 96), nn.Linear(32, 8)  # 2 heads of 16: Inductor's flex kernel needs >= 16

    def forward(self, x, mask):
        from torch.nn.attention.flex_attention import flex_attention

        q, k, v = self.qkv(x).view(1, 128, 3, 2, 16).permute(2, 0, 3, 1, 4)
        return self.out(flex_attention(q, k, v, block_mask=mask).transpose(1, 2).reshape(1, 128, 32))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (flex_attention's backward)")
def test_flex_attention_with_document_masks_trains_as_eager_through_inductor_on_cuda():
    from torch.nn.attention.flex_attention import create_block_mask

    def document_mask_cuda(documents):
        ids = torch.tensor(documents, device="cuda")
        return create_block_mask(lambda b, h, q, kv: ids[q] == ids[kv], None, None, 128, 128, device="cuda")

    torch.manual_seed(0)
    model = FlexAttentionTrained().cuda()
    ref = copy.deepcopy(model)
    # SGD: Inductor's flex kernel and eager's reference round differently in float32, and Adam's normalisation
    # would turn those last bits into lr-sized parameter differences
    optim, ref_optim = (torch.optim.SGD(m.parameters(), lr=1e-2, momentum=0.9) for m in (model, ref))
    step = spmd.compile(gm_transformation=spmd.GraphModuleTransformation(enable_inductor=True))(flex_step)
    for split in (40, 90, 40):  # a new document mask each call: one graph
        mask = document_mask_cuda([0] * split + [1] * (128 - split))
        x = torch.randn(1, 128, 8, device="cuda")
        torch.testing.assert_close(step(model, optim, x, mask), flex_step(ref, ref_optim, x, mask), atol=1e-4, rtol=1e-4)
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, atol=1e-4, rtol=1e-4)
    assert step.trace_count == 1


OFFSETS = torch.tensor([0.5, -0.5], dtype=F64)  # a global the step reads: a graph input (spmd.trace.step_reach)


def global_tensor_step(model, optim, x):
    return updated(optim, (model(x) * OFFSETS).sum())


def test_a_tensor_the_step_finds_in_a_global_is_an_input_and_trains_as_eager():
    torch.manual_seed(0)
    model = nn.Linear(4, 2).to(F64)
    ref = copy.deepcopy(model)
    optim, ref_optim = (torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, ref))
    step = spmd.compile()(global_tensor_step)
    for k in range(3):
        OFFSETS.fill_(0.5 * (k + 1))  # read anew on every call
        x = torch.randn(3, 4, dtype=F64)
        torch.testing.assert_close(step(model, optim, x), global_tensor_step(ref, ref_optim, x), rtol=0, atol=1e-12)
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=1e-12)
    assert step.trace_count == 1



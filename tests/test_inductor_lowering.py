"""Inductor lowering of whole steps: graph preparation, kept comm schedule, parity (CPU, C++ backend)."""

from __future__ import annotations

import copy
import operator
import re
from collections import Counter

import pytest
import torch
import torch.distributed as dist
from torch._inductor.utils import run_and_get_code

import spmd
import spmd.trace.capture
from spmd.graph_utils import find_node, is_all_reduce, is_wait_node
from spmd.passes import comm_fusion_with_concat, remove_copy_from_optimizer, schedule_comm_wait
from spmd import IterGraphModule, SpmdCompileError
from spmd._testing import with_lowering
from spmd.lower import Lowering
from spmd.lower.worker_pool import WorkerPool
from spmd.lower.rewrites import prepare_for_inductor
from spmd.tools.models import MLP
from tests.dist import run_distributed, single_process_group
from tests.helpers import first_relu, inplace_activation_step, iter_move_pipeline
from tests.parity import assert_params_close, check_sgd_grad_sum, ddp_copy, eager_step, train_step

aten = torch.ops.aten
# Inductor reassociates float math (fused reductions, FMA); Adam turns that into small
# parameter differences. Anything beyond this is a real numerical change.
TOL = {"atol": 1e-4, "rtol": 1e-4}


def _pipeline_igm(bucket_mb: float):
    seen = {}

    def transform(gm):
        igm = IterGraphModule(gm)
        comm_fusion_with_concat(igm, bucket_mb)
        schedule_comm_wait(igm)
        remove_copy_from_optimizer(igm)
        igm.finalize_setup()
        seen["igm"] = igm
        return igm

    return transform, seen


def test_prepare_for_inductor_turns_copy_views_into_views_and_wraps_inplace_optimizer():
    transform, seen = _pipeline_igm(0.002)
    torch.manual_seed(0)
    model = MLP(layers=3, dim=16)
    optim = torch.optim.AdamW(model.parameters(), lr=0.01, fused=True)
    with single_process_group():
        spmd.compile(gm_transformation=transform)(inplace_activation_step)(model, optim, torch.randn(4, 16))
    gm = seen["igm"].logical_gm

    def targets(g):
        return [n.target for n in g.nodes if n.op == "call_function"]

    # our functionalization keeps views; a user's pass may leave copying views, as functionalize(remove=
    # "mutations_and_views") does: every view of the step made one
    copying = {aten.t.default: aten.t_copy.default, aten.detach.default: aten.detach_copy.default,
               aten.view.default: aten.view_copy.default}
    made = set()
    for node in gm.graph.nodes:
        node.target = copying.get(node.target, node.target)
        made.add(node.target)
    # torch 2.15's trace has no detach nodes here; transposes and reshapes every version has
    assert {aten.t_copy.default, aten.view_copy.default} <= made
    assert aten._fused_adamw_.tensor_lr in targets(gm.graph)
    before = str(gm.graph)

    prepared = prepare_for_inductor(gm, decompose=False)
    after = targets(prepared.graph)
    assert str(gm.graph) == before  # the input graph is not edited
    assert not [t for t in after if isinstance(t, torch._ops.OpOverload) and t._opname in ("detach_copy", "t_copy", "view_copy")]
    assert aten._fused_adamw_.tensor_lr not in after
    assert torch.ops.spmd_lowering.fused_adamw_tensor_lr.default in after
    assert len(after) == len(targets(gm.graph))


def test_a_low_precision_embedding_backward_stays_one_aten_call_without_a_float32_table():
    """Inductor's decomposition sums a bfloat16 embedding gradient in a float32 (rows, dim) buffer, twice the
    gradient's size (at the end of a tied-embedding GPT's backward, on top of the peak); prepared for
    Inductor it stays ATen's kernel, with eager's values. A float32 gradient is still decomposed."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from spmd.lower.inductor import compile_with_inductor
    from spmd.lower.opaque_ops import EMBEDDING_BACKWARD

    rows, dim = 64, 8
    gen = torch.Generator().manual_seed(0)
    idx = torch.randint(0, rows, (3, 5), generator=gen)

    def backward(grad, idx):
        return (aten.embedding_dense_backward(grad, idx, rows, -1, False),)

    for dtype in (torch.bfloat16, torch.float32):
        grad = torch.randn(3, 5, dim, generator=gen).to(dtype)
        gm = make_fx(backward, tracing_mode="fake")(grad, idx)
        prepared = prepare_for_inductor(gm)
        tables = [n for n in prepared.graph.nodes if isinstance(n.meta.get("val"), torch.Tensor)
                  and n.meta["val"].shape == (rows, dim) and n.meta["val"].dtype == torch.float32]
        kept = [n for n in prepared.graph.nodes if n.target is EMBEDDING_BACKWARD]
        if dtype == torch.bfloat16:
            assert kept and not tables, prepared.graph
            compiled, _ = compile_with_inductor(gm, [grad, idx])
            (out,) = compiled(grad, idx)
            assert torch.equal(out, aten.embedding_dense_backward(grad, idx, rows, -1, False))
        else:
            assert tables and not kept, "a float32 gradient is summed in its own dtype: decomposed as before"


def test_a_lookup_into_a_gathered_table_stays_one_aten_call_and_a_parameter_table_is_left_to_inductor():
    """Inductor would look the rows of a gathered table up again in each kernel that reads them, the backward's
    among them, keeping the table alive there; a lookup into a table the graph makes (as a fully sharded
    model's gather does) runs as ATen's lookup, with eager's values. Any other table is Inductor's."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from spmd.lower.inductor import compile_with_inductor
    from spmd.lower.opaque_ops import EMBEDDING

    gen = torch.Generator().manual_seed(0)
    shard, idx = torch.randn(32, 8, generator=gen, dtype=torch.float64), torch.randint(0, 32, (3, 5), generator=gen)

    def gathered(shard, idx):
        flat = torch.ops._c10d_functional.all_gather_into_tensor(shard, 1, dist.group.WORLD.group_name)
        table = torch.ops._c10d_functional.wait_tensor(flat)
        return (torch.nn.functional.embedding(idx, table.view(32, 8)) * 2,)

    def computed(table, idx):  # a table the step computes but gathers not (a cast): Inductor's, fused
        return (torch.nn.functional.embedding(idx, table * 3) * 2,)

    with single_process_group():
        for fn, opaque in ((gathered, True), (computed, False)):
            gm = make_fx(fn)(shard, idx)
            kept = [n for n in prepare_for_inductor(gm, decompose=False).graph.nodes if n.target is EMBEDDING]
            assert bool(kept) == opaque, fn.__name__
            compiled, _ = compile_with_inductor(gm, [shard, idx])
            assert torch.equal(compiled(shard, idx)[0], fn(shard, idx)[0])


def _op_counts(graph) -> Counter:
    """How often each op is called, leaving out how in-place writes are spelled: AOT autograd writes an
    in-place op as ``auto_functionalized`` + ``getitem`` + ``copy_`` back, we keep the in-place op."""
    def spelling(target) -> bool:
        name = str(target)
        return (target in (operator.getitem, aten.copy_.default) or name.startswith("auto_functionalized")
                or name.startswith("spmd_lowering."))

    return Counter(str(n.target) for n in graph.nodes if n.op == "call_function" and not spelling(n.target))


@pytest.mark.parametrize("step", [train_step, inplace_activation_step], ids=["optimizer-writes", "re-traced"])
def test_inductor_compiles_what_aot_autograds_retrace_would_have_given_it(step, monkeypatch):
    """``compile_with_inductor`` decomposes node by node instead of letting ``compile_fx`` re-trace the
    whole step with AOT autograd: ``compile_fx_inner`` receives the same ops either way (so the same
    kernels and numerics), only in-place writes are spelled differently."""
    import torch._inductor.compile_fx as inductor
    from torch._inductor.decomposition import select_decomp_table

    from spmd.lower.inductor import compile_with_inductor, inductor_config

    if step is inplace_activation_step:  # the graph as the functionalize re-trace gives it
        monkeypatch.setattr(spmd.trace.capture, "functionalize_writes", lambda gm: None)
    transform, seen = _pipeline_igm(0.002)
    torch.manual_seed(0)
    model = MLP(layers=3, dim=16)
    optim = torch.optim.AdamW(model.parameters(), lr=0.01, fused=True)
    x = torch.randn(4, 16)
    received = []

    def stop_before_codegen(gm, example_inputs, **kwargs):
        received.append(gm)
        raise RuntimeError("stop")

    with single_process_group():
        step_fn = spmd.compile(gm_transformation=transform)(step)
        step_fn(model, optim, x)
        state = step_fn._definition.prepare_state((model, optim, x), {})
        inputs = [*state.flat_tensors(), *state.hyper_tensors(), x]
        gm = seen["igm"].logical_gm
        monkeypatch.setattr(inductor, "compile_fx_inner", stop_before_codegen)
        with pytest.raises(RuntimeError, match="stop"):
            compile_with_inductor(gm, inputs)
        with torch.no_grad(), torch._inductor.config.patch(inductor_config()), pytest.raises(RuntimeError, match="stop"):
            inductor.compile_fx(prepare_for_inductor(gm, decompose=False), inputs, inner_compile=stop_before_codegen)
    ours, aot = received
    assert _op_counts(ours.graph) == _op_counts(aot.graph)
    assert [n for n in gm.graph.nodes if n.op == "call_function" and n.target in select_decomp_table()]
    assert _op_counts(ours.graph) != _op_counts(gm.graph)  # there was something to decompose


def _comm_tokens_in_graph(graph) -> list[str]:
    """'A<i>' for the i-th all_reduce, 'W<i>' for its wait, in graph order."""
    index = {n: i for i, n in enumerate(find_node(graph, is_all_reduce))}
    tokens = []
    for n in graph.nodes:
        if n in index:
            tokens.append(f"A{index[n]}")
        elif is_wait_node(n):
            tokens.append(f"W{index[n.args[0]]}")
    return tokens


def _comm_tokens_in_code(code: str) -> tuple[list[str], list[int]]:
    """The same tokens from Inductor's output code, and how many kernels ran between each A and its W."""
    tokens, kernels_since, between = [], {}, []
    buffer_of = {}
    for line in code.splitlines():
        line = line.strip()
        if line.startswith("#"):
            continue
        m = re.search(r"_c10d_functional\.all_reduce_?\.default\((\w+)", line)
        if m:
            buffer_of[m.group(1)] = len(buffer_of)
            tokens.append(f"A{buffer_of[m.group(1)]}")
            kernels_since[m.group(1)] = 0
            continue
        m = re.search(r"_c10d_functional\.wait_tensor\.default\((\w+)", line)
        if m:
            tokens.append(f"W{buffer_of[m.group(1)]}")
            between.append(kernels_since.pop(m.group(1)))
            continue
        if re.match(r"(cpp_fused_\w+|extern_kernels\.\w+)\(", line):
            kernels_since = {k: v + 1 for k, v in kernels_since.items()}
    return tokens, between


def _keeps_order(rank, world_size):
    transform, seen = _pipeline_igm(0.002)  # several buckets for MLP(5, 16)

    def lowered(gm):
        igm = transform(gm)
        igm.lowering = Lowering(inductor=True)
        return igm

    torch.manual_seed(0)
    model = MLP(layers=5, dim=16)
    optim = torch.optim.AdamW(model.parameters(), lr=0.01, fused=True)
    _, codes = run_and_get_code(spmd.compile(gm_transformation=lowered)(train_step), model, optim, torch.randn(4, 16))
    graph_tokens = _comm_tokens_in_graph(seen["igm"].graph)
    code_tokens, kernels_between = _comm_tokens_in_code("\n".join(codes))
    assert len(find_node(seen["igm"].graph, is_all_reduce)) >= 3
    assert code_tokens == graph_tokens
    assert any(k > 0 for k in kernels_between), "every wait was issued right after its collective"


def test_inductor_keeps_the_collective_and_wait_order_the_passes_chose():
    run_distributed(_keeps_order)  # on the ranks, which compile with Inductor anyway


def _parity(rank, world_size, optimize, optim_kwargs):
    torch.manual_seed(0)
    model = MLP(layers=4, dim=16)
    ddp = ddp_copy(model)

    def make(m):  # two param groups: two optimizer ops read gradients from one bucket
        weights = [p for p in m.parameters() if p.dim() == 2]
        biases = [p for p in m.parameters() if p.dim() == 1]
        return torch.optim.AdamW([{"params": weights, "weight_decay": 0.1}, {"params": biases, "weight_decay": 0.0}],
                                 lr=0.01, **optim_kwargs)

    optim, ddp_optim = make(model), make(ddp)
    transformation = spmd.GraphModuleTransformation(enable_graph_optimization=optimize, bucket_size_mb=0.002,
                                                    enable_inductor=True)
    replicate = spmd.DataParallel("replicate", "avg")
    step = spmd.compile(gm_transformation=transformation, parallel_mode=replicate)(train_step)
    torch.manual_seed(rank)
    for i in range(5):
        batch = torch.randn(8, 16)
        loss = step(model, optim, batch, last_train_step=(i == 4))
        torch.testing.assert_close(loss, eager_step(ddp, ddp_optim, batch), **TOL)
    assert_params_close(model, ddp, **TOL)
    (entry,) = step.cache.values()
    for label, runner in entry.runner._runners.items():
        assert not isinstance(runner, torch.fx.GraphModule), f"the {label} graph was not compiled"


@pytest.mark.parametrize("optimize,optim_kwargs", [
    (False, {"foreach": True}),
    (True, {"fused": True}),
    (True, {"foreach": True}),
], ids=["replicate-foreach", "pipeline-fused", "pipeline-foreach"])
def test_inductor_lowered_step_matches_ddp(optimize, optim_kwargs):
    run_distributed(_parity, optimize, optim_kwargs)


def _sgd_sum(rank, world_size):
    """grad_reduce="sum" through the pass pipeline and Inductor, seen by plain SGD (see check_sgd_grad_sum)."""
    transformation = spmd.GraphModuleTransformation(enable_graph_optimization=True, bucket_size_mb=0.004,
                                                    enable_inductor=True)
    step = spmd.compile(gm_transformation=transformation)(train_step)
    check_sgd_grad_sum(step, world_size, "foreach")
    (entry,) = step.cache.values()
    assert all(not isinstance(r, torch.fx.GraphModule) for r in entry.runner._runners.values()), "not compiled"


def test_inductor_lowered_sum_matches_ddp_with_plain_sgd():
    run_distributed(_sgd_sum)


def _iter_move_parity(rank, world_size):
    torch.manual_seed(0)
    model = MLP(layers=5, dim=16)
    ddp = ddp_copy(model)
    optim = torch.optim.Adam(model.parameters(), lr=0.01, fused=True)
    ddp_optim = torch.optim.Adam(ddp.parameters(), lr=0.01, fused=True)
    seen = {}
    pipeline = iter_move_pipeline(lambda comms: comms[0], first_relu, seen)  # the seed file's move

    def moved(gm):
        igm = pipeline(gm)
        igm.lowering = Lowering(inductor=True)
        return igm

    step = spmd.compile(gm_transformation=moved)(train_step)
    torch.manual_seed(rank)
    compiled = step.lower(model, optim, torch.randn(8, 16))  # every graph compiled before the first run
    lowered = dict(seen["igm"]._runners)
    assert sorted(lowered) == ["cleanup", "flush", "main", "setup"]
    assert compiled.compile_times["lower"] > 0 and "first_run" not in compiled.compile_times
    for i in range(4):  # setup, main, main, cleanup
        batch = torch.randn(8, 16)
        step(model, optim, batch, last_train_step=(i == 3))
        eager_step(ddp, ddp_optim, batch, grad_scale=world_size)
    assert_params_close(model, ddp, **TOL)
    assert seen["igm"]._runners == lowered, "running compiled nothing more"
    assert step.trace_count == 1


def test_inductor_compiles_every_graph_of_a_moved_step_before_it_runs():
    run_distributed(_iter_move_parity)


def test_cudagraphs_refuse_cpu_inputs_before_running_anything():
    torch.manual_seed(0)
    model = MLP(layers=2, dim=8)
    optim = torch.optim.AdamW(model.parameters(), lr=0.01, foreach=True)
    before = [p.detach().clone() for p in model.parameters()]
    step = spmd.compile(gm_transformation=spmd.GraphModuleTransformation(enable_cudagraphs=True))(train_step)
    with pytest.raises(SpmdCompileError, match=r"enable_cudagraphs=True.*is on cpu.*capturable=True"):
        step(model, optim, torch.randn(4, 8))
    for p, q in zip(model.parameters(), before):
        torch.testing.assert_close(p, q, atol=0, rtol=0)


def test_our_schedule_switches_inductor_comm_reordering_off_and_the_comparison_switches_it_on():
    import torch._inductor.config as config

    from spmd.lower.inductor import inductor_config

    ours, theirs = inductor_config(), inductor_config(inductor_comm_passes=True)
    assert ours["reorder_for_compute_comm_overlap"] is False and ours["reorder_for_peak_memory"] is False
    if "aten_distributed_optimizations.enable_overlap_scheduling" in config.get_config_copy():
        assert ours["aten_distributed_optimizations.enable_overlap_scheduling"] is False
        assert theirs["aten_distributed_optimizations.enable_overlap_scheduling"] is True
    assert any(v is True for v in theirs.values())
    with pytest.raises(ValueError, match="needs enable_inductor=True"):
        with_lowering(spmd.GraphModuleTransformation(), inductor_comm_passes=True)


def test_inductor_orders_its_kernels_for_memory_in_a_graph_without_collectives_only(monkeypatch):
    """Inductor's memory-aware kernel order could move a collective away from where our passes put it: it
    stays off in a graph holding one, and on (Inductor's default, as torch.compile has it) in one without."""
    import torch._inductor.memory as inductor_memory
    from torch.fx.experimental.proxy_tensor import make_fx

    from spmd.lower.inductor import compile_with_inductor, inductor_config

    assert "reorder_for_peak_memory" not in inductor_config(collectives=False)
    assert inductor_config(collectives=True)["reorder_for_peak_memory"] is False
    ordered = []
    real = inductor_memory.reorder_for_peak_memory
    monkeypatch.setattr(inductor_memory, "reorder_for_peak_memory", lambda nodes, *a, **k: (
        ordered.append(len(nodes)), real(nodes, *a, **k))[1])

    def local(x):
        wide = x.float()
        return ((x * 2).sum() + (wide.exp() * 3).sum(),)

    def gathered(x):
        flat = torch.ops._c10d_functional.all_gather_into_tensor(x, 1, dist.group.WORLD.group_name)
        return ((torch.ops._c10d_functional.wait_tensor(flat).float().exp() * 3).sum(),)

    x = torch.randn(64, 32, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    with torch._inductor.config.patch(fx_graph_cache=False), single_process_group():
        for fn, reorders in ((local, True), (gathered, False)):
            ordered.clear()
            gm = make_fx(fn)(x)
            compiled, _ = compile_with_inductor(gm, [x])
            torch.testing.assert_close(compiled(x)[0], fn(x)[0])
            assert bool(ordered) == reorders, fn.__name__


def test_inductor_names_each_kernel_by_the_ops_it_computes_decomposed_ones_too():
    """Our traced nodes carry no ``original_aten``; Inductor would name every kernel ``..._fused_<n>`` and list
    no op above it (as on a GPU). Each op is named by itself, and a node decomposed before Inductor (the layer
    norm) by the op it was."""
    from torch._inductor.utils import run_and_get_code
    from torch.fx.experimental.proxy_tensor import make_fx

    from spmd.lower.inductor import compile_with_inductor

    def step(x, w):
        return (torch.nn.functional.layer_norm(x * 2, (16,), w).exp(),)

    x, w = torch.randn(4, 16, dtype=torch.float64), torch.randn(16, dtype=torch.float64)
    gm = make_fx(step)(x, w)
    with torch._inductor.config.patch(fx_graph_cache=False):
        (out,), (code,) = run_and_get_code(lambda: compile_with_inductor(gm, [x, w])[0](x, w))
    torch.testing.assert_close(out, step(x, w)[0], rtol=1e-12, atol=1e-12)
    assert "fused_exp_mul_native_layer_norm_0" in code and not re.search(r"_fused_\d", code), code


def test_a_missing_inductor_option_fails_loudly_unless_this_torch_may_lack_it(monkeypatch):
    """A renamed Inductor option would let Inductor reorder our collectives: refuse instead of skipping it."""
    import spmd.lower.inductor as lowering
    from spmd._torch_version import installed

    monkeypatch.setitem(lowering._INDUCTOR_CONFIG, "renamed_comm_reordering_option", False)
    with pytest.raises(SpmdCompileError, match=re.escape(f"torch ({torch.__version__}) has no Inductor option "
                                                         "renamed_comm_reordering_option")):
        lowering.inductor_config()
    monkeypatch.setitem(lowering._ABSENT_BEFORE, "renamed_comm_reordering_option", (installed()[0] + 1, 0))
    assert "renamed_comm_reordering_option" not in lowering.inductor_config()


def test_inductor_compile_workers_start_before_a_gpu_step_is_traced(monkeypatch):
    """spmd.compile asks the transformation's lowering to start before tracing; with Inductor it then
    starts Inductor's compile workers for a GPU step (as compile_fx would, but seconds earlier)."""
    import spmd.lower.lowering as lowering_module

    started = []
    monkeypatch.setattr(lowering_module, "start_compile_workers", lambda: started.append(True))
    Lowering(inductor=True).start(torch.device("cuda"), WorkerPool())
    Lowering(inductor=True).start(torch.device("cpu"), WorkerPool())
    Lowering().start(torch.device("cuda"), WorkerPool())
    assert started == [True]

    seen = []
    monkeypatch.setattr(Lowering, "start", lambda self, device, workers: seen.append(("start", device)))
    transform = spmd.GraphModuleTransformation()
    original = spmd.GraphModuleTransformation.transform
    monkeypatch.setattr(spmd.GraphModuleTransformation, "transform",
                        lambda self, gm, mode: seen.append(("transform", None)) or original(self, gm, mode))
    model = MLP(layers=2, dim=8)
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    spmd.compile(gm_transformation=transform)(train_step)(model, optim, torch.randn(2, 8))
    assert seen == [("start", torch.device("cpu")), ("transform", None)]


def test_a_decomposition_that_fails_names_the_op_and_the_way_around_it():
    """A decomposition that raises on our graph is an SpmdCompileError naming the op and the fix, not a
    deep traceback from make_fx."""
    from spmd.lower.decompose_for_inductor import decompose_for_inductor

    gm = torch.fx.experimental.proxy_tensor.make_fx(lambda x: torch.relu(x) + 1, tracing_mode="fake")(torch.randn(4))

    def broken(*args, **kwargs):
        raise RuntimeError("no decomposition today")

    with pytest.raises(SpmdCompileError, match=r"aten\.relu\.default.*without Inductor"):
        decompose_for_inductor(gm.graph, {aten.relu.default: broken})


def test_a_decomposition_that_lays_its_result_out_otherwise_keeps_the_ops_layout_for_later_views():
    """Inductor's ``cat`` of one non-empty tensor and an empty one (a Hugging Face cache's first update) is a
    clone in that tensor's layout, where ``cat`` is contiguous; the matmul after it was traced as a ``view``
    of the contiguous result (HF T5 in bf16 autocast failed with "Cannot view a tensor ..."). The decomposed
    graph keeps ``cat``'s layout, and computes what the op did."""
    from torch.fx.experimental.proxy_tensor import make_fx
    from torch.fx.passes.fake_tensor_prop import FakeTensorProp

    from spmd.lower.decompose_for_inductor import decompose_for_inductor

    def attention_scores(q, cached, k):
        keys = torch.cat([cached, k.transpose(1, 2)], dim=-2)  # (b, h, s, d), contiguous
        return (torch.matmul(q, keys.transpose(3, 2)),)  # expand + view of the transposed keys

    q, cached, k = torch.randn(2, 4, 6, 8), torch.empty(2, 4, 0, 8), torch.randn(2, 6, 4, 8)
    gm = make_fx(attention_scores)(q, cached, k)
    assert any(n.target is aten.cat.default for n in gm.graph.nodes)
    decompose_for_inductor(gm.graph)
    gm.recompile()
    assert not any(n.target is aten.cat.default for n in gm.graph.nodes)
    FakeTensorProp(gm).propagate(q, cached, k)
    assert torch.equal(gm(q, cached, k)[0], attention_scores(q, cached, k)[0])


class _DroppedAttention(torch.nn.Module):
    """Attention whose weights go through dropout after the softmax (as Hugging Face T5's do)."""

    def __init__(self):
        super().__init__()
        self.q, self.k, self.v = (torch.nn.Linear(8, 8, dtype=torch.float64) for _ in range(3))

    def forward(self, x):
        weights = torch.softmax(self.q(x) @ self.k(x).transpose(-1, -2), dim=-1)
        return (torch.nn.functional.dropout(weights, p=0.1, training=True) @ self.v(x)).square().mean()


def test_a_dropout_mask_drawn_on_the_cpu_is_drawn_before_its_readers_and_as_eager_draws_it():
    """The CPU traces dropout as ``bernoulli.p`` on an uninitialized tensor. Inductor's lowering of it fused the
    mask's readers ahead of the draw (NaN losses); run as ATen's kernel, it draws eager's mask from the same
    generator, so the step through Inductor matches eager with the same seed."""
    torch.manual_seed(0)
    model = _DroppedAttention()
    ref = copy.deepcopy(model)
    optim, ref_optim = (torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, ref))
    step = spmd.compile(gm_transformation=spmd.GraphModuleTransformation(enable_inductor=True))(train_step)
    for k in range(3):
        x = torch.randn(2, 6, 8, dtype=torch.float64)
        torch.manual_seed(100 + k)
        loss = step(model, optim, x)
        torch.manual_seed(100 + k)
        assert abs(loss.item() - train_step(ref, ref_optim, x).item()) <= 1e-10, k
    assert_params_close(model, ref, atol=1e-10, rtol=0)

"""Sharding units follow FSDP's wrap-policy semantics: the same units and parameter owners as FSDP1's wrapping.

FSDP1 (``FullyShardedDataParallel(auto_wrap_policy=...)``, one gloo process on CPU) is
the reference: for each policy kind, the modules it wraps and the parameters each
wrapper flattens must be spmd's units and the parameters each owns.
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn as nn
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.tensor import Replicate
from torch.distributed.fsdp.wrap import (
    CustomPolicy, ModuleWrapPolicy, _or_policy, always_wrap_policy, lambda_auto_wrap_policy, size_based_auto_wrap_policy,
    transformer_auto_wrap_policy,
)

import spmd
from spmd import SpmdCompileError
from spmd.parallel.shard import build_units
from spmd.tools.models import GPT, Block, GPTConfig
from tests.dist import single_process_group

CFG = GPTConfig(vocab_size=37, block_size=8, n_layer=2, n_head=2, n_embd=16)
pytestmark = pytest.mark.filterwarnings("ignore:FSDP is switching to use `NO_SHARD`")  # FSDP1 on one rank


def _nested_sequential():
    """The reference test's NestedSequentialModel: Linear, Linear, Sequential(Linear, Linear)."""
    return nn.Sequential(nn.Linear(5, 5), nn.Linear(5, 5), nn.Sequential(nn.Linear(5, 5), nn.Linear(5, 5)))


def _fsdp1_units(model, policy) -> dict[str, list[str]]:
    """FSDP1's wrappers: module name -> the parameter names its flat parameter holds (relative to the module)."""
    wrapped = FSDP(model, auto_wrap_policy=policy, use_orig_params=True, device_id=torch.device("cpu"))
    out = {}
    for name, mod in wrapped.named_modules():
        if isinstance(mod, FSDP):
            params = mod._flat_param._fqns if mod._flat_param is not None else ()
            out[name.replace("_fsdp_wrapped_module.", "").replace("_fsdp_wrapped_module", "")] = sorted(params)
    return out


def _spmd_units(model, policy) -> dict[str, list[str]]:
    units = build_units(model, spmd.DataParallel("fully_shard", wrap_policy=policy))
    assert units[-1].module is model, "the root is the last unit"
    prefix = lambda u: f"{u.fqn}." if u.fqn else ""  # noqa: E731
    return {u.fqn: sorted(n[len(prefix(u)):] for n in u.names) for u in units}


POLICIES = {
    "module_classes_set": lambda: {Block},
    "ModuleWrapPolicy": lambda: ModuleWrapPolicy({Block, nn.LayerNorm}),
    "CustomPolicy": lambda: CustomPolicy(lambda m: isinstance(m, Block) or (isinstance(m, nn.Linear)
                                                                            and m.out_features == 64)),
    "size_based": lambda: functools.partial(size_based_auto_wrap_policy, min_num_params=1000),
    "_or_policy": lambda: functools.partial(_or_policy, policies=[
        ModuleWrapPolicy({nn.LayerNorm}), functools.partial(size_based_auto_wrap_policy, min_num_params=2000)]),
    "transformer_auto_wrap": lambda: functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={Block}),
    "lambda_auto_wrap": lambda: functools.partial(lambda_auto_wrap_policy,
                                                  lambda_fn=lambda m: isinstance(m, nn.Linear)),
}


@pytest.mark.parametrize("kind", list(POLICIES))
def test_units_are_fsdp1_wrappers_for_each_policy_kind(kind):
    policy = POLICIES[kind]()
    fsdp_policy = ModuleWrapPolicy(policy) if isinstance(policy, set) else policy
    model = GPT(CFG)
    if kind == "lambda_auto_wrap":  # no Linear may hold the tied weight, or FSDP1 would wrap it twice
        model.lm_head.weight = nn.Parameter(model.wte.weight.detach().clone())
    ours = _spmd_units(model, policy)
    with single_process_group():
        theirs = _fsdp1_units(model, fsdp_policy)
    assert ours == theirs
    assert len(ours) > 1


@pytest.mark.parametrize("policy, units", [
    (functools.partial(size_based_auto_wrap_policy, min_num_params=40), {"", "2"}),  # verify_model
    (always_wrap_policy, {"", "0", "1", "2", "2.0", "2.1"}),                         # verify_model_all_wrapped
])
def test_the_reference_nested_sequential(policy, units):
    """The reference's test_auto_wrap_api and test_always_wrap on its NestedSequentialModel."""
    ours = _spmd_units(_nested_sequential(), policy)
    with single_process_group():
        theirs = _fsdp1_units(_nested_sequential(), policy)
    assert ours == theirs
    assert set(ours) == units


def test_tied_parameter_belongs_to_the_lowest_unit_holding_all_its_users():
    model = GPT(CFG)  # lm_head.weight is wte.weight
    units = {u.fqn: u for u in build_units(model, spmd.DataParallel("fully_shard",
                                                                     wrap_policy={Block, nn.Linear}))}
    assert "lm_head" in units and "wte.weight" in units[""].names, "users in the root and in lm_head: the root"
    assert units["lm_head"].names == []
    owner = next(u for u in units.values() if "wte.weight" in u.names)
    assert [(m, a) for m, a in owner.params[owner.names.index("wte.weight")]] == [(model.wte, "weight"),
                                                                                 (model.lm_head, "weight")]


def test_custom_policy_settings_per_unit():
    model = GPT(CFG)
    policy = CustomPolicy(lambda m: {"reshard_after_forward": False} if m is model.blocks[0] else isinstance(m, Block))
    units = build_units(model, spmd.DataParallel("fully_shard", wrap_policy=policy))
    assert [u.reshard_after_forward for u in units] == [False, True, False]  # the root never reshards
    bad = CustomPolicy(lambda m: {"sharding_strategy": "FULL_SHARD"} if isinstance(m, Block) else False)
    with pytest.raises(SpmdCompileError, match="reshard_after_forward"):
        build_units(model, spmd.DataParallel("fully_shard", wrap_policy=bad))


def test_options_that_do_not_apply_to_the_style_raise():
    with pytest.raises(spmd.SpmdConfigError, match="sharded styles"):
        spmd.DataParallel("replicate", wrap_policy={Block})
    with pytest.raises(spmd.SpmdConfigError, match="grad_reduce and group apply to replicate"):
        spmd.DataParallel("fully_shard", grad_reduce="avg")
    for option in ("sync_module_states", "broadcast_buffers"):
        with pytest.raises(spmd.SpmdConfigError, match="keeps each rank's own shard and buffers"):
            spmd.DataParallel("hybrid_shard", **{option: False})
    with pytest.raises(spmd.SpmdConfigError, match="must be True or False"):
        spmd.DataParallel("replicate", broadcast_buffers="yes")
    with pytest.raises(spmd.SpmdConfigError, match="MixedPrecisionPolicy"):
        spmd.DataParallel("fully_shard", mp_policy="bf16")
    with pytest.raises(spmd.SpmdConfigError, match="wrap_policy"):
        spmd.DataParallel("fully_shard", wrap_policy=42)
    assert spmd.DataParallel("shard_grad_op").resolved_reshard_after_forward is False
    assert spmd.DataParallel("hybrid_shard").resolved_reshard_after_forward is True


def test_shard_refuses_without_process_group_and_twice():
    mode = spmd.DataParallel("fully_shard")
    with pytest.raises(SpmdCompileError, match="init_process_group"):
        spmd.shard(GPT(CFG), mode)
    with single_process_group():
        model = spmd.shard(GPT(CFG), mode)
        with pytest.raises(SpmdCompileError, match="already sharded"):
            spmd.shard(model, mode)
        scalar = nn.Module()  # a 0-dim parameter, which FSDP2 refuses, is replicated (tests/test_trace_through.py)
        scalar.p = nn.Parameter(torch.tensor(1.0))
        assert spmd.shard(scalar, mode).p.placements == (Replicate(),)
        with pytest.raises(SpmdCompileError, match="2-D mesh"):
            spmd.shard(GPT(CFG), spmd.DataParallel("hybrid_shard"))

"""qshard.models.Llama: the KV-cached decode equals a full forward, every layout runs it, the
one-token step compiles, and the TP plan shards it with the single-device result."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from helpers import LAYOUT_CASES
from test_tensor_parallel import spawn

import qshard
import qshard.tp
from qshard.models import TP_PLAN, Llama, LlamaConfig, decode_one_token, generate

# Logits of the tiny Llama with every linear but the output quantized, against the float model's,
# per config class. Measured on the CPU over `tiny(seed)` and its prompt for seeds 0..19 and
# every contract config of the class (the test runs seed 0, every other config): FP8 blockwise
# 21.4-26.1 dB (22.7 and 24.7 here), FP8 row-wise 21.8-26.1 (24.9), int4 12.4-17.2 (13.9
# symmetric g32, 15.9 tinygemm g32), MXFP4 11.7-14.4 (11.9), NVFP4 13.2-15.1. Floors 1.4 dB or
# more under the lowest and 1.9 or more under the values here (MXFP4's is the old common 10).
LOGITS_MIN_SQNR_DB = {
    "Fp8BlockwiseConfig": 20.0,
    "Fp8RowwiseConfig": 20.0,
    "Int4WeightOnlyConfig": 11.0,
    "MXFP4WeightOnlyConfig": 10.0,
    "NVFP4WeightOnlyConfig": 11.0,
}


def tiny(seed: int = 0) -> Llama:
    torch.manual_seed(seed)
    model = Llama(LlamaConfig.tiny()).eval()
    model.setup_caches(batch=2, max_seq=32)
    return model


@torch.no_grad()
def test_cached_decode_equals_a_full_forward():
    model = tiny()
    prompt = torch.randint(0, 512, (2, 7))
    tokens = generate(model, prompt, new_tokens=5)
    assert tokens.shape == (2, 12) and torch.equal(tokens[:, :7], prompt)
    # Each generated token is the argmax of a full (prefill-only) forward over what precedes it.
    for end in range(7, 12):
        fresh = tiny()
        logits = fresh(tokens[:, :end], torch.arange(end))
        assert torch.equal(logits[:, -1].argmax(-1), tokens[:, end])


@pytest.mark.parametrize(
    "change,named",
    [
        ({"n_heads": 3}, "n_heads=3"),
        ({"n_kv_heads": 3}, "n_kv_heads=3"),
        ({"n_kv_heads": 0}, "n_kv_heads=0"),
        ({"dim": 260, "n_heads": 4}, "even head_dim"),
        ({"n_experts": 4, "top_k": 8, "expert_hidden": 64}, "top_k <= n_experts"),
        ({"n_experts": 4, "top_k": 2}, "expert_hidden=0"),
        ({"decode_kernel": "no"}, "decode_kernel='no'"),
    ],
)
def test_bad_configs_and_inputs_are_typed_errors(change, named):
    with pytest.raises(qshard.ConfigError, match=named):
        dataclasses.replace(LlamaConfig.tiny(), **change)


def test_forwards_that_do_not_fit_the_caches_are_typed_errors():
    model = Llama(LlamaConfig.tiny()).eval()
    prompt = torch.randint(0, 512, (2, 6))
    with pytest.raises(qshard.ConfigError, match="setup_caches"):
        model(prompt, torch.arange(6))
    model.setup_caches(batch=2, max_seq=8)
    with pytest.raises(qshard.errors.InputMismatchError, match="max_seq >= 9"):
        generate(model, prompt, new_tokens=3)
    with pytest.raises(qshard.errors.InputMismatchError, match="caches of 2 sequences"):
        model(prompt[:1], torch.arange(6))


@pytest.mark.parametrize(
    "config", [c for _, c in LAYOUT_CASES][::2], ids=lambda c: type(c).__name__
)
@torch.no_grad()
def test_every_layout_decodes_and_the_step_compiles(config):
    model = tiny()
    prompt = torch.randint(0, 512, (2, 6))
    float_logits = model(prompt, torch.arange(6))
    model = tiny()
    qshard.quantize_(model, config, exclude=["output"])
    logits = model(prompt, torch.arange(6))
    measured = qshard.sqnr_db(float_logits, logits)
    floor = LOGITS_MIN_SQNR_DB[type(config).__name__]
    assert measured >= floor, f"logits SQNR {measured:.1f} dB < {floor}"
    eager = generate(model, prompt, new_tokens=4)
    model.setup_caches(batch=2, max_seq=32)
    step = torch.compile(decode_one_token, fullgraph=True)
    compiled = generate(model, prompt, new_tokens=4, step=step)
    assert torch.equal(compiled, eager)
    # Frozen (the weights constants of the graph: how bench_decode.py compiles the step at TP 1,
    # since otherwise each call unwraps every quantized weight in Python).
    torch._dynamo.reset()
    with torch._inductor.config.patch(freezing=True):
        frozen = generate(model, prompt, new_tokens=4, step=torch.compile(decode_one_token))
    assert torch.equal(frozen, eager)


def _tp_worker(rank, world, mesh):
    with torch.no_grad():
        expected_model = tiny()
        qshard.quantize_(
            expected_model, qshard.Int4WeightOnlyConfig(group_size=64), exclude=["output"]
        )
        prompt = torch.randint(0, 512, (2, 6))
        expected = expected_model(prompt, torch.arange(6))
        model = tiny()
        qshard.quantize_(model, qshard.Int4WeightOnlyConfig(group_size=64), exclude=["output"])
        qshard.tp.parallelize(model, mesh, TP_PLAN)
        model.setup_caches(batch=2, max_seq=32, tp_world=world)
        # q, k, v fused: (4 query + 2 key + 2 value heads) x 64 rows, whole KV groups per rank.
        local = model.layers[0].attention.wqkv.weight.to_local()
        assert local.shape == (512 // world, 256)
        logits = model(prompt, torch.arange(6))
        torch.testing.assert_close(logits, expected, rtol=1e-4, atol=1e-4)


def test_the_tp_plan_shards_the_model_with_the_single_device_logits():
    spawn(_tp_worker, 2)


@torch.no_grad()
def test_the_fused_projections_are_the_separate_ones_reordered():
    """wqkv's rows go KV group by KV group ([q heads of g, k_g, v_g]) and w13's alternate
    128-row gate and up units: each output equals separate q, k, v, gate and up projections
    with their rows taken from those places."""
    model = tiny()
    c, attention, ffn = model.config, model.layers[0].attention, model.layers[0].feed_forward
    x = torch.randn(3, c.dim)
    rep, hd = c.n_heads // c.n_kv_heads, c.head_dim
    groups = attention.wqkv.weight.view(c.n_kv_heads, rep + 2, hd, c.dim)
    wq, wk, wv = groups[:, :rep].reshape(-1, c.dim), groups[:, rep], groups[:, rep + 1]
    out = attention.wqkv(x).view(3, c.n_kv_heads, rep + 2, hd)
    torch.testing.assert_close(out[:, :, :rep].reshape(3, -1), x @ wq.t())
    torch.testing.assert_close(out[:, :, rep], (x @ wk.reshape(-1, c.dim).t()).view(3, -1, hd))
    torch.testing.assert_close(out[:, :, rep + 1], (x @ wv.reshape(-1, c.dim).t()).view(3, -1, hd))
    units = ffn.w13.weight.view(-1, 2, ffn.UNIT, c.dim)
    gate, up = units[:, 0].reshape(c.hidden, c.dim), units[:, 1].reshape(c.hidden, c.dim)
    expected = torch.nn.functional.silu(x @ gate.t()) * (x @ up.t())
    torch.testing.assert_close(ffn(x[None])[0], expected @ ffn.w2.weight.t())


def test_a_tp_size_that_would_split_a_kv_group_is_refused():
    model = tiny()  # 2 KV heads, 6 gate/up units
    with pytest.raises(qshard.ConfigError, match=r"use a TP size in \[1, 2\]"):
        model.setup_caches(batch=1, max_seq=8, tp_world=4)
    with pytest.raises(qshard.ConfigError, match="multiple of the gate/up unit"):
        Llama(dataclasses.replace(LlamaConfig.tiny(), hidden=200))


def _to_local_worker(rank, world, mesh):
    with torch.no_grad():
        model = tiny()
        qshard.quantize_(model, qshard.Int4WeightOnlyConfig(group_size=64), exclude=["output"])
        qshard.tp.parallelize(model, mesh, TP_PLAN)
        model.setup_caches(batch=2, max_seq=32, tp_world=world)
        prompt = torch.randint(0, 512, (2, 6), generator=torch.Generator().manual_seed(0))
        sharded_logits = model(prompt, torch.arange(6))
        sharded_tokens = generate(model, prompt, new_tokens=4)
        qshard.tp.to_local(model)
        wqkv, wo = model.layers[0].attention.wqkv, model.layers[0].attention.wo
        assert isinstance(wqkv, qshard.tp.LocalLinear) and wqkv.reduce_group is None
        assert isinstance(wo, qshard.tp.LocalLinear) and wo.reduce_group is not None
        assert isinstance(wo.weight, qshard.Int4Tensor) and wo.weight.shape == (256, 256 // world)
        # The same local products and the same all-reduce as the DTensor model.
        torch.testing.assert_close(model(prompt, torch.arange(6)), sharded_logits, rtol=0, atol=0)
        assert torch.equal(generate(model, prompt, new_tokens=4), sharded_tokens)
        # What to_local is for: the compiled step freezes (over DTensor weights it cannot).
        torch._dynamo.reset()
        with torch._inductor.config.patch(freezing=True):
            step = torch.compile(decode_one_token, fullgraph=True)
            frozen = generate(model, prompt, new_tokens=4, step=step)
        assert torch.equal(frozen, sharded_tokens)


def test_to_local_runs_a_tp_model_on_plain_shards_and_its_step_freezes():
    spawn(_to_local_worker, 2)


def _to_local_refusal_worker(rank, world, mesh):
    from torch.distributed.tensor.parallel import ColwiseParallel

    model = torch.nn.Sequential(torch.nn.Embedding(8, 4), torch.nn.Linear(4, 4))
    qshard.tp.parallelize(model, mesh, {"0": ColwiseParallel(), "1": "colwise"})
    before = model[1]
    with pytest.raises(qshard.ConfigError, match=r"'0.weight' is a DTensor outside"):
        qshard.tp.to_local(model)
    assert model[1] is before  # checked first: nothing was swapped
    # A style with other layouts than LocalLinear computes (here a gathered output): refused.
    from torch.distributed.tensor import Replicate

    model = torch.nn.Sequential(torch.nn.Linear(4, 6))
    qshard.tp.parallelize(model, mesh, {"0": ColwiseParallel(output_layouts=Replicate())})
    with pytest.raises(qshard.ConfigError, match=r"'0': its style has input / output layouts"):
        qshard.tp.to_local(model)
    # One linear under two names: swapped under both.
    shared = torch.nn.Linear(4, 6)
    model = torch.nn.Module()
    model.a, model.b = shared, shared
    qshard.tp.parallelize(model, mesh, {"a": "colwise"})
    qshard.tp.to_local(model)
    assert isinstance(model.a, qshard.tp.LocalLinear) and model.b is model.a
    # A sharded linear that is the whole model: the LocalLinear is returned.
    linear = torch.nn.Linear(4, 6)
    x = torch.randn(3, 4)
    expected = linear(x)
    qshard.tp.parallelize(linear, mesh, "colwise")
    local = qshard.tp.to_local(linear)
    assert isinstance(local, qshard.tp.LocalLinear) and local.weight.shape == (3, 4)
    torch.testing.assert_close(local(x), expected.chunk(world, -1)[rank])


def test_to_local_refuses_a_dtensor_outside_a_linear_and_changes_nothing():
    spawn(_to_local_refusal_worker, 2)


MOE = LlamaConfig(
    vocab_size=256,
    dim=128,
    n_layers=2,
    n_heads=4,
    n_kv_heads=2,
    hidden=256,
    n_experts=8,
    top_k=2,
    expert_hidden=64,
)
# The sharded MoE model's logits against one process's: the experts' outputs are summed over
# the ranks (and, cut by ExpertTensorParallel, their down projection's K halves) in another
# fp32 order than one device's, then pass the next layers (measured: below 1e-6).
MOE_TOLERANCE = {"rtol": 1e-4, "atol": 1e-4}


def _moe_worker(rank, world, mesh):
    from qshard.models import EP_PLAN

    plans = {
        "ep": EP_PLAN,
        "etp": {**EP_PLAN, "layers.*.feed_forward.experts": "expert_tensor_parallel"},
        # each rank sends its (here: the same) tokens' routes; a rank may receive none
        "ep-all-to-all": {
            **EP_PLAN,
            "layers.*.feed_forward.experts": qshard.tp.ExpertParallel(dispatch="all_to_all"),
        },
    }
    prompt = torch.randint(0, 256, (2, 6), generator=torch.Generator().manual_seed(0))
    for config in (
        qshard.Int4WeightOnlyConfig(group_size=32),
        qshard.Fp8BlockwiseConfig(block_size=(32, 32)),
    ):
        for style, plan in plans.items():
            if style == "ep-all-to-all" and isinstance(config, qshard.Fp8BlockwiseConfig):
                continue  # one layout is enough for the dispatch (CI's time)
            torch.manual_seed(0)
            expected_model = Llama(MOE).eval()
            qshard.quantize_(expected_model, config, exclude=["output"])
            model = Llama(MOE).eval()
            model.load_state_dict(expected_model.state_dict(), assign=True)
            expected_model.setup_caches(batch=2, max_seq=32)
            qshard.tp.parallelize(model, mesh, plan)
            model.setup_caches(batch=2, max_seq=32, tp_world=world)
            experts = model.layers[0].feed_forward.experts
            assert experts.num_experts == (8 if style == "etp" else 8 // world)
            where = (type(config).__name__, style)
            with torch.no_grad():
                expected = expected_model(prompt, torch.arange(6))
                got = model(prompt, torch.arange(6))
                torch.testing.assert_close(got, expected, **MOE_TOLERANCE, msg=str(where))
                tokens = generate(model, prompt, new_tokens=3)
                # as bench_decode.py runs it: plain local shards, the step compiled and frozen
                qshard.tp.to_local(model)
                torch._dynamo.reset()
                with torch._inductor.config.patch(freezing=True):
                    step = torch.compile(decode_one_token, fullgraph=True)
                    frozen = generate(model, prompt, new_tokens=3, step=step)
            assert torch.equal(frozen, tokens), where


def test_the_moe_model_takes_expert_parallel_and_expert_tensor_parallel():
    """qshard.models' MoE Llama (bench_decode.py's Qwen3-30B-A3B-shaped model) under EP_PLAN:
    TP attention, experts whole per rank (or cut by ExpertTensorParallel), against one process,
    then made local and decoded by the frozen compiled step."""
    spawn(_moe_worker, 2)

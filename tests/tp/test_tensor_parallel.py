"""Tensor parallelism on CPU with gloo, world sizes 2 and 4, started by pytest itself.

Every check runs over every registered layout (the contract configs). Each test spawns one group
of processes; the worker functions live at module level so that spawn can import them.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import itertools
import multiprocessing
import os
import signal
import tempfile
import time

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from helpers import LAYOUT_CASES, assert_same_qtensor, gaussian
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

import qshard
import qshard.tp
from qshard import QShardError
from qshard.config import Backend

WORLD_SIZES = [2, 4]
# Row-parallel partial sums are added in another order than one device's K loop: fp32 rounding.
ROW_PARALLEL_TOLERANCE = {"rtol": 1e-5, "atol": 1e-6}


SPAWN_DEADLINE_S = 300  # a hung collective fails the test instead of stalling CI
# Each rank's own deadline comes first: it prints the rank's stacks (where it waits) and exits.
RANK_DEADLINE_MARGIN_S = 20
COLLECTIVE_TIMEOUT_S = 120  # a collective whose peer never comes raises after this


def spawn(
    worker, world: int, *args, backend: str = "gloo", deadline_s: float = SPAWN_DEADLINE_S
) -> None:
    """Run worker(rank, world, mesh, *args) on `world` processes (gloo on CPU, nccl on GPUs).

    A Python exception in any rank fails the test. A rank that dies by a signal or an exit code
    fails it too, unless every rank had already passed all its checks and the closing barrier:
    gloo occasionally aborts a process while tearing the group down (seen 2 times in about 20
    runs of this suite on the 2-core CI machine, torch 2.13), after the test has nothing left
    to check. No run hangs: each rank prints its Python stacks and exits at its deadline
    (`qshard.tp.deadline`), and past the test's own every rank is asked for its stacks
    (SIGUSR1) before it is killed.
    """
    with tempfile.TemporaryDirectory() as tmp:
        init = f"file://{tmp}/rendezvous"
        context = torch.multiprocessing.start_processes(
            _entry,
            args=(world, init, backend, tmp, worker, args, deadline_s - RANK_DEADLINE_MARGIN_S),
            nprocs=world,
            join=False,
            start_method=_start_method(backend),
        )
        deadline = time.monotonic() + deadline_s
        try:
            while not context.join(timeout=5):
                if time.monotonic() > deadline:
                    _dump_and_kill(context.processes)
                    pytest.fail(f"{worker.__name__} on {world} ranks ran past {deadline_s} s")
        except torch.multiprocessing.ProcessExitedException:
            passed = [os.path.exists(f"{tmp}/passed.{rank}") for rank in range(world)]
            if not all(passed):
                _dump_and_kill(context.processes)  # the ranks still waiting on the dead one
                raise
            for process in context.processes:
                process.kill()


# The modules every rank imports, loaded once by the fork server that starts the ranks (a
# rank forked from it starts in well under a second; a spawned one imports torch again).
PRELOADED = [
    "torch",
    "torch.distributed.tensor",
    "torch._dynamo",
    "qshard",
    "qshard.tp",
    "transformers",
    "helpers",
    "test_tensor_parallel",
]


def _start_method(backend: str) -> str:
    if backend == "nccl":
        return "spawn"  # a CUDA context cannot cross a fork
    multiprocessing.set_forkserver_preload(PRELOADED)
    return "forkserver"


def _dump_and_kill(processes) -> None:
    for process in processes:
        if process.is_alive():
            os.kill(process.pid, signal.SIGUSR1)  # qshard.tp.deadline: print the stacks
    time.sleep(2)
    for process in processes:
        process.kill()


def _entry(
    rank: int, world: int, init: str, backend: str, tmp: str, worker, args, rank_deadline_s: float
) -> None:
    device_type = "cuda" if backend == "nccl" else "cpu"
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))  # ranks share the cores
    if device_type == "cuda":
        torch.cuda.set_device(rank)
    with qshard.tp.deadline(rank_deadline_s):
        qshard.tp.init_process_group(
            backend, init_method=init, rank=rank, world_size=world, timeout_s=COLLECTIVE_TIMEOUT_S
        )
        torch.manual_seed(1234)  # every rank builds the same float weights and inputs
        worker(rank, world, init_device_mesh(device_type, (world,)), *args)
        dist.barrier()  # no rank tears down while another still has a collective in flight
        open(f"{tmp}/passed.{rank}", "w").close()
        # Only after success: a failed rank exits at once (its peers are killed by spawn)
        # instead of waiting at shutdown's barrier for a rank that will not come.
        qshard.tp.shutdown()


class Block(nn.Module):
    """A Llama-style block: attention (fused qkv, o) and a SwiGLU MLP (fused gate_up, down).

    Fused outputs are ordered so that any row chunk holds whole units: qkv head by head
    ([q_h, k_h, v_h] for each head h) and gate_up in `unit`-wide pairs ([gate_i, up_i]); the
    forward only reshapes by those units, so the same code runs on a rank's shard.
    """

    def __init__(self, dim=256, heads=4, head_dim=64, hidden=768, unit=64, bias=False):
        super().__init__()
        self.head_dim, self.unit = head_dim, unit
        self.qkv = nn.Linear(dim, 3 * heads * head_dim, bias=bias)
        self.o = nn.Linear(heads * head_dim, dim, bias=bias)
        self.gate_up = nn.Linear(dim, 2 * hidden, bias=bias)
        self.down = nn.Linear(hidden, dim, bias=bias)
        for p in self.parameters():
            nn.init.normal_(p, std=0.02)

    def forward(self, x):
        b, s, _ = x.shape
        qkv = self.qkv(x).view(b, s, -1, 3, self.head_dim)
        q, k, v = (t.transpose(1, 2) for t in qkv.unbind(3))
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.o(attn.transpose(1, 2).reshape(b, s, -1))
        gate, up = self.gate_up(x).view(b, s, -1, 2, self.unit).unbind(3)
        return x + self.down((F.silu(gate) * up).reshape(b, s, -1))


BLOCK_PLAN = {"qkv": "colwise", "o": "rowwise", "gate_up": "colwise", "down": "rowwise"}


def _quantized(module: nn.Module, config) -> nn.Module:
    qshard.quantize_(module, config)
    return module


def _two_quantized_copies(module: nn.Module, config) -> tuple[nn.Module, nn.Module]:
    return _quantized(copy.deepcopy(module), config), _quantized(copy.deepcopy(module), config)


def _realigned_like(reference: nn.Module, sharded: nn.Module, world: int) -> None:
    """Give the single-device reference the packing each TP shard got (FP8 re-blocking of a
    cut block), so that both compute with the same blocks and activation groups."""
    for name, module in reference.named_modules():
        weight = getattr(module, "weight", None)
        if isinstance(weight, qshard.QTensor):
            local = sharded.get_submodule(name).weight.to_local()
            dim = 0 if sharded.get_submodule(name).weight.placements[0] == Shard(0) else 1
            cuts = qshard.tp.shard_cuts(weight.shape[dim], world)
            realigned = weight.realign(dim, cuts)
            assert realigned.attr_values() == local.attr_values()
            module.weight = nn.Parameter(realigned.clone(), requires_grad=False)
            if dim == 1 and weight.activation_scale_spans_k():
                module.forward = functools.partial(
                    lambda m, x: _k_parts_linear(x, m.weight, m.bias, world), module
                )


def _assert_shards_hold_the_whole_weights(
    whole: nn.Module, sharded: nn.Module, rank: int, world: int
) -> None:
    """Each rank's quantized shard dequantizes to exactly its rows (column-parallel) or columns
    (row-parallel) of the whole quantized weight's float64 dequantization, sliced as torch.chunk
    slices: a reference independent of `realign` (the path under test re-blocks cut blocks)."""
    for name in BLOCK_PLAN:
        weight = sharded.get_submodule(name).weight
        dim = 0 if weight.placements[0] == Shard(0) else 1
        expected = whole.get_submodule(name).weight.dequantize(torch.float64)
        expected = expected.chunk(world, dim)[rank]
        got = weight.to_local().dequantize(torch.float64)
        assert torch.equal(got, expected), f"{name}: rank {rank}'s shard != its part of the whole"


# ---- column- and row-parallel linears ------------------------------------------------------


def _column_parallel_worker(rank, world, mesh):
    # Bit for bit under the reference (docs/design.md invariant 6: its sums are exact, whatever the
    # shard's width); `auto` on CPU is dequantize-then-BLAS, whose sums follow the BLAS's
    # blocking of each call's width, so there the shards agree up to summation order.
    for cls, config in LAYOUT_CASES:
        auto = config.backend is Backend.AUTO
        for backend in (Backend.REFERENCE, Backend.AUTO) if auto else (config.backend,):
            config = dataclasses.replace(config, backend=backend)
            linear = _quantized(nn.Linear(320, 4 * 192, bias=True), config)
            x = torch.randn(5, 320)
            expected = linear(x)
            qshard.tp.parallelize(linear, mesh, ColwiseParallel(use_local_output=False))
            assert isinstance(linear.weight, DTensor) and isinstance(linear.weight.to_local(), cls)
            out = linear(x)
            assert out.placements == (Shard(1),)
            gathered = out.full_tensor()
            if backend is not Backend.AUTO:
                assert torch.equal(gathered, expected), f"{cls.__name__} {config}: colwise differs"
            else:
                torch.testing.assert_close(gathered, expected, **ROW_PARALLEL_TOLERANCE)


def _k_parts_linear(x, weight, bias, world):
    """x @ W.T + bias as a row-parallel layer computes it where the activation quantization
    spans K (`activation_scale_spans_k`): each rank's part of K by itself, then summed."""
    cuts = [0, *qshard.tp.shard_cuts(weight.shape[1], world), weight.shape[1]]
    parts = [F.linear(x[..., a:b], weight[:, a:b]) for a, b in itertools.pairwise(cuts)]
    return torch.stack(parts).sum(0) + (bias if bias is not None else 0)


def _row_parallel_worker(rank, world, mesh):
    for _, config in LAYOUT_CASES:
        linear = _quantized(nn.Linear(world * 256, 96, bias=True), config)
        x = torch.randn(5, world * 256)
        expected = linear(x)
        if linear.weight.activation_scale_spans_k():
            expected = _k_parts_linear(x, linear.weight, linear.bias, world)
        qshard.tp.parallelize(linear, mesh, RowwiseParallel(input_layouts=Shard(-1)))
        local_x = x.chunk(world, -1)[rank]
        torch.testing.assert_close(linear(local_x), expected, **ROW_PARALLEL_TOLERANCE)


@pytest.mark.parametrize("world", WORLD_SIZES)
def test_column_parallel_gathers_to_the_single_device_output(world):
    spawn(_column_parallel_worker, world)


@pytest.mark.parametrize("world", WORLD_SIZES)
def test_row_parallel_equals_single_device_up_to_summation_order(world):
    spawn(_row_parallel_worker, world)


def _native_order_worker(rank, world, mesh):
    """int4 weights holding the native code order (their form on Hopper, forced here): sharded
    column- and row-wise they equal the single device, and rank parts in the native order
    gather to the canonical weight (what qshard.save writes)."""
    from qshard.tp.gather import full_tensor

    bf16 = {"rtol": 1e-2, "atol": 1e-2}  # the CPU BLAS's bf16 sums of another width
    styles = (
        (ColwiseParallel(use_local_output=False), 0),
        (RowwiseParallel(input_layouts=Shard(-1)), 1),
    )
    for style, dim in styles:
        linear = nn.Linear(world * 256, world * 96, bias=True, dtype=torch.bfloat16)
        _quantized(linear, qshard.Int4WeightOnlyConfig())
        canonical = linear.weight
        linear.weight = nn.Parameter(canonical.with_code_order("native"), requires_grad=False)
        x = torch.randn(5, world * 256, dtype=torch.bfloat16)
        expected = linear(x)
        qshard.tp.parallelize(linear, mesh, style)
        if dim == 0:
            torch.testing.assert_close(linear(x).full_tensor(), expected, **bf16)
        else:
            torch.testing.assert_close(linear(x.chunk(world, -1)[rank]), expected, **bf16)
        local = linear.weight.to_local().with_code_order("native")
        native = DTensor.from_local(local, mesh, linear.weight.placements, run_check=False)
        assert_same_qtensor(full_tensor(native), canonical)


@pytest.mark.parametrize("world", [2])
def test_native_int4_codes_shard_and_gather_as_canonical_ones(world):
    spawn(_native_order_worker, world)


# ---- a Llama-style block, aligned and cut through blocks (DeepSeek-like) ----------------------


def _block_worker(rank, world, mesh, dims):
    for cls, config in LAYOUT_CASES:
        torch.manual_seed(7)
        reference, sharded = _two_quantized_copies(Block(**dims), config)
        x = torch.randn(2, 9, dims.get("dim", 256))
        with torch.no_grad():
            qshard.tp.parallelize(sharded, mesh, BLOCK_PLAN)
            _assert_shards_hold_the_whole_weights(reference, sharded, rank, world)
            _realigned_like(reference, sharded, world)
            expected, out = reference(x), sharded(x)
        for name in BLOCK_PLAN:
            assert isinstance(sharded.get_submodule(name).weight.to_local(), cls)
        torch.testing.assert_close(out, expected, **ROW_PARALLEL_TOLERANCE)


@pytest.mark.parametrize("world", WORLD_SIZES)
def test_llama_block_in_tp_equals_single_device(world):
    spawn(_block_worker, world, {})


DEEPSEEK_LIKE_SQNR_DB = 26  # measured 28.7 dB (seed 11), see _deepseek_like_worker


def _deepseek_like_worker(rank, world, mesh):
    """A DeepSeek-V3-like cut inside FP8 blocks, scaled down (docs/checkpoints.md): an
    intermediate of 4 x 576 rows, cut into 576-wide TP-4 shards (4.5 x 128), re-blocks to 64;
    the row-parallel layer gets 1x64 activation groups."""
    config = qshard.Fp8BlockwiseConfig()
    torch.manual_seed(11)
    dims = {"dim": 256, "heads": 4, "head_dim": 64, "hidden": 4 * 576, "unit": 64}
    unquantized = Block(**dims)
    reference, sharded = _two_quantized_copies(unquantized, config)
    x = torch.randn(2, 5, 256)
    with torch.no_grad():
        qshard.tp.parallelize(sharded, mesh, BLOCK_PLAN)
        down = sharded.down.weight.to_local()
        assert down.block_size == (128, 64) and down.act_group_size == 64
        assert sharded.gate_up.weight.to_local().block_size == (128, 128)  # 1152 = 9 x 128
        _assert_shards_hold_the_whole_weights(reference, sharded, rank, world)
        whole_out = reference(x)
        _realigned_like(reference, sharded, world)
        torch.testing.assert_close(sharded(x), reference(x), **ROW_PARALLEL_TOLERANCE)
        # Against the float block: the re-blocked weights are the whole ones' values, and only
        # down's finer activation groups (1x64) change the output, so it stays as close as the
        # unsharded quantized block's (both measured 28.7 dB; re-blocked K scales tiled instead
        # of interleaved measured 19.6).
        float_out = unquantized(x)
        assert qshard.sqnr_db(float_out, whole_out) > DEEPSEEK_LIKE_SQNR_DB
        assert qshard.sqnr_db(float_out, sharded(x)) > DEEPSEEK_LIKE_SQNR_DB


def test_deepseek_like_uneven_blocks_reblock_exactly():
    spawn(_deepseek_like_worker, 4)


# ---- both orders: shard then quantize equals quantize then shard ---------------------------


# Every shard boundary at TP 2 and 4 falls on every contract config's blocks: qkv 1536 rows,
# o 512 columns, gate_up 2048 rows, down 1024 columns.
ALIGNED_DIMS = {"dim": 256, "heads": 4, "head_dim": 128, "hidden": 1024, "unit": 64}


def _both_orders_worker(rank, world, mesh):
    for _, config in LAYOUT_CASES:
        torch.manual_seed(3)
        first = Block(**ALIGNED_DIMS)
        second = copy.deepcopy(first)
        qshard.quantize_(first, config)
        qshard.tp.parallelize(first, mesh, BLOCK_PLAN)
        qshard.tp.parallelize(second, mesh, BLOCK_PLAN)
        report = qshard.quantize_(second, config)
        assert len(report.quantized) == 4 and not report.skipped
        for name in BLOCK_PLAN:
            a, b = first.get_submodule(name).weight, second.get_submodule(name).weight
            assert isinstance(b, DTensor) and a.placements == b.placements
            assert_same_qtensor(a.to_local(), b.to_local())


@pytest.mark.parametrize("world", WORLD_SIZES)
def test_shard_then_quantize_equals_quantize_then_shard(world):
    spawn(_both_orders_worker, world)


# ---- torch.compile -----------------------------------------------------------------------


def _compile_worker(rank, world, mesh):
    from torch._dynamo.testing import CompileCounterWithBackend

    for cls in sorted({c for c, _ in LAYOUT_CASES}, key=lambda c: c.__name__):
        torch._dynamo.reset()
        block = _quantized(Block(), cls.contract_configs()[0])
        counter = CompileCounterWithBackend("inductor")
        with torch.no_grad():
            qshard.tp.parallelize(block, mesh, BLOCK_PLAN)
            compiled = torch.compile(block, backend=counter, fullgraph=True)
            for seq in (9, 13):
                x = torch.randn(2, seq, 256)
                torch._dynamo.mark_dynamic(x, 1)
                measured = qshard.sqnr_db(block(x), compiled(x))
                assert measured > 60, f"{cls.__name__} seq {seq}: {measured:.1f} dB vs eager"
        assert counter.frame_count == 1, f"{cls.__name__}: {counter.frame_count} compiles"


@pytest.mark.slow
def test_compile_fullgraph_of_a_tp_block():
    """Attention + MLP with quantized DTensor weights: one graph, no break, same numbers."""
    spawn(_compile_worker, 2)


# ---- errors ----------------------------------------------------------------------------------


def _errors_worker(rank, world, mesh):
    # qkv has 288 rows and o 96 columns: TP-4 cuts them at multiples of 72 and 24, on no
    # block of 16 or more; TP 2, 3 and 6 cut at multiples of 16 (re-blocking exactly).
    model = _quantized(
        Block(dim=256, heads=2, head_dim=48, hidden=768), qshard.Fp8BlockwiseConfig()
    )
    before = dict(model.named_parameters())
    with pytest.raises(QShardError) as info:
        qshard.tp.parallelize(model, mesh, BLOCK_PLAN)
    message = str(info.value)
    assert "'qkv'" in message and "'o'" in message and "'down'" not in message
    assert "sizes that work for this model: [1, 2, 3, 6]" in message
    for key, value in model.named_parameters():  # nothing changed
        assert value is before[key] and not isinstance(value, DTensor)
    with pytest.raises(QShardError, match="matches no module"):
        qshard.tp.parallelize(model, mesh, {"mlp.*": "colwise"})
    with pytest.raises(QShardError, match="'colwise', 'rowwise'"):
        qshard.tp.parallelize(model, mesh, {"qkv": "columnwise"})


def test_plan_errors_name_the_module_and_working_sizes():
    spawn(_errors_worker, 4)


def test_chunk_bounds_follow_torch_chunk():
    for size in (0, 1, 5, 100, 576, 4 * 576):
        for world in (1, 2, 3, 4, 8):
            pieces = torch.arange(size).chunk(world) if size else ()
            bounds = [qshard.tp.chunk_bounds(size, world, r) for r in range(world)]
            lengths = [e - s for s, e in bounds if e > s]
            assert lengths == [len(p) for p in pieces], (size, world)
    assert qshard.tp.shard_cuts(18432, 32)[:2] == [576, 1152]
    assert gaussian(2, 2).shape == (2, 2)


# ---- uneven shards, bf16, pass-through styles, and ranks that must agree --------------------


def _uneven_and_bf16_worker(rank, world, mesh):
    """Column-wise rows 254 -> shards 64, 64, 64, 62 at TP 4 (223 -> 112, 111 at TP 2), feeding
    a row-wise layer with the same uneven split; bf16 activations."""
    for _, config in LAYOUT_CASES:
        torch.manual_seed(5)
        hidden = 254 if world == 4 else 223
        mlp = nn.Sequential(nn.Linear(256, hidden), nn.SiLU(), nn.Linear(hidden, 256))
        reference, sharded = _two_quantized_copies(mlp.to(torch.bfloat16), config)
        x = torch.randn(3, 7, 256, dtype=torch.bfloat16)
        if world == 2 and config.backend is qshard.Backend.TINYGEMM:
            # The 112-column cut needs groups of 16, which tinygemm lacks: refused up front.
            with pytest.raises(QShardError, match="tinygemm"):
                qshard.tp.parallelize(sharded, mesh, {"0": "colwise", "2": "rowwise"})
            assert not isinstance(sharded[0].weight, DTensor)
            continue
        with torch.no_grad():
            qshard.tp.parallelize(sharded, mesh, {"0": "colwise", "2": "rowwise"})
            _realigned_like(reference, sharded, world)
            out, expected = sharded(x), reference(x)
        assert out.dtype == torch.bfloat16
        # bf16 output: one bf16 rounding of sums taken in another order
        torch.testing.assert_close(out, expected, rtol=1.6e-2, atol=1e-2)


@pytest.mark.parametrize("world", WORLD_SIZES)
def test_uneven_shards_and_bf16(world):
    spawn(_uneven_and_bf16_worker, world)


def _pass_through_and_twice_worker(rank, world, mesh):
    from torch.distributed.tensor.parallel import PrepareModuleInput

    model = _quantized(Block(), qshard.Fp8BlockwiseConfig())
    plan = {
        "": PrepareModuleInput(
            input_layouts=Replicate(), desired_input_layouts=Replicate(), use_local_output=True
        ),
        **BLOCK_PLAN,
    }
    x = torch.randn(2, 5, 256)
    with torch.no_grad():
        expected = copy.deepcopy(model)(x)
        qshard.tp.parallelize(model, mesh, plan)
        torch.testing.assert_close(model(x), expected, **ROW_PARALLEL_TOLERANCE)
    with pytest.raises(QShardError, match="already sharded"):
        qshard.tp.parallelize(model, mesh, {"qkv": "colwise"})


def test_hook_only_styles_pass_through_and_a_second_parallelize_is_refused():
    spawn(_pass_through_and_twice_worker, 2)


def _ranks_agree_worker(rank, world, mesh):
    """Shard, then quantize with a NaN in rank 1's shard only: every rank raises, none changes."""
    model = nn.Sequential(nn.Linear(256, 512), nn.Linear(512, 256))
    with torch.no_grad():
        model[0].weight[300, 7] = float("nan")  # row 300 lies in rank 1's half
    qshard.tp.parallelize(model, mesh, {"0": "colwise", "1": "rowwise"})
    with pytest.raises(QShardError) as info:
        qshard.quantize_(model, qshard.Fp8BlockwiseConfig())
    if rank == 1:
        assert "shard [256, 256] of the [512, 256] weight" in str(info.value)
    else:
        assert "another rank failed" in str(info.value)
    assert not any(isinstance(p.to_local(), qshard.QTensor) for p in model.parameters())


def test_shard_then_quantize_ranks_agree_on_failure():
    spawn(_ranks_agree_worker, 2)

"""Expert and tensor parallelism of quantized experts over NCCL, at each world size of
`helpers.nccl_worlds()` (2, 4 and 8 as the machine's GPUs allow; skipped without them). The same
worker runs on gloo in CI (test_the_nccl_worker_on_gloo), so that what the GPU run checks is
itself checked on every commit.

Every layout, ExpertParallel (both dispatches), ExpertTensorParallel and, from 4 ranks, EP x TP
(`ExpertParallel(tensor_parallel=2)`: a 2-D mesh of world / 2 expert groups of 2), in bf16
through the GPU kernels: the sharded experts and the whole model against one device's (SQNR:
the grouped kernels' bf16 rounding differs with the rows a launch holds), compiled with
fullgraph and frozen after `qshard.tp.to_local`; then a per-rank EP load of a saved
checkpoint, which reads only each rank's experts (bytes read per rank printed).
"""

from __future__ import annotations

import copy

import moe_models
import pytest
import torch
from helpers import nccl_worlds
from test_experts_parallel import (
    EXPERTS,
    MODELS,
    experts_of,
    qwen3_moe,
    realigned_reference,
    routing,
)
from test_tensor_parallel import spawn

import qshard
import qshard.tp
from qshard.tp import ExpertParallel, ExpertTensorParallel

CONFIGS = {
    "fp8-block": qshard.Fp8BlockwiseConfig(block_size=(32, 32)),
    "int4": qshard.Int4WeightOnlyConfig(group_size=32),
    "mxfp4": qshard.MXFP4WeightOnlyConfig(),
    "nvfp4": qshard.NVFP4WeightOnlyConfig(),
    "fp8-row": qshard.Fp8RowwiseConfig(),
}
STYLES = {
    "ep": ExpertParallel,
    "ep-all-to-all": lambda: ExpertParallel(dispatch="all_to_all"),
    "etp": ExpertTensorParallel,
    "ep-x-tp": lambda: ExpertParallel(tensor_parallel=2),  # from 4 ranks
}
# The layouts that quantize activations too (FP8 W8A8).
W8A8 = ("fp8-block", "fp8-row")
# The ranks that cut each expert's intermediate dim, by style.
TENSOR_PARALLEL = {"etp": lambda world: world, "ep-x-tp": lambda world: 2}
# The experts module alone, sharded against one device's, on the same inputs: EP equals it bit
# for bit; ETP's down projection sums bf16 partial outputs, one rounding more (measured
# 46.4-47.6 dB on gloo/CPU and on 2 H200s, bench/repro/experts_parallel_numerics.py).
SQNR_DB = 40
# FP8 per-row under ExpertTensorParallel: the row-parallel down projection quantizes each
# rank's K part of a token with its own per-token scale (as dense row-parallel FP8 per-row
# does), a finer activation quantization than one device's (experts measured 34.5 dB, CPU).
SQNR_DB_PER_SHARD_SCALES = 30
# Whole-model logits under ETP with W8A8 layouts: the experts' last-bit differences move
# activations of the next FP8 linears across rounding boundaries, and the router of layer 1
# then picks another expert for a few (token, slot) routes; each flip changes that token by
# far more than rounding. Measured (same script): FP8 blockwise 35.4 dB with 0 flips on
# gloo/CPU, 24.4 dB with 3 of 56 routes flipped on 2 H200s; FP8 per-row 27.9 dB, 1 flip (CPU).
LOGITS_SQNR_DB_W8A8_ETP = 20
# Compiled W8A8 experts against eager ones: inductor computes silu(gate) * up without eager's
# bf16 rounding in between, and the FP8 quantization of down's input then rounds a few values a
# whole step the other way (measured: FP8 blockwise EP x TP at 4 ranks on gloo, 47.3 dB eager,
# 40.0 dB compiled; FP8 per-row EP at 4 ranks on 4 H200s under 40 dB compiled).
COMPILED_SQNR_DB_W8A8 = 35


def _floors(layout: str, style: str) -> tuple[float, float]:
    """(experts floor, logits floor) in dB."""
    per_shard_scales = layout == "fp8-row" and style in TENSOR_PARALLEL
    experts = SQNR_DB_PER_SHARD_SCALES if per_shard_scales else SQNR_DB
    if style in TENSOR_PARALLEL and layout in W8A8:
        return experts, LOGITS_SQNR_DB_W8A8_ETP
    return experts, min(experts, SQNR_DB)


def intermediate_size(layout: str, world: int) -> int:
    """The experts' intermediate size at `world` ranks: 32 columns of down per rank under
    ExpertTensorParallel (int4 g32 and MXFP4 blocks of 32 stay whole), and for FP8 blockwise 16
    (64 at 2 and 4 ranks), so that from 4 ranks every cut falls inside a 32x32 block and leaves
    re-blocked blocks of 16, the smallest the layout re-blocks to."""
    return max(64, 16 * world) if layout == "fp8-block" else max(64, 32 * world)


def _case(rank, world, mesh, layout: str, style: str) -> None:
    device = mesh.device_type
    model = qwen3_moe(intermediate=intermediate_size(layout, world)).to(device, torch.bfloat16)
    qshard.quantize_(model, CONFIGS[layout])
    model.set_experts_implementation("grouped_mm")
    reference = copy.deepcopy(model)
    if style in TENSOR_PARALLEL:
        realigned_reference(reference, TENSOR_PARALLEL[style](world))
    qshard.tp.parallelize(model, mesh, {EXPERTS: STYLES[style]()})
    where = f"{layout} {style} rank {rank}"
    floor, logits_floor = _floors(layout, style)
    compiled_floor = min(floor, COMPILED_SQNR_DB_W8A8) if layout in W8A8 else floor
    # all_to_all: each rank its own tokens; otherwise the same tokens on every rank
    seed = rank if style == "ep-all-to-all" else 0
    args = [t.to(device) for t in routing(11 + seed, dtype=torch.bfloat16, seed=seed)]
    name, experts = next(iter(experts_of(model).items()))
    with torch.no_grad():
        expected = reference.get_submodule(name)(*args).float()
        sqnr = qshard.sqnr_db(expected, experts(*args).float())
        assert sqnr > floor, (where, sqnr)
        ids = torch.randint(0, moe_models.VOCAB, (2, 7), generator=torch.Generator().manual_seed(3))
        ids = ids.to(device)
        logits = reference(ids).logits.float()
        logits_sqnr = qshard.sqnr_db(logits, model(ids).logits.float())
        print(f"{where}: experts {sqnr:.1f} dB, logits {logits_sqnr:.1f} dB", flush=True)
        assert logits_sqnr > logits_floor, (where, logits_sqnr)
        if style != "ep-all-to-all":  # compiled and frozen (the all-to-all: in its own test)
            torch._dynamo.reset()
            compiled = torch.compile(experts, fullgraph=True)
            sqnr = qshard.sqnr_db(expected, compiled(*args).float())
            assert sqnr > compiled_floor, (where, "compiled", sqnr)
            qshard.tp.to_local(model)
            torch._dynamo.reset()
            with torch._inductor.config.patch(freezing=True):
                frozen = torch.compile(experts, fullgraph=True)(*args)
            sqnr = qshard.sqnr_db(expected, frozen.float())
            assert sqnr > compiled_floor, (where, "frozen", sqnr)


def _bytes_read() -> dict[str, int]:
    """Counts the bytes each kind of checkpoint read returns in this process."""
    from qshard.io.checkpoint import Checkpoint

    counts = {"whole": 0, "slice": 0}
    whole, part = Checkpoint._read_stored, Checkpoint._read_slice

    def read_whole(self, header, stored):
        out = whole(self, header, stored)
        counts["whole"] += out.nbytes
        return out

    def read_slice(self, header, stored, dim, start, end):
        out = part(self, header, stored, dim, start, end)
        counts["slice"] += out.nbytes
        return out

    Checkpoint._read_stored, Checkpoint._read_slice = read_whole, read_slice
    return counts


def _worker(rank, world, mesh, directory, layouts):
    for layout in layouts:
        for style in STYLES:
            if style != "ep-x-tp" or world >= 4:
                _case(rank, world, mesh, layout, style)
    # A per-rank EP load: each rank reads its own experts' bytes (and every other tensor).
    model = MODELS["qwen3_moe"]()
    qshard.quantize_(model, CONFIGS["int4"])
    if rank == 0:
        qshard.save(model, directory)
    torch.distributed.barrier()
    experts_bytes = sum(
        sum(t.nbytes for t in p.inner_tensors().values())
        for n, p in model.named_parameters()
        if ".experts." in n
    )
    counts = _bytes_read()
    loaded = qshard.load(
        directory, MODELS["qwen3_moe"](), mesh=mesh, plan={EXPERTS: ExpertParallel()}
    )
    print(
        f"rank {rank}: EP load read {counts['slice']} bytes of experts by slices (of "
        f"{experts_bytes} in the checkpoint) and {counts['whole']} bytes whole",
        flush=True,
    )
    # The quantized experts (NVFP4 would add 8 bytes of global scales) split in two halves.
    assert counts["slice"] == experts_bytes // world
    assert all(m.num_experts == moe_models.EXPERTS // world for m in experts_of(loaded).values())


@pytest.mark.cuda
@pytest.mark.parametrize("world", nccl_worlds())
def test_experts_parallel_on_gpus_with_nccl(world, tmp_path):
    spawn(_worker, world, tmp_path / "ckpt", list(CONFIGS), backend="nccl", deadline_s=480)


def test_the_nccl_worker_on_gloo(tmp_path):
    """The GPU test's worker on gloo and the CPU's reference paths, at 4 ranks so that every
    style runs (EP x TP on its 2-D mesh, FP8 cut inside its blocks); one layout (CI's time)."""
    spawn(_worker, 4, tmp_path / "ckpt", ["fp8-block"])

"""The decode attention op (`torch.ops.qshard.decode_attention`, kernels/decode_attention.py)
on one GPU: checked against its float32 reference (odd shapes, forced split counts, the first
and last positions, a strided q), then timed beside `F.scaled_dot_product_attention` with the
causal mask row (what `LlamaConfig(decode_kernel=False)` and prefill run) over one KV cache per
layer (32 caches, as a decode step reads them: no cache stays in the L2).

    PYTHONPATH=$PWD python bench/bench_decode_attention.py [--batches 1,32] [--positions 1288]
        [--sweep]   # also the split kernel's block and split counts, Llama-3.1-8B shapes
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
import triton
from harness import time_us, versions_line

from qshard.kernels.decode_attention import decode_attention, decode_attention_reference
from qshard.kernels.decode_attention_triton import MAX_SPLITS, decode_attention_launch, split_plan

MAX_ERROR = 2e-2  # bf16 scores and probabilities in the MMAs, against float32
SHAPES = {"llama-3.1-8b": (32, 8, 128), "llama-3.1-70b": (64, 8, 128)}  # Hq, Hkv, D
LAYERS = 32


def cache(batch: int, hkv: int, positions: int, d: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A layer's (K, V) cache of random bf16 values on the GPU."""
    shape = (batch, hkv, positions, d)
    return tuple(torch.randn(shape, device="cuda", dtype=torch.bfloat16) for _ in range(2))


def check() -> None:
    torch.manual_seed(0)
    cases = [  # b, hq, hkv, positions, d, pos, splits
        (1, 32, 8, 1288, 128, 1087, None),
        (1, 32, 8, 1288, 128, 0, None),
        (1, 32, 8, 1288, 128, 1287, None),
        (32, 32, 8, 1288, 128, 1100, None),
        (3, 64, 8, 777, 128, 500, 5),
        (2, 7, 7, 100, 64, 63, 2),
        (1, 40, 8, 4096, 128, 4095, None),
        (4, 16, 2, 333, 64, 332, 1),
        (1, 32, 8, 32768, 128, 1087, None),  # a long cache, a short sequence
        (1, 16, 4, 700, 256, 650, None),  # head dim 256: 64-position blocks
    ]
    for b, hq, hkv, positions, d, pos, splits in cases:
        q = torch.randn(b, 1, hq, d, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
        k, v = cache(b, hkv, positions, d)
        at = torch.tensor([pos], device="cuda")
        want = decode_attention_reference(q, k, v, at, d**-0.5).float()
        got = decode_attention_launch(q, k, v, at, d**-0.5, splits).float()
        error = (got - want).abs().max().item() / want.abs().max().item()
        assert error < MAX_ERROR, (b, hq, hkv, positions, d, pos, splits, error)
        got = decode_attention(q, k, v, at, d**-0.5).float()
        assert (got - want).abs().max().item() / want.abs().max().item() < MAX_ERROR
    print(f"checked: {len(cases)} cases within {MAX_ERROR} of the float32 reference")


def timings(hq, hkv, d, batch, positions, pos) -> tuple[float, float, int]:
    q = torch.randn(batch, hq, 1, d, device="cuda", dtype=torch.bfloat16)
    caches = [cache(batch, hkv, positions, d) for _ in range(LAYERS)]
    at = torch.tensor([pos], device="cuda")
    mask = (torch.arange(positions, device="cuda") <= pos)[None, None, None]
    scale = d**-0.5

    def op():
        return [decode_attention(q, k, v, at, scale) for k, v in caches]

    def sdpa():
        return [
            F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
            for k, v in caches
        ]

    splits, _ = split_plan(batch * hkv, positions, d, q.device)
    return time_us(op, LAYERS), time_us(sdpa, LAYERS), splits


def sweep(batches, positions: int, filled: int) -> None:
    """The op's time per layer by (positions a block, splits): the filled positions divided
    among the splits in whole blocks (those with some: "with work"); `split_plan`'s marked *."""
    hq, hkv, d = SHAPES["llama-3.1-8b"]
    print("\n| batch | block | splits (with work) | positions a split | us a layer |")
    print("|---|---|---|---|---|")
    for batch in batches:
        q = torch.randn(batch, hq, 1, d, device="cuda", dtype=torch.bfloat16)
        caches = [cache(batch, hkv, positions, d) for _ in range(LAYERS)]
        at = torch.tensor([filled - 1], device="cuda")
        planned = split_plan(batch * hkv, positions, d, q.device)
        for block_n in (32, 64, 128):
            blocks = triton.cdiv(positions, block_n)
            chosen = split_plan(batch * hkv, positions, d, q.device, block_n=block_n)[0]
            counts = {chosen, 1, 2, 4, 8, 16, 32, MAX_SPLITS}
            for splits in sorted(c for c in counts if c <= min(blocks, MAX_SPLITS)):

                def op(block_n=block_n, splits=splits, q=q, at=at, caches=caches):
                    return [
                        decode_attention_launch(q, k, v, at, d**-0.5, splits, block_n)
                        for k, v in caches
                    ]

                per_split = triton.cdiv(triton.cdiv(filled, splits), block_n) * block_n
                working = triton.cdiv(filled, per_split)
                mark = "*" if (splits, block_n) == planned else ""
                print(
                    f"| {batch} | {block_n} | {splits}{mark} ({working}) | {per_split} | "
                    f"{time_us(op, LAYERS):.2f} |",
                    flush=True,
                )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batches", default="1,32")
    parser.add_argument("--positions", type=int, default=1288, help="the cache's length")
    parser.add_argument("--filled", default="1088,1288", help="positions filled (input_pos + 1)")
    parser.add_argument("--sweep", action="store_true")
    args = parser.parse_args()
    print(versions_line([]))
    check()
    print(
        f"\nper layer, us (median of CUDA-graph replays over {LAYERS} caches); TB/s: the "
        "filled positions' K and V bytes over the op's time\n"
    )
    print("| shape | batch | filled / cache | op (splits) | TB/s | SDPA + mask row | speedup |")
    print("|---|---|---|---|---|---|---|")
    for name, (hq, hkv, d) in SHAPES.items():
        for batch in map(int, args.batches.split(",")):
            for filled in map(int, args.filled.split(",")):
                op_us, sdpa_us, splits = timings(hq, hkv, d, batch, args.positions, filled - 1)
                tbs = batch * hkv * filled * d * 2 * 2 / op_us / 1e6
                print(
                    f"| {name} | {batch} | {filled} / {args.positions} | {op_us:.2f} ({splits}) "
                    f"| {tbs:.2f} | {sdpa_us:.2f} | {sdpa_us / op_us:.2f}x |",
                    flush=True,
                )
    if args.sweep:
        filled = int(args.filled.split(",")[0])
        sweep(list(map(int, args.batches.split(","))), args.positions, filled)


if __name__ == "__main__":
    main()

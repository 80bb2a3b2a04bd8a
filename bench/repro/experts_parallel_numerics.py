"""Where a sharded MoE model's logits depart from one device's: per layer and per layout.

    torchrun --nproc-per-node 2 bench/repro/experts_parallel_numerics.py   # NCCL on 2 GPUs

The test model of tests/tp/test_experts_parallel_cuda.py (2 layers, 8 experts of I = 64,
bf16), each layout under ExpertParallel and ExpertTensorParallel. Printed by rank 0, per case:
each layer's experts output SQNR against the (re-blocked) reference on the *reference's own
inputs to that layer* (the kernel and summation-order difference alone), the whole model's
logits SQNR, and how many (token, slot) router choices of layer 1 differ between the two
whole-model runs (a flipped expert changes a token's output by far more than rounding).
"""

from __future__ import annotations

import copy
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.join(HERE, "..", "..")
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests"), os.path.join(ROOT, "tests", "tp")]

import qshard  # noqa: E402
import qshard.tp  # noqa: E402


def main() -> None:
    import moe_models
    from test_experts_parallel import EXPERTS, MODELS, experts_of, realigned_reference
    from test_experts_parallel_cuda import CONFIGS, STYLES
    from torch.distributed.device_mesh import init_device_mesh

    device = "cuda" if torch.cuda.is_available() else "cpu"
    with qshard.tp.deadline(600):
        qshard.tp.init_process_group("nccl" if device == "cuda" else "gloo", timeout_s=120)
        rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
        if device == "cuda":
            torch.cuda.set_device(rank)
        mesh = init_device_mesh(device, (world,))
        ids = torch.randint(0, moe_models.VOCAB, (2, 7), generator=torch.Generator().manual_seed(3))
        ids = ids.to(device)
        for layout, config in CONFIGS.items():
            for style in ("ep", "etp"):
                torch.manual_seed(1234)
                model = MODELS["qwen3_moe_i64"]().to(device, torch.bfloat16)
                qshard.quantize_(model, config)
                model.set_experts_implementation("grouped_mm")
                reference = copy.deepcopy(model)
                if style == "etp":
                    realigned_reference(reference, world)
                qshard.tp.parallelize(model, mesh, {EXPERTS: STYLES[style]()})
                seen, routes = {}, {}
                for name, experts in experts_of(reference).items():
                    experts.register_forward_hook(_keep(seen, name))
                for key, which in (("reference", reference), ("sharded", model)):
                    which.model.layers[1].mlp.gate.register_forward_hook(_keep_route(routes, key))
                with torch.no_grad():
                    want = reference(ids).logits.float()
                    got = model(ids).logits.float()
                    layers = []
                    for name, (args, out) in seen.items():
                        mine = model.get_submodule(name)(*args)
                        layers.append(qshard.sqnr_db(out.float(), mine.float()))
                flips = _route_flips(routes)
                if rank == 0:
                    per_layer = ", ".join(f"{s:.1f}" for s in layers)
                    print(
                        f"{layout:9s} {style:3s}: experts per layer {per_layer} dB; logits "
                        f"{qshard.sqnr_db(want, got):.1f} dB; layer-1 route flips {flips}",
                        flush=True,
                    )
        qshard.tp.shutdown()


def _keep(store, name):
    def hook(module, args, out):
        store[name] = ([a.detach() for a in args], out.detach())

    return hook


def _keep_route(store, key):
    def hook(module, args, out):
        store[key] = out[-1]  # (logits, weights, top-k expert ids)

    return hook


def _route_flips(routes) -> int:
    a, b = routes.get("reference"), routes.get("sharded")
    return int((a.sort(-1).values != b.sort(-1).values).sum())


if __name__ == "__main__":
    main()

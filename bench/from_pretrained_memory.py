"""Peak host memory of `from_pretrained` of an 8B-shaped qshard checkpoint (issue 23's target:
no more than its largest tensor above the checkpoint's size). CPU only.

    PYTHONPATH=. python bench/from_pretrained_memory.py [--layouts int4-g128 fp8-block]
        [--dir /tmp] [--device-map none cpu] [--keep] [--trace]

For each layout: builds a Llama-3.1-8B-shaped `LlamaForCausalLM` (hidden 4096, intermediate 14336,
32 layers, 32/8 heads, vocab 128256, bf16, untied embeddings) on the meta device and gives each
decoder linear a random QTensor of the layout made directly from random inner tensors (codes,
scales and zeros that pass qshard's validation), the embeddings, norms and lm_head random bf16:
no float linear is ever made. `save_pretrained` writes it (default shard size) to a temporary
directory under --dir; then, in a fresh process per `device_map` (so nothing is cached in the
measuring process), `AutoModelForCausalLM.from_pretrained(directory)` loads it. The page cache
is not dropped: the files were just written, so they are usually cached (reads are fast; mapped
pages still count in the loader's RSS once touched).

Prints one markdown table, a row per layout and load: checkpoint files and bytes, the largest
tensor, the loading process's baseline (after importing torch, transformers and qshard), its peak
RSS (VmHWM; ru_maxrss agrees), peak minus baseline, the peaks of its anonymous and file-backed
(mmapped safetensors) RSS sampled every 5 ms, RSS after loading, how many bytes of the loaded
weights lie in the mapped file and how many were copied, the excess of the peak over the
checkpoint's size against the largest tensor (the target), and the excess of the RSS once every
page of every weight has been read (a first forward's footprint: the weights are mapped from the
file, and mapped pages count only once touched). With --trace, also each loading phase's RSS
(qshard's header read and float checksums, first / last weight built, the end of loading). The
notes (HTML comments) give each load's time, ru_maxrss, and RssAnon after glibc's
malloc_trim(0): what the allocator kept of freed temporaries. The directories are deleted
afterwards unless --keep.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import platform
import resource
import shutil
import struct
import subprocess
import sys
import tempfile
import threading
import time

GB = 1e9
LLAMA_8B = dict(
    hidden_size=4096,
    intermediate_size=14336,
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=8,
    vocab_size=128256,
    tie_word_embeddings=False,
    max_position_embeddings=8192,
    rope_theta=500000.0,
)
LAYOUTS = ("int4-g128", "fp8-block")


# ---- building the random checkpoint ------------------------------------------------------------


def random_qtensor(layout: str, n: int, k: int, generator):
    """A random QTensor [n, k] (bf16) of `layout`, made from random inner tensors."""
    import torch

    from qshard.config import Backend, ScaleFormat
    from qshard.layouts.fp8_blockwise import Fp8BlockwiseTensor
    from qshard.layouts.int4 import Int4Tensor

    if layout == "int4-g128":  # asymmetric, integer zero points: (u - zero) * scale
        groups = -(-k // 128)
        qdata = torch.randint(0, 256, (n, -(-k // 2)), dtype=torch.uint8, generator=generator)
        scale = torch.empty(n, groups, dtype=torch.bfloat16)
        scale.uniform_(1e-3, 4e-3, generator=generator)
        zero = torch.randint(0, 16, (n, groups), generator=generator).to(torch.bfloat16)
        tensor = Int4Tensor(
            {"qdata": qdata, "scale": scale, "zero": zero},
            shape=(n, k),
            dtype=torch.bfloat16,
            group_size=128,
            symmetric=False,
            backend=Backend.AUTO,
        )
    elif layout == "fp8-block":  # 128x128 blocks, fp32 scales
        # bytes 0..253 with 0x7f (NaN) moved up: 0x00-0x7e, 0x80-0xfe (never 0x7f or 0xff)
        codes = torch.randint(0, 254, (n, k), dtype=torch.uint8, generator=generator)
        codes += codes >= 0x7F
        scale = torch.empty(-(-n // 128), -(-k // 128)).uniform_(1e-5, 4e-5, generator=generator)
        tensor = Fp8BlockwiseTensor(
            {"qdata": codes.view(torch.float8_e4m3fn), "scale": scale},
            shape=(n, k),
            dtype=torch.bfloat16,
            block_size=(128, 128),
            act_group_size=128,
            weight_only=False,
            scale_format=ScaleFormat.FP32,
            backend=Backend.AUTO,
        )
    else:
        raise SystemExit(f"unknown layout {layout!r}; known: {LAYOUTS}")
    tensor.validate()
    return tensor.repack_for_device()


def build_and_save(layout: str, directory: str) -> None:
    """Build the random model (no float linear) and save_pretrained it to `directory`."""
    import torch
    from torch import nn
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    import qshard.api
    from qshard.qtensor.validation import check_qtensor

    config = LlamaConfig(**LLAMA_8B, dtype="bfloat16")
    with torch.device("meta"):
        model = LlamaForCausalLM(config).to(torch.bfloat16)
    generator = torch.Generator().manual_seed(0)
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear) and name != "lm_head":
            n, k = module.weight.shape
            weight = random_qtensor(layout, n, k, generator)
            check_qtensor(weight, name)  # what from_pretrained will check
            module.weight = nn.Parameter(weight, requires_grad=False)
    for name, param in list(model.named_parameters()):
        if param.device.type == "meta":  # embeddings, lm_head, norms: random bf16
            module_name, _, param_name = name.rpartition(".")
            value = torch.empty(param.shape, dtype=torch.bfloat16)
            if "norm" in name:
                value.uniform_(0.5, 1.5, generator=generator)
            else:
                value.normal_(0.0, 0.02, generator=generator)
            setattr(model.get_submodule(module_name), param_name, nn.Parameter(value, False))
    model.model.rotary_emb = LlamaRotaryEmbedding(config)  # its buffers, off the meta device
    qshard.integrations.attach_to_transformers(model)
    model.save_pretrained(directory)


# ---- measuring from_pretrained in a fresh process ----------------------------------------------


def proc_status() -> dict[str, int]:
    """/proc/self/status's memory fields (VmRSS, VmHWM, RssAnon, RssFile, RssShmem) in bytes."""
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM", "RssAnon", "RssFile", "RssShmem"):
                out[key] = int(value.split()[0]) * 1024
    return out


class Sampler(threading.Thread):
    """Polls /proc/self/status every `interval` s: the peaks of RssAnon and RssFile."""

    def __init__(self, interval: float = 0.005):
        super().__init__(daemon=True)
        self.interval, self.stopped = interval, threading.Event()
        self.peak_anon = self.peak_file = 0

    def run(self):
        while not self.stopped.is_set():
            s = proc_status()
            self.peak_anon = max(self.peak_anon, s["RssAnon"])
            self.peak_file = max(self.peak_file, s["RssFile"] + s.get("RssShmem", 0))
            time.sleep(self.interval)

    def stop(self):
        self.stopped.set()
        self.join()


def install_trace(events: list) -> None:
    """Record RSS at qshard's loading phases (the quantizer's hooks), for --trace."""
    from qshard.integrations import transformers as integration

    cls = integration.QShardHfQuantizer

    def mark(label):
        s = proc_status()
        events.append((label, s["RssAnon"], s["RssFile"], s["VmHWM"]))

    def wrap(name, label):
        original = getattr(cls, name)

        def wrapper(self, *args, **kwargs):
            mark(f"{label}: start")
            out = original(self, *args, **kwargs)
            mark(f"{label}: end")
            return out

        setattr(cls, name, wrapper)

    wrap("_process_model_before_weight_loading", "headers + float checksums")
    wrap("_process_model_after_weight_loading", "after weights")
    original_build, count = cls.build, [0]

    def build(self, *args, **kwargs):
        out = original_build(self, *args, **kwargs)
        count[0] += 1
        if count[0] in (1, len(self.records)) or count[0] % 56 == 0:
            mark(f"weight {count[0]}/{len(self.records)} built")
        return out

    cls.build = build
    original_check = integration._check_float_tensors

    def check(*args, **kwargs):
        mark("float checksums: start")
        out = original_check(*args, **kwargs)
        mark("float checksums: end")
        return out

    integration._check_float_tensors = check


def measure(directory: str, device_map: str, trace: bool) -> None:
    """Run in a fresh process: load `directory`, print one JSON line of memory figures."""
    import torch
    import transformers
    import transformers.core_model_loading  # what loading imports
    from transformers import AutoModelForCausalLM

    import qshard.integrations.transformers  # noqa: F401
    from qshard.qtensor import QTensor

    events: list = []
    if trace:
        install_trace(events)
    before = proc_status()
    maxrss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    sampler = Sampler()
    sampler.start()
    start = time.perf_counter()
    kwargs = {} if device_map == "none" else {"device_map": device_map}
    model = AutoModelForCausalLM.from_pretrained(directory, **kwargs)
    seconds = time.perf_counter() - start
    sampler.stop()
    after = proc_status()
    maxrss_after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    params = dict(model.named_parameters())

    def nbytes(p):
        if isinstance(p, QTensor):
            return sum(t.numel() * t.element_size() for t in p.inner_tensors().values())
        return p.numel() * p.element_size()

    largest = max(params, key=lambda n: nbytes(params[n]))
    mapped, copied = where_weights_live(params.values())
    # Mapped pages count in RSS only once touched: read one byte of every page of every weight
    # (what a first forward does) to see the loaded model's whole footprint.
    for p in params.values():
        for t in p.inner_tensors().values() if isinstance(p, QTensor) else [p]:
            if t.numel():
                int(t.detach().reshape(-1).view(torch.uint8)[::4096].sum())
    touched = proc_status()
    try:  # what glibc keeps of freed temporaries (RssAnon drops by that much), for the notes
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass
    trimmed = proc_status()
    print(
        json.dumps(
            {
                "transformers": transformers.__version__,
                "dtype": str(model.dtype),
                "seconds": seconds,
                "quantized": sum(isinstance(p, QTensor) for p in params.values()),
                "params": len(params),
                "model_bytes": sum(nbytes(p) for p in params.values()),
                "largest_param": largest,
                "largest_param_bytes": nbytes(params[largest]),
                "baseline_hwm": before["VmHWM"],
                "baseline_rss": before["VmRSS"],
                "baseline_maxrss": maxrss_before,
                "peak_hwm": after["VmHWM"],
                "peak_maxrss": maxrss_after,
                "peak_anon": sampler.peak_anon,
                "peak_file": sampler.peak_file,
                "after_rss": after["VmRSS"],
                "after_anon": after["RssAnon"],
                "after_file": after["RssFile"],
                "mapped": mapped,
                "copied": copied,
                "touched_rss": touched["VmRSS"],
                "touched_hwm": touched["VmHWM"],
                "trimmed_anon": trimmed["RssAnon"],
                "events": events,
            }
        )
    )


def where_weights_live(params) -> tuple[int, int]:
    """(bytes of the weights' tensors that lie in a mapped .safetensors file, bytes that do not,
    i.e. were copied into the process's own memory)."""
    from qshard.qtensor import QTensor

    ranges = []
    with open("/proc/self/maps") as f:
        for line in f:
            fields = line.split()
            if len(fields) >= 6 and fields[5].endswith(".safetensors"):
                low, high = (int(x, 16) for x in fields[0].split("-"))
                ranges.append((low, high))
    mapped = copied = 0
    for p in params:
        for t in p.inner_tensors().values() if isinstance(p, QTensor) else [p]:
            size, ptr = t.numel() * t.element_size(), t.data_ptr()
            if any(low <= ptr and ptr + size <= high for low, high in ranges):
                mapped += size
            else:
                copied += size
    return mapped, copied


# ---- the driver --------------------------------------------------------------------------------


def checkpoint_facts(directory: pathlib.Path) -> dict:
    """Files, total bytes and the largest stored tensor of a safetensors checkpoint."""
    files = sorted(directory.glob("*.safetensors"))
    largest, largest_name = 0, None
    for path in files:
        with open(path, "rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(length))
        for name, entry in header.items():
            if name != "__metadata__":
                size = entry["data_offsets"][1] - entry["data_offsets"][0]
                if size > largest:
                    largest, largest_name = size, name
    return {
        "files": len(files),
        "bytes": sum(p.stat().st_size for p in files),
        "largest": largest,
        "largest_name": largest_name,
    }


def run_child(args: list[str]) -> str:
    env = dict(os.environ)
    root = str(pathlib.Path(__file__).resolve().parent.parent)
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    done = subprocess.run(
        [sys.executable, __file__, *args], env=env, check=True, stdout=subprocess.PIPE, text=True
    )
    return done.stdout


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=LAYOUTS)
    parser.add_argument("--dir", default=tempfile.gettempdir(), help="where the checkpoints go")
    parser.add_argument("--device-map", nargs="+", default=["none", "cpu"], choices=["none", "cpu"])
    parser.add_argument("--keep", action="store_true", help="keep the checkpoint directories")
    parser.add_argument("--trace", action="store_true", help="RSS at each loading phase")
    parser.add_argument("--build", nargs=2, metavar=("LAYOUT", "DIR"), help=argparse.SUPPRESS)
    parser.add_argument("--measure", nargs=2, metavar=("DIR", "DEVICE_MAP"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.build:
        return build_and_save(*args.build)
    if args.measure:
        return measure(*args.measure, trace=args.trace)

    import torch
    import transformers

    import qshard

    print(
        f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, "
        f"{os.sysconf('SC_PHYS_PAGES') * os.sysconf('SC_PAGE_SIZE') / 2**30:.0f} GiB RAM; "
        f"Python {platform.python_version()}, torch {torch.__version__}, transformers "
        f"{transformers.__version__}, qshard {qshard.__version__}"
    )
    print("Llama-3.1-8B shapes, random weights, untied embeddings; sizes in GB (1e9 bytes)\n")
    print(
        "| layout | load | files | checkpoint | largest tensor | baseline | peak (VmHWM) | "
        "peak - baseline | peak anon / file-backed | RSS after | RSS, every weight touched | "
        "weights mapped / copied | excess over checkpoint | target (excess <= largest) | "
        "excess, every weight touched |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for layout in args.layouts:
        directory = pathlib.Path(tempfile.mkdtemp(prefix=f"qshard-8b-{layout}-", dir=args.dir))
        try:
            start = time.perf_counter()
            run_child(["--build", layout, str(directory)])
            facts = checkpoint_facts(directory)
            print(
                f"<!-- {layout}: built and saved in {time.perf_counter() - start:.0f} s; largest "
                f"tensor {facts['largest_name']} -->",
                flush=True,
            )
            for device_map in args.device_map:
                extra = ["--trace"] if args.trace else []
                out = json.loads(
                    run_child(["--measure", str(directory), device_map, *extra])
                    .strip()
                    .splitlines()[-1]
                )
                rise = out["peak_hwm"] - out["baseline_hwm"]
                excess = rise - facts["bytes"]
                held = "yes" if excess <= facts["largest"] else "no"
                resident = out["touched_rss"] - out["baseline_hwm"] - facts["bytes"]
                load = (
                    "from_pretrained(d)" if device_map == "none" else f'device_map="{device_map}"'
                )
                print(
                    f"| {layout} | {load} | {facts['files']} | {facts['bytes'] / GB:.2f} | "
                    f"{facts['largest'] / GB:.2f} | {out['baseline_hwm'] / GB:.2f} | "
                    f"{out['peak_hwm'] / GB:.2f} | {rise / GB:.2f} | "
                    f"{out['peak_anon'] / GB:.2f} / {out['peak_file'] / GB:.2f} | "
                    f"{out['after_rss'] / GB:.2f} | {out['touched_rss'] / GB:.2f} | "
                    f"{out['mapped'] / GB:.2f} / {out['copied'] / GB:.2f} | "
                    f"{excess / GB:+.2f} | {held} | {resident / GB:+.2f} |",
                    flush=True,
                )
                print(
                    f"<!-- {layout} {device_map}: {out['seconds']:.0f} s, dtype "
                    f"{out['dtype']}, {out['quantized']}/{out['params']} parameters quantized, "
                    f"ru_maxrss {out['peak_maxrss'] / GB:.2f}, after: anon "
                    f"{out['after_anon'] / GB:.2f} file {out['after_file'] / GB:.2f}; anon "
                    f"after malloc_trim(0) {out['trimmed_anon'] / GB:.2f} -->",
                    flush=True,
                )
                for label, anon, file, hwm in out["events"]:
                    print(
                        f"<!--   {label}: anon {anon / GB:.2f} file {file / GB:.2f} "
                        f"peak {hwm / GB:.2f} -->"
                    )
        finally:
            if not args.keep:
                shutil.rmtree(directory, ignore_errors=True)


if __name__ == "__main__":
    main()

"""Where the register kernel's time goes: the Llama-3.1-8B layer (int4 g128, bf16) timed with
parts of the kernel's work removed, each variant a copy of qshard/kernels/w4a16_gluon.py with
that part cut out of its source (results are wrong on purpose; only the times mean anything).

    PYTHONPATH=$PWD python bench/ablate_register.py [--ms 2,16] [--cuts 0,1,2,4,16,20,64,87]

CUTS is a bit mask: 1 no decode (the code words passed to the MMA as bf16 bits), 2 no split-K
epilogue (no partial sums stored, no arrival counted, no tile summed), 4 no copy of x, 16 no
copy of the codes, 64 no scale loads for the next item; 0 is the kernel as shipped. Timed as
bench_register.py does. Measurements: docs/kernels/w4a16_register.md, session 17.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
import tempfile

import torch

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from bench_fp8 import LLAMA, copies_for, versions_line
from bench_register import timed

from qshard.kernels import int4

KERNEL = os.path.join(os.path.dirname(__file__), "..", "qshard", "kernels", "w4a16_gluon.py")

# (text in the kernel, the same text with the part guarded by the constexpr mask _CUT)
EDITS = [
    ("from .split_k import", "from qshard.kernels.split_k import"),
    ("from .gluon_api import", "from qshard.kernels.gluon_api import"),
    ("    _CHUNK = gl.constexpr(CHUNK)\n",
     "    _CHUNK = gl.constexpr(CHUNK)\n    _CUT = gl.constexpr({cut})\n"),
    ("        cp_async(codes, q_ptr + run[:, :, None] + j[None, None, :], mask=ok[:, :, None])\n"
     "        _copy_x(x_ptr, x_slot, chunk, m_live, K, BLOCK_M)\n",
     "        if (_CUT & 16) == 0:\n"
     "            cp_async(codes, q_ptr + run[:, :, None] + j[None, None, :],\n"
     "                     mask=ok[:, :, None])\n"
     "        if (_CUT & 4) == 0:\n"
     "            _copy_x(x_ptr, x_slot, chunk, m_live, K, BLOCK_M)\n"),
    ("        else:\n            p = _int4_planes(w, scale, zero, FORMAT, dtype)\n",
     "        elif (_CUT & 1) != 0:\n"
     "            p = gl.inline_asm_elementwise(\n"
     "                'mov.b32 {$0, $1}, $8; mov.b32 {$2, $3}, $8; mov.b32 {$4, $5}, $8;'\n"
     "                'mov.b32 {$6, $7}, $8;', '=h,=h,=h,=h,=h,=h,=h,=h,r', [w],\n"
     "                dtype=(gl.bfloat16,) * 8, is_pure=True, pack=1)\n"
     "        else:\n            p = _int4_planes(w, scale, zero, FORMAT, dtype)\n"),
    ("            next_scales = _item_scales(s_ptr, z_ptr, after, K, stride_sn, FORMAT, GROUP, "
     "STEPS,\n                                       dtype)  # fmt: skip\n",
     "            if (_CUT & 64) != 0:\n                next_scales = scales\n            else:\n"
     "                next_scales = _item_scales(s_ptr, z_ptr, after, K, stride_sn, FORMAT, "
     "GROUP,\n                                           STEPS, dtype)\n"),
    ("            _finish_tile(acc, part_ptr, cnt_ptr, bias_ptr, out_ptr, item % tiles,\n",
     "            if (_CUT & 2) != 0:\n"
     "                if M < 0:  # never: the sums stay live, nothing is stored\n"
     "                    _store_tile(acc, bias_ptr, out_ptr, 0, M, N, times, HAS_BIAS, BLOCK_M)\n"
     "            else:\n"
     "              _finish_tile(acc, part_ptr, cnt_ptr, bias_ptr, out_ptr, item % tiles,\n"),
]  # fmt: skip


def variant(cut: int, folder: str):
    """The kernel module with the parts in `cut` removed."""
    with open(KERNEL) as f:
        source = f.read()
    for old, new in EDITS:
        if source.count(old) != 1:
            raise RuntimeError(f"the kernel changed: {old[:60]!r} is not found once; update EDITS")
        source = source.replace(old, new.replace("{cut}", str(cut)))
    path = os.path.join(folder, f"register_cut_{cut}.py")
    with open(path, "w") as f:
        f.write(source)
    spec = importlib.util.spec_from_file_location(f"register_cut_{cut}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ms", default="2,16")
    parser.add_argument("--cuts", default="0,1,2,4,16,20,64,87")
    args = parser.parse_args()
    print(versions_line([]))
    ms = [int(v) for v in args.ms.split(",")]
    cuts = [int(v) for v in args.cuts.split(",")]
    folder = tempfile.mkdtemp()
    modules = {cut: variant(cut, folder) for cut in cuts}
    sums: dict[tuple[int, int], float] = {}
    for name in ("qkv", "o", "gate_up", "down"):
        n, k = LLAMA[name]
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
        q, s, z = int4.quantize_int4(w, 128, symmetric=False)
        weights = [(q.clone(), s.clone(), z.clone()) for _ in range(copies_for(n * k // 2, 1))]
        for m in ms:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
            cells = []
            for cut in cuts:
                run = modules[cut].register_launch
                t = timed(lambda q, s, z, run=run, out=out: (
                    lambda a: run(0, a, q, s, z, None, out, 128)), weights, x)  # fmt: skip
                sums[m, cut] = sums.get((m, cut), 0.0) + t
                cells.append(f"cut {cut}: {t:.2f}")
            print(f"{name} M={m}: " + "  ".join(cells), flush=True)
    for m in ms:
        print(f"layer M={m} (us): " + "  ".join(f"cut {c}: {sums[m, c]:.1f}" for c in cuts))


if __name__ == "__main__":
    main()

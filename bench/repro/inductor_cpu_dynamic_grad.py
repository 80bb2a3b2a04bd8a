"""Repro: inductor (CPU) miscompiles a grad-enabled graph of two FP8 quantized linears with a
dynamic batch dim (torch 2.13.0+cpu, 2 threads). Prints SQNR of compiled vs eager per trial.

    python bench/repro/inductor_cpu_dynamic_grad.py            # garbage (-inf .. -300 dB)
    python bench/repro/inductor_cpu_dynamic_grad.py threads1   # correct (inf)
    python bench/repro/inductor_cpu_dynamic_grad.py simd1      # correct (inf)
    python bench/repro/inductor_cpu_dynamic_grad.py nograd     # correct (inf)
"""

import sys

import torch
import torch._inductor.config as inductor_config
import torch.nn.functional as F
from torch import nn

import qshard


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = nn.Linear(160, 224)
        self.down = nn.Linear(224, 160, bias=False)

    def forward(self, x):
        return self.down(F.silu(self.up(x)))


option = sys.argv[1] if len(sys.argv) > 1 else "none"
if option == "simd1":
    inductor_config.cpp.simdlen = 1
if option == "threads1":
    torch.set_num_threads(1)
results = []
for _ in range(3):
    model = MLP()
    qshard.quantize_(model, qshard.Fp8BlockwiseConfig())
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True)
    x = torch.randn(3, 160)
    torch._dynamo.mark_dynamic(x, 0)
    with torch.set_grad_enabled(option != "nograd"):
        results.append(round(qshard.sqnr_db(model(x), compiled(x)), 1))
print(option, results)

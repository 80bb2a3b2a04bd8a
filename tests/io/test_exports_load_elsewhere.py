"""qshard.export(format="compressed-tensors") loads and runs where it is served: transformers +
compressed-tensors, in a process that never imports qshard (a subprocess), against qshard's
own outputs of the same quantized model.

The asymmetric int4 export stores its zero points as compressed-tensors itself writes them
(int32 [N/8, K/g], packed along the output dim: what vLLM's and SGLang's WNA16 loaders read
too); transformers 5.24 + compressed-tensors 0.20.1 load such a checkpoint (compressed-tensors'
own included) only with `CompressedTensorsConfig(dequantize=True)`: their default path
registers the zero point unpacked on the meta model (llm-compressor issue #1618).
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
import torch

import qshard

pytest.importorskip("compressed_tensors")

# (config, how transformers loads it, largest relative error of the logits against qshard's).
# Measured on the CPU (torch 2.13, transformers 5.24.0, compressed-tensors 0.20.1): 0.0 for
# int4 symmetric and both FP8 (the same weights and activation quantization, float32 sums);
# NVFP4 7.1e-3 (compressed-tensors unpacks NVFP4 to bf16, so the export names bf16 and the
# model runs in it); int4 asymmetric 2.9e-3 (its dequantize=True path computes (q - z) * s in
# the scales' bf16: a weight differs from qshard's float32 dequantization by up to one bf16
# ulp, 21% of q_proj's weights; the codes, scales and zero points are the same).
CASES = {
    "int4-symmetric": (qshard.Int4WeightOnlyConfig(group_size=128, symmetric=True), {}, 1e-5),
    "int4-asymmetric": (qshard.Int4WeightOnlyConfig(group_size=128), {"dequantize": True}, 1e-2),
    "fp8-row": (qshard.Fp8RowwiseConfig(), {}, 1e-5),
    "fp8-block": (qshard.Fp8BlockwiseConfig(), {}, 1e-5),
    "nvfp4": (qshard.NVFP4WeightOnlyConfig(), {}, 2e-2),
}

_LOADER = textwrap.dedent(
    """
    import json, sys
    import torch
    from transformers import AutoModelForCausalLM, CompressedTensorsConfig

    directory, options = sys.argv[1], json.loads(sys.argv[2])
    extra = {"quantization_config": CompressedTensorsConfig(**options)} if options else {}
    model = AutoModelForCausalLM.from_pretrained(directory, **extra).eval()
    ids = torch.load(directory + "/ids.pt")
    with torch.no_grad():
        logits = model(ids).logits.float()
    torch.save(logits, directory + "/logits.pt")
    assert not any(name.startswith("qshard") for name in sys.modules), "qshard was imported"
    print("LOADED", type(model).__name__, str(next(model.parameters()).dtype))
    """
)


def _model():
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=128,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    torch.manual_seed(0)
    return LlamaForCausalLM(config).eval()


@pytest.mark.parametrize("case", list(CASES))
def test_a_compressed_tensors_export_runs_in_transformers_without_qshard(tmp_path, case):
    config, options, tolerance = CASES[case]
    model = _model()
    qshard.quantize_(model, config)
    out = tmp_path / "export"
    qshard.export(model, out, format="compressed-tensors")
    ids = torch.randint(0, 128, (1, 12), generator=torch.Generator().manual_seed(1))
    torch.save(ids, out / "ids.pt")
    with torch.no_grad():
        expected = model(ids).logits.float()
    command = [sys.executable, "-c", _LOADER, str(out), json.dumps(options)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    got = torch.load(out / "logits.pt")
    error = ((got - expected).norm() / expected.norm()).item()
    assert error < tolerance, (case, error, done.stdout)

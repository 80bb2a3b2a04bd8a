"""CUDA: the reference path on the GPU agrees with the CPU, eager and compiled."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from helpers import LAYOUT_CASES, LAYOUT_IDS, assert_same_qtensor, gaussian

import qshard

pytestmark = pytest.mark.cuda
cases = pytest.mark.parametrize(("cls", "config"), LAYOUT_CASES, ids=LAYOUT_IDS)
# fp32 GEMMs on GPU and CPU sum in different orders (and cuBLAS may split K): ~1e-6 relative.
GPU_VS_CPU = {"rtol": 1e-4, "atol": 1e-5}


@cases
def test_quantize_on_gpu_is_bit_identical_to_cpu(cls, config):
    """Over 40 fresh weights of odd shapes and magnitudes: issue 21 saw NVFP4's global scale
    differ in 2 runs of 5 of a one-weight version (a Python-scalar divisor, which CUDA turns
    into a multiplication by its reciprocal)."""
    for trial in range(40):
        n, k = (int(v) for v in torch.randint(1, 400, (2,)))
        w = gaussian(n, k, std=10.0 ** (trial % 9 - 6))
        assert_same_qtensor(cls.from_float(w.cuda(), config).cpu(), cls.from_float(w, config))


@cases
@pytest.mark.parametrize("act_dtype", [torch.float32, torch.bfloat16])
def test_reference_linear_on_gpu_matches_cpu(cls, config, act_dtype):
    """The reference path on both devices (the GPU kernels: tests/kernels)."""
    w, x = gaussian(300, 520), torch.randn(17, 520)
    q = cls.from_float(w, dataclasses.replace(config, backend=qshard.Backend.REFERENCE))
    on_cpu = F.linear(x.to(act_dtype), q.to(act_dtype)).float()
    on_gpu = F.linear(x.to(act_dtype).cuda(), q.to(act_dtype).cuda()).float().cpu()
    if act_dtype == torch.float32:
        torch.testing.assert_close(on_gpu, on_cpu, **GPU_VS_CPU)
    else:  # bf16 output rounding on top of a different summation order
        assert qshard.sqnr_db(on_cpu, on_gpu) > 40


@pytest.mark.parametrize("cls", sorted({c for c, _ in LAYOUT_CASES}, key=lambda c: c.__name__))
def test_compile_on_gpu(cls):
    torch._dynamo.reset()
    model = torch.nn.Sequential(
        torch.nn.Linear(320, 864), torch.nn.SiLU(), torch.nn.Linear(864, 320)
    ).cuda()
    qshard.quantize_(model, cls.contract_configs()[0])
    compiled = torch.compile(model, fullgraph=True)
    # Layouts that quantize activations (FP8, W8A8): inductor's fused SiLU rounds the second
    # linear's input differently in fp32's last bits, and FP8 quantization then rounds a few
    # elements a whole step the other way (Fp8RowwiseTensor measured 54.3 dB on an H200).
    compiled_floor = 45 if cls.__name__.startswith("Fp8") else 60
    with torch.no_grad():
        for batch in (1, 17):
            x = torch.randn(batch, 320, device="cuda")
            torch._dynamo.mark_dynamic(x, 0)
            assert qshard.sqnr_db(model(x), compiled(x)) > compiled_floor


@cases
def test_save_from_gpu_and_load_onto_gpu(cls, config, tmp_path):
    # tinygemm on CUDA takes bf16 activations only (a typed error otherwise).
    dtype = torch.bfloat16 if getattr(config, "backend", None) == "tinygemm" else torch.float32
    model = torch.nn.Sequential(torch.nn.Linear(320, 864), torch.nn.Linear(864, 320))
    model = model.to("cuda", dtype)
    qshard.quantize_(model, config)
    qshard.save(model, tmp_path)
    with torch.device("meta"):
        fresh = torch.nn.Sequential(torch.nn.Linear(320, 864), torch.nn.Linear(864, 320))
    qshard.load(tmp_path, fresh.to(dtype), device="cuda")
    assert fresh[0].weight.device.type == "cuda"
    assert_same_qtensor(fresh[0].weight.cpu(), model[0].weight.cpu())
    x = torch.randn(5, 320, device="cuda", dtype=dtype)
    assert torch.equal(fresh(x), model(x))


@pytest.mark.parametrize("m", [1, 3, 17, 257])
def test_fp8_rowwise_cublas_matches_the_reference(m):
    """torch._scaled_mm with row-wise scales (fp32 accumulation, scales in its epilogue) vs the
    reference's float64 sums: within bf16 output rounding."""
    w = gaussian(320, 512).cuda()
    q = qshard.Fp8RowwiseTensor.from_float(w.to(torch.bfloat16))
    x = torch.randn(m, 512, device="cuda", dtype=torch.bfloat16)
    bias = torch.randn(320, device="cuda", dtype=torch.bfloat16)
    assert q.select_backend(x) is qshard.Backend.CUBLAS
    out = F.linear(x, q, bias)
    reference = F.linear(x, q.with_changes(backend=qshard.Backend.REFERENCE), bias)
    error = ((out.float() - reference.float()).norm() / reference.float().norm()).item()
    assert error <= 1e-2, f"relative error {error:.2e} > 1e-2"
    compiled = torch.compile(lambda x: F.linear(x, q, bias), fullgraph=True)
    assert qshard.sqnr_db(out, compiled(x)) > 40
    assert q.select_backend(x.half()) is qshard.Backend.REFERENCE  # bf16 output only


@pytest.mark.parametrize("k", [1792, 2048])
def test_fp8_blockwise_auto_runs_every_k_cut_over_ranks(k):
    """K = 1792 (14 blocks: DeepSeek-V3's attention output over 4 ranks) is refused by cuBLAS's
    blockwise scaled_mm (its weight scales need K/128 rounded up to a multiple of 4); "auto"
    runs the Triton kernels there, cuBLAS at K = 2048, both within bf16 rounding of the
    reference."""
    from qshard.kernels.availability import cublas_unavailable_reason

    reason = cublas_unavailable_reason(torch.device("cuda"), 512, k, 128, 128, 128)
    assert (reason is None) == (k == 2048), reason
    q = qshard.Fp8BlockwiseTensor.from_float(gaussian(512, k).cuda().to(torch.bfloat16))
    x = torch.randn(128, k, device="cuda", dtype=torch.bfloat16)
    out = F.linear(x, q)
    reference = F.linear(x, q.with_changes(backend=qshard.Backend.REFERENCE))
    assert qshard.sqnr_db(reference.float(), out.float()) > 40


@cases
def test_shape_ops_of_experts_on_gpu_equal_the_cpus(cls, config):
    """cat, stack, index and copy_ of 3-D experts on CUDA give the CPU's bytes: MXFP4's e8m0
    scales have no CUDA cat / stack / index_select kernels in torch 2.11 (byte views do it)."""
    experts = [cls.from_float(gaussian(64, 128, seed=e), config) for e in range(4)]
    on_cpu = qshard.QTensor.stack_experts(experts)
    on_gpu = qshard.QTensor.stack_experts([w.cuda() for w in experts])
    assert_same_qtensor(on_gpu.cpu(), on_cpu)
    ids = torch.tensor([3, 0, 2])
    assert_same_qtensor(on_gpu[ids.cuda()].cpu(), on_cpu[ids])
    halves = [on_gpu.slice_logical(0, 0, 2), on_gpu.slice_logical(0, 2, 4)]
    assert_same_qtensor(torch.cat(halves, 0).cpu(), on_cpu)

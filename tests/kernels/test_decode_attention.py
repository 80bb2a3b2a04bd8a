"""The decode attention op (kernels/decode_attention.py): its reference is SDPA with the causal
mask row; the split-K Triton kernels (under the interpreter on the CPU with float16, as
docs/design.md says; compiled on a GPU with bfloat16) equal the reference for every split
count, the first and last positions, GQA groups of 1 to 8, odd cache lengths and a strided q;
the op's checks, its fake implementation, and qshard.models.Llama decoding with it."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from qshard.errors import InputMismatchError, QShardError
from qshard.kernels.availability import triton_unavailable_reason
from qshard.kernels.decode_attention import decode_attention, decode_attention_reference
from qshard.models import Llama, LlamaConfig, generate

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
KERNEL_PROBLEM = triton_unavailable_reason(DEVICE, fp8=False)
needs_kernel = pytest.mark.skipif(KERNEL_PROBLEM is not None, reason=str(KERNEL_PROBLEM))
DTYPE = torch.bfloat16 if DEVICE.type == "cuda" else torch.float16
# Scores and probabilities enter the MMAs in the input dtype (float32 sums), as flash
# attention does; against the float32 reference, relative to the output's largest value.
MAX_ERROR = {torch.float16: 4e-3, torch.bfloat16: 2e-2}[DTYPE]


def inputs(b, hq, hkv, positions, d, dtype=torch.float32, device="cpu"):
    q = torch.randn(b, 1, hq, d, dtype=dtype, device=device).transpose(1, 2)  # as a model's
    k, v = (torch.randn(b, hkv, positions, d, dtype=dtype, device=device) for _ in range(2))
    return q, k, v


@pytest.mark.parametrize("pos", [0, 17, 99])
@pytest.mark.parametrize("hq,hkv", [(4, 4), (8, 2), (16, 2)])
def test_the_reference_is_sdpa_with_the_causal_mask_row(hq, hkv, pos):
    q, k, v = inputs(2, hq, hkv, 100, 32)
    at = torch.tensor([pos])
    mask = (torch.arange(100) <= pos)[None, None, None]
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    got = decode_attention_reference(q, k, v, at, 32**-0.5)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


CASES = [  # b, hq, hkv, positions, d, pos, splits (None: split_plan's)
    (1, 8, 2, 200, 64, 150, None),
    (2, 12, 4, 130, 32, 0, 3),
    (1, 4, 1, 64, 16, 63, 1),
    (3, 6, 6, 70, 32, 69, 2),
    (1, 8, 2, 300, 64, 5, 4),  # splits past the last position do nothing
    (2, 16, 2, 257, 32, 256, None),
]


@needs_kernel
@pytest.mark.parametrize("case", CASES, ids=str)
def test_the_kernel_equals_the_reference(case):
    from qshard.kernels.decode_attention_triton import decode_attention_launch

    b, hq, hkv, positions, d, pos, splits = case
    q, k, v = inputs(b, hq, hkv, positions, d, DTYPE, DEVICE)
    at = torch.tensor([pos], device=DEVICE)
    want = decode_attention_reference(q, k, v, at, d**-0.5).float()
    got = decode_attention_launch(q, k, v, at, d**-0.5, splits).float()
    assert (got - want).abs().max() <= MAX_ERROR * want.abs().max()
    # A cache's later positions never matter: filled with NaN, the result is the same.
    k[:, :, pos + 1 :], v[:, :, pos + 1 :] = float("nan"), float("nan")
    again = decode_attention_launch(q, k, v, at, d**-0.5, splits).float()
    assert torch.equal(again, got)


@pytest.mark.skipif(DEVICE.type != "cuda", reason="the op runs the kernel on CUDA only")
def test_the_op_runs_the_kernel_on_a_gpu():
    q, k, v = inputs(2, 32, 8, 1288, 128, torch.bfloat16, DEVICE)
    at = torch.tensor([1000], device=DEVICE)
    want = decode_attention_reference(q, k, v, at, 128**-0.5).float()
    got = decode_attention(q, k, v, at, 128**-0.5).float()
    assert (got - want).abs().max() <= 2e-2 * want.abs().max()
    compiled = torch.compile(decode_attention, fullgraph=True)(q, k, v, at, 128**-0.5)
    assert torch.equal(compiled.float(), got)


def test_the_op_on_the_cpu_is_the_reference_and_passes_opcheck():
    q, k, v = inputs(2, 8, 2, 40, 16)
    at = torch.tensor([25])
    assert torch.equal(
        decode_attention(q, k, v, at, 0.25), decode_attention_reference(q, k, v, at, 0.25)
    )
    torch.library.opcheck(decode_attention, (q, k, v, at, 0.25))
    want = decode_attention(q, k, v, at, 0.25)
    k[:, :, 26:], v[:, :, 26:] = float("nan"), float("inf")
    assert torch.equal(decode_attention(q, k, v, at, 0.25), want)


@pytest.mark.parametrize(
    "change",
    ["two tokens", "cache shapes differ", "heads not a multiple", "two positions", "head_dim"],
)
def test_bad_input_is_a_typed_error_naming_the_rule(change):
    q, k, v = inputs(1, 8, 2, 40, 16)
    at = torch.tensor([3])
    if change == "two tokens":
        q = torch.randn(1, 8, 2, 16)
    elif change == "cache shapes differ":
        v = v[:, :, :20]
    elif change == "heads not a multiple":
        q = torch.randn(1, 7, 1, 16)
    elif change == "two positions":
        at = torch.tensor([3, 4])
    else:
        q = torch.randn(1, 8, 1, 32)
    with pytest.raises(InputMismatchError) as info:
        decode_attention(q, k, v, at, 0.25)
    assert isinstance(info.value, QShardError) and "decode_attention" in str(info.value)


@torch.no_grad()
def test_llama_decodes_the_same_with_the_op_and_with_sdpa():
    prompt = torch.randint(0, 512, (2, 7))
    outputs = {}
    for kernel in (True, False):
        torch.manual_seed(0)
        config = dataclasses.replace(LlamaConfig.tiny(), decode_kernel=kernel)
        model = Llama(config).eval()
        model.setup_caches(batch=2, max_seq=32)
        tokens = generate(model, prompt, new_tokens=6)
        logits = model(tokens[:, -1:], torch.tensor([tokens.shape[1] - 1]))
        outputs[kernel] = tokens, logits
    assert torch.equal(outputs[True][0], outputs[False][0])
    torch.testing.assert_close(outputs[True][1], outputs[False][1], rtol=1e-4, atol=1e-4)

"""The decode attention op (kernels/decode_attention.py): its reference is SDPA with the causal
mask row; the split-K Triton kernels (under the interpreter on the CPU with float16, as
docs/design.md says; compiled on a GPU with bfloat16) equal the reference at forced split counts
of 1 to 64 (with and without the combine kernel, splits left with no positions), the first and
last positions, GQA groups of 1 to 32, odd cache lengths and a strided q, and never read a
position past input_pos; the op's checks, its fake implementation, and qshard.models.Llama
decoding with it (eager on the CPU through the reference, compiled with CUDA graphs on a GPU)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from qshard.errors import InputMismatchError, QShardError
from qshard.kernels.availability import triton_unavailable_reason
from qshard.kernels.decode_attention import (
    decode_attention,
    decode_attention_reference,
    kernel_applies,
)
from qshard.models import Llama, LlamaConfig, decode_one_token, generate

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


CASES = [  # b, hq, hkv, positions, d, pos, splits (None: split_plan's), block_n
    (1, 8, 2, 200, 64, 150, None, None),
    (2, 12, 4, 130, 32, 0, 3, 16),
    (1, 4, 1, 64, 16, 63, 1, 16),  # one split: the split kernel writes the output
    (3, 6, 6, 70, 32, 69, 2, 32),
    (1, 8, 2, 300, 64, 5, 4, 16),  # splits past the last position do nothing
    (2, 16, 2, 257, 32, 256, None, None),
    (1, 64, 2, 100, 16, 50, 3, 16),  # 32 query heads a KV head: a 32-row tile
    (1, 8, 1, 1000, 32, 999, 64, 16),  # the most splits the combine takes
]


@needs_kernel
@pytest.mark.parametrize("case", CASES, ids=str)
def test_the_kernel_equals_the_reference(case):
    from qshard.kernels.decode_attention_triton import decode_attention_launch, split_plan

    b, hq, hkv, positions, d, pos, splits, block_n = case
    if splits is not None:  # the launch runs the split count asked for
        assert split_plan(b * hkv, positions, d, DEVICE, splits, block_n)[0] == splits
    q, k, v = inputs(b, hq, hkv, positions, d, DTYPE, DEVICE)
    at = torch.tensor([pos], device=DEVICE)
    want = decode_attention_reference(q, k, v, at, d**-0.5).float()
    got = decode_attention_launch(q, k, v, at, d**-0.5, splits, block_n)
    assert got.is_contiguous() and got.shape == q.shape
    assert (got.float() - want).abs().max() <= MAX_ERROR * want.abs().max()
    # A cache's later positions are never read: filled with NaN, the result is the same.
    k[:, :, pos + 1 :], v[:, :, pos + 1 :] = float("nan"), float("nan")
    again = decode_attention_launch(q, k, v, at, d**-0.5, splits, block_n)
    assert torch.equal(again, got)


@pytest.mark.skipif(DEVICE.type != "cuda", reason="the op runs the kernel on CUDA only")
def test_the_op_runs_the_kernel_on_a_gpu():
    from qshard.kernels.decode_attention_triton import decode_attention_launch

    q, k, v = inputs(2, 32, 8, 1288, 128, torch.bfloat16, DEVICE)
    at = torch.tensor([1000], device=DEVICE)
    assert kernel_applies(q, k)
    got = decode_attention(q, k, v, at, 128**-0.5)
    assert torch.equal(got, decode_attention_launch(q, k, v, at, 128**-0.5))
    want = decode_attention_reference(q, k, v, at, 128**-0.5).float()
    assert (got.float() - want).abs().max() <= 2e-2 * want.abs().max()
    compiled = torch.compile(decode_attention, fullgraph=True)(q, k, v, at, 128**-0.5)
    assert torch.equal(compiled, got)
    torch.library.opcheck(decode_attention, (q, k, v, at, 128**-0.5))
    # Head dims the kernels do not take run the reference; 256 runs 64-position blocks.
    assert not kernel_applies(q[..., :80], k[..., :80])
    q, k, v = inputs(1, 8, 2, 700, 256, torch.bfloat16, DEVICE)
    at = torch.tensor([650], device=DEVICE)
    want = decode_attention_reference(q, k, v, at, 256**-0.5).float()
    got = decode_attention(q, k, v, at, 256**-0.5).float()
    assert (got - want).abs().max() <= 2e-2 * want.abs().max()


@pytest.mark.skipif(DEVICE.type != "cuda", reason="the kernels run on CUDA only")
@torch.no_grad()
def test_llama_compiled_with_cuda_graphs_decodes_the_same_with_the_op_as_with_sdpa():
    prompt = torch.randint(0, 512, (2, 9), device=DEVICE)
    tokens = {}
    for kernel in (True, False):
        torch.manual_seed(0)
        config = dataclasses.replace(LlamaConfig.tiny(), decode_kernel=kernel)
        model = Llama(config).to(DEVICE, torch.bfloat16).eval()
        model.setup_caches(batch=2, max_seq=64)
        torch._dynamo.reset()
        step = torch.compile(decode_one_token, mode="reduce-overhead", fullgraph=True)
        tokens[kernel] = generate(model, prompt, new_tokens=12, step=step)
    # bf16 logits of two attention implementations: the greedy tokens agree over 12 steps
    # at these sizes (random weights, std 0.02: no near-ties).
    assert torch.equal(tokens[True], tokens[False])


def test_the_op_on_the_cpu_is_the_reference_and_passes_opcheck():
    q, k, v = inputs(2, 8, 2, 40, 16)
    at = torch.tensor([25])
    assert not kernel_applies(q, k)
    assert torch.equal(
        decode_attention(q, k, v, at, 0.25), decode_attention_reference(q, k, v, at, 0.25)
    )
    torch.library.opcheck(decode_attention, (q, k, v, at, 0.25))
    # A q whose batch is not its outer dim: the fake and the op both give a contiguous output.
    strided = torch.randn(8, 2, 1, 16).transpose(0, 1)
    torch.library.opcheck(decode_attention, (strided, k, v, at, 0.25))
    want = decode_attention(q, k, v, at, 0.25)
    k[:, :, 26:], v[:, :, 26:] = float("nan"), float("inf")
    assert torch.equal(decode_attention(q, k, v, at, 0.25), want)


@pytest.mark.parametrize(
    "change,named",
    [
        ("two tokens", "(1, 8, 2, 16)"),
        ("cache shapes differ", "(1, 2, 20, 16)"),
        ("heads not a multiple", "(1, 7, 1, 16)"),
        ("no KV heads", "(1, 0, 40, 16)"),
        ("two positions", "2 values"),
        ("a float position", "torch.float32"),
        ("head_dim", "(1, 8, 1, 32)"),
        ("dtypes differ", "torch.float16"),
    ],
)
def test_bad_input_is_a_typed_error_naming_the_value_and_the_fix(change, named):
    q, k, v = inputs(1, 8, 2, 40, 16)
    at = torch.tensor([3])
    if change == "two tokens":
        q = torch.randn(1, 8, 2, 16)
    elif change == "cache shapes differ":
        v = v[:, :, :20]
    elif change == "heads not a multiple":
        q = torch.randn(1, 7, 1, 16)
    elif change == "no KV heads":
        k, v = k[:, :0], v[:, :0]
    elif change == "two positions":
        at = torch.tensor([3, 4])
    elif change == "a float position":
        at = torch.tensor([3.0])
    elif change == "head_dim":
        q = torch.randn(1, 8, 1, 32)
    else:
        v = v.half()
    with pytest.raises(InputMismatchError) as info:
        decode_attention(q, k, v, at, 0.25)
    message = str(info.value)
    assert isinstance(info.value, QShardError) and message.startswith("decode_attention: ")
    assert named in message, message


@torch.no_grad()
def test_llama_decodes_the_same_with_the_op_and_with_sdpa(monkeypatch):
    """The model's wiring, on the CPU: the op runs (its reference) wherever its kernels would."""
    import qshard.models.llama as llama

    monkeypatch.setattr(llama, "kernel_applies", lambda q, k: True)
    calls = []
    monkeypatch.setattr(
        llama, "decode_attention", lambda *a: calls.append(1) or decode_attention(*a)
    )
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
        assert len(calls) == (6 * 2 if kernel else 0)  # 5 decode steps and the last call, 2 layers
        calls.clear()
    assert torch.equal(outputs[True][0], outputs[False][0])
    torch.testing.assert_close(outputs[True][1], outputs[False][1], rtol=1e-4, atol=1e-4)

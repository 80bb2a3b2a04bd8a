"""Loading into models built without weights (issue 23, Deliver 2): nothing comes out half
real, half meta. A model built under torch.device("meta") has its non-persistent buffers (a
rotary embedding's inv_freq) on meta too, and no checkpoint holds them: qshard.load refuses it,
naming every such tensor, before any change. `qshard.empty_weights()` builds parameters on meta
and buffers for real, and the load then gives the whole model."""

from __future__ import annotations

import moe_models
import pytest
import torch
from torch import nn

import qshard
from qshard.errors import CheckpointError


def llama() -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**moe_models.COMMON, intermediate_size=96)
    return moe_models._seeded(lambda: LlamaForCausalLM(config), seed=2)


BUILDERS = {"llama": llama, "qwen3_moe": moe_models.qwen3_moe}


@pytest.fixture(scope="module", params=sorted(BUILDERS))
def saved(request, tmp_path_factory):
    """(builder, quantized model, its checkpoint directory)."""
    build = BUILDERS[request.param]
    model = build()
    qshard.quantize_(model, qshard.Int4WeightOnlyConfig(group_size=32))
    directory = tmp_path_factory.mktemp(request.param)
    qshard.save(model, directory)
    return build, model, directory


def test_a_meta_built_model_is_refused_naming_its_meta_buffers(saved):
    build, _, directory = saved
    with torch.device("meta"):
        model = build()
    before = dict(model.state_dict(keep_vars=True))
    with pytest.raises(CheckpointError, match=r"meta device.*model\.rotary_emb\.inv_freq"):
        qshard.load(directory, model)
    after = model.state_dict(keep_vars=True)
    assert all(after[k] is v for k, v in before.items())  # nothing changed


def test_empty_weights_then_load_gives_the_whole_model(saved):
    build, quantized, directory = saved
    with qshard.empty_weights():
        model = build()
    assert all(p.is_meta for p in model.parameters())
    assert not any(b.is_meta for b in model.buffers())
    qshard.load(directory, model)
    assert not any(t.is_meta for t in [*model.parameters(), *model.buffers()])
    expected = quantized.state_dict()
    for key, got in model.state_dict().items():
        want = expected[key]
        if isinstance(want, qshard.QTensor):
            assert all(torch.equal(getattr(got, n), t) for n, t in want.inner_tensors().items())
        else:
            assert torch.equal(got, want), key
    ids = torch.randint(0, moe_models.VOCAB, (1, 6), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        got = model.generate(ids, max_new_tokens=4, do_sample=False)
        want = quantized.generate(ids, max_new_tokens=4, do_sample=False)
    assert torch.equal(got, want)


def test_a_missing_key_left_on_meta_is_refused_even_when_not_strict(saved, tmp_path):
    build, quantized, _ = saved
    state = {k: v for k, v in quantized.state_dict().items() if k != "model.norm.weight"}
    qshard.save(state, tmp_path)
    with qshard.empty_weights():
        model = build()
    with pytest.raises(CheckpointError, match=r"model\.norm\.weight"):
        qshard.load(tmp_path, model, strict=False)
    assert model.model.norm.weight.is_meta


def test_empty_weights_is_undone_on_exit_and_on_error():
    with pytest.raises(RuntimeError, match="inside"), qshard.empty_weights():
        assert nn.Linear(2, 3).weight.is_meta
        raise RuntimeError("inside")
    assert not nn.Linear(2, 3).weight.is_meta

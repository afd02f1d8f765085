"""``past_bank: "rotate"`` on a model with a rotary embedding per layer type
(Gemma 3: base 10000 on its sliding-window layers, 1e6 on its full ones;
connector/rotary_source.py ``layer_ropes``): each layer's keys are turned
by its own type's table, the one vLLM's ``get_rope`` made from that type's
parameters, so the turned keys are vLLM's own keys at the true positions;
turned by the other type's table they are not.  What cannot be matched is
refused naming the type or the layer."""
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("vllm.model_executor.layers.rotary_embedding")
from vllm.config import VllmConfig, set_current_vllm_config  # noqa: E402
from vllm.model_executor.layers import rotary_embedding  # noqa: E402
from vllm.model_executor.layers.rotary_embedding import get_rope  # noqa: E402

from kvfill.connector import rotary_source  # noqa: E402
from kvfill.kernels.rotary import Rerotation  # noqa: E402

H, D, POSITIONS = 2, 64, 4096
TYPES = ["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"]
PARAMS = {"sliding_attention": {"rope_theta": 10000.0, "rope_type": "default"},
          "full_attention": {"rope_theta": 1000000.0, "rope_type": "default"}}
NAMES = [f"model.layers.{i}.self_attn.attn" for i in range(len(TYPES))]


@pytest.fixture(autouse=True)
def _platform(vllm_cpu_platform):
    """VllmConfig() needs a platform: vLLM 0.34's CUDA wheel resolves none without a GPU (make test-vllm034)."""


@pytest.fixture
def ropes(monkeypatch):
    """This process's model: Gemma 3's attention made one embedding per layer type (as vLLM's gemma3.py does,
    passing ``config.rope_parameters[layer_type]`` to get_rope), type -> embedding."""
    monkeypatch.setattr(rotary_embedding, "_ROPE_DICT", {})
    with set_current_vllm_config(VllmConfig()):
        return {kind: get_rope(D, POSITIONS, is_neox_style=True, rope_parameters=PARAMS[kind], dtype=torch.bfloat16)
                for kind in TYPES}


def _hf(**over):
    return SimpleNamespace(**{"layer_types": list(TYPES), "rope_parameters": PARAMS, **over})


def test_each_layer_is_turned_by_its_own_types_table_to_vllms_keys(ropes):
    by_layer = rotary_source.layer_ropes(_hf(), NAMES, rotary_source.made_ropes())
    assert {n: r for n, r in by_layer.items()} == {n: ropes[t] for n, t in zip(NAMES, TYPES)}
    got = rotary_source.rotary_layers(rotary_source.model_ropes(), {n: (H, D, D) for n in NAMES}, {},
                                      torch.bfloat16, by_layer=by_layer, max_positions=POSITIONS)
    assert set(got) == set(NAMES)
    for name, kind in zip(NAMES, TYPES):
        assert torch.equal(got[name].table, ropes[kind].cos_sin_cache.to(torch.bfloat16).float()), name
    assert got[NAMES[0]].table is got[NAMES[1]].table  # the layers of one type share one table (one device copy)
    g = torch.Generator(device="cpu").manual_seed(0)
    n = 128
    x = torch.randn(n, H, D, generator=g, device="cpu").to(torch.bfloat16)
    p = torch.randint(0, 1000, (n,), generator=g, device="cpu")
    t = p + torch.randint(1, 3000, (n,), generator=g, device="cpu")
    q = torch.zeros_like(x)
    for name, kind in zip(NAMES[1:3], TYPES[1:3]):  # one layer of each type
        rope, other = ropes[kind], ropes["full_attention" if kind == "sliding_attention" else "sliding_attention"]
        recorded = rope.forward_native(p, q.clone(), x.clone())[1].reshape(n, -1)
        want = rope.forward_native(t, q.clone(), x.clone())[1].reshape(n, -1).double()
        bound = 4 * torch.finfo(torch.bfloat16).eps * want.abs().amax(dim=1, keepdim=True)
        rows = recorded.clone().view(torch.int16)
        Rerotation(got[name], None, torch.bfloat16, "cpu").apply(rows, t, p)
        assert ((rows.view(torch.bfloat16).double() - want).abs() <= bound).all(), name
        wrong = recorded.clone().view(torch.int16)  # turned by the other type's table: not vLLM's keys
        Rerotation(rotary_source.rotary_layers([other], {name: (H, D, D)}, {}, torch.bfloat16)[name], None,
                   torch.bfloat16, "cpu").apply(wrong, t, p)
        assert ((wrong.view(torch.bfloat16).double() - want).abs() > bound).any(dim=1).float().mean() > 0.9, name


def test_without_layer_types_the_two_tables_are_refused_as_before(ropes):
    assert rotary_source.layer_ropes(SimpleNamespace(rope_parameters=PARAMS["full_attention"]), NAMES,
                                     rotary_source.made_ropes()) is None
    with pytest.raises(ValueError, match=r"2 different rotary embeddings.*use past_bank 'wrap'"):
        rotary_source.rotary_layers(rotary_source.model_ropes(), {n: (H, D, D) for n in NAMES}, {}, torch.bfloat16)


@pytest.mark.parametrize("hf, names, match", [
    (_hf(rope_parameters={**PARAMS, "full_attention": {"rope_theta": 5e5, "rope_type": "default"}}), NAMES,
     r"layer type 'full_attention' \(\{'rope_theta': 500000.0.*made 0 different rotary embeddings"),
    (_hf(), NAMES + ["model.layers.7.self_attn.attn"],
     r"layer model.layers.7.self_attn.attn's index 7 is past the config's 4 layer_types"),
], ids=["type-made-none", "index-past-types"])
def test_what_layer_types_cannot_tell_is_refused_naming_it(ropes, hf, names, match):
    with pytest.raises(ValueError, match=match):
        rotary_source.layer_ropes(hf, names, rotary_source.made_ropes())


def test_the_worker_reads_the_layer_types_from_the_models_text_config(ropes):
    """``worker_rotary`` (what registration calls) maps the replayed groups'
    layers through the model's hf_text_config; state layers (no K/V
    geometry) need no type."""
    hf = _hf()
    model = SimpleNamespace(hf_config=SimpleNamespace(), hf_text_config=hf, dtype=torch.bfloat16,
                            max_model_len=POSITIONS)
    groups = {"full": SimpleNamespace(mode=None, layers=NAMES), "state": SimpleNamespace(mode=None, layers=["mamba"])}
    got = rotary_source.worker_rotary(SimpleNamespace(model_config=model), groups,
                                      {**{n: (H, D, D) for n in NAMES}, "mamba": None}, {}, {})
    assert set(got) == set(NAMES)
    assert torch.equal(got[NAMES[2]].table, ropes["full_attention"].cos_sin_cache.to(torch.bfloat16).float())
    assert torch.equal(got[NAMES[0]].table, ropes["sliding_attention"].cos_sin_cache.to(torch.bfloat16).float())

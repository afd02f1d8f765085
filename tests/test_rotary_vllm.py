"""Re-rotation (kernels/rotary.py) against vLLM's own rotary embeddings:
raw keys rotated by vLLM's module at recorded positions p (the bank) and at
true positions t (what real prefill writes there); the recorded keys turned
from p to t with the module's own cos/sin table equal vLLM's keys at t up to
a few roundings (the recorded key's, the float32 turn's) - every variant the connector accepts
(default, GPT-J style, partial rotary, linear, Llama-3, YaRN with its mscale,
DeepSeek's YaRN of MLA's RoPE part), bfloat16 and float32 - while the keys
left as recorded (wrap) are as far from them as unrelated keys."""
import pytest
import torch

pytest.importorskip("vllm.model_executor.layers.rotary_embedding")
from vllm.config import VllmConfig, set_current_vllm_config  # noqa: E402
from vllm.model_executor.layers.rotary_embedding import get_rope  # noqa: E402

from kvfill.kernels.rotary import Rerotation, Rotary  # noqa: E402

H, D = 4, 64
VARIANTS = {
    "default": (True, {"rope_theta": 10000, "rope_type": "default"}),
    "gptj": (False, {"rope_theta": 10000, "rope_type": "default"}),
    "partial": (True, {"rope_theta": 10000, "rope_type": "default", "partial_rotary_factor": 0.5}),
    "linear": (True, {"rope_theta": 10000, "rope_type": "linear", "factor": 2.0}),
    "llama3": (True, {"rope_theta": 500000, "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}),
    "yarn": (True, {"rope_theta": 10000, "rope_type": "yarn", "factor": 4.0,
                    "original_max_position_embeddings": 4096}),
    "deepseek_yarn": (False, {"rope_theta": 10000, "rope_type": "deepseek_yarn", "factor": 40,
                              "original_max_position_embeddings": 4096, "beta_fast": 32, "beta_slow": 1,
                              "mscale": 0.707, "mscale_all_dim": 1.0}),
}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_recorded_keys_turned_to_their_true_positions_are_vllms_keys_there(variant, dtype):
    neox, params = VARIANTS[variant]
    with set_current_vllm_config(VllmConfig()):
        rope = get_rope(D, 40000, is_neox_style=neox, rope_parameters=params, dtype=dtype)
    g = torch.Generator(device="cpu").manual_seed(0)
    n = 256
    x = torch.randn(n, H, D, generator=g, device="cpu").to(dtype)
    p = torch.randint(0, 2000, (n,), generator=g, device="cpu")
    t = (p + torch.randint(1, 60000, (n,), generator=g, device="cpu")).clamp_max(rope.cos_sin_cache.shape[0] - 1)
    t[:8] = p[:8]  # a few recorded where they are replayed
    q = torch.zeros_like(x)
    recorded = rope.forward_native(p, q.clone(), x.clone())[1].reshape(n, -1)
    want = rope.forward_native(t, q.clone(), x.clone())[1].reshape(n, -1).double()
    # what vLLM's forward reads: its table in the keys' dtype (DeepSeek's kept in float32)
    table = rope.cos_sin_cache if variant == "deepseek_yarn" else rope.cos_sin_cache.to(dtype)
    rows = recorded.clone().view(torch.int16 if dtype != torch.float32 else torch.int32)
    Rerotation(Rotary(table, H, D, rope.rotary_dim, rope.is_neox_style), None, dtype, "cpu").apply(rows, t, p)
    got = rows.view(dtype).double()
    eps = torch.finfo(dtype).eps
    bound = 4 * eps * want.abs().amax(dim=1, keepdim=True)  # a few roundings of the row's largest element
    assert ((got - want).abs() <= bound).all(), float(((got - want).abs() / bound).max())
    assert torch.equal(rows[:8], recorded[:8].view(rows.dtype)), "a key replayed where it was recorded changed"
    wrapped = (recorded.double() - want).abs().amax(dim=1)
    assert (wrapped[8:] > 20 * bound[8:, 0]).float().mean() > 0.9  # unrotated: far from vLLM's keys


def _ropes(*specs):
    with set_current_vllm_config(VllmConfig()):
        return [get_rope(head, 4096, is_neox_style=neox, rope_parameters=params, dtype=torch.bfloat16)
                for head, neox, params in specs]


def test_the_models_rotary_embedding_gives_attention_and_mla_layers_their_rotary_part():
    from kvfill.connector.rotary_source import rotary_layers

    default = (64, True, {"rope_theta": 10000, "rope_type": "default"})
    rope, = _ropes(default)
    got = rotary_layers(_ropes(default, default), {"attn.0": (8, 64, 64), "state.1": None}, set(), torch.bfloat16)
    assert set(got) == {"attn.0"}  # the same embedding twice (a drafter's) is one; state layers have no keys
    r = got["attn.0"]
    assert (r.heads, r.head_stride, r.rotary_dim, r.neox, r.offset) == (8, 64, 64, True, 0)
    assert torch.equal(r.table, rope.cos_sin_cache.to(torch.bfloat16).float())  # what vLLM's forward reads
    mla_rope = (64, False, {"rope_theta": 10000, "rope_type": "deepseek_yarn", "factor": 40,
                            "original_max_position_embeddings": 4096, "beta_fast": 32, "beta_slow": 1,
                            "mscale": 1.0, "mscale_all_dim": 1.0})
    mla = rotary_layers(_ropes(mla_rope), {"mla.0": (1, 576, 0)}, set(), torch.bfloat16)["mla.0"]
    assert (mla.heads, mla.head_stride, mla.rotary_dim, mla.neox, mla.offset) == (1, 576, 64, False, 512)
    assert mla.table.dtype == torch.float32 and mla.table.shape[0] == 4096 * 40  # DeepSeek's own float32 table


@pytest.mark.parametrize("ropes,geometry,packed,match", [
    ([], {"a": (8, 64, 64)}, set(), r"has no rotary embedding"),
    ([(64, True, {"rope_theta": 10000}), (64, True, {"rope_theta": 1000000})], {"a": (8, 64, 64)}, set(),
     r"2 different rotary embeddings"),
    ("longrope", {"a": (8, 64, 64)}, set(), r"LongRoPE: vLLM picks short or long factors by max_model_len"),
    ([(64, True, {"rope_theta": 10000})], {"a": (8, 128, 128)}, set(), r"a \[8, 128, 128\]"),
    ([(64, True, {"rope_theta": 10000})], {"a": (8, 64, 64)}, {"a"}, r"packed fp8 rows"),
])
def test_what_cannot_be_matched_is_refused_naming_why(ropes, geometry, packed, match):
    from kvfill.connector.rotary_source import rotary_layers

    if ropes == "longrope":  # vLLM builds it only inside an engine's config: its class and attributes suffice
        longrope = type("Phi3LongRoPEScaledRotaryEmbedding", (), dict(head_size=64, rotary_dim=64, base=10000.0,
                                                                    is_neox_style=True))()
        found = [longrope]
    else:
        found = _ropes(*ropes)
    with pytest.raises(ValueError, match=match):
        rotary_layers(found, geometry, packed, torch.bfloat16)

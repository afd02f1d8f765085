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

from kvfill.bench.dsa_writers import indexer_row  # noqa: E402
from kvfill.kernels.rotary import Rerotation, Rotary  # noqa: E402


@pytest.fixture(autouse=True)
def _platform(vllm_cpu_platform):
    """VllmConfig() needs a platform: vLLM 0.34's CUDA wheel resolves none without a GPU (make test-vllm034)."""


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


def _keys(n=256, positions=40000, seed=0):
    """Raw keys [n, H, D], recorded positions p, true positions t (the first 8 where recorded)."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    x = torch.randn(n, H, D, generator=g, device="cpu")
    p = torch.randint(0, 2000, (n,), generator=g, device="cpu")
    t = (p + torch.randint(1, 60000, (n,), generator=g, device="cpu")).clamp_max(positions - 1)
    t[:8] = p[:8]
    return x, t, p


def test_fp8_keys_turned_to_their_true_positions_are_vllms_keys_there_within_fp8s_rounding():
    """vLLM's keys in bfloat16 quantised to fp8 e4m3 (scale 1: a per-tensor
    scale cancels in the turn) at p; turned to t they decode to vLLM's keys
    at t within two fp8 roundings (the recorded key's and the result's)."""
    with set_current_vllm_config(VllmConfig()):
        rope = get_rope(D, 40000, is_neox_style=True, rope_parameters=VARIANTS["llama3"][1], dtype=torch.bfloat16)
    x, t, p = _keys()
    x = x.to(torch.bfloat16) * 8
    q = torch.zeros_like(x)
    fp8 = torch.float8_e4m3fn
    recorded = rope.forward_native(p, q.clone(), x.clone())[1].reshape(len(x), -1).float().clamp(-448, 448).to(fp8)
    want = rope.forward_native(t, q.clone(), x.clone())[1].reshape(len(x), -1).double()
    rows = recorded.clone().view(torch.uint8)
    Rerotation(Rotary(rope.cos_sin_cache.to(torch.bfloat16), H, D, D, True), None, fp8, "cpu").apply(rows, t, p)
    got = rows.view(fp8).double()
    assert torch.isfinite(got).all()
    pair = torch.maximum(want.abs(), want.view(len(x), H, 2, D // 2).flip(2).reshape(len(x), -1).abs())
    bound = pair * 3 / 16 + 2.0 ** -9  # the recorded pair's rounding turned, the result's, fp8's subnormal step
    assert ((got - want).abs() <= bound).all(), float(((got - want).abs() - bound).max())
    assert torch.equal(rows[:8], recorded[:8].view(torch.uint8))
    far = (recorded.double() - want).abs().amax(dim=1) > 2 * bound.amax(dim=1)
    assert far[8:].float().mean() > 0.9


def _longrope(monkeypatch, max_model_len, dtype=torch.bfloat16):
    """vLLM's LongRoPE (Phi-3's factors' shape) built for an engine of ``max_model_len``."""
    from types import SimpleNamespace

    from vllm.model_executor.layers.rotary_embedding import phi3_long_rope_scaled_rope as mod

    monkeypatch.setattr(mod, "get_current_vllm_config",
                        lambda: SimpleNamespace(model_config=SimpleNamespace(max_model_len=max_model_len)))
    half = D // 2
    return mod.Phi3LongRoPEScaledRotaryEmbedding(
        D, D, 131072, 4096, 10000.0, True, dtype, short_factor=[1.0 + 0.05 * i for i in range(half)],
        long_factor=[1.0 + 1.5 * i for i in range(half)])


@pytest.mark.parametrize("recorded_len", [4096, 131072], ids=["recorded-short", "recorded-long"])
def test_longrope_keys_recorded_with_either_factors_are_turned_to_the_engines(monkeypatch, recorded_len):
    """A bank recorded at max_model_len 4096 (short factors) or 131072 (long)
    replayed by an engine at 131072 (long): the connector's Rotary turns
    every key from the recording's table (short: all of them, long: those
    past the end) and the result is vLLM's long-factor key at t."""
    from kvfill.connector.rotary_source import rotary_layers

    short, long = _longrope(monkeypatch, 4096), _longrope(monkeypatch, 131072)
    recorder = short if recorded_len == 4096 else long
    r = rotary_layers([long], {"a": (H, D, D)}, {}, torch.bfloat16, recorded_max_model_len=recorded_len)["a"]
    assert (r.source is not None) == (recorded_len == 4096)
    x, t, p = _keys(positions=131072)
    p = p.clamp_max(4095)
    x = x.to(torch.bfloat16).reshape(len(x), -1)
    recorded = recorder(p, torch.zeros_like(x), x.clone())[1]
    want = long(t, torch.zeros_like(x), x.clone())[1].double()
    rows = recorded.clone().view(torch.int16)
    Rerotation(r, None, torch.bfloat16, "cpu").apply(rows, t, p)
    got = rows.view(torch.bfloat16).double()
    bound = 4 * torch.finfo(torch.bfloat16).eps * want.abs().amax(dim=1, keepdim=True)
    assert ((got - want).abs() <= bound).all(), float(((got - want).abs() / bound).max())


def test_longrope_without_the_banks_max_model_len_is_refused(monkeypatch):
    from kvfill.connector.rotary_source import rotary_layers

    with pytest.raises(ValueError, match=r"the bank does not say the max_model_len it was recorded with"):
        rotary_layers([_longrope(monkeypatch, 131072)], {"a": (H, D, D)}, {}, torch.bfloat16)


DSA_YARN = {"rope_theta": 10000, "rope_type": "deepseek_yarn", "factor": 40, "original_max_position_embeddings": 4096,
            "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}


def test_deepseek_indexer_keys_quantised_by_vllms_writer_are_turned_to_vllms_keys_there():
    """DeepSeek-V3.2's indexer: a 128-element key whose first 64 are rotated
    NeoX style by its own embedding, quantised with one power-of-two scale
    (vLLM's writer's rule); turned, requantised with the rule, it decodes to
    vLLM's key at t within fp8's rounding."""
    from kvfill.connector.rotary_source import rotary_layers

    mla_rope, idx_rope = _ropes((64, False, DSA_YARN), (64, True, DSA_YARN))
    got_layers = rotary_layers([mla_rope, idx_rope], {"mla": (1, 576, 0), "idx": None, "ds": None},
                               {"idx": "indexer", "ds": "fp8_ds_mla"}, torch.bfloat16, indexer_neox=True)
    assert {n: (r.neox, r.packing, r.head_stride) for n, r in got_layers.items()} == {
        "mla": (False, None, 576), "idx": (True, "indexer", 128), "ds": (False, "fp8_ds_mla", 64)}
    n = 128
    g = torch.Generator(device="cpu").manual_seed(1)
    k = (torch.randn(n, 128, generator=g, device="cpu") * 2).to(torch.bfloat16)
    p = torch.randint(0, 2000, (n,), generator=g, device="cpu")
    t = p + torch.randint(1, 100000, (n,), generator=g, device="cpu")

    def at(pos):
        pe = idx_rope.forward_native(pos, torch.zeros(n, 1, 64, dtype=k.dtype), k[:, None, :64].clone())[1]
        return torch.cat([pe.reshape(n, 64), k[:, 64:]], dim=1).float()

    rows = indexer_row(at(p))
    Rerotation(got_layers["idx"], None, torch.uint8, "cpu").apply(rows, t, p)
    scale = rows[:, 128:].contiguous().view(torch.float32)
    got = rows[:, :128].contiguous().view(torch.float8_e4m3fn).double() * scale.double()
    want = at(t).double()
    # the recorded pair's rounding turned (<= |pair| sqrt(2) / 16, |pair| <= sqrt(2) x its larger element) and the
    # result's (<= 1/16), and fp8's subnormal step under the scale
    pair = torch.cat([torch.maximum(want[:, :64].abs(), want[:, :64].view(n, 2, 32).flip(1).reshape(n, 64).abs()),
                      want[:, 64:].abs()], dim=1)
    assert ((got - want).abs() <= pair * 3 / 16 + scale.double() * 2.0 ** -9).all()
    moved = (got[:, :64] - at(p).double()[:, :64]).abs().amax(dim=1)  # left as recorded (wrap): far from vLLM's
    assert moved.gt(pair[:, :64].amax(dim=1) / 2).float().mean() > 0.9


def test_two_pairings_without_an_indexer_to_tell_them_apart_are_refused():
    from kvfill.connector.rotary_source import rotary_layers

    with pytest.raises(ValueError, match=r"both NeoX and GPT-J pairs .* no DeepSeek indexer"):
        rotary_layers(_ropes((64, False, DSA_YARN), (64, True, DSA_YARN)), {"mla": (1, 576, 0)}, {},
                      torch.bfloat16)


def _ropes(*specs):
    with set_current_vllm_config(VllmConfig()):
        return [get_rope(head, 4096, is_neox_style=neox, rope_parameters=params, dtype=torch.bfloat16)
                for head, neox, params in specs]


def test_the_models_rotary_embedding_gives_attention_and_mla_layers_their_rotary_part():
    from kvfill.connector.rotary_source import rotary_layers

    default = (64, True, {"rope_theta": 10000, "rope_type": "default"})
    rope, = _ropes(default)
    got = rotary_layers(_ropes(default, default), {"attn.0": (8, 64, 64), "state.1": None}, {}, torch.bfloat16)
    assert set(got) == {"attn.0"}  # the same embedding twice (a drafter's) is one; state layers have no keys
    r = got["attn.0"]
    assert (r.heads, r.head_stride, r.rotary_dim, r.neox, r.offset) == (8, 64, 64, True, 0)
    assert torch.equal(r.table, rope.cos_sin_cache.to(torch.bfloat16).float())  # what vLLM's forward reads
    mla_rope = (64, False, {"rope_theta": 10000, "rope_type": "deepseek_yarn", "factor": 40,
                            "original_max_position_embeddings": 4096, "beta_fast": 32, "beta_slow": 1,
                            "mscale": 1.0, "mscale_all_dim": 1.0})
    mla = rotary_layers(_ropes(mla_rope), {"mla.0": (1, 576, 0)}, {}, torch.bfloat16)["mla.0"]
    assert (mla.heads, mla.head_stride, mla.rotary_dim, mla.neox, mla.offset) == (1, 576, 64, False, 512)
    assert mla.table.dtype == torch.float32 and mla.table.shape[0] == 4096 * 40  # DeepSeek's own float32 table


@pytest.mark.parametrize("ropes,geometry,packed,match", [
    ([], {"a": (8, 64, 64)}, {}, r"has no rotary embedding"),
    ([(64, True, {"rope_theta": 10000}), (64, True, {"rope_theta": 1000000})], {"a": (8, 64, 64)}, {},
     r"2 different rotary embeddings"),
    ("mrope", {"a": (8, 64, 64)}, {}, r"not one table row per position \(M-RoPE"),
    ([(64, True, {"rope_theta": 10000})], {"a": (8, 128, 128)}, {}, r"a \[8, 128, 128\]"),
    ([(64, True, {"rope_theta": 10000})], {"a": None}, {"a": "nvfp4_ds_mla"}, r"holds nvfp4_ds_mla rows"),
])
def test_what_cannot_be_matched_is_refused_naming_why(ropes, geometry, packed, match):
    from kvfill.connector.rotary_source import rotary_layers

    if ropes == "mrope":  # vLLM builds it only inside a multimodal engine's config: its class and attributes suffice
        mrope = type("MRotaryEmbedding", (), dict(head_size=64, rotary_dim=64, base=10000.0, is_neox_style=True))()
        found = [mrope]
    else:
        found = _ropes(*ropes)
    with pytest.raises(ValueError, match=match):
        rotary_layers(found, geometry, packed, torch.bfloat16)


def test_rotate_cuts_the_table_to_max_model_len_and_refuses_positions_past_it_at_start(monkeypatch):
    """Issue 61's second finding: a Llama of 4096 positions served at a
    longer max_model_len started silently, and its requests past the table
    failed in the step; now registration refuses it naming both lengths.
    Within the table, the device copy is cut to max_model_len rows, and
    ``rotary_table_bytes`` (what the fit counts before the bank is read)
    is that cut table's float32 bytes."""
    from kvfill.connector import rotary_source
    from kvfill.connector.rotary_source import rotary_layers, rotary_table_bytes

    default = (64, True, {"rope_theta": 10000, "rope_type": "default"})
    ropes = _ropes(default)
    with pytest.raises(ValueError, match=r"covers 4096 positions and max_model_len is 5000.*--max-model-len 4096"):
        rotary_layers(ropes, {"attn.0": (8, 64, 64)}, {}, torch.bfloat16, max_positions=5000)
    got = rotary_layers(ropes, {"attn.0": (8, 64, 64)}, {}, torch.bfloat16, max_positions=1000)["attn.0"]
    assert got.positions == 1000 and torch.equal(got.table, ropes[0].cos_sin_cache[:1000].to(torch.bfloat16).float())
    monkeypatch.setattr(rotary_source, "model_ropes", lambda: ropes)  # the process's embeddings, as after loading
    assert rotary_table_bytes(1000) == 1000 * 64 * 4 and rotary_table_bytes(10**6) == 4096 * 64 * 4

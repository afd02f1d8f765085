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


@pytest.mark.needs_vllm
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

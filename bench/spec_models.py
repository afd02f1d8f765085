"""The drafters of ``bench/check_presets.py spec``, made locally with random weights (no
network): the target's own weights as a separate draft model, an EAGLE head
for the tiny Llama, and a tiny MiMo-style model with one MTP layer.
"""
from __future__ import annotations

import json
import os
import shutil

from kvfill.bench.models import KV_HEADS, MODEL_LAYERS
from kvfill.bench.models import PEAKED_STD


def make_draft(model: str, draft: str) -> str:
    """The target's own weights in a folder of their own: vLLM loads it as a
    separate draft model (its own KV cache layers, ``draft_model.*``)."""
    if not os.path.exists(os.path.join(draft, "config.json")):
        shutil.copytree(model, draft + ".tmp", dirs_exist_ok=True)
        os.replace(draft + ".tmp", draft)
    return draft


def make_eagle_head(model: str, path: str, std: float = PEAKED_STD) -> str:
    """A random EAGLE head for the tiny Llama (vLLM's ``EagleLlamaForCausalLM``:
    ``fc`` over [token embedding, target hidden state], one decoder layer with
    no input norm, the target's embeddings and LM head), weights of ``std``.
    Random is enough for exactness: replay must give its KV and drafts as
    real prefill does, whatever it proposes."""
    if os.path.exists(os.path.join(path, "config.json")):
        return path
    import torch
    from safetensors.torch import save_file

    with open(os.path.join(model, "config.json")) as f:
        cfg = json.load(f)
    cfg.update(num_hidden_layers=1, architectures=["LlamaForCausalLM"])
    h, inter = cfg["hidden_size"], cfg["intermediate_size"]
    q = cfg["num_attention_heads"] * cfg["head_dim"]
    kv = cfg["num_key_value_heads"] * cfg["head_dim"]
    g = torch.Generator(device="cpu").manual_seed(7)
    rand = lambda *shape: (torch.randn(*shape, generator=g, device="cpu") * std).contiguous()  # noqa: E731
    weights = {"fc.weight": rand(h, 2 * h), "layers.0.self_attn.q_proj.weight": rand(q, h),
               "layers.0.self_attn.k_proj.weight": rand(kv, h), "layers.0.self_attn.v_proj.weight": rand(kv, h),
               "layers.0.self_attn.o_proj.weight": rand(h, q), "layers.0.mlp.gate_proj.weight": rand(inter, h),
               "layers.0.mlp.up_proj.weight": rand(inter, h), "layers.0.mlp.down_proj.weight": rand(h, inter),
               "layers.0.post_attention_layernorm.weight": torch.ones(h)}
    tmp = path + ".tmp"
    os.makedirs(tmp, exist_ok=True)
    save_file(weights, os.path.join(tmp, "model.safetensors"))
    with open(os.path.join(tmp, "config.json"), "w") as f:
        json.dump(cfg, f, indent=1)
    os.replace(tmp, path)
    return path


def make_mtp_model(path: str, std: float = PEAKED_STD) -> str:
    """A tiny MiMo-style model (``MiMoForCausalLM``: a Qwen2 with one MTP
    layer, ``model.mtp_layers.0``: norms of the token embedding and the
    hidden state, ``input_proj`` over both, one decoder block, a final norm),
    random weights of ``std``.  vLLM serves its MTP layer as a drafter
    (``method: mtp``) whose block caches KV as ``model.mtp_layers.4``.  Its
    tokenizer is the tiny Llama's (transformers reads a folder of a Qwen2
    config with its Qwen2 tokenizer class, whatever the folder holds)."""
    if os.path.exists(os.path.join(path, "config.json")):
        return path
    import torch
    from safetensors.torch import load_file, save_file
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    # vLLM's Qwen2 attention takes head_dim = hidden_size / heads (32 here), whatever the config says
    cfg = Qwen2Config(vocab_size=1024, hidden_size=256, intermediate_size=512, num_hidden_layers=MODEL_LAYERS,
                      num_attention_heads=KV_HEADS, num_key_value_heads=KV_HEADS, max_position_embeddings=32768,
                      initializer_range=std, tie_word_embeddings=False)
    tmp = path + ".tmp"
    Qwen2ForCausalLM(cfg).save_pretrained(tmp)
    weights = load_file(os.path.join(tmp, "model.safetensors"))
    g = torch.Generator(device="cpu").manual_seed(11)
    rand = lambda *shape: (torch.randn(*shape, generator=g, device="cpu") * std).contiguous()  # noqa: E731
    h, inter = cfg.hidden_size, cfg.intermediate_size
    q = KV_HEADS * (h // KV_HEADS)
    mtp = "model.mtp_layers.0."
    weights.update({mtp + "token_layernorm.weight": torch.ones(h), mtp + "hidden_layernorm.weight": torch.ones(h),
                    mtp + "final_layernorm.weight": torch.ones(h), mtp + "input_proj.weight": rand(h, 2 * h),
                    mtp + "input_layernorm.weight": torch.ones(h),
                    mtp + "post_attention_layernorm.weight": torch.ones(h)})
    for name, rows in (("q", q), ("k", q), ("v", q)):
        weights[f"{mtp}self_attn.{name}_proj.weight"] = rand(rows, h)
        weights[f"{mtp}self_attn.{name}_proj.bias"] = rand(rows)
    weights.update({mtp + "self_attn.o_proj.weight": rand(h, q), mtp + "mlp.gate_proj.weight": rand(inter, h),
                    mtp + "mlp.up_proj.weight": rand(inter, h), mtp + "mlp.down_proj.weight": rand(h, inter)})
    save_file(weights, os.path.join(tmp, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(tmp, "config.json")) as f:
        config = json.load(f)
    config.update(architectures=["MiMoForCausalLM"], num_nextn_predict_layers=1)
    with open(os.path.join(tmp, "config.json"), "w") as f:
        json.dump(config, f, indent=1)
    os.replace(tmp, path)
    return path

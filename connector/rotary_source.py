"""The model's rotary embedding, read from vLLM for ``past_bank: "rotate"``
(``kvfill/kernels/rotary.py``): which layers' keys are rotated, by which
cos/sin table, in which pairs.

vLLM builds every rotary embedding through ``get_rope``, which keeps each one
it made (``rotary_embedding._ROPE_DICT``): after the model is loaded - when a
worker registers its caches - they are the model's.  One embedding (or
several equal ones: a drafter's) gives every attention layer its table: a
layer of K/V geometry ``(H, D, Dv)`` with the embedding's ``head_size`` D
rotates ``rotary_dim`` elements from each head's start; an MLA row ``(1,
latent + rope, 0)`` its last ``rotary_dim`` (the RoPE part).  The table is
what vLLM's forward reads: ``cos_sin_cache`` in the model's dtype (DeepSeek's
YaRN keeps its own float32).  What cannot be matched is refused naming why,
never guessed: several different embeddings (per-layer-type bases, e.g.
Gemma 3), a layer whose head size is no embedding's, variants whose angle is
not one table row per position (LongRoPE's choice of factors by
max_model_len, which a bank may have been recorded with otherwise;
multimodal M-RoPE; dual-chunk attention), DeepSeek's packed fp8 rows.
"""
from __future__ import annotations

from typing import Any, Mapping

import torch

from kvfill.kernels.rotary import Rotary

# vLLM's rotary embeddings whose key at position t is row t of cos_sin_cache applied to the raw key.
TABLE_PER_POSITION = {
    "RotaryEmbedding", "LinearScalingRotaryEmbedding", "Llama3RotaryEmbedding", "YaRNScalingRotaryEmbedding",
    "DeepseekScalingRotaryEmbedding", "DynamicNTKScalingRotaryEmbedding", "NTKScalingRotaryEmbedding",
    "DynamicNTKAlphaRotaryEmbedding",
}
OWN_DTYPE = {"DeepseekScalingRotaryEmbedding"}  # forward reads the table as it is (float32), not in the keys' dtype


def model_ropes() -> list[Any]:
    """The rotary embeddings vLLM made in this process (the loaded model's)."""
    from vllm.model_executor.layers.rotary_embedding import _ROPE_DICT

    return list(_ROPE_DICT.values())


def _describe(rope) -> str:
    return (f"{type(rope).__name__}(head_size {rope.head_size}, rotary_dim {rope.rotary_dim}, base {rope.base}, "
            f"{'NeoX' if rope.is_neox_style else 'GPT-J'} pairs)")


def _same(a, b) -> bool:
    ca, cb = getattr(a, "cos_sin_cache", None), getattr(b, "cos_sin_cache", None)
    if a is b:
        return True
    return (type(a) is type(b) and a.head_size == b.head_size and a.rotary_dim == b.rotary_dim
            and a.is_neox_style == b.is_neox_style and isinstance(ca, torch.Tensor) and isinstance(cb, torch.Tensor)
            and ca.shape == cb.shape and torch.equal(ca.cpu(), cb.cpu()))


def rotary_layers(ropes: list[Any], kv_geometry: Mapping[str, tuple[int, int, int] | None], packed: set[str],
                  model_dtype: torch.dtype) -> dict[str, Rotary]:
    """Layer -> its ``Rotary`` for every layer of K/V geometry (module
    docstring); ValueError naming what cannot be matched."""
    distinct = []
    for r in ropes:
        if not any(_same(r, d) for d in distinct):
            distinct.append(r)
    if not distinct:
        raise ValueError("past_bank 'rotate': the model has no rotary embedding vLLM made with get_rope; its keys "
                         "carry no rotary position to correct - use past_bank 'wrap'")
    if len(distinct) > 1:
        raise ValueError(f"past_bank 'rotate': the model has {len(distinct)} different rotary embeddings "
                         f"({'; '.join(_describe(r) for r in distinct[:4])}); which layer uses which is not known "
                         f"here - use past_bank 'wrap'")
    rope = distinct[0]
    kind = type(rope).__name__
    if kind not in TABLE_PER_POSITION:
        raise ValueError(f"past_bank 'rotate': the model's rotary embedding is {_describe(rope)}, whose angle is "
                         f"not one table row per position of one table (LongRoPE: vLLM picks short or long factors "
                         f"by max_model_len, and a bank recorded with the other choice needs every key turned, not "
                         f"only those past its end; M-RoPE has three positions); re-rotating it is not implemented - "
                         f"use past_bank 'wrap'")
    if packed:
        raise ValueError(f"past_bank 'rotate': {len(packed)} layers hold DeepSeek's packed fp8 rows "
                         f"({sorted(packed)[0]}...); dequantising, rotating and requantising them with their scales "
                         f"is not implemented - use past_bank 'wrap'")
    table = rope.cos_sin_cache if kind in OWN_DTYPE else rope.cos_sin_cache.to(model_dtype)
    table = table.detach().to("cpu", torch.float32)
    out, unmatched = {}, []
    for name, kv in kv_geometry.items():
        if kv is None:  # recurrent state, or rows in their cache's own order: no keys of a known geometry
            continue
        heads, head, value = kv
        if value and head == rope.head_size:
            out[name] = Rotary(table, heads, head, rope.rotary_dim, rope.is_neox_style)
        elif not value and heads == 1 and head > rope.rotary_dim and rope.head_size == rope.rotary_dim:
            out[name] = Rotary(table, 1, head, rope.rotary_dim, rope.is_neox_style, offset=head - rope.rotary_dim)
        else:
            unmatched.append(f"{name} {list(kv)}")
    if unmatched:
        raise ValueError(f"past_bank 'rotate': {len(unmatched)} layers' K/V geometry matches no head of "
                         f"{_describe(rope)} (first: {unmatched[0]}) - use past_bank 'wrap'")
    return out


def worker_rotary(vllm_config, groups, kv_geometry: Mapping, packed) -> dict[str, Rotary]:
    """A replaying worker's rotary layers (``rotary_layers`` over its replayed
    groups' layers, this process's embeddings), logged; refused for a model
    declaring layers without RoPE, which the caches cannot tell apart."""
    import logging

    model = vllm_config.model_config
    nope = [i for i, r in enumerate(getattr(model.hf_config, "no_rope_layers", None) or []) if not r]
    if nope:  # layers of the same geometry without RoPE (Llama 4, SmolLM3): not told apart here
        raise ValueError(f"past_bank 'rotate': the model declares {len(nope)} layers without RoPE (no_rope_layers, "
                         f"first: {nope[0]}); their keys would be turned as rotary ones - use past_bank 'wrap'")
    replayed = {n: kv_geometry.get(n) for g in groups.values() if g.mode is None for n in g.layers}
    rotary = rotary_layers(model_ropes(), replayed, set(packed) & set(replayed), model.dtype)
    logging.getLogger("vllm.kvfill.connector").info(
        "KVFillConnector: past_bank 'rotate': the keys of %d layers past each recorded sequence's end are re-rotated "
        "to their true positions", len(rotary))
    return rotary

"""The model's rotary embedding, read from vLLM for ``past_bank: "rotate"``
(``kvfill/kernels/rotary.py``): which layers' keys are rotated, by which
cos/sin table, in which pairs.

vLLM builds every rotary embedding through ``get_rope``, which keeps each one
it made (``rotary_embedding._ROPE_DICT``): after the model is loaded - when a
worker registers its caches - they are the model's.  One table gives every
layer its angles: a layer of K/V geometry ``(H, D, Dv)`` with the
embedding's ``head_size`` D rotates ``rotary_dim`` elements from each head's
start; an MLA row ``(1, latent + rope, 0)`` its last ``rotary_dim`` (the
RoPE part).  The table is what vLLM's forward reads: ``cos_sin_cache`` in
the model's dtype (DeepSeek's YaRN keeps its own float32).

* LongRoPE (Phi-3 and kin): vLLM uses the long factors when
  ``max_model_len`` exceeds ``original_max_position_embeddings``, else the
  short ones; the bank's ``max_model_len`` (its provenance) says which the
  recording used, and where the two differ every key is turned from the
  recording's table to the engine's (``Rotary.source``).
* DeepSeek's sparse attention (V3.2, GLM-5): MLA's RoPE part pairs GPT-J
  style (vLLM builds it so), the indexer's keys NeoX style unless the
  config's ``indexer_rope_interleave`` - two embeddings of one table; the
  indexer's rows and ``fp8_ds_mla`` rows are turned in their packed bytes.

* Per-layer-type embeddings (Gemma 3: base 10000 on its sliding-window
  layers, 1e6 on its full ones): where the config keys ``rope_parameters``
  by the names in ``layer_types``, each layer is turned by the table of its
  own type (``layer_ropes``): its type is ``layer_types`` at its index in
  vLLM's layer name, and its type's embedding is the one ``get_rope`` made
  from that type's parameters (its cache's key holds them).

What cannot be matched is refused naming why, never guessed: several
different tables no layer type tells apart, a layer whose head size is no
embedding's, multimodal M-RoPE and dual-chunk attention (not one table row
per position), ``nvfp4_ds_mla`` rows, a LongRoPE bank that does not say its
``max_model_len``.
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
LONGROPE = "Phi3LongRoPEScaledRotaryEmbedding"  # short and long tables in one buffer, picked by max_model_len
OWN_DTYPE = {"DeepseekScalingRotaryEmbedding"}  # forward reads the table as it is (float32), not in the keys' dtype
ROTATED_PACKINGS = {"indexer": "indexer", "indexer_mx": "indexer_mx", "fp8_ds_mla": "fp8_ds_mla"}
WRAP = " - use past_bank 'wrap'"


def model_ropes() -> list[Any]:
    """The rotary embeddings vLLM made in this process (the loaded model's)."""
    return list(made_ropes().values())


def made_ropes() -> dict[tuple, Any]:
    """vLLM's cache of the rotary embeddings it made in this process:
    ``get_rope``'s key (head size, rotary dim, positions, pairing, the rope
    parameters as a tuple of items, ...) -> the embedding."""
    from vllm.model_executor.layers.rotary_embedding import _ROPE_DICT

    return dict(_ROPE_DICT)


def layer_type_parameters(hf) -> dict[str, dict] | None:
    """Each layer type's rope parameters where the config gives every type
    in ``layer_types`` its own (transformers' ``rope_parameters`` keyed by
    type: Gemma 3's ``sliding_attention`` and ``full_attention``); None for
    one set of parameters for every layer."""
    types, params = getattr(hf, "layer_types", None), getattr(hf, "rope_parameters", None)
    if not types or not isinstance(params, dict) or not all(isinstance(params.get(t), dict) for t in types):
        return None
    return {t: params[t] for t in dict.fromkeys(types)}


def layer_ropes(hf, names, made: Mapping[tuple, Any]) -> dict[str, Any] | None:
    """Layer name -> the rotary embedding of its layer type (module
    docstring), for a config with rope parameters per layer type; None for
    any other.  ``made``: ``made_ropes()``.  ValueError naming the type
    whose parameters made no embedding or several different tables, or a
    layer whose index in its name is past ``layer_types``."""
    from vllm.model_executor.models.utils import extract_layer_index

    per_type = layer_type_parameters(hf)
    if per_type is None:
        return None

    def items(p: Mapping) -> dict:  # as get_rope keys them: lists become tuples
        return {k: tuple(v) if isinstance(v, list) else v for k, v in p.items()}

    ropes = {}
    for kind, params in per_type.items():
        found: list = []
        for key, rope in made.items():
            args = key[4] if isinstance(key, tuple) and len(key) > 4 else None
            if isinstance(args, tuple) and dict(args) == items(params) and not any(_same_table(rope, f) for f in found):
                found.append(rope)
        if len(found) != 1:
            raise ValueError(f"past_bank 'rotate': the config's rope_parameters for layer type {kind!r} ({params}) "
                             f"made {len(found)} different rotary embeddings in vLLM "
                             f"({'; '.join(_describe(r) for r in found[:4]) or 'none'}); expected one{WRAP}")
        ropes[kind] = found[0]
    types, out = list(hf.layer_types), {}
    for name in names:
        index = extract_layer_index(name)
        if not 0 <= index < len(types):
            raise ValueError(f"past_bank 'rotate': layer {name}'s index {index} is past the config's "
                             f"{len(types)} layer_types, so its rotary embedding is not known{WRAP}")
        out[name] = ropes[types[index]]
    return out


def _neox(rope) -> bool:
    """NeoX pairs (LongRoPE has only those, and no attribute saying so)."""
    return bool(getattr(rope, "is_neox_style", type(rope).__name__ == LONGROPE))


def _describe(rope) -> str:
    return (f"{type(rope).__name__}(head_size {rope.head_size}, rotary_dim {rope.rotary_dim}, base {rope.base}, "
            f"{'NeoX' if _neox(rope) else 'GPT-J'} pairs)")


def _buffer(rope) -> torch.Tensor | None:
    for name in ("cos_sin_cache", "long_short_cos_sin_cache"):
        if isinstance(getattr(rope, name, None), torch.Tensor):
            return getattr(rope, name)
    return None


def _same_table(a, b) -> bool:
    """The same angles at every position (the pairing style aside)."""
    ca, cb = _buffer(a), _buffer(b)
    return a is b or (type(a) is type(b) and a.head_size == b.head_size and a.rotary_dim == b.rotary_dim
                      and getattr(a, "use_long_rope", None) == getattr(b, "use_long_rope", None)
                      and ca is not None and cb is not None and ca.shape == cb.shape
                      and torch.equal(ca.cpu(), cb.cpu()))


def _tables(rope, model_dtype: torch.dtype,
            recorded_max_model_len: int | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(the table vLLM's forward reads, the one the bank was recorded with where it is another) as float32."""
    kind = type(rope).__name__
    if kind == LONGROPE:
        orig = int(rope.original_max_position_embeddings)
        both = rope.long_short_cos_sin_cache.detach().to("cpu", torch.float32)  # in the model's dtype already
        short, long = both[:orig], both[orig:]
        if recorded_max_model_len is None:
            raise ValueError(f"past_bank 'rotate': the model's LongRoPE uses short or long factors by max_model_len "
                             f"(long above {orig}), and the bank does not say the max_model_len it was recorded "
                             f"with{WRAP}, or record it again")
        engine, bank = bool(rope.use_long_rope), recorded_max_model_len > orig
        return (long if engine else short), (None if engine == bank else (long if bank else short))
    if kind not in TABLE_PER_POSITION:
        raise ValueError(f"past_bank 'rotate': the model's rotary embedding is {_describe(rope)}, whose angle is not "
                         f"one table row per position (M-RoPE has three positions; dual-chunk attention its own "
                         f"chunks); re-rotating it is not implemented{WRAP}")
    table = rope.cos_sin_cache if kind in OWN_DTYPE else rope.cos_sin_cache.to(model_dtype)
    return table.detach().to("cpu", torch.float32), None


def rotary_layers(ropes: list[Any], kv_geometry: Mapping[str, tuple[int, int, int] | None],
                  packed: Mapping[str, str], model_dtype: torch.dtype, *, indexer_neox: bool | None = None,
                  recorded_max_model_len: int | None = None, max_positions: int | None = None,
                  by_layer: Mapping[str, Any] | None = None) -> dict[str, Rotary]:
    """Layer -> its ``Rotary`` for every layer of K/V geometry or of a
    rotated packing (``packed``: layer -> its packed kind, ``indexer_mx``
    for an indexer whose scales are UE8M0 bytes), module docstring;
    ``indexer_neox``: the indexer's pairing (DeepSeek's sparse attention);
    ``max_positions``: the serving max_model_len - the tables are cut to
    the positions a fill can reach (true and recorded alike: the bank is
    cut there too), as they go to the device; ValueError naming what
    cannot be matched.  ``by_layer``: each layer's own embedding
    (``layer_ropes``), where the model has one per layer type: the layers
    of each distinct table are matched to it as above."""
    if by_layer is not None:
        return _per_layer(by_layer, kv_geometry, packed, model_dtype, recorded_max_model_len, max_positions)
    tables = []
    for r in ropes:
        if not any(_same_table(r, d) for d in tables):
            tables.append(r)
    if not tables:
        raise ValueError(f"past_bank 'rotate': the model has no rotary embedding vLLM made with get_rope; its keys "
                         f"carry no rotary position to correct{WRAP}")
    if len(tables) > 1:
        raise ValueError(f"past_bank 'rotate': the model has {len(tables)} different rotary embeddings "
                         f"({'; '.join(_describe(r) for r in tables[:4])}); which layer uses which is not known "
                         f"here{WRAP}")
    rope = tables[0]
    styles = {_neox(r) for r in ropes}
    indexers = [n for n, k in packed.items() if k in ("indexer", "indexer_mx")]
    if len(styles) > 1 and (not indexers or indexer_neox is None):
        raise ValueError(f"past_bank 'rotate': the model has rotary embeddings of one table with both NeoX and GPT-J "
                         f"pairs ({_describe(rope)}) and no DeepSeek indexer to tell their layers apart{WRAP}")
    style = styles.pop() if len(styles) == 1 else not indexer_neox  # MLA's and attention's; the indexer's its own
    table, source = _tables(rope, model_dtype, recorded_max_model_len)
    if max_positions is not None and max_positions > table.shape[0]:
        raise ValueError(f"past_bank 'rotate': the model's rotary table ({_describe(rope)}) covers "
                         f"{table.shape[0]} positions and max_model_len is {max_positions}: a key at a position "
                         f"from {table.shape[0]} on has no angle to be turned to. Serve with --max-model-len "
                         f"{table.shape[0]} or less, or use past_bank 'wrap'")
    table, source = (None if t is None else t[:max_positions] for t in (table, source))
    out, unmatched = {}, []
    for name, kv in kv_geometry.items():
        kind = packed.get(name)
        if kind is not None:
            if kind not in ROTATED_PACKINGS:
                raise ValueError(f"past_bank 'rotate': {name} holds {kind} rows, whose RoPE part is not re-rotated "
                                 f"(e4m3 values with their own scales){WRAP}")
            indexer = kind != "fp8_ds_mla"
            out[name] = Rotary(table, 1, 128 if indexer else 64, rope.rotary_dim,
                               (indexer_neox if indexer and indexer_neox is not None else style),
                               source=source, packing=ROTATED_PACKINGS[kind])
            continue
        if kv is None:  # recurrent state, or rows in their cache's own order: no keys of a known geometry
            continue
        heads, head, value = kv
        if value and head == rope.head_size:
            out[name] = Rotary(table, heads, head, rope.rotary_dim, style, source=source)
        elif not value and heads == 1 and head > rope.rotary_dim and rope.head_size == rope.rotary_dim:
            out[name] = Rotary(table, 1, head, rope.rotary_dim, style, offset=head - rope.rotary_dim, source=source)
        else:
            unmatched.append(f"{name} {list(kv)}")
    if unmatched:
        raise ValueError(f"past_bank 'rotate': {len(unmatched)} layers' K/V geometry matches no head of "
                         f"{_describe(rope)} (first: {unmatched[0]}){WRAP}")
    return out


def _per_layer(by_layer: Mapping[str, Any], kv_geometry: Mapping, packed: Mapping[str, str],
               model_dtype: torch.dtype, recorded_max_model_len: int | None,
               max_positions: int | None) -> dict[str, Rotary]:
    """``rotary_layers`` for layers each with its own embedding: one table
    per distinct embedding, shared by its layers."""
    if packed:
        raise ValueError(f"past_bank 'rotate': per-layer-type rotary embeddings with DeepSeek's packed rows "
                         f"({sorted(set(packed.values()))}) are not matched{WRAP}")
    groups: list[tuple[Any, dict]] = []
    for name, kv in kv_geometry.items():
        if kv is None:
            continue
        if name not in by_layer:
            raise ValueError(f"past_bank 'rotate': layer {name} has keys but no layer type's rotary embedding{WRAP}")
        group = next((g for r, g in groups if _same_table(r, by_layer[name])), None)
        if group is None:
            groups.append((by_layer[name], group := {}))
        group[name] = kv
    out: dict[str, Rotary] = {}
    for rope, layers in groups:
        out.update(rotary_layers([rope], layers, {}, model_dtype, recorded_max_model_len=recorded_max_model_len,
                                 max_positions=max_positions))
    return out


def worker_rotary(vllm_config, groups, kv_geometry: Mapping, packed: Mapping[str, str],
                  bank_metadata: Mapping[str, str]) -> dict[str, Rotary]:
    """A replaying worker's rotary layers (``rotary_layers`` over its replayed
    groups' layers, this process's embeddings, the bank's recorded
    ``max_model_len``), logged; refused for a model declaring layers without
    RoPE, which the caches cannot tell apart."""
    import logging

    from .packed import INDEXER, indexer_mx_scales

    model = vllm_config.model_config
    hf = model.hf_config
    nope = [i for i, r in enumerate(getattr(hf, "no_rope_layers", None) or []) if not r]
    if nope:  # layers of the same geometry without RoPE (Llama 4, SmolLM3): not told apart here
        raise ValueError(f"past_bank 'rotate': the model declares {len(nope)} layers without RoPE (no_rope_layers, "
                         f"first: {nope[0]}); their keys would be turned as rotary ones{WRAP}")
    replayed = {n: kv_geometry.get(n) for g in groups.values() if g.mode is None for n in g.layers}
    kinds = {n: ("indexer_mx" if indexer_mx_scales() else "indexer") if k == INDEXER else k
             for n, k in packed.items() if n in replayed}
    recorded = bank_metadata.get("max_model_len")
    made = made_ropes()
    by_layer = layer_ropes(getattr(model, "hf_text_config", None) or hf,
                           [n for n, kv in replayed.items() if kv is not None], made)
    rotary = rotary_layers(list(made.values()), replayed, kinds, model.dtype, by_layer=by_layer,
                           indexer_neox=not getattr(hf, "indexer_rope_interleave", False) if kinds else None,
                           recorded_max_model_len=int(recorded) if str(recorded or "").isdigit() else None,
                           max_positions=model.max_model_len or None)
    turned_all = sum(r.source is not None for r in rotary.values())
    logging.getLogger("vllm.kvfill.connector").info(
        "KVFillConnector: past_bank 'rotate': the keys of %d layers past each recorded sequence's end are re-rotated "
        "to their true positions%s", len(rotary),
        f" (every key of {turned_all}: the bank was recorded with LongRoPE's other factors)" if turned_all else "")
    return rotary


def rotary_table_bytes(max_positions: int) -> int:
    """Device bytes ``past_bank: "rotate"`` keeps for this process's rotary
    tables, known before the bank is read (the fit counts them,
    ``bank_fit.choose_placement``): each distinct table once, float32, cut to
    ``max_positions``, and a LongRoPE model's other table as well (a bank
    recorded with the other factors is turned from it)."""
    distinct = []
    for r in model_ropes():
        if not any(_same_table(r, d) for d in distinct):
            distinct.append(r)
    total = 0
    for r in distinct:
        cache = getattr(r, "cos_sin_cache", getattr(r, "long_short_cos_sin_cache", None))
        rows = min(int(cache.shape[0]) if isinstance(cache, torch.Tensor) else max_positions, max_positions)
        total += (2 if type(r).__name__ == LONGROPE else 1) * rows * int(r.rotary_dim) * 4
    return total

"""One canonical bank from the parts the workers saved (``connector/recorder.py``).

Each worker saves, per recorded prompt, one file of its part:
``<key>.tp<r>-pp<p>.safetensors`` holding its layers (its pipeline stage's),
each ``[N, row]`` of its KV heads in canonical order (K of its heads, then
their V), with metadata naming the heads ``[lo, hi)`` of the model's ``total``
each layer holds, how many files the run writes per prompt and how the
worker's vLLM stores an indexer token's scale (``indexer_scales``, the
bank's provenance).  Here the parts of every prompt are checked - the
expected number of files, every layer from one pipeline stage, every head of
every layer exactly once, one scale encoding - and merged:
a layer's K columns in head order, then its V columns, the prompts one after
another (a ragged bank, ``kvfill/bank/format.py``).
"""
from __future__ import annotations

import glob
import json
import os
from typing import Sequence

import torch

from kvfill.bank import Bank, BankError, sequence_key
from kvfill.bank.state import layouts_from_json, state_tensor_name


def rows_path(work: str, token_ids: Sequence[int], tp_rank: int = 0, pp_rank: int = 0) -> str:
    """Where the worker of TP rank ``tp_rank``, PP rank ``pp_rank`` saves a prompt's rows."""
    return os.path.join(work, f"{sequence_key(token_ids)}.tp{tp_rank}-pp{pp_rank}.safetensors")


class _Part:
    """One worker's file for one prompt."""

    def __init__(self, path: str):
        from safetensors import safe_open

        with safe_open(path, framework="pt") as f:
            meta = f.metadata()
            tensors = {name: f.get_tensor(name) for name in f.keys()}
        try:
            self.heads = json.loads(meta["heads"])
            self.files = int(meta["files_per_prompt"])
            self.layers = json.loads(meta["layers"])
            self.value_dtypes = json.loads(meta["value_dtypes"])
            self.tp_rank, self.tp_size = int(meta["tp_rank"]), int(meta.get("tp_size", "1"))
            self.state_layouts = layouts_from_json(meta.get("states"), path)
            self.where = f"TP rank {meta['tp_rank']}, PP rank {meta['pp_rank']}"
            self.indexer_scales = meta.get("indexer_scales")  # None: a part of a kvfill that did not write it
        except (KeyError, ValueError, TypeError) as exc:
            raise RuntimeError(f"{path}: not a recorder's rows file (metadata {exc})") from None
        state_names = {state_tensor_name(n, i): n for n, lay in self.state_layouts.items() for i in range(len(lay))}
        self.rows = {n: t for n, t in tensors.items() if n not in state_names}
        # layer -> its state tensors [1, *local shape], in spec order
        self.states = {n: [tensors[state_tensor_name(n, i)] for i in range(len(lay))]
                       for n, lay in self.state_layouts.items()}
        self.path = path


def check_parts_agree(name: str, parts: list[tuple], where: str) -> None:
    """Every part of a layer ``(heads, rows, kv, origin)`` holds the same
    dtype and the same head_size / head_size_v as the first: merged, parts
    of two dtypes would be promoted silently, and two geometries of one row
    width would split K from V at the wrong column."""
    _, rows0, kv0, origin0 = parts[0]
    for _, rows, kv, origin in parts[1:]:
        if rows.dtype != rows0.dtype:
            raise RuntimeError(f"{where}: layer {name!r} arrived as {rows.dtype} from {origin} and as {rows0.dtype} "
                               f"from {origin0}; every worker records the same cache dtype")
        if (kv is None) != (kv0 is None) or (kv is not None and list(kv[1:]) != list(kv0[1:])):
            raise RuntimeError(f"{where}: layer {name!r} arrived with kv {kv} (heads, head_size, head_size_v) from "
                               f"{origin} and {kv0} from {origin0}; every worker's heads have the same sizes")


def merge_layer(name: str, parts: list[tuple], kv: Sequence[int] | None,
                where: str) -> tuple[torch.Tensor, list[int] | None]:
    """A layer's canonical rows from its parts ``([lo, hi, total], rows, kv,
    origin)``, after checking they agree (``check_parts_agree``) and hold
    each of its heads exactly once; and its kv."""
    check_parts_agree(name, parts, where)
    parts = [(heads, rows) for heads, rows, _, _ in parts]
    if kv is None:  # no K/V geometry: recorded whole on one worker (the recorder refuses it under TP)
        if len(parts) != 1:
            raise RuntimeError(f"{where}: layer {name!r} (no K/V geometry) arrived {len(parts)} times; expected once")
        return parts[0][1], None
    _, d, dv = (int(x) for x in kv)
    parts = sorted(parts, key=lambda p: p[0][0])
    total = parts[0][0][2]
    ranges = [(lo, hi) for (lo, hi, _), _ in parts]
    if any(p[0][2] != total for p in parts) or [lo for lo, _ in ranges] != [0] + [hi for _, hi in ranges[:-1]] \
            or ranges[-1][1] != total:
        raise RuntimeError(f"{where}: layer {name!r} arrived with KV heads {ranges} of {total}; expected each of "
                           f"[0, {total}) exactly once (a worker's rows missing or saved twice)")
    bad = [((lo, hi), tuple(rows.shape)) for (lo, hi, _), rows in parts
           if rows.shape[1] != (hi - lo) * (d + dv) or rows.shape[0] != parts[0][1].shape[0]]
    if bad:
        raise RuntimeError(f"{where}: layer {name!r} parts {bad} are not [positions, heads x {d + dv}] rows of the "
                           f"same positions (heads, shape)")
    keys = [rows[:, :(hi - lo) * d] for (lo, hi, _), rows in parts]
    values = [rows[:, (hi - lo) * d:] for (lo, hi, _), rows in parts]
    return torch.cat(keys + values, dim=1) if len(parts) > 1 else parts[0][1], [total, d, dv]


def merge_states(name: str, parts: list, where: str) -> tuple[list[torch.Tensor], tuple]:
    """A state layer's full tensors from every TP rank's part ``(tp_rank,
    tp_size, layout, tensors, origin)``, after checking each rank arrived
    once with one layout (``StateTensor.merge``)."""
    parts = sorted(parts, key=lambda p: p[0])
    size, layout = parts[0][1], parts[0][2]
    if [p[0] for p in parts] != list(range(size)) or any(p[1] != size or p[2] != layout for p in parts):
        raise RuntimeError(f"{where}: state layer {name!r} arrived from TP ranks {[p[0] for p in parts]} of "
                           f"{[p[1] for p in parts]} ({[p[4] for p in parts]}); expected each of {size} ranks "
                           f"once, with one layout")
    for r, _, _, tensors, origin in parts:
        want = [st.local_shape(r, size) for st in layout]
        got = [tuple(t.shape[1:]) for t in tensors]
        if got != want or [t.dtype for t in tensors] != [st.dtype for st in layout]:
            raise RuntimeError(f"{where}: state layer {name!r} from {origin} holds {got} of "
                               f"{[str(t.dtype) for t in tensors]}; its layout names {want}")
    try:
        return [st.merge([p[3][i] for p in parts], f"{where}: state layer {name!r}")
                for i, st in enumerate(layout)], layout
    except BankError as exc:
        raise RuntimeError(str(exc)) from None


def assemble(work: str, unique: list, meta: dict, out: str) -> Bank:
    """The bank of the rows recorded in ``work`` for the prompts ``unique``
    (their recorded tokens), the sequences one after another."""
    layers: dict[str, list[torch.Tensor]] = {}
    states: dict[str, list[list[torch.Tensor]]] = {}  # state layer -> per prompt, its full tensors [1, *shape]
    layouts: dict = {}
    kvs, info, value_dtypes, merged = {}, {}, {}, set()
    scales: dict[str, str] = {}  # indexer scale encoding -> a part that recorded with it
    for t in unique:
        key = sequence_key(t)
        paths = sorted(glob.glob(os.path.join(work, f"{key}.tp*-pp*.safetensors")))
        if not paths:
            raise RuntimeError(f"vLLM ran, but no rows were recorded for a prompt of {len(t)} tokens "
                               f"({rows_path(work, t)})")
        parts = [_Part(p) for p in paths]
        if any(p.files != len(parts) for p in parts):
            raise RuntimeError(f"a prompt of {len(t)} tokens has {len(parts)} rows files "
                               f"({[os.path.basename(p) for p in paths]}); its workers expected "
                               f"{parts[0].files}: a worker's rows are missing")
        by_layer: dict[str, list] = {}
        by_state: dict[str, list] = {}
        for p in parts:
            value_dtypes.update(p.value_dtypes)
            if p.indexer_scales is not None:
                scales.setdefault(p.indexer_scales, f"{p.where} ({os.path.basename(p.path)})")
            for name, rows in p.rows.items():
                info[name] = p.layers.get(name) or {}
                kv = info[name].get("kv")
                by_layer.setdefault(name, []).append((p.heads.get(name, [0, 1, 1]), rows, kv, p.where))
            for name, tensors in p.states.items():
                by_state.setdefault(name, []).append((p.tp_rank, p.tp_size, p.state_layouts[name], tensors, p.where))
        if (layers or states) and set(by_state) != set(states):
            raise RuntimeError(f"a prompt of {len(t)} tokens was recorded with state layers {sorted(by_state)[:4]}, "
                               f"an earlier one with {sorted(states)[:4]}: every prompt needs every layer")
        for name, got in by_state.items():
            tensors, layout = merge_states(name, got, f"prompt {key}")
            if name in layouts and layout != layouts[name]:
                raise RuntimeError(f"prompt {key}: state layer {name!r} arrived with another layout than an earlier "
                                   f"prompt's")
            layouts[name] = layout
            states.setdefault(name, []).append(tensors)
        if layers and set(by_layer) != set(layers):
            raise RuntimeError(f"a prompt of {len(t)} tokens was recorded with layers {sorted(by_layer)[:4]}..., "
                               f"an earlier one with {sorted(layers)[:4]}...: every prompt needs every layer")
        for name, got in by_layer.items():
            rows, kv = merge_layer(name, got, got[0][2], f"prompt {key}")
            if name in layers and (rows.dtype != layers[name][0].dtype or kv != kvs[name]):
                raise RuntimeError(f"prompt {key}: layer {name!r} arrived as {rows.dtype} with kv {kv}, an earlier "
                                   f"prompt's as {layers[name][0].dtype} with kv {kvs[name]}; every prompt is "
                                   f"recorded by the same workers and caches")
            kvs[name] = kv
            if len(got) > 1:  # a worker's cache dims name its heads only: not the merged row's
                merged.add(name)
            layers.setdefault(name, []).append(rows)
    if len(scales) > 1:  # workers on GPUs of two kinds (an H200 node and a B200 node): one bank cannot say which
        raise RuntimeError(f"the workers stored indexer scales in {len(scales)} encodings "
                           f"({'; '.join(f'{k} on {w}' for k, w in sorted(scales.items()))}); record on GPUs of one "
                           f"kind, whose vLLM stores them one way")
    first = next(iter(layers.values()))[0]
    meta = {**meta, "dtype": str(first.dtype).removeprefix("torch.")}
    if scales:
        meta["indexer_scales"] = next(iter(scales))
    return Bank({name: torch.cat(rows) for name, rows in layers.items()},
                sequence_lengths=[len(t) for t in unique], sequence_tokens=unique,
                value_dtypes={k: v for k, v in value_dtypes.items() if k in layers},
                kv={k: v for k, v in kvs.items() if v},
                parts={k: v["parts"] for k, v in info.items() if k in layers and k not in merged},
                states={n: [torch.cat(ts) for ts in zip(*per)] for n, per in states.items()},
                state_layouts=layouts, metadata=meta, source=out)

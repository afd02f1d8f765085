"""A bank checked against one cache: a layer's rows in the cache's element
order (``check_rows``), a state layer's recorded states as the cache's state
pages (``state_pages``); each refusal a BankError naming what differs.
``bank`` is a ``bank.Bank``, read through its fields only (``Bank``'s own
methods call these, so this file does not import it)."""
from __future__ import annotations

import numpy as np
import torch

from .format import BankError, dtype_name
from .rows import RowFormat
from .state import pack


def check_rows(bank, name: str, dtype: torch.dtype, fmt: RowFormat,
               value_dtype: torch.dtype | None = None) -> tuple[torch.Tensor, RowFormat | None]:
    """The bank's stored rows of layer ``name`` and the format that puts them
    in the element order of a cache of ``dtype`` whose row is described by
    ``fmt`` and whose bytes encode ``value_dtype`` (None: already in it),
    after checking they fit; BankError naming what differs."""
    t = bank.layers.get(name)
    if t is None:
        some = sorted(bank.layers)[:3]
        raise BankError(f"{bank.source}: has no rows for layer {name!r} (it holds {len(bank.layers)} layers, "
                        f"e.g. {some}); record the bank from the same model")
    if t.dtype != dtype:
        raise BankError(f"{bank.source}: layer {name!r} was recorded as {t.dtype}, the cache holds {dtype}; "
                        f"record the bank with the same dtype and kv_cache_dtype")
    recorded = bank.value_dtypes.get(name)
    if value_dtype is not None and recorded and recorded != dtype_name(value_dtype):
        raise BankError(f"{bank.source}: layer {name!r} holds {recorded} values, the cache encodes "
                        f"{dtype_name(value_dtype)}; record the bank with the same kv_cache_dtype")
    cache_parts = [list(p) for p in fmt.parts]
    row = sum(int(np.prod(p)) for p in fmt.parts)
    kv = bank.kv.get(name)
    if kv is not None:
        if fmt.kv is None:
            raise BankError(f"{bank.source}: layer {name!r} holds K/V rows of {list(kv)} (heads, head_size, "
                            f"head_size_v); the cache's element dims {cache_parts} are no known K/V view "
                            f"(give the engine the layer's geometry: CacheGroup(kv=...))")
        if tuple(fmt.kv) != kv:
            split = kv[1:] == tuple(fmt.kv)[1:] and kv[0] > fmt.kv[0] and bank.part.tp_size == 1
            raise BankError(f"{bank.source}: layer {name!r} was recorded with {list(kv)} (heads, head_size, "
                            f"head_size_v), the cache holds {list(fmt.kv)}: " + (
                                "a tensor-parallel rank's heads; load the rank's part (Bank.load(path, "
                                "BankPart(tp_rank, tp_size)))" if split else "another model or head layout"))
        return t, (fmt if fmt.order is not None else None)
    if t.shape[1] != row:
        raise BankError(f"{bank.source}: layer {name!r} rows have {t.shape[1]} elements, the cache's have {row} "
                        f"(another model or head layout?)")
    recorded_parts = bank.parts.get(name)
    if recorded_parts and recorded_parts != cache_parts:
        raise BankError(f"{bank.source}: layer {name!r} rows were recorded in the element order of caches with "
                        f"element dims {recorded_parts} (no known K/V view), these caches have {cache_parts}; "
                        f"record the bank on this platform and attention backend")
    return t, None


def state_pages(bank, name: str, shapes, dtypes, alignment: int = 1) -> torch.Tensor:
    """A state layer's recorded states as pages ``[S, page bytes]`` (uint8)
    for a cache whose spec names ``shapes`` and ``dtypes`` (this rank's) and
    ``alignment`` (its ``state_alignment``: each state at a multiple of it),
    after checking they are the ones recorded; BankError naming what differs."""
    tensors = bank.states.get(name)
    if tensors is None:
        raise BankError(f"{bank.source}: has no recorded state for layer {name!r} (it holds "
                        f"{len(bank.states)} state layers); record the bank with this kvfill from the same model")
    have = [(list(t.shape[1:]), dtype_name(t.dtype)) for t in tensors]
    want = [(list(s), dtype_name(d)) for s, d in zip(shapes, dtypes)]
    if have != want:
        where = f"TP rank {bank.part.tp_rank}/{bank.part.tp_size}" if bank.part.tp_size > 1 else "TP size 1"
        raise BankError(f"{bank.source}: state layer {name!r} was recorded as {have} (shape, dtype at {where}), "
                        f"the cache holds {want}: record the bank with the serving run's dtype, mamba cache "
                        f"dtypes and speculative config (a conv state holds its drafts' positions)")
    return pack(tensors, alignment)

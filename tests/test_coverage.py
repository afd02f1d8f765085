"""The coverage table of docs/engine.md against the installed vLLM: every KV
cache spec class, KV cache dtype, cache role and Mamba kind vLLM registers is
listed, and what the table says kvfill does with it is what kvfill's
classification does with a spec built as vLLM's model code builds it.  A
vLLM that registers a kind the table does not list fails here."""
import os
import re
import typing

import pytest
import torch

pytestmark = pytest.mark.needs_vllm

DOC = os.path.join(os.path.dirname(__file__), "..", "docs", "engine.md")
BS = 16


def table(title: str) -> dict[str, str]:
    """First column (backticked names, comma separated) -> second column of
    the coverage table under the heading ``title``."""
    text = open(DOC).read()
    start = text.index(f"### {title}")
    end = text.find("\n#", start + 1)
    rows = {}
    for line in text[start:end if end > 0 else None].splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) < 2 or not cells[0].startswith("`"):
            continue
        for name in re.findall(r"`([^`]+)`", cells[0]):
            rows[name] = cells[1]
    return rows


def treatment(spec, cache_dtype: str = "auto") -> str:
    """What kvfill does with a layer of ``spec`` (the table's second column's first words)."""
    from kvfill.connector.packed import packed_row_kind
    from kvfill.connector.planner import GroupKind
    from kvfill.connector.specs import layer_encoding, layer_specs, spec_kind
    from kvfill.kernels import values as V

    if isinstance(spec, tuple(_hisparse())):
        return "not filled"
    kinds = {treatment(s, cache_dtype) for s in layer_specs(spec)} if len(layer_specs(spec)) > 1 else None
    if kinds:
        return " / ".join(sorted(kinds))
    kind = spec_kind(spec)
    if kind == GroupKind.MAMBA:
        return "recurrent state"
    if kind == GroupKind.OTHER:
        return "not filled"
    if kind == GroupKind.CIRCULAR_BUFFER:
        return "zeros"
    if packed_row_kind(spec) is not None:
        return "packed rows"
    if layer_encoding(spec, cache_dtype) == V.ENC_PACKED:
        return "zeros, named at start"
    if kind in (GroupKind.CROSS_ATTENTION, GroupKind.CHUNKED_LOCAL):
        return "rows, synthetic in replay"
    return "rows"


def _hisparse():
    import vllm.v1.kv_cache_interface as K

    return [getattr(K, n) for n in ("HiSparseHotSpec", "HiSparseResidentSpec") if hasattr(K, n)]


def spec_classes() -> set[type]:
    import vllm.v1.kv_cache_interface as K

    out, todo = set(), [K.KVCacheSpec]
    while todo:
        for sub in todo.pop().__subclasses__():
            if sub.__module__.startswith("vllm") and sub not in out:
                out.add(sub)
                todo.append(sub)
    return out - {K.AttentionSpec}  # abstract: never registered as such


def built(cls):
    """A spec of ``cls`` as vLLM's model code builds one (bf16, 8 heads of 128)."""
    import vllm.v1.kv_cache_interface as K

    att = dict(block_size=BS, num_kv_heads=8, head_size=128, dtype=torch.bfloat16)
    mla = dict(block_size=BS, num_kv_heads=1, head_size=576, dtype=torch.bfloat16)
    make = {
        "SlidingWindowSpec": lambda: cls(**att, sliding_window=256),
        "SlidingWindowMLASpec": lambda: cls(**mla, sliding_window=128),
        "ChunkedLocalAttentionSpec": lambda: cls(**att, attention_chunk_size=64),
        "RSWASpec": lambda: cls(**att, rswa_window=64),
        "MLAAttentionSpec": lambda: cls(**mla),
        "HiddenStateCacheSpec": lambda: cls(**mla),
        "MambaSpec": lambda: cls(block_size=BS, shapes=((3, 64), (4, 16, 16)), dtypes=(torch.bfloat16,) * 2),
        "HiSparseHotSpec": lambda: cls(block_size=BS, page_size=1024, blocks_per_request=4),
        "HiSparseResidentSpec": lambda: cls(block_size=BS, page_size=1024),
        "UniformTypeKVCacheSpecs": lambda: cls(block_size=BS, kv_cache_specs={
            "a": K.FullAttentionSpec(**att), "b": K.FullAttentionSpec(**att)}),
    }
    return make.get(cls.__name__, lambda: cls(**att))()


def test_every_kv_cache_spec_class_vllm_registers_is_in_the_table_with_what_kvfill_does():
    rows = table("KV cache spec classes")
    names = {c.__name__ for c in spec_classes()}
    assert names - set(rows) == set(), "vLLM registers spec classes the coverage table does not list"
    for cls in sorted(spec_classes(), key=lambda c: c.__name__):
        assert rows[cls.__name__].startswith(treatment(built(cls))), (cls.__name__, treatment(built(cls)))


def test_every_kv_cache_dtype_vllm_accepts_is_in_the_table_with_what_kvfill_does():
    """Each dtype on the spec a layer gets with it (an MLA latent for the
    ``*_ds_mla`` dtypes, an attention layer otherwise)."""
    import vllm.v1.kv_cache_interface as K
    from vllm.config.cache import CacheDType
    from vllm.utils.torch_utils import STR_DTYPE_TO_TORCH_DTYPE

    rows = table("KV cache dtypes")
    dtypes = typing.get_args(CacheDType)
    assert set(dtypes) - set(rows) == set(), "vLLM accepts KV cache dtypes the coverage table does not list"
    for dt in dtypes:
        storage = torch.bfloat16 if dt == "auto" else STR_DTYPE_TO_TORCH_DTYPE[dt]
        kw = dict(block_size=BS, dtype=storage, kv_quant_mode=K.get_kv_quant_mode(dt))
        if dt.endswith("_ds_mla"):
            spec = K.MLAAttentionSpec(num_kv_heads=1, head_size=576, **kw, cache_dtype_str=dt,
                                      state_content_bytes={"fp8_ds_mla": 656, "nvfp4_ds_mla": 352}[dt])
        else:
            spec = K.FullAttentionSpec(num_kv_heads=8, head_size=128, **kw)
        assert rows[dt].startswith(treatment(spec, dt)), (dt, treatment(spec, dt))


def test_every_cache_role_and_mamba_kind_vllm_registers_is_in_the_table():
    import vllm.v1.kv_cache_interface as K
    from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum

    rows = table("Cache roles and Mamba kinds")
    assert {r.value for r in K.SparseCacheRole} - set(rows) == set()
    assert {m.name for m in MambaAttentionBackendEnum} - set(rows) == set()
    idx = K.MLAAttentionSpec(block_size=64, num_kv_heads=1, max_tp_shards=1, head_size=132, dtype=torch.uint8,
                             cache_role=K.SparseCacheRole.INDEXER)  # as DeepseekV32IndexerCache registers it
    assert rows["indexer"].startswith(treatment(idx))

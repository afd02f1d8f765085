"""The coverage table of docs/engine.md against the installed vLLM: every KV
cache spec class, KV cache dtype (those a platform registers with vLLM 0.34's
``register_kv_cache_dtype`` too), quantization mode, cache role and Mamba
kind vLLM registers is listed, and what the table says kvfill does with it is
what kvfill's classification does with a spec built as vLLM's model code
builds it - for the caches of the models vLLM 0.34 adds, by their own layer
classes where this machine can import them.  A vLLM that registers a kind
the tables do not list fails here."""
import os
import re
import sys
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
    from kvfill.connector.packed import packed_row_kind, refused_layout
    from kvfill.connector.planner import GroupKind
    from kvfill.connector.specs import layer_encoding, layer_specs, spec_kind
    from kvfill.kernels import values as V

    if refused_layout(spec) is not None:
        return "refused"
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


def dtype_spec(dt: str):
    """The spec a layer gets with ``--kv-cache-dtype dt`` (an MLA latent for
    the ``*_ds_mla`` dtypes, an attention layer otherwise)."""
    import vllm.v1.kv_cache_interface as K
    from vllm.utils.torch_utils import STR_DTYPE_TO_TORCH_DTYPE

    storage = torch.bfloat16 if dt == "auto" else STR_DTYPE_TO_TORCH_DTYPE[dt]
    kw = dict(block_size=BS, dtype=storage, kv_quant_mode=K.get_kv_quant_mode(dt))
    if dt.endswith("_ds_mla"):
        return K.MLAAttentionSpec(num_kv_heads=1, head_size=576, **kw, cache_dtype_str=dt,
                                  state_content_bytes={"fp8_ds_mla": 656, "nvfp4_ds_mla": 352}[dt])
    return K.FullAttentionSpec(num_kv_heads=8, head_size=128, **kw)


def accepted_dtypes() -> list[str]:
    """Every ``--kv-cache-dtype`` the installed vLLM accepts: vLLM 0.34's
    mutable ``KV_CACHE_DTYPES`` (its literal ones and those platforms
    registered), the ``CacheDType`` literal before."""
    import vllm.config.cache as C

    return list(getattr(C, "KV_CACHE_DTYPES", None) or typing.get_args(C.CacheDType))


def handler_of(dt: str):
    import vllm.config.cache as C

    get = getattr(C, "get_kv_cache_dtype_handler", None)
    return get(dt) if get is not None else None


HANDLER_ROW = "KVCacheDTypeHandler"


def handler_treatment(spec) -> str:
    """The coverage table's rule for a dtype a platform registers: a float
    storage dtype of quantization mode none or per-tensor fp8 holds rows;
    anything else (mode CUSTOM: the backend's own format) is zeros, named."""
    import vllm.v1.kv_cache_interface as K

    from kvfill.kernels import values as V

    plain = (K.KVQuantMode.NONE, K.KVQuantMode.FP8_PER_TENSOR)
    return "rows" if spec.dtype in V.FLOAT_DTYPES and spec.kv_quant_mode in plain else "zeros, named at start"


def test_every_kv_cache_dtype_vllm_accepts_is_in_the_table_with_what_kvfill_does():
    rows = table("KV cache dtypes")
    dtypes = accepted_dtypes()
    listed = {dt for dt in dtypes if handler_of(dt) is None}
    assert listed - set(rows) == set(), "vLLM accepts KV cache dtypes the coverage table does not list"
    for dt in dtypes:
        spec = dtype_spec(dt)
        if handler_of(dt) is not None:
            assert treatment(spec, dt) == handler_treatment(spec), dt
            assert treatment(spec, dt) in rows[HANDLER_ROW], dt
        else:
            assert rows[dt].startswith(treatment(spec, dt)), (dt, treatment(spec, dt))


@pytest.fixture
def registered_dtypes():
    """Three ``--kv-cache-dtype`` values registered as a platform backend
    registers them (vLLM 0.34's ``register_kv_cache_dtype``): a bf16 alias
    of mode NONE, and a bf16 and a uint8 format of mode CUSTOM; vLLM's
    tables are restored after."""
    import vllm.config.cache as C
    import vllm.v1.kv_cache_interface as K
    from vllm.utils.torch_utils import STR_DTYPE_TO_TORCH_DTYPE

    register = getattr(C, "register_kv_cache_dtype", None)
    if register is None:
        pytest.skip("this vLLM has no vllm.config.cache.register_kv_cache_dtype (vLLM 0.32: no KVCacheDTypeHandler)")
    made = {"kvfill_test_bf16": (torch.bfloat16, K.KVQuantMode.NONE),
            "kvfill_test_custom_bf16": (torch.bfloat16, K.KVQuantMode.CUSTOM),
            "kvfill_test_custom_u8": (torch.uint8, K.KVQuantMode.CUSTOM)}
    saved = (list(C.KV_CACHE_DTYPES), dict(STR_DTYPE_TO_TORCH_DTYPE), dict(C._KV_CACHE_DTYPE_HANDLERS))
    try:
        for name, (storage, mode) in made.items():
            register(name)(type(f"Handler_{name}", (), {"name": name, "torch_dtype": lambda self, d=storage: d,
                                                        "quant_mode": lambda self, m=mode: m}))
        yield made
    finally:
        C.KV_CACHE_DTYPES[:] = saved[0]
        STR_DTYPE_TO_TORCH_DTYPE.clear()
        STR_DTYPE_TO_TORCH_DTYPE.update(saved[1])
        C._KV_CACHE_DTYPE_HANDLERS.clear()
        C._KV_CACHE_DTYPE_HANDLERS.update(saved[2])


def test_a_dtype_a_platform_registers_is_covered_by_its_storage_and_quant_mode(registered_dtypes):
    """A handler's dtype is accepted (``KV_CACHE_DTYPES``) and covered by the
    table's handler row: kvfill fills the bf16 alias with rows, and zeroes
    (named at start) both formats of mode CUSTOM - whatever their storage
    dtype, kvfill does not know what a backend's own format holds."""
    from kvfill.connector.packed import zeroed_line
    from kvfill.connector.specs import layer_encoding

    rows = table("KV cache dtypes")
    assert set(registered_dtypes) <= set(accepted_dtypes())
    got = {dt: treatment(dtype_spec(dt), dt) for dt in registered_dtypes}
    assert got == {"kvfill_test_bf16": "rows", "kvfill_test_custom_bf16": "zeros, named at start",
                   "kvfill_test_custom_u8": "zeros, named at start"}
    assert all(g in rows[HANDLER_ROW] for g in got.values())
    specs = {f"model.layers.{i}.self_attn.attn": dtype_spec(dt) for i, dt in enumerate(registered_dtypes)}
    line = zeroed_line(specs, {n: layer_encoding(s, dt) for (n, s), dt in zip(specs.items(), registered_dtypes)})
    assert "2 attention cache layer(s) are left zero" in line and "model.layers.1.self_attn.attn" in line
    test_every_kv_cache_dtype_vllm_accepts_is_in_the_table_with_what_kvfill_does()


def test_every_quantization_mode_vllm_names_is_in_the_table_with_what_kvfill_does():
    """Every ``KVQuantMode`` name, aliases included (vLLM 0.34's ``CUSTOM``
    is ``OCTAVE_K3V4``'s value, 12: a spec cannot tell them apart), on the
    spec of the first dtype vLLM maps to it."""
    import vllm.v1.kv_cache_interface as K

    rows = table("KV cache quantization modes")
    names = set(K.KVQuantMode.__members__)
    assert names - set(rows) == set(), "vLLM names quantization modes the coverage table does not list"
    first = {}
    for dt in accepted_dtypes():
        first.setdefault(K.get_kv_quant_mode(dt), dt)
    for name, mode in K.KVQuantMode.__members__.items():
        assert mode in first, f"no --kv-cache-dtype of mode {name}: build its spec here"
        want = treatment(dtype_spec(first[mode]), first[mode])
        assert rows[name].startswith(want), (name, first[mode], want)


def test_every_cache_role_and_mamba_kind_vllm_registers_is_in_the_table():
    import vllm.v1.kv_cache_interface as K
    from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum

    rows = table("Cache roles and Mamba kinds")
    assert {r.value for r in K.SparseCacheRole} - set(rows) == set()
    assert {m.name for m in MambaAttentionBackendEnum} - set(rows) == set()
    idx = K.MLAAttentionSpec(block_size=64, num_kv_heads=1, max_tp_shards=1, head_size=132, dtype=torch.uint8,
                             cache_role=K.SparseCacheRole.INDEXER)  # as DeepseekV32IndexerCache registers it
    assert rows["indexer"].startswith(treatment(idx))


# ------------------------------------------------------------------ caches of the models vLLM 0.34 adds
def _config(tmp_path):
    from vllm_harness import model_dir, vllm_config

    return vllm_config(model_dir(tmp_path), block_size=64)


def _module(name: str):
    """A vLLM 0.34 model module, or a skip naming it where this vLLM has none."""
    import importlib

    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as exc:
        if exc.name and name.startswith(exc.name):
            pytest.skip(f"this vLLM has no {exc.name} (a model vLLM 0.34 adds)")
        raise


def _minimax_attention_nvfp4(cfg):
    """MiniMax-M3's attention layer with ``--kv-cache-dtype nvfp4``
    (vllm/models/minimax_m3/nvidia/model.py ``get_kv_cache_spec``) as its
    NVFP4 MSA backend customises it (sparse_attention_msa.py
    ``customize_spec``): one slot per KV head and side, head-major. Built
    here as they build it: the minimax_m3 package imports torchvision, which
    this lane does not install."""
    import dataclasses

    import vllm.v1.kv_cache_interface as K

    if "kv_head_major_slots" not in {f.name for f in dataclasses.fields(K.FullAttentionSpec)}:
        pytest.skip("this vLLM's AttentionSpec has no kv_head_major_slots (vLLM 0.32: no head-major K/V slots)")
    from vllm.utils.torch_utils import nvfp4_kv_cache_full_dim

    spec = K.FullAttentionSpec(block_size=64, num_kv_heads=4, head_size=128, head_size_v=128, dtype=torch.uint8,
                               kv_quant_mode=K.get_kv_quant_mode("nvfp4"))
    return dataclasses.replace(spec, num_head_slots=2 * spec.num_kv_heads, kv_head_major_slots=True,
                               state_content_bytes=nvfp4_kv_cache_full_dim(spec.head_size))


def _minimax_index_k(kind):
    """MiniMax-M3's index-K cache (vllm/models/minimax_m3/common/indexer.py
    ``MiniMaxM3IndexerCache``: its dtype and width per ``indexer_kv_dtype``,
    a key-only ``MLAAttentionSpec`` of role indexer), built as it builds it
    (its package imports torchvision)."""
    dtype, width = {"bf16": (torch.bfloat16, 128), "fp8": (torch.float8_e4m3fn, 128),
                    "nvfp4": (torch.uint8, 128 // 2 + 128 // 16)}[kind]

    def build(cfg):
        import vllm.v1.kv_cache_interface as K  # when the test runs: the module collects without vLLM

        return K.MLAAttentionSpec(block_size=64, num_kv_heads=1, head_size=width, dtype=dtype,
                                  cache_role=K.SparseCacheRole.INDEXER)
    return build


def _kimi_indexer(fp4):
    def build(cfg):
        m = _module("vllm.models.kimi_k3.common.dsa_cache")
        layer = m.KimiK3IndexerCache(head_dim=m.indexer_cache_entry_bytes(128, fp4), dtype=torch.uint8,
                                     prefix=f"model.layers.1.self_attn.indexer.k_cache{int(fp4)}",
                                     cache_config=cfg.cache_config)  # as kimi_k3/nvidia/dsa.py makes it
        return layer.get_kv_cache_spec(cfg)
    return build


def _mistral_indexer(cfg):
    m = _module("vllm.models.mistral.nvidia.indexer")
    head_dim = 128  # index_head_dim; one float32 scale per quant_block_size (128) keys, as MistralIndexer adds
    layer = m.MistralIndexerCache(head_dim=head_dim + head_dim // m.MistralIndexer.quant_block_size * 4,
                                  dtype=torch.uint8, prefix="model.layers.1.self_attn.indexer.k_cache",
                                  cache_config=cfg.cache_config)
    return layer.get_kv_cache_spec(cfg)


def _step5_summary(cfg):
    m = _module("vllm.models.step5.common.sparse_summary_cache")
    layer = m.Step5SparseSummaryCacheLayer(prefix="model.layers.1.self_attn.summary", target_impl=None,
                                           static_forward_context={})
    return layer.get_kv_cache_spec(cfg)


def _step5_tail_ring(cfg):
    import vllm.v1.kv_cache_interface as K

    m = _module("vllm.models.step5.common.csa_tail_ring")

    class Main:  # the DSA layer the ring sits beside: a 64 KiB page of 64 tokens
        def get_kv_cache_spec(self, vllm_config):
            return K.FullAttentionSpec(block_size=64, num_kv_heads=1, head_size=512, head_size_v=0,
                                       dtype=torch.bfloat16)

    context = {"model.layers.1.self_attn.attn": Main()}
    ring = m.Step5CSATailRing(prefix="model.layers.1.self_attn.tail_ring",
                              main_layer_name="model.layers.1.self_attn.attn", num_speculative_tokens=1,
                              static_forward_context=context)
    return ring.get_kv_cache_spec(cfg)


MODEL_CACHES = {
    "MiniMax-M3 NVFP4 KV": _minimax_attention_nvfp4,
    "MiniMax-M3 bf16 index-K": _minimax_index_k("bf16"),
    "MiniMax-M3 fp8 index-K": _minimax_index_k("fp8"),
    "MiniMax-M3 NVFP4 index-K": _minimax_index_k("nvfp4"),
    "Kimi-K3.1 fp8 indexer": _kimi_indexer(False),
    "Kimi-K3.1 MXFP4 indexer": _kimi_indexer(True),
    "Mistral Large 4 indexer": _mistral_indexer,
    "Step5 sparse summary": _step5_summary,
    "Step5 CSA tail ring": _step5_tail_ring,
}


def test_the_model_caches_table_lists_exactly_the_caches_built_here():
    assert set(table("Caches of the models vLLM 0.34 adds")) == set(MODEL_CACHES)


@pytest.mark.parametrize("name", list(MODEL_CACHES))
def test_each_cache_of_the_models_vllm_034_adds_is_in_the_table_with_what_kvfill_does(name, tmp_path):
    """The layer's spec as vLLM 0.34's model code builds it (its own layer
    class where this machine imports it), classified by kvfill as the
    connector does (``treatment``: the table's second column)."""
    from vllm.config import set_current_vllm_config

    cfg = _config(tmp_path)
    with set_current_vllm_config(cfg):
        spec = MODEL_CACHES[name](cfg)
    rows = table("Caches of the models vLLM 0.34 adds")
    assert rows[name].startswith(treatment(spec)), (name, treatment(spec))


def test_step5s_summary_beside_its_dsa_layer_is_left_out_and_named(tmp_path):
    """In Step5 the 8-token summary cache shares its DSA layer's KV cache
    group: the group's block table addresses tokens, the summary's pages
    hold one state per 8, so kvfill leaves it out of the fill and names it
    (``compressed_in_mixed_groups``) - the second half of its table row."""
    from types import SimpleNamespace

    import vllm.v1.kv_cache_interface as K
    from vllm.config import set_current_vllm_config

    from kvfill.connector.packed import compressed_in_mixed_groups, left_out_line

    cfg = _config(tmp_path)
    with set_current_vllm_config(cfg):
        summary = _step5_summary(cfg)
    main = K.MLAAttentionSpec(block_size=64, num_kv_heads=1, head_size=576, dtype=torch.bfloat16)
    names = ["model.layers.1.self_attn.attn", "model.layers.1.self_attn.summary"]
    group = SimpleNamespace(layer_names=names)
    left = compressed_in_mixed_groups([group], dict(zip(names, (main, summary))))
    assert left == {"model.layers.1.self_attn.summary": 8}
    assert "model.layers.1.self_attn.summary" in left_out_line(left)
    assert "Step5 sparse summary" in table("Caches of the models vLLM 0.34 adds")
    assert "left out" in table("Caches of the models vLLM 0.34 adds")["Step5 sparse summary"]


def _dropped(tmp_path, monkeypatch, name):
    """docs/engine.md with ``name`` no longer a listed kind (its backticks removed)."""
    text = open(DOC).read()
    assert f"`{name}`" in text
    copy = tmp_path / "engine.md"
    copy.write_text(text.replace(f"`{name}`", name))
    monkeypatch.setattr(sys.modules[__name__], "DOC", str(copy))


def test_a_kind_the_tables_do_not_list_fails_the_coverage_tests(tmp_path, monkeypatch):
    """Each enumeration fails when a kind the installed vLLM registers is
    missing from its table: the newest of each (vLLM 0.34's where it has them)."""
    import vllm.v1.kv_cache_interface as K

    dtype = "octave_k3v3_compact" if "octave_k3v3_compact" in accepted_dtypes() else "nvfp4_4over6"
    mode = "CUSTOM" if "CUSTOM" in K.KVQuantMode.__members__ else "ULTRAQUANT_4BIT"
    classes = test_every_kv_cache_spec_class_vllm_registers_is_in_the_table_with_what_kvfill_does
    cases = [("HiddenStateCacheSpec", classes, "spec classes"),
             (dtype, test_every_kv_cache_dtype_vllm_accepts_is_in_the_table_with_what_kvfill_does, "KV cache dtypes"),
             (mode, test_every_quantization_mode_vllm_names_is_in_the_table_with_what_kvfill_does,
              "quantization modes"),
             ("Step5 CSA tail ring", test_the_model_caches_table_lists_exactly_the_caches_built_here, None)]
    for name, check, says in cases:
        with monkeypatch.context() as mp:
            _dropped(tmp_path, mp, name)
            with pytest.raises(AssertionError, match=says):
                check()
        check()  # the real table passes

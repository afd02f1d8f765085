"""The vLLM spec adapter agrees with the installed vLLM's allocator geometry."""
import pytest
import torch

vllm_kv = pytest.importorskip("vllm.v1.kv_cache_interface")
from vllm.v1.core import kv_cache_utils  # noqa: E402
from vllm.v1.kv_cache_interface import (  # noqa: E402
    ChunkedLocalAttentionSpec,
    CircularBufferSpec,
    CrossAttentionSpec,
    FullAttentionSpec,
    KVQuantMode,
    MambaSpec,
    MLAAttentionSpec,
    SinkFullAttentionSpec,
    SlidingWindowSpec,
)

from kvfill.connector.planner import GroupKind  # noqa: E402
from kvfill.connector.specs import dcp_world_size_of, group_geometry, layer_encoding, spec_kind  # noqa: E402

ATT = dict(block_size=16, num_kv_heads=2, head_size=8, dtype=torch.bfloat16)
SPECS = {
    "full": (FullAttentionSpec(**ATT), GroupKind.FULL_ATTENTION),
    "full-unsharded": (FullAttentionSpec(**ATT, dcp_sharded=False), GroupKind.FULL_ATTENTION),
    "mla": (MLAAttentionSpec(block_size=16, num_kv_heads=1, head_size=576, dtype=torch.bfloat16), GroupKind.FULL_ATTENTION),
    "sink": (SinkFullAttentionSpec(**ATT, sink_len=4), GroupKind.FULL_ATTENTION),
    "sliding": (SlidingWindowSpec(**ATT, sliding_window=64), GroupKind.SLIDING_WINDOW),
    "chunked": (ChunkedLocalAttentionSpec(**ATT, attention_chunk_size=64), GroupKind.CHUNKED_LOCAL),
    "cross": (CrossAttentionSpec(**ATT), GroupKind.CROSS_ATTENTION),
    "ring": (CircularBufferSpec(**ATT), GroupKind.CIRCULAR_BUFFER),
    "mamba": (MambaSpec(block_size=16, shapes=((4, 8),), dtypes=(torch.float32,)), GroupKind.MAMBA),
}


@pytest.mark.parametrize("name", list(SPECS))
def test_kind_of_every_spec(name):
    spec, kind = SPECS[name]
    assert spec_kind(spec) == kind


@pytest.mark.parametrize("name", list(SPECS))
@pytest.mark.parametrize("dcp", [1, 2, 4])
def test_span_of_every_spec_kind_equals_vllms_own(name, dcp):
    """The span the planner uses is the block span vLLM's allocator gives the group."""
    spec, _ = SPECS[name]
    geo = group_geometry(name, spec, dcp_world_size=dcp, interleave=1)
    helper = getattr(kv_cache_utils, "dcp_world_size_for_kv_cache_spec", None)
    world = helper(spec, dcp) if helper is not None else dcp
    assert geo.span == kv_cache_utils.resolve_dcp_kv_block_size(spec, world)


def test_dcp_resolution_uses_vllms_helper_when_it_exists(monkeypatch):
    calls = []
    monkeypatch.setattr(kv_cache_utils, "dcp_world_size_for_kv_cache_spec",
                        lambda spec, w: calls.append((spec, w)) or (1 if spec is SPECS["chunked"][0] else w),
                        raising=False)
    assert dcp_world_size_of(SPECS["chunked"][0], 4) == 1 and dcp_world_size_of(SPECS["full"][0], 4) == 4
    assert [w for _, w in calls] == [4, 4]


def test_dcp_resolution_reads_dcp_sharded_without_the_helper(monkeypatch):
    monkeypatch.delattr(kv_cache_utils, "dcp_world_size_for_kv_cache_spec", raising=False)
    assert dcp_world_size_of(SPECS["chunked"][0], 2) == 2       # vLLM 0.32: every AttentionSpec is sharded
    assert dcp_world_size_of(SPECS["full-unsharded"][0], 2) == 1
    assert dcp_world_size_of(SPECS["mamba"][0], 2) == 1


def _without_dcp_sharded(cls, **kw):
    """A spec of ``cls`` as a vLLM tree older than ``dcp_sharded`` builds it."""

    class Old(cls):
        def __getattribute__(self, name):
            if name == "dcp_sharded":
                raise AttributeError(name)
            return super().__getattribute__(name)

    return Old(**kw)


def test_dcp_resolution_without_helper_or_flag_shards_full_attention_only(monkeypatch):
    monkeypatch.delattr(kv_cache_utils, "dcp_world_size_for_kv_cache_spec", raising=False)
    full = _without_dcp_sharded(FullAttentionSpec, **ATT)
    mla = _without_dcp_sharded(MLAAttentionSpec, block_size=16, num_kv_heads=1, head_size=576, dtype=torch.bfloat16)
    chunked = _without_dcp_sharded(ChunkedLocalAttentionSpec, **ATT, attention_chunk_size=64)
    assert not hasattr(full, "dcp_sharded")
    assert (dcp_world_size_of(full, 4), dcp_world_size_of(mla, 4), dcp_world_size_of(chunked, 4)) == (4, 4, 1)


def test_interleave_applies_to_sharded_groups_only():
    assert group_geometry("full", SPECS["full"][0], dcp_world_size=2, interleave=8).dcp.interleave == 8
    assert group_geometry("mamba", SPECS["mamba"][0], dcp_world_size=2, interleave=8).dcp.interleave == 1
    assert dcp_world_size_of(SPECS["full-unsharded"][0], 4) == 1


@pytest.mark.parametrize(
    "spec,cache_dtype,enc",
    [
        (FullAttentionSpec(**ATT), "auto", "native"),
        (FullAttentionSpec(**{**ATT, "dtype": torch.float8_e4m3fn}), "fp8", "native"),
        (FullAttentionSpec(**{**ATT, "dtype": torch.uint8}, kv_quant_mode=KVQuantMode.FP8_PER_TENSOR), "fp8", "fp8_e4m3"),
        (FullAttentionSpec(**{**ATT, "dtype": torch.uint8}, kv_quant_mode=KVQuantMode.FP8_PER_TENSOR), "fp8_e5m2", "fp8_e5m2"),
        (FullAttentionSpec(**{**ATT, "dtype": torch.uint8}), "nvfp4", "packed"),
        (FullAttentionSpec(**{**ATT, "dtype": torch.uint8}, kv_quant_mode=KVQuantMode.FP8_PER_TENSOR, state_content_bytes=40), "fp8", "packed"),
        (MambaSpec(block_size=16, shapes=((4, 8),), dtypes=(torch.float32,)), "auto", "packed"),
    ],
)
def test_layer_encoding(spec, cache_dtype, enc):
    assert layer_encoding(spec, cache_dtype) == enc


@pytest.mark.parametrize("platform_fp8,cache_dtype,enc", [
    (torch.float8_e4m3fnuz, "fp8", "fp8_e4m3fnuz"),
    (torch.float8_e4m3fnuz, "fp8_e4m3", "fp8_e4m3fnuz"),
    (torch.float8_e4m3fnuz, "fp8_e5m2", "fp8_e5m2"),  # vLLM keeps e5m2 caches e5m2 on every platform
    (torch.float8_e4m3fn, "fp8", "fp8_e4m3"),
])
def test_fp8_caches_are_encoded_with_the_platforms_fp8_type(monkeypatch, platform_fp8, cache_dtype, enc):
    """vLLM's kernels read fp8/fp8_e4m3 uint8 caches as current_platform.fp8_dtype()
    (e4m3fnuz on ROCm MI300): kvfill must encode with that type."""
    from vllm.platforms import current_platform

    monkeypatch.setattr(type(current_platform), "fp8_dtype", classmethod(lambda cls: platform_fp8))
    spec = FullAttentionSpec(**{**ATT, "dtype": torch.uint8}, kv_quant_mode=KVQuantMode.FP8_PER_TENSOR)
    assert layer_encoding(spec, cache_dtype) == enc


def test_null_block_is_block_zero():
    from vllm.v1.core.block_pool import BlockPool

    from kvfill.connector.planner import NULL_BLOCK_ID

    pool = BlockPool(num_gpu_blocks=8, enable_caching=False, hash_block_size=16)
    assert pool.null_block.block_id == NULL_BLOCK_ID and pool.null_block.is_null


@pytest.mark.parametrize("tp,dcp,ok", [(4, 2, True), (4, 4, True), (2, 4, False), (6, 4, False)])
def test_dcp_size_must_divide_tp_size_as_vllm_requires(tp, dcp, ok):
    from types import SimpleNamespace

    from kvfill.connector.specs import geometries_from_config

    par = SimpleNamespace(decode_context_parallel_size=dcp, tensor_parallel_size=tp,
                          prefill_context_parallel_size=1, cp_kv_cache_interleave_size=1)
    kv_cfg = SimpleNamespace(kv_cache_groups=[SimpleNamespace(kv_cache_spec=SPECS["full"][0])])
    if ok:
        assert geometries_from_config(SimpleNamespace(parallel_config=par), kv_cfg)[0].dcp.world_size == dcp
    else:
        with pytest.raises(ValueError, match=rf"DCP size {dcp} does not divide the TP size {tp}"):
            geometries_from_config(SimpleNamespace(parallel_config=par), kv_cfg)


# ------------------------------------------------------------------ head-major K/V slots (vLLM 0.34's H2ND)
NO_H2ND = "this vLLM's AttentionSpec has no kv_head_major_slots (vLLM 0.32: no head-major K/V slots)"


def _h2nd_spec():
    """An attention layer's spec as MiniMax-M3's NVFP4 MSA backend makes it
    (``MiniMaxM3SparseMSANvfp4Backend.customize_spec``, vLLM 0.34: its module
    needs CUDA-only packages, so built here as it builds it): 2 KV heads of
    128, NVFP4 (uint8), one slot per head and side, 64 value bytes + 8 scale
    bytes each, head h's K and V in slots 2h, 2h + 1."""
    from dataclasses import fields, replace

    if "kv_head_major_slots" not in {f.name for f in fields(FullAttentionSpec)}:
        pytest.skip(NO_H2ND)
    from vllm.utils.torch_utils import nvfp4_kv_cache_full_dim

    spec = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=128, head_size_v=128, dtype=torch.uint8,
                             kv_quant_mode=vllm_kv.get_kv_quant_mode("nvfp4"))
    return replace(spec, num_head_slots=4, state_content_bytes=nvfp4_kv_cache_full_dim(128), kv_head_major_slots=True)


def test_head_major_slots_are_a_refused_layout_named_with_the_layer():
    from kvfill.connector.packed import H2ND, refused_layout, refused_line

    spec = _h2nd_spec()
    assert refused_layout(spec) == H2ND
    assert all(refused_layout(s) is None for s, _ in SPECS.values())
    line = refused_line({"model.layers.3.self_attn.attn": spec, "model.layers.4.self_attn.attn": SPECS["full"][0]})
    assert "cannot fill 1 cache layer(s) laid out H2ND (FullAttentionSpec (uint8))" in line
    assert "model.layers.3.self_attn.attn" in line and "model.layers.4" not in line
    assert refused_line({n: s for n, (s, _) in SPECS.items()}) is None


def test_a_worker_over_head_major_slots_refuses_to_start_naming_the_layout_and_the_layer(tmp_path):
    """Through vLLM's scheduler and connector factory (tests/vllm_harness.py):
    the worker's connector is refused when it is made, before vLLM registers
    any cache with it."""
    from vllm_harness import make_harness

    spec = _h2nd_spec()
    with pytest.raises(ValueError, match=r"laid out H2ND .*: model\.layers\.0\.self_attn\.attn\. kvfill writes"):
        make_harness(tmp_path, [(["model.layers.0.self_attn.attn"], spec)], extra={"fill_mean": 0.1})

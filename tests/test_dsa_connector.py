"""The connector on a DeepSeek-V3.2 / GLM-5 (DSA) KV cache group as vLLM
builds it: per layer the MLA latent (bf16, or ``fp8_ds_mla`` rows) and the
indexer K cache in one group, vLLM's own spec classes, its scheduler and its
cache views over a poisoned buffer (``vllm_harness.py``; no model runs: vLLM
CPU refuses sparse attention).  The pages a prompt's prefill writes are
written by a port of vLLM's writers (``dsa_writers.py``); the recorder saves
every cache; replay restores every byte of them into a request's own blocks;
a bank without the indexer's rows is refused naming the way out; a synthetic
fill gives the indexer keys, not zeros."""
import pytest
import torch

pytest.importorskip("vllm")  # the harness is vLLM's scheduler (the device image has no vLLM)
from kvfill.bench.dsa_writers import pack_ds_mla, write_indexer  # noqa: E402
from conftest import connector_lines  # noqa: E402
from vllm_harness import make_harness  # noqa: E402

from kvfill.connector.packed import FP8_DS_MLA, INDEXER, packed_row_kind

# (the module is skipped where vLLM is missing: no needs_vllm mark, as tests/device_image.py expects)

BS = 64
LAYERS = 2
PROMPT = list(range(100, 100 + 150))  # 150 tokens: a partial third block


def attn(i):
    return f"model.layers.{i}.self_attn.attn"


def indexer(i):
    return f"model.layers.{i}.self_attn.indexer.k_cache"


def dsa_group(mla_dtype: str):
    """The group's spec as DeepseekV32 registers it (``deepseek_v2.py``,
    ``mla_attention.py``): MLA latent + indexer per layer, one uniform-type group."""
    from vllm.v1.kv_cache_interface import (
        MLAAttentionSpec, SparseCacheRole, UniformTypeKVCacheSpecs, get_kv_quant_mode)

    if mla_dtype.endswith("_ds_mla"):
        mla = MLAAttentionSpec(block_size=BS, num_kv_heads=1, max_tp_shards=1, head_size=576, dtype=torch.uint8,
                               cache_dtype_str=mla_dtype, kv_quant_mode=get_kv_quant_mode(mla_dtype),
                               state_content_bytes={"fp8_ds_mla": 656, "nvfp4_ds_mla": 352}[mla_dtype],
                               is_index_group_leader=True)
    else:
        mla = MLAAttentionSpec(block_size=BS, num_kv_heads=1, max_tp_shards=1, head_size=576, dtype=torch.bfloat16,
                               cache_dtype_str="auto", is_index_group_leader=True)
    idx = MLAAttentionSpec(block_size=BS, num_kv_heads=1, max_tp_shards=1, head_size=132, dtype=torch.uint8,
                           cache_role=SparseCacheRole.INDEXER)
    specs = {}
    for i in range(LAYERS):
        specs[attn(i)], specs[indexer(i)] = mla, idx
    return [(list(specs), UniformTypeKVCacheSpecs(block_size=BS, kv_cache_specs=specs))], mla, idx


def prefill_pages(h, blocks, seed=0):
    """What a prefill of PROMPT writes into ``blocks`` (the request's block
    table), layer by layer, with vLLM's writers: returns the layers' rows."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    slots = [blocks[t // BS] * BS + t % BS for t in range(len(PROMPT))]
    for i in range(LAYERS):
        write_indexer(h.views[indexer(i)], torch.randn(len(PROMPT), 128, generator=g, device="cpu") * 3, slots)
        cache = h.views[attn(i)].reshape(h.views[attn(i)].shape[0], BS, -1)
        if cache.dtype == torch.uint8 and cache.shape[-1] == 352:  # nvfp4_ds_mla: any bytes (moved, not read)
            rows = torch.randint(0, 256, (len(PROMPT), 352), generator=g, dtype=torch.uint8, device="cpu")
        elif cache.dtype == torch.uint8:
            rows = pack_ds_mla(torch.randn(len(PROMPT), 512, generator=g, device="cpu"),
                               torch.randn(len(PROMPT), 64, generator=g, device="cpu"))
        else:
            rows = torch.randn(len(PROMPT), 576, generator=g, device="cpu").to(torch.bfloat16)
        for t, s in enumerate(slots):
            cache[s // BS, s % BS] = rows[t]


def token_bytes(h, buffer, name, blocks, n):
    """The bytes of positions [0, n) of a layer under ``buffer``: an indexer
    token's 128 key bytes and its 4 scale bytes; an MLA token's row."""
    view = h.views_over(buffer)[name]
    out = []
    for t in range(n):
        b, o = blocks[t // BS], t % BS
        if name.endswith("k_cache"):
            page = view.reshape(view.shape[0], -1)[b]
            out.append(torch.cat([page[o * 128:(o + 1) * 128], page[BS * 128 + 4 * o:BS * 128 + 4 * o + 4]]))
        else:
            out.append(view.reshape(view.shape[0], BS, -1)[b, o].reshape(-1).view(torch.uint8))
    return torch.stack(out)


def record(tmp_path, mla_dtype):
    """The harness in the record role: one prompt prefilled (its pages
    written as vLLM would), saved at wait_for_save, assembled into a bank."""
    from kvfill.kernels import Bank
    from kvfill.record.assemble import assemble

    groups, _, _ = dsa_group(mla_dtype)
    h = make_harness(tmp_path / "rec", groups, block_size=BS, cache_dtype=mla_dtype, prefix_caching=False,
                     extra={"record_dir": str(tmp_path / "work")})
    h.add("p", PROMPT, max_tokens=1)
    out = h.scheduler.schedule()
    h.worker.bind_connector_metadata(out.kv_connector_metadata)
    h.worker.start_load_kv(None)
    blocks = h.block_table("p")[0]
    prefill_pages(h, blocks)
    h.worker.wait_for_save()
    h.worker.clear_connector_metadata()
    folder = h.worker.worker.recorder.folder
    bank = assemble(folder, [PROMPT], {"model": "dsa"}, str(tmp_path / "bank.safetensors"))
    bank.save(tmp_path / "bank.safetensors")
    h.worker.worker.recorder.drop()
    return h, blocks, Bank.load(tmp_path / "bank.safetensors")


@pytest.mark.parametrize("mla_dtype", ["auto", "fp8_ds_mla", "nvfp4_ds_mla"])
def test_a_dsa_group_is_recorded_whole_and_replayed_byte_for_byte_into_a_requests_own_blocks(tmp_path, mla_dtype):
    rec, rec_blocks, bank = record(tmp_path, mla_dtype)
    assert sorted(bank.layers) == sorted([attn(i) for i in range(LAYERS)] + [indexer(i) for i in range(LAYERS)])
    for i in range(LAYERS):  # a token's row: its key bytes and scale bytes; the MLA latent row as written
        assert torch.equal(bank.layers[indexer(i)], token_bytes(rec, rec.raw, indexer(i), rec_blocks, len(PROMPT)))
        assert torch.equal(bank.layers[attn(i)].view(torch.uint8).reshape(len(PROMPT), -1),
                           token_bytes(rec, rec.raw, attn(i), rec_blocks, len(PROMPT)))
    groups, _, _ = dsa_group(mla_dtype)
    h = make_harness(tmp_path / "rep", groups, block_size=BS, cache_dtype=mla_dtype, poison_seed=8,
                     extra={"fill_mode": "replay", "bank": str(tmp_path / "bank.safetensors"), "verify": "raise"})
    h.add("a", PROMPT + [5])
    h.step()  # verify: raise - every written row read back
    blocks = h.block_table("a")[0]
    for name in bank.layers:  # what replay must write: the recorded tokens' bytes, at this request's slots
        got = token_bytes(h, h.raw, name, blocks, len(PROMPT))
        assert torch.equal(got, token_bytes(rec, rec.raw, name, rec_blocks, len(PROMPT))), name
    # every other byte keeps its poison: put the poison back where the tokens are and compare all
    restored = h.raw.clone()
    for name in bank.layers:
        _put_tokens(h, restored, name, blocks, len(PROMPT), token_bytes(h, h.poison, name, blocks, len(PROMPT)))
    assert torch.equal(restored, h.poison)


def _put_tokens(h, buffer, name, blocks, n, rows):
    view = h.views_over(buffer)[name]
    for t in range(n):
        b, o = blocks[t // BS], t % BS
        if name.endswith("k_cache"):
            page = view.reshape(view.shape[0], -1)[b]
            page[o * 128:(o + 1) * 128] = rows[t, :128]
            page[BS * 128 + 4 * o:BS * 128 + 4 * o + 4] = rows[t, 128:]
        else:
            view.reshape(view.shape[0], BS, -1)[b, o] = rows[t].view(view.dtype)


def test_a_bank_without_the_indexers_rows_is_refused_unless_zeros_are_accepted(tmp_path):
    from kvfill.kernels import Bank

    groups, _, _ = dsa_group("auto")
    g = torch.Generator(device="cpu").manual_seed(1)
    Bank({attn(i): torch.randn(len(PROMPT), 576, generator=g, device="cpu").to(torch.bfloat16)
          for i in range(LAYERS)}, sequence_lengths=[len(PROMPT)], sequence_tokens=[PROMPT],
         kv={attn(i): (1, 576, 0) for i in range(LAYERS)}).save(tmp_path / "old.safetensors")
    extra = {"fill_mode": "replay", "bank": str(tmp_path / "old.safetensors")}
    with pytest.raises(Exception, match=r"has no rows for 2 sparse-attention cache layer\(s\) of this engine "
                                        r"\(model.layers.0.self_attn.indexer.k_cache, .*: indexer\), which its decode "
                                        r"reads. Record the bank again .* zero_packed: true"):
        make_harness(tmp_path / "a", groups, block_size=BS, extra=extra)
    h = make_harness(tmp_path / "b", groups, block_size=BS, extra={**extra, "zero_packed": True})
    h.add("a", PROMPT + [5])
    h.step()
    blocks = h.block_table("a")[0]
    for i in range(LAYERS):  # the in-tree connector's zeros, in the filled tokens' bytes only
        assert torch.all(token_bytes(h, h.raw, indexer(i), blocks, len(PROMPT)) == 0)
    restored = h.raw.clone()
    for name in [attn(i) for i in range(LAYERS)] + [indexer(i) for i in range(LAYERS)]:
        _put_tokens(h, restored, name, blocks, len(PROMPT), token_bytes(h, h.poison, name, blocks, len(PROMPT)))
    assert torch.equal(restored, h.poison)


def test_a_synthetic_fill_gives_the_indexer_scaled_keys_and_the_ds_mla_rows_valid_values(tmp_path):
    from kvfill.kernels.packed_rows import power_of_two_scale

    groups, mla, idx = dsa_group("fp8_ds_mla")
    assert (packed_row_kind(mla), packed_row_kind(idx)) == (FP8_DS_MLA, INDEXER)
    h = make_harness(tmp_path, groups, block_size=BS, cache_dtype="fp8_ds_mla",
                     extra={"fill_std": 0.1, "fill_mean": 0.0, "verify": "raise"})
    h.add("a", PROMPT + [5])
    h.step()
    blocks = h.block_table("a")[0]
    rows = token_bytes(h, h.raw, indexer(1), blocks, len(PROMPT))
    scale = rows[:, 128:].contiguous().view(torch.float32).reshape(-1)
    assert torch.all(scale == power_of_two_scale(0.0, 0.1))
    keys = rows[:, :128].contiguous().view(torch.float8_e4m3fn).float() * scale[:, None]
    assert torch.isfinite(keys).all() and abs(keys.std().item() - 0.1) < 0.01
    latent = token_bytes(h, h.raw, attn(0), blocks, len(PROMPT))
    tile_scales = latent[:, 512:528].contiguous().view(torch.float32)
    assert torch.all(tile_scales == power_of_two_scale(0.0, 0.1))
    rope = latent[:, 528:].contiguous().view(torch.bfloat16).float()
    assert torch.isfinite(rope).all() and (rope != 0).float().mean() > 0.99


def test_a_compressed_indexer_in_the_latents_group_is_left_out_and_named_not_a_crash(tmp_path, caplog):
    """GLM-5-Next's kpool indexer (one state per 4 tokens) shares the MLA
    latent's group: its pages hold other slots than the block table says.
    The connector starts, fills the latents, leaves the compressed pages as
    they are and names them."""
    import dataclasses

    from vllm.v1.kv_cache_interface import UniformTypeKVCacheSpecs

    _, mla, idx = dsa_group("auto")
    kpool = dataclasses.replace(idx, tokens_per_state=4)
    specs = {}
    for i in range(LAYERS):
        specs[attn(i)], specs[indexer(i)] = mla, kpool
    with connector_lines() as said:
        h = make_harness(tmp_path, [(list(specs), UniformTypeKVCacheSpecs(block_size=BS, kv_cache_specs=specs))],
                         block_size=BS, extra={"fill_std": 0.1, "verify": "raise"})
    assert any("2 cache layer(s) hold one state per several tokens" in line and indexer(0) in line
               and "[4] tokens per state" in line for line in said), said
    h.add("a", PROMPT + [5])
    h.step()  # verify: raise - the latents' rows read back
    blocks = h.block_table("a")[0]
    assert not torch.equal(token_bytes(h, h.raw, attn(0), blocks, len(PROMPT)),
                           token_bytes(h, h.poison, attn(0), blocks, len(PROMPT)))
    for i in range(LAYERS):  # the compressed pages: untouched
        view, poison = h.views[indexer(i)], h.views_over(h.poison)[indexer(i)]
        assert torch.equal(view, poison)


def test_a_recording_of_a_cache_kvfill_cannot_hold_is_one_line_before_a_prompt_runs(tmp_path):
    """A compressed indexer (GLM-5-Next's kpool) in the record role: refused
    at registration, naming the layers, their kind and the way out - not
    'blocks freed before the read' after the prefill."""
    import dataclasses

    from vllm.v1.kv_cache_interface import UniformTypeKVCacheSpecs

    _, mla, idx = dsa_group("auto")
    specs = {}
    for i in range(LAYERS):
        specs[attn(i)], specs[indexer(i)] = mla, dataclasses.replace(idx, tokens_per_state=4)
    with pytest.raises(ValueError, match=r"KVFillConnector: cannot record 2 cache layer\(s\) of this engine "
                                         r"\(model.layers.0.self_attn.indexer.k_cache, .*MLAAttentionSpec "
                                         r"\(uint8, indexer, 4 tokens per state\).*such a model cannot be recorded yet"):
        make_harness(tmp_path, [(list(specs), UniformTypeKVCacheSpecs(block_size=BS, kv_cache_specs=specs))],
                     block_size=BS, extra={"record_dir": str(tmp_path / "work")})


def test_a_synthetic_fill_writes_valid_nvfp4_latent_rows(tmp_path):
    """nvfp4_ds_mla: e2m1 values two a byte, e4m3 RoPE values, 32 equal e4m3
    scales - the values decode (e2m1 x scale) to the fill's spread; nothing
    is left zero, so no warning names them."""
    from kvfill.kernels.packed_rows import nvfp4_ds_mla_values
    from kvfill.kernels.value_tables import E2M1
    from kvfill.kernels.values import ValueSpec

    groups, _, _ = dsa_group("nvfp4_ds_mla")
    with connector_lines() as said:
        h = make_harness(tmp_path, groups, block_size=BS, cache_dtype="nvfp4_ds_mla",
                         extra={"fill_std": 0.1, "fill_mean": 0.0, "verify": "raise"})
    assert not any("left zero" in line for line in said), said
    h.add("a", PROMPT + [5])
    h.step()
    rows = token_bytes(h, h.raw, attn(0), h.block_table("a")[0], len(PROMPT))
    scale = nvfp4_ds_mla_values(ValueSpec(0.0, 0.1))[2].constant
    assert torch.all(rows[:, 320:].contiguous().view(torch.float8_e4m3fn).float() == scale)
    nibbles = torch.stack([rows[:, :256] & 15, rows[:, :256] >> 4], dim=2).reshape(len(PROMPT), 512).long()
    mags = torch.tensor(E2M1)[nibbles & 7]
    values = torch.where(nibbles >= 8, -mags, mags) * scale
    assert abs(values.std().item() - 0.1) < 0.02 and (values != 0).float().mean() > 0.7
    rope = rows[:, 256:320].contiguous().view(torch.float8_e4m3fn).float()
    assert torch.isfinite(rope).all() and abs(rope.std().item() - 0.1) < 0.02


def test_layer_ids_are_unique_and_the_same_on_every_pipeline_stage_when_caches_share_a_layer_number():
    """A DSA layer registers two caches under one layer number: each gets its
    own id (its own synthetic values), and a pipeline stage holding layers
    3-4 numbers them as the whole model does (no two stages alike)."""
    from kvfill.connector.registration import layer_ids

    whole = layer_ids({n: None for i in range(5) for n in (attn(i), indexer(i))})
    stage = layer_ids({n: None for i in (3, 4) for n in (attn(i), indexer(i))})
    assert len(set(whole.values())) == 10 and all(whole[n] == stage[n] for n in stage)
    assert layer_ids({"model.layers.2.self_attn.attn": None, "model.layers.5.self_attn.attn": None}) == {
        "model.layers.2.self_attn.attn": 2, "model.layers.5.self_attn.attn": 5}


@pytest.mark.parametrize("mla_dtype", ["auto", "fp8_ds_mla"])
def test_past_bank_rotate_turns_the_indexers_and_mlas_rope_parts_of_a_dsa_model(tmp_path, mla_dtype, monkeypatch,
                                                                               vllm_cpu_platform):
    """DeepSeek-V3.2's two embeddings of one table (MLA's GPT-J pairs, the
    indexer's NeoX ones) read from vLLM's get_rope: a prompt 80 tokens past
    the bank's 150 replays the recorded bytes below 150; past it each
    layer's RoPE part differs from the recorded row's (the indexer's fp8 keys
    requantised, the MLA row's last 64 values / fp8_ds_mla's bf16 part) and
    everything else is the recorded row's - checked by verify 'raise'."""
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers import rotary_embedding
    from vllm.model_executor.layers.rotary_embedding import get_rope

    rec, rec_blocks, bank = record(tmp_path, mla_dtype)
    monkeypatch.setattr(rotary_embedding, "_ROPE_DICT", {})
    yarn = {"rope_theta": 10000, "rope_type": "deepseek_yarn", "factor": 40, "original_max_position_embeddings": 4096,
            "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}
    with set_current_vllm_config(VllmConfig()):
        for neox in (False, True):  # MLA's, the indexer's
            get_rope(64, 4096, is_neox_style=neox, rope_parameters=yarn, dtype=torch.bfloat16)
    groups, _, _ = dsa_group(mla_dtype)
    h = make_harness(tmp_path / "rep", groups, block_size=BS, cache_dtype=mla_dtype, poison_seed=8,
                     extra={"fill_mode": "replay", "bank": str(tmp_path / "bank.safetensors"), "verify": "raise",
                            "past_bank": "rotate"})
    assert "re-rotating 4 layers' keys past each recorded sequence's end" in h.worker.worker.engine.describe()
    n = len(PROMPT) + 80
    h.add("a", PROMPT + list(range(7, 7 + 80)) + [5])
    h.step()  # verify: raise - every written row read back, turned as the fill turned it
    blocks = h.block_table("a")[0]
    for name in bank.layers:
        got = token_bytes(h, h.raw, name, blocks, n)
        held = token_bytes(rec, rec.raw, name, rec_blocks, len(PROMPT))
        assert torch.equal(got[:len(PROMPT)], held), name
        past, again = got[len(PROMPT):], held[torch.arange(80) % len(PROMPT)]
        if name.endswith("k_cache"):  # fp8 keys: the first 64 turned; a scale may change with the turned key's amax
            assert (past[:, :64] != again[:, :64]).any(dim=1).all(), name
        else:
            rope = slice(528, 656) if mla_dtype == "fp8_ds_mla" else slice(1024, 1152)  # bf16: 512 latent, then 64
            assert torch.equal(past[:, :rope.start], again[:, :rope.start]), name
            assert (past[:, rope] != again[:, rope]).any(dim=1).all(), name


@pytest.mark.parametrize("mx", [False, True], ids=["float32", "ue8m0"])
def test_a_recording_names_how_its_vllm_stores_the_indexers_scales(tmp_path, monkeypatch, mx):
    """Issue 59 G2: the bank's provenance ``indexer_scales`` is the recording
    worker's vLLM's rule (``mqa_logits_use_mx_scales``, True on SM100)."""
    import kvfill.connector.packed as packed

    monkeypatch.setattr(packed, "indexer_mx_scales", lambda: mx)
    _, _, bank = record(tmp_path, "auto")
    assert bank.metadata["indexer_scales"] == ("ue8m0_x4" if mx else "float32")


def _replay(tmp_path, name, mla_dtype, extra, n_extra=0):
    """Replay PROMPT (+ ``n_extra`` tokens) from tmp_path's bank; the indexer layers' token bytes."""
    groups, _, _ = dsa_group(mla_dtype)
    h = make_harness(tmp_path / name, groups, block_size=BS, cache_dtype=mla_dtype, poison_seed=8,
                     extra={"fill_mode": "replay", "bank": str(tmp_path / "bank.safetensors"), "verify": "raise",
                            **extra})
    h.add("a", PROMPT + list(range(7, 7 + n_extra)) + [5])
    h.step()  # verify: raise - every written row read back
    blocks = h.block_table("a")[0]
    return {indexer(i): token_bytes(h, h.raw, indexer(i), blocks, len(PROMPT) + n_extra) for i in range(LAYERS)}


@pytest.mark.parametrize("rotate", [False, True], ids=["replay", "rotate"])
def test_a_float32_bank_replays_into_a_ue8m0_reading_vllm_as_the_same_keys_in_its_bytes(tmp_path, monkeypatch,
                                                                                     rotate, vllm_cpu_platform):
    """Issue 59 G2: a bank recorded where vLLM stores float32 scales (H200,
    vLLM 0.32), replayed where it reads four UE8M0 bytes (B200, vLLM 0.34):
    every indexer token's bytes are the float32 replay's with the scale as
    vLLM 0.34's ``pack_ue8m0_x4`` stores it - the recorded keys, and past
    the bank's end (``past_bank: rotate``) the same turned keys, decoded
    from what the converted rows hold.  Before the conversion at load the
    float32 bytes were replayed verbatim (verify passed) and re-rotation
    read them as UE8M0 bytes."""
    from test_indexer_scales import pack_ue8m0_x4

    import kvfill.connector.packed as packed

    _, _, bank = record(tmp_path, "auto")
    assert bank.metadata["indexer_scales"] == "float32"
    extra, n_extra = {}, 0
    if rotate:
        from vllm.config import VllmConfig, set_current_vllm_config
        from vllm.model_executor.layers import rotary_embedding
        from vllm.model_executor.layers.rotary_embedding import get_rope

        monkeypatch.setattr(rotary_embedding, "_ROPE_DICT", {})
        yarn = {"rope_theta": 10000, "rope_type": "deepseek_yarn", "factor": 40,
                "original_max_position_embeddings": 4096, "beta_fast": 32, "beta_slow": 1, "mscale": 1.0,
                "mscale_all_dim": 1.0}
        with set_current_vllm_config(VllmConfig()):
            for neox in (False, True):  # MLA's, the indexer's
                get_rope(64, 4096, is_neox_style=neox, rope_parameters=yarn, dtype=torch.bfloat16)
        extra, n_extra = {"past_bank": "rotate"}, 80
    here = _replay(tmp_path, "f32", "auto", extra, n_extra)
    monkeypatch.setattr(packed, "indexer_mx_scales", lambda: True)
    sm100 = _replay(tmp_path, "mx", "auto", extra, n_extra)
    for name, rows in here.items():
        scale = rows[:, 128:].contiguous().view(torch.float32)[:, 0]
        assert torch.all(torch.frexp(scale).mantissa == 0.5), name
        want = torch.cat([rows[:, :128], pack_ue8m0_x4(scale)[:, None].contiguous().view(torch.uint8)], dim=1)
        assert torch.equal(sm100[name], want), name

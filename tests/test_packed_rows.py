"""DeepSeek's sparse-attention caches (``kvfill/kernels/packed_rows.py``): the
indexer K cache, whose page is not token-major, and ``fp8_ds_mla`` latent
rows.  Pages written by a port of vLLM's own writers (``dsa_writers.py``) are
recorded and replayed into poisoned caches: every filled token's value and
scale bytes equal, every other byte untouched, both backends, partial
blocks, a 128-token block split into 64-token kernel blocks, DCP 2; vLLM
CPU's own indexer reader scores the replayed pages bit for bit as the real
ones.  Synthetic fills write rows that decode to the fill's values."""
import pytest
import torch
from kvfill.bench.dsa_writers import indexer_row, pack_ds_mla, pages, unpack_ds_mla, write_indexer
from oracle import dcp_position, poisoned_buffer

from kvfill.kernels import Bank, CacheGroup, DcpGeometry, FillEngine, GroupFill
from kvfill.kernels import values as V
from kvfill.kernels.packed_rows import (
    DS_MLA_ROW,
    ds_mla_parts,
    ds_mla_values,
    indexer_parts,
    indexer_values,
    power_of_two_scale,
)

P, D = 64, 128          # the indexer's kernel block (tokens) and key dim
BLOCK = 128             # the manager's block: two kernel blocks
NUM_BLOCKS = 4          # manager blocks
PAD = 40                # bytes between pages (a page stride wider than a page)
N = 150                 # positions recorded: the last block partial (22 of 128)


def kernel_cache(width: int, seed: int, pad: int = PAD) -> torch.Tensor:
    """vLLM's registered view ``[kernel blocks, 1, P, width]`` uint8 over a poisoned buffer."""
    stride = P * width + pad
    buf = poisoned_buffer(NUM_BLOCKS * 2 * stride, seed=seed)
    return buf.as_strided((NUM_BLOCKS * 2, 1, P, width), (stride, stride, width, 1))


def kernel_slots(table: list[int], positions) -> list[int]:
    """Kernel slot (kernel block * P + offset) of each position under a manager block table."""
    out = []
    for p in positions:
        block, slot = table[p // BLOCK], p % BLOCK
        out.append((block * 2 + slot // P) * P + slot % P)
    return out


def entries(table: list[int], n: int, first: int = 0) -> GroupFill:
    """Positions [first, n) in blocks of ``table`` (manager blocks of BLOCK tokens)."""
    ids, lo, hi, base = [], [], [], []
    for i, b in enumerate(table):
        s0, s1 = max(first - i * BLOCK, 0), min(n - i * BLOCK, BLOCK)
        if s1 > s0:
            ids.append(b), lo.append(s0), hi.append(s1), base.append(i * BLOCK)  # slot 0 of the block
    return GroupFill(ids, lo, hi, base)


def keys(n: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator(device="cpu").manual_seed(seed)
    return (torch.randn(n, D, generator=g, device="cpu") * torch.rand(n, 1, generator=g, device="cpu") * 4).to(
        torch.empty(0).device)


def group(cache: torch.Tensor, dcp: DcpGeometry | None = None, encoding=V.ENC_AUTO) -> dict:
    kw = {"dcp": dcp} if dcp is not None else {}
    return {"g": CacheGroup({"idx": indexer_parts(cache)}, num_blocks=NUM_BLOCKS, encoding=encoding, **kw)}


def recorded_indexer(backend) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys of N positions written by vLLM's writer into blocks [3, 1], and what kvfill records of them."""
    cache = kernel_cache(D + 4, seed=1)
    k = keys(N)
    write_indexer(cache, k, kernel_slots([3, 1], range(N)))
    rows = FillEngine(group(cache), backend=backend).read({"g": entries([3, 1], N)})["idx"]
    return k, rows


def test_a_recorded_indexer_row_is_the_tokens_fp8_key_then_its_scale(backend):
    k, rows = recorded_indexer(backend)
    assert rows.dtype == torch.uint8 and rows.shape == (N, D + 4)
    assert torch.equal(rows, indexer_row(k))


@pytest.mark.parametrize("first", [0, 138], ids=["whole", "from-mid-block"])
def test_replayed_indexer_pages_hold_the_writers_bytes_of_the_filled_tokens_and_nothing_else(backend, first):
    """Replayed into other blocks [0, 2] of a poisoned cache: the filled
    positions' key bytes and scale bytes are those vLLM's writer puts there
    (partial last block; from the middle of a block, as after a prefix-cache
    hit); every other byte keeps its poison."""
    k, rows = recorded_indexer(backend)
    cache = kernel_cache(D + 4, seed=7)
    want = twin(cache)
    write_indexer(want, k[first:], kernel_slots([0, 2], range(first, N)))
    FillEngine(group(cache), bank=Bank({"idx": rows}, sequence_lengths=[N]), backend=backend).fill(
        {"g": entries([0, 2], N, first)})
    assert torch.equal(_buffer(cache), _buffer(want))


def _buffer(cache: torch.Tensor) -> torch.Tensor:
    """The whole buffer under the cache's view (padding between pages included)."""
    return cache.as_strided((cache.shape[0] * cache.stride(0),), (1,), 0)


def twin(cache: torch.Tensor) -> torch.Tensor:
    """The same view over a copy of the whole buffer (``clone`` would drop the padding)."""
    return _buffer(cache).clone().as_strided(cache.shape, cache.stride())


def indexer_ops():
    """vLLM's ops module, or a skip where vLLM CPU's kernels for this CPU have
    no sparse-indexer ops: vLLM loads one of three builds by CPU feature
    (``CpuPlatform.import_kernels``), and only the one for AVX-512 BF16
    (``_C``) holds ``fp8_paged_mqa_logits_cpu``; the AVX-512 and AVX2 builds
    do not (an AMD EPYC with AVX2 only ran these as skips).  vLLM 0.34 keeps
    the ops' wrappers in ``vllm._cpu_ops`` (``cpu_layout.cpu_ops``); a vLLM
    that is not vLLM CPU (the 0.34 lane's CUDA wheel) has no CPU kernels."""
    import vllm
    from vllm.platforms import vllm_version_matches_substr

    from kvfill.connector.cpu_layout import cpu_ops

    if not vllm_version_matches_substr("cpu"):
        pytest.skip(f"vLLM {vllm.__version__} is not vLLM CPU (a CUDA wheel): it has no CPU kernels, "
                    f"fp8_paged_mqa_logits_cpu among them")
    if not hasattr(torch.ops._C, "fp8_paged_mqa_logits_cpu"):
        pytest.skip("vLLM CPU's kernels for this CPU have no fp8_paged_mqa_logits_cpu (only its AVX-512 BF16 "
                    "build has)")
    return cpu_ops()


@pytest.mark.needs_vllm
def test_vllm_cpus_indexer_reader_scores_replayed_pages_bit_for_bit_as_the_real_ones(backend):
    """``fp8_paged_mqa_logits_cpu`` (what vLLM CPU's sparse indexer reads)
    over the real pages and over the replayed ones: identical logits."""
    ops = indexer_ops()

    k, rows = recorded_indexer(backend)
    real = kernel_cache(D + 4, seed=1)
    write_indexer(real, k, kernel_slots([3, 1], range(N)))
    replayed = kernel_cache(D + 4, seed=9)
    FillEngine(group(replayed), bank=Bank({"idx": rows}, sequence_lengths=[N]), backend=backend).fill(
        {"g": entries([0, 2], N)})
    assert torch.equal(_logits(ops, real, [3, 1]), _logits(ops, replayed, [0, 2]))


def _logits(ops, cache, table, n=N, heads=4, seed=3):
    g = torch.Generator(device="cpu").manual_seed(seed)
    q = (torch.randn(1, heads, D, generator=g, device="cpu") * 8).to(torch.float8_e4m3fn)
    w = torch.randn(1, heads, generator=g, device="cpu") * D ** -0.5
    kernel_table = torch.tensor([[b * 2 + j for b in table for j in range(2)]], dtype=torch.int32)
    out = ops.fp8_paged_mqa_logits_cpu(q, pages(cache).cpu(), w, torch.tensor([n], dtype=torch.int32),
                                       kernel_table, P, n)
    return out[:, :n]


@pytest.mark.parametrize("interleave", [1, 4])
def test_indexer_replay_under_dcp_2_puts_each_ranks_positions_in_its_own_pages(backend, interleave):
    """A bank recorded at DCP 1 replayed at DCP 2: rank r's local slot l holds
    the writer's bytes of global position ``dcp_position(l)``."""
    k, rows = recorded_indexer(backend)
    bank = Bank({"idx": rows}, sequence_lengths=[N])
    for rank in range(2):
        local = [l for l in range(BLOCK * 2) if dcp_position(l, 2, rank, interleave) < N]
        cache = kernel_cache(D + 4, seed=11 + rank)
        want = twin(cache)
        write_indexer(want, k[[dcp_position(l, 2, rank, interleave) for l in local]], kernel_slots([2, 0], local))
        FillEngine(group(cache, DcpGeometry(2, rank, interleave)), bank=bank, backend=backend).fill(
            {"g": entries([2, 0], len(local))})
        assert torch.equal(_buffer(cache), _buffer(want)), rank


def test_a_synthetic_indexer_fill_writes_scaled_fp8_keys_that_score_apart(backend):
    """normal(0, 0.1): each token's scale is the power of two vLLM's writer
    would pick for such keys, its fp8 keys decode to the value function's
    values / the scale; verify passes; the bytes between pages are untouched."""
    cache = kernel_cache(D + 4, seed=5)
    before = _buffer(cache).clone()
    spec = V.ValueSpec(mean=0.0, std=0.1, seed=2)
    eng = FillEngine(group(cache, encoding={"idx": indexer_values(spec)}), values=spec, backend=backend)
    plan = {"g": entries([3, 1], N)}
    eng.fill(plan)
    assert eng.verify(plan).ok
    rows = eng.read(plan)["idx"]
    scale = rows[:, D:].contiguous().view(torch.float32).reshape(-1)
    assert torch.all(scale == power_of_two_scale(0.0, 0.1)) and power_of_two_scale(0.0, 0.1) == 2.0 ** -10
    decoded = rows[:, :D].contiguous().view(torch.float8_e4m3fn).float() * scale[:, None]
    assert torch.isfinite(decoded).all() and abs(decoded.std().item() - 0.1) < 0.01
    # (almost) every token its own key: two of N positions share a row start with probability ~N^2 / 2^19
    assert len(torch.unique(decoded, dim=0)) >= N - 2
    touched = torch.zeros_like(before, dtype=torch.bool)
    view = _buffer(cache)
    page_bytes = cache.shape[0] * cache.stride(0)
    assert page_bytes == view.numel()
    for s in kernel_slots([3, 1], range(N)):
        b, o = divmod(s, P)
        base = b * cache.stride(0)
        touched[base + o * D: base + (o + 1) * D] = True
        touched[base + P * D + 4 * o: base + P * D + 4 * o + 4] = True
    assert torch.equal(view[~touched], before[~touched])


@pytest.mark.parametrize("std, exponent", [(0.1, -10), (500.0, 3)])
def test_an_mx_indexer_fill_stores_each_scale_as_four_equal_ue8m0_bytes(backend, std, exponent):
    """vLLM 0.34's indexer writers on SM100 (``mqa_logits_use_mx_scales``)
    store a token's power-of-two scale ``2^k`` as four bytes ``k + 127``
    (``pack_ue8m0_x4``): the synthetic fill writes exactly those bytes (a
    scale above 1 too, whose bytes read as float32 are negative), the same
    fp8 keys as with a float32 scale, and nothing between the pages."""
    from kvfill.kernels.packed_rows import ue8m0_x4

    spec = V.ValueSpec(mean=0.0, std=std, seed=2)
    assert power_of_two_scale(0.0, std) == 2.0 ** exponent
    read = {}
    for mx in (False, True):
        cache = kernel_cache(D + 4, seed=5)
        before = _buffer(cache).clone()
        eng = FillEngine(group(cache, encoding={"idx": indexer_values(spec, mx_scales=mx)}), values=spec,
                         backend=backend)
        plan = {"g": entries([3, 1], N)}
        eng.fill(plan)
        assert eng.verify(plan).ok
        read[mx] = eng.read(plan)["idx"].view(torch.uint8)
        touched = torch.zeros_like(before, dtype=torch.bool)
        for slot in kernel_slots([3, 1], range(N)):
            b, o = divmod(slot, P)
            base = b * cache.stride(0)
            touched[base + o * D: base + (o + 1) * D] = True
            touched[base + P * D + 4 * o: base + P * D + 4 * o + 4] = True
        assert torch.equal(_buffer(cache)[~touched], before[~touched])
    assert torch.all(read[True][:, D:] == exponent + 127)
    assert torch.equal(read[True][:, :D], read[False][:, :D])
    assert ue8m0_x4(2.0 ** exponent) != 2.0 ** exponent
    with pytest.raises(ValueError, match="MX scale"):
        ue8m0_x4(3.0)


@pytest.mark.needs_vllm
def test_the_connector_writes_mx_scales_where_vllm_reads_them():
    """``packed_encoding`` asks the installed vLLM (``mqa_logits_use_mx_scales``,
    vLLM 0.34; absent in 0.32: float32 scales) which scale bytes its
    indexer readers take, here and with the check answering SM100's yes."""
    import vllm.utils.deep_gemm as dg

    from kvfill.connector.packed import INDEXER, indexer_mx_scales, packed_encoding
    from kvfill.kernels.packed_rows import ue8m0_x4

    spec = V.ValueSpec(mean=0.0, std=0.1, seed=2)
    here = packed_encoding(INDEXER, spec, zero=False)[1].constant
    assert here == (ue8m0_x4(2.0 ** -10) if indexer_mx_scales() else 2.0 ** -10)
    if not hasattr(dg, "mqa_logits_use_mx_scales"):
        assert not indexer_mx_scales()
        return
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(dg, "mqa_logits_use_mx_scales", lambda: True)
        assert indexer_mx_scales()
        assert packed_encoding(INDEXER, spec, zero=False)[1].constant == ue8m0_x4(2.0 ** -10)


@pytest.mark.needs_vllm
def test_vllm_cpus_indexer_reader_scores_synthetic_keys_apart_where_zeros_tie(backend):
    ops = indexer_ops()

    spec = V.ValueSpec(mean=0.0, std=0.1, seed=2)
    logits = {}
    for name, enc, values in (("normal", {"idx": indexer_values(spec)}, spec),
                              ("zeros", V.ENC_PACKED, spec)):
        cache = kernel_cache(D + 4, seed=5)
        FillEngine(group(cache, encoding=enc), values=values, backend=backend).fill({"g": entries([3, 1], N)})
        logits[name] = _logits(ops, cache, [3, 1], heads=16)  # 16 heads: a score is rarely relu-zero in all
    assert torch.isfinite(logits["normal"]).all()
    assert len(torch.unique(logits["normal"])) >= N - 5  # (almost) all distinct; relu zeros may repeat
    assert torch.all(logits["zeros"] == 0)  # the in-tree connector's fill: every score ties


# ------------------------------------------------------------------ fp8_ds_mla
def ds_mla_rows(n: int, seed: int = 4) -> torch.Tensor:
    g = torch.Generator(device="cpu").manual_seed(seed)
    latent = torch.randn(n, 512, generator=g, device="cpu") * torch.rand(n, 1, generator=g, device="cpu") * 3
    return pack_ds_mla(latent, torch.randn(n, 64, generator=g, device="cpu")).to(torch.empty(0).device)


def ds_mla_group(cache, encoding=V.ENC_AUTO) -> dict:
    return {"g": CacheGroup({"attn": ds_mla_parts(cache)}, num_blocks=NUM_BLOCKS, encoding=encoding)}


def test_fp8_ds_mla_rows_are_recorded_and_replayed_byte_for_byte(backend):
    rows = ds_mla_rows(N)
    cache = kernel_cache(DS_MLA_ROW, seed=21)
    slots = kernel_slots([3, 1], range(N))
    view = cache.squeeze(1)
    for i, s in enumerate(slots):
        view[s // P, s % P] = rows[i]
    recorded = FillEngine(ds_mla_group(cache), backend=backend).read({"g": entries([3, 1], N)})["attn"]
    assert torch.equal(recorded, rows)
    target = kernel_cache(DS_MLA_ROW, seed=22)
    want = twin(target)
    for i, s in enumerate(kernel_slots([0, 2], range(N))):
        want.squeeze(1)[s // P, s % P] = rows[i]
    FillEngine(ds_mla_group(target), bank=Bank({"attn": recorded}, sequence_lengths=[N]), backend=backend).fill(
        {"g": entries([0, 2], N)})
    assert torch.equal(_buffer(target), _buffer(want))


def test_a_synthetic_fp8_ds_mla_fill_writes_valid_rows(backend):
    """fp8 values, 4 power-of-two scales, bf16 RoPE values: the latent decodes
    to normal(0.015, 0.1), the RoPE part holds the value function's bf16
    values; nothing is zero or NaN."""
    spec = V.ValueSpec(mean=0.015, std=0.1, seed=6)
    cache = kernel_cache(DS_MLA_ROW, seed=23)
    eng = FillEngine(ds_mla_group(cache, {"attn": ds_mla_values(spec)}), values=spec, backend=backend)
    plan = {"g": entries([3, 1], N)}
    eng.fill(plan)
    assert eng.verify(plan).ok
    latent, scale, rope = unpack_ds_mla(eng.read(plan)["attn"])
    s = power_of_two_scale(0.015, 0.1)
    assert torch.all(scale == s) and s == 2.0 ** -10
    assert torch.isfinite(latent).all() and abs(latent.mean().item() - 0.015) < 0.01
    assert abs(latent.std().item() - 0.1) < 0.01
    rope = rope.float()
    assert torch.isfinite(rope).all() and abs(rope.std().item() - 0.1) < 0.01 and (rope != 0).float().mean() > 0.99


def test_packed_row_views_refuse_a_cache_of_another_shape():
    with pytest.raises(ValueError, match=r"fp8_ds_mla cache: expected 656 bytes per token .*got 576"):
        ds_mla_parts(torch.zeros(2, 1, P, 576, dtype=torch.uint8))
    with pytest.raises(ValueError, match=r"indexer cache: expected a uint8 cache tensor, got torch.bfloat16"):
        indexer_parts(torch.zeros(2, 1, P, 132, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match=r"indexer cache: expected pages of 64 x 132 contiguous bytes"):
        indexer_parts(torch.zeros(2, 132, P, dtype=torch.uint8).transpose(1, 2))


def test_e2m1_pairs_round_to_the_nearest_fp4_value_ties_to_even_codes_the_even_value_low():
    """The nvfp4 encoding a synthetic nvfp4_ds_mla row is made of (value_tables.encode_e2m1_pairs)."""
    import numpy as np

    from kvfill.kernels.value_tables import encode_e2m1_pairs

    got = encode_e2m1_pairs(np.array([0.0, 0.5, -1.0, 6.0, 7.0, -0.25, 0.75, 2.5, 5.0, -0.1]))
    # (0, 0.5) -> codes 0, 1; (-1, 6) -> 2|8, 7; (7 -> 6, -0.25 -> 0 tie to even); (0.75 -> 1.0, 2.5 -> 2.0): ties
    # to the even code; (5.0 -> 4.0, -0.1 -> +0)
    assert got.tolist() == [0 | 1 << 4, 10 | 7 << 4, 7 | 0 << 4, 2 | 4 << 4, 6 | 0 << 4]


@pytest.mark.parametrize("make", [indexer_values, ds_mla_values], ids=["indexer", "fp8_ds_mla"])
def test_every_parts_value_table_is_whole_so_a_row_starting_at_the_last_start_reads_inside_it(make):
    """Each part's table holds ``2**pool_bits`` entries plus the widest row
    less one (a row reads ``table[start : start + row]`` with start up to
    ``2**pool_bits - 16``), e2m1 pairs included."""
    from kvfill.kernels.packed_rows import nvfp4_ds_mla_values
    from kvfill.kernels.value_tables import value_table

    spec = V.ValueSpec(mean=0.0, std=0.1)
    for part in (*make(spec), *nvfp4_ds_mla_values(spec)):
        table = value_table(V.NORMAL, spec.mean, spec.std, part.vdtype, 1, torch.device("cpu"), max_row=256,
                            part=part)
        assert table.numel() == (1 << part.pool_bits) + 255, part
    assert make(spec)[0].pool_bits == (V.PARTS_POOL_BITS if make is indexer_values else V.POOL_BITS)

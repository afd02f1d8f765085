"""A DeepSeek indexer row's scale in either of vLLM's encodings (issue 59, G2):
float32 ``2^k`` (vLLM 0.32; 0.34 off SM100) or four UE8M0 bytes ``k + 127``
(vLLM 0.34 on SM100).  A bank records which (``indexer_scales``); a replaying
worker converts the rows to the encoding its own vLLM reads
(``connector/packed.py`` ``match_indexer_scales``, from ``check_packed_rows``)
with ``kernels/packed_rows.py`` ``convert_indexer_scales``, or refuses naming
both.  The reference is a port of vLLM 0.34.0's writer, written from its
source (below), not from kvfill's code:

* ``vllm/models/deepseek_v32/common/kernels.py:64-75`` ``_fp8_ue8m0_quantize``:
  ``scale = 2^ceil(log2(max(amax, 1e-4) / 448))``, fp8 e4m3 keys ``k / scale``;
* ``kernels.py:116-119`` ``_fp8_quant_and_cache_write``: the scale at byte
  ``P * D + 4 * offset`` of the token's page, ``pack_ue8m0_x4(scale)`` first
  when ``MX_SCALE``; ``kernels.py:584-587``: stored through an int32 view of
  the cache then, a float32 view otherwise;
* ``vllm/v1/attention/ops/common.py:158-161`` ``pack_ue8m0_x4``:
  ``((bits(scale) >> 23) & 0xFF) * 0x01010101``;
* ``vllm/utils/deep_gemm.py:656-666`` ``mqa_logits_use_mx_scales``: CUDA and
  device capability family 100 (B200/GB200).
"""
import logging

import numpy as np
import pytest
import torch
from oracle import poisoned_buffer

from kvfill.bank import Bank, BankError
from kvfill.connector.packed import INDEXER, INDEXER_SCALES_KEY, check_packed_rows, match_indexer_scales
from kvfill.kernels.packed_rows import SCALES_FLOAT32, SCALES_UE8M0_X4, convert_indexer_scales

D, P = 128, 64  # key bytes per token; tokens per indexer page
FP8_MAX = 448.0


# ------------------------------------------------------------ vLLM 0.34.0's writer, ported (module docstring)
def pack_ue8m0_x4(scale: torch.Tensor) -> torch.Tensor:
    """common.py:161, on float32 scales ``[n]``: int32 ``[n]``."""
    return ((scale.float().contiguous().view(torch.int32) >> 23) & 0xFF) * 0x01010101


def write_page(keys: torch.Tensor, mx: bool) -> torch.Tensor:
    """One indexer page ``[P * D + P * 4]`` uint8 over poison, tokens ``0..n-1`` written by vLLM 0.34's writer."""
    page = poisoned_buffer(P * (D + 4), seed=11).cpu()
    k = keys.double().float()
    scale = torch.exp2(torch.ceil(torch.log2(k.abs().amax(-1).clamp_min(1e-4) / FP8_MAX)))  # kernels.py:71-72
    q = (k / scale[:, None]).to(torch.float8_e4m3fn)
    n = len(keys)
    page[:n * D] = q.view(torch.uint8).reshape(-1)
    stored = pack_ue8m0_x4(scale) if mx else scale  # kernels.py:117-118, through the int32 / float32 view
    page[P * D:P * D + 4 * n] = stored.contiguous().view(torch.uint8).reshape(-1)
    return page


def page_rows(page: torch.Tensor, n: int) -> torch.Tensor:
    """A bank's canonical indexer rows of the page's first n tokens: D key bytes, then the scale's 4."""
    return torch.cat([page[:n * D].view(n, D), page[P * D:P * D + 4 * n].view(n, 4)], dim=1)


def keys_of_every_scale(n: int = P) -> torch.Tensor:
    """Keys whose writer's scales run from the writer's smallest (2^-22) to 2^40."""
    g = torch.Generator(device="cpu").manual_seed(7)
    magnitude = torch.exp2(torch.linspace(-40, 48, n, device="cpu"))
    keys = torch.randn(n, D, generator=g, device="cpu") * magnitude[:, None]
    keys[0] = 0.0  # amax 0: the writer's floor, 2^ceil(log2(1e-4 / 448)) = 2^-22
    return keys


def poisoned_rows(rows: torch.Tensor, seed: int = 5) -> tuple[torch.Tensor, torch.Tensor]:
    """``rows`` copied into the middle of a poisoned buffer in host memory,
    where a loaded bank's rows are (a row above and below, 3 bytes either
    side): (the buffer, the rows' view of it)."""
    n, w = rows.shape
    buf = poisoned_buffer((n + 2) * (w + 6), seed).cpu().view(n + 2, w + 6)
    view = buf[1:-1, 3:3 + w]
    view.copy_(rows)
    return buf, view


def only_rows_changed(buf: torch.Tensor, before: torch.Tensor, w: int) -> bool:
    """The buffer equals ``before`` outside the rows' view."""
    mask = torch.ones_like(buf, dtype=torch.bool)
    mask[1:-1, 3:3 + w] = False
    return torch.equal(buf[mask], before[mask])


# ------------------------------------------------------------ the conversion, byte for byte
def test_the_writers_scales_cover_the_range_this_suite_converts():
    page = write_page(keys_of_every_scale(), mx=False)
    scales = page_rows(page, P)[:, D:].contiguous().view(torch.float32)[:, 0]
    assert scales[0] == 2.0 ** -22 and scales.max() >= 2.0 ** 40
    assert torch.all(torch.frexp(scales).mantissa == 0.5)  # powers of two


@pytest.mark.parametrize("source, target", [(SCALES_FLOAT32, SCALES_UE8M0_X4), (SCALES_UE8M0_X4, SCALES_FLOAT32)],
                         ids=["float32-to-ue8m0", "ue8m0-to-float32"])
def test_rows_convert_byte_for_byte_to_what_vllm_034s_writer_stores_in_the_other_encoding(source, target):
    keys = keys_of_every_scale()
    written = {enc: page_rows(write_page(keys, mx=enc == SCALES_UE8M0_X4), P) for enc in (source, target)}
    assert not torch.equal(written[source][:, D:], written[target][:, D:])
    buf, rows = poisoned_rows(written[source])
    before = buf.clone()
    assert convert_indexer_scales(rows, source, target) == P
    assert torch.equal(rows.cpu(), written[target]), "keys as written, the scale in the target's bytes"
    assert only_rows_changed(buf, before, D + 4), "no byte outside the rows"
    assert torch.equal(buf[1:-1, 3:3 + D], before[1:-1, 3:3 + D]), "the key bytes are not touched"


@pytest.mark.parametrize("k", [-127, -126, -22, -1, 0, 1, 40, 127])
def test_every_power_of_two_ue8m0_holds_round_trips_and_matches_pack_ue8m0_x4(k):
    scale = torch.tensor([2.0 ** k], dtype=torch.float32, device="cpu")
    rows = torch.zeros(1, D + 4, dtype=torch.uint8, device="cpu")
    rows[:, D:] = scale.view(torch.uint8)
    convert_indexer_scales(rows, SCALES_FLOAT32, SCALES_UE8M0_X4)
    assert rows[0, D:].tolist() == [k + 127] * 4
    assert torch.equal(rows[:, D:].contiguous().view(torch.int32)[:, 0], pack_ue8m0_x4(scale))
    convert_indexer_scales(rows, SCALES_UE8M0_X4, SCALES_FLOAT32)
    assert rows[:, D:].contiguous().view(torch.float32)[0, 0].item() == 2.0 ** k


@pytest.mark.parametrize("bad", [3.0, 0.0, -0.5, float("inf"), float("nan"), 2.0 ** -130],
                         ids=["not-a-power-of-two", "zero", "negative", "inf", "nan", "below-2^-127"])
def test_a_float32_scale_without_an_exact_ue8m0_code_is_refused_and_nothing_written(bad):
    rows = page_rows(write_page(keys_of_every_scale(8), mx=False), 8)
    rows[5, D:] = torch.tensor([bad], dtype=torch.float32, device="cpu").view(torch.uint8)
    buf, view = poisoned_rows(rows)
    before = buf.clone()
    with pytest.raises(ValueError, match=r"1 of 8 indexer scales have no exact ue8m0_x4 code \(first: row 5, "):
        convert_indexer_scales(view, SCALES_FLOAT32, SCALES_UE8M0_X4)
    assert torch.equal(buf, before)


@pytest.mark.parametrize("code", [[127, 127, 127, 126], [255] * 4], ids=["unequal-bytes", "nan-byte"])
def test_ue8m0_bytes_that_are_not_one_power_of_two_are_refused(code):
    rows = page_rows(write_page(keys_of_every_scale(8), mx=True), 8)
    rows[2, D:] = torch.tensor(code, dtype=torch.uint8, device="cpu")
    before = rows.clone()
    with pytest.raises(ValueError, match=r"1 of 8 indexer scales have no exact float32 code \(first: row 2, "
                                         r"UE8M0 bytes"):
        convert_indexer_scales(rows, SCALES_UE8M0_X4, SCALES_FLOAT32)
    assert torch.equal(rows, before)


# ------------------------------------------------------------ the bank's provenance, read at load
def saved_bank(tmp_path, rows: torch.Tensor, scales: str | None) -> Bank:
    """A bank of one indexer layer and one bf16 layer, saved with ``indexer_scales`` (None: without it), loaded."""
    meta = {"model": "dsa"} | ({INDEXER_SCALES_KEY: scales} if scales else {})
    other = torch.arange(len(rows) * 8, dtype=torch.float32, device="cpu").view(len(rows), 8).to(torch.bfloat16)
    Bank({"idx": rows, "attn": other}, sequence_lengths=[len(rows)], parts={"idx": [[D], [4]]},
         kv={"attn": (1, 8, 0)}, metadata=meta).save(tmp_path / "bank.safetensors")
    return Bank.load(tmp_path / "bank.safetensors")


@pytest.mark.parametrize("recorded, serving", [(SCALES_FLOAT32, SCALES_UE8M0_X4), (SCALES_UE8M0_X4, SCALES_FLOAT32),
                                               (SCALES_FLOAT32, SCALES_FLOAT32), (SCALES_UE8M0_X4, SCALES_UE8M0_X4)])
def test_a_loaded_banks_indexer_rows_hold_the_serving_encoding_after_check_packed_rows(tmp_path, recorded, serving):
    keys = keys_of_every_scale(40)
    rows = {enc: page_rows(write_page(keys, mx=enc == SCALES_UE8M0_X4), 40) for enc in (recorded, serving)}
    bank = saved_bank(tmp_path, rows[recorded], recorded)
    attn = bank.layers["attn"].clone()
    check_packed_rows(bank, bank.part, {"idx": INDEXER}, serving)
    assert torch.equal(bank.layers["idx"], rows[serving])
    assert torch.equal(bank.layers["attn"], attn), "other layers keep their bytes"
    assert bank.metadata[INDEXER_SCALES_KEY] == serving


def test_a_bank_recorded_before_the_key_is_taken_as_float32_said_once_where_vllm_reads_ue8m0(tmp_path, caplog):
    """One log line, only where the rows are converted."""
    keys = keys_of_every_scale(16)
    bank = saved_bank(tmp_path, page_rows(write_page(keys, mx=False), 16), None)
    with caplog.at_level(logging.INFO, logger="vllm.kvfill.connector"):
        assert match_indexer_scales(bank, {"idx": INDEXER}, SCALES_UE8M0_X4) == 1
    assert torch.equal(bank.layers["idx"], page_rows(write_page(keys, mx=True), 16))
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 1 and "converted from float32 (vLLM 0.32, and 0.34 off SM100) (taken as float32: the bank " \
        "does not record its indexer scale encoding" in said[0] and "to four UE8M0 bytes" in said[0], said
    caplog.clear()
    bank = saved_bank(tmp_path, page_rows(write_page(keys, mx=False), 16), None)
    with caplog.at_level(logging.INFO, logger="vllm.kvfill.connector"):
        assert match_indexer_scales(bank, {"idx": INDEXER}, SCALES_FLOAT32) == 0  # what it holds: nothing to say
    assert not caplog.records


def test_a_bank_whose_scales_cannot_be_converted_is_refused_naming_both_encodings(tmp_path):
    rows = page_rows(write_page(keys_of_every_scale(16), mx=False), 16)
    rows[9, D:] = torch.tensor([0.75], dtype=torch.float32, device="cpu").view(torch.uint8)
    bank = saved_bank(tmp_path, rows, SCALES_FLOAT32)
    with pytest.raises(BankError, match=r"bank.safetensors: layer 'idx' stores its indexer scales as float32 \(vLLM "
                                        r"0.32, and 0.34 off SM100\), this engine's vLLM reads four UE8M0 bytes \(vLLM "
                                        r"0.34 on SM100: B200/GB200\), .*first: row 9, 0.75 .*Record the bank again"):
        check_packed_rows(bank, bank.part, {"idx": INDEXER}, SCALES_UE8M0_X4)


def test_an_unknown_recorded_encoding_is_refused(tmp_path):
    bank = saved_bank(tmp_path, page_rows(write_page(keys_of_every_scale(4), mx=False), 4), "bf16")
    with pytest.raises(BankError, match=r"records indexer_scales='bf16'; expected one of \['float32', 'ue8m0_x4'\]"):
        match_indexer_scales(bank, {"idx": INDEXER}, SCALES_FLOAT32)


# ------------------------------------------------------------ recorded by the workers, merged by assemble
def write_part(work, tokens, tp_rank: int, scales: str) -> None:
    """A recorder's part file of a 2-head layer under TP 2, recorded with ``scales``."""
    import json

    from safetensors.torch import save_file

    from kvfill.record.assemble import rows_path

    rows = {"l": torch.full((len(tokens), 16), float(tp_rank), dtype=torch.bfloat16, device="cpu")}
    meta = {"key": "k", "positions": str(len(tokens)), "tp_rank": str(tp_rank), "tp_size": "2", "pp_rank": "0",
            "files_per_prompt": "2", "states": "{}", "heads": json.dumps({"l": [tp_rank, tp_rank + 1, 2]}),
            "value_dtypes": json.dumps({"l": "bfloat16"}),
            "layers": json.dumps({"l": {"kv": [1, 8, 8], "parts": [[1, 8], [1, 8]]}}), INDEXER_SCALES_KEY: scales}
    save_file(rows, rows_path(str(work), tokens, tp_rank, 0), metadata=meta)


def test_assemble_writes_the_workers_scale_encoding_and_refuses_two(tmp_path):
    from kvfill.record.assemble import assemble

    tokens = [list(range(5, 12))]
    (tmp_path / "one").mkdir()
    for r in range(2):
        write_part(tmp_path / "one", tokens[0], r, SCALES_UE8M0_X4)
    assert assemble(str(tmp_path / "one"), tokens, {"model": "m"}, "out").metadata[INDEXER_SCALES_KEY] == \
        SCALES_UE8M0_X4
    (tmp_path / "two").mkdir()
    write_part(tmp_path / "two", tokens[0], 0, SCALES_FLOAT32)
    write_part(tmp_path / "two", tokens[0], 1, SCALES_UE8M0_X4)
    with pytest.raises(RuntimeError, match=r"stored indexer scales in 2 encodings \(float32 on TP rank 0, PP rank 0 "
                                           r".*; ue8m0_x4 on TP rank 1, PP rank 0 .*record on GPUs of one kind"):
        assemble(str(tmp_path / "two"), tokens, {"model": "m"}, "out")


def test_the_serving_encoding_follows_vllms_mqa_logits_use_mx_scales(monkeypatch):
    import kvfill.connector.packed as packed

    monkeypatch.setattr(packed, "indexer_mx_scales", lambda: True)
    assert packed.indexer_scale_encoding() == SCALES_UE8M0_X4
    monkeypatch.setattr(packed, "indexer_mx_scales", lambda: False)
    assert packed.indexer_scale_encoding() == SCALES_FLOAT32


def test_decoded_keys_are_the_same_in_either_encoding():
    """What the conversion keeps: the key each row decodes to (fp8 x scale), bit for bit."""
    rows = page_rows(write_page(keys_of_every_scale(), mx=False), P)

    def decode(r, mx):
        s = torch.exp2(r[:, D].double() - 127) if mx else r[:, D:].contiguous().view(torch.float32)[:, 0].double()
        return r[:, :D].contiguous().view(torch.float8_e4m3fn).double() * s[:, None]
    want = decode(rows, False)
    convert_indexer_scales(rows, SCALES_FLOAT32, SCALES_UE8M0_X4)
    assert np.array_equal(decode(rows, True).numpy(), want.numpy())


def test_ue8m0_rows_taken_for_float32_are_refused_not_converted():
    """Why taking a bank without ``indexer_scales`` as float32 is safe: were
    its rows UE8M0 bytes, no scale reads as a float32 power of two."""
    rows = page_rows(write_page(keys_of_every_scale(), mx=True), P)
    with pytest.raises(ValueError, match=rf"{P} of {P} indexer scales have no exact ue8m0_x4 code"):
        convert_indexer_scales(rows, SCALES_FLOAT32, SCALES_UE8M0_X4)

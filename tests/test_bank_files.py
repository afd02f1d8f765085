"""Bank files that lie, change or are not banks: refused at start with a
BankError naming the file, the key and what was expected; saved atomically;
loaded into memory the process owns (host memory, whatever torch's default
device: the file data here is made on the host explicitly).  The bank package
imported alone loads neither vLLM nor the rest of kvfill.
"""
import os
import stat

import pytest
import torch

pytest.importorskip("safetensors")  # a torch + triton only image (the GPU check) may lack it
from safetensors import safe_open  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

from kvfill.bank import BANK_VERSION, Bank, BankError, BankIndex, DcpGeometry  # noqa: E402

S, ROW = 2, 8
LENGTHS = [4, 7]  # a ragged bank: T = 11 rows
T = sum(LENGTHS)
TOKENS = [list(range(10, 14)), list(range(20, 27))]


def good_bank(tmp_path, name="bank.safetensors"):
    g = torch.Generator(device="cpu").manual_seed(1)
    rows = {"l0": torch.randn(T, ROW, generator=g, device="cpu"),
            "l1": torch.randn(T, ROW, generator=g, device="cpu")}
    path = tmp_path / name
    Bank(rows, sequence_lengths=LENGTHS, sequence_tokens=TOKENS, value_dtypes={"l0": "float32", "l1": "float32"},
         kv={"l0": (2, 2, 2)}, metadata={"model": "m"}).save(path)
    return path, rows


def rewrite(path, tensors=None, seal=True, **changes):
    """The same file with some metadata keys changed (None: removed) and
    some tensors replaced (``tensors``: name -> tensor); ``seal``: its
    metadata digest made to match again (a file written so, not edited after
    its save: what the checks of each key meet)."""
    from kvfill.bank.files import metadata_digest

    with safe_open(str(path), framework="pt", device="cpu") as f:
        meta = dict(f.metadata())
        old = {n: f.get_tensor(n) for n in f.keys()}
    old.update(tensors or {})
    for k, v in changes.items():
        if v is None:
            meta.pop(k, None)
        else:
            meta[k] = v
    if seal and "metadata_sha256" in meta:
        meta["metadata_sha256"] = metadata_digest(meta)
    save_file(old, str(path), metadata=meta)


def rewrite_metadata(path, seal=True, **changes):
    rewrite(path, seal=seal, **changes)


LENGTHS_EXPECTED = r"expected a list of 2 ints >= 1 \(each sequence's positions\)"


@pytest.mark.parametrize("key, value, expected", [
    ("num_sequences", "0", r"metadata 'num_sequences' is '0'; expected an int >= 1"),
    ("num_sequences", "x", r"metadata 'num_sequences' is 'x'; expected an int >= 1"),
    ("num_sequences", None, r"metadata 'num_sequences' is None; expected an int >= 1"),
    ("num_sequences", "5", r"metadata 'sequence_lengths' is \[4, 7\]; expected a list of 5 ints >= 1"),
    ("num_sequences", "1", r"metadata 'sequence_lengths' is \[4, 7\]; expected a list of 1 ints >= 1"),
    ("sequence_lengths", None, r"metadata 'sequence_lengths' is missing; " + LENGTHS_EXPECTED),
    ("sequence_lengths", "nope", r"metadata 'sequence_lengths' is not JSON \(.*\); " + LENGTHS_EXPECTED),
    ("sequence_lengths", "11", r"metadata 'sequence_lengths' is a int; " + LENGTHS_EXPECTED),
    ("sequence_lengths", '{"0": 4}', r"metadata 'sequence_lengths' is a dict; " + LENGTHS_EXPECTED),
    ("sequence_lengths", "[11]", r"metadata 'sequence_lengths' is \[11\]; " + LENGTHS_EXPECTED),
    ("sequence_lengths", "[4, 7, 0]", r"metadata 'sequence_lengths' is \[4, 7, 0\]; " + LENGTHS_EXPECTED),
    ("sequence_lengths", "[11, 0]", r"metadata 'sequence_lengths' is \[11, 0\]; " + LENGTHS_EXPECTED),
    ("sequence_lengths", "[-3, 14]", r"metadata 'sequence_lengths' is \[-3, 14\]; " + LENGTHS_EXPECTED),
    ("sequence_lengths", "[4.0, 7]", r"metadata 'sequence_lengths' is \[4\.0, 7\]; " + LENGTHS_EXPECTED),
    ("sequence_lengths", "[true, 10]", r"metadata 'sequence_lengths' is \[True, 10\]; " + LENGTHS_EXPECTED),
    ("sequence_lengths", '["4", 7]', r"metadata 'sequence_lengths' is \['4', 7\]; " + LENGTHS_EXPECTED),
    # well-formed, but another sum than the tensors' rows
    ("sequence_lengths", "[5, 7]", r"layer 'l0' has shape \[11, 8\], but the metadata's sequence_lengths sum to 12 "
                                   r"rows \(expected \[12, row\]\)"),
    ("sequence_lengths", "[4, 6]", r"layer 'l0' has shape \[11, 8\], but the metadata's sequence_lengths sum to 10 "
                                   r"rows \(expected \[10, row\]\)"),
])
def test_metadata_that_disagrees_with_the_tensors_is_refused_naming_file_key_and_values(tmp_path, key, value,
                                                                                          expected):
    path, _ = good_bank(tmp_path)
    rewrite_metadata(path, **{key: value})
    for read in (BankIndex.read, Bank.load):
        with pytest.raises(BankError, match=str(path).replace(".", r"\.") + ": " + expected):
            read(path)


@pytest.mark.parametrize("tensors, expected", [
    # a version-2 [S, N, R] tensor under version-3 metadata
    ({"l0": torch.zeros(2, 6, ROW, device="cpu")}, r"layer 'l0' has shape \[2, 6, 8\], but the metadata's sequence_lengths sum to "
                                     r"11 rows \(expected \[11, row\]\)"),
    # one layer of other rows than the others and the metadata
    ({"l1": torch.zeros(T - 1, ROW, device="cpu")}, r"layer 'l1' has shape \[10, 8\], but the metadata's sequence_lengths sum to "
                                      r"11 rows"),
    ({"l1": torch.zeros(T, device="cpu")}, r"layer 'l1' has shape \[11\], but"),
], ids=["rectangular", "short-layer", "1-d"])
def test_tensors_that_disagree_with_the_sequence_lengths_are_refused_naming_the_layer(tmp_path, tensors, expected):
    path, _ = good_bank(tmp_path)
    rewrite(path, tensors=tensors)
    for read in (BankIndex.read, Bank.load):
        with pytest.raises(BankError, match=str(path).replace(".", r"\.") + ": " + expected):
            read(path)


TOKENS_EXPECTED = (r"expected \[\] or 2 lists of token ids \(ints in \[0, 2\^63\)\), one per sequence, as long as "
                   r"'sequence_lengths' says")
KV_EXPECTED = (r"expected an object with 'dtype', 'row', 'value_dtype', 'kv' \(null or \[heads, head_size, "
               r"head_size_v\]\) and 'parts' \(a list of lists of dims >= 1\)")


def _layers_json(**l0):
    import json

    entry = {"dtype": "float32", "row": ROW, "value_dtype": "float32", "kv": [2, 2, 2], "parts": []}
    return json.dumps({"l0": {**entry, **l0}, "l1": {**entry, "kv": None}})


@pytest.mark.parametrize("key, value, expected", [
    ("sequence_tokens", "{not json", r"metadata 'sequence_tokens' is not JSON"),
    ("sequence_tokens", '{"a": 1}', r"metadata 'sequence_tokens' is a dict; " + TOKENS_EXPECTED),
    ("sequence_tokens", "[[1, 2]]", r"metadata 'sequence_tokens' holds 1 entries of lengths \[2\]; "
                                    + TOKENS_EXPECTED),
    # two lists, but not of the sequences' lengths (4, 7)
    ("sequence_tokens", "[[1, 2, 3, 4, 5, 6, 7], [1, 2, 3, 4]]",
     r"metadata 'sequence_tokens' holds 2 entries of lengths \[7, 4\]; " + TOKENS_EXPECTED),
    ("sequence_tokens", "[[1, 2, 3, 4], [1, 2, 3, 4, 5, 6]]",
     r"metadata 'sequence_tokens' holds 2 entries of lengths \[4, 6\]; " + TOKENS_EXPECTED),
    ("sequence_tokens", '[[1, 2, 3, 4], "1234567"]', r"metadata 'sequence_tokens' holds 2 entries of lengths "
                                                     r"\[4, None\]; " + TOKENS_EXPECTED),
    ("sequence_tokens", '[[1, 2, 3, 4], [1, 2, 3, 4, 5, 6, "7"]]',
     r"metadata 'sequence_tokens' holds 2 entries of lengths \[4, 7\]; " + TOKENS_EXPECTED),
    ("sequence_tokens", "[[1, 2, 3, 4], [1, 2, 3, 4, 5, 6, 7.5]]",
     r"metadata 'sequence_tokens' holds 2 entries of lengths \[4, 7\]; " + TOKENS_EXPECTED),
    ("sequence_tokens", None, r"metadata 'sequence_tokens' is missing"),
    # token ids are ints in [0, 2**63): one past int64 and a negative one
    ("sequence_tokens", f"[[1, 2, 3, 4], [1, 2, 3, 4, 5, 6, {2**63}]]",
     r"metadata 'sequence_tokens' holds 2 entries of lengths \[4, 7\]; " + TOKENS_EXPECTED),
    ("sequence_tokens", "[[1, 2, 3, -4], [1, 2, 3, 4, 5, 6, 7]]",
     r"metadata 'sequence_tokens' holds 2 entries of lengths \[4, 7\]; " + TOKENS_EXPECTED),
    ("layers", "[1]", r"metadata 'layers' is a list; expected an object"),
    ("layers", '{"l0": 3}', r"metadata 'layers'\['l0'\] is 3; expected an object"),
    ("layers", "nope", r"metadata 'layers' is not JSON"),
    ("layers", _layers_json(kv=[2, 4]), r"metadata 'layers'\['l0'\] is .*'kv': \[2, 4\].*; " + KV_EXPECTED),
    ("layers", _layers_json(kv=[2, 2, 2, 0]), r"metadata 'layers'\['l0'\] is .*; " + KV_EXPECTED),
    ("layers", _layers_json(kv="2,2,2"), r"metadata 'layers'\['l0'\] is .*; " + KV_EXPECTED),
    ("layers", _layers_json(kv={"heads": 2}), r"metadata 'layers'\['l0'\] is .*; " + KV_EXPECTED),
    ("layers", _layers_json(kv=[2, -2, 6]), r"metadata 'layers'\['l0'\] is .*; " + KV_EXPECTED),
    ("layers", _layers_json(kv=[2, 2.0, 2]), r"metadata 'layers'\['l0'\] is .*; " + KV_EXPECTED),
    ("layers", _layers_json(kv=[2, True, 3]), r"metadata 'layers'\['l0'\] is .*; " + KV_EXPECTED),
    ("layers", _layers_json(parts="[[2, 4]]"), r"metadata 'layers'\['l0'\] is .*; " + KV_EXPECTED),
    # parts: a list of lists of dims >= 1 (each cache tensor's element dims)
    ("layers", _layers_json(parts=[5]), r"metadata 'layers'\['l0'\] is .*'parts': \[5\].*; " + KV_EXPECTED),
    ("layers", _layers_json(parts=[[2, "4"]]), r"metadata 'layers'\['l0'\] is .*; " + KV_EXPECTED),
    ("layers", _layers_json(parts=[[2, 0]]), r"metadata 'layers'\['l0'\] is .*; " + KV_EXPECTED),
    ("layers", _layers_json(parts=[[True]]), r"metadata 'layers'\['l0'\] is .*; " + KV_EXPECTED),
    # well-formed kv naming another row size than the tensor's 8 elements
    ("layers", _layers_json(kv=[2, 2, 3]), r"layer 'l0' rows have 8 elements, its kv \[2, 2, 3\] names 10"),
    ("layers", _layers_json(kv=[1, 4, 0]), r"layer 'l0' rows have 8 elements, its kv \[1, 4, 0\] names 4"),
])
def test_malformed_metadata_gets_a_bank_error_naming_the_key(tmp_path, key, value, expected):
    from kvfill.bank import BankPart

    path, _ = good_bank(tmp_path)
    rewrite_metadata(path, **{key: value})
    # a server reads the index first, then each rank its part (TP 2, DCP 2)
    reads = [Bank.load, lambda p: Bank.load(p, BankPart(1, 2, frozenset({"l0"}))),
             lambda p: Bank.load(p, BankPart(dcp=DcpGeometry(2, 1, 1)))]
    if key == "sequence_tokens":
        reads.append(BankIndex.read)
    for read in reads:
        with pytest.raises(BankError, match=expected) as err:
            read(path)
        assert str(path) in str(err.value)


@pytest.mark.parametrize("version", ["1", "2", "5", None])
def test_a_bank_of_another_version_is_refused_saying_how_to_record_again(tmp_path, version):
    path, _ = good_bank(tmp_path)
    rewrite_metadata(path, version=version)
    for read in (BankIndex.read, Bank.load):
        with pytest.raises(BankError, match=rf"bank version {version!r}; this kvfill reads versions "
                                            rf"\['3', '4'\] \(ragged sequences, rows in the canonical K/V "
                                            r"order\) - record the bank again with `python -m kvfill.record`"):
            read(path)
    assert BANK_VERSION == "4"


def test_a_version_2_file_as_version_2_wrote_it_is_refused(tmp_path):
    """The old layout whole: [S, N, R] tensors, num_positions, no lengths."""
    import json

    path = tmp_path / "v2.safetensors"
    save_file({"l0": torch.zeros(2, 6, ROW, device="cpu")}, str(path), metadata={
        "format": "kvfill-bank", "version": "2", "num_sequences": "2", "num_positions": "6",
        "sequence_tokens": json.dumps([list(range(6)), list(range(1, 7))]),
        "layers": json.dumps({"l0": {"dtype": "float32", "row": ROW, "value_dtype": "float32", "parts": []}})})
    for read in (BankIndex.read, Bank.load):
        with pytest.raises(BankError, match=r"v2\.safetensors: bank version '2'.* record the bank again"):
            read(path)


def test_a_well_formed_bank_round_trips_lengths_tokens_kv_and_rows(tmp_path):
    path, rows = good_bank(tmp_path)
    bank = Bank.load(path)
    assert bank.lengths == tuple(LENGTHS) and bank.starts == (0, 4) and bank.num_positions == 7
    assert bank.num_rows == T and bank.sequence_table().tolist() == [[0, 4], [4, 7]]
    assert [list(t) for t in bank.sequence_tokens] == TOKENS
    assert bank.kv == {"l0": (2, 2, 2)} and bank.metadata == {"model": "m"}
    assert all(torch.equal(bank.layers[n], rows[n]) for n in rows)
    # empty sequence_tokens: a bank of no known prompts (every block by prefix hash)
    rewrite_metadata(path, sequence_tokens="[]")
    assert Bank.load(path).sequence_tokens == () and BankIndex.read(path).tokens is None


@pytest.mark.parametrize("kwargs, expected", [
    (dict(sequence_lengths=[4, 6]), r"sequence_lengths \[4, 6\] \(sum 10\) must be ints >= 1 summing to the "
                                    r"layers' 11 rows"),
    (dict(sequence_lengths=[0, 11]), r"sequence_lengths \[0, 11\] \(sum 11\) must be ints >= 1"),
    (dict(sequence_lengths=[4, 7], sequence_tokens=[[1] * 4, [1] * 6]),
     r"sequence_tokens must be 2 lists of the sequences' lengths \[4, 7\], got lengths \[4, 6\]"),
    (dict(sequence_lengths=[4, 7], kv={"l0": (2, 2, 3)}), r"layer 'l0' rows have 8 elements, its kv \[2, 2, 3\] "
                                                           r"names 10"),
])
def test_a_bank_built_in_memory_is_checked_like_a_file(kwargs, expected):
    rows = {"l0": torch.zeros(T, ROW), "l1": torch.zeros(T, ROW)}
    with pytest.raises(BankError, match=r"^mine: " + expected):
        Bank(rows, source="mine", **kwargs)
    with pytest.raises(BankError, match=r"layers disagree on their rows"):
        Bank({"l0": torch.zeros(T, ROW), "l1": torch.zeros(T - 1, ROW, device="cpu")}, sequence_lengths=LENGTHS)
    with pytest.raises(BankError, match=r"sequence_lengths \[3, 3\] disagree with layers of \[2, 4, row\]"):
        Bank({"l0": torch.zeros(2, 4, ROW)}, sequence_lengths=[3, 3])
    # rectangular [S, N, R]: S sequences of N, stored [S * N, R]
    rect = Bank({"l0": torch.arange(2 * 4 * ROW).view(2, 4, ROW)}, sequence_lengths=[4, 4])
    assert rect.lengths == (4, 4) and rect.layers["l0"].shape == (8, ROW)


@pytest.mark.parametrize("what, expected", [("dir", "is a directory"), ("dev", "is not a regular file"),
                                            ("missing", "does not exist")])
def test_a_path_that_is_no_file_is_named_for_what_it_is(tmp_path, what, expected):
    path = {"dir": str(tmp_path), "dev": "/dev/zero", "missing": str(tmp_path / "none")}[what]
    with pytest.raises(BankError, match=expected):
        BankIndex.read(path)


def test_a_loaded_bank_does_not_read_from_its_file_any_more(tmp_path):
    path, rows = good_bank(tmp_path)
    bank = Bank.load(path)
    with open(path, "r+b") as f:  # overwrite the rows' bytes in place, then cut the file short
        f.seek(os.path.getsize(path) - 4 * T * ROW)
        f.write(b"\xff" * (4 * T * ROW))
        f.truncate(100)
    assert all(torch.equal(bank.layers[n], rows[n]) for n in rows)


def test_a_failed_save_leaves_the_earlier_bank_whole_and_no_temporary(tmp_path, monkeypatch):
    path, rows = good_bank(tmp_path)
    before = path.read_bytes()
    import safetensors.torch

    def failing(tensors, filename, metadata=None):
        with open(filename, "wb") as f:
            f.write(b"partial")
        raise OSError("disk full")

    monkeypatch.setattr(safetensors.torch, "save_file", failing)
    with pytest.raises(OSError, match="disk full"):
        Bank(rows).save(path)
    assert path.read_bytes() == before
    assert sorted(os.listdir(tmp_path)) == ["bank.safetensors"]


def test_a_saved_bank_gets_the_mode_the_umask_gives(tmp_path):
    old = os.umask(0o022)
    try:
        path, _ = good_bank(tmp_path)
    finally:
        os.umask(old)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o644


@pytest.mark.needs_vllm
def test_non_finite_recorded_values_are_counted_per_layer(tmp_path):
    rows = {"a": torch.zeros(5, 3, device="cpu"), "b": torch.zeros(5, 3, device="cpu").to(torch.bfloat16),
            "f8": torch.zeros(5, 3, dtype=torch.uint8, device="cpu")}
    rows["a"][1, 2] = float("nan")
    rows["a"][4, 0] = float("inf")  # the second sequence's last row
    rows["b"][0, 0] = float("-inf")
    rows["f8"][2, 1] = 0x7F  # NaN in float8_e4m3fn
    bank = Bank(rows, sequence_lengths=[2, 3], value_dtypes={"f8": "float8_e4m3fn"})
    from kvfill.connector.bank_checks import count_nonfinite

    assert count_nonfinite(bank) == {"a": 2, "b": 1, "f8": 1}


@pytest.mark.needs_vllm
def test_non_finite_recorded_values_in_packed_rows_are_counted_part_by_part():
    """DeepSeek's sparse-attention rows are bytes of parts that each encode
    their own dtype (kernels/packed_rows.py): fp8 keys, float32 scales, bf16
    RoPE values, e4m3 scales; e2m1 values have no NaN or inf.  A NaN or inf
    in any of them is counted and named in the start-up warning as in a
    float layer's rows (issue 52)."""
    from kvfill.connector.bank_checks import count_nonfinite, nonfinite_warning

    rows = {"idx": torch.zeros(4, 132, dtype=torch.uint8, device="cpu"),
            "mla": torch.zeros(4, 656, dtype=torch.uint8, device="cpu"),
            "fp4": torch.zeros(4, 352, dtype=torch.uint8, device="cpu"),
            "raw": torch.zeros(4, 132, dtype=torch.uint8, device="cpu")}
    parts = {"idx": [[128], [4]], "mla": [[512], [16], [128]], "fp4": [[256], [64], [32]], "raw": [[132]]}
    bank = Bank(rows, sequence_lengths=[4], parts=parts)
    assert count_nonfinite(bank) == {}
    rows["idx"][0, 5] = 0x7F  # an fp8 key: NaN
    rows["idx"][3, 128:132] = 0xFF  # a scale: NaN (as float32, and as UE8M0 bytes)
    rows["mla"][1, 511] = 0xFF  # an fp8 value: NaN
    rows["mla"][2, 512:516] = torch.tensor([0, 0, 0x80, 0x7F], dtype=torch.uint8)  # a float32 scale: inf
    rows["mla"][2, 528:530] = torch.tensor([0x80, 0xFF], dtype=torch.uint8)  # a bf16 RoPE value: -inf
    rows["fp4"][0, :256] = 0xFF  # e2m1 codes: -6, finite
    rows["fp4"][1, 256 + 3] = 0x7F  # an e4m3 RoPE value: NaN
    rows["fp4"][3, 351] = 0xFF  # an e4m3 scale: NaN
    rows["raw"][:] = 0xFF  # bytes of no known kind: not counted
    counts = count_nonfinite(bank)
    assert counts == {"idx": 2, "mla": 3, "fp4": 2}
    line = nonfinite_warning("b.kv", counts)
    assert "7 recorded values are NaN or infinite in 3 layers" in line and "mla: 3" in line


@pytest.mark.needs_vllm
def test_provenance_that_differs_from_the_serving_run_is_named():
    from kvfill.connector.bank_checks import nonfinite_warning, provenance_mismatches

    meta = {"model": "out/m", "max_model_len": "4096", "kv_cache_dtype": "auto", "block_size": "16"}
    lines = provenance_mismatches(meta, model="out/m", max_model_len=8192, kv_cache_dtype="auto")
    assert lines == ["the bank was recorded with max_model_len='4096', this run has max_model_len='8192': "
                     "replayed rows are real KV but not bit-identical to this run's prefill"]
    assert provenance_mismatches(meta, model="out/m", max_model_len=4096, kv_cache_dtype="auto") == []
    # the compilation is compared where the bank records it (older banks do not)
    assert provenance_mismatches(meta, model="out/m", max_model_len=4096, kv_cache_dtype="auto",
                                 compilation="mode=NONE custom_ops=all") == []
    meta["compilation"] = "mode=NONE custom_ops=all"
    assert provenance_mismatches(meta, model="out/m", max_model_len=4096, kv_cache_dtype="auto",
                                 compilation="mode=NONE custom_ops=all") == []
    [line] = provenance_mismatches(meta, model="out/m", max_model_len=4096, kv_cache_dtype="auto",
                                   compilation="mode=DYNAMO_TRACE_ONCE backend=inductor custom_ops=none")
    assert line.startswith("the bank was recorded with compilation='mode=NONE custom_ops=all', this run has "
                           "compilation='mode=DYNAMO_TRACE_ONCE backend=inductor custom_ops=none': replayed rows are "
                           "real KV but not bit-identical to this run's prefill (eager and compiled kernels round")
    assert "--enforce-eager" in line
    assert "3 recorded values are NaN or infinite in 2 layers" in nonfinite_warning("b.st", {"x": 2, "y": 1})
    assert nonfinite_warning("b.st", {}) is None


def test_record_dir_naming_a_file_is_refused_at_start(tmp_path):
    from kvfill.connector.options import FillOptions, OptionError

    f = tmp_path / "file"
    f.write_text("x")
    with pytest.raises(OptionError, match=r"\['record_dir'\] = .* expected a directory path \(it names an "
                                          r"existing file\)"):
        FillOptions.from_extra_config({"record_dir": str(f), "record_positions": 4})


def test_record_positions_past_max_model_len_are_refused_at_start(tmp_path):
    from kvfill.connector.options import FillOptions, OptionError

    opts = FillOptions.from_extra_config({"record_dir": str(tmp_path / "r"), "record_positions": 5000})
    with pytest.raises(OptionError, match=r"\['record_positions'\] = 5000 is invalid; expected an int <= the "
                                          r"engine's max_model_len \(4096\)"):
        opts.check_max_model_len(4096)
    opts.check_max_model_len(5000)


def test_round_trip_keeps_the_recorded_tokens(tmp_path):
    path, _ = good_bank(tmp_path)
    index = BankIndex.read(path)
    assert [t.tolist() for t in index.tokens] == TOKENS
    assert index.lengths.tolist() == LENGTHS and index.num_positions == max(LENGTHS)
    assert [t.tolist() for t in Bank.load(path).index.tokens] == TOKENS
    assert [index.sequence_for(t) for t in TOKENS] == [0, 1]


@pytest.mark.parametrize("kv", [(2, 4), (2, 0, 4), (0, 2, 2), (2, 2, -1), ("2", 2, 2), (True, 2, 2)])
def test_a_malformed_kv_geometry_is_refused_naming_the_layer(kv):
    """Refused where the bank is built (in memory or from a file), not later
    at registration: a geometry names K and V sizes >= 1 and >= 0."""
    with pytest.raises(BankError, match=r"^mine: layer 'l' kv is .*; expected \[num_kv_heads >= 1, head_size >= 1, "
                                        r"head_size_v >= 0\]"):
        Bank({"l": torch.zeros(1, 4, 8, dtype=torch.bfloat16)}, kv={"l": kv}, source="mine")


@pytest.fixture
def meta_default_device():
    """torch's default device set elsewhere than the host (the GPU run sets
    ``cuda``; ``meta`` stands in for it on the CPU: factories follow it)."""
    before = torch.get_default_device()
    torch.set_default_device("meta")
    try:
        yield
    finally:
        torch.set_default_device(before)


def test_a_bank_loads_into_host_memory_whatever_torchs_default_device(tmp_path, meta_default_device):
    from kvfill.bank import BankPart

    path, rows = good_bank(tmp_path)
    whole = Bank.load(path)
    part = Bank.load(path, BankPart(tp_rank=1, tp_size=2, layers=frozenset({"l0"})))  # column slices
    for bank in (whole, part):
        assert {t.device.type for t in bank.layers.values()} == {"cpu"}, bank.describe()
    assert all(torch.equal(whole.layers[n], rows[n]) for n in rows)
    assert torch.equal(part.layers["l0"], torch.cat([rows["l0"][:, 2:4], rows["l0"][:, 6:8]], dim=1))


# ------------------------------------------------------------------ identity (one bank everywhere)
def test_every_save_has_its_own_identity_and_copies_share_it(tmp_path):
    """A bank's identity is written once at save: a copy of the file keeps it,
    saving again (the same rows) makes another; the index and every loaded
    part carry it."""
    import shutil

    from kvfill.bank import BankPart

    path, rows = good_bank(tmp_path)
    copy = tmp_path / "copy.safetensors"
    shutil.copy(path, copy)
    again, _ = good_bank(tmp_path, "again.safetensors")
    first = BankIndex.read(path).identity
    assert first and not first.startswith("unsaved/")
    assert BankIndex.read(copy).identity == first == Bank.load(path).identity
    assert Bank.load(path, BankPart(1, 2, frozenset({"l0"}))).identity == first
    assert BankIndex.read(again).identity != first


def test_metadata_changed_after_the_save_is_refused_naming_the_file(tmp_path):
    path, _ = good_bank(tmp_path)
    rewrite_metadata(path, model="another/model", seal=False)
    for read in (BankIndex.read, Bank.load):
        with pytest.raises(BankError, match=str(path).replace(".", r"\.") + r": its metadata changed after the bank "
                                            r"was saved .*: record or save it again"):
            read(path)


def test_a_bank_saved_before_banks_had_ids_reads_with_a_digest_identity(tmp_path):
    path, rows = good_bank(tmp_path)
    rewrite_metadata(path, bank_id=None, metadata_sha256=None)
    ident = BankIndex.read(path).identity
    assert ident.startswith("unsaved/") and Bank.load(path).identity == ident
    rewrite_metadata(path, model="another/model")  # no stored digest: a change is another identity, not an error
    assert BankIndex.read(path).identity not in (ident, None)


def test_the_bank_package_imports_neither_vllm_nor_the_rest_of_kvfill():
    """kvfill.bank sits below everything (kernels and connector import it) and
    runs where vLLM is absent: importing it alone loads no vLLM, no
    kvfill.kernels and no kvfill.connector."""
    import subprocess
    import sys

    code = ("import sys, kvfill.bank\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] == 'vllm'\n"
            "             or m.startswith(('kvfill.kernels', 'kvfill.connector', 'kvfill.record'))))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip() == "[]", out.stdout


@pytest.mark.needs_vllm
def test_a_bank_recorded_with_another_drafter_is_refused_and_another_method_or_k_named(tmp_path):
    """A drafter is named by its folder's content (config.json, weight files'
    names and sizes), not its path: a copy elsewhere is the same drafter,
    another head of the same architecture is refused (issue 38: it replayed
    silently, 3 of 90 drafts accepted instead of 9 of 72)."""
    import json
    import shutil
    from types import SimpleNamespace

    from kvfill.connector.drafter import check_drafter, drafter_identity

    a, b = tmp_path / "a", tmp_path / "b"
    for path, weights in ((a, b"x" * 10), (b, b"x" * 12)):
        path.mkdir()
        (path / "config.json").write_text('{"architectures": ["EagleLlamaForCausalLM"]}')
        (path / "model.safetensors").write_bytes(weights)
    shutil.copytree(a, tmp_path / "a-copy")
    assert drafter_identity(str(a)) == drafter_identity(str(tmp_path / "a-copy")) != drafter_identity(str(b))
    assert drafter_identity(None) == drafter_identity(str(tmp_path / "missing")) == ""
    meta = {"speculative_config": json.dumps({"method": "eagle", "model": str(a), "num_speculative_tokens": 3}),
            "drafter_identity": drafter_identity(str(a))}
    spec = SimpleNamespace(method="eagle", model=str(tmp_path / "a-copy"), num_speculative_tokens=3)
    assert check_drafter(meta, spec, "b.st") == [] and check_drafter(meta, None, "b.st") == []
    with pytest.raises(BankError, match=r"b.st: its drafter layers were recorded with drafter '.*/a' .*this run "
                                        r"drafts with '.*/b' .*another drafter"):
        check_drafter(meta, SimpleNamespace(method="eagle", model=str(b), num_speculative_tokens=3), "b.st")
    [line] = check_drafter(meta, SimpleNamespace(method="eagle", model=str(a), num_speculative_tokens=5), "b.st")
    assert "recorded with speculative num_speculative_tokens 3, this run has 5" in line


def test_two_checkpoints_of_one_architecture_are_two_drafters_and_older_banks_keep_their_identity(tmp_path):
    """Same config.json, same weight file names and sizes, other bytes (two
    trainings of one head): another drafter, by the sampled bytes.  A bank
    recorded before names its drafter by sizes alone (``sha256:``); it is
    compared that way, not refused for the scheme."""
    import json
    from types import SimpleNamespace

    from kvfill.connector.drafter import SAMPLE_BYTES, check_drafter, drafter_identity

    a, b = tmp_path / "a", tmp_path / "b"
    for path, fill in ((a, 1), (b, 2)):
        path.mkdir()
        (path / "config.json").write_text('{"architectures": ["EagleLlamaForCausalLM"]}')
        data = bytearray(3 * SAMPLE_BYTES)
        data[SAMPLE_BYTES * 3 // 2] = fill  # one byte in the middle sample
        (path / "model.safetensors").write_bytes(bytes(data))
    assert drafter_identity(str(a)).startswith("sampled-sha256:")
    assert drafter_identity(str(a)) != drafter_identity(str(b))
    assert drafter_identity(str(a), "sizes") == drafter_identity(str(b), "sizes")
    spec = SimpleNamespace(method="eagle", model=str(b), num_speculative_tokens=3)
    recorded = json.dumps({"method": "eagle", "model": str(a), "num_speculative_tokens": 3})
    with pytest.raises(BankError, match=r"another drafter"):
        check_drafter({"speculative_config": recorded, "drafter_identity": drafter_identity(str(a))}, spec, "b.st")
    older = {"speculative_config": recorded, "drafter_identity": drafter_identity(str(a), "sizes")}
    assert older["drafter_identity"].startswith("sha256:") and check_drafter(older, spec, "b.st") == []

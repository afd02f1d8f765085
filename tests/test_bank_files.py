"""Bank files that lie, change or are not banks: refused at start with a
BankError naming the file, the key and what was expected; saved atomically;
loaded into memory the process owns."""
import os
import stat

import pytest
import torch

pytest.importorskip("safetensors")  # a torch + triton only image (the GPU check) may lack it
from safetensors import safe_open  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

from kvfill.kernels import Bank, BankError, BankIndex  # noqa: E402
from kvfill.kernels.bank import BANK_VERSION  # noqa: E402

S, N, ROW = 2, 6, 8


def good_bank(tmp_path, name="bank.safetensors"):
    g = torch.Generator(device="cpu").manual_seed(1)
    rows = {"l0": torch.randn(S, N, ROW, generator=g, device="cpu"),
            "l1": torch.randn(S, N, ROW, generator=g, device="cpu")}
    path = tmp_path / name
    Bank(rows, sequence_tokens=[list(range(i, i + N)) for i in range(S)],
         value_dtypes={"l0": "float32", "l1": "float32"}, metadata={"model": "m"}).save(path)
    return path, rows


def rewrite_metadata(path, **changes):
    """The same tensors with some metadata keys changed (None: removed)."""
    with safe_open(str(path), framework="pt", device="cpu") as f:
        meta = dict(f.metadata())
        tensors = {n: f.get_tensor(n) for n in f.keys()}
    for k, v in changes.items():
        if v is None:
            meta.pop(k, None)
        else:
            meta[k] = v
    save_file(tensors, str(path), metadata=meta)


@pytest.mark.parametrize("key, value, expected", [
    ("num_sequences", "0", r"metadata 'num_sequences' is '0'; expected an int >= 1"),
    ("num_sequences", "x", r"metadata 'num_sequences' is 'x'; expected an int >= 1"),
    ("num_sequences", None, r"metadata 'num_sequences' is None; expected an int >= 1"),
    ("num_positions", "-3", r"metadata 'num_positions' is '-3'; expected an int >= 1"),
    ("num_sequences", "5", r"layer 'l0' has shape \[2, 6, 8\], but the metadata says num_sequences=5, "
                           r"num_positions=6"),
    ("num_positions", "7", r"layer 'l0' has shape \[2, 6, 8\], but the metadata says num_sequences=2, "
                           r"num_positions=7"),
])
def test_metadata_that_disagrees_with_the_tensors_is_refused_naming_file_key_and_values(tmp_path, key, value,
                                                                                          expected):
    path, _ = good_bank(tmp_path)
    rewrite_metadata(path, **{key: value})
    for read in (BankIndex.read, Bank.load):
        with pytest.raises(BankError, match=str(path).replace(".", r"\.") + ": " + expected):
            read(path)


@pytest.mark.parametrize("key, value, expected", [
    ("sequence_tokens", "{not json", r"metadata 'sequence_tokens' is not JSON"),
    ("sequence_tokens", '{"a": 1}', r"metadata 'sequence_tokens' is a dict; expected \[\] or 2 lists of 6 token"),
    ("sequence_tokens", "[[1, 2]]", r"metadata 'sequence_tokens' holds 1 entries; expected \[\] or 2 lists of 6"),
    ("sequence_tokens", None, r"metadata 'sequence_tokens' is missing"),
    ("layers", "[1]", r"metadata 'layers' is a list; expected an object"),
    ("layers", '{"l0": 3}', r"metadata 'layers'\['l0'\] is 3; expected an object"),
    ("layers", "nope", r"metadata 'layers' is not JSON"),
])
def test_malformed_metadata_gets_a_bank_error_naming_the_key(tmp_path, key, value, expected):
    path, _ = good_bank(tmp_path)
    rewrite_metadata(path, **{key: value})
    with pytest.raises(BankError, match=expected) as err:
        Bank.load(path)
    assert str(path) in str(err.value)


def test_a_version_1_bank_is_refused_saying_how_to_record_again(tmp_path):
    path, _ = good_bank(tmp_path)
    rewrite_metadata(path, version="1")
    with pytest.raises(BankError, match=rf"bank version '1'; this kvfill reads version '{BANK_VERSION}' - record "
                                        r"the bank again with `python -m kvfill.record`"):
        BankIndex.read(path)


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
        f.seek(os.path.getsize(path) - 4 * S * N * ROW)
        f.write(b"\xff" * (4 * S * N * ROW))
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


def test_non_finite_recorded_values_are_counted_per_layer(tmp_path):
    rows = {"a": torch.zeros(1, 4, 3, device="cpu"), "b": torch.zeros(1, 4, 3, device="cpu").to(torch.bfloat16),
            "f8": torch.zeros(1, 4, 3, dtype=torch.uint8, device="cpu")}
    rows["a"][0, 1, 2] = float("nan")
    rows["a"][0, 3, 0] = float("inf")
    rows["b"][0, 0, 0] = float("-inf")
    rows["f8"][0, 2, 1] = 0x7F  # NaN in float8_e4m3fn
    bank = Bank(rows, value_dtypes={"f8": "float8_e4m3fn"})
    assert bank.count_nonfinite() == {"a": 2, "b": 1, "f8": 1}


def test_provenance_that_differs_from_the_serving_run_is_named():
    from kvfill.connector.bank_checks import nonfinite_warning, provenance_mismatches

    meta = {"model": "out/m", "max_model_len": "4096", "kv_cache_dtype": "auto", "block_size": "16"}
    lines = provenance_mismatches(meta, model="out/m", max_model_len=8192, kv_cache_dtype="auto")
    assert lines == ["the bank was recorded with max_model_len='4096', this run has max_model_len='8192': "
                     "replayed rows are real KV but not bit-identical to this run's prefill"]
    assert provenance_mismatches(meta, model="out/m", max_model_len=4096, kv_cache_dtype="auto") == []
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
    assert index.tokens.tolist() == [list(range(i, i + N)) for i in range(S)]
    assert Bank.load(path).index.tokens.tolist() == index.tokens.tolist()

"""Connector options: one frozen object, validated once, errors naming key, value and expectation."""
import dataclasses

import pytest

from kvfill.connector.options import FillOptions, OptionError
from kvfill.connector.planner import Granularity
from kvfill.kernels import ValueSpec


def test_defaults_are_the_in_tree_connectors():
    opts = FillOptions.from_extra_config(None)
    assert opts == FillOptions()
    assert opts.values == ValueSpec(mean=0.015, std=0.0, seed=0)
    assert (opts.startup_fill, opts.granularity, opts.refill_on_preemption, opts.backend, opts.verify) == (
        False, Granularity.TOKEN, True, "auto", None)


def test_keys_become_typed_fields():
    opts = FillOptions.from_extra_config({"fill_mean": 1, "fill_std": 0.5, "seed": 7, "granularity": "block",
                                          "verify": True, "backend": "torch"})
    assert opts.values == ValueSpec(1.0, 0.5, 7) and isinstance(opts.fill_mean, float)
    assert opts.granularity is Granularity.BLOCK and opts.verify == "raise" and opts.backend == "torch"
    assert FillOptions.from_extra_config({"verify": False}).verify is None


def test_options_are_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        FillOptions().fill_std = 1.0


@pytest.mark.parametrize(
    "key,value,expected",
    [
        ("fill_mean", "0.1", "a finite number"),
        ("fill_mean", float("nan"), "a finite number"),
        ("fill_std", -1.0, "a finite number >= 0"),
        ("fill_std", True, "a finite number"),
        ("seed", -3, "an int >= 0"),
        ("seed", 1.5, "an int >= 0"),
        ("startup_fill", "yes", "true or false"),
        ("refill_on_preemption", 1, "true or false"),
        ("zero_packed", "yes", "true or false"),
        ("granularity", "page", "'token' or 'block'"),
        ("backend", "cuda", "one of ['auto', 'triton', 'torch']"),
        ("verify", "warn", "false, true, 'log' or 'raise'"),
        ("page_image_mib", -1, "an int >= 0 (MiB; 0 keeps no page images)"),
        ("page_image_mib", 0.5, "an int >= 0 (MiB; 0 keeps no page images)"),
        ("bank_placement", "gpu", "one of ['auto', 'device', 'host']"),
        ("past_bank", "extend", "one of ['wrap', 'rotate']"),
        ("staging_mib", 0, "an int in [1, 1048576] (MiB of device staging for a bank kept in host memory)"),
        ("staging_mib", True, "an int in [1, 1048576] (MiB of device staging for a bank kept in host memory)"),
        ("staging_mib", 2**63, "an int in [1, 1048576] (MiB of device staging for a bank kept in host memory)"),
        ("staging_mib", 64, "256 (unset) without a bank: it sizes the staging a replayed bank's rows go through"),
    ],
)
def test_a_bad_value_names_the_key_the_value_and_what_was_expected(key, value, expected):
    with pytest.raises(OptionError) as err:
        FillOptions.from_extra_config({key: value})
    msg = str(err.value)
    assert f"[{key!r}] = {value!r}" in msg and msg.endswith(f"expected {expected}"), msg


def test_an_unknown_key_lists_the_valid_ones():
    with pytest.raises(ValueError, match=r"unknown kv_connector_extra_config key\(s\) \['fill_sdt'\]; "
                                         r"valid keys: \['backend', 'bank', 'bank_placement', 'fill_mean', 'fill_mode', 'fill_std', "
                                         r"'granularity', 'page_image_mib', 'past_bank', 'record_dir', 'record_engine', 'record_flags', 'record_positions', 'refill_on_preemption', "
                                         r"'seed', 'staging_mib', 'startup_fill', 'verify', 'zero_packed'\]"):
        FillOptions.from_extra_config({"fill_sdt": 0.1})


@pytest.mark.parametrize("extra, key, expected", [
    ({"fill_mode": "normal"}, "fill_std", "a finite number > 0 with fill_mode 'normal'"),
    ({"fill_mode": "constant", "fill_std": 0.2}, "fill_std", "0 with fill_mode 'constant'"),
    ({"fill_mode": "replay"}, "bank", "the path of a bank file with fill_mode 'replay'"),
    ({"fill_mode": "uniform"}, "fill_mode", "one of ['constant', 'normal', 'replay']"),
    ({"past_bank": "rotate"}, "past_bank", "'wrap' (unset) without a bank: it says what replay writes past a "
                                           "recorded sequence's end"),
    ({"bank_placement": "host"}, "bank_placement", "'auto' (unset) without a bank: it says where a replayed bank "
                                                   "is kept"),
    ({"fill_mode": "normal", "fill_std": 0.1, "bank": "b.safetensors"}, "fill_mode", "'replay' (or unset) with a bank"),
    ({"bank": "/nonexistent/b.safetensors"}, "bank", "a readable kvfill bank (bank '/nonexistent/b.safetensors' does not exist"),
    ({"record_dir": "/tmp/x", "record_positions": -1}, "record_positions",
     "an int >= 0 with record_dir (the most positions saved per prompt; 0: all)"),
    ({"record_dir": "/tmp/x", "record_positions": 2.5}, "record_positions", "an int >= 0 with record_dir"),
    ({"record_positions": 64}, "record_positions", "0 (unset) without record_dir"),
])
def test_fill_mode_bank_and_record_options_are_checked_against_each_other(extra, key, expected):
    with pytest.raises(OptionError) as err:
        FillOptions.from_extra_config(extra)
    assert f"kv_connector_extra_config[{key!r}]" in str(err.value) and expected in str(err.value), str(err.value)


def test_fill_mode_defaults_keep_the_fill_std_meaning_and_a_bank_means_replay(tmp_path):
    pytest.importorskip("safetensors")  # a torch + triton only image (the GPU check) may lack it
    import torch

    from kvfill.kernels import Bank

    assert FillOptions.from_extra_config({}).fill_mode == "constant"
    assert FillOptions.from_extra_config({"fill_std": 0.1}).fill_mode == "normal"
    path = tmp_path / "b.safetensors"
    Bank({"l": torch.zeros(3, 4, 8, dtype=torch.bfloat16)}).save(path)
    opts = FillOptions.from_extra_config({"bank": str(path)})
    assert opts.replay and (opts.bank_index.num_sequences, opts.bank_index.num_positions) == (3, 4)
    assert "replay fill from" in opts.summary() and "3 sequences of 4 positions" in opts.summary()
    ragged = tmp_path / "r.safetensors"
    Bank({"l": torch.zeros(12, 8, dtype=torch.bfloat16)}, sequence_lengths=[2, 7, 3]).save(ragged)
    opts = FillOptions.from_extra_config({"bank": str(ragged)})
    assert opts.bank_index.lengths.tolist() == [2, 7, 3] and opts.bank_index.num_positions == 7
    assert "3 sequences of 2-7 positions" in opts.summary()


def test_record_dir_alone_records_every_prompt_whole(tmp_path):
    opts = FillOptions.from_extra_config({"record_dir": str(tmp_path / "r")})
    assert opts.recording and opts.record_positions == 0
    assert "recording each prompt's positions to" in opts.summary()
    capped = FillOptions.from_extra_config({"record_dir": str(tmp_path / "r"), "record_positions": 64})
    assert "(at most 64)" in capped.summary()

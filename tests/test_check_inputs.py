"""kvfill-check's inputs before any step runs: a bank's value statistics
(streamed, fp8 decoded as stored, K and V apart), a bank that cannot replay
into --model refused naming both, and every bad path an exit 2 with one line
and nothing written."""
import json
import os
import subprocess
import sys
import textwrap

import pytest

vllm = pytest.importorskip("vllm")
pytestmark = pytest.mark.cpu_only

import torch  # noqa: E402

from kvfill.bank import Bank  # noqa: E402
from kvfill.check.cli import CheckError, check_config  # noqa: E402
from kvfill.check.inputs import prepare, read_bank  # noqa: E402

KV = (2, 16, 16)  # the tiny Llama's (kvfill.bench.models.TINY_LLAMA_CONFIG): 2 KV heads of 16, 2 layers


@pytest.fixture(autouse=True)
def _vllm_platform(vllm_cpu_platform):
    """conftest's vllm_cpu_platform for every test here."""


@pytest.fixture
def tiny(check_model):
    return check_model


def _tiny_variant(tmp_path, name, **config):
    """The tiny Llama (kvfill.bench.models.make_config_only) with ``config`` over its config.json."""
    from kvfill.bench.models import make_config_only

    path = make_config_only(str(tmp_path / name))
    with open(os.path.join(path, "config.json")) as f:
        merged = {**json.load(f), **config}
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(merged, f)
    return path


def _save(path, layers, model=None, kv=None, value_dtypes=None, lengths=(3, 4), tokens=((5, 6, 7), (8, 9, 10, 11))):
    """A bank file written by the project's writer (Bank.save): ``layers`` name -> rows ``[sum(lengths), row]``."""
    Bank(layers, sequence_lengths=list(lengths), sequence_tokens=[list(t) for t in tokens] if tokens else (),
         kv=kv, value_dtypes=value_dtypes, metadata={"model": model} if model else {}).save(str(path))
    return str(path)


def _llama_bank(path, model, n_layers=2, kv=KV, dtype=torch.bfloat16, extra=None):
    """A bank of the tiny Llama's shape: ``n_layers`` attention layers of ``kv``, recorded from ``model``."""
    torch.manual_seed(0)
    width = kv[0] * (kv[1] + kv[2])
    layers = {f"model.layers.{i}.self_attn.attn": torch.randn(7, width).to(dtype) for i in range(n_layers)}
    kvs = {name: kv for name in layers}
    for name, (g, rows) in (extra or {}).items():
        layers[name], kvs[name] = rows, g
    return _save(path, layers, model=model, kv=kvs)


# ---------------------------------------------------------------- statistics


def test_the_statistics_equal_torch_over_every_k_and_every_v_value_of_the_bank(tmp_path):
    torch.manual_seed(1)
    k = [torch.randn(7, 32) * s + m for s, m in ((0.5, 0.2), (2.0, -1.0))]
    v = [torch.randn(7, 32) * s for s in (0.1, 3.0)]
    rows = {f"l{i}": torch.cat([k[i], v[i]], dim=1).to(torch.bfloat16) for i in range(2)}
    path = _save(tmp_path / "b.safetensors", rows, kv={n: KV for n in rows})
    stats, _ = read_bank(path, [[5, 6, 7]])
    ks = torch.cat([r[:, :32].double().flatten() for r in rows.values()])
    vs = torch.cat([r[:, 32:].double().flatten() for r in rows.values()])
    every = torch.cat([ks, vs])
    assert stats["mean"] == pytest.approx(every.mean().item(), rel=1e-12)
    assert stats["std"] == pytest.approx(every.std().item(), rel=1e-12)
    assert stats["k_std"] == pytest.approx(ks.std().item(), rel=1e-12)
    assert stats["v_std"] == pytest.approx(vs.std().item(), rel=1e-12)
    assert (stats["sequences"], stats["has_state"]) == (2, False)
    assert stats["source"] == "the bank's 2 KV layers of bfloat16"


def test_the_statistics_are_the_same_whatever_chunk_the_rows_stream_in(tmp_path, monkeypatch):
    from kvfill.bank import stream

    torch.manual_seed(2)
    path = _save(tmp_path / "b.safetensors", {"l0": (torch.randn(7, 64) * 4 + 100).to(torch.float32)},
                 kv={"l0": KV})
    whole, _ = read_bank(path, [])
    monkeypatch.setattr(stream, "CHUNK_ELEMENTS", 1)  # one row per read
    by_row, _ = read_bank(path, [])
    assert by_row["std"] == pytest.approx(whole["std"], rel=1e-12)
    assert by_row["mean"] == pytest.approx(whole["mean"], rel=1e-12)


@pytest.mark.parametrize("stored, value_dtype, fp8", [
    (torch.uint8, "float8_e4m3fn", torch.float8_e4m3fn),  # vLLM's fp8 / fp8_e4m3 cache: bytes
    (torch.uint8, "float8_e5m2", torch.float8_e5m2),
    (torch.float8_e4m3fn, "", torch.float8_e4m3fn),  # a native float8 cache (fp8_inc)
])
def test_an_fp8_bank_gives_the_spread_of_its_values_as_stored_and_says_it_holds_no_scales(tmp_path, stored,
                                                                                         value_dtype, fp8):
    torch.manual_seed(3)
    values = (torch.randn(7, 64) * 3 + 0.5).to(fp8)
    rows = values.view(torch.uint8) if stored == torch.uint8 else values
    path = _save(tmp_path / "b.safetensors", {"l0": rows}, kv={"l0": KV},
                 value_dtypes={"l0": value_dtype} if value_dtype else None)
    stats, _ = read_bank(path, [])
    direct = values.double()
    assert stats["std"] == pytest.approx(direct.std().item(), rel=1e-12)
    assert stats["k_std"] == pytest.approx(direct[:, :32].std().item(), rel=1e-12)
    assert stats["mean"] == pytest.approx(direct.mean().item(), rel=1e-12)
    kind = str(fp8).removeprefix("torch.") + ("" if stored == fp8 else " stored as uint8")
    assert stats["source"].startswith(f"the bank's 1 KV layers of {kind}; fp8 values as stored: the bank records "
                                      f"no KV scales, so this is the spread vLLM reads at k/v scale 1")


def test_the_normal_fill_of_an_fp8_bank_takes_the_banks_spread_not_n_0_1(tiny, tmp_path):
    from kvfill.check.runner import fill_config

    torch.manual_seed(4)
    values = (torch.randn(7, 64) * 0.25).to(torch.float8_e4m3fn)
    path = _save(tmp_path / "b.safetensors", {"l0": values.view(torch.uint8)}, kv={"l0": KV},
                 value_dtypes={"l0": "float8_e4m3fn"})
    stats, _ = read_bank(path, [])
    cfg = check_config(["--model", tiny[0], "--prompts", tiny[1], "--bank", path])
    fill = fill_config("normal", cfg, path, stats)
    assert fill["fill_std"] == pytest.approx(values.double().std().item(), rel=1e-12)
    assert 0.2 < fill["fill_std"] < 0.3


def test_mla_latent_rows_are_all_k_and_leave_v_unmeasured(tmp_path):
    torch.manual_seed(5)
    rows = torch.randn(7, 48).to(torch.bfloat16)
    path = _save(tmp_path / "b.safetensors", {"l0": rows}, kv={"l0": (1, 48, 0)})
    stats, _ = read_bank(path, [])
    assert stats["v_std"] is None
    assert stats["k_std"] == stats["std"] == pytest.approx(rows.double().std().item(), rel=1e-12)


def test_a_layer_in_its_caches_own_order_counts_in_mean_and_std_but_not_in_k_or_v(tmp_path):
    torch.manual_seed(6)
    known, own = torch.randn(7, 64).to(torch.bfloat16), (torch.randn(7, 64) * 5).to(torch.bfloat16)
    path = _save(tmp_path / "b.safetensors", {"known": known, "own": own}, kv={"known": KV})
    stats, _ = read_bank(path, [])
    assert stats["std"] == pytest.approx(torch.cat([known, own]).double().std().item(), rel=1e-12)
    assert stats["k_std"] == pytest.approx(known[:, :32].double().std().item(), rel=1e-12)
    assert stats["source"] == "the bank's 2 KV layers of bfloat16; K and V told apart in the 1 layers whose K/V " \
                              "geometry the bank names"


def test_packed_rows_are_no_values_and_a_bank_of_only_them_has_no_statistics(tmp_path):
    packed = torch.randint(0, 256, (7, 132), dtype=torch.uint8)  # an indexer's fp8 keys and float32 scale
    path = _save(tmp_path / "b.safetensors", {"indexer": packed}, value_dtypes={"indexer": "uint8"})
    assert read_bank(path, [[5, 6, 7], [1]]) == (None, 1)
    mixed = _save(tmp_path / "m.safetensors", {"indexer": packed, "attn": torch.ones(7, 64, dtype=torch.float16)},
                  kv={"attn": KV}, value_dtypes={"indexer": "uint8"})
    stats, _ = read_bank(mixed, [])
    assert (stats["mean"], stats["std"]) == (1.0, 0.0)
    assert stats["source"] == ("the bank's 1 KV layers of float16; 1 layer of no float values (packed rows, "
                               "integers) left out")


def test_reading_a_bank_holds_a_small_fraction_of_it_in_host_memory(tmp_path):
    """The statistics stream: the peak resident memory reading a 48 MiB bank
    adds (VmHWM reset before the read, in a fresh process) stays under half
    the bank - the whole bank, decoded to float, took about 5x it."""
    torch.manual_seed(7)
    rows = {f"model.layers.{i}.self_attn.attn": torch.randn(4096, 1024).to(torch.bfloat16) for i in range(6)}
    big = _save(tmp_path / "big.safetensors", rows, kv={n: (4, 128, 128) for n in rows}, lengths=(2048, 2048),
                tokens=())
    small = _save(tmp_path / "small.safetensors", {"l0": torch.randn(7, 64).to(torch.bfloat16)}, kv={"l0": KV})
    del rows
    script = textwrap.dedent("""
        import json, sys
        from kvfill.check.inputs import read_bank

        def status():
            with open("/proc/self/status") as f:
                return {k: int(v.split()[0]) * 1024 for k, v in (line.split(":", 1) for line in f)
                        if k in ("VmRSS", "VmHWM")}

        read_bank(sys.argv[2], [[5, 6, 7]])  # torch's and the reader's first use, outside the measure
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # the peak resident size starts again from now
        before = status()["VmRSS"]
        stats, _ = read_bank(sys.argv[1], [[5, 6, 7]])
        print(json.dumps({"extra": status()["VmHWM"] - before, "std": stats["std"]}))
    """)
    out = subprocess.run([sys.executable, "-c", script, big, small], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    measured = json.loads(out.stdout.strip().splitlines()[-1])
    size = os.path.getsize(big)
    assert size > 48 * 2**20
    extra = measured["extra"]
    assert extra < 0.5 * size, f"reading a {size / 2**20:.0f} MiB bank added {extra / 2**20:.0f} MiB resident"
    assert measured["std"] == pytest.approx(1.0, abs=0.01)


# ---------------------------------------------------------------- a bank that cannot replay into --model


def test_a_bank_of_another_models_kv_geometry_exits_2_naming_both_before_any_step(tiny, tmp_path, capsys):
    from kvfill.check.__main__ import main

    model, prompts = tiny
    other = _tiny_variant(tmp_path, "four-heads", num_key_value_heads=4)
    bank = _llama_bank(tmp_path / "bank.safetensors", model)
    out = tmp_path / "report"
    assert main(["--model", other, "--prompts", prompts, "--bank", bank, "--out", str(out)]) == 2
    err = _error_line(capsys)
    assert f"--bank {bank!r} (recorded from {model!r}: 2 KV layers, 2 of [2, 16, 16] [KV heads, head_size, " \
           f"head_size_v]) cannot replay into --model {other!r} (2 attention layers of 4 KV heads x 16, " \
           f"bfloat16): no layer of the bank has the model's K/V geometry" in err, err
    assert not out.exists()


def test_a_bank_with_fewer_layers_than_the_models_attention_layers_is_refused(tiny, tmp_path):
    model, prompts = tiny
    deeper = _tiny_variant(tmp_path, "deeper", num_hidden_layers=4)
    bank = _llama_bank(tmp_path / "bank.safetensors", model)
    with pytest.raises(CheckError, match=r"the bank holds 2 KV layers, the model has 4 attention layers; expected "
                                         r"a bank kvfill-record wrote for --model"):
        prepare(check_config(["--model", deeper, "--prompts", prompts, "--bank", bank]))


def test_a_bank_of_another_dtype_is_refused_even_from_the_same_model(tiny, tmp_path):
    model, prompts = tiny
    bank = _llama_bank(tmp_path / "bank.safetensors", model, dtype=torch.float16)
    with pytest.raises(CheckError, match=r"the bank's layers hold float16 values, this run's KV cache holds "
                                         r"bfloat16; expected a bank recorded with this run's dtype \(bfloat16\) "
                                         r"and --kv-cache-dtype \(auto\)"):
        prepare(check_config(["--model", model, "--prompts", prompts, "--bank", bank]))


@pytest.mark.parametrize("case", ["same model", "copied model folder", "drafter layers", "own-order layers"])
def test_a_bank_that_replays_into_the_model_is_not_refused(tiny, tmp_path, case):
    """Replay takes layers beyond the model's (a drafter's), a model under another name with the same
    layers, and layers in their cache's own order; a TP/PP/DCP recording is the same canonical bank."""
    model, prompts = tiny
    recorded = _tiny_variant(tmp_path, "copy") if case == "copied model folder" else model
    extra = {"drafter": ((1, 8, 8), torch.zeros(7, 16, dtype=torch.bfloat16))} if case == "drafter layers" else None
    if case == "own-order layers":
        bank = _save(tmp_path / "bank.safetensors", {f"model.layers.{i}.self_attn.attn": torch.ones(
            7, 64, dtype=torch.bfloat16) for i in range(2)}, model=model)
    else:
        bank = _llama_bank(tmp_path / "bank.safetensors", recorded, extra=extra)
    inputs = prepare(check_config(["--model", model, "--prompts", prompts, "--bank", bank]))
    assert inputs.held == 1 and inputs.stats["sequences"] == 2


def _hybrid_config(path):
    """A Granite-4-H config (Mamba-2 layers 0, 1, 3; attention layer 2 of 2 KV heads x 32) and the word tokenizer."""
    from transformers import GraniteMoeHybridConfig

    from kvfill.bench.models import make_tokenizer

    GraniteMoeHybridConfig(
        vocab_size=1024, hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=8,
        num_key_value_heads=2, max_position_embeddings=8192, layer_types=["mamba", "mamba", "attention", "mamba"],
        position_embedding_type="rope", num_local_experts=4, num_experts_per_tok=2, shared_intermediate_size=256,
        mamba_n_heads=8, mamba_d_head=64, mamba_n_groups=2, mamba_d_state=64, mamba_d_conv=4, mamba_expand=2,
        mamba_chunk_size=64, dtype="bfloat16").save_pretrained(path)
    return make_tokenizer(path)


def _mla_config(path):
    """A DeepSeek-V2 config (MLA: a latent row of kv_lora_rank 32 + RoPE 16) and the word tokenizer."""
    from transformers import DeepseekV2Config

    from kvfill.bench.models import make_tokenizer

    DeepseekV2Config(
        vocab_size=1024, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=32, q_lora_rank=None, qk_rope_head_dim=16,
        qk_nope_head_dim=16, v_head_dim=16, n_routed_experts=4, num_experts_per_tok=2, first_k_dense_replace=1,
        max_position_embeddings=4096, dtype="bfloat16").save_pretrained(path)
    return make_tokenizer(path)


@pytest.mark.parametrize("make, kv, layers", [(_hybrid_config, (2, 32, 32), 1), (_mla_config, (1, 48, 0), 2)])
def test_hybrid_and_mla_banks_replay_into_their_model_and_a_llama_bank_does_not(tiny, tmp_path, make, kv, layers):
    """A hybrid's bank holds rows of its attention layers only (its Mamba layers' state is no row layer);
    MLA's holds one latent row per token."""
    llama, prompts = tiny
    model = make(str(tmp_path / "model-2"))
    own = _llama_bank(tmp_path / "own.safetensors", "elsewhere/" + os.path.basename(model), n_layers=layers, kv=kv)
    assert prepare(check_config(["--model", model, "--prompts", prompts, "--bank", own])).stats is not None
    foreign = _llama_bank(tmp_path / "llama.safetensors", llama)
    with pytest.raises(CheckError, match=f"cannot replay into --model '{model}'.*: no layer of the bank has the "
                                         f"model's K/V geometry"):
        prepare(check_config(["--model", model, "--prompts", prompts, "--bank", foreign]))


# ---------------------------------------------------------------- bad paths: exit 2, one line, nothing written


def _error_line(capsys) -> str:
    """The one line kvfill-check printed on stderr."""
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(lines) == 1, lines
    assert lines[0].startswith("kvfill-check: error: ")
    return lines[0]


@pytest.mark.parametrize("flag, value, says", [
    ("--out", "/proc/kvfill-check-report", "--out '/proc/kvfill-check-report': no folder can be made in '/proc' "),
    ("--prompts", "DIR", "--prompts 'DIR' is a folder; expected a text or .jsonl file of prompts"),
    ("--bank", "DIR", "--bank 'DIR' is a folder; expected a bank file kvfill-record wrote"),
])
def test_a_path_that_is_no_file_or_folder_of_its_kind_exits_2_with_one_line(tiny, tmp_path, capsys, flag, value,
                                                                           says):
    from kvfill.check.__main__ import main

    model, prompts = tiny
    folder = tmp_path / "folder"
    folder.mkdir()
    value, says = value.replace("DIR", str(folder)), says.replace("DIR", str(folder))
    out = tmp_path / "report"
    argv = {"--model": model, "--prompts": prompts, "--out": str(out), flag: value}
    assert main([token for pair in argv.items() for token in pair]) == 2
    assert says in _error_line(capsys)
    assert not out.exists() and not os.path.exists(value if flag == "--out" else out)


def test_a_prompt_class_missing_on_one_line_exits_2_with_one_line_before_anything_is_written(tiny, tmp_path, capsys):
    """A JSONL prompts file whose first line names a class and whose second
    does not: refused with the prompts file's other errors, before --out."""
    from kvfill.check.__main__ import main

    model, _ = tiny
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps(item) + "\n" for item in ({"prompt": "one two", "class": "code"},
                                                                   {"prompt": "three"})))
    out = tmp_path / "report"
    assert main(["--model", model, "--prompts", str(prompts), "--out", str(out)]) == 2
    assert 'line 2: "class" is None; expected 1-32 letters, digits or _.+- on every line once one line names a ' \
           "class (line 1 does)" in _error_line(capsys)
    assert not out.exists()


@pytest.mark.parametrize("given", ["--model", "--tokenizer"])
def test_a_folder_without_tokenizer_files_exits_2_saying_so(tiny, tmp_path, capsys, given):
    from kvfill.check.__main__ import main

    model, prompts = tiny
    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "config.json").write_text("{}")
    folder = model if given == "--model" else str(bare)
    if given == "--model":
        for name in ("tokenizer.json", "tokenizer_config.json"):
            os.unlink(os.path.join(model, name))
    out = tmp_path / "report"
    assert main(["--model", model, "--prompts", prompts, "--out", str(out),
                 *(["--tokenizer", folder] if given == "--tokenizer" else [])]) == 2
    line = _error_line(capsys)
    assert f"{given} {folder!r} is a folder with no tokenizer files (it holds config.json); expected the " \
           f"model's tokenizer files there" in line, line
    assert line.endswith("or --tokenizer naming a folder or hub model that has them") == (given == "--model")
    assert not out.exists()

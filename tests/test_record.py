"""Recording and replaying through vLLM's CPU engine: the recorder's checks,
vLLM CPU's real K/V layout, and replay equal to real prefill end to end."""
import os
import tempfile

import pytest
import torch

# Every recording and engine run here leaves nothing: no work folder, no vLLM
# rendezvous file or shared-memory segment, no process (conftest.leaves_nothing).
pytestmark = [pytest.mark.cpu_only, pytest.mark.usefixtures("leaves_nothing")]
vllm = pytest.importorskip("vllm")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("isa", ["vec", "vec16"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_kv_views_address_what_vllms_write_kernel_writes(isa, dtype):
    """vLLM CPU stores K transposed: the views kvfill registers read each
    token's K and V back at its slot, checked against vLLM's own kernel."""
    from kvfill.connector.cpu_layout import cpu_kv_parts, layout_matches

    assert layout_matches(isa, dtype, 2, 32, 64)
    cache = torch.zeros(3, 2, 32, 128, dtype=dtype)
    k, v = cpu_kv_parts(cache, 64)
    assert k.stride() == (cache.stride(0), 2 * 32 * 64, 1, 32) and v.stride()[2:] == (64, 1)
    # The registered row of slot 1 is not token 1: it starts with K element 4 of token 0 (transposed)
    assert cache[0, 0, 1].data_ptr() == k[0, 0, 0, 4].data_ptr()


def write_prompts(path, lines):
    path.write_text("\n".join(" ".join(f"w{t}" for t in line) for line in lines) + "\n")
    return str(path)


def test_the_recorder_prints_its_estimate_and_refuses_a_bank_over_budget(tmp_path, capsys):
    from kvfill.bench.models import KV_HEADS, HEAD_DIM, MODEL_LAYERS, make_model, make_tokenizer
    from kvfill.record.__main__ import main

    model = make_tokenizer(make_model(os.path.join(ROOT, "out", "tiny-llama")))
    prompts = write_prompts(tmp_path / "p.txt", [range(3, 103), range(200, 300)])
    rc = main(["--model", model, "--prompts", prompts, "--out", str(tmp_path / "b.safetensors"),
               "--budget-gib", "0.001"])
    out, err = capsys.readouterr()
    per_token = MODEL_LAYERS * 2 * KV_HEADS * HEAD_DIM * 2  # layers x K+V row bytes (bf16)
    assert f"bank estimate: 2 sequences, 200 positions in all x {per_token} B per token" in out
    assert rc == 2 and "over --budget-gib 0.001" in err
    assert not (tmp_path / "b.safetensors").exists()


@pytest.fixture(scope="module")
def tp2_recording(tmp_path_factory):
    """One TP 2 recording for the module (two tests read it): the ``llama``
    preset of bench/check_presets.py records 3 prompts of 64 tokens at TP 2
    (kvfill-record) and kvfill-check replays the bank at TP 2, both on Model
    Runner V2; a second check replays it at TP 1 on the V1 runner (a bank
    crosses runners).  Per TP: its exit code and report; the work folder
    (``bank-tp2-pp1.safetensors``, ``prompts.txt``); nothing left behind (as
    ``leaves_nothing`` checks each test)."""
    from conftest import check_preset, nothing_left

    base = tmp_path_factory.mktemp("tp2-recording")
    common = ["--output-len", "6", "--fills", "replay", "--max-model-len", "192", "--in-process"]
    with nothing_left(base):
        tp2 = check_preset(base / "tp2", ["llama", "--record-tp", "2", "--lens", "64", "64", "64", "--",
                                          "--tensor-parallel-size", "2", *common], runner="v2")
        work = tp2[2]
        bank = work / "bank-tp2-pp1.safetensors"
        tp1 = check_preset(base / "tp1", ["llama", "--lens", "64", "64", "64", "--", "--bank", str(bank), *common],
                           runner="v1")
    return {"tp2": tp2[:2], "tp1": tp1[:2], "work": work, "bank": bank, "model": tp2[1]["model"]}


def test_a_bank_recorded_at_tp_2_replays_at_tp_1_and_tp_2_as_real_prefill_decodes(tp2_recording):
    """vLLM CPU at tensor parallel size 2 (one core per worker): each worker
    saves its 4 of the tiny Llama's 8 KV heads and the recorder merges them
    into the canonical bank a TP 1 recording writes; replayed at TP 2 (each
    rank loading its heads) and at TP 1, greedy tokens equal real prefill's at
    the replaying size, logprobs within 1e-3 (TP 2's reduction order)."""
    from kvfill.kernels import Bank

    for tp in ("tp2", "tp1"):
        rc, data = tp2_recording[tp]
        replay = data["comparison"]["replay"]["tokens"]
        assert rc == 0 and (replay["equal"], replay["total"]) == (18, 18), (tp, data["verdicts"])
        assert replay["max_abs_logprob_diff"] <= 1e-3, (tp, replay)
        assert data["bank"] == str(tp2_recording["bank"]) and not data["bank_recorded"], tp
    assert tp2_recording["tp2"][1]["engine_flags"]["tensor_parallel_size"] == 2
    bank = Bank.load(tp2_recording["bank"])
    assert set(bank.kv.values()) == {(8, 128, 128)} and len(bank.layers) == 4 and bank.lengths == (64, 64, 64)


@pytest.mark.xdist_group("e2e")  # beside the leaves_nothing group, which holds most of the suite's engine time
def test_replay_on_a_sliding_window_hybrid_model_equals_real_prefill(tmp_path):
    """Gemma3 alternating sliding-window (256 tokens) and full attention - two
    KV cache groups - with a 300-token prompt (kvfill-check's ``sliding``
    preset): both groups replayed, greedy tokens and logprobs equal real
    prefill's; a constant fill's differ.  Model Runner V2."""
    from conftest import check_preset

    rc, data, _ = check_preset(tmp_path, ["sliding", "--lens", "300", "--", "--output-len", "4", "--fills", "replay",
                                          "constant", "--in-process"], runner="v2")
    cmp = data["comparison"]
    assert rc == 0, data["verdicts"]
    assert cmp["replay"]["tokens"]["identical"] and cmp["replay"]["tokens"]["max_abs_logprob_diff"] <= 1e-4, cmp
    assert not cmp["constant"]["tokens"]["identical"], cmp


def _worker_config(tmp_path, **parallel):
    from types import SimpleNamespace

    from vllm.v1.kv_cache_interface import FullAttentionSpec
    from vllm_harness import make_harness

    h = make_harness(tmp_path, [(["model.layers.0.self_attn.attn"],
                                 FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=8, dtype=torch.bfloat16))])
    par = SimpleNamespace(**{"decode_context_parallel_size": 1, "tensor_parallel_size": 1,
                             "pipeline_parallel_size": 1, "prefill_context_parallel_size": 1,
                             "cp_kv_cache_interleave_size": 1, **parallel})
    model = SimpleNamespace(model="m", max_model_len=64, use_mla=False,
                            get_total_num_kv_heads=lambda: 2 * par.tensor_parallel_size)
    return SimpleNamespace(parallel_config=par, cache_config=h.config.cache_config,
                           model_config=model), h.kv_cache_config


def test_recording_under_decode_context_parallelism_is_refused_with_the_way_out(tmp_path):
    """DCP splits positions, not heads: a model served with DCP is recorded at
    the same TP with DCP 1.  TP and PP record (each worker its part)."""
    from kvfill.connector.options import FillOptions
    from kvfill.connector.worker import KVFillWorker

    record = FillOptions.from_extra_config({"record_dir": str(tmp_path / "r"), "record_positions": 8})
    cfg, kvc = _worker_config(tmp_path, tensor_parallel_size=2, decode_context_parallel_size=2)
    with pytest.raises(ValueError, match=r"recording needs decode context parallel size 1, got 2: record at the "
                                         r"same tensor parallel size with DCP 1"):
        KVFillWorker(cfg, kvc, record, dcp_rank=0, tp_rank=0)
    for parallel in ({"tensor_parallel_size": 2}, {"pipeline_parallel_size": 2}):
        cfg, kvc = _worker_config(tmp_path / str(len(parallel)), **parallel)
        recorder = KVFillWorker(cfg, kvc, record, dcp_rank=0, tp_rank=1, pp_rank=1).recorder
        assert recorder.tp_rank == 1 and recorder.pp_rank == 1 and recorder.saves
        recorder.drop()  # its parts folder, as its connector's shutdown does


def test_replay_gives_unrecorded_group_kinds_zeros_or_the_synthetic_fill(tmp_path):
    """Banks hold full and sliding-window attention only: recurrent state gets
    the empty state, chunked-local and cross attention the synthetic fill."""
    from kvfill.connector.registration import group_mode
    from kvfill.connector.options import FillOptions
    from kvfill.connector.planner import GroupGeometry, GroupKind
    from kvfill.kernels import Bank

    bank = tmp_path / "b.safetensors"
    Bank({"l": torch.zeros(1, 4, 32, dtype=torch.bfloat16)}).save(bank)
    options = FillOptions.from_extra_config({"bank": str(bank), "fill_std": 0.2})
    modes = {kind: group_mode(GroupGeometry("g", kind, 16), options) for kind in GroupKind}
    assert modes[GroupKind.FULL_ATTENTION] is None and modes[GroupKind.SLIDING_WINDOW] is None  # replayed
    assert modes[GroupKind.MAMBA] == "zero" and modes[GroupKind.CIRCULAR_BUFFER] == "zero"
    assert modes[GroupKind.CHUNKED_LOCAL] == "normal" and modes[GroupKind.CROSS_ATTENTION] == "normal"


def test_the_recorder_keeps_each_prompt_whole_with_a_max_model_len_above_its_batch_default(tmp_path, capfd):
    """Whole prompts per step need max_num_batched_tokens >= max_model_len
    (vLLM refuses less without chunked prefill): prompts of 40 and 25 tokens,
    max_model_len 3000, each recorded whole (a ragged bank), in the canonical
    K/V order of 8 heads x 128.  No traceback is printed (vLLM's
    chat-template warm-up without a tokenizer logs one)."""
    from kvfill.bench.models import make_model, make_tokenizer
    from kvfill.record import record

    model = make_tokenizer(make_model(os.path.join(ROOT, "out", "tiny-llama")))
    prompts = write_prompts(tmp_path / "p.txt", [range(3, 43), range(100, 125)])
    eager = {"enforce_eager": True}  # the runs compared with are eager; compiling would only take longer
    bank = record(model, prompts, str(tmp_path / "b.safetensors"), max_model_len=3000, llm_kwargs=eager)
    assert (bank.num_sequences, bank.lengths) == (2, (40, 25))
    assert [len(t) for t in bank.sequence_tokens] == [40, 25] and bank.sequence_tokens[1][0] == 100
    assert set(bank.kv.values()) == {(8, 128, 128)}
    capped = record(model, prompts, str(tmp_path / "c.safetensors"), positions=30, max_model_len=3000,
                    llm_kwargs=eager)
    assert capped.lengths == (30, 25)
    assert bank.metadata["max_model_len"] == "3000" and bank.bytes_per_token == 4 * 2 * 8 * 128 * 2
    assert bank.metadata["block_size"] == "128"  # vLLM CPU's default, read back from the engine (not "auto")
    assert bank.metadata["compilation"].startswith("mode=NONE custom_ops=")  # as the engine resolved --enforce-eager
    out, err = capfd.readouterr()
    assert "Traceback" not in out + err and "Chat template warmup failed" not in out + err


def test_a_worker_never_makes_the_record_folder_again_once_it_is_gone(tmp_path, caplog):
    """A worker's parts folder (its own, on its own node) goes when its parts
    were fetched or the run stopped; a worker still finishing a step logs
    that the rows are not saved and leaves no folder behind it (made once, at
    start)."""
    from types import SimpleNamespace

    from kvfill.connector.options import FillOptions
    from kvfill.connector.worker import KVFillWorker

    cfg, kvc = _worker_config(tmp_path)
    recorder = KVFillWorker(cfg, kvc, FillOptions.from_extra_config({"record_dir": str(tmp_path / "r")}),
                            dcp_rank=0, tp_rank=0).recorder
    folder = recorder.folder
    assert os.path.isdir(folder) and not (tmp_path / "r").exists()  # its own, at start; the recorder's untouched
    recorder.drop()
    meta = SimpleNamespace(records=[SimpleNamespace(positions=4, selection=None, key="k")])
    recorder.save(reg=None, engine=None, meta=meta)  # nothing read: the folder check comes first
    assert not os.path.exists(folder) and recorder.parts() == []
    assert "is gone (the recorder stopped); 1 prompts not saved" in caplog.text


def test_an_engine_config_vllm_refuses_is_one_line_before_any_worker_starts(tmp_path, monkeypatch, capsys):
    """--tensor-parallel-size 3 for 4 attention heads: vLLM's own refusal,
    one line naming the flags given, and no engine started."""
    import vllm

    from kvfill.bench.models import make_config_only
    from kvfill.record.__main__ import main

    model = make_config_only(str(tmp_path / "model"))
    (tmp_path / "p.txt").write_text("w3 w4 w5 w6\n")
    monkeypatch.setattr(vllm, "LLM", lambda **kw: pytest.fail("vLLM's engine started"))
    out = tmp_path / "out"
    out.mkdir()
    rc = main(["--model", model, "--prompts", str(tmp_path / "p.txt"), "--out", str(out / "b.safetensors"),
               "--tensor-parallel-size", "3"])
    err = capsys.readouterr().err
    assert rc == 2, err
    line = err.strip().splitlines()[-1]
    assert line.startswith("kvfill-record: error: vLLM refuses this engine configuration: ") and "(3)" in line, err
    assert line.endswith("(engine flags given: --tensor-parallel-size)"), line
    assert os.listdir(out) == []


def test_a_tp_2_engine_whose_workers_hold_another_save_than_its_scheduler_does_not_start(tmp_path, monkeypatch):
    """Two nodes' copies that differ: vLLM CPU at TP 2, its engine core (and
    scheduler) in this process reading the head node's copy, its two worker
    processes another save of the same rows.  vLLM's handshake brings each
    worker's bank to the scheduler at start, and the engine stops there,
    naming both ranks, the paths and both identities."""
    from kvfill.bench.models import HEAD_DIM, KV_HEADS, MODEL_LAYERS, make_model
    from kvfill.connector.options import FillOptions
    from kvfill.kernels import Bank, BankIndex
    from kvfill.record.engine import llm_engine

    model = make_model(os.path.join(ROOT, "out", "tiny-llama"))
    kv = (KV_HEADS, HEAD_DIM, HEAD_DIM)
    names = [f"model.layers.{i}.self_attn.attn" for i in range(MODEL_LAYERS)]
    workers_bank, scheduler_bank = tmp_path / "node1.safetensors", tmp_path / "head.safetensors"
    for path in (workers_bank, scheduler_bank):  # two saves of the same rows: two identities
        Bank({n: torch.zeros(40, 2 * KV_HEADS * HEAD_DIM, device="cpu") for n in names}, sequence_lengths=[40],
             kv={n: kv for n in names}).save(path)
    real = FillOptions.from_extra_config.__func__
    # Only this process's connectors (the scheduler's) read the head node's copy; the workers are spawned.
    monkeypatch.setattr(FillOptions, "from_extra_config", classmethod(
        lambda cls, extra: real(cls, {**extra, "bank": str(scheduler_bank)} if extra.get("bank") else extra)))
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0|1")
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
    with pytest.raises(ValueError) as err:
        with llm_engine(model=model, dtype="float32", tensor_parallel_size=2, max_model_len=128, enforce_eager=True,
                        skip_tokenizer_init=True, disable_log_stats=True,
                        kv_transfer_config={"kv_connector": "KVFillConnector", "kv_role": "kv_both",
                                            "kv_connector_extra_config": {"bank": str(workers_bank)}}):
            pytest.fail("the engine started")
    text = str(err.value)  # the workers are gone with the failed start (record.engine.llm_engine)
    ours, theirs = BankIndex.read(scheduler_bank).identity, BankIndex.read(workers_bank).identity
    assert f"the scheduler indexed the bank {str(scheduler_bank)!r}, identity {ours}" in text, text
    for rank in (0, 1):
        assert f"TP rank {rank}, PP rank 0 loaded {str(workers_bank)!r}, identity {theirs}" in text, text


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_recording_over_two_nodes_on_loopback_writes_the_one_node_bank_and_refuses_other_flags(
        tp2_recording, tmp_path, monkeypatch, capsys):
    """vLLM's multiprocessing executor over two "nodes" on loopback (each its
    own kvfill-record process: --nnodes 2, its --node-rank, one worker and
    one core each): node 0 records and writes the bank, node 1 only hosts
    TP rank 1 and ends when node 0 ends the recording.  The bank's rows are
    byte-identical to the module's one-node TP 2 recording of the same
    prompts (``tp2_recording``).  A node
    1 started with other engine flags is refused at start naming its rank,
    and node 1 then ends on its own with an error (its workers would wait on
    the first node forever)."""
    import subprocess
    import sys

    from safetensors import safe_open

    from kvfill.record.__main__ import main

    model, prompts = tp2_recording["model"], tp2_recording["work"] / "prompts.txt"
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
    monkeypatch.setenv("VLLM_TARGET_DEVICE", "cpu")
    temp = tmp_path / "temp"  # both nodes' temp folder: nothing of vLLM's may be left there (zero-byte sockets were)
    temp.mkdir()
    monkeypatch.setenv("TMPDIR", str(temp))
    monkeypatch.setattr(tempfile, "tempdir", str(temp))

    def two_nodes(name, node1_extra=()):
        port = str(_free_port())
        flags = ["--model", model, "--prompts", str(prompts), "--dtype", "float32", "--tensor-parallel-size", "2",
                 "--enforce-eager", "--nnodes", "2", "--master-addr", "127.0.0.1", "--master-port", port]
        env = {**os.environ, "VLLM_CPU_OMP_THREADS_BIND": "1", "PYTHONPATH": os.path.dirname(ROOT)}
        node1 = subprocess.Popen([sys.executable, "-m", "kvfill.record", *flags, "--out", str(tmp_path / "n1"),
                                  "--node-rank", "1", *node1_extra], env=env, stdout=subprocess.PIPE,
                                 stderr=subprocess.STDOUT, text=True)
        try:
            monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0")
            rc = main([*flags, "--out", str(tmp_path / name), "--node-rank", "0"])
            log, _ = node1.communicate(timeout=120)
        finally:
            node1.kill()
            node1.wait()
        return rc, node1.returncode, log

    rc, rc1, log1 = two_nodes("two-nodes.safetensors")
    assert (rc, rc1) == (0, 0), log1
    assert "node 1: the first node ended the recording; this node's workers stopped" in log1, log1
    assert not (tmp_path / "n1").exists()
    assert sorted(p.name for p in temp.iterdir()) == [], "left in the nodes' temp folder"

    two, one = safe_open(str(tmp_path / "two-nodes.safetensors"), "pt"), safe_open(str(tp2_recording["bank"]), "pt")
    assert sorted(two.keys()) == sorted(one.keys()) and len(two.keys()) == 4
    for key in two.keys():
        assert torch.equal(two.get_tensor(key), one.get_tensor(key)), key
    capsys.readouterr()

    rc, rc1, log1 = two_nodes("refused.safetensors", ["--max-model-len", "100"])
    err = capsys.readouterr().err
    assert (rc, rc1) == (2, 2), (err, log1)
    assert "the recording's first node runs engine flags sha256:" in err, err
    assert "TP rank 1, PP rank 0 runs engine flags sha256:" in err and "TP rank 0" not in err, err
    assert "node 1: the first node's engine at 127.0.0.1:" in log1 and "stopped before it ended" in log1, log1
    assert not (tmp_path / "refused.safetensors").exists()


def test_a_two_node_recording_fails_on_the_other_node_within_seconds_when_one_stops_or_never_starts(
        tp2_recording, tmp_path):
    """Node 1's process group killed the moment node 0's worker starts
    recording (a crash: no last word): node 0 fails within the stall bound
    (``--node-silence 5``) naming node 1, where it used to wait on vLLM's
    queue for good.  Node 0
    refused at its own input checks: node 1 gives up after --node-wait, where
    it used to wait for torch's rendezvous for 30 minutes.  No bank either
    time (``bench/node_failures.py`` measures every way)."""
    from kvfill.bench import node_failures
    from kvfill.bench.models import word_prompts, write_lines

    model = tp2_recording["model"]
    prompts = write_lines(tmp_path / "prompts.txt", word_prompts([150] * 30, seed=3))  # node 0 still prefills
    crashed = node_failures.scenario("further-killed", model, prompts, str(tmp_path), node_wait=60, limit=120,
                                     node_silence=5)
    assert crashed["triggered"] and crashed["rc"] == 2, crashed
    assert crashed["seconds"] is not None and crashed["seconds"] < 5 + 20, crashed
    assert crashed["error"].startswith("kvfill-record: error: node 1 of 2 went away during the recording (no beat "
                                       "for ") and "--node-silence 5 s: its process or machine stopped" in \
        crashed["error"], crashed
    never = node_failures.scenario("first-never", model, prompts, str(tmp_path), node_wait=5, limit=120)
    assert never["rc"] == 2 and never["seconds"] is not None and never["seconds"] < 5 + 30, never
    assert "kvfill-record: error: node 1: the first node's engine at 127.0.0.1:" in never["error"] and \
        "did not come up within --node-wait 5 s" in never["error"], never
    assert not crashed["bank_written"] and not never["bank_written"]
    assert crashed["left"] == [] and never["left"] == []  # the survivor's killed workers' parts too

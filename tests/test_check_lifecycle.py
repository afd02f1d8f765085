"""kvfill-check's life cycle on a shared host: each engine's KV space sized
from the prompts (or the user's), a host that cannot hold it refused before
anything is written; SIGTERM and SIGHUP stop the check, its running step and
that step's engine; every stop (a signal, --run-timeout, a step killed)
leaves no process and no temp folder; after real prefill failed no further
step runs."""
import glob
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid

import pytest

vllm = pytest.importorskip("vllm")
pytestmark = pytest.mark.cpu_only

from kvfill.check.cli import CheckError, check_config  # noqa: E402

GiB = 2**30


@pytest.fixture(autouse=True)
def _vllm_platform(vllm_cpu_platform):
    """conftest's vllm_cpu_platform for every test here."""


@pytest.fixture
def config_only(check_model):
    return check_model


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    """The tiny Llama with weights (4 layers, 8 KV heads x 128, bf16), made once for the module."""
    from kvfill.bench.models import make_model, make_tokenizer

    return make_tokenizer(make_model(str(tmp_path_factory.mktemp("tiny") / "tiny-llama"), init_std=0.15))


def test_the_kv_space_is_sized_from_the_prompts_and_max_model_len_drafter_and_tp_included(config_only, tmp_path):
    """10000 prompts x max_model_len 2000 (16 blocks of 128 = 2048 tokens) x 256 B per token =
    4.883 GiB, x1.25 = 6.1: 7 GiB; decoys double the sequences, TP 2 halves each worker's share, a drafter
    of the same size doubles the bytes per token."""
    from kvfill.check.kv_space import sized_kv_space

    model, prompts = config_only
    cfg = check_config(["--model", model, "--prompts", prompts, "--out", str(tmp_path / "r")])
    kv = sized_kv_space(cfg, 10000, 2000)
    assert kv["gib"] == 7, kv
    assert kv["source"].startswith("sized from 10000 prompts x max_model_len 2000 (256 B per token over 2 layers, "
                                   "blocks of 128: 4.883 GiB, x1.25 margin"), kv
    assert sized_kv_space(cfg, 2, 40) == {"gib": 1, "source": "sized from 2 prompts x max_model_len 40 (256 B per "
                                          "token over 2 layers, blocks of 128: 0.000 GiB, x1.25 margin, whole GiB)"}
    decoys = check_config(["--model", model, "--prompts", prompts, "--enable-prefix-caching", "--decoys", "1"])
    kv = sized_kv_space(decoys, 10000, 2000)
    assert kv["gib"] == 13 and kv["source"].startswith("sized from 10000 prompts + 10000 decoys x max_model_len 2000")
    tp2 = check_config(["--model", model, "--prompts", prompts, "--tensor-parallel-size", "2"])
    kv = sized_kv_space(tp2, 10000, 2000)  # 2 KV heads over 2 ranks: 2.441 GiB each, x1.25 = 3.05
    assert kv["gib"] == 4 and "; per worker of 2: 2.441 GiB" in kv["source"], kv
    cfg.engine["speculative_config"] = {"method": "draft_model", "model": model, "num_speculative_tokens": 2}
    kv = sized_kv_space(cfg, 10000, 2000)
    assert kv["gib"] == 13 and "(512 B per token over 4 layers, the drafter's 2 included" in kv["source"], kv


def test_the_users_kv_space_is_used_and_one_the_host_cannot_hold_exits_2_before_anything_is_written(
        config_only, tmp_path, monkeypatch, capsys):
    """The host's available memory against the KV space and the weights; nonsense in the variable named."""
    import psutil

    from kvfill.check.__main__ import main
    from kvfill.check.kv_space import kv_space

    model, prompts = config_only
    cfg = check_config(["--model", model, "--prompts", prompts])
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)  # the user's own: none
    assert kv_space(cfg, 1, 40)["source"].startswith("sized from 1 prompts")
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
    assert kv_space(cfg, 10**6, 10**6) == {"gib": 1, "source": "VLLM_CPU_KVCACHE_SPACE set by the user"}
    huge = int(psutil.virtual_memory().total / GiB) * 4 + 1
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", str(huge))
    out = tmp_path / "report"
    assert main(["--model", model, "--prompts", prompts, "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvfill-check: error: this host has ") and "GiB of memory available" in err, err
    assert f"needs about {huge:.1f} GiB (KV space {huge} GiB, VLLM_CPU_KVCACHE_SPACE set by the user" in err, err
    assert "or a smaller VLLM_CPU_KVCACHE_SPACE" in err and not out.exists()
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "lots")
    assert main(["--model", model, "--prompts", prompts, "--out", str(out)]) == 2
    assert "VLLM_CPU_KVCACHE_SPACE='lots': expected a whole number of GiB >= 1" in capsys.readouterr().err
    assert not out.exists()
    with pytest.raises(CheckError, match="VLLM_CPU_KVCACHE_SPACE='0'"):
        monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "0")
        kv_space(cfg, 1, 40)


def _found(pattern: str) -> list[str]:
    """Paths under this test's temp folder (leaves_nothing's) matching ``pattern`` at any depth."""
    return glob.glob(os.path.join(glob.escape(tempfile.gettempdir()), "**", pattern), recursive=True)


def _wait_for_engine(step: str, deadline: float, alive) -> str:
    """The temp folder of ``step``'s vLLM engine, once its rendezvous file is there (the engine's worker is
    up), under the step's own temp folder (``kvfill-step-STEP-*``) or, in-process, anywhere here."""
    while time.monotonic() < deadline:
        assert alive(), "the check ended before the engine came up"
        for rendezvous in _found("vllm_dist_*"):
            folder = os.path.dirname(rendezvous)
            if os.path.basename(folder).startswith("kvfill-record-vllm-") and (
                    step is None or f"kvfill-step-{step}-" in folder):
                return folder
        time.sleep(0.2)
    raise AssertionError(f"no engine of step {step} came up in time")


def _ours(mark: str) -> list:
    """Every live process whose environment carries ``mark`` (what the check started inherits it)."""
    import psutil

    found = []
    for p in psutil.process_iter():
        try:
            if p.environ().get("KVFILL_TEST_MARK") == mark and p.status() != psutil.STATUS_ZOMBIE:
                found.append(p)
        except (psutil.AccessDenied, psutil.NoSuchProcess, psutil.ZombieProcess):
            continue
    return found


@pytest.mark.usefixtures("leaves_nothing")
@pytest.mark.xdist_group("e2e")  # beside the other engine tests: the leaves_nothing group is the longest
@pytest.mark.parametrize("sig, flags", [(signal.SIGTERM, []), (signal.SIGHUP, ["--in-process"])],
                         ids=["SIGTERM", "SIGHUP-in-process"])
def test_a_signal_stops_the_check_its_step_and_engine_and_leaves_nothing(tiny_model, tmp_path, sig, flags):
    """kvfill-check as a user runs it, on the tiny Llama: once its first step's engine is up (the recording's
    worker made its rendezvous file), SIGTERM (child steps) or SIGHUP (--in-process: the engine in the check's
    own process) stops it: exit 128 + signal, one line naming the signal, no process of the check left (its
    processes carry a mark in their environment), no temp folder of its steps or engines, no recording's
    work folder.  The step ran with the KV space the check sized."""
    import psutil

    prompts = tmp_path / "prompts.txt"
    prompts.write_text("w5 w6 w7 w8 w9\nw10 w11 w12\n")
    out, mark = tmp_path / "check", uuid.uuid4().hex
    env = {k: v for k, v in os.environ.items() if k != "VLLM_CPU_KVCACHE_SPACE"}
    proc = subprocess.Popen([sys.executable, "-m", "kvfill.check", "--model", tiny_model, "--prompts", str(prompts),
                             "--out", str(out), "--fills", "zeros", "--output-len", "64", *flags],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**env, "KVFILL_TEST_MARK": mark})
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True)
    reader.start()
    try:
        engine = _wait_for_engine(None if flags else "record", time.monotonic() + 240, lambda: proc.poll() is None)
        seen = {p.pid for p in _ours(mark)}
        if not flags:  # the step's child holds the check's KV space in its environment
            child = [p for p in psutil.Process(proc.pid).children() if "kvfill.check.child" in p.cmdline()]
            assert len(child) == 1 and child[0].environ().get("VLLM_CPU_KVCACHE_SPACE") == "1", child
        proc.send_signal(sig)
        rc = proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    reader.join(10)
    text = "".join(lines)
    assert rc == 128 + sig, text[-3000:]
    name = signal.Signals(sig).name
    said = [ln for ln in text.splitlines() if ln.startswith("kvfill-check: stopped by")]
    assert said == [f"kvfill-check: stopped by {name}: the running step and its engine were stopped, nothing of the "
                    f"check is left running; no report written (real prefill was not measured: nothing to compare); the "
                    f"steps' logs are in {out / 'logs'}"], text[-3000:]
    assert "KV space of each engine: 1 GiB (sized from 2 prompts x max_model_len " in text, text[-3000:]
    time.sleep(3)
    assert not _ours(mark) and not [p for p in seen if psutil.pid_exists(p)
                                    and psutil.Process(p).status() != psutil.STATUS_ZOMBIE], seen
    assert not os.path.exists(engine)
    assert not _found("kvfill-step-*") and not _found("kvfill-record-*") and not list(out.glob("kvfill-record-*"))
    assert not (out / "report.json").exists()


@pytest.mark.usefixtures("leaves_nothing")
@pytest.mark.xdist_group("e2e")  # beside the other engine tests: the leaves_nothing group is the longest
def test_a_killed_step_and_a_step_past_run_timeout_leave_no_temp_folder_and_a_failed_reference_ends_the_check(
        tiny_model, tmp_path):
    """The runner on the tiny Llama, the test stopping its steps once each engine is up: the recording's child
    killed (SIGKILL: it cleans nothing up itself) - the runner removes its temp folder and the recording's work
    folder; real prefill past --run-timeout (shortened while it runs) - stopped, its folder gone; then no fill
    runs (replay, zeros: 'not run: real prefill failed'), one line saying why."""
    import psutil

    from kvfill.check.runner import run_all

    prompts = tmp_path / "prompts.txt"
    prompts.write_text("w5 w6 w7 w8 w9\nw10 w11 w12\n")
    out = tmp_path / "check"
    cfg = check_config(["--model", tiny_model, "--prompts", str(prompts), "--out", str(out), "--fills", "replay",
                        "zeros", "--output-len", "64"])
    lines, got = [], {}
    runner = threading.Thread(target=lambda: got.update(run_all(cfg, log=lines.append)), daemon=True)
    runner.start()
    deadline = time.monotonic() + 240
    recording = _wait_for_engine("record", deadline, runner.is_alive)
    work = list(out.glob("kvfill-record-*"))  # the recorder's work folder beside the bank
    assert work, os.listdir(out)
    child = [p for p in psutil.Process().children() if "kvfill.check.child" in p.cmdline()]
    assert len(child) == 1, child
    child[0].send_signal(signal.SIGKILL)
    prefill = _wait_for_engine("prefill", deadline, runner.is_alive)
    assert not os.path.exists(recording) and not any(os.path.exists(w) for w in work)  # gone before the next step
    cfg.run_timeout = 0.1
    runner.join(120)
    assert not runner.is_alive()
    steps = got["steps"]
    assert steps["record"]["error"].startswith("exit -9: "), steps["record"]
    assert steps["prefill"]["error"].startswith("stopped after --run-timeout 0.1 s: "), steps["prefill"]
    assert {run: steps[run] for run in ("replay", "zeros")} == {
        run: {"run": run, "error": "not run: real prefill failed"} for run in ("replay", "zeros")}
    assert "real prefill failed: replay, zeros not run (nothing to compare them with)" in lines, lines
    assert not any(ln.startswith(("[3/4]", "[4/4]")) for ln in lines), lines
    assert got["kv_space"]["gib"] == 1 and got["kv_space"]["source"].startswith("sized from 2 prompts"), got
    assert not os.path.exists(prefill)
    assert not _found("kvfill-step-*") and not _found("kvfill-record-*") and not list(out.glob("kvfill-record-*"))
    with open(out / "logs" / "prefill.log") as f:  # the child stopped its engine on the runner's SIGTERM
        assert "kvfill.check.child: SIGTERM: stopping the step" in f.read()
    json.dumps(got["kv_space"])  # as report.json holds it


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_a_step_dies_with_a_killed_check_and_removes_the_temp_folder_made_for_it(tmp_path):
    """kvfill-check killed outright (SIGKILL, the OOM killer) cannot stop its
    step (issue 61, finding 8: the step's engine and temp folder were left).
    A stand-in check starts a step as steps.py does (its pid and the step's
    temp folder in the environment), the step's work a sleep; the check is
    SIGKILLed: the step gets SIGTERM from Linux, ends through its usual way
    out, and removes the temp folder."""
    import pickle

    import psutil

    step_tmp = tmp_path / "kvfill-step-x"
    step_tmp.mkdir()
    (step_tmp / "vllm_dist_probe").write_text("")
    job = tmp_path / "x.job"
    job.write_bytes(pickle.dumps({"kind": "sleep"}))
    step = ("import sys, time; import kvfill.check.child as c; c.execute = lambda job: time.sleep(120); "
            f"sys.exit(c.main([{str(job)!r}, {str(tmp_path / 'x.json')!r}]))")
    check = ("import os, subprocess, sys; "
             f"env = {{**os.environ, 'KVFILL_CHECK_PID': str(os.getpid()), 'KVFILL_STEP_TMP': {str(step_tmp)!r}}}; "
             f"p = subprocess.Popen([sys.executable, '-c', {step!r}], env=env, start_new_session=True); "
             "print(p.pid, flush=True); p.wait()")
    parent = subprocess.Popen([sys.executable, "-c", check], stdout=subprocess.PIPE, text=True)
    child = psutil.Process(int(parent.stdout.readline()))
    time.sleep(3)  # the step is in its work
    assert child.is_running() and step_tmp.exists()
    parent.kill()
    parent.wait(30)
    child.wait(60)  # ended by Linux's SIGTERM, through its way out
    assert not step_tmp.exists()


def test_a_bad_kv_space_is_refused_before_vllm_is_imported(tmp_path):
    """kvfill-check took 44-91 s to refuse VLLM_CPU_KVCACHE_SPACE=lots: it
    imported vLLM first (issue 61, finding 9).  Now refused before."""
    code = ("import sys; from kvfill.check.__main__ import main; "
            f"rc = main(['--model', 'm', '--prompts', 'p', '--out', {str(tmp_path / 'o')!r}]); "
            "print(rc, 'vllm' in sys.modules, 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "VLLM_CPU_KVCACHE_SPACE": "lots"})
    assert out.stdout.split() == ["2", "False", "False"], out.stdout + out.stderr
    assert "VLLM_CPU_KVCACHE_SPACE='lots': expected a whole number of GiB >= 1" in out.stderr


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_a_step_killed_while_importing_torch_removes_its_temp_folder_without_a_traceback(tmp_path):
    """Issue 67: a step whose check was killed while the step still imported torch left its temp folder and a
    traceback - its way out imported kvfill.record, which re-entered torch's half-done import.  A stand-in
    check starts a step as steps.py does; the step's work imports torch, held half-way (in torch.nn, after
    torch._C) until the check is SIGKILLed: the step ends on Linux's SIGTERM and removes its temp folder (and
    the shared memory its rendezvous file names), saying only that it stopped."""
    import pickle

    step_tmp = tmp_path / "kvfill-step-x"
    (step_tmp / "kvfill-record-vllm-y").mkdir(parents=True)
    ident = f"vllm_dist_{uuid.uuid4().hex}"
    (step_tmp / "kvfill-record-vllm-y" / ident).write_text("")  # an engine's rendezvous file, a folder down
    segment = f"/dev/shm/{ident}-0"
    open(segment, "w").close()
    job, log = tmp_path / "x.job", tmp_path / "step.log"
    job.write_bytes(pickle.dumps({"kind": "import"}))
    step = ("import sys, time\n"
            "class HalfWay:\n"  # holds torch's import once, inside torch.nn (torch._C loaded, torch unfinished)
            "    def find_spec(self, name, path, target=None):\n"
            "        if name == 'torch.nn.modules.transformer' and not hasattr(self, 'held'):\n"
            "            self.held = True\n"
            "            print('half-way', flush=True)\n"
            "            time.sleep(120)\n"
            "sys.meta_path.insert(0, HalfWay())\n"
            "import kvfill.check.child as c\n"
            "c.execute = lambda job: __import__('torch')\n"
            f"sys.exit(c.main([{str(job)!r}, {str(tmp_path / 'x.json')!r}]))\n")
    check = ("import os, subprocess, sys; "
             f"env = {{**os.environ, 'KVFILL_CHECK_PID': str(os.getpid()), 'KVFILL_STEP_TMP': {str(step_tmp)!r}}}; "
             f"p = subprocess.Popen([sys.executable, '-c', {step!r}], env=env, start_new_session=True, "
             f"stdout=open({str(log)!r}, 'w'), stderr=subprocess.STDOUT); "
             "print(p.pid, flush=True); p.wait()")
    parent = subprocess.Popen([sys.executable, "-c", check], stdout=subprocess.PIPE, text=True)
    child = int(parent.stdout.readline())
    try:
        deadline = time.monotonic() + 60
        while "half-way" not in log.read_text():
            assert time.monotonic() < deadline and parent.poll() is None, log.read_text()
            time.sleep(0.1)
        parent.kill()
        parent.wait(30)
        deadline = time.monotonic() + 60
        while os.path.exists(f"/proc/{child}") and time.monotonic() < deadline:
            time.sleep(0.2)
        said = log.read_text()
        assert not step_tmp.exists() and not os.path.exists(segment), said
        assert "Traceback" not in said and "kvfill.check.child: SIGTERM: stopping the step" in said, said
    finally:
        if os.path.exists(f"/proc/{child}"):
            os.kill(child, signal.SIGKILL)
        if os.path.exists(segment):
            os.unlink(segment)


# A stand-in for `vllm serve` and `vllm bench serve` (serving.vllm_command's, by its first argument): the server
# answers /health and /metrics on its --port, leaves a rendezvous file in its TMPDIR and a shared-memory segment
# named after it, and starts an "engine core" in its process group; the client waits.  Each writes its pids.
_STAND_IN_VLLM = """
import http.server, os, subprocess, sys, time
pids, ident = os.environ["KVFILL_TEST_PIDS"], os.environ["KVFILL_TEST_IDENT"]
if sys.argv[1] == "serve":
    open(os.path.join(os.environ["TMPDIR"], ident), "w").close()
    open(f"/dev/shm/{ident}-0", "w").close()
    core = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
    class Answer(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200)
            self.end_headers()
            self.wfile.write(b"")
        def log_message(self, *args):
            pass
    port = int(sys.argv[sys.argv.index("--port") + 1])
    server = http.server.HTTPServer(("127.0.0.1", port), Answer)
    with open(pids, "a") as f:
        f.write(f"server {os.getpid()}\\ncore {core.pid}\\n")
    server.serve_forever()
else:
    with open(pids, "a") as f:
        f.write(f"client {os.getpid()}\\n")
    time.sleep(300)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
@pytest.mark.e2e  # its stand-in check runs kvfill.check.serving, which needs vLLM's own platform (not the 0.34 lane's)
def test_a_served_run_dies_with_a_killed_check_and_leaves_no_temp_folder_or_shared_memory(tmp_path):
    """Issue 67: SIGKILL to `kvfill-check --serve` left `vllm serve` (its port, its memory), `vllm bench serve`,
    /dev/shm files and kvfill-serve-* folders: neither had a parent-death signal, and the server's temp folder
    was the check's to remove.  A stand-in check runs serving.served as the runner does, with a stand-in for
    vLLM's CLI; once the client runs, the check is SIGKILLed: server, its engine core and the client end, and
    the server's temp folder and shared memory are gone."""
    pids, ident = tmp_path / "pids", f"vllm_dist_{uuid.uuid4().hex}"
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "w5 w6"}\n')
    (tmp_path / "logs").mkdir()
    check = (
        "import os, sys\n"
        "import kvfill.check.serving as s\n"
        "from kvfill.check.cli import CheckConfig\n"
        f"s.vllm_command = lambda *args: [sys.executable, '-c', {_STAND_IN_VLLM!r}, *args]\n"
        f"cfg = CheckConfig(model='m', prompts={str(prompts)!r}, out={str(tmp_path)!r}, bank=None, fills=[], "
        "output_len=1, max_tokens=4, temperature=0.0, normal=None, constant=0.0, split='off', run_timeout=300, "
        "engine={}, argv=['--model', 'm'], serve=True)\n"
        "engine = {'max_model_len': 64, 'max_num_seqs': 1, 'seed': 0, 'enable_prefix_caching': False}\n"
        f"s.served('prefill', cfg, engine, None, {str(prompts)!r}, 1, dict(os.environ), print)\n")
    env = {**os.environ, "KVFILL_TEST_PIDS": str(pids), "KVFILL_TEST_IDENT": ident,
           "TMPDIR": str(tmp_path)}  # the server's temp folder is made here, where the test can look
    parent = subprocess.Popen([sys.executable, "-c", check], env=env, stdout=subprocess.DEVNULL)
    started: dict[str, int] = {}
    try:
        deadline = time.monotonic() + 120
        while "client" not in started:
            assert time.monotonic() < deadline and parent.poll() is None, "the stand-in client never started"
            time.sleep(0.2)
            started = {k: int(v) for k, v in (ln.split() for ln in pids.read_text().splitlines())} \
                if pids.exists() else {}
        folders = glob.glob(str(tmp_path / "kvfill-serve-*"))
        assert len(folders) == 1 and os.path.exists(os.path.join(folders[0], ident)), folders
        parent.kill()
        parent.wait(30)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and (any(os.path.exists(f"/proc/{p}") for p in started.values())
                                               or os.path.exists(folders[0])):
            time.sleep(0.2)
        left = {name: p for name, p in started.items() if os.path.exists(f"/proc/{p}")}
        assert not left, f"left running: {left}"
        assert not os.path.exists(folders[0]) and not os.path.exists(f"/dev/shm/{ident}-0")
    finally:
        for p in started.values():
            if os.path.exists(f"/proc/{p}"):
                os.kill(p, signal.SIGKILL)
        if os.path.exists(f"/dev/shm/{ident}-0"):
            os.unlink(f"/dev/shm/{ident}-0")

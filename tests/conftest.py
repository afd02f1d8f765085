import os

# Triton kernels run under the interpreter on CPU tensors; the variable must be
# set before any @triton.jit definition is executed.
os.environ.setdefault("TRITON_INTERPRET", "1")

import sys  # noqa: E402

# bench/ holds the layout zoo shared by the tests and the GPU check.
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench"))

import pytest  # noqa: E402
import torch  # noqa: E402

BACKENDS = ["torch", "triton"]


@pytest.fixture(params=BACKENDS)
def backend(request):
    return request.param


def pytest_report_header(config):
    return f"torch {torch.__version__}, TRITON_INTERPRET={os.environ.get('TRITON_INTERPRET')}"

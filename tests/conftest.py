import os

# Triton kernels run under the interpreter on CPU tensors; the variable must be
# set before any @triton.jit definition is executed.
os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

BACKENDS = ["torch", "triton"]


@pytest.fixture(params=BACKENDS)
def backend(request):
    return request.param


def pytest_report_header(config):
    return f"torch {torch.__version__}, TRITON_INTERPRET={os.environ.get('TRITON_INTERPRET')}"

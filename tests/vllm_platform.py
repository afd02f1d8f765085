"""vLLM's platform for tests that parse vLLM's engine flags or build its
engine config without starting an engine.

vLLM resolves its platform once per process (``vllm.platforms.current_platform``).
vLLM CPU (``make test``) resolves its CPU platform; vLLM 0.34's CUDA wheel on
a machine without a GPU (``make test-vllm034``) resolves none - an empty
``device_type`` - and then ``EngineArgs.add_cli_args`` and
``create_engine_config`` raise "Failed to infer device type" before any of
kvfill's code runs.  ``cpu_platform_stand_in`` gives such a test vLLM's own
CPU platform class for its duration (the flags and their checks are the
installed vLLM's; only the device is the CPU's); ``skip_without_engine_config``
skips a test that builds a whole engine config where that stand-in cannot:
vLLM's CPU platform refuses an x86 machine without triton-cpu.
"""
from __future__ import annotations

import pytest


def cpu_platform_stand_in(monkeypatch) -> bool:
    """vLLM's ``CpuPlatform`` as ``current_platform`` for this test where the
    installed vLLM resolves no platform here; True when it stands in."""
    import vllm.platforms as platforms

    if platforms.current_platform.device_type:
        return False
    from vllm.platforms.cpu import CpuPlatform

    monkeypatch.setattr(platforms, "_current_platform", CpuPlatform())
    return True


def skip_without_engine_config(stand_in: bool) -> None:
    """Skip, naming what is missing, where vLLM's engine config cannot be
    built here: the CPU platform stands in (no platform of the installed
    vLLM's own) and vLLM finds no Triton with a CPU backend."""
    if not stand_in:
        return
    import vllm
    from vllm.triton_utils import HAS_TRITON

    if not HAS_TRITON:
        pytest.skip(f"vLLM {vllm.__version__} resolves no platform on this machine without a GPU (its CUDA wheel), "
                    f"and its CpuPlatform refuses to build an engine config on x86 without triton-cpu "
                    f"(vllm.triton_utils.HAS_TRITON False): EngineArgs.create_engine_config cannot run here")

"""pytest-benchmark suites: kvfill vs the in-tree fill vs a memset of the same bytes.

    make bench                      # CPU grid, then bench/report.py (table, JSON, plot)
    KVFILL_BENCH_DEVICE=cuda .venv/bin/python -m pytest bench/test_bench_fill.py \\
        --benchmark-json=bench/results/gpu-bench-raw.json   # GPU grid

Three sweeps, each case run by the three implementations:
* size:   bf16 LBNHC, 8 layers (32 on GPU), 16 requests, 1 MiB ... 64 MiB (1 GiB on GPU)
* shape:  16 MiB over layouts x dtypes
* launch: small fills, layers 1 ... 80 x requests 1 ... 256 (the launch-bound regime)
in both modes (constant, normal).  ``extra_info`` carries bytes, launches per
call and peak extra device memory; report.py turns the medians into GB/s, %
of memset and the speedup over the in-tree path.
"""
from __future__ import annotations

import os

import pytest
import torch

from kvfill.bench import common as C  # noqa: E402
from kvfill.bench import fill_bench  # noqa: E402

DEVICE = os.environ.get("KVFILL_BENCH_DEVICE", "cuda" if torch.cuda.is_available() else "cpu")
GPU = DEVICE.startswith("cuda")
MiB = 1 << 20
IMPLS = ["kvfill", "in-tree", "memset"]
MODES = ["constant", "normal"]
SIZES = [1, 16, 64, 256, 1024] if GPU else [1, 4, 16, 64]
LAYERS = 32 if GPU else 8
SHAPES = [("LBNHC", torch.bfloat16), ("BLHNC", torch.bfloat16), ("LBNHC", torch.uint8), ("LHBNC", torch.float32)]
LAUNCH = [(1, 1), (80, 1), (1, 256), (80, 256)] if GPU else [(1, 1), (16, 1), (1, 64), (16, 64)]


class _Case:
    """One fill: caches, plan, engine, and the three implementations as callables."""

    def __init__(self, *, fill_bytes, num_layers, num_requests, mode, layout="LBNHC", dtype=torch.bfloat16,
                 heads=8, content=256):
        from kvfill.kernels import CacheGroup, FillEngine

        self.mean, self.std = (0.015, 0.0) if mode == "constant" else (0.0, 1.0)
        self.layers, self.requests, self.plan, self.nbytes = fill_bench.build(
            DEVICE, fill_bytes=fill_bytes, num_layers=num_layers, num_requests=num_requests,
            layout=layout, heads=heads, content=content, dtype=dtype,
        )
        enc = "fp8_e4m3" if dtype == torch.uint8 else "auto"
        self.engine = FillEngine(
            {"g": CacheGroup({f"layer.{i}": v for i, v in enumerate(self.layers)}, encoding=enc)},
            mean=self.mean, std=self.std,
        )
        self.scratch = None

    def fn(self, impl):
        if impl == "kvfill":
            return lambda: self.engine.fill(self.plan)
        if impl == "in-tree":
            return lambda: C.intree_fill(self.layers, self.requests, self.mean, self.std)
        self.scratch = torch.empty(self.nbytes, dtype=torch.uint8, device=DEVICE)
        return self.scratch.zero_


def _run(benchmark, fill: _Case, impl: str, **info):
    fn = fill.fn(impl)

    def timed():
        fn()
        C.sync(DEVICE)

    calls = {"kvfill": None, "in-tree": len(fill.requests) * len(fill.layers), "memset": 1}[impl]
    if impl == "kvfill":
        stats = fill.engine.fill(fill.plan)
        calls = stats.launches or len(fill.layers)  # torch backend: one index_put per layer
        assert fill.engine.verify(fill.plan).ok
    rounds = 3 if impl == "in-tree" and fill.std > 0 and not GPU else 7
    benchmark.pedantic(timed, rounds=rounds, iterations=1, warmup_rounds=1)
    benchmark.extra_info.update(
        impl=impl, bytes=fill.nbytes, calls=calls, device=DEVICE,
        extra_bytes=C.peak_extra_bytes(fn, DEVICE), **info,
    )


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("mib", SIZES)
def test_size_sweep(benchmark, impl, mode, mib):
    case = _Case(fill_bytes=mib * MiB, num_layers=LAYERS, num_requests=16, mode=mode)
    _run(benchmark, case, impl, sweep="size", mode=mode, case=f"{mib}MiB L{LAYERS} R16 LBNHC bf16")


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("layout,dtype", SHAPES, ids=[f"{layout}-{str(d).split('.')[-1]}" for layout, d in SHAPES])
def test_shape_sweep(benchmark, impl, mode, layout, dtype):
    case = _Case(fill_bytes=16 * MiB, num_layers=LAYERS, num_requests=16, mode=mode, layout=layout, dtype=dtype)
    name = f"16MiB {layout} {str(dtype).split('.')[-1]}"
    _run(benchmark, case, impl, sweep="shape", mode=mode, case=name)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("layers,requests", LAUNCH, ids=[f"L{a}-R{b}" for a, b in LAUNCH])
def test_launch_sweep(benchmark, impl, mode, layers, requests):
    # One 4 KiB block per request per layer: short prompts, launch-bound.
    case = _Case(fill_bytes=0, num_layers=layers, num_requests=requests, mode=mode, heads=1, content=128)
    _run(benchmark, case, impl, sweep="launch", mode=mode, case=f"L{layers} R{requests} 4KiB blocks")

"""kvfill vs the in-tree fill vs a memset of the same bytes, side by side in one run.

    python bench/fill_bench.py                      # CPU: torch backend, small sizes
    python bench/fill_bench.py --device cuda --sizes 64 256 1024   # GPU: Triton
    python bench/fill_bench.py --values [--tokens 65536] [--row 1024]  # what the normal fill writes

Caches are vLLM-standard ``[B, H, N, C]`` bf16 views (LBNHC by default) of
``--layers`` layers; each step fills ``--requests`` requests whose blocks are
scattered randomly over a pool twice the fill's size.  Figures per implementation:
median time, GB/s written, % of the memset's bandwidth, kvfill's speedup over the
in-tree path, fill calls per step, peak extra device memory (CUDA).

``--values`` times nothing: it fills two layers of ``--tokens`` token rows of
``--row`` fp32 elements with the normal fill (mean 0, std 1) and prints the
sample mean and std and the Pearson correlation between neighbouring
elements of a row, neighbouring tokens, tokens 4096 apart and the two layers.
"""
from __future__ import annotations

import argparse
import sys

import numpy as np
import torch

from kvfill.bench import common as C  # noqa: E402

from kvfill.kernels import CacheGroup, FillEngine, GroupFill, fill_blocks  # noqa: E402
from kvfill.kernels.testing import STANDARD_LAYOUTS  # noqa: E402

MiB = 1 << 20


def build(device, *, fill_bytes, num_layers, num_requests, heads=8, block_size=16, content=256,
          dtype=torch.bfloat16, layout="LBNHC", seed=0):
    itemsize = torch.empty((), dtype=dtype).element_size()
    page = heads * block_size * content * itemsize
    if fill_bytes > 0:  # small fills: fewer requests rather than more bytes
        num_requests = max(1, min(num_requests, fill_bytes // (page * num_layers)))
    total_blocks = max(num_requests, fill_bytes // (page * num_layers))
    per_request = max(1, total_blocks // num_requests)
    num_blocks = 2 * per_request * num_requests
    _, layers = C.standard_views(num_layers, num_blocks, heads, block_size, content, dtype, layout, device)
    requests = C.scattered_requests(num_requests, per_request, num_blocks, seed)
    ids = np.concatenate([np.asarray(r) for r in requests])
    base = np.concatenate([np.arange(len(r)) * block_size for r in requests])
    plan = {"g": GroupFill(block_ids=ids, local_base=base)}
    nbytes = len(ids) * page * num_layers
    return layers, requests, plan, nbytes


BANK_POSITIONS = 4096  # positions past it wrap (bank.py), as a shorter recording would


def replay_bank(layers, device):
    """A bank on the device for replay rows: one sequence of BANK_POSITIONS
    random rows per layer (bits are what the kernel moves; values don't matter)."""
    from kvfill.kernels import Bank, layout_of

    g = torch.Generator(device=device).manual_seed(0)
    return Bank({
        f"layer.{i}": torch.randn(1, BANK_POSITIONS, layout_of(v).row_size, generator=g, device=device).to(v.dtype)
        for i, v in enumerate(layers)
    })


def run_case(device, *, fill_bytes, num_layers, num_requests, mode, layout="LBNHC", repeat=5, label=None,
             heads=8, content=256, include_intree=True):
    mean, std = (0.015, 0.0) if mode == "constant" else (0.0, 1.0)
    layers, requests, plan, nbytes = build(
        device, fill_bytes=fill_bytes, num_layers=num_layers, num_requests=num_requests, layout=layout,
        heads=heads, content=content,
    )
    bank = replay_bank(layers, device) if mode == "replay" else None
    engine = FillEngine({"g": CacheGroup({f"layer.{i}": v for i, v in enumerate(layers)})}, mean=mean, std=std,
                        bank=bank)
    stats = engine.fill(plan)
    ok = engine.verify(plan).ok
    t_kv = C.median_time(lambda: engine.fill(plan), device, repeat=repeat)
    mem_kv = C.peak_extra_bytes(lambda: engine.fill(plan), device)
    scratch = torch.empty(nbytes, dtype=torch.uint8, device=device)
    t_memset = C.median_time(lambda: scratch.zero_(), device, repeat=repeat)
    del scratch
    rows = []
    name = label or f"{nbytes / MiB:.0f}MiB L{num_layers} R{num_requests}"
    t_in = mem_in = None
    if include_intree:
        t_in = C.median_time(lambda: C.intree_fill(layers, requests, mean, std), device, repeat=max(1, repeat // 2))
        mem_in = C.peak_extra_bytes(lambda: C.intree_fill(layers, requests, mean, std), device)
    for impl, t, calls, mem in (
        # kvfill on CPU (torch backend): one index_put per layer tensor.
        ("kvfill", t_kv, stats.launches or num_layers, mem_kv),
        ("in-tree", t_in, len(requests) * num_layers, mem_in),
        ("memset", t_memset, 1, 0),
    ):
        if t is None:
            continue
        rows.append({
            "case": name,
            "mode": mode,
            "impl": impl,
            "MiB": round(nbytes / MiB, 1),
            "ms": round(t * 1e3, 3),
            "GB/s": round(C.gbps(nbytes, t), 1),
            "%memset": round(100 * t_memset / t, 1),
            "x in-tree": round(t_in / t, 2) if t_in else "",
            "calls": calls,
            "extra MiB": "" if mem is None else round(mem / MiB, 2),
            "verified": ok if impl == "kvfill" else "",
        })
    return rows


def corr(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double().flatten(), b.double().flatten()
    a, b = a - a.mean(), b - b.mean()
    return float((a * b).sum() / (a.norm() * b.norm()))


def value_stats(tokens: int, row: int, block_size: int = 16) -> dict:
    """The normal fill's values (mean 0, std 1) over two layers of ``tokens`` rows of ``row`` fp32 elements."""
    layer0 = torch.zeros(tokens // block_size, 1, block_size, row)
    layer1 = torch.zeros_like(layer0)
    fill_blocks([layer0, layer1], list(range(tokens // block_size)), mean=0.0, std=1.0, seed=0)
    x, y = layer0.reshape(tokens, row), layer1.reshape(tokens, row)  # [token, element]
    n = x.numel()
    return {
        "samples": n,
        "mean": float(x.double().mean()),
        "std": float(x.double().std()),
        "sampling error of the mean (1/sqrt(n))": n**-0.5,
        "corr(element e, e+1)": corr(x[:, 1:], x[:, :-1]),
        "corr(token t, t+1)": corr(x[1:], x[:-1]),
        "corr(token t, t+4096)": corr(x[4096:], x[:-4096]) if tokens > 4096 else float("nan"),
        "corr(layer 0, layer 1)": corr(x, y),
    }


COLUMNS = ["case", "mode", "impl", "MiB", "ms", "GB/s", "%memset", "x in-tree", "calls", "extra MiB", "verified"]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--sizes", type=int, nargs="+", default=None, help="fill sizes in MiB")
    p.add_argument("--layers", type=int, default=None)
    p.add_argument("--requests", type=int, default=16)
    p.add_argument("--modes", nargs="+", default=["constant", "normal"])
    p.add_argument("--layout", default="LBNHC", choices=sorted(STANDARD_LAYOUTS))
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--json", default=None, help="write results here")
    p.add_argument("--values", action="store_true", help="the normal fill's value statistics instead of timings")
    p.add_argument("--tokens", type=int, default=65536, help="--values: token rows per layer")
    p.add_argument("--row", type=int, default=1024, help="--values: fp32 elements per row")
    a = p.parse_args(argv)
    if a.values:
        figures = value_stats(a.tokens, a.row)
        for k, v in figures.items():
            print(f"{k:>40}: {v:.5f}" if isinstance(v, float) else f"{k:>40}: {v}")
        return figures
    gpu = torch.device(a.device).type == "cuda"
    sizes = a.sizes or ([64, 256, 1024] if gpu else [16, 64])
    layers = a.layers or (32 if gpu else 8)
    rows = []
    for mib in sizes:
        for mode in a.modes:
            rows += run_case(a.device, fill_bytes=mib * MiB, num_layers=layers, num_requests=a.requests,
                             mode=mode, layout=a.layout, repeat=a.repeat)
    if a.json:
        C.write_json(a.json, {"machine": C.machine_info(a.device), "command": " ".join(sys.argv), "rows": rows})
    print(C.table(rows, COLUMNS))
    return rows


if __name__ == "__main__":
    main()

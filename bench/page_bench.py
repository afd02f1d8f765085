"""The torch backend on vLLM CPU's cache layout: whole 128-slot pages, normal vs replay vs constant vs memset.

    python bench/page_bench.py                 # 256 blocks x 4 layers, 512 MiB per step
    python bench/page_bench.py --blocks random

vLLM 0.32's CPU attention keeps each layer as ``[num_blocks, H, N, 2 * D]``
whose (block, head) pages hold K transposed ``[D, N]`` then V ``[N, D]``
(``connector/cpu_layout.py``); kvfill registers the K and V views, as the
connector does.  Whole pages of both are gathered head-major into a small
staging buffer and written with one strided copy per run of consecutive
blocks (for K a transposing one: ``torch_pages.fill_pages_staged``).  Normal and replay (a bank of recorded rows, one
sequence covering the positions) are timed beside a constant fill and a memset
of the same bytes, in one run.
"""
from __future__ import annotations

import argparse
import time

import numpy as np
import torch

from kvfill.bench import common as C
from kvfill.connector.cpu_layout import cpu_kv_parts
from kvfill.kernels import Bank, CacheGroup, FillEngine, GroupFill


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--blocks", choices=["consecutive", "random"], default="consecutive",
                   help="block ids of the plan: one run (as vLLM hands them out) or scattered")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--num-blocks", type=int, default=512)
    p.add_argument("--planned", type=int, default=256, help="blocks filled per step")
    p.add_argument("--requests", type=int, default=8,
                   help="the planned blocks are this many requests' prompts, each from position 0 (as in a "
                        "serving benchmark: every request's whole pages are the first one's again)")
    p.add_argument("--repeat", type=int, default=5)
    a = p.parse_args(argv)
    if a.requests < 1 or a.planned % a.requests:
        p.error(f"--requests {a.requests}: expected a divisor of --planned {a.planned}")
    heads, slots, dim = 8, 128, 128
    caches = [torch.zeros(a.num_blocks, heads, slots, 2 * dim, dtype=torch.bfloat16) for _ in range(a.layers)]
    ids = np.arange(a.planned) if a.blocks == "consecutive" else \
        np.random.default_rng(0).permutation(a.num_blocks)[: a.planned]
    per_request = a.planned // a.requests
    plan = {"g": GroupFill(ids, local_base=np.arange(ids.size) % per_request * slots)}
    layers = {f"model.layers.{i}.attn": cpu_kv_parts(c, dim) for i, c in enumerate(caches)}
    g = torch.Generator(device="cpu").manual_seed(0)
    bank = Bank({n: torch.randn(1, per_request * slots, 2 * heads * dim, generator=g, device="cpu").to(torch.bfloat16)
                 for n in layers})
    rows = []
    nbytes = 0
    runs = (("normal", 0.1, None), ("replay", 0.0, None), ("normal", 0.1, 0), ("replay", 0.0, 0), ("constant", 0.0, None))
    for mode, std, images in runs:
        eng = FillEngine({"g": CacheGroup(layers, slot_dim=2)}, mean=0.015, std=std, backend="torch",
                         bank=bank if mode == "replay" else None, page_image_bytes=images)
        t0 = time.perf_counter()
        nbytes = eng.fill(plan).bytes
        first = time.perf_counter() - t0
        assert eng.verify(plan).ok
        t = C.median_time(lambda: eng.fill(plan), "cpu", repeat=a.repeat)
        name = f"kvfill {mode}" + (", no page images" if images == 0 else "")
        rows.append({"impl": name, "ms": round(t * 1e3, 1), "GB/s": round(C.gbps(nbytes, t), 1),
                     "first fill ms": round(first * 1e3, 1)})
    scratch = torch.empty(nbytes, dtype=torch.uint8)
    t = C.median_time(lambda: scratch.zero_(), "cpu", repeat=a.repeat)
    rows.append({"impl": "memset", "ms": round(t * 1e3, 1), "GB/s": round(C.gbps(nbytes, t), 1), "first fill ms": ""})
    print(f"{nbytes / 2**20:.0f} MiB per step: {a.planned} {a.blocks} blocks ({a.requests} requests of "
          f"{per_request * slots} positions) x {a.layers} layers of [{a.num_blocks}, {heads}, {slots}, 2 x {dim}] "
          f"bf16 (K transposed, V), torch threads {torch.get_num_threads()}; replay / normal time "
          f"{rows[1]['ms'] / rows[0]['ms']:.2f}; without page images {rows[2]['ms'] / rows[0]['ms']:.2f}x "
          f"the normal fill's time")
    print(C.table(rows, ["impl", "ms", "GB/s", "first fill ms"]))
    return rows


if __name__ == "__main__":
    main()

"""The torch backend on vLLM CPU's cache layout: whole 128-slot pages, normal vs constant vs memset.

    python bench/page_bench.py                 # 8 requests x 32 blocks x 4 layers, 512 MiB
    python bench/page_bench.py --blocks random

vLLM's CPU attention keeps each layer as ``(2, num_blocks, H, N, D)``: whole
pages are gathered from the value table straight into each of K and V, one
``index_select`` per region and run of consecutive block ids.  The fill is
timed beside a memset of the same bytes and a constant fill, in one run.
"""
from __future__ import annotations

import argparse

import numpy as np
import torch

from kvfill.bench import common as C
from kvfill.kernels import CacheGroup, FillEngine, GroupFill


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--blocks", choices=["consecutive", "random"], default="consecutive",
                   help="block ids of the plan: one run (as vLLM hands them out) or scattered")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--num-blocks", type=int, default=512)
    p.add_argument("--planned", type=int, default=256, help="blocks filled per step")
    p.add_argument("--repeat", type=int, default=5)
    a = p.parse_args(argv)
    heads, slots, dim = 8, 128, 128
    caches = [torch.zeros(2, a.num_blocks, heads, slots, dim, dtype=torch.bfloat16) for _ in range(a.layers)]
    ids = np.arange(a.planned) if a.blocks == "consecutive" else \
        np.random.default_rng(0).permutation(a.num_blocks)[: a.planned]
    plan = {"g": GroupFill(ids, local_base=np.arange(ids.size) * slots)}
    rows = []
    nbytes = 0
    for mode, std in (("normal", 0.1), ("constant", 0.0)):
        layers = {f"model.layers.{i}.attn": c for i, c in enumerate(caches)}
        eng = FillEngine({"g": CacheGroup(layers, block_dim=1, slot_dim=3)}, mean=0.015, std=std, backend="torch")
        nbytes = eng.fill(plan).bytes
        assert eng.verify(plan).ok
        t = C.median_time(lambda: eng.fill(plan), "cpu", repeat=a.repeat)
        rows.append({"impl": f"kvfill {mode}", "ms": round(t * 1e3, 1), "GB/s": round(C.gbps(nbytes, t), 1)})
    scratch = torch.empty(nbytes, dtype=torch.uint8)
    t = C.median_time(lambda: scratch.zero_(), "cpu", repeat=a.repeat)
    rows.append({"impl": "memset", "ms": round(t * 1e3, 1), "GB/s": round(C.gbps(nbytes, t), 1)})
    print(f"{nbytes / 2**20:.0f} MiB per step: {a.planned} {a.blocks} blocks x {a.layers} layers of "
          f"(2, {a.num_blocks}, {heads}, {slots}, {dim}) bf16, torch threads {torch.get_num_threads()}")
    print(C.table(rows, ["impl", "ms", "GB/s"]))
    return rows


if __name__ == "__main__":
    main()

"""Engine demo (no vLLM needed): fill a hybrid model's KV caches on CPU, verify, compare with the in-tree fill.

It drives the planner and the engine directly, as the connector's worker does
(``Planner.plan`` then ``FillEngine.fill``): caches shaped as vLLM allocates them (standard [B, H, N, C] views, an fp8-in-uint8 group, a
Mamba state group), a step of several long requests with partially computed
first blocks, one ``fill`` per step, then ``verify`` of every planned slot and
a check that no other byte changed.  The Triton kernel runs too (under the
interpreter on CPU) on a small plan and must store the same bytes.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

os.environ.setdefault("TRITON_INTERPRET", "1")  # before kvfill imports triton

import numpy as np  # noqa: E402
import torch  # noqa: E402

from kvfill.bench import common as C  # noqa: E402

from kvfill.connector.planner import GroupGeometry, GroupKind, Planner  # noqa: E402
from kvfill.kernels import CacheGroup, FillEngine, GroupFill  # noqa: E402

MiB = 1 << 20


def build(num_layers, num_blocks, block_size):
    _, full = C.standard_views(num_layers, num_blocks, 8, block_size, 256, torch.bfloat16, "LBNHC")
    _, fp8 = C.standard_views(2, num_blocks, 4, block_size, 128, torch.uint8, "BLHNC")
    mamba = {f"mamba.{i}": [torch.empty(64, 4, 128, dtype=torch.bfloat16), torch.empty(64, 8, 64, 16)] for i in range(2)}
    tensors = [*full, *fp8] + [t for states in mamba.values() for t in states]
    for t in tensors:
        t.view(torch.uint8).fill_(0xA5)  # poison: 0xA5 bytes are no fill value
    groups = {
        "full_attention": CacheGroup({f"attn.{i}": v for i, v in enumerate(full)}),
        "fp8_attention": CacheGroup({f"fp8.{i}": v for i, v in enumerate(fp8)}, encoding="fp8_e4m3"),
        "mamba": CacheGroup(mamba),
    }
    return groups, tensors


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--requests", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=8000)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--fill-std", type=float, default=0.1)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    bs = 16
    per_req = -(-a.prompt_len // bs)
    num_blocks = per_req * a.requests + 8
    groups, tensors = build(a.layers, num_blocks, bs)
    engine = FillEngine(groups, mean=0.015, std=a.fill_std, seed=a.seed)
    print(f"kvfill demo on {engine.device} ({engine.backend} backend), fill_std={a.fill_std}")
    print(engine.describe())

    rng = np.random.default_rng(a.seed)
    perm = rng.permutation(num_blocks)
    planner = Planner([
        GroupGeometry("full_attention", GroupKind.FULL_ATTENTION, bs),
        GroupGeometry("fp8_attention", GroupKind.FULL_ATTENTION, bs),
        GroupGeometry("mamba", GroupKind.MAMBA, a.prompt_len),  # one state row per request
    ])
    selections, requests = [], []
    for r in range(a.requests):
        table = perm[r * per_req : (r + 1) * per_req].tolist()
        local = int(rng.integers(0, 3 * bs))  # prefix-cache hit: partial first block
        selections.append(planner.select(f"req-{r}", a.prompt_len, local, [table, table, [r]]))
        requests.append(table)
    plan = planner.plan(selections)  # what the connector's worker calls each step
    before = [t.clone() for t in tensors]
    t0 = time.perf_counter()
    stats = engine.fill(plan)
    t_fill = time.perf_counter() - t0
    report = engine.verify(plan)
    # Bytes outside the plan: count changed bytes, must equal the planned bytes.
    changed = sum(int((t.view(torch.uint8) != o.view(torch.uint8)).sum()) for t, o in zip(tensors, before))
    print(f"\nfilled {stats.slots} slots, {stats.bytes / MiB:.1f} MiB in {t_fill * 1e3:.1f} ms "
          f"({stats.bytes / t_fill / 1e9:.2f} GB/s); verify: ok={report.ok}, "
          f"{report.num_checked} elements checked, {report.num_mismatched} mismatched; "
          f"bytes changed: {changed} of {stats.bytes} planned")

    # The in-tree fill of the same requests (whole blocks, full-attention group only).
    full_layers = list(groups["full_attention"].layers.values())
    t_in = C.median_time(lambda: C.intree_fill(full_layers, requests, 0.015, a.fill_std), "cpu", repeat=1, warmup=0)
    full_only = {"full_attention": plan["full_attention"]}
    t_kv = C.median_time(lambda: engine.fill(full_only), "cpu", repeat=1, warmup=0)
    full_bytes = per_req * a.requests * full_layers[0][0].numel() * 2 * a.layers
    rows = [
        {"impl": "kvfill (torch)", "ms": round(t_kv * 1e3, 1), "x": round(t_in / t_kv, 2)},
        {"impl": "in-tree", "ms": round(t_in * 1e3, 1), "x": 1.0},
    ]
    print(f"\nfull-attention group only, {a.requests} requests x {a.prompt_len} tokens x {a.layers} layers "
          f"(in-tree fills whole blocks: {full_bytes / MiB:.0f} MiB):")
    print(C.table(rows, ["impl", "ms", "x"]))
    print(f"(x: the in-tree fill's ms / this row's, how many times faster than the in-tree; wall times, one run each, "
          f"with the host's 1-minute load at {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores)")

    # Triton kernel (interpreter on CPU) on the first request: same bytes as torch.
    g = plan["full_attention"]
    small = {"full_attention": GroupFill(*(np.asarray(x)[:3] for x in (g.block_ids, g.slot_start, g.slot_end,
                                                                         g.local_base)))}
    _, ref = C.standard_views(2, num_blocks, 8, bs, 256, torch.bfloat16, "LBNHC")
    _, tri = C.standard_views(2, num_blocks, 8, bs, 256, torch.bfloat16, "LBNHC")
    for views, backend in ((ref, "torch"), (tri, "triton")):
        for v in views:
            v.zero_()
        FillEngine({"full_attention": CacheGroup({f"attn.{i}": v for i, v in enumerate(views)})},
                   mean=0.015, std=a.fill_std, seed=a.seed, backend=backend).fill(small)
    same = all(torch.equal(x.view(torch.int16), y.view(torch.int16)) for x, y in zip(ref, tri))
    print(f"\nTriton kernel (interpreter) vs torch backend on 3 entries x 2 layers: identical bytes = {same}")
    ok = report.ok and changed <= stats.bytes and same
    print("demo OK" if ok else "demo FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

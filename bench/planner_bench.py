"""Scheduler-side planning cost: kvfill's planner vs the in-tree connector, same inputs, one run.

    python bench/planner_bench.py [--requests 256] [--tokens 32768] [--repeat 5]

One step of ``--requests`` new requests of ``--tokens`` prompt tokens, two KV
cache groups (full attention and sliding window, block size 16) with real
vLLM ``KVCacheBlock`` objects.  In-tree: ``DecodeBenchConnectorScheduler``
``update_state_after_alloc`` for every request, then ``build_connector_meta``.
kvfill: ``specs.select_request`` for every request (the planner's selection,
which reads only the selected blocks' ids), collected into the step's
metadata, plus the worker-side ``Planner.plan`` reported separately.  Prints the
median times and the ratio.
"""
from __future__ import annotations

import argparse
import statistics
import time
from types import SimpleNamespace

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.decode_bench_connector import (
    DecodeBenchConnectorScheduler,
)
from vllm.v1.core.kv_cache_manager import KVCacheBlocks
from vllm.v1.core.kv_cache_utils import KVCacheBlock
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    SlidingWindowSpec,
)

from kvfill.connector.planner import Planner
from kvfill.connector.specs import geometries_from_config, select_request

BS = 16


def make_inputs(num_requests: int, num_tokens: int):
    att = dict(block_size=BS, num_kv_heads=8, head_size=128, dtype=torch.bfloat16)
    groups = [
        KVCacheGroupSpec(["full.0"], FullAttentionSpec(**att)),
        KVCacheGroupSpec(["swa.0"], SlidingWindowSpec(**att, sliding_window=4096)),
    ]
    kv_cache_config = KVCacheConfig(num_blocks=10**7, kv_cache_tensors=[], kv_cache_groups=groups)
    vllm_config = SimpleNamespace(
        kv_transfer_config=SimpleNamespace(get_from_extra_config=lambda key, default: default),
        parallel_config=SimpleNamespace(
            decode_context_parallel_size=1, tensor_parallel_size=1, cp_kv_cache_interleave_size=1,
            prefill_context_parallel_size=1,
        ),
    )
    per_req = -(-num_tokens // BS)
    requests, blocks = [], []
    next_id = 1
    for r in range(num_requests):
        full = [KVCacheBlock(next_id + i) for i in range(per_req)]
        next_id += per_req
        window = min(4096 // BS + 1, per_req)
        swa = [KVCacheBlock(0)] * (per_req - window) + [KVCacheBlock(next_id + i) for i in range(window)]
        next_id += window
        for b in swa[: per_req - window]:
            b.is_null = True
        requests.append(SimpleNamespace(request_id=f"req-{r}", num_tokens=num_tokens))
        blocks.append(KVCacheBlocks((full, swa)))
    return vllm_config, kv_cache_config, requests, blocks


def median(fn, repeat):
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=int, default=256)
    p.add_argument("--tokens", type=int, default=32768)
    p.add_argument("--repeat", type=int, default=5)
    a = p.parse_args(argv)
    vllm_config, kv_cache_config, requests, blocks = make_inputs(a.requests, a.tokens)
    n_ext = a.tokens - 1

    def intree():
        sched = DecodeBenchConnectorScheduler(vllm_config, kv_cache_config)
        for req, blk in zip(requests, blocks):
            sched.update_state_after_alloc(req, blk, n_ext)
        return sched.build_connector_meta(None)

    planner = Planner(geometries_from_config(vllm_config, kv_cache_config))

    def kvfill():
        return {req.request_id: select_request(planner, req, blk, n_ext) for req, blk in zip(requests, blocks)}

    # Same selection: the in-tree view of kvfill's metadata equals the in-tree metadata.
    ours, theirs = kvfill(), intree().reqs_to_fill
    assert {k: v.intree_view() for k, v in ours.items()} == theirs, "selections differ"
    t_in = median(intree, a.repeat)
    t_kv = median(kvfill, a.repeat)
    sels = list(ours.values())
    t_rank = median(lambda: planner.plan(sels), a.repeat)
    n_blocks = sum(len(g) for v in theirs.values() for g in v[0])
    print(f"{a.requests} requests x {a.tokens} tokens x 2 groups, {n_blocks} blocks selected")
    print(f"  in-tree update_state_after_alloc + build_connector_meta: {t_in * 1e3:8.1f} ms")
    print(f"  kvfill select_request (scheduler side):                  {t_kv * 1e3:8.1f} ms")
    print(f"  ratio in-tree / kvfill:                                  {t_in / t_kv:8.2f}x")
    print(f"  kvfill Planner.plan (worker side, once per step):        {t_rank * 1e3:8.1f} ms")
    return t_in, t_kv


if __name__ == "__main__":
    main()

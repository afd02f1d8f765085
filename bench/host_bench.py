"""Host overhead per step of the connectors, kernel excluded: kvfill vs the in-tree connector.

    python bench/host_bench.py [--layers 32] [--repeat 5]

Same steps for both: "long" = 16 requests x 32768 tokens, "short" = 256
requests x 512 tokens; two KV cache groups (full attention, sliding window),
block size 16, ``--layers`` layers per group.  Scheduler side: the
connector's ``update_state_after_alloc`` for every request plus
``build_connector_meta``.  Worker side with the data writes removed: kvfill's
``start_fill`` with the engine's write step stubbed (planning, validation and
the plan upload remain); the in-tree ``start_fill_kv`` with
``_fill_block_tensor`` reduced to its host work (the per-layer block-id
tensor and bounds filter; sampling and index-put removed).
"""
from __future__ import annotations

import argparse
from types import SimpleNamespace
from unittest import mock

import torch

from kvfill.bench import planner_bench as PB  # noqa: E402
from kvfill.bench.common import table  # noqa: E402

from vllm.distributed.kv_transfer.kv_connector.v1.decode_bench_connector import (  # noqa: E402
    DecodeBenchConnectorScheduler,
    DecodeBenchConnectorWorker,
)
from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec  # noqa: E402

from kvfill.connector.options import FillOptions  # noqa: E402
from kvfill.connector.scheduler import KVFillScheduler  # noqa: E402
from kvfill.connector.worker import KVFillWorker  # noqa: E402
from kvfill.kernels.torch_fill import TorchBackend  # noqa: E402


def with_layers(vllm_config, kv_cache_config, num_layers):
    groups = [
        KVCacheGroupSpec([f"model.layers.{2 * i + g}.attn" for i in range(num_layers)], grp.kv_cache_spec)
        for g, grp in enumerate(kv_cache_config.kv_cache_groups)
    ]
    cfg = KVCacheConfig(num_blocks=kv_cache_config.num_blocks, kv_cache_tensors=[], kv_cache_groups=groups)
    vllm_config.cache_config = SimpleNamespace(cache_dtype="auto")
    return cfg


def run_step(name, num_requests, num_tokens, num_layers, repeat):
    vllm_config, kv_cfg, requests, blocks = PB.make_inputs(num_requests, num_tokens)
    max_id = max(b.block_id for blk in blocks for grp in blk.blocks for b in grp)
    kv_cfg.num_blocks = max_id + 1
    kv_cfg = with_layers(vllm_config, kv_cfg, num_layers)
    n_ext = num_tokens - 1

    def sched_step(cls):
        sched = cls(vllm_config, kv_cfg) if cls is DecodeBenchConnectorScheduler else cls(
            vllm_config, kv_cfg, FillOptions())
        for req, blk in zip(requests, blocks):
            sched.update_state_after_alloc(req, blk, n_ext)
        return sched.build_connector_meta(None)

    meta_in = sched_step(DecodeBenchConnectorScheduler)
    meta_kv = sched_step(KVFillScheduler)
    t_sched_in = PB.median(lambda: sched_step(DecodeBenchConnectorScheduler), repeat)
    t_sched_kv = PB.median(lambda: sched_step(KVFillScheduler), repeat)

    # Caches: one small page (16 slots x 2 elements) per block and layer.
    nb = kv_cfg.num_blocks
    names = [n for g in kv_cfg.kv_cache_groups for n in g.layer_names]
    caches = {n: torch.zeros(nb, 1, 16, 2, dtype=torch.bfloat16) for n in names}

    worker_kv = KVFillWorker(vllm_config, kv_cfg, FillOptions(fill_std=0.1))
    worker_kv.register_kv_caches(caches)
    worker_in = DecodeBenchConnectorWorker(vllm_config, kv_cfg)
    worker_in.register_kv_caches(caches)

    def intree_host_only(self, kv_cache, block_ids, fill_mean, fill_std, fill_dtype):
        ids = torch.tensor(block_ids, dtype=torch.long, device=kv_cache.device)
        ids[ids < kv_cache.shape[0]]

    with mock.patch.object(TorchBackend, "fill", lambda self, plan: 0):
        t_work_kv = PB.median(lambda: worker_kv.start_fill(meta_kv), repeat)
    with mock.patch.object(DecodeBenchConnectorWorker, "_fill_block_tensor", intree_host_only):
        t_work_in = PB.median(lambda: worker_in.start_fill_kv(meta_in), repeat)
    return {
        "step": f"{name}: {num_requests} req x {num_tokens} tok x {num_layers} layers x 2 groups",
        "in-tree sched ms": round(t_sched_in * 1e3, 2),
        "kvfill sched ms": round(t_sched_kv * 1e3, 2),
        "in-tree worker ms": round(t_work_in * 1e3, 2),
        "kvfill worker ms": round(t_work_kv * 1e3, 2),
        "x in-tree (total)": round((t_sched_in + t_work_in) / (t_sched_kv + t_work_kv), 2),
    }


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--steps", nargs="+", default=["long", "short"])
    a = p.parse_args(argv)
    shapes = {"long": (16, 32768), "short": (256, 512), "tiny": (4, 256)}
    rows = [run_step(s, *shapes[s], a.layers, a.repeat) for s in a.steps]
    print(table(rows, list(rows[0])))
    return rows


if __name__ == "__main__":
    main()

"""What each fill of a DeepSeek-V3.2 / GLM-5 indexer K cache gives the decode's
sparse-attention selector, read by vLLM CPU's own ops: the indexer's logits
(``fp8_paged_mqa_logits_cpu``) and its top-512 selection
(``topk_transform_512_cpu``), for a decode batch of R requests of L positions.

    python bench/indexer_scores.py [--requests 8] [--lens 2048 8192] [--json bench/results/indexer-scores-cpu.json]

Fills, each into its own pages of the same block tables:
  * ``writer``   - vLLM's writer (a port, ``dsa_writers.py``) of keys like
                   the indexer's (LayerNorm output: normal(0, 1) per dim):
                   what a real prefill writes, for random prompts;
  * ``replay``   - kvfill replaying the writer's pages recorded as a bank;
  * ``normal``   - kvfill's synthetic fill, normal(0, 0.1) keys with their
                   power-of-two scale (``kernels/packed_rows.py``);
  * ``constant`` - kvfill's constant fill (0.015): every key equal;
  * ``zeros``    - the in-tree DecodeBenchConnector's (and ``zero_packed``).
Per fill: the share of distinct logits per request, the top-512 overlap with
the writer's, and the median time of each op (the time is the point: a
selector's work can depend on the scores' distribution).
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from kvfill.bench.dsa_writers import pages, quant_indexer, write_indexer
from kvfill.kernels import Bank, CacheGroup, FillEngine, GroupFill
from kvfill.kernels import values as V
from kvfill.kernels.packed_rows import indexer_parts, indexer_values

P, D, HEADS, TOPK = 64, 128, 64, 512
FILLS = ("writer", "replay", "normal", "constant", "zeros")


def fill(kind: str, requests: int, length: int, rows: torch.Tensor) -> torch.Tensor:
    """A cache of ``requests`` block tables of ``length`` positions filled by ``kind``."""
    blocks = requests * length // P
    cache = torch.zeros(blocks, 1, P, D + 4, dtype=torch.uint8)
    table = torch.arange(blocks).view(requests, length // P)
    if kind == "writer":
        g = torch.Generator(device="cpu").manual_seed(1)
        keys = torch.randn(requests * length, D, generator=g, device="cpu")
        write_indexer(cache, keys, range(requests * length))
        return cache
    spec = V.ValueSpec(mean=0.0 if kind == "normal" else 0.015, std=0.1 if kind == "normal" else 0.0, seed=2)
    enc = "packed" if kind == "zeros" else {"l": indexer_values(spec)}
    bank = Bank({"l": rows}, sequence_lengths=[length] * requests) if kind == "replay" else None
    eng = FillEngine({"g": CacheGroup({"l": indexer_parts(cache)}, encoding=enc)}, values=spec, bank=bank,
                     backend="torch")
    n = length // P
    eng.fill({"g": GroupFill(table.reshape(-1).tolist(), local_base=[(i % n) * P for i in range(blocks)],
                             sequence=[i // n if bank is not None else 0 for i in range(blocks)])})
    return cache


def measure(cache, requests, length, repeat) -> dict:
    from vllm import _custom_ops as ops

    if not hasattr(torch.ops._C, "fp8_paged_mqa_logits_cpu"):
        raise SystemExit("vLLM CPU's kernels for this CPU have no fp8_paged_mqa_logits_cpu: vLLM loads the build "
                         "that holds its sparse-indexer ops on CPUs with AVX-512 BF16 only")

    g = torch.Generator(device="cpu").manual_seed(3)
    q8, qs = quant_indexer(torch.randn(requests * HEADS, D, generator=g, device="cpu"))
    q8 = q8.view(requests, HEADS, D)
    w = torch.randn(requests, HEADS, generator=g, device="cpu") * qs.view(requests, HEADS) * D ** -0.5 * HEADS ** -0.5
    lens = torch.full((requests,), length, dtype=torch.int32)
    table = torch.arange(requests * length // P, dtype=torch.int32).view(requests, -1)
    kv = pages(cache)
    out_page = torch.empty(requests, TOPK, dtype=torch.int32)
    out_raw = torch.empty_like(out_page)
    t_logits, t_topk = [], []
    for _ in range(repeat):
        t0 = time.perf_counter()
        logits = ops.fp8_paged_mqa_logits_cpu(q8, kv, w, lens, table, P, length)
        t1 = time.perf_counter()
        ops.topk_transform_512_cpu(logits, lens, table, out_page, P, out_raw)
        t2 = time.perf_counter()
        t_logits.append(t1 - t0), t_topk.append(t2 - t1)
    distinct = statistics.mean(len(torch.unique(logits[r, :length])) / length for r in range(requests))
    return {"logits": logits[:, :length].clone(), "topk": out_raw.clone(), "distinct_share": round(distinct, 4),
            "logits_ms": round(statistics.median(t_logits) * 1e3, 3),
            "topk_ms": round(statistics.median(t_topk) * 1e3, 3)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=int, default=8)
    p.add_argument("--lens", type=int, nargs="+", default=[2048, 8192])
    p.add_argument("--repeat", type=int, default=20)
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    for n in a.lens:
        if n % P or n <= TOPK:
            p.error(f"--lens {n}: expected a multiple of {P} above {TOPK} (the top-k selects {TOPK})")
    from kvfill.bench.common import machine_info, table, write_json

    rows_out = []
    for length in a.lens:
        writer = fill("writer", a.requests, length, None)
        # the writer's pages recorded by kvfill (a token's key bytes, then its scale's), request after request
        blocks = a.requests * length // P
        bank_rows = FillEngine({"g": CacheGroup({"l": indexer_parts(writer)})}, backend="torch").read(
            {"g": GroupFill(list(range(blocks)), local_base=[i * P for i in range(blocks)])})["l"]
        ref = None
        for kind in FILLS:
            m = measure(writer if kind == "writer" else fill(kind, a.requests, length, bank_rows), a.requests,
                        length, a.repeat)
            if ref is None:
                ref = m
            overlap = statistics.mean(
                len(set(m["topk"][r].tolist()) & set(ref["topk"][r].tolist())) / TOPK for r in range(a.requests))
            rows_out.append({"positions": length, "fill": kind, "distinct_share": m["distinct_share"],
                             "logits_equal_writer": bool(torch.equal(m["logits"], ref["logits"])),
                             "topk_overlap_writer": round(overlap, 3), "logits_ms": m["logits_ms"],
                             "topk_ms": m["topk_ms"]})
            print(f"{length} positions, {kind}: {rows_out[-1]}", flush=True)
    cols = ["positions", "fill", "distinct_share", "logits_equal_writer", "topk_overlap_writer", "logits_ms",
            "topk_ms"]
    print(f"\n{a.requests} requests x {a.lens} positions, {HEADS} indexer heads, vLLM CPU's ops, median of "
          f"{a.repeat}:")
    print(table(rows_out, cols))
    if a.json:
        write_json(a.json, {"machine": machine_info("cpu"), "command": "python bench/indexer_scores.py "
                            + " ".join(sys.argv[1:] if argv is None else argv), "rows": rows_out})
    replay = [r for r in rows_out if r["fill"] == "replay"]
    return 0 if all(r["logits_equal_writer"] for r in replay) else 1


if __name__ == "__main__":
    sys.exit(main())

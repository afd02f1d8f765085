"""One-shot GPU check: correctness on every layout x dtype, then kvfill vs memset
vs the in-tree fill at several sizes.  Needs torch + triton + kvfill only (no
vLLM, no network); prints a compact table last and writes JSON.

    python bench/gpu_check.py --out bench/results          # on a GPU machine
    TRITON_INTERPRET=1 python bench/gpu_check.py --smoke   # CPU dry run (tests do this)

Correctness: each cache layout of kvfill.kernels.testing is built over a poisoned
buffer on the device, filled by the Triton kernel (partial first block, whole
block, partial last block, out of order), and every byte of the buffer is
compared with the torch backend's fill of a CPU copy (the torch backend is
checked against an independent oracle by the CPU test suite).
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch

from kvfill.bench import common as C  # noqa: E402
from kvfill.bench import fill_bench  # noqa: E402
from kvfill.kernels import testing as LZ  # noqa: E402

from kvfill.kernels import CacheGroup, FillEngine, GroupFill, fill_blocks  # noqa: E402

MiB = 1 << 20
SLOT_ENTRIES = [(4, 3, 8, 0), (1, 0, 8, 8), (5, 0, 2, 16)]
STATE_ENTRIES = [(4, 0, 1, 7), (2, 0, 1, 9)]


def _engine(layers, case, encoding, backend, std):
    group = CacheGroup(
        layers, num_blocks=LZ.NUM_BLOCKS, block_dim=case.block_dim, slot_dim=case.slot_dim, encoding=encoding
    )
    return FillEngine({"g": group}, mean=0.25, std=std, seed=11, backend=backend)


def check_case(case, dtype, encoding, device, std):
    itemsize = torch.empty((), dtype=dtype).element_size()
    g = torch.Generator(device="cpu").manual_seed(99)
    host = torch.randint(0, 256, (case.nbytes(itemsize),), dtype=torch.uint8, generator=g, device="cpu")
    dev = host.to(device)
    entries = STATE_ENTRIES if case.state_list else SLOT_ENTRIES
    blocks, lo, hi, base = zip(*entries)
    plan = {"g": GroupFill(block_ids=blocks, slot_start=lo, slot_end=hi, local_base=base)}
    _engine(case.make(dev, dtype), case, encoding, "triton", std).fill(plan)
    _engine(case.make(host, dtype), case, encoding, "torch", std).fill(plan)
    got = dev.cpu()
    bad = int((got != host).sum())
    return bad


def correctness(device, log):
    rows, failures = [], 0
    for case in LZ.CASES:
        for dname, dtype, encoding in LZ.DTYPES:
            for std in (0.0, 1.0):
                bad = check_case(case, dtype, encoding, device, std)
                failures += bad != 0
                if bad:
                    log(f"MISMATCH {case.name} {dname} std={std}: {bad} bytes")
                rows.append({"layout": case.name, "dtype": dname, "std": std, "bad_bytes": bad})
    return rows, failures


def check_graph_capture(device, log):
    """fill_blocks captured in a CUDA graph (kvfill.kernels.capture), replayed
    with new ids after the engine cache was cleared and refilled: the same
    bytes as the host path (repeated id: first position wins; ids past the
    caches and past int32 skipped), and host ids refused under capture.
    Returns the failed checks' names; None where not CUDA."""
    if torch.device(device).type != "cuda":
        return None
    from kvfill.kernels import clear_engine_cache, release_captured_fills

    failed = []
    cache = torch.zeros(16, 2, 8, 32, dtype=torch.bfloat16, device=device)
    ids = torch.tensor([3, 7, 3, 9], device=device)
    kw = dict(mean=0.0, std=1.0, seed=5)
    fill_blocks([cache], ids, **kw)  # warm-up: registers the engine
    torch.cuda.synchronize()
    cache.zero_()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fill_blocks([cache], ids, **kw)
        try:
            fill_blocks([cache], [3, 7], **kw)
            failed.append("host ids accepted under capture")
        except RuntimeError:
            pass
    # Evict every cached engine: the captured fill's must stay alive.
    for i in range(10):
        fill_blocks([torch.zeros(4, 1, 8, 32, device=device)], [i % 4], **kw)
    clear_engine_cache()
    torch.cuda.empty_cache()
    ids.copy_(torch.tensor([1, 2**32 + 1, 1, 99], device=device))  # repeat, past int32, past the caches
    graph.replay()
    torch.cuda.synchronize()
    ref = torch.zeros(16, 2, 8, 32, dtype=torch.bfloat16)
    fill_blocks([ref], [1], **kw, backend="torch")
    if not torch.equal(cache.cpu().view(torch.int16), ref.view(torch.int16)):
        failed.append("replayed bytes differ from the host path")
    del graph
    release_captured_fills()
    for name in failed:
        log(f"CUDA graph: {name}")
    return failed


def check_device_guard(device, log):
    """With a second GPU current, a fill of caches on the first still lands
    there, ordered after its plan upload.  None with fewer than two GPUs."""
    if torch.device(device).type != "cuda" or torch.cuda.device_count() < 2:
        return None
    cache = torch.zeros(8, 2, 8, 32, dtype=torch.bfloat16, device="cuda:0")
    eng = FillEngine({"g": CacheGroup({"l": cache})}, mean=0.0, std=1.0, seed=3)
    plan = {"g": GroupFill(block_ids=[2, 5])}
    with torch.cuda.device(1):
        eng.fill(plan)
    torch.cuda.synchronize(0)
    ok = eng.verify(plan).ok
    if not ok:
        log("device guard: a fill issued with cuda:1 current missed cuda:0's caches")
    return ok


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--out", default=os.environ.get("OUT", "."), help="folder for gpu_check.json")
    p.add_argument("--sizes", type=int, nargs="+", default=[64, 256, 1024], help="fill sizes (MiB)")
    p.add_argument("--smoke", action="store_true", help="tiny sizes: a dry run of the script itself")
    a = p.parse_args(argv)
    t0 = time.time()
    log = lambda msg: print(f"[{time.time() - t0:6.1f}s] {msg}", flush=True)  # noqa: E731
    device = a.device
    log(f"machine: {C.machine_info(device)}")

    rows, failures = correctness(device, log)
    log(f"correctness: {len(rows)} layout x dtype x mode cases, {failures} with mismatched bytes")
    graph_failed = check_graph_capture(device, log)
    graph_ok = None if graph_failed is None else not graph_failed
    log(f"CUDA graph capture of fill_blocks: {'n/a' if graph_ok is None else graph_ok}")
    guard_ok = check_device_guard(device, log)
    log(f"device guard (fill with another GPU current): {'n/a (one GPU)' if guard_ok is None else guard_ok}")

    sizes = [1] if a.smoke else a.sizes
    layers = 2 if a.smoke else 32
    repeat = 1 if a.smoke else 7
    perf = []
    for mib in sizes:
        for mode in ("constant", "normal", "replay"):
            perf += fill_bench.run_case(device, fill_bytes=mib * MiB, num_layers=layers, num_requests=16,
                                        mode=mode, repeat=repeat)
            log(f"timed {mib} MiB {mode}")
    # Launch-bound step: 256 requests x 80 layers, one small block each.
    n_req, n_layers = (4, 3) if a.smoke else (256, 80)
    for mode in ("constant", "normal"):
        perf += fill_bench.run_case(
            device, fill_bytes=0, num_layers=n_layers, num_requests=n_req, mode=mode, repeat=repeat,
            heads=1, content=128, label=f"launch-bound R{n_req} L{n_layers}",
        )
    log("timed launch-bound step")
    # Replay's goal: >= 90% of the synthetic (normal) fill's bandwidth, size by size.
    kv = {(r["case"], r["mode"]): r for r in perf if r["impl"] == "kvfill"}
    replay_ratio = {case: round(kv[(case, "normal")]["ms"] / r["ms"], 3) if r["ms"] else None
                    for (case, mode), r in kv.items() if mode == "replay" and (case, "normal") in kv}
    log(f"replay / normal bandwidth (goal >= 0.9): {replay_ratio}")
    unverified = [r for r in perf if r["impl"] == "kvfill" and r["verified"] is not True]
    for r in unverified:
        log(f"UNVERIFIED perf row: {r['case']} {r['mode']}")

    os.makedirs(a.out, exist_ok=True)
    path = os.path.join(a.out, "gpu_check.json")
    C.write_json(path, {
        "machine": C.machine_info(device),
        "command": "python bench/gpu_check.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "correctness": {"cases": len(rows), "failures": failures, "graph_capture": graph_ok,
                        "graph_capture_failed": graph_failed, "device_guard": guard_ok,
                        "unverified_perf_rows": len(unverified), "rows": rows},
        "perf": perf,
        "replay_over_normal_bandwidth": replay_ratio,
    })
    log(f"wrote {path}")
    print(f"\ncorrectness: {len(rows) - failures}/{len(rows)} cases byte-exact"
          f"{'' if graph_ok is None else f'; CUDA graph capture ok: {graph_ok}'}"
          f"{'' if guard_ok is None else f'; device guard ok: {guard_ok}'}"
          f"; perf rows verified: {sum(r['impl'] == 'kvfill' for r in perf) - len(unverified)}/"
          f"{sum(r['impl'] == 'kvfill' for r in perf)}")
    print(C.table(perf, fill_bench.COLUMNS))
    # Every failed check counts: a fast row whose bytes are wrong is a failure, not a figure.
    return failures + (graph_ok is False) + (guard_ok is False) + len(unverified)


if __name__ == "__main__":
    sys.exit(1 if main() else 0)

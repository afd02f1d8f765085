"""The GPU check's bandwidth figures (gpu/gpu_check.py), shaped by issue 59's
anchors: the normal (in-kernel random) fill's bytes written per second as a
fraction of a memset of as many bytes, timed in the same run, and of the
GPU's datasheet peak (``PEAKS``); best and median of ``repeat`` calls; at
sizes above the GPU's L2 (bandwidth) and below it, where a fill rereads as
more than 100 % of peak and is reported as a latency (us per fill); a fill
beside a forward-sized matmul on another CUDA stream; and the goal line
(``GOAL``: on an H200, >= 87 % of peak, SGLang's KV scatter-with-cast).

On CUDA each call is timed on the device (CUDA events), queued behind a spin
kernel so that the host's launch work is hidden and the figure is the
device's; without a GPU (the CPU, the device stand-in) it is the host's wall
time, the L2 an assumed size (``ASSUMED_L2``), the pair run one after the
other (labelled not overlapped) and the goal not measurable.
Torch + triton + kvfill only.
"""
from __future__ import annotations

import re
import statistics
import time

import torch

from kvfill.bench import common as C
from kvfill.bench import fill_bench
from kvfill.kernels import CacheGroup, FillEngine

KiB, MiB = 1 << 10, 1 << 20
# Datasheet HBM bandwidth in TB/s (10^12 bytes/s) by torch.cuda.get_device_name(), lowercased; first match wins.
PEAKS = (
    # NVIDIA H200 datasheet: 4.8 TB/s HBM3e (H200 SXM and H200 NVL alike).
    (H200 := r"\bh200\b", 4.8),
    # NVIDIA H100 datasheet: H100 PCIe 2.0 TB/s, H100 SXM ("NVIDIA H100 80GB HBM3") 3.35 TB/s. H100 NVL: no entry.
    (r"\bh100\b.*\bpcie\b", 2.0),
    (r"\bh100\b.*(\bsxm|80gb hbm3)", 3.35),
    # B200: 7.67 TB/s, issue 59's "real peak" (NVIDIA's launch figure is 8 TB/s). GB200 does not match (\b).
    (r"\bb200\b", 7.67),
    # NVIDIA H20 product brief (96 GB HBM3): 4.0 TB/s; issue 59's plain-copy anchor, 92.8 % of it.
    (r"\bh20\b", 4.0),
    # NVIDIA A100 datasheet: A100 80GB PCIe 1,935 GB/s, A100 80GB SXM 2,039 GB/s.
    (r"\ba100\b.*80gb.*pcie", 1.935),
    (r"\ba100\b.*80gb", 2.039),
)
GOAL = 0.87  # SGLang's KV scatter-with-cast on an H200: ~4.2 of 4.8 TB/s (issue 59)
GOAL_TEXT = (f"goal: on an H200, the fill >= {GOAL:.0%} of the datasheet peak "
             "(SGLang's KV scatter-with-cast: ~4.2 of 4.8 TB/s)")
# Without a GPU the L2 is assumed: 50 MiB (an H100's or H200's), 512 KiB under --smoke (toy sizes either side).
ASSUMED_L2, SMOKE_L2 = 50 * MiB, 512 * KiB
# Fill sizes as multiples of the L2: one below it (a latency), two above it (the goal reads the largest).
SIZES, SMOKE_SIZES, MAX_FILL = (0.25, 4, 16), (0.5, 4), 2 << 30
# The forward beside the fill: the gate and up projections of one Llama-3.1-8B decoder layer at 256 decode
# tokens, [256, 4096] x [4096, 2 x 14336] bf16 (235 MB of weights read from HBM, as a decode step's forward).
FORWARD, SMOKE_FORWARD = (256, 4096, 2 * 14336), (4, 64, 128)
SPIN_CYCLES = 2_000_000  # ~1 ms of torch.cuda._sleep ahead of each timed call: the host's launch work hidden


def peak_tbps(gpu: str | None) -> float | None:
    """The datasheet peak of the GPU named ``gpu`` (None: not in ``PEAKS``)."""
    name = (gpu or "").lower()
    return next((peak for pattern, peak in PEAKS if re.search(pattern, name)), None)


def context(device, smoke: bool) -> dict:
    """What the figures are measured against: the GPU, its peak and L2, how calls are timed."""
    dev = torch.device(device)
    if dev.type == "cuda":
        gpu = torch.cuda.get_device_name(dev)
        l2 = getattr(torch.cuda.get_device_properties(dev), "L2_cache_size", 0)
        return {"gpu": gpu, "peak_TBps": peak_tbps(gpu), "l2_bytes": l2 or ASSUMED_L2,
                "l2_source": "device properties" if l2 else "assumed: the device reports none",
                "timing": "device time: CUDA events, each call queued behind a spin kernel"}
    l2 = SMOKE_L2 if smoke else ASSUMED_L2
    return {"gpu": None, "peak_TBps": None, "l2_bytes": l2,
            "l2_source": f"assumed: no GPU{', --smoke sizes' if smoke else ''}",
            "timing": "host wall time (no GPU)"}


def device_times(fn, device, repeat: int, warmup: int = 2) -> list[float]:
    """Seconds of each of ``repeat`` calls of ``fn`` (module docstring: device time on CUDA)."""
    cuda = torch.device(device).type == "cuda"
    for _ in range(warmup):
        fn()
    if cuda:
        torch.cuda.synchronize(device)
    times = []
    for _ in range(repeat):
        if cuda:
            torch.cuda._sleep(SPIN_CYCLES)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return times


def _best_median(times) -> tuple[float, float]:
    return min(times), statistics.median(times)


def _normal_fill(device, fill_bytes, layers):
    """fill_bench's caches (bf16 LBNHC, 16 requests' scattered blocks) and a normal-fill engine over them."""
    views, _, plan, nbytes = fill_bench.build(device, fill_bytes=fill_bytes, num_layers=layers, num_requests=16)
    engine = FillEngine({"g": CacheGroup({f"layer.{i}": v for i, v in enumerate(views)})}, mean=0.0, std=1.0)
    return engine, plan, nbytes


def fill_rows(device, ctx: dict, layers: int, repeat: int, smoke: bool) -> list[dict]:
    """A row per size of ``SIZES`` x the L2: the fill's and a memset's best and
    median time; above the L2, GB/s and the fractions of the memset and the
    peak (None: no peak); below it, a latency (GB/s and % of peak None)."""
    rows, peak, l2 = [], ctx["peak_TBps"], ctx["l2_bytes"]
    for factor in SMOKE_SIZES if smoke else SIZES:
        engine, plan, nbytes = _normal_fill(device, min(int(factor * l2), MAX_FILL), layers)
        fill = _best_median(device_times(lambda: engine.fill(plan), device, repeat))
        scratch = torch.empty(nbytes, dtype=torch.uint8, device=device)
        memset = _best_median(device_times(scratch.zero_, device, repeat))
        del scratch
        above = nbytes > l2
        gbs = [nbytes / t / 1e9 if above else None for t in fill]
        rows.append({
            "case": f"{nbytes / MiB:g} MiB, {layers} layers", "size": "above L2" if above else "below L2: latency",
            "MiB": round(nbytes / MiB, 2), "best us": round(fill[0] * 1e6, 1), "median us": round(fill[1] * 1e6, 1),
            "memset best us": round(memset[0] * 1e6, 1), "memset median us": round(memset[1] * 1e6, 1),
            "best GB/s": _round(gbs[0], 1), "median GB/s": _round(gbs[1], 1),
            "%memset best": round(100 * memset[0] / fill[0], 1), "%memset median": round(100 * memset[1] / fill[1], 1),
            "%peak best": _round(gbs[0] and peak and gbs[0] / peak / 10, 1),
            "%peak median": _round(gbs[1] and peak and gbs[1] / peak / 10, 1),
            "verified": engine.verify(plan).ok,
        })
        del engine, plan
    return rows


def overlap(device, ctx: dict, layers: int, repeat: int, smoke: bool) -> dict:
    """A fill of 4 x the L2 and ``FORWARD``'s matmul, each alone and as a pair,
    the matmul on another CUDA stream (without CUDA: one after the other,
    ``overlapped`` False): best and median us of each, what the fill adds to
    the forward's time, and the share of the fill's time the pair hides."""
    dev = torch.device(device)
    cuda = dev.type == "cuda"
    engine, plan, nbytes = _normal_fill(device, min(4 * ctx["l2_bytes"], MAX_FILL), layers)
    tokens, hidden, out = FORWARD if cuda and not smoke else SMOKE_FORWARD
    x = torch.randn(tokens, hidden, dtype=torch.bfloat16, device=device)
    w = torch.randn(hidden, out, dtype=torch.bfloat16, device=device)

    def fill():
        engine.fill(plan)

    def forward():
        torch.matmul(x, w)

    if cuda:
        side = torch.cuda.Stream(device=dev)

        def pair():
            main = torch.cuda.current_stream(dev)
            side.wait_stream(main)
            with torch.cuda.stream(side):
                forward()
            fill()
            main.wait_stream(side)
    else:
        def pair():
            fill()
            forward()

    t = {name: _best_median(device_times(fn, device, repeat)) for name, fn in
         (("fill", fill), ("forward", forward), ("pair", pair))}
    us = {name: {"best": round(b * 1e6, 1), "median": round(m * 1e6, 1)} for name, (b, m) in t.items()}
    hidden_share = (t["fill"][1] + t["forward"][1] - t["pair"][1]) / t["fill"][1] if cuda else None
    return {"overlapped": cuda,
            "how": "forward on a second CUDA stream" if cuda else "sequential (no CUDA streams): not overlapped",
            "fill MiB": round(nbytes / MiB, 2), "forward": f"[{tokens}, {hidden}] x [{hidden}, {out}] bf16 matmul",
            "us": us, "fill adds us (median)": round((t["pair"][1] - t["forward"][1]) * 1e6, 1),
            "fill hidden (median)": _round(hidden_share, 3), "verified": engine.verify(plan).ok}


def goal(bw: dict) -> dict:
    """The goal's status (met, not met, not measurable) and its line, from the
    largest fill above the L2 (its median)."""
    gpu, peak = bw.get("gpu"), bw.get("peak_TBps")
    above = [r for r in bw.get("rows") or [] if r["%peak median"] is not None]
    if gpu is None:
        status, detail = "not measurable", "no GPU"
    elif bw.get("skipped_for_budget"):
        status, detail = "not measurable", "skipped for the budget"
    elif peak is None:
        status, detail = "not measurable", f"no datasheet peak for {gpu}"
    elif not above:
        status, detail = "not measurable", "no fill above the L2 ran"
    else:
        r = max(above, key=lambda r: r["MiB"])
        status = "met" if r["%peak median"] >= 100 * GOAL else "not met"
        detail = (f"{r['%peak median']} % median, {r['%peak best']} % best of {peak} TB/s "
                  f"({r['median GB/s']} GB/s, {r['MiB']} MiB) on {gpu}")
        if not re.search(H200, gpu.lower()):
            detail += " (the goal is set on an H200)"
        if r["verified"] is not True:
            status, detail = "not measurable", f"the fill's bytes did not verify; {detail}"
    return {"target": GOAL, "status": status, "detail": detail, "line": f"{GOAL_TEXT}: {status} ({detail})"}


COLUMNS = ["case", "size", "best us", "median us", "memset median us", "best GB/s", "median GB/s",
           "%memset best", "%memset median", "%peak best", "%peak median", "verified"]


def summary(bw: dict) -> list[str]:
    """The summary's lines: what was measured against, a table, the pair, the goal."""
    peak = f"{bw['peak_TBps']} TB/s" if bw.get("peak_TBps") else "none (no datasheet peak for this device)"
    lines = [f"bandwidth, the normal fill beside a memset ({bw['timing']}): GPU {bw.get('gpu') or 'none'}, "
             f"datasheet peak {peak}, L2 {bw['l2_bytes'] / MiB:g} MiB ({bw['l2_source']})"]
    if bw.get("skipped_for_budget"):
        lines.append("  skipped for the budget")
    if bw.get("rows"):
        why = "latency" if bw.get("peak_TBps") else "no peak"
        shown = [{k: ("latency" if v is None and "GB/s" in k else why if v is None else v) for k, v in r.items()}
                 for r in bw["rows"]]
        lines.append(C.table(shown, COLUMNS))
    o = bw.get("overlap")
    if o:
        lines.append(f"fill beside a forward ({o['how']}): fill {o['fill MiB']} MiB {o['us']['fill']['median']} us, "
                     f"forward ({o['forward']}) {o['us']['forward']['median']} us, pair {o['us']['pair']['median']} us "
                     f"(medians); the fill adds {o['fill adds us (median)']} us"
                     + (f", {o['fill hidden (median)']:.0%} of it hidden" if o["overlapped"] else "")
                     + f"; verified {o['verified']}")
    lines.append(bw["goal"]["line"])
    return lines


def _round(x, digits):
    return None if x is None else round(x, digits)

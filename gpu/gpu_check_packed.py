"""The GPU check's packed-row sections (gpu/gpu_check.py): DeepSeek's
indexer K pages, ``fp8_ds_mla`` and ``nvfp4_ds_mla`` rows (``kvfill/kernels/packed_rows.py``)
filled by the Triton kernels on the device, compared byte for byte with the
torch backend's fill of a host copy of the same poisoned buffer.  Torch +
triton + kvfill only.

* ``check_packed_rows``: each kind in each mode - synthetic keys with their
  power-of-two scales (``normal``), replayed bytes (``replay``), and the zeros
  ``zero_packed`` asks for (``zero``) - in each buffer arrangement: one
  layer; several layers per launch class, layer after layer in one buffer,
  or block-major (``cross-layer``: a block holds every layer's page, as
  vLLM's cross-layer KV blocks do); and DCP 2, each rank's engine filling
  its own slots from a whole bank.  Every fill: a partial block, a fill from
  the middle of a block, 128-token blocks in 64-token kernel blocks, pages
  padded apart.
* ``check_packed_capture``: one engine of the three kinds' classes, several
  layers each: ``warmup()`` launches every class and writes nothing, then a
  replay plan on the device (``fill_device_entries``) - captured in a CUDA
  graph and replayed with new entries on CUDA, called directly elsewhere.
* ``time_packed``: rows for gpu_check's table - each kind's whole-cache fill
  (synthetic and replay) beside a memset of the bytes it writes.
"""
from __future__ import annotations

import torch

from kvfill.bench import common as C
from kvfill.kernels import Bank, CacheGroup, DcpGeometry, FillEngine, GroupFill
from kvfill.kernels import values as V
from kvfill.kernels.packed_rows import (
    DS_MLA_ROW, NVFP4_DS_MLA_ROW, ds_mla_parts, ds_mla_values, indexer_parts, indexer_values, nvfp4_ds_mla_parts,
    nvfp4_ds_mla_values,
)

KINDS = {  # kind -> (bytes per token, its views, its synthetic encodings)
    "indexer": (132, indexer_parts, indexer_values),
    "fp8_ds_mla": (DS_MLA_ROW, ds_mla_parts, ds_mla_values),
    "nvfp4_ds_mla": (NVFP4_DS_MLA_ROW, nvfp4_ds_mla_parts, nvfp4_ds_mla_values),
}
MODES = ("normal", "replay", "zero")

P, BLOCK, NUM_BLOCKS, PAD, N = 64, 128, 4, 40, 150
# (block, slot_start, slot_end, local_base): positions [0, 128) and [138, 150) - a gap, a partial block
ENTRIES = GroupFill([3, 1], [0, 10], [128, 22], [0, 128])
# Buffer arrangements: (name, layers, cross-layer, DCP geometry or None, modes compared)
ARRANGEMENTS = (
    ("1 layer", 1, False, None, MODES),
    ("3 layers", 3, False, None, ("normal", "replay")),
    ("3 layers cross-layer", 3, True, None, MODES),
    ("DCP 2 rank 0", 2, False, DcpGeometry(2, 0, 1), ("normal", "replay")),
    ("DCP 2 rank 1 interleave 16", 2, False, DcpGeometry(2, 1, 16), ("normal", "replay")),
)


def _caches(width: int, layers: int, cross: bool, device, num_blocks: int = NUM_BLOCKS,
            seed: int = 0) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """A poisoned byte buffer and each layer's vLLM view ``[kernel blocks, 1,
    P, width]`` into it: layer-major (a layer's pages one after another), or
    ``cross`` (block-major: a kernel block holds every layer's page)."""
    page = P * width + PAD
    kernel_blocks = num_blocks * 2
    g = torch.Generator(device="cpu").manual_seed(width * 7 + layers + seed)
    buf = torch.randint(0, 256, (kernel_blocks * layers * page,), dtype=torch.uint8, generator=g, device="cpu")
    buf = buf.to(device)
    block_stride, layer_stride = (layers * page, page) if cross else (page, kernel_blocks * page)
    views = [buf.as_strided((kernel_blocks, 1, P, width), (block_stride, block_stride, width, 1), i * layer_stride)
             for i in range(layers)]
    return buf, views


def _bank(width: int, layers: int, seed: int = 5) -> Bank:
    g = torch.Generator(device="cpu").manual_seed(seed)
    return Bank({f"l{i}": torch.randint(0, 256, (N, width), dtype=torch.uint8, generator=g, device="cpu")
                 for i in range(layers)}, sequence_lengths=[N])


def _engine(kind: str, mode: str, views, backend: str, dcp=None, num_blocks: int = NUM_BLOCKS) -> FillEngine:
    width, parts_of, encodings = KINDS[kind]
    spec = V.ValueSpec(mean=0.0, std=0.1, seed=3)
    enc = V.ENC_PACKED if mode == "zero" else encodings(spec)  # zero_packed: the connector's encoding
    kw = {"dcp": dcp} if dcp is not None else {}
    group = CacheGroup({f"l{i}": parts_of(v) for i, v in enumerate(views)}, num_blocks=num_blocks,
                       encoding={f"l{i}": enc for i in range(len(views))}, **kw)
    bank = _bank(width, len(views)) if mode == "replay" else None
    return FillEngine({"g": group}, values=spec, bank=bank, backend=backend)


def _fill(kind: str, mode: str, device, backend: str, layers: int = 1, cross: bool = False, dcp=None) -> torch.Tensor:
    """The whole buffer (host bytes) after one fill of ENTRIES on ``device`` by ``backend``."""
    buf, views = _caches(KINDS[kind][0], layers, cross, device)
    eng = _engine(kind, mode, views, backend, dcp)
    eng.fill({"g": ENTRIES})
    if not eng.verify({"g": ENTRIES}).ok:
        raise AssertionError(f"{kind} {mode} on {device} ({backend}): verify found other bytes than planned")
    return buf.cpu()


def check_packed_rows(device, log) -> list[str]:
    """One line per (kind, arrangement, mode) whose device bytes differ from
    the torch backend's (empty: byte-exact).  Zeros in the one-layer and the
    cross-layer arrangement only: what they write does not depend on more."""
    failed = []
    for kind in KINDS:
        for name, layers, cross, dcp, modes in ARRANGEMENTS:
            for mode in modes:
                got = _fill(kind, mode, torch.device(device), "triton", layers, cross, dcp)
                want = _fill(kind, mode, torch.device("cpu"), "torch", layers, cross, dcp)
                bad = int((got != want).sum())
                if bad or name == ARRANGEMENTS[0][0]:
                    log(f"packed rows {kind} {name} {mode}: {bad} bytes differ from the torch backend")
                if bad:
                    failed.append(f"packed rows {kind} {name} {mode}: {bad} bytes differ")
        log(f"packed rows {kind}: {sum(len(a[-1]) for a in ARRANGEMENTS)} arrangement x mode fills compared")
    return failed


def check_packed_capture(device, log) -> list[str]:
    """An engine of the three kinds (a group and launch class each, two
    layers each) replaying a plan given on the device: ``warmup()`` launches
    every class and leaves every byte as it was; on CUDA the fills are
    captured in one graph, the entries changed and the graph replayed.  The
    buffers must equal the torch backend's host fill of the new plan.
    Returns the failed checks' names."""
    device = torch.device(device)
    cuda = device.type == "cuda"
    failed = []
    first = [[3, 0, 128, 0, 0], [1, 10, 22, 128, 0]]
    new = [[2, 5, 128, 0, 0], [0, 0, 64, 128, 0], [3, 0, 10, 300, 0]]  # positions past N wrap
    bufs, groups, host_bufs, host_groups, banks = {}, {}, {}, {}, {}
    spec = V.ValueSpec(mean=0.0, std=0.1, seed=3)
    for kind, (width, parts_of, _) in KINDS.items():
        for side, where, store, gs in (("dev", device, bufs, groups), ("host", torch.device("cpu"), host_bufs,
                                                                        host_groups)):
            buf, views = _caches(width, 2, False, where)
            store[kind] = buf
            gs[kind] = CacheGroup({f"{kind}.{i}": parts_of(v) for i, v in enumerate(views)}, num_blocks=NUM_BLOCKS)
        banks.update({f"{kind}.{i}": r for i, r in enumerate(_bank(width, 2).layers.values())})
    bank = Bank(banks, sequence_lengths=[N])
    eng = FillEngine(groups, values=spec, bank=bank, backend="triton")
    before = {k: b.cpu() for k, b in bufs.items()}
    launches = eng.warmup()
    C.sync(device)
    if launches < len(KINDS):
        failed.append(f"warmup launched {launches} times for {len(KINDS)} packed classes")
    failed += [f"warmup wrote {int((b.cpu() != before[k]).sum())} bytes of {k}" for k, b in bufs.items()
               if not torch.equal(b.cpu(), before[k])]
    entries = {k: torch.tensor(first + [[0, 0, 0, 0, 0]], dtype=torch.int32, device=device) for k in KINDS}
    if cuda:
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for kind in KINDS:
                eng.fill_device_entries(kind, entries[kind])
        for kind in KINDS:
            entries[kind].copy_(torch.tensor(new, dtype=torch.int32, device=device))
        graph.replay()
        torch.cuda.synchronize()
        del graph
        from kvfill.kernels import release_captured_fills

        release_captured_fills()
    else:
        for kind in KINDS:
            entries[kind].copy_(torch.tensor(new, dtype=torch.int32))
            eng.fill_device_entries(kind, entries[kind])
    FillEngine(host_groups, values=spec, bank=bank, backend="torch").fill(
        {k: GroupFill(*zip(*[e[:4] for e in new]), sequence=[e[4] for e in new]) for k in KINDS})
    for kind in KINDS:
        bad = int((bufs[kind].cpu() != host_bufs[kind]).sum())
        if bad:
            failed.append(f"{kind}: {bad} bytes differ from the host replay fill of the new entries")
    log(f"packed classes: warmup {launches} launches, {'captured and replayed' if cuda else 'device entries'}: "
        f"{'ok' if not failed else '; '.join(failed)}")
    return failed


def time_packed(device, *, num_blocks: int, layers: int, repeat: int) -> list[dict]:
    """gpu_check's table rows: each kind's fill of every token of ``layers``
    layers' caches (``num_blocks`` manager blocks), synthetic and replayed,
    and a memset of as many bytes (the tokens' rows; pages' padding apart)."""
    rows = []
    for kind, (width, _, _) in KINDS.items():
        _, views = _caches(width, layers, False, device, num_blocks)
        written = num_blocks * BLOCK * width * layers
        scratch = torch.empty(written, dtype=torch.uint8, device=device)
        t_memset = C.median_time(lambda: scratch.zero_(), device, repeat=repeat)
        del scratch
        for mode in ("normal", "replay"):
            eng = _engine(kind, mode, views, "auto", num_blocks=num_blocks)  # Triton on a GPU, as the other rows
            plan = eng.whole_plan()
            stats = eng.fill(plan)
            ok = eng.verify(plan).ok
            t = C.median_time(lambda: eng.fill(plan), device, repeat=repeat)
            name = f"packed {kind} L{layers} B{num_blocks}"
            rows += C.rows_beside_memset(name, mode, written, t, stats.launches, t_memset, ok)
    return rows

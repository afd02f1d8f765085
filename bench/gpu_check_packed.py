"""The GPU check's packed-row section (bench/gpu_check.py): DeepSeek's
indexer K pages, ``fp8_ds_mla`` and ``nvfp4_ds_mla`` rows (``kvfill/kernels/packed_rows.py``)
filled by the Triton kernels on the device - synthetic keys with their
power-of-two scales, and replayed bytes - compared byte for byte with the
torch backend's fill of a host copy of the same poisoned buffer: a partial
block, a fill from the middle of a block, 128-token blocks in 64-token
kernel blocks, padded pages.  Torch + triton + kvfill only.
"""
from __future__ import annotations

import torch

from kvfill.kernels import Bank, CacheGroup, FillEngine, GroupFill
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

P, BLOCK, NUM_BLOCKS, PAD, N = 64, 128, 4, 40, 150
# (block, slot_start, slot_end, local_base): positions [0, 128) and [138, 150) - a gap, a partial block
ENTRIES = GroupFill([3, 1], [0, 10], [128, 22], [0, 128])


def _cache(width: int, device) -> torch.Tensor:
    stride = P * width + PAD
    g = torch.Generator(device="cpu").manual_seed(width)
    buf = torch.randint(0, 256, (NUM_BLOCKS * 2 * stride,), dtype=torch.uint8, generator=g, device="cpu")
    return buf.to(device).as_strided((NUM_BLOCKS * 2, 1, P, width), (stride, stride, width, 1))


def _fill(kind: str, mode: str, device, backend: str) -> torch.Tensor:
    """The whole buffer after one fill of ENTRIES on ``device`` by ``backend``."""
    width, views, encodings = KINDS[kind]
    cache = _cache(width, device)
    parts = views(cache)
    spec = V.ValueSpec(mean=0.0, std=0.1, seed=3)
    bank = None
    if mode == "replay":
        g = torch.Generator(device="cpu").manual_seed(5)
        bank = Bank({"l": torch.randint(0, 256, (N, width), dtype=torch.uint8, generator=g, device="cpu")},
                    sequence_lengths=[N])
    enc = encodings(spec)
    eng = FillEngine({"g": CacheGroup({"l": parts}, num_blocks=NUM_BLOCKS, encoding={"l": enc})}, values=spec,
                     bank=bank, backend=backend)
    eng.fill({"g": ENTRIES})
    if not eng.verify({"g": ENTRIES}).ok:
        raise AssertionError(f"{kind} {mode} on {device} ({backend}): verify found other bytes than planned")
    return cache.as_strided((cache.shape[0] * cache.stride(0),), (1,), cache.storage_offset()).cpu()


def check_packed_rows(device, log) -> list[str]:
    """One line per (kind, mode) whose device bytes differ from the torch backend's (empty: byte-exact)."""
    failed = []
    for kind in KINDS:
        for mode in ("normal", "replay"):
            got = _fill(kind, mode, torch.device(device), "triton")
            want = _fill(kind, mode, torch.device("cpu"), "torch")
            bad = int((got != want).sum())
            log(f"packed rows {kind} {mode}: {bad} bytes differ from the torch backend")
            if bad:
                failed.append(f"packed rows {kind} {mode}: {bad} bytes differ")
    return failed

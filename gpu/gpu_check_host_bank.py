"""The GPU check's host-bank section (gpu/gpu_check.py): a bank kept in
host memory (``bank_placement="host"``, ``kvfill/kernels/staging.py``), each
fill's rows staged on the device through pinned host buffers, against the
same bank resident on the device - several layers, a ragged bank whose
entries wrap, partial blocks, a staging small enough that one fill goes in
many chunks through both pinned buffers, and a second fill right after the
first (the pinned buffers reused once their copies are done) - compared
byte for byte, plain and with keys re-rotated past each sequence's end
(``past_bank="rotate"``); and ``time_host_bank``, a replay fill of whole
blocks from the device-resident bank, from the host-kept one, with keys
re-rotated, and a memset of the bytes they write, for gpu_check's table.
Torch + triton + kvfill only.
"""
from __future__ import annotations

import numpy as np
import torch

from kvfill.bench import common as C
from kvfill.kernels import Bank, CacheGroup, FillEngine, GroupFill
from kvfill.kernels.host_copy import is_host
from kvfill.kernels.rotary import Rotary

HEADS, SLOTS, DIM = 8, 16, 128
LENGTHS = [700, 300, 513]  # a ragged bank: entries past each length wrap


def _bank(layers: int, lengths, seed: int = 0) -> Bank:
    g = torch.Generator(device="cpu").manual_seed(seed)
    return Bank({f"layer.{i}": torch.randn(sum(lengths), HEADS * DIM, generator=g, device="cpu").to(torch.bfloat16)
                 for i in range(layers)}, sequence_lengths=lengths)


def _caches(layers: int, num_blocks: int, device) -> dict[str, torch.Tensor]:
    """``[B, H, N, C]`` bf16 caches holding a fixed pattern of bits (what the fill must leave alone)."""
    g = torch.Generator(device="cpu").manual_seed(7)
    bits = torch.randint(-2**15, 2**15, (layers, num_blocks, HEADS, SLOTS, DIM), dtype=torch.int16, generator=g,
                         device="cpu")
    return {f"layer.{i}": bits[i].to(device).view(torch.bfloat16) for i in range(layers)}


def _plan(num_blocks: int, seed: int) -> dict[str, GroupFill]:
    """A step of several requests: partial first and last blocks, every
    sequence, positions past each sequence's length (wrap)."""
    rng = np.random.default_rng(seed)
    blocks = rng.permutation(num_blocks)[: num_blocks - 4]
    n = blocks.size
    start = np.where(rng.random(n) < 0.3, rng.integers(0, SLOTS, n), 0)
    end = np.where(rng.random(n) < 0.3, rng.integers(1, SLOTS + 1, n), SLOTS)
    end = np.maximum(end, start)
    base = (rng.integers(0, 1200, n) // SLOTS) * SLOTS
    return {"g": GroupFill(blocks, start, end, base, rng.integers(0, len(LENGTHS), n))}


def _rotary(layers: int, positions: int) -> dict[str, Rotary]:
    """Each layer's keys re-rotated past a sequence's end (``past_bank="rotate"``): a default RoPE table."""
    inv = 1.0 / 10000.0 ** (np.arange(0, DIM, 2) / DIM)
    ang = np.arange(positions)[:, None] * inv[None, :]
    table = torch.from_numpy(np.concatenate([np.cos(ang), np.sin(ang)], axis=1)).float()
    return {f"layer.{i}": Rotary(table, HEADS, DIM, DIM, True) for i in range(layers)}


def check_host_bank(device, log) -> list[str]:
    """Returns the failed checks' names (empty: every byte as the device-resident bank writes; keys
    re-rotated past each sequence's end the same from either placement)."""
    layers, num_blocks = 4, 64
    bank = _bank(layers, LENGTHS)
    failed, out = [], {}
    turn = dict(past_bank="rotate", rotary=_rotary(layers, 1200 + SLOTS))
    for placement, kw in (("device", {}), ("host", {"bank_placement": "host", "staging_bytes": 64 << 10}),
                          ("device rotate", turn), ("host rotate", {"bank_placement": "host",
                                                                    "staging_bytes": 64 << 10, **turn})):
        caches = _caches(layers, num_blocks, device)
        eng = FillEngine({"g": CacheGroup(caches)}, bank=bank, **kw)
        eng.warmup()
        for seed in (1, 2):  # the second step reuses the staging and the pinned buffers
            plan = _plan(num_blocks, seed)
            eng.fill(plan)
            if not eng.verify(plan).ok:
                failed.append(f"{placement}: verify found mismatches after step {seed}")
        out[placement] = torch.stack([c.view(torch.int16) for c in caches.values()]).cpu()
        if placement.startswith("host"):
            line = eng.describe().splitlines()[-1]
            if eng.bank_placement != "host" or ("pinned host" in line) == is_host(device):  # pinned on a device
                failed.append(f"the engine says {eng.bank_placement!r}: {line}")
    for a, b in (("host", "device"), ("host rotate", "device rotate")):
        bad = int((out[a] != out[b]).sum())
        if bad:
            failed.append(f"{bad} elements of the {a} bank's fill differ from the {b} bank's")
    if torch.equal(out["device"], out["device rotate"]):
        failed.append("past_bank 'rotate' wrote what wrap writes: no key was turned")
    log(f"host-kept bank: {layers} layers, 2 steps in chunks of 64 KiB of staging vs the device-resident bank, "
        f"wrapped and re-rotated: {'ok' if not failed else '; '.join(failed)}")
    return failed


def time_host_bank(device, *, layers: int, blocks: int, repeat: int) -> list[dict]:
    """gpu_check's table rows: a replay fill of ``blocks`` whole blocks of
    ``layers`` layers from the device-resident bank, from the host-kept one
    (its default staging) and from the device-resident bank with the keys of
    the positions past its sequences' end (3/4 of them) re-rotated, beside
    a memset of the bytes they write."""
    bank = _bank(layers, [max(blocks * SLOTS // 4, 1)] * 2, seed=3)
    plan = {"g": GroupFill(np.arange(blocks), local_base=np.arange(blocks) * SLOTS, sequence=np.arange(blocks) % 2)}
    written = layers * blocks * SLOTS * HEADS * DIM * 2
    scratch = torch.empty(written, dtype=torch.uint8, device=device)
    t_memset = C.median_time(lambda: scratch.zero_(), device, repeat=repeat)
    del scratch
    rows = []
    for label, kw in (("device", {}), ("host", {"bank_placement": "host"}),
                      ("device, rotated", dict(past_bank="rotate", rotary=_rotary(layers, blocks * SLOTS)))):
        eng = FillEngine({"g": CacheGroup(_caches(layers, blocks, device))}, bank=bank, **kw)
        eng.warmup()
        stats = eng.fill(plan)
        ok = eng.verify(plan).ok
        t = C.median_time(lambda: eng.fill(plan), device, repeat=repeat)
        name = f"bank on {label} L{layers} B{blocks}"
        rows += C.rows_beside_memset(name, "replay", written, t, stats.launches, t_memset, ok)
    return rows

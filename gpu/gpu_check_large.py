"""The GPU check's large-offset section (gpu/gpu_check.py): a fill whose
addresses do not fit 32 bits, as on a GPU where vLLM puts the whole KV cache
(~125 GB on an H200) in one buffer and a long recording makes a bank of
billions of elements.

Two layers of MLA-like rows ``[blocks, N, R]`` (fp8 e4m3 stored as bytes)
in one buffer, the second starting ``LAYER_STRIDE`` = 2^32 + 4 KiB bytes
after the first (one launch class: the layers share a geometry); a bank
whose second sequence starts past 2^31 elements of each layer's rows.  The
Triton fill (synthetic, then replay of that sequence, positions wrapping)
must write what the torch backend writes into a host buffer laid out the
same way: the two layers' bytes and a poisoned guard around each compared.
Only those windows are poisoned and compared, so on the CPU the buffers stay
mostly unbacked (torch's large host allocations are mapped lazily) and the
section takes seconds; on a GPU it needs ~4 GiB for the caches and ~4 GiB
for the bank.  Torch + triton + kvfill only.
"""
from __future__ import annotations

import math
from dataclasses import astuple

import torch

from kvfill.kernels import Bank, CacheGroup, FillEngine, GroupFill

LAYER_STRIDE = 2**32 + 4096  # bytes from layer 0's first byte to layer 1's
BLOCKS, SLOTS, ROW = 4, 16, 576
GUARD = 4096  # poisoned bytes compared on each side of a layer
TAIL = 40  # positions of the bank's second sequence, which starts past 2^31 elements
ENTRIES = GroupFill(block_ids=[3, 0, 2], slot_start=[0, 5, 0], slot_end=[16, 16, 9], local_base=[0, 16, 48],
                    sequence=[1, 1, 1])  # positions [0, 57): past TAIL they wrap


def _layer_bytes() -> int:
    return BLOCKS * SLOTS * ROW


def _windows() -> list[tuple[int, int]]:
    """The byte ranges poisoned and compared: each layer with its guards."""
    n = _layer_bytes()
    return [(max(0, at - GUARD), at + n + GUARD) for at in (0, LAYER_STRIDE)]


def _caches(device) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    total = LAYER_STRIDE + _layer_bytes() + GUARD
    buf = torch.empty(total, dtype=torch.uint8, device=device)
    g = torch.Generator(device="cpu").manual_seed(23)
    for lo, hi in _windows():
        buf[lo:hi].copy_(torch.randint(0, 256, (hi - lo,), dtype=torch.uint8, generator=g, device="cpu"))
    layers = {f"layer.{i}": buf.as_strided((BLOCKS, SLOTS, ROW), (SLOTS * ROW, ROW, 1), i * LAYER_STRIDE)
              for i in range(2)}
    return buf, layers


def _bank() -> Bank:
    """Two layers' rows ``[T, ROW]`` (host bytes): a first sequence long
    enough that the second starts past 2^31 elements; only the second's rows
    are written (random), the first's pages stay unbacked on the host."""
    head = math.ceil(2**31 / ROW) + 1
    g = torch.Generator(device="cpu").manual_seed(29)
    layers = {}
    for i in range(2):
        rows = torch.empty(head + TAIL, ROW, dtype=torch.uint8, device="cpu")
        rows[head:].copy_(torch.randint(0, 256, (TAIL, ROW), dtype=torch.uint8, generator=g, device="cpu"))
        layers[f"layer.{i}"] = rows
    assert head * ROW > 2**31
    return Bank(layers, sequence_lengths=[head, TAIL])


def _fill(device, backend: str, bank: Bank | None) -> list[torch.Tensor]:
    buf, layers = _caches(device)
    eng = FillEngine({"g": CacheGroup(layers, slot_dim=1, encoding="fp8_e4m3")}, mean=0.0, std=1.0, seed=31,
                     backend=backend, bank=bank)
    if eng.num_launch_classes != 1:
        raise AssertionError(f"the two layers make {eng.num_launch_classes} launch classes, expected one")
    entries = ENTRIES if bank is not None else GroupFill(*astuple(ENTRIES)[:4])  # no bank: sequence 0
    eng.fill({"g": entries})
    out = [buf[lo:hi].cpu() for lo, hi in _windows()]
    del eng, layers, buf
    return out


def check_large_offsets(device, log) -> list[str]:
    """Returns the failed checks' names (empty: every compared byte equal)."""
    failed = []
    bank = _bank()
    for mode, b in (("normal", None), ("replay", bank)):
        got = _fill(torch.device(device), "triton", b)
        if torch.device(device).type == "cuda":
            torch.cuda.empty_cache()
        want = _fill(torch.device("cpu"), "torch", b)
        for i, (x, y) in enumerate(zip(got, want)):
            bad = int((x != y).sum())
            if bad:
                failed.append(f"{mode}: layer {i} (at byte {i * LAYER_STRIDE}): {bad} bytes differ")
        if b is not None:  # and what both wrote is the far rows: block 3 slot 0 position 0, block 2 slot 8 56 -> 16
            rows, head = b.layers["layer.1"], b.layers["layer.1"].shape[0] - TAIL
            lo = _windows()[1][0]
            for block, slot, row in ((3, 0, 0), (2, 8, 16)):
                at = LAYER_STRIDE - lo + (block * SLOTS + slot) * ROW
                if not torch.equal(got[1][at:at + ROW], rows[head + row]):
                    failed.append(f"replay: layer 1 block {block} slot {slot} is not the bank's row {head + row}")
    log(f"offsets past 2^32 bytes (layer 1 at {LAYER_STRIDE}), a bank past 2^31 elements: "
        f"{'ok' if not failed else '; '.join(failed)}")
    return failed

"""The GPU check's state-page section (gpu/gpu_check.py): recurrent state
replayed into state blocks (``kvfill/kernels/state_pages.py``) on the
device - several layers in one step, pages of different sizes, two layers
sharing their block ids (one upload) - compared byte for byte with the same
step computed on the host; and ``time_state_pages``, a multi-layer step
beside a memset of the bytes it writes, for gpu_check's table.  Torch +
triton + kvfill only.
"""
from __future__ import annotations

import numpy as np
import torch

from kvfill.bench import common as C
from kvfill.kernels.state_pages import StatePages

SEQUENCES = 5
NUM_BLOCKS = 16
PAGES = {"mamba.0": 4096, "mamba.1": 12288 + 64, "conv.2": 700}  # bytes per page: odd sizes too
# layer -> (block ids, recorded sequence per block); mamba.0 and mamba.1 share theirs
BLOCKS = {"mamba.0": ([3, 7, 12], [0, 4, 2]), "mamba.1": ([3, 7, 12], [0, 4, 2]), "conv.2": ([15, 0], [1, 1])}


def _random(shape, seed: int) -> torch.Tensor:
    g = torch.Generator(device="cpu").manual_seed(seed)
    return torch.randint(-128, 128, shape, dtype=torch.int8, generator=g, device="cpu")


def check_state_pages(device, log) -> list[str]:
    """Returns the failed checks' names (empty: every byte as on the host)."""
    caches = {n: _random((NUM_BLOCKS, 1, 1, b), seed=i) for i, (n, b) in enumerate(PAGES.items())}
    states = {n: _random((SEQUENCES, b), seed=10 + i) for i, (n, b) in enumerate(PAGES.items())}
    on_device = {n: c.to(device, copy=True) for n, c in caches.items()}
    pages = StatePages(on_device, states)
    blocks = {n: (np.array(ids), np.array(seqs)) for n, (ids, seqs) in BLOCKS.items()}
    wrote = pages.write(blocks)
    failed = []
    if wrote.launches != 1 + 2 * len(BLOCKS) or wrote.pages != sum(len(ids) for ids, _ in BLOCKS.values()):
        failed.append(f"the step wrote {wrote.pages} pages in {wrote.launches} launches")
    for name, (ids, seqs) in BLOCKS.items():
        want = caches[name].clone().view(NUM_BLOCKS, -1)
        want[ids] = states[name][seqs]
        bad = int((on_device[name].cpu().view(NUM_BLOCKS, -1) != want).sum())
        if bad:
            failed.append(f"{name}: {bad} bytes differ from the host step")
    checked, differ, first = pages.mismatches(blocks)
    if differ or checked != wrote.pages:
        failed.append(f"mismatches() found {differ} of {checked} pages differing: {first}")
    log(f"state pages: {wrote.pages} pages of {len(BLOCKS)} layers in {wrote.launches} launches: "
        f"{'ok' if not failed else '; '.join(failed)}")
    return failed


def time_state_pages(device, *, layers: int, blocks: int, page_bytes: int, repeat: int) -> list[dict]:
    """gpu_check's table rows: one step writing ``blocks`` pages of
    ``page_bytes`` into each of ``layers`` layers (every layer its own block
    ids), beside a memset of as many bytes."""
    caches = {f"l{i}": torch.empty(2 * blocks, page_bytes, dtype=torch.int8, device=device) for i in range(layers)}
    states = {n: _random((SEQUENCES, page_bytes), seed=i) for i, n in enumerate(caches)}
    pages = StatePages(caches, states)
    rng = np.random.default_rng(0)
    step = {n: (rng.permutation(2 * blocks)[:blocks], rng.integers(0, SEQUENCES, blocks)) for n in caches}
    wrote = pages.write(step)
    ok = pages.mismatches(step)[1] == 0
    written = layers * blocks * page_bytes
    t = C.median_time(lambda: pages.write(step), device, repeat=repeat)
    scratch = torch.empty(written, dtype=torch.uint8, device=device)
    t_memset = C.median_time(lambda: scratch.zero_(), device, repeat=repeat)
    name = f"state pages L{layers} x{blocks} {page_bytes // 1024}KiB"
    return C.rows_beside_memset(name, "replay", written, t, wrote.launches, t_memset, ok)

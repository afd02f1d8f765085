"""Decode context parallelism (DCP): which rank holds which token of a group.

Under DCP of world size W with interleave I, a request's global token ``t``
lives on rank ``(t // I) % W`` at rank-local index
``l = (t // (I * W)) * I + t % I``; a rank's block holds ``slots_per_block``
of its own tokens.  Inverse: ``t = (l // I) * (I * W) + r * I + l % I``.
W = 1 is "not sharded": every rank holds every token at ``l = t``.

One type for this geometry everywhere: the planner's groups, the engine's
cache groups, both fill backends and a bank's parts.  It lives in the bank
package, which imports nothing else of kvfill, because a rank's part of a bank
(``parts.py``) names the positions a DCP rank holds; ``kvfill.kernels``
re-exports it.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np


@dataclass(frozen=True)
class DcpGeometry:
    """One group's DCP geometry as seen from one rank.

    ``world_size`` W (1: not sharded), ``rank`` r of this process in the DCP
    group (0 when W = 1), ``interleave`` I: consecutive tokens per rank.
    """

    world_size: int = 1
    rank: int = 0
    interleave: int = 1

    def __post_init__(self):
        W, r, I = self.world_size, self.rank, self.interleave
        ok = all(isinstance(v, int) and not isinstance(v, bool) for v in (W, r, I))
        if not (ok and W >= 1 and I >= 1 and 0 <= r < W):
            raise ValueError(
                f"DCP geometry world_size={W!r}, rank={r!r}, interleave={I!r} is invalid; "
                "expected ints with world_size >= 1, 0 <= rank < world_size, interleave >= 1"
            )

    @property
    def sharded(self) -> bool:
        return self.world_size > 1

    def on_rank(self, rank: int) -> "DcpGeometry":
        """The same geometry seen from ``rank`` (unsharded geometry: unchanged)."""
        return replace(self, rank=rank) if self.sharded else self

    def global_positions(self, local) -> np.ndarray:
        """Global token position of each rank-local slot index ``l``."""
        local = np.asarray(local, dtype=np.int64)
        if not self.sharded:
            return local
        W, r, I = self.world_size, self.rank, self.interleave
        return (local // I) * (I * W) + r * I + local % I

    def local_count(self, n):
        """How many of the global tokens ``[0, n)`` live on this rank (n: int or int array)."""
        if not self.sharded:
            return n
        period = self.interleave * self.world_size
        return (n // period) * self.interleave + np.clip(n % period - self.rank * self.interleave, 0,
                                                         self.interleave)


NO_DCP = DcpGeometry()

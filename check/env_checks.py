"""kvfill-check's environment, checked before anything heavy is imported:
vLLM's import alone takes seconds to a minute, and a value the check
refuses must not wait for it (``__main__.main`` asks first).  No vLLM or
torch import here."""
from __future__ import annotations

import os

KV_SPACE = "VLLM_CPU_KVCACHE_SPACE"


def given_kv_space() -> int | None:
    """The user's ``VLLM_CPU_KVCACHE_SPACE`` in GiB (None: unset); ValueError
    naming it unless a whole number >= 1."""
    given = os.environ.get(KV_SPACE, "")
    if not given:
        return None
    try:
        gib = int(given)
    except ValueError:
        gib = 0
    if gib < 1:
        raise ValueError(f"{KV_SPACE}={given!r}: expected a whole number of GiB >= 1 (each engine's KV space on "
                         f"vLLM CPU), or unset (the check sizes it)")
    return gib

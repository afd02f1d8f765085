"""Which drafter a bank's drafter layers were recorded with, and the serving
run's checked against it (speculative decoding, docs/replay.md).

A drafter's KV layers are named by its architecture (an EAGLE head caches as
``model.layers.N`` whatever its weights), so a bank recorded with drafter A
would replay silently into drafter B.  ``drafter_identity`` names a drafter
by its folder's content - its ``config.json``, its weight files' names and
sizes and samples of their bytes - not its path (a copy elsewhere, on another node, is the same
drafter); the recorder writes it beside the recorded speculative config, and
``check_drafter`` refuses a serving run whose drafter is another, and warns
where the rows stay exact but a figure may not (another method name or
number of speculative tokens).
"""
from __future__ import annotations

import hashlib
import json
import os
from typing import Any, Mapping

from kvfill.bank import BankError

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".gguf")


SAMPLE_BYTES = 1 << 20  # read from each weight file's start, middle and end


def drafter_identity(path: str | None, scheme: str = "sampled") -> str:
    """A drafter folder by content: a digest of its ``config.json`` and its
    weight files' names, sizes and (``scheme`` "sampled",
    ``sampled-sha256:<hex>``) 1 MiB of bytes from each file's start, middle
    and end - two checkpoints of one architecture differ there, and a file
    of GBs is not read whole; "sizes" (``sha256:<hex>``, banks recorded
    before) leaves the bytes out.  "" for no folder (ngram, the target's
    own MTP layers, a hub name not on this disk)."""
    if not path or not os.path.isdir(path):
        return ""
    h = hashlib.sha256()
    config = os.path.join(path, "config.json")
    if os.path.isfile(config):
        with open(config, "rb") as f:
            h.update(f.read())
    for name in sorted(os.listdir(path)):
        if name.endswith(WEIGHT_SUFFIXES):
            file = os.path.join(path, name)
            size = os.path.getsize(file)
            h.update(f"{name}:{size};".encode())
            if scheme == "sampled":
                with open(file, "rb") as f:
                    for at in sorted({0, max(0, size // 2 - SAMPLE_BYTES // 2), max(0, size - SAMPLE_BYTES)}):
                        f.seek(at)
                        h.update(f.read(SAMPLE_BYTES))
    return ("sampled-sha256:" if scheme == "sampled" else "sha256:") + h.hexdigest()


def check_drafter(meta: Mapping[str, str], spec: Any, source: str) -> list[str]:
    """The serving run's speculative config (vLLM's ``SpeculativeConfig``,
    None without one) against the bank's recorded one: BankError when the
    drafter whose layers the bank holds is another (by identity); the
    lines to warn (another method or number of speculative tokens: the
    recorded rows are the same, acceptance figures may differ)."""
    recorded = json.loads(meta.get("speculative_config") or "{}")
    if spec is None or not recorded:
        return []
    theirs = meta.get("drafter_identity") or ""
    ours = drafter_identity(getattr(spec, "model", None), "sizes" if theirs.startswith("sha256:") else "sampled")
    if theirs and ours and theirs != ours:
        raise BankError(f"{source}: its drafter layers were recorded with drafter {recorded.get('model')!r} "
                        f"({theirs[:27]}...), this run drafts with {getattr(spec, 'model', None)!r} ({ours[:27]}...), "
                        f"another drafter (config or weights differ): its draft tokens would read the other's KV. "
                        f"Record the bank with this run's --speculative-config")
    lines = []
    for key, serving in (("method", getattr(spec, "method", None)),
                         ("num_speculative_tokens", getattr(spec, "num_speculative_tokens", None))):
        if recorded.get(key) is not None and serving is not None and str(recorded[key]) != str(serving):
            lines.append(f"{source}: recorded with speculative {key} {recorded[key]!r}, this run has {serving!r}: "
                         f"the drafter's recorded rows are replayed as they are (the prompt's KV does not depend on "
                         f"it), but acceptance figures are this run's own")
    return lines

"""The vLLM versions kvfill is tested on, and the warning for any other.

vLLM changes the internals a connector meets from one minor release to the
next (model runners, cache layouts, spec fields, connector hooks): a version
outside ``TESTED_VLLM`` may run, but nothing here has checked that its fills
land where its attention reads.  setup.cfg's ``vllm`` extra admits the same
versions.
"""
from __future__ import annotations

import re

# minor versions the suite runs against (docs/testing.md): 0.32 end to end on vLLM CPU (both model runners);
# 0.33 and 0.34 without an engine, on their CUDA wheels
TESTED_VLLM = ("0.32", "0.33", "0.34")


def untested_vllm(version: str) -> str | None:
    """A warning naming ``version`` when its minor release is not one kvfill
    is tested on; None when it is."""
    m = re.match(r"(\d+)\.(\d+)", version or "")
    if m and f"{int(m.group(1))}.{int(m.group(2))}" in TESTED_VLLM:
        return None
    return (f"KVFillConnector: vLLM {version!r} is not a version kvfill is tested on ({', '.join(TESTED_VLLM)}); "
            f"its fills may not land where this vLLM's attention reads - check with kvfill-check or verify=raise")

"""The record role's reads (``kvfill.record``): after the forward that completes
a prompt's positions ``[0, N)``, read every layer's rows of them from the
request's own blocks and save them to ``record_dir/<key>.safetensors`` - one
``[N, row]`` tensor per layer in the caches' dtype and the bank's canonical
row order, written whole or not at all; N is the prompt's length, capped at
``record_positions``.  The scheduler side (which step completes which prompt) is
``scheduler._RecordTracker``.
"""
from __future__ import annotations

import json
import os
from typing import TYPE_CHECKING

from vllm.logger import init_logger

from kvfill.kernels import FillEngine
from kvfill.kernels.bank import dtype_name

from .metadata import KVFillConnectorMetadata
from .options import FillOptions
from .planner import Planner

if TYPE_CHECKING:
    from vllm.config import ParallelConfig

logger = init_logger("vllm.kvfill.connector")


class Recorder:
    """Saves the rows of recorded prompts; refuses parallelism that splits a layer."""

    def __init__(self, options: FillOptions, parallel: "ParallelConfig"):
        sizes = (parallel.tensor_parallel_size, parallel.pipeline_parallel_size,
                 parallel.decode_context_parallel_size)
        if max(sizes) > 1:
            raise ValueError(f"KVFillConnector: recording needs every layer whole on one worker; got tensor, "
                             f"pipeline and decode context parallel sizes {sizes} (record with 1, 1, 1)")
        self.record_dir = options.record_dir  # each item names its own positions (the scheduler's cap applied)

    def save(self, engine: FillEngine, planner: Planner, meta: KVFillConnectorMetadata) -> None:
        """Save positions ``[0, N)`` of each prompt the step completed, in the
        bank's canonical row order (``kvfill.kernels.kv_rows``)."""
        if not meta.records:
            return
        from safetensors.torch import save_file

        vdtypes = {name: dtype_name(d) for name, d in engine.value_dtypes().items()}
        formats = engine.row_formats()
        layers = {name: {"kv": list(f.kv) if f.kv else None, "parts": [list(p) for p in f.parts]}
                  for name, f in formats.items()}
        os.makedirs(self.record_dir, exist_ok=True)
        for item in meta.records:
            n = item.positions
            rows = engine.read(planner.plan([item.selection], groups=engine.groups))
            short = {name: r.shape[0] for name, r in rows.items() if r.shape[0] != n}
            if short or not rows:
                raise RuntimeError(f"KVFillConnector: recording {item.selection.req_id!r} read {short or 'no'} rows "
                                   f"of layers where {n} positions were expected (blocks freed before the read?)")
            path = os.path.join(self.record_dir, f"{item.key}.safetensors")
            save_file({name: formats[name].to_bank(r).cpu().contiguous() for name, r in rows.items()},
                      path + ".part", metadata={"key": item.key, "positions": str(n),
                                                "value_dtypes": json.dumps(vdtypes), "layers": json.dumps(layers)})
            os.replace(path + ".part", path)
        logger.info("KVFillConnector: recorded %d prompts to %s", len(meta.records), self.record_dir)

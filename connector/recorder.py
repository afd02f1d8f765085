"""The record role's reads (``kvfill.record``): after the forward that completes
a prompt's positions ``[0, N)``, read every layer's rows of them from the
request's own blocks and save them as ``<key>.tp<r>-pp<p>.safetensors`` - one
``[N, row]`` tensor per layer in the caches' dtype and the bank's canonical
row order, this rank's KV heads and layers, written whole or not at all; N is
the prompt's length, capped at ``record_positions``.  The scheduler side
(which step completes which prompt) is ``scheduler._RecordTracker``.

A worker keeps its parts in a folder of its own on its own node's disk; the
recorder fetches them through vLLM's own channel to its workers
(``collective_rpc`` of ``rpc_list_parts`` / ``rpc_read_part`` in bounded
chunks, then ``rpc_drop_parts``), so recording needs no filesystem shared by
the nodes.  The folder goes with the parts, at the connector's shutdown or
the process's exit whatever ends the run.
"""
from __future__ import annotations

import atexit
import json
import os
import shutil
import signal
import socket
import tempfile
from typing import TYPE_CHECKING

from vllm.logger import init_logger

from kvfill.bank import dtype_name, head_range
from kvfill.bank.state import layouts_to_json, state_tensor_name, unpack
from kvfill.kernels import FillEngine

from .metadata import KVFillConnectorMetadata
from .options import FillOptions
from .packed import INDEXER_SCALES_KEY, indexer_scale_encoding
from .states import has_recurrent_state

if TYPE_CHECKING:
    from vllm.config import VllmConfig

    from .registration import Registration

logger = init_logger("vllm.kvfill.connector")


class Recorder:
    """Saves this rank's part of the rows of recorded prompts.

    Under tensor parallelism a rank saves its KV heads (``head_range``; a
    head replicated on several ranks, MLA's latent row or one shared KV head
    is saved by the first of them only), under pipeline parallelism its
    stage's layers; each file names its part, and ``kvfill.record`` merges
    them into one canonical bank, checking every layer and head arrived once.
    """

    def __init__(self, options: FillOptions, vllm_config: "VllmConfig", tp_rank: int, pp_rank: int):
        """``tp_rank``, ``pp_rank``: this worker's (``worker.current_*_rank``)."""
        par = vllm_config.parallel_config
        if par.decode_context_parallel_size > 1:
            raise ValueError(f"KVFillConnector: recording needs decode context parallel size 1, got "
                             f"{par.decode_context_parallel_size}: record at the same tensor parallel size with DCP "
                             f"1 (DCP splits positions, not heads; the bank replays under any DCP size)")
        self.record_dir = options.record_dir  # the recorder's work folder: names the run; never written here
        self.tp_rank, self.tp_size = tp_rank, par.tensor_parallel_size
        self.pp_rank, self.pp_size = pp_rank, par.pipeline_parallel_size
        # This worker's parts, on its own node, until the recorder fetches them. Made once, at start; never
        # again while saving: a folder gone mid-run was dropped, and a worker that re-made it would leave
        # parts behind it.
        self.folder = tempfile.mkdtemp(prefix=f"kvfill-parts-{os.path.basename(os.path.normpath(self.record_dir))}"
                                              f"-tp{self.tp_rank}-pp{self.pp_rank}-")
        self.part_id = f"{socket.gethostname()}:{os.getpid()}:{os.path.basename(self.folder)}"
        atexit.register(self.drop)
        model = vllm_config.model_config
        self.total_heads = 1 if getattr(model, "use_mla", False) else int(model.get_total_num_kv_heads())
        replicas = max(1, self.tp_size // self.total_heads)
        self.saves_rows = tp_rank % replicas == 0  # the first rank of each head's replicas saves it
        # A model with recurrent state: every rank saves its part of each state layer (Registration.recorded).
        self.records_states = has_recurrent_state(model)
        if self.records_states and getattr(vllm_config.cache_config, "mamba_cache_mode", "none") != "none":
            raise ValueError(f"KVFillConnector: recording recurrent state needs mamba_cache_mode 'none', this engine "
                             f"runs {vllm_config.cache_config.mamba_cache_mode!r}: record without prefix caching")
        self.saves = self.saves_rows or self.records_states
        self.files_per_prompt = self.pp_size * (self.tp_size if self.records_states else self.tp_size // replicas)
        # how this worker's vLLM stores an indexer token's scale: the bank's provenance (packed.py)
        self.indexer_scales = indexer_scale_encoding()

    def _heads(self, formats) -> dict[str, list[int]]:
        """Layer -> ``[lo, hi, total]``: the model's KV heads this rank's rows
        hold (``formats``: the layers read).  A layer in its cache's own order
        has no heads to merge: whole on one rank (TP 1, or MLA's latent: every
        rank caches it, rank 0 saves it), refused otherwise."""
        out = {}
        for name, f in formats.items():
            if f.kv is None:
                if self.tp_size > 1 and self.total_heads != 1:
                    raise ValueError(f"KVFillConnector: layer {name!r} has no K/V geometry (its cache's own order): "
                                     f"its rows cannot be merged over tensor parallel size {self.tp_size}; record "
                                     f"it at tensor parallel size 1")
                continue
            h = f.kv[0]  # this rank's heads; the model's: all of them at TP 1, TP x them when split
            total = h if self.tp_size == 1 else h * self.tp_size if h > 1 else min(self.total_heads, self.tp_size)
            lo, hi = head_range(total, self.tp_rank, self.tp_size, f"layer {name!r}")
            if hi - lo != f.kv[0]:
                raise ValueError(f"KVFillConnector: layer {name!r} holds {f.kv[0]} KV heads on TP rank "
                                 f"{self.tp_rank}, expected heads [{lo}, {hi}) of the model's {total}")
            out[name] = [lo, hi, total]
        return out

    def _states(self, reg: "Registration", item) -> dict:
        """The state tensors ``<layer>/state<i>`` ``[1, *local shape]`` of the
        request's state block (the planner's one block of each state group)
        after its ``positions`` tokens (``reg.recorded``: this rank's state
        layers, their pages and layouts)."""
        out = {}
        if reg.recorded is None:
            return out
        for name, (gi, layout, alignment) in reg.recorded.layouts.items():
            ids = item.selection.groups[gi].block_ids
            if len(ids) != 1:
                raise RuntimeError(f"KVFillConnector: recording {item.selection.req_id!r}: state layer {name!r} has "
                                   f"{len(ids)} state blocks selected, expected 1")
            page = reg.recorded.pages.read(name, [int(ids[0])])
            shapes = [st.local_shape(self.tp_rank, self.tp_size) for st in layout]
            for i, t in enumerate(unpack(page, shapes, [st.dtype for st in layout], alignment)):
                out[state_tensor_name(name, i)] = t
        return out

    def save(self, reg: "Registration", engine: FillEngine, meta: KVFillConnectorMetadata) -> None:
        """Save positions ``[0, N)`` of each prompt the step completed, in the
        bank's canonical row order (``kvfill.bank.rows``), this rank's part
        (``reg``: the worker's registration, its planner and state layers)."""
        if not meta.records or not self.saves:
            return
        if not os.path.isdir(self.folder):
            logger.error("KVFillConnector: this worker's parts folder %s is gone (the recorder stopped); %d prompts "
                         "not saved, the folder not made again", self.folder, len(meta.records))
            return
        from safetensors.torch import save_file

        vdtypes = {name: dtype_name(d) for name, d in engine.value_dtypes().items()}
        formats = engine.row_formats()
        layers = {name: {"kv": list(f.kv) if f.kv else None, "parts": [list(p) for p in f.parts]}
                  for name, f in formats.items()}
        part = {"tp_rank": str(self.tp_rank), "tp_size": str(self.tp_size), "pp_rank": str(self.pp_rank),
                "files_per_prompt": str(self.files_per_prompt), INDEXER_SCALES_KEY: self.indexer_scales,
                "states": layouts_to_json({n: v[1] for n, v in (reg.recorded.layouts if reg.recorded else {}).items()})}
        for item in meta.records:
            n = item.positions
            rows = self._rows(engine, reg.planner.plan([item.selection], groups=engine.groups), formats) \
                if self.saves_rows else {}
            short = {name: r.shape[0] for name, r in rows.items() if r.shape[0] != n}
            states = self._states(reg, item)
            if short or not (rows or states):
                raise RuntimeError(f"KVFillConnector: recording {item.selection.req_id!r} read {short or 'no'} rows "
                                   f"of layers where {n} positions were expected (blocks freed before the read; "
                                   f"a pipeline stage of no attention layer?)")
            part["heads"] = json.dumps(self._heads({name: formats[name] for name in rows}))
            path = os.path.join(self.folder, f"{item.key}.tp{self.tp_rank}-pp{self.pp_rank}.safetensors")
            save_file({**rows, **states},
                      path + ".part", metadata={"key": item.key, "positions": str(n), **part,
                                                "value_dtypes": json.dumps(vdtypes), "layers": json.dumps(layers)})
            os.replace(path + ".part", path)
        logger.info("KVFillConnector: recorded %d prompts to %s (TP rank %d, PP rank %d)", len(meta.records),
                    self.folder, self.tp_rank, self.pp_rank)

    @staticmethod
    def _rows(engine: FillEngine, plan, formats) -> dict[str, torch.Tensor]:
        """Each layer's rows of ``plan`` in the bank's order, in host memory,
        read one layer at a time: the device holds one layer's rows and
        their reordered copy at most, whatever the prompt's length (a 128k
        prompt of an 8B model: ~1 GiB per layer group, not ~16 GiB)."""
        out = {}
        for name in formats:
            got = engine.read(plan, layers=[name])
            if name in got:
                out[name] = formats[name].to_bank(got.pop(name)).cpu().contiguous()
        return out

    def parts(self) -> list[tuple[str, int]]:
        """(file name, bytes) of each part saved and not yet fetched."""
        if not os.path.isdir(self.folder):
            return []
        return [(n, os.path.getsize(os.path.join(self.folder, n))) for n in sorted(os.listdir(self.folder))
                if n.endswith(".safetensors")]

    def read(self, name: str, offset: int, length: int) -> bytes:
        if os.path.basename(name) != name or not name.endswith(".safetensors"):
            raise ValueError(f"KVFillConnector: {name!r} is no part of this worker's")
        with open(os.path.join(self.folder, name), "rb") as f:
            f.seek(offset)
            return f.read(length)

    def drop(self) -> None:
        """The parts and their folder gone (fetched, or the run ended)."""
        shutil.rmtree(self.folder, ignore_errors=True)


# vLLM's collective_rpc runs these in every worker process (``worker``: vLLM's
# worker object); the recorder calls them through ``LLM.collective_rpc``.
def _this_recorder() -> Recorder | None:
    from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group

    worker = getattr(get_kv_transfer_group(), "worker", None) if has_kv_transfer_group() else None
    return getattr(worker, "recorder", None)


def rpc_list_parts(worker) -> tuple[str, list[tuple[str, int]]]:
    """This worker's part id and parts (none where it records nothing)."""
    rec = _this_recorder()
    return (rec.part_id, rec.parts()) if rec is not None and rec.saves else ("", [])


def rpc_read_part(worker, part_id: str, name: str, offset: int, length: int) -> bytes | None:
    """``length`` bytes of a part from ``offset``, from the worker ``part_id`` names only."""
    rec = _this_recorder()
    return rec.read(name, offset, length) if rec is not None and rec.part_id == part_id else None


def rpc_drop_parts(worker) -> None:
    rec = _this_recorder()
    if rec is not None:
        rec.drop()


def rpc_end_node(worker, reply: bool) -> bool:
    """The recording is over: a worker on a node other than the first drops
    its parts and tells its node's kvfill-record (its parent process,
    ``record.nodes.host_workers``) with SIGUSR1; vLLM's own headless nodes run
    until stopped.  Without ``reply`` (only the first rank replies) it then
    exits at once: blocked on the first node's queue, it would otherwise
    outlast its executor's grace period and be killed.  Returns whether this
    worker's node was told."""
    rec = _this_recorder()
    if rec is not None:
        rec.drop()
    par = getattr(getattr(worker, "vllm_config", None), "parallel_config", None)
    if par is None or getattr(par, "nnodes", 1) <= 1 or par.node_rank_within_dp == 0:
        return False
    os.kill(os.getppid(), signal.SIGUSR1)
    if not reply:
        os._exit(0)
    return True

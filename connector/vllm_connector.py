"""KVFillConnector: a drop-in for vLLM's DecodeBenchConnector backed by kvfill.

    vllm serve MODEL --kv-transfer-config '{"kv_connector": "KVFillConnector",
        "kv_role": "kv_both", "kv_connector_extra_config": {"fill_std": 0.1}}'

(or ``"kv_connector_module_path": "kvfill.connector"`` without the plugin).

Scheduler side: every new request's prompt minus its last token is reported
as external; the planner selects the external blocks of every group once per
request (again after a preemption, so a preempted request is not prefilled for
real).  Worker side: one ``FillEngine.fill`` per step for all requests, groups
and layers, stream-ordered, no host sync.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    SupportsHMA,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats
from vllm.logger import init_logger
from vllm.v1.kv_cache_interface import AttentionSpec, UniformTypeKVCacheSpecs

from kvfill.kernels import CacheGroup, FillEngine, GroupFill

from .planner import NULL_BLOCK_ID, GroupKind, GroupSelection, Planner, RequestSelection
from .specs import geometries_from_config, layer_encoding, layer_specs, select_request, spec_kind

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

# Under "vllm." so that vLLM's logging configuration (handlers, level) applies.
logger = init_logger("vllm.kvfill.connector")

# kv_connector_extra_config keys and defaults.
DEFAULTS: dict[str, Any] = {
    "fill_mean": 0.015,           # as the in-tree connector
    "fill_std": 0.0,              # 0: constant fill_mean; > 0: normal(mean, std)
    "startup_fill": False,        # fill whole caches once at registration
    "seed": 0,                    # values are a function of (seed, layer, token, element)
    "granularity": "token",       # "token": only external slots; "block": whole blocks (in-tree parity)
    "refill_on_preemption": True,  # a preempted request is filled again, not prefilled for real
    "backend": "auto",            # "auto" / "triton" / "torch"
    "verify": False,              # false / "log" / "raise" (true): re-check every fill (debug aid; syncs)
}


def parse_config(extra: dict[str, Any] | None) -> dict[str, Any]:
    """Validated connector options; unknown keys are an error listing the valid ones."""
    extra = dict(extra or {})
    unknown = sorted(set(extra) - set(DEFAULTS))
    if unknown:
        raise ValueError(
            f"KVFillConnector: unknown kv_connector_extra_config key(s) {unknown}; "
            f"valid keys: {sorted(DEFAULTS)}"
        )
    cfg = {**DEFAULTS, **extra}
    for key in ("fill_mean", "fill_std"):
        v = cfg[key]
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            raise ValueError(f"KVFillConnector: {key} must be a finite number, got {v!r}")
    if cfg["fill_std"] < 0:
        raise ValueError(f"KVFillConnector: fill_std must be >= 0, got {cfg['fill_std']!r}")
    if cfg["granularity"] not in ("token", "block"):
        raise ValueError(f"KVFillConnector: granularity must be 'token' or 'block', got {cfg['granularity']!r}")
    if cfg["backend"] not in ("auto", "triton", "torch"):
        raise ValueError(f"KVFillConnector: backend must be 'auto', 'triton' or 'torch', got {cfg['backend']!r}")
    if cfg["verify"] is True:
        cfg["verify"] = "raise"
    if cfg["verify"] not in (False, "log", "raise"):
        raise ValueError(f"KVFillConnector: verify must be false, true, 'log' or 'raise', got {cfg['verify']!r}")
    for key in ("startup_fill", "refill_on_preemption"):
        if not isinstance(cfg[key], bool):
            raise ValueError(f"KVFillConnector: {key} must be true or false, got {cfg[key]!r}")
    if isinstance(cfg["seed"], bool) or not isinstance(cfg["seed"], int) or cfg["seed"] < 0:
        raise ValueError(f"KVFillConnector: seed must be an int >= 0, got {cfg['seed']!r}")
    return cfg


def startup_fill_group_ids(kv_cache_config: "KVCacheConfig") -> set[int]:
    """Groups a startup fill covers: not circular buffers (zeroed per request),
    not attention groups the engine zeroes on allocation (that wipes the fill)."""
    out = set()
    for i, g in enumerate(kv_cache_config.kv_cache_groups):
        specs = layer_specs(g.kv_cache_spec)
        if any(spec_kind(s) == GroupKind.CIRCULAR_BUFFER for s in specs):
            continue
        if getattr(kv_cache_config, "needs_kv_cache_zeroing", False) and isinstance(g.kv_cache_spec, AttentionSpec):
            continue
        out.add(i)
    return out


class KVFillConnectorMetadata(KVConnectorMetadata):
    """The step's fills.

    ``reqs_to_fill``: the in-tree field, request id -> (block ids per group,
    number of external tokens).  Given alone (metadata written for the
    in-tree connector) it means: fill those blocks whole.  ``selections``
    carries kvfill's token ranges and block positions; when the scheduler
    builds the metadata from selections, ``reqs_to_fill`` is derived from them
    on first access, so the scheduler's step does not pay for it.
    """

    def __init__(
        self,
        reqs_to_fill: dict[str, tuple[tuple[list[int], ...], int]] | None = None,
        selections: dict[str, RequestSelection] | None = None,
        null_block_id: int = NULL_BLOCK_ID,
    ):
        self._reqs_to_fill = reqs_to_fill
        self.selections = dict(selections or {})
        self.null_block_id = null_block_id

    @property
    def reqs_to_fill(self) -> dict[str, tuple[tuple[list[int], ...], int]]:
        if self._reqs_to_fill is None:
            self._reqs_to_fill = {rid: s.intree_view(self.null_block_id) for rid, s in self.selections.items()}
        return self._reqs_to_fill

    def __bool__(self) -> bool:
        return bool(self.selections) or bool(self._reqs_to_fill)

    def __repr__(self) -> str:
        return f"KVFillConnectorMetadata(reqs_to_fill={self.reqs_to_fill!r})"

    def request_selections(self) -> list[RequestSelection]:
        out = list(self.selections.values())
        for req_id, (groups, n_ext) in (self._reqs_to_fill or {}).items():
            if req_id not in self.selections:
                out.append(RequestSelection(
                    req_id, n_ext, tuple(GroupSelection(0, list(ids), 0, 0, whole=True) for ids in groups)
                ))
        return out


@dataclass
class KVFillStats(KVConnectorStats):
    """Fill statistics for vLLM's KV connector metrics (summed over steps)."""

    def reset(self):
        self.data = {"fills": 0, "requests": 0, "entries": 0, "bytes": 0, "seconds": 0.0}

    def __post_init__(self):
        if not self.data:
            self.reset()

    def record(self, requests: int, entries: int, nbytes: int, seconds: float) -> None:
        self.data["fills"] += 1
        self.data["requests"] += requests
        self.data["entries"] += entries
        self.data["bytes"] += nbytes
        self.data["seconds"] += seconds

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for k, v in other.data.items():
            self.data[k] = self.data.get(k, 0) + v
        return self

    def reduce(self) -> dict[str, int | float]:
        return {
            "kvfill_fills": self.data["fills"],
            "kvfill_requests": self.data["requests"],
            "kvfill_MiB": round(self.data["bytes"] / 2**20, 3),
            "kvfill_ms": round(self.data["seconds"] * 1e3, 3),
        }

    def is_empty(self) -> bool:
        return self.data.get("fills", 0) == 0


class KVFillScheduler:
    """Scheduler side: which requests to fill, and their selected blocks."""

    def __init__(self, vllm_config: "VllmConfig", kv_cache_config: "KVCacheConfig", cfg: dict):
        self.cfg = cfg
        self.planner = Planner(geometries_from_config(vllm_config, kv_cache_config), granularity=cfg["granularity"])
        self.startup_groups = startup_fill_group_ids(kv_cache_config) if cfg["startup_fill"] else set()
        # request id -> its num_preemptions when it was filled
        self.filled: dict[str, int] = {}
        # request id -> the locally computed tokens it was last asked about: the
        # grant starts there even when the scheduler trims its end
        self.asked: dict[str, int] = {}
        self.pending: dict[str, RequestSelection] = {}

    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int) -> tuple[int, bool]:
        preemptions = getattr(request, "num_preemptions", 0)
        seen = self.filled.get(request.request_id)
        if seen is not None and not (self.cfg["refill_on_preemption"] and preemptions > seen):
            return 0, False
        self.asked[request.request_id] = num_computed_tokens
        return max(0, request.num_tokens - num_computed_tokens - 1), False

    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks", num_external_tokens: int) -> None:
        num_local = self.asked.pop(request.request_id, None)
        if num_external_tokens == 0:
            return
        if num_local is not None and num_local + num_external_tokens > request.num_tokens - 1:
            num_local = None  # not the query this grant answers: fall back to the tail
        sel = select_request(self.planner, request, blocks, num_external_tokens, num_local)
        if self.startup_groups:
            sel = RequestSelection(
                sel.req_id,
                sel.num_external_tokens,
                tuple(
                    GroupSelection(g.first_block, [], 0, 0) if i in self.startup_groups else g
                    for i, g in enumerate(sel.groups)
                ),
            )
        self.filled[request.request_id] = getattr(request, "num_preemptions", 0)
        if any(len(g.block_ids) for g in sel.groups):
            self.pending[request.request_id] = sel

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> KVFillConnectorMetadata:
        meta = KVFillConnectorMetadata(selections=self.pending, null_block_id=self.planner.null_block_id)
        self.pending = {}
        return meta

    def request_finished(self, request: "Request") -> None:
        self.filled.pop(request.request_id, None)
        self.asked.pop(request.request_id, None)
        self.pending.pop(request.request_id, None)


class KVFillWorker:
    """Worker side: one engine over the registered caches, one fill per step."""

    def __init__(self, vllm_config: "VllmConfig", kv_cache_config: "KVCacheConfig", cfg: dict):
        self.cfg = cfg
        self.kv_cache_config = kv_cache_config
        self.geometries = geometries_from_config(vllm_config, kv_cache_config)
        self.planner = Planner(self.geometries, granularity=cfg["granularity"])
        self.startup_groups = startup_fill_group_ids(kv_cache_config) if cfg["startup_fill"] else set()
        self.dcp_rank = self._dcp_rank(vllm_config)
        cache_dtype = vllm_config.cache_config.cache_dtype
        self.encodings: dict[str, str] = {}
        self.unaddressable: set[str] = set()
        for g in kv_cache_config.kv_cache_groups:
            spec = g.kv_cache_spec
            for name in g.layer_names:
                layer_spec = spec.kv_cache_specs[name] if isinstance(spec, UniformTypeKVCacheSpecs) else spec
                self.encodings[name] = layer_encoding(layer_spec, cache_dtype)
                if not getattr(layer_spec, "has_layer_views", True):
                    # Raw backing buffers laid out by the layer itself (HiSparse):
                    # no block dim to address.
                    self.unaddressable.add(name)
        self.engine: FillEngine | None = None
        self.stats = KVFillStats()
        self.last_stats = None  # FillStats of the latest fill

    @staticmethod
    def _dcp_rank(vllm_config: "VllmConfig") -> int:
        if vllm_config.parallel_config.decode_context_parallel_size <= 1:
            return 0
        from vllm.distributed.parallel_state import get_dcp_group

        return get_dcp_group().rank_in_group

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        """Build the engine (again after re-registration, e.g. sleep mode)."""
        groups: dict[str, CacheGroup] = {}
        for geo, g in zip(self.geometries, self.kv_cache_config.kv_cache_groups):
            # Layers of one group sharing one cache tensor are filled once.  Groups
            # may alias one buffer (hybrid models): each still fills its own blocks.
            layers, seen = {}, set()
            for name in g.layer_names:
                cache = kv_caches.get(name)
                if cache is None or name in self.unaddressable:
                    continue
                tensors = cache if isinstance(cache, (list, tuple)) else [cache]
                key = tuple((t.data_ptr(), tuple(t.shape), t.stride(), t.dtype) for t in tensors)
                if key not in seen:
                    seen.add(key)
                    layers[name] = cache
            if not layers:
                continue
            groups[geo.name] = CacheGroup(
                layers,
                num_blocks=self.kv_cache_config.num_blocks,
                encoding={n: self.encodings.get(n, "auto") for n in layers},
                mode="zero" if geo.zero else None,
                dcp_world_size=geo.dcp_world_size,
                dcp_rank=self.dcp_rank if geo.dcp_world_size > 1 else 0,
                interleave=geo.interleave,
            )
        if self.unaddressable:
            logger.warning(
                "KVFillConnector: %d layers keep raw caches with no block views (%s...); they are not filled",
                len(self.unaddressable), sorted(self.unaddressable)[0],
            )
        self.engine = FillEngine(
            groups,
            mean=float(self.cfg["fill_mean"]),
            std=float(self.cfg["fill_std"]),
            seed=self.cfg["seed"],
            backend=self.cfg["backend"],
            layer_ids=_layer_ids(kv_caches),
        )
        # Caches storing several tokens per slot (tokens_per_state != 1, e.g.
        # compressed MLA) or several slots per token: the planner's token slots
        # don't map 1:1 onto them, so their planned blocks are filled whole.
        self.whole_block_groups = {}
        for geo in self.geometries:
            info = self.engine.groups.get(geo.name)
            if info is not None and geo.kind != GroupKind.MAMBA and info.block_size != geo.block_size:
                self.whole_block_groups[geo.name] = (geo.block_size, info.block_size)
                logger.warning(
                    "KVFillConnector: group %s holds %d slots per block for %d tokens; its planned "
                    "blocks are filled whole", geo.name, info.block_size, geo.block_size,
                )
        self.engine.warmup()  # compile the kernels now, not in the first filling step
        logger.info(
            "KVFillConnector: %s fill (mean=%g, std=%g, seed=%d, %s granularity), %s backend, "
            "DCP rank %d, startup_fill=%s; caches:\n%s",
            "random" if self.cfg["fill_std"] > 0 else "constant", self.cfg["fill_mean"], self.cfg["fill_std"],
            self.cfg["seed"], self.cfg["granularity"], self.engine.backend, self.dcp_rank,
            self.cfg["startup_fill"], self.engine.describe(),
        )
        if self.startup_groups:
            names = [self.geometries[i].name for i in sorted(self.startup_groups) if self.geometries[i].name in groups]
            stats = self.engine.fill_all(names)
            logger.info("KVFillConnector: startup fill of %d groups, %.1f MiB", len(names), stats.bytes / 2**20)

    def start_fill(self, meta: KVFillConnectorMetadata) -> None:
        """One engine fill for every request of the step.

        Metadata this engine cannot apply (block ids past its caches, another
        group count: another engine configuration) is logged and skipped -
        nothing is written, since the engine validates the whole plan before
        its first write - rather than crashing the worker.
        """
        self.last_stats = None
        if not meta:
            return
        if self.engine is None:
            raise RuntimeError("KVFillConnector: start_load_kv before register_kv_caches")
        t0 = time.perf_counter()
        selections = meta.request_selections()
        try:
            for sel in selections:
                if len(sel.groups) != len(self.planner.groups):
                    raise ValueError(
                        f"request {sel.req_id!r} has block ids for {len(sel.groups)} groups, "
                        f"this engine has {len(self.planner.groups)}"
                    )
            plan = self.planner.rank_plan(selections, self.dcp_rank)
            fill = {
                name: _unique_entries(g, self.whole_block_groups.get(name))
                for name, g in plan.groups.items()
                if g.num_entries and name in self.engine.groups
            }
            stats = self.last_stats = self.engine.fill(fill)
        except ValueError as exc:
            logger.error("KVFillConnector: skipped this step's fill, its metadata does not fit the caches: %s", exc)
            return
        elapsed = time.perf_counter() - t0
        self.stats.record(len(selections), stats.entries, stats.bytes, elapsed)
        logger.debug(
            "KVFillConnector: filled %d requests, %d block entries, %.2f MiB in %d launches, %.3f ms host",
            len(selections), stats.entries, stats.bytes / 2**20, stats.launches, elapsed * 1e3,
        )
        if self.cfg["verify"]:
            report = self.engine.verify(fill)
            if not report.ok:
                msg = (
                    f"KVFillConnector: verify found {report.num_mismatched} of {report.num_checked} "
                    f"elements mismatched after the fill, first: {report.first[:3]}"
                )
                if self.cfg["verify"] == "raise":
                    raise RuntimeError(msg)
                logger.error(msg)
            else:
                logger.debug("KVFillConnector: verified %d elements", report.num_checked)


def _layer_ids(kv_caches: dict[str, Any]) -> dict[str, int]:
    """Layer index for the value function: the number in the layer name
    (``model.layers.7.self_attn.attn`` -> 7), registration order otherwise."""
    from vllm.model_executor.models.utils import extract_layer_index

    out = {}
    for i, name in enumerate(kv_caches):
        try:
            out[name] = extract_layer_index(name)
        except (AssertionError, ValueError):
            out[name] = i
    if len(set(out.values())) != len(out):  # names without unique indices
        out = {name: i for i, name in enumerate(kv_caches)}
    return out


def _unique_entries(g, whole: tuple[int, int] | None = None) -> GroupFill:
    """Drop repeated entries (a block shared by requests of one step is filled once).

    Repeats are rare, so they are looked for with a 1-D sort of the block ids
    (~7 ms for 1.2M entries); the row-wise unique (~100x slower) runs only
    when some block id does repeat.  ``whole = (tokens per block, slots per
    block)``: fill every slot of each planned block instead of a token range.
    """
    start, end, base = g.slot_start, g.slot_end, g.local_base
    if whole is not None:
        tokens, slots = whole
        start = np.zeros_like(start)
        end = np.full_like(end, slots)
        base = base // tokens * slots
    ids = np.sort(g.block_ids)
    if ids.size < 2 or not (ids[1:] == ids[:-1]).any():
        return GroupFill(g.block_ids, start, end, base)
    cols = np.stack([g.block_ids, start, end, base], axis=1)
    uniq = np.unique(cols, axis=0)
    return GroupFill(uniq[:, 0], uniq[:, 1], uniq[:, 2], uniq[:, 3])


class KVFillConnector(KVConnectorBase_V1, SupportsHMA):
    """A drop-in for DecodeBenchConnector: synthetic KV for decode benchmarks."""

    def __init__(self, vllm_config: "VllmConfig", role: KVConnectorRole, kv_cache_config: "KVCacheConfig"):
        super().__init__(vllm_config, role, kv_cache_config)
        self.cfg = parse_config(vllm_config.kv_transfer_config.kv_connector_extra_config)
        self.scheduler: KVFillScheduler | None = None
        self.worker: KVFillWorker | None = None
        if role == KVConnectorRole.SCHEDULER:
            self.scheduler = KVFillScheduler(vllm_config, kv_cache_config, self.cfg)
        elif role == KVConnectorRole.WORKER:
            self.worker = KVFillWorker(vllm_config, kv_cache_config, self.cfg)

    # ---------------------------------------------------------------- worker
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]):
        assert self.worker is not None
        self.worker.register_kv_caches(kv_caches)

    def start_load_kv(self, forward_context: "ForwardContext", **kwargs: Any) -> None:
        assert self.worker is not None
        meta = self._get_connector_metadata()
        assert isinstance(meta, KVFillConnectorMetadata), type(meta)
        self.worker.start_fill(meta)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None  # the fill is stream-ordered before the forward

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        return None

    def wait_for_save(self):
        return None

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        if self.worker is None or self.worker.stats.is_empty():
            return None
        stats, self.worker.stats = self.worker.stats, KVFillStats()
        return stats

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats | None:
        return KVFillStats(data=dict(data)) if data is not None else KVFillStats()

    # ---------------------------------------------------------------- scheduler
    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int) -> tuple[int | None, bool]:
        assert self.scheduler is not None
        return self.scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks", num_external_tokens: int):
        assert self.scheduler is not None
        self.scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> KVConnectorMetadata:
        assert self.scheduler is not None
        return self.scheduler.build_connector_meta(scheduler_output)

    def request_finished(self, request: "Request", block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        assert self.scheduler is not None
        self.scheduler.request_finished(request)
        return False, None

    def request_finished_all_groups(
        self, request: "Request", block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        assert self.scheduler is not None
        self.scheduler.request_finished(request)
        return False, None

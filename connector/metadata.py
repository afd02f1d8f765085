"""What travels from the scheduler to the workers each step, and the fill
statistics that travel back to vLLM's metrics."""
from __future__ import annotations

from dataclasses import dataclass

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorHandshakeMetadata, KVConnectorMetadata
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats
from vllm.v1.metrics.utils import create_metric_per_engine

from .options import FillOptions
from .planner import NULL_BLOCK_ID, GroupSelection, RequestSelection


@dataclass(frozen=True)
class RecordItem:
    """Record role: read positions ``[0, N)`` of one prompt after this step's
    forward; ``key``: ``sequence_key`` of its first N tokens (the bank's key)."""

    key: str
    selection: RequestSelection
    positions: int


def rank_where(node: str, tp_rank: int, pp_rank: int) -> str:
    """How errors name a worker: ``node HOST, TP rank r, PP rank p``."""
    return f"node {node}, TP rank {tp_rank}, PP rank {pp_rank}"


@dataclass(frozen=True)
class _WorkerHandshake(KVConnectorHandshakeMetadata):
    """Sent by every worker of every node to the scheduler at start through
    vLLM's handshake (after the caches are registered): which worker it is."""

    node: str
    tp_rank: int
    pp_rank: int

    def where(self) -> str:
        return rank_where(self.node, self.tp_rank, self.pp_rank)


@dataclass(frozen=True)
class KVFillBankHandshake(_WorkerHandshake):
    """What a replaying worker loaded: checked against the bank the scheduler
    indexed."""

    path: str
    identity: str


@dataclass(frozen=True)
class KVFillRecordHandshake(_WorkerHandshake):
    """What a recording worker runs with: ``engine``, the digest of the
    recording's engine flags its node's kvfill-record computed
    (``record.engine_config.engine_digest``).  Several nodes each run
    kvfill-record (node 0 records, the others only host workers); their flags
    must agree; ``flags``: each flag's digest
    (``record.engine_config.engine_flags``), to name those that differ."""

    engine: str
    flags: tuple = ()


def check_record_handshakes(engine: str, handshakes, flags=()) -> None:
    """Every recording worker's node ran kvfill-record with the flags the
    scheduler's node did (``flags``: its per-flag digests); else a
    ValueError naming each worker that did not and the flags it differs in."""
    wrong = [h for h in handshakes if isinstance(h, KVFillRecordHandshake) and h.engine != engine]
    if wrong:
        _refuse(f"the recording's first node runs engine flags {engine}",
                [f"{h.where()} runs engine flags {h.engine}{_differing(dict(flags), dict(h.flags))}" for h in wrong],
                "Run the same kvfill-record command on every node, only --node-rank differing (the paths of the "
                "model, tokenizer and drafter may differ per node; the drafter is compared by content)")


def _differing(ours: dict, theirs: dict) -> str:
    """`` (differs in --a, --b)`` naming the flags whose digests differ,
    set on one node only included; "" when either side sent none."""
    if not ours or not theirs:
        return ""
    names = sorted(k for k in set(ours) | set(theirs) if ours.get(k) != theirs.get(k))
    return f" (differs in {', '.join('--' + k.replace('_', '-') for k in names)})" if names else ""


def check_bank_handshakes(path: str, identity: str | None, handshakes) -> None:
    """Every replaying worker loaded the bank the scheduler indexed
    (``identity``: ``kvfill.bank.files.identity_of``); else a ValueError naming each
    worker that did not - node, rank, path and both identities."""
    wrong = [h for h in handshakes if isinstance(h, KVFillBankHandshake) and h.identity != identity]
    if wrong:
        _refuse(f"the scheduler indexed the bank {path!r}, identity {identity}",
                [f"{h.where()} loaded {h.path!r}, identity {h.identity}" for h in wrong],
                "Every node must hold the same bank file (a copy of one save; its path may differ per node): copy "
                "it again from where it was recorded")


def _refuse(head: str, workers: list[str], way_out: str) -> None:
    """The start-up refusal of a handshake check: what the scheduler has, each
    worker that differs on a line of its own, the way out."""
    raise ValueError(f"KVFillConnector: {head}, but\n  " + "\n  ".join(workers) + "\n" + way_out)


@dataclass
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
        self.records: list[RecordItem] = []  # record role only

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
        self.data = {"fills": 0, "requests": 0, "entries": 0, "bytes": 0, "seconds": 0.0, "verified": 0,
                     "mismatched": 0, "wrapped_positions": 0, "wrapped_requests": 0}

    def __post_init__(self):
        if not self.data:
            self.reset()

    def record(self, requests: int, entries: int, nbytes: int, seconds: float) -> None:
        self.data["fills"] += 1
        self.data["requests"] += requests
        self.data["entries"] += entries
        self.data["bytes"] += nbytes
        self.data["seconds"] += seconds

    def record_wrapped(self, positions: int) -> None:
        """One request (the scheduler's) whose fill replays ``positions``
        positions past its sequences' recorded lengths."""
        self.data["wrapped_positions"] = self.data.get("wrapped_positions", 0) + positions
        self.data["wrapped_requests"] = self.data.get("wrapped_requests", 0) + 1

    def record_verify(self, mismatched_elements: int) -> None:
        """One fill re-checked by the ``verify`` option."""
        self.data["verified"] = self.data.get("verified", 0) + 1
        self.data["mismatched"] = self.data.get("mismatched", 0) + mismatched_elements

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
            "kvfill_verified_fills": self.data.get("verified", 0),
            "kvfill_mismatched_elements": self.data.get("mismatched", 0),
            "kvfill_wrapped_positions": self.data.get("wrapped_positions", 0),
            "kvfill_wrapped_requests": self.data.get("wrapped_requests", 0),
        }

    def is_empty(self) -> bool:
        return self.data.get("fills", 0) == 0 and self.data.get("wrapped_requests", 0) == 0


# Prometheus counters on the served /metrics: KVFillStats.data key -> (name, help).
PROM_COUNTERS = {
    "fills": ("vllm:kvfill_fills", "Engine fills issued by KVFillConnector (one per step with requests to fill)."),
    "requests": ("vllm:kvfill_requests", "Requests whose prompt KV KVFillConnector filled."),
    "bytes": ("vllm:kvfill_bytes", "Bytes of KV cache KVFillConnector wrote."),
    "seconds": ("vllm:kvfill_seconds", "Host seconds KVFillConnector spent issuing fills."),
    "verified": ("vllm:kvfill_verified_fills", "Fills re-checked against the value function (verify option)."),
    "mismatched": ("vllm:kvfill_mismatched_elements", "Elements a verified fill found wrong (goal: 0)."),
    "wrapped_positions": ("vllm:kvfill_wrapped_positions", "Replayed positions past their recorded sequence's "
                                                           "length, which replay it again from its start."),
    "wrapped_requests": ("vllm:kvfill_wrapped_requests", "Requests with replayed positions past their recorded "
                                                         "sequences' lengths."),
}


class KVFillPromMetrics(KVConnectorPromMetrics):
    """kvfill's fill figures as Prometheus counters (``vllm:kvfill_*_total``),
    and its settings as an info gauge (``vllm:kvfill_config_info``, always 1,
    labelled with the fill mode, granularity, backend and bank - as vLLM's
    ``vllm:cache_config_info``)."""

    def __init__(self, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self.counters = {
            key: create_metric_per_engine(
                self._counter_cls(name=name, documentation=doc, labelnames=labelnames), per_engine_labelvalues
            )
            for key, (name, doc) in PROM_COUNTERS.items()
        }
        info = config_info(vllm_config)
        gauge = self._gauge_cls(name="vllm:kvfill_config_info", documentation="KVFillConnector's settings.",
                                multiprocess_mode="mostrecent", labelnames=[*labelnames, *info])
        for values in per_engine_labelvalues.values():
            gauge.labels(*values, *info.values()).set(1)

    def observe(self, transfer_stats_data: dict, engine_idx: int = 0):
        for key, per_engine in self.counters.items():
            value = transfer_stats_data.get(key, 0)
            if value:
                per_engine[engine_idx].inc(value)



def config_info(vllm_config) -> dict[str, str]:
    """The labels of ``vllm:kvfill_config_info``: what kvfill writes and how."""
    options = FillOptions.from_extra_config(vllm_config.kv_transfer_config.kv_connector_extra_config)
    backend = options.backend
    if backend == "auto":
        from vllm.platforms import current_platform

        backend = "torch" if current_platform.is_cpu() else "triton"
    mode = "record" if options.recording else options.fill_mode
    return {"fill_mode": mode, "granularity": options.granularity.value, "backend": backend,
            "bank": options.bank or ""}

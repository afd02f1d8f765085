"""Scheduler side of KVFillConnector: which requests to fill, and their blocks.

Every new request's prompt minus its last token (its last two with
speculative decoding, its last ``lookahead - 1`` with vLLM's
multi-module MTP when that is more: ``computed_tail``) is reported as external; once
vLLM has allocated its blocks, the planner selects the external blocks of
every group (again after a preemption, unless ``refill_on_preemption`` is
off, so a preempted request is not prefilled for real).  Replaying, each
block is given the bank sequence its token prefix picks
(``BankIndex.sequences_for``), so requests sharing a cached block agree on it.
The step's selections travel to the workers as ``KVFillConnectorMetadata``.

A request whose ``kv_transfer_params`` hold ``{"kvfill_prefill": true}``
(``SamplingParams(extra_args={"kv_transfer_params": ...})``, or the
OpenAI API's ``kv_transfer_params`` field) is not filled: vLLM prefills it
for real beside filled ones, in the same engine, its prefix-cache blocks
kept apart from filled ones (``request_params.py``).  Where vLLM reads no
connector KV for a request (``prompt_logprobs``) it prefills it for real;
that, and a malformed ``kvfill_prefill`` past vLLM's front end (filled), are
said once.  A request whose prefix hit ends in blocks other requests of its
step fill (vLLM caches a block when it allocates it) fills them too: a
refusal of the others' fill then fails them alone (``step_fill.fill_requests``).

Record role (``record_dir``, used by ``kvfill.record``): nothing is granted;
the block tables of scheduled requests are followed, and in the step whose
forward computes a prompt's position ``N - 1`` the request's blocks of
positions ``[0, N)`` are sent to the workers, which read them after the
forward (``wait_for_save``).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
from vllm.logger import init_logger

from kvfill.bank import sequence_key

from .metadata import KVFillConnectorMetadata, KVFillStats, RecordItem
from .options import FillOptions
from .planner import RECORDED_KINDS, GroupKind, Planner, RequestSelection, wrapped_positions
from .request_params import keep_apart, prefill_param_error, reads_no_connector_kv, wants_prefill
from .specs import geometries_from_config, select_request, startup_fill_group_ids
from .step_fill import covers, token_ranges_by_block


if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request


logger = init_logger("vllm.kvfill.connector")


def _spec_method(vllm_config: "VllmConfig") -> str | None:
    spec = getattr(vllm_config, "speculative_config", None)
    return None if spec is None else str(getattr(spec, "method", None))


def prefill_lookahead(vllm_config: "VllmConfig") -> int:
    """vLLM's ``VllmConfig.num_prefill_lookahead_tokens`` (0.32 and 0.34):
    how many prompt tokens past a computed range its drafter reads
    (multi-module MTP: one per module); 0 where a vLLM has no such property."""
    value = getattr(vllm_config, "num_prefill_lookahead_tokens", 0)
    if not isinstance(value, int) or value < 0:
        raise ValueError(f"KVFillConnector: vLLM's num_prefill_lookahead_tokens is {value!r}, "
                         f"expected an int >= 0")
    return value


def computed_tail(vllm_config: "VllmConfig") -> int:
    """How many of a prompt's last tokens vLLM computes itself: 1 (the
    token whose logits it samples), 2 with speculative decoding.  vLLM's
    drafter, after a step that computes a single prompt token, proposes a
    first draft that real prefill does not (all of it rejected: one more
    step per request than real prefill; measured with vLLM's own prefix
    cache too, so a vLLM behaviour, not the fill's); from two computed
    tokens on its drafts are real prefill's (docs/replay.md, speculative
    decoding).

    With vLLM's multi-module MTP (lookahead L) at least the last L - 1:
    module k's KV at the prompt's last k positions is built from drafts, and
    the drafter rebuilds those slots after a rejection only from the inputs
    it cached in the step that computed them - the last L - 1 positions of
    that step's query.  A filled position there would keep its fill (or
    take an input this request never cached); vLLM's NIXL connector backs
    off by the same L - 1 (docs/vllm-internals.md, the prefill lookahead)."""
    base = 2 if _spec_method(vllm_config) is not None else 1
    return max(base, prefill_lookahead(vllm_config) - 1)


# vLLM's mamba_cache_mode values whose state block kvfill knows (planner._state_block): a request's only
# state block (none), or its running block, the blocks before it null (align, with prefix caching).
STATE_CACHE_MODES = ("none", "align")


def check_state_cache_mode(vllm_config: "VllmConfig") -> None:
    """Replaying recorded state needs a ``mamba_cache_mode`` of
    ``STATE_CACHE_MODES``; refused at start otherwise."""
    mode = getattr(vllm_config.cache_config, "mamba_cache_mode", "none")
    if mode not in STATE_CACHE_MODES:
        raise ValueError(f"KVFillConnector: replaying recorded state needs mamba_cache_mode in {STATE_CACHE_MODES}, "
                         f"this engine runs {mode!r}; serve with one of them, or a synthetic fill_mode")


def wrap_line(lengths, max_model_len: int, past_bank: str = "wrap") -> str | None:
    """The start-up line when a request may run past every recorded
    sequence (None when the longest covers ``max_model_len``)."""
    longest = int(max(lengths, default=0))
    if longest >= max_model_len:
        return None
    keys = ("keys re-rotated to position t (past_bank 'rotate'): positions right, the text a short one repeated"
            if past_bank == "rotate" else
            "keys rotated for position t mod N: attention sees a short text repeated, not one long one; past_bank "
            "'rotate' re-rotates them to t")
    return (f"replay: the bank's longest recorded sequence holds {longest} positions, max_model_len is "
            f"{max_model_len}: a request's positions past its sequence's length replay that sequence again from its "
            f"start (row t mod N, {keys}); counted as vllm:kvfill_wrapped_positions_total and kvfill_wrapped_requests - record "
            f"prompts as long as the benchmark's to replay them whole")


class KVFillScheduler:
    def __init__(self, vllm_config: "VllmConfig", kv_cache_config: "KVCacheConfig", options: FillOptions):
        self.options = options
        self.planner = Planner(geometries_from_config(vllm_config, kv_cache_config),
                               granularity=options.granularity)
        self.startup_groups = startup_fill_group_ids(kv_cache_config) if options.startup_fill else set()
        # request id -> its num_preemptions when it was filled
        self.filled: dict[str, int] = {}
        # request id -> the locally computed tokens it was last asked about: the
        # grant starts there even when the scheduler trims its end
        self.asked: dict[str, int] = {}
        self.pending: dict[str, RequestSelection] = {}
        self.recorder = _RecordTracker(self.planner, options.record_positions) if options.recording else None
        # vLLM 0.33 with routed experts keeps a grant only if it is block-aligned
        # and already in its routed-experts cache; else it prefills for real.
        aux = getattr(vllm_config, "aux_output_config", None)
        self.routed_experts = bool(getattr(aux, "enable_return_routed_experts", False))
        self.granted: dict[str, int] = {}  # request id -> tokens granted, until vLLM allocates
        self.said_once: set[str] = set()  # what vLLM or a client changed of the workload, said once per run
        # The prompt tokens vLLM computes itself: its last one; with speculative decoding its last two, or
        # a multi-module MTP drafter's lookahead less one (``computed_tail``).
        self.computed_tail = computed_tail(vllm_config)
        # Replaying recorded state (hybrid models): a request's state block gets the state after its
        # filled positions, which a preempted request's generated tokens have moved past.
        self.state_replay = options.replay and any(g.kind == GroupKind.MAMBA for g in self.planner.groups)
        self.state_sequences: dict[str, int] = {}  # request -> the sequence its state block replays
        if self.state_replay:
            check_state_cache_mode(vllm_config)
        # Replayed positions past their sequence's recorded length (they wrap), for vLLM's connector stats.
        self.stats = KVFillStats()
        if options.bank_index is not None:
            line = wrap_line(options.bank_index.lengths, vllm_config.model_config.max_model_len, options.past_bank)
            if line:
                logger.warning("KVFillConnector: %s", line)
        if self.computed_tail > 1:
            logger.info("KVFillConnector: speculative decoding (method %r, prefill lookahead %d): the last %d "
                        "prompt tokens of each request are computed by vLLM, the rest filled",
                        _spec_method(vllm_config), prefill_lookahead(vllm_config), self.computed_tail)

    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int) -> tuple[int, bool]:
        if self.recorder is not None:
            return 0, False  # recording: every prompt is prefilled for real
        if wants_prefill(getattr(request, "kv_transfer_params", None)):
            return 0, False  # asked to be prefilled for real (request_params.PREFILL_PARAM)
        if reads_no_connector_kv(request):
            self._say_once("prompt_logprobs", "request %s reads no connector KV (prompt_logprobs, or "
                           "skip_reading_prefix_cache): vLLM prefills such requests for real, not kvfill; said once",
                           request.request_id)
            return 0, False
        preemptions = getattr(request, "num_preemptions", 0)
        seen = self.filled.get(request.request_id)
        if seen is not None and not (self.options.refill_on_preemption and preemptions > seen):
            return 0, False
        if seen is not None and self.state_replay:
            # No state was recorded after the prompt *and* the tokens generated before the preemption:
            # vLLM recomputes the request (the prompt's KV then is real prefill's, the recording's).
            return 0, False
        if self.state_replay and not self._state_sequence(request):
            return 0, False  # no recorded state is this prompt's: vLLM prefills it (logged)
        self.asked[request.request_id] = num_computed_tokens
        grant = max(0, request.num_tokens - num_computed_tokens - self.computed_tail)
        self.granted[request.request_id] = grant
        return grant, False

    def _state_sequence(self, request: "Request") -> bool:
        """Replaying state: the sequence recorded at exactly the request's
        filled length with its tokens (``BankIndex.state_sequence``), kept for
        its state block (-1, logged once, where the bank has none - another
        sequence's state is the state after other tokens); found once per
        request however often vLLM asks while the request waits."""
        s = self.state_sequences.get(request.request_id)
        if s is None:
            n = request.num_tokens - self.computed_tail
            s = self.options.bank_index.state_sequence(list(request.prompt_token_ids or ()), n)
            self.state_sequences[request.request_id] = s
            if s < 0:
                logger.info("KVFillConnector: request %s: no recorded sequence is its first %d prompt tokens, so "
                            "no recorded state is its own; vLLM prefills it", request.request_id, n)
        return s >= 0

    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks", num_external_tokens: int) -> None:
        num_local = self.asked.pop(request.request_id, None)
        granted = self.granted.pop(request.request_id, 0)
        if granted and not num_external_tokens and self.routed_experts:
            self._say_once("routed", "vLLM dropped the fill of request %s (enable_return_routed_experts keeps a "
                           "connector's grant only when it is block-aligned and already in the routed-experts "
                           "cache): such requests are prefilled for real; logged once", request.request_id)
        # Handled from here on, even with nothing to fill (a 1-token prompt, a
        # full local prefix hit): after a preemption its generated tokens are
        # not a prompt to fill unless refill_on_preemption says so (vLLM #57419).
        self.filled[request.request_id] = getattr(request, "num_preemptions", 0)
        if num_external_tokens == 0:
            return
        if num_local is None or num_local + num_external_tokens > request.num_tokens - self.computed_tail:
            num_local = request.num_tokens - self.computed_tail - num_external_tokens  # the grant's own tail
        start = self._shared_pending_start(blocks, num_local)  # this step's fills its prefix hit shares
        num_external_tokens += num_local - start
        # Startup-filled groups are skipped before planning: their tables are
        # never looked at, so a table shorter than the prompt cannot raise.
        index = self.options.bank_index
        sequences_at = None
        if index is not None:  # a block replays the sequence its own token prefix picks (bank.py)
            # all the request's tokens: a refill after preemption runs past the prompt into its output
            tokens = list(getattr(request, "all_token_ids", None) or request.prompt_token_ids or ())
            sequences_at = lambda ends: index.sequences_for(tokens, ends)  # noqa: E731
        # The request-level sequence stays 0: only whole-block kinds take it, and
        # those are never replayed (circular buffers zeroed, cross attention synthetic).
        sel = select_request(self.planner, request, blocks, num_external_tokens, start,
                             skip_groups=self.startup_groups, sequences_at=sequences_at, tail=self.computed_tail)
        if index is not None:
            wrapped = wrapped_positions(self.planner.groups, sel.groups, index.lengths)
            if wrapped:
                self.stats.record_wrapped(wrapped)
                logger.debug("KVFillConnector: request %s: %d of its filled positions are past its recorded "
                             "sequences' lengths and replay them again from their start", request.request_id, wrapped)
        state = self.state_sequences.pop(request.request_id, -1)
        if state >= 0:  # a state block takes the sequence recorded at exactly the filled length
            for geo, g in zip(self.planner.groups, sel.groups):
                if geo.kind == GroupKind.MAMBA and len(g.block_ids):
                    g.sequences = np.full(len(g.block_ids), state, np.int64)
        if any(len(g.block_ids) for g in sel.groups):
            self.pending[request.request_id] = sel

    def _shared_pending_start(self, blocks: "KVCacheBlocks", num_local: int) -> int:
        """Where the request's fill starts: ``num_local``, or the first of the
        blocks ending its prefix hit that other requests of this step fill
        whole (module docstring) - so it writes only slots they write too.
        One token-range group only: vLLM takes block-level load errors there
        alone, and only there a block's table index is one in every table."""
        geo = self.planner.groups[0] if len(self.planner.groups) == 1 else None
        if (geo is None or geo.whole_blocks or geo.kind == GroupKind.MAMBA or not self.pending
                or not num_local or num_local % geo.span):
            return num_local
        filling = token_ranges_by_block(geo, self.pending.values())
        start = num_local
        for k in reversed(range(num_local // geo.span)):  # the newest blocks of a hit are this step's, if any
            if not covers(filling, blocks.blocks[0][k].block_id, k * geo.span, (k + 1) * geo.span):
                break
            start = k * geo.span
        return start

    def on_new_request(self, request: "Request") -> None:
        """vLLM adds a request: its prefix-cache hashes salted by its kind
        (``request_params.keep_apart``); a malformed ``kvfill_prefill`` past
        vLLM's front end is a fill, said once - never raised in the engine core."""
        keep_apart(request)
        line = prefill_param_error(getattr(request, "kv_transfer_params", None))
        if line is not None:
            self._say_once("malformed", "request %s: %s; it reached the engine core past vLLM's front-end check, "
                           "so it is filled (read as not a prefill request); said once", request.request_id, line)

    def _say_once(self, what: str, msg: str, *args) -> None:
        if what not in self.said_once:
            self.said_once.add(what)
            logger.warning("KVFillConnector: " + msg, *args)

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> KVFillConnectorMetadata:
        meta = KVFillConnectorMetadata(selections=self.pending, null_block_id=self.planner.null_block_id)
        self.pending = {}
        if self.recorder is not None:
            meta.records = self.recorder.step(scheduler_output)
        return meta

    def request_finished(self, request: "Request") -> None:
        self.filled.pop(request.request_id, None)
        self.state_sequences.pop(request.request_id, None)
        self.asked.pop(request.request_id, None)
        self.granted.pop(request.request_id, None)
        self.pending.pop(request.request_id, None)
        if self.recorder is not None:
            self.recorder.forget(request.request_id)


class _RecordTracker:
    """Follows the block tables of scheduled requests; emits a ``RecordItem``
    in the step whose forward completes a prompt's positions ``[0, N)``, N
    the prompt's length capped at ``positions``."""

    def __init__(self, planner: Planner, positions: int):
        self.planner, self.positions = planner, positions
        # recorded: the rows of token-position groups, the state block of state groups
        self.skip = {i for i, g in enumerate(planner.groups) if g.kind not in (*RECORDED_KINDS, GroupKind.MAMBA)}
        self.tables: dict[str, list[list[int]]] = {}
        self.prompts: dict[str, list[int]] = {}
        self.done: set[str] = set()

    def step(self, so: "SchedulerOutput") -> list[RecordItem]:
        computed = {}
        for new in so.scheduled_new_reqs:
            self.tables[new.req_id] = [list(ids) for ids in new.block_ids]
            self.prompts[new.req_id] = list(new.prompt_token_ids or ())
            computed[new.req_id] = new.num_computed_tokens
        cached = so.scheduled_cached_reqs
        for i, rid in enumerate(cached.req_ids):
            new_ids = cached.new_block_ids[i]
            if rid in cached.resumed_req_ids and new_ids is not None:
                self.tables[rid] = [list(ids) for ids in new_ids]
            elif new_ids is not None and rid in self.tables:
                for table, ids in zip(self.tables[rid], new_ids):
                    table.extend(ids)
            computed[rid] = cached.num_computed_tokens[i]
        items = []
        for rid, before in computed.items():
            prompt = self.prompts.get(rid, ())
            n = min(len(prompt), self.positions or len(prompt))  # the whole prompt, up to the cap
            after = before + so.num_scheduled_tokens.get(rid, 0)
            if rid in self.done or n < 1 or after < n:
                continue
            self.done.add(rid)
            sel = self.planner.select(rid, n + 1, 0, self.tables[rid], skip_groups=self.skip)
            items.append(RecordItem(sequence_key(prompt[:n]), sel, n))
        return items

    def forget(self, req_id: str) -> None:
        self.tables.pop(req_id, None)
        self.prompts.pop(req_id, None)
        self.done.discard(req_id)

"""The per-step fill's parts around its one plan and one engine fill
(``KVFillWorker.start_fill`` runs them in order): the state blocks the step's
requests replay recorded states into, a request whose fill is refused
filled apart from the others and handed to vLLM's
``kv_load_failure_policy``, and ``verify``'s read-back of what was written.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

import numpy as np

from vllm.logger import init_logger

from kvfill.kernels import FillEngine, FillPlan

from .geometry import GroupKind
from .metadata import KVFillStats
from .planner import Planner

if TYPE_CHECKING:
    from .registration import Registration

# Under "vllm." so that vLLM's logging configuration (handlers, level) applies.
logger = init_logger("vllm.kvfill.connector")


def state_blocks(reg: "Registration", selections) -> dict:
    """Layer -> (state block ids, the sequences they replay) of the step's
    requests: each request's state block gets the state of the sequence
    its last filled block replays (``Planner.plan`` of the state groups)."""
    if reg.replayed is None:
        return {}
    state_groups = reg.replayed.groups
    plan = reg.planner.plan(selections, groups=state_groups)
    return {layer: (e.block_ids, e.sequence) for g, e in plan.groups.items() for layer in state_groups[g]}


def fill_requests(selections: list, fill: Callable, planner: Planner, load_failure_policy: Any) -> tuple[list, set]:
    """The step's requests filled in one engine fill (``fill(selections)``
    -> ``(plan, states, FillStats, StateWrite)``), and where that is refused
    - a request whose metadata the caches cannot take (the engine validates
    a whole plan before its first write) - each request on its own, so only
    the refused ones go to ``kv_load_failure_policy`` (``skipped_blocks``),
    and of their blocks only those no filled request of the step wrote: a
    block a refused request shares with a filled neighbour (its prefix hit,
    ``scheduler``) holds the neighbour's values, and reporting it would fail
    the neighbour with it.  ``(done, failed)``: ``done`` a list of
    ``(selections, plan, states, stats, written)``, ``failed`` the block ids
    to report."""
    try:
        return [(selections, *fill(selections))], set()
    except ValueError as exc:
        if len(selections) == 1:
            return [], skipped_blocks(selections, exc, planner, load_failure_policy)
    done, refused = [], []
    for sel in selections:
        try:
            done.append(([sel], *fill([sel])))
        except ValueError as exc:  # nothing of it written
            refused.append((sel, exc))
    filled = [sels[0] for sels, *_ in done]
    failed = set()
    for sel, exc in refused:
        failed |= skipped_blocks([sel], exc, planner, load_failure_policy, filled)
    logger.error("KVFillConnector: %d of this step's %d requests could not be filled (above); the other %d were",
                 len(refused), len(selections), len(done))
    return done, failed


def log_fill(selections: list, stats, written, elapsed: float) -> None:
    logger.debug(
        "KVFillConnector: filled %d requests, %d block entries and %d state pages, %.2f MiB in %d launches, "
        "%.3f ms host", len(selections), stats.entries, written.pages, (stats.bytes + written.bytes) / 2**20,
        stats.launches + written.launches, elapsed * 1e3,
    )


def skipped_blocks(selections, exc: ValueError, planner: Planner, load_failure_policy: Any,
                   filled=()) -> set[int]:
    """A step's fill was skipped for ``selections``: the blocks to tell vLLM
    of, which applies ``kv_load_failure_policy`` to them - each block they
    were to fill, unless a request of ``filled`` (filled this step) wrote all
    of that block they needed (``block_token_ranges``).

    vLLM 0.32 takes block-level load failures only with one KV cache group
    (block ids are per group); with several, ``fail`` fails loudly here and
    ``recompute`` can only log: the step decodes over unfilled blocks (no
    block reported).
    """
    if len(planner.groups) == 1:
        geo = planner.groups[0]
        written = token_ranges_by_block(geo, filled)
        failed = {block for sel in selections for block, (lo, hi) in block_token_ranges(geo, sel.groups[0]).items()
                  if not covers(written, block, lo, hi)}
        failed.discard(planner.null_block_id)
        logger.error("KVFillConnector: skipped this step's fill (%d blocks reported as load errors), its "
                     "metadata does not fit the caches: %s", len(failed), exc)
        return failed
    msg = (f"KVFillConnector: this step's fill does not fit the caches ({exc}); with "
           f"{len(planner.groups)} KV cache groups vLLM cannot take block-level load failures")
    if load_failure_policy == "fail":
        raise RuntimeError(msg + " (kv_load_failure_policy 'fail')") from exc
    logger.error("%s; kv_load_failure_policy %r: the step decodes over unfilled blocks", msg, load_failure_policy)
    return set()


def block_token_ranges(geo, g) -> dict[int, tuple[int, int]]:
    """Block id -> the global token range ``[lo, hi)`` of it a group
    selection fills: the block's whole span for whole-block selections and
    state blocks, else its span cut to the selection's tokens (a prefix
    block sits at the same table index in every request that holds it, so
    ranges of one block compare across requests)."""
    out = {}
    for i, block in enumerate(g.block_ids):
        k = g.first_block + i
        lo, hi = k * geo.span, (k + 1) * geo.span
        if not (g.whole or geo.whole_blocks or geo.kind == GroupKind.MAMBA):
            lo, hi = max(lo, g.token_lo), min(hi, g.token_hi)
        out[int(block)] = (lo, hi)
    return out


def token_ranges_by_block(geo, selections) -> dict[int, list[tuple[int, int]]]:
    """Block id -> the token ranges ``selections`` (one group's) fill of it,
    one per request (``block_token_ranges``)."""
    out: dict[int, list[tuple[int, int]]] = {}
    for sel in selections:
        for block, span in block_token_ranges(geo, sel.groups[0]).items():
            out.setdefault(block, []).append(span)
    return out


def covers(ranges: dict[int, list[tuple[int, int]]], block: int, lo: int, hi: int) -> bool:
    """One request's range of ``block`` in ``ranges`` holds all of ``[lo, hi)``."""
    return any(r_lo <= lo and hi <= r_hi for r_lo, r_hi in ranges.get(block, ()))


def state_rule_breaks(selections, planner: Planner, lengths) -> list[str]:
    """Each request whose state block replays a sequence not recorded at
    exactly the request's filled length (the end of its filled tokens): the
    state after other tokens than the ones filled (``BankIndex.state_sequence``
    is the rule; ``lengths``: the bank's recorded length per sequence)."""
    breaks = []
    for sel in selections:
        pairs = list(zip(planner.groups, sel.groups))
        ends = [g.token_hi for geo, g in pairs if geo.kind != GroupKind.MAMBA and len(g.block_ids)]
        if not ends:
            continue
        for geo, g in pairs:
            if geo.kind == GroupKind.MAMBA and len(g.block_ids) and g.sequences is not None:
                s = int(np.asarray(g.sequences).reshape(-1)[-1])
                if int(lengths[s]) != max(ends):
                    breaks.append(f"request {sel.req_id}: state of sequence {s} (recorded at {int(lengths[s])} "
                                  f"positions), filled {max(ends)}")
                break  # one line per request: its state groups share the sequence
    return breaks


def verify_fill(reg: "Registration", engine: FillEngine, selections, plan: FillPlan, states: dict | None,
                stats: KVFillStats, verify: str) -> None:
    """Read back what the step wrote (``FillOptions.verify``): the plan's
    elements and the state pages, and each state block's sequence against
    the rule (``state_rule_breaks``); mismatches counted in ``stats``, then
    raised (``verify`` "raise") or logged."""
    report = engine.verify(plan)
    pages, bad_pages, first_pages = reg.replayed.pages.mismatches(states) if states else (0, 0, [])
    rule_breaks = state_rule_breaks(selections, reg.planner, reg.replayed.lengths) if states else []
    stats.record_verify(report.num_mismatched + bad_pages + len(rule_breaks))
    if report.ok and not bad_pages and not rule_breaks:
        logger.debug("KVFillConnector: verified %d elements and %d state pages", report.num_checked, pages)
        return
    state = f" and {bad_pages} of {pages} state pages" if pages else ""
    rule = (f"; {len(rule_breaks)} state blocks replay a sequence not recorded at the request's filled length, "
            f"first: {list(rule_breaks)[:3]}" if rule_breaks else "")
    msg = (f"KVFillConnector: verify found {report.num_mismatched} of {report.num_checked} "
           f"elements{state} mismatched after the fill, first: {(report.first or first_pages)[:3]}{rule}")
    if verify == "raise":
        raise RuntimeError(msg)
    logger.error(msg)

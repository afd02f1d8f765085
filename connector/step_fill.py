"""The per-step fill's parts around its one plan and one engine fill
(``KVFillWorker.start_fill`` runs them in order): the state blocks the step's
requests replay recorded states into, a skipped fill handed to vLLM's
``kv_load_failure_policy``, and ``verify``'s read-back of what was written.
"""
from __future__ import annotations

from typing import Any

from vllm.logger import init_logger

from kvfill.kernels import FillEngine, FillPlan
from kvfill.kernels.state_pages import StatePages

from .metadata import KVFillStats
from .planner import Planner

# Under "vllm." so that vLLM's logging configuration (handlers, level) applies.
logger = init_logger("vllm.kvfill.connector")


def state_blocks(planner: Planner, state_groups: dict[str, list[str]], selections) -> dict:
    """Layer -> (state block ids, the sequences they replay) of the step's
    requests: each request's state block gets the state of the sequence
    its last filled block replays (``Planner.plan`` of the state groups)."""
    if not state_groups:
        return {}
    plan = planner.plan(selections, groups=state_groups)
    return {layer: (e.block_ids, e.sequence) for g, e in plan.groups.items() for layer in state_groups[g]}


def skipped_blocks(selections, exc: ValueError, planner: Planner, load_failure_policy: Any) -> set[int]:
    """A step's fill was skipped: the blocks to tell vLLM of, which applies
    ``kv_load_failure_policy`` to them.

    vLLM 0.32 takes block-level load failures only with one KV cache group
    (block ids are per group); with several, ``fail`` fails loudly here and
    ``recompute`` can only log: the step decodes over unfilled blocks (no
    block reported).
    """
    if len(planner.groups) == 1:
        failed = {int(b) for sel in selections for g in sel.groups for b in g.block_ids}
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


def verify_fill(engine: FillEngine, plan: FillPlan, state_pages: StatePages | None, states: dict | None,
                stats: KVFillStats, verify: str) -> None:
    """Read back what the step wrote (``FillOptions.verify``): the plan's
    elements and the state pages; mismatches counted in ``stats``, then
    raised (``verify`` "raise") or logged."""
    report = engine.verify(plan)
    pages, bad_pages, first_pages = state_pages.mismatches(states) if states else (0, 0, [])
    stats.record_verify(report.num_mismatched + bad_pages)
    if report.ok and not bad_pages:
        logger.debug("KVFillConnector: verified %d elements and %d state pages", report.num_checked, pages)
        return
    state = f" and {bad_pages} of {pages} state pages" if pages else ""
    msg = (f"KVFillConnector: verify found {report.num_mismatched} of {report.num_checked} "
           f"elements{state} mismatched after the fill, first: {(report.first or first_pages)[:3]}")
    if verify == "raise":
        raise RuntimeError(msg)
    logger.error(msg)

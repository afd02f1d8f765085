"""Registration, planned once: ``register`` turns the per-layer caches vLLM
registers, with the configs' facts (``layer_facts.py``), into one immutable
``Registration`` and the ``FillEngine`` built from it.  The step fill, the
recorder and a wake's startup fill take the value whole; none reaches back
for a piece of it.

In order: the caches' groups as registered, their modes and the value
function's layer ids; replaying, this rank's bank, its packed rows checked,
its rotary layers and recorded states (``bank_loading.py``: it reads the
caches' names, geometry and device only); each layer's cache as the engine
takes it (``cache_views.py``); the engine over them, the planner told the
caches' slots per block, the kernels compiled (GPU) or the page images
written (CPU), and the startup fill.  vLLM 0.34's extensible KV cache
registers its caches once they are committed (``extend_kv_cache``): a second
registration builds everything again the same way.
"""
from __future__ import annotations

import socket
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Mapping

import torch
from vllm.logger import init_logger

from kvfill.kernels import CacheGroup, FillEngine
from kvfill.kernels.state_pages import StatePages

from .bank_loading import load_replay
from .cache_views import with_views
from .layer_facts import LayerFacts
from .metadata import KVFillBankHandshake, KVFillRecordHandshake
from .options import FillOptions
from .packed import left_out_line, unrecordable_line, zeroed_line
from .planner import RECORDED_KINDS, GroupKind, Planner
from .states import ReplayedStates, state_layouts

if TYPE_CHECKING:
    from vllm.config import VllmConfig

    from .geometry import GroupGeometry

# Under "vllm." so that vLLM's logging configuration (handlers, level) applies.
logger = init_logger("vllm.kvfill.connector")


@dataclass(frozen=True)
class RecordedStates:
    """A recording worker's state layers: their caches and, per layer,
    (group index, full ``StateTensor`` layout, the state alignment in its
    page: ``states.state_layouts``)."""

    pages: StatePages
    layouts: Mapping[str, tuple]


@dataclass(frozen=True)
class Registration:
    """What registration decided, once (module docstring)."""

    facts: LayerFacts
    planner: Planner  # this rank's, told the caches' slots per block
    groups: Mapping[str, CacheGroup]  # as the engine holds them
    layer_ids: Mapping[str, int]  # the value function's layer ids
    # Not the bank itself: the engine holds what its fills read (placement "device": the rows on the
    # caches' device), and a host copy kept here as well would hold each rank's part twice for the
    # worker's life (a 40 GiB part per GPU: 320 GiB of host RAM on an 8-GPU node).
    placement: str  # where the bank's rows are kept: "device" or "host"
    replayed: ReplayedStates | None  # replaying: the state layers given their recorded states
    recorded: RecordedStates | None  # recording: the state layers read after each prompt
    handshake: KVFillBankHandshake | KVFillRecordHandshake | None  # sent to the scheduler at start
    startup_groups: tuple[str, ...]  # the groups the startup fill writes (again on wake)


def register(facts: LayerFacts, kv_caches: dict[str, Any], options: FillOptions,
             vllm_config: "VllmConfig") -> tuple[Registration, FillEngine]:
    """The registration of ``kv_caches`` and its engine, warmed up, with the
    startup fill written (module docstring)."""
    if options.recording:
        line = unrecordable_line(facts.specs, facts.encodings, facts.left_out)
        if line:
            raise ValueError(line)
    if facts.left_out:
        logger.warning(left_out_line(facts.left_out))
    ids = layer_ids(kv_caches)
    groups = cache_groups(kv_caches, facts, options)
    asked = facts.packed if options.zero_packed else {}  # zeros the user asked for are not named
    line = zeroed_line({n: s for n, s in facts.specs.items() if n not in asked}, facts.encodings)
    if line:
        logger.warning(line)
    unfilled = set(facts.unaddressable) | set(facts.untransferred)
    state_caches = {n: kv_caches[n] for n in sorted(facts.state_layers)
                    if isinstance(kv_caches.get(n), torch.Tensor) and n not in unfilled}
    _log_unfilled(facts)
    replay = load_replay(options, facts, groups, state_caches, vllm_config) \
        if options.replay and not options.recording else None
    bank, placement = (replay.bank, replay.placement) if replay else (None, "device")
    # the caches as the engine takes them (a group whose every layer's recorded state is replayed is not its)
    groups = with_views(replay.groups if replay else groups, facts.packed, facts.specs, facts.cache_dtype)
    engine = FillEngine(groups, values=options.values, backend=options.backend, layer_ids=ids, bank=bank,
                        bank_placement=placement, staging_bytes=options.staging_mib << 20,
                        past_bank=options.past_bank, rotary=replay.rotary if replay else None,
                        page_image_bytes=0 if options.recording else options.page_image_mib << 20)
    planner = with_cache_slots(facts.planner, engine)
    recorded = None
    if options.recording and state_caches:
        recorded = RecordedStates(StatePages(state_caches), state_layouts(state_caches, facts.specs,
                                                                          facts.kv_cache_config, facts.ranks.tp_size))
    reg = Registration(
        facts=facts, planner=planner, groups=groups, layer_ids=ids,
        placement=placement, replayed=replay.states if replay else None, recorded=recorded,
        handshake=replay.handshake if replay else _record_handshake(facts, options),
        startup_groups=tuple(g.name for i, g in enumerate(planner.groups)
                             if i in facts.startup_groups and g.name in engine.groups),
    )
    # Compile the kernels (GPU) or write the page images of every position a
    # request can have (CPU) now, not in the first filling step.
    engine.warmup(facts.max_model_len)
    logger.info("KVFillConnector: %s, %s backend, DCP rank %d, %d torch threads; caches:\n%s",
                options.summary(), engine.backend, facts.ranks.dcp, torch.get_num_threads(), engine.describe())
    startup_fill(reg, engine)
    return reg, engine


def startup_fill(reg: Registration, engine: FillEngine) -> None:
    """The startup fill of ``reg``'s groups (at registration, and again on
    wake: vLLM 0.33's sleep mode discards the caches' contents)."""
    if not reg.startup_groups:
        return
    stats = engine.fill_all(list(reg.startup_groups))
    logger.info("KVFillConnector: startup fill of %d groups, %.1f MiB", len(reg.startup_groups), stats.bytes / 2**20)


def cache_groups(kv_caches: dict[str, Any], facts: LayerFacts, options: FillOptions) -> dict[str, CacheGroup]:
    """One engine group per KV cache group with addressable caches here,
    each layer's cache as registered (``cache_views.with_views`` turns them
    into the engine's views), each group's fill mode ``group_mode``.

    Layers of one group sharing one cache tensor are filled once.  Groups
    may alias one buffer (hybrid models): each still fills its own blocks.
    """
    unfilled = facts.unfilled
    groups: dict[str, CacheGroup] = {}
    for geo, g in zip(facts.planner.groups, facts.kv_cache_config.kv_cache_groups):
        layers, seen = {}, set()
        for name in g.layer_names:
            cache = kv_caches.get(name)
            if cache is None or name in unfilled:
                continue
            tensors = cache if isinstance(cache, (list, tuple)) else [cache]
            key = tuple((t.data_ptr(), tuple(t.shape), t.stride(), t.dtype) for t in tensors)
            if key not in seen:
                seen.add(key)
                layers[name] = cache
        if layers:
            groups[geo.name] = CacheGroup(
                layers,
                num_blocks=facts.kv_cache_config.num_blocks,
                encoding={n: facts.encodings.get(n, "auto") for n in layers},
                mode=group_mode(geo, options),
                dcp=geo.dcp,
                kv={n: facts.kv_geometry.get(n) for n in layers},
            )
    return groups


def group_mode(geo: "GroupGeometry", options: FillOptions) -> str | None:
    """None: the engine's mode. Replaying, groups the recorder does not
    record get zeros (recurrent state: the empty state) or, for chunked
    local and cross attention, the synthetic fill of fill_mean/fill_std."""
    if geo.zero:
        return "zero"
    if not options.replay or geo.kind in RECORDED_KINDS:
        return None
    if geo.kind == GroupKind.MAMBA:
        return "zero"
    logger.info("KVFillConnector: group %s (%s) is not recorded in banks; it gets the synthetic %s fill",
                geo.name, geo.kind.value, options.values.mode)
    return options.values.mode


def layer_ids(kv_caches: dict[str, Any]) -> dict[str, int]:
    """Layer id for the value function, from the number in the layer name
    (``model.layers.7.self_attn.attn`` -> 7), so every pipeline stage numbers
    its layers as the model does; caches sharing a layer's number (a DSA
    layer's latent and indexer) are ``number * m + j``, j their rank by name
    among the m at most of one number; registration order where a name has
    no number."""
    from vllm.model_executor.models.utils import extract_layer_index

    index = {}
    for name in kv_caches:
        try:
            index[name] = extract_layer_index(name)
        except (AssertionError, ValueError):
            return {name: i for i, name in enumerate(kv_caches)}
    by_index: dict[int, list[str]] = {}
    for name in sorted(index):
        by_index.setdefault(index[name], []).append(name)
    m = max((len(v) for v in by_index.values()), default=1)
    return {name: i * m + j for i, names in by_index.items() for j, name in enumerate(names)}


def with_cache_slots(planner: Planner, engine: FillEngine) -> Planner:
    """The planner told how many slots each group's caches hold per block."""
    geos = []
    for geo in planner.groups:
        info = engine.groups.get(geo.name)
        geo = replace(geo, slots_per_block=info.slots_per_block if info else None)
        if geo.remaps_to_whole_blocks:
            logger.warning("KVFillConnector: group %s holds %d slots per block for %d tokens; its planned "
                           "blocks are filled whole", geo.name, geo.slots_per_block, geo.block_size)
        geos.append(geo)
    return Planner(geos, granularity=planner.granularity, null_block_id=planner.null_block_id)


def _record_handshake(facts: LayerFacts, options: FillOptions) -> KVFillRecordHandshake | None:
    """A recording worker's engine flags, checked by the scheduler at start."""
    if not options.recording or options.record_engine is None:
        return None
    return KVFillRecordHandshake(socket.gethostname(), facts.ranks.tp, facts.ranks.pp, options.record_engine,
                                 options.record_flags or ())


def _log_unfilled(facts: LayerFacts) -> None:
    """The layers registration leaves unfilled, named at start."""
    if facts.unaddressable:
        logger.warning("KVFillConnector: %d layers keep raw caches with no block views (%s...); they are not filled",
                       len(facts.unaddressable), sorted(facts.unaddressable)[0])
    if facts.untransferred:
        logger.info("KVFillConnector: %d layers of groups %s are kept out of KV transfer by vLLM "
                    "(enable_kv_transfer False); they are not filled, recorded or replayed (%s...)",
                    len(facts.untransferred), sorted(set(facts.untransferred.values())),
                    sorted(facts.untransferred)[0])

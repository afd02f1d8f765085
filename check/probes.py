"""What a check run watches inside vLLM's engine: the MoE routers' expert
choices for decode tokens, the drafter's proposals, and vLLM's own counters.

The hooks run in vLLM's workers (``LLM.collective_rpc``), so they hold under
tensor parallelism too (each rank sees every token; rank 0's record is read).
"""
from __future__ import annotations

import collections
import json
import os
import time

SPEC_COUNTERS = ("num_drafts", "num_draft_tokens", "num_accepted_tokens")
PASS_DONE = "kvfill-check: timed pass done in"  # + " 12.345 s": the step's log line the check's progress counts
EXPERT_KEYS = ("num_local_experts", "num_experts", "n_routed_experts")


def model_config(model: str, trust_remote_code: bool = False) -> dict:
    """The model's config.json as a dict: a local folder's file, else what
    transformers resolves for a hub name (its cache; {} when it cannot)."""
    path = os.path.join(model, "config.json")
    if os.path.isfile(path):
        with open(path) as f:
            return json.load(f)
    try:
        from transformers import AutoConfig

        return AutoConfig.from_pretrained(model, trust_remote_code=trust_remote_code).to_dict()
    except Exception:  # no such model here, or a config transformers cannot read: vLLM says more
        return {}


def moe_shape(cfg: dict) -> tuple[int, int] | None:
    """(experts, experts per token) of an MoE model's config (its text
    config for a multimodal one), None for a dense model."""
    for c in (cfg, cfg.get("text_config") or {}):
        experts = next((c[k] for k in EXPERT_KEYS if isinstance(c.get(k), int) and c[k] > 1), None)
        if experts and isinstance(c.get("num_experts_per_tok"), int):
            return experts, c["num_experts_per_tok"]
    return None


def runner_kind(runner) -> str | None:
    """Which of vLLM's model runners ``runner`` is, by what it exposes:
    "v1" (``input_batch`` and ``positions`` on the runner), "v2" (Model
    Runner V2: ``req_states``, a ``prepare_inputs`` that returns the step's
    batch), None for neither (a runner these probes cannot read)."""
    if hasattr(runner, "input_batch") and hasattr(runner, "positions"):
        return "v1"
    if hasattr(runner, "req_states") and callable(getattr(runner, "prepare_inputs", None)):
        return "v2"
    return None


def model_runner(worker) -> str:
    """The worker's model runner, as the report names it: "V1", "V2" (Model
    Runner V2, vLLM's GPU runner), else its class name."""
    runner = worker.model_runner
    kind = runner_kind(runner)
    return kind.upper() if kind else type(runner).__name__


def block_size(worker) -> int | None:
    """The KV cache block size the worker's engine runs with: what vLLM's
    platform settled in the worker (vLLM 0.34 picks the attention backend's
    preferred size there, not the front end's default)."""
    size = getattr(getattr(worker, "vllm_config", None), "cache_config", None)
    size = getattr(size, "block_size", None)
    return int(size) if size else None


def _cannot_read(runner, what: str) -> str:
    return (f"{what} not read: the model runner {type(runner).__name__} exposes neither V1's input batch nor "
            f"Model Runner V2's prepare_inputs")


class _V2Batches:
    """Model Runner V2 keeps no batch on the runner: the step's ``InputBatch``
    is what ``prepare_inputs`` returns, remembered here for the step's hooks."""

    def __init__(self, runner):
        self.last = None
        prepare = runner.prepare_inputs

        def remembered(*args, **kwargs):
            self.last = out = prepare(*args, **kwargs)
            return out

        runner.prepare_inputs = remembered


def _step_tokens(runner, kind: str, batches: "_V2Batches | None", md) -> list[tuple[str, int, int, list[int]]]:
    """This forward's requests as (request id, first token, end token,
    positions of its tokens relative to its prompt's length: >= 0 is a
    decode-step input), tokens laid out request by request."""
    if kind == "v2":
        batch = batches.last if batches is not None else None
        if batch is None:
            return []
        starts = [int(x) for x in batch.query_start_loc_np[: batch.num_reqs + 1]]
        positions = batch.positions[: starts[-1]].tolist()
        prompt = runner.req_states.prompt_len.np[batch.idx_mapping_np[: batch.num_reqs]]
        return [(batch.req_ids[i], starts[i], starts[i + 1],
                 [p - int(prompt[i]) for p in positions[starts[i]: starts[i + 1]]]) for i in range(batch.num_reqs)]
    # V1: an attention layer's metadata holds the batch's token offsets (a hybrid's linear layers have their own)
    starts = next((m.query_start_loc for m in md.values() if hasattr(m, "query_start_loc")), None)
    if starts is None:
        return []
    starts = starts.tolist()
    positions = runner.positions[: starts[-1]].tolist()
    batch = runner.input_batch
    return [(batch.req_ids[i], starts[i], starts[i + 1],
             [p - int(batch.num_prompt_tokens[i]) for p in positions[starts[i]: starts[i + 1]]])
            for i in range(len(starts) - 1)]


def install_expert_counter(worker, num_experts: int, top_k: int) -> dict:
    """Hook every MoE router of the worker's model, on either model runner.
    Returns {"layers": hooked layers} or {"layers": [], "note": why none
    are counted}.  While ``worker.kvfill_counting`` is true, counts land in
    ``worker.kvfill_expert_counts``: request id -> layer -> [decode-step
    tokens routed to each expert].  The router's top-k logits are the
    experts chosen (a softmax or sigmoid keeps the order; grouped top-k
    routing, DeepSeek's, may choose otherwise).  A hook never raises into
    the model's forward: the first error stops counting and becomes the
    note ``stop_counting`` returns."""
    from vllm.forward_context import get_forward_context

    runner = worker.model_runner
    kind = runner_kind(runner)
    if kind is None:
        return {"layers": [], "note": _cannot_read(runner, "expert counts")}
    batches = _V2Batches(runner) if kind == "v2" else None
    counts: dict[str, dict[int, list[int]]] = collections.defaultdict(dict)
    worker.kvfill_expert_counts = counts
    worker.kvfill_counting = True
    worker.kvfill_probe_error = None

    def hook_for(layer: int):
        def hook(module, inputs, output):
            if not worker.kvfill_counting:
                return
            try:
                md = get_forward_context().attn_metadata
                if isinstance(md, list):
                    md = md[0] if md else None
                if not md:  # a dummy run
                    return
                logits = output[0] if isinstance(output, tuple) else output
                experts = logits.float().topk(top_k, dim=-1).indices.tolist()
                for req_id, start, end, past_prompt in _step_tokens(runner, kind, batches, md):
                    row = counts[req_id].setdefault(layer, [0] * num_experts)
                    for t, rel in zip(range(start, end), past_prompt):
                        if rel >= 0 and t < len(experts):
                            for e in experts[t]:
                                row[e] += 1
            except Exception as exc:  # what the probe could not read is reported, the forward goes on
                worker.kvfill_counting = False
                worker.kvfill_probe_error = (f"expert counts stopped: reading the {kind} runner's batch raised "
                                             f"{type(exc).__name__}: {exc}")
        return hook

    layers = []
    for name, module in runner.model.named_modules():
        # Mixtral: model.layers.N.block_sparse_moe.gate, Qwen3-MoE: model.layers.N.mlp.gate.  On CPU the
        # linear weights are repacked after loading (weight is empty): match on the output size.
        if name.endswith(".gate") and ".layers." in name and getattr(module, "output_size", None) == num_experts:
            layer = int(name.split(".layers.")[1].split(".")[0])
            module.register_forward_hook(hook_for(layer))
            layers.append(layer)
    return {"layers": sorted(layers)}


def stop_counting(worker) -> dict:
    """Stop counting; the counts so far (request id -> layer -> row) and,
    where a hook could not read the batch, why (``note``)."""
    worker.kvfill_counting = False
    return {"counts": {rid: {str(layer): row for layer, row in by_layer.items()}
                       for rid, by_layer in worker.kvfill_expert_counts.items()},
            "note": getattr(worker, "kvfill_probe_error", None)}


def watch_drafts(worker) -> str | None:
    """Keep every step's drafts per request (the token ids the drafter
    proposed), so runs compare what the drafter read, not only what was
    accepted.  None when watching; else why not (a note for the report)."""
    runner = worker.model_runner
    kind = runner_kind(runner)
    log = runner.__dict__.setdefault("_kvfill_drafts", {})
    if kind == "v2":
        speculator = getattr(runner, "speculator", None)
        if speculator is None:
            return "drafts not watched: Model Runner V2 runs no speculator here"
        propose = speculator.propose

        def proposed(input_batch, *args, **kwargs):
            out = propose(input_batch, *args, **kwargs)
            if runner.__dict__.get("_kvfill_watching", True) and not kwargs.get("dummy_run"):
                n = input_batch.num_reqs
                # a request whose prompt is not complete after this step (a chunk) has its draft discarded
                partial = (input_batch.num_computed_prefill_tokens_np[:n] + input_batch.num_scheduled_tokens[:n]
                           < input_batch.prefill_len_np[:n])
                for i, row in enumerate(out[:n].tolist()):
                    if not partial[i]:
                        log.setdefault(input_batch.req_ids[i], []).append([int(t) for t in row if t >= 0])
            return out

        speculator.propose = proposed
        return None
    if kind is None:
        return _cannot_read(runner, "drafts")
    propose = getattr(runner, "propose_draft_token_ids", None)
    if propose is None:
        return f"drafts not watched: the V1 runner {type(runner).__name__} has no propose_draft_token_ids"

    def watched(*args, **kwargs):
        out = propose(*args, **kwargs)
        rows = out.tolist() if hasattr(out, "tolist") else [list(r) for r in out]
        if runner.__dict__.get("_kvfill_watching", True):
            # a request whose prompt is still being prefilled (a chunk) has its draft discarded by vLLM
            partial = getattr(getattr(runner, "discard_request_mask", None), "np", None)
            for i, (req_id, row) in enumerate(zip(runner.input_batch.req_ids, rows)):
                if partial is None or not partial[i]:
                    log.setdefault(req_id, []).append([int(t) for t in row])
        return out

    runner.propose_draft_token_ids = watched
    return None


def stop_drafts(worker) -> dict:
    """Stop watching; the drafts so far (request id -> steps' drafts)."""
    runner = worker.model_runner
    runner._kvfill_watching = False
    return runner.__dict__.get("_kvfill_drafts", {})


def counters(llm) -> dict:
    """vLLM's speculative-decoding counters and prefix-cache hits (its metrics)."""
    out = {}
    for m in llm.get_metrics():
        name = m.name.removeprefix("vllm:spec_decode_")
        if name in SPEC_COUNTERS:
            out[name] = int(getattr(m, "value", 0))
        elif name == "num_accepted_tokens_per_pos":  # a Vector: one counter per draft position
            out[name] = [int(v) for v in getattr(m, "values", ())]
        elif m.name == "vllm:prefix_cache_hits":
            out["prefix_cache_hit_tokens"] = int(getattr(m, "value", 0))
    return out


def counters_since(after: dict, before: dict) -> dict:
    """What ``counters`` grew by between two readings (per position too)."""
    out = {}
    for k, v in after.items():
        if isinstance(v, list):
            was = before.get(k) or []
            out[k] = [a - (was[i] if i < len(was) else 0) for i, a in enumerate(v)]
        else:
            out[k] = v - before.get(k, 0)
    return out


def by_prompt(log: dict, outs) -> list:
    """Per output, in prompt order, what ``log`` holds for its request (the
    engine's request ids are the outputs' with a random suffix)."""
    short = {rid.rsplit("-", 1)[0]: v for rid, v in log.items()}
    return [short.get(o.request_id) for o in outs]


class StepTimer:
    """Times the engine core's steps, in this process (kvfill.check runs
    vLLM with ``VLLM_ENABLE_V1_MULTIPROCESSING=0``), and keeps the pure
    decode ones: no new request scheduled and no request given more than
    1 + ``spec_tokens`` tokens (a prefill chunk).  Real prefill's first
    steps mix prompt chunks into the batch and a fill's do not, so only pure
    decode steps compare.  ``steps``: (seconds, requests in the batch) of
    each pure decode step while ``on``.  Each pass (``on`` until it is
    turned off) ends with a ``PASS_DONE`` line on stdout, the step's log:
    the check's progress line counts them (``steps.PassProgress``)."""

    def __init__(self, llm, spec_tokens: int):
        self.steps: list[tuple[float, int]] = []
        self._on, self._since = False, 0.0
        core = getattr(getattr(llm.llm_engine, "engine_core", None), "engine_core", None)
        self.available = core is not None and hasattr(core, "step_fn") and hasattr(core, "scheduler")
        if not self.available:
            return
        schedule, step_fn, last = core.scheduler.schedule, core.step_fn, {}

        def watched_schedule(*args, **kwargs):
            last["out"] = out = schedule(*args, **kwargs)
            return out

        def timed():
            last.pop("out", None)
            t0 = time.perf_counter()
            result = step_fn()
            took = time.perf_counter() - t0
            out = last.get("out")
            if self.on and out is not None and out.total_num_scheduled_tokens:
                n = out.num_scheduled_tokens
                if not out.scheduled_new_reqs and max(n.values()) <= 1 + spec_tokens:
                    self.steps.append((took, len(n)))
            return result

        core.scheduler.schedule = watched_schedule
        core.step_fn = timed

    @property
    def on(self) -> bool:
        return self._on

    @on.setter
    def on(self, value: bool) -> None:
        if value and not self._on:
            self._since = time.perf_counter()
        elif self._on and not value:
            print(f"{PASS_DONE} {time.perf_counter() - self._since:.3f} s", flush=True)
        self._on = bool(value)

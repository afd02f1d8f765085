"""kvfill-check's one runner: the recording (unless ``--bank``), real
prefill, the split reference where one is needed, and each fill - every
step a process of its own (``kvfill.check.child``), one after another, so one
engine runs at a time and a failed step is reported while the others run.

Progress goes to ``log`` as each step starts, every 30 s while it runs (a
run's passes done and about how long the rest take: ``steps.PassProgress``),
and as it ends; each step's own output goes to ``OUT/logs/STEP.log``
(``steps.py``, which also stops the running step on SIGTERM, SIGHUP and
SIGINT).  On vLLM CPU each engine's KV space is sized first
(``kv_space.py``).  Once real prefill failed, the steps after it are not
run.
"""
from __future__ import annotations

import dataclasses
import json
import os
import time

from . import probes, report
from .compare import REFERENCE_FAILED
from .cli import CheckConfig, engine_kwargs, on_cpu, record_call
from .inputs import Inputs, bank_coverage, prepare, read_bank
from .kv_space import CPU_BLOCK_SIZE, kv_env, kv_space
from .replays import fill_runs, replay_config
from .steps import Stopped, _raise_if_stopped, child_env, duration, step

SAMPLE_TOKENS = 16


def fill_config(fill: str, cfg: CheckConfig, bank: str | None, stats: dict | None) -> dict:
    """A fill's ``kv_connector_extra_config``."""
    if fill == "replay" or fill in cfg.also_replay:
        return replay_config(fill, cfg, bank)
    if fill == "normal":
        mean, std = cfg.normal or ((stats["mean"], stats["std"]) if stats else (0.0, 1.0))
        return {"fill_mean": mean, "fill_std": std}
    return {"fill_mean": cfg.constant if fill == "constant" else 0.0, "fill_std": 0.0}


def run_all(cfg: CheckConfig, inputs: Inputs | None = None, log=print) -> dict:
    """Every step; what ``compare`` and ``report`` read.  ``inputs``:
    ``inputs.prepare(cfg)``'s (made here when not given: its CheckError
    comes before anything is written).  An earlier check's report in
    ``--out`` is removed before the first step.  A signal that stops the
    check (``Stopped``) carries what was measured until then as
    ``partial``: this result with every run not measured marked "not run"."""
    t_start, began = time.perf_counter(), time.time()
    inputs = inputs or prepare(cfg)
    ids, max_len = inputs.ids, inputs.max_len
    kv = kv_space(cfg, len(ids), max_len)  # CheckError when the host cannot hold it: before anything is written
    report.clear(cfg.out)
    os.makedirs(os.path.join(cfg.out, "logs"), exist_ok=True)
    if inputs.texts is not None:  # --depths: the recording and the served data set read the cut prompts
        cfg = dataclasses.replace(cfg, prompts=write_depth_prompts(cfg.out, inputs))
        log(f"--depths: {len(inputs.ids)} prompts ({len(set(inputs.depths))} depths) written to {cfg.prompts}")
    if kv:
        log(f"KV space of each engine: {kv['gib']} GiB ({kv['source']})")
    env = kv_env(kv)
    for key, value in child_env(cfg).items():
        log(f"vLLM CPU with several workers: {key}={value} (one share of this process's cores each; set it to choose)")
    config = probes.model_config(cfg.model, bool(cfg.engine.get("trust_remote_code", False)))
    engine = engine_kwargs(cfg, len(ids), max_len)
    # what the result is made of, as far as the steps got (a stop's partial report reads it)
    got = {"steps": {}, "bank": cfg.bank, "stats": inputs.stats, "held": inputs.held, "fills": {}, "runs": [],
           "moe": probes.moe_shape(config) if engine.get("enforce_eager") else None}
    try:
        _run_steps(cfg, inputs, engine, env, got, log)
    except Stopped as stop:
        not_measured = [r for r in got["runs"] if r not in got["steps"]]  # the one it stopped, and those after
        for run in not_measured:
            got["steps"][run] = {"run": run, "error": f"not run: the check was stopped by {stop.name}"}
        for run, one in got["steps"].items():  # a run whose served part the stop cut short
            if cfg.serve and run != "prefill_split" and "error" not in one and not {"served", "served_error"} & set(one):
                one["served_error"] = f"not run: the check was stopped by {stop.name}"
        measured = [r for r, one in got["steps"].items() if "error" not in one]
        stop.partial = {**_result(cfg, inputs, kv, config, got, t_start, began, partial=True),
                        "partial": {"stopped_by": stop.name, "measured": measured, "not_measured": not_measured}}
        raise
    return _result(cfg, inputs, kv, config, got, t_start, began)


DEPTH_PROMPTS = "depth-prompts.jsonl"


def write_depth_prompts(out: str, inputs: Inputs) -> str:
    """The prompts ``--depths`` cut, as a JSONL prompts file in ``out``'s
    logs (each line its text and class): what the recording and the served
    data set read in place of the user's file."""
    path = os.path.abspath(os.path.join(out, "logs", DEPTH_PROMPTS))
    with open(path, "w") as f:
        for text, c in zip(inputs.texts, inputs.classes):
            f.write(json.dumps({"prompt": text, "class": c}) + "\n")
    return path


def _run_steps(cfg: CheckConfig, inputs: Inputs, engine: dict, env: dict, got: dict, log) -> None:
    """The recording (unless --bank), real prefill, the split reference and
    each fill, one after another, into ``got`` as they end."""
    ids, max_len, steps = inputs.ids, inputs.max_len, got["steps"]
    made = cfg.bank is None
    served = cfg.serve * (1 + len(fill_runs(cfg)))
    n_steps = made + 1 + (cfg.split == "on") + len(fill_runs(cfg)) + served  # the split is known once the bank is
    if made:
        got["runs"] = ["record"]
        got["bank"] = os.path.abspath(os.path.join(cfg.out, "bank.safetensors"))
        steps["record"] = step("record", {"kind": "record", "call": record_call(cfg, got["bank"], max_len)}, cfg, 1,
                               n_steps, log, env)
        if "error" in steps["record"]:
            got["bank"] = None
    if made and got["bank"]:
        try:
            got["stats"], got["held"] = read_bank(got["bank"], ids)
        except (ValueError, OSError) as exc:  # the recording wrote what kvfill cannot read back
            steps["record"] = {**steps["record"], "error": f"its bank cannot be read: {exc}"}
            log(f"record: its bank cannot be read - {exc}")
            got["bank"] = None
    bank, stats = got["bank"], got["stats"]
    split = cfg.split == "on" or (cfg.split == "auto" and bool(stats and stats["has_state"]))
    n_steps = made + 1 + split + len(fill_runs(cfg)) + served
    spec = cfg.engine.get("speculative_config")
    if cfg.temperature > 0 and cfg.max_tokens and "max_num_batched_tokens" not in cfg.engine and on_cpu():
        # vLLM CPU cannot rewind a seeded request's generator after a step that sampled for a prompt
        # still in prefill ("CPU Generator does not use offset"): prefill every prompt in one step
        engine["max_num_batched_tokens"] = max(sum(map(len, ids)), max_len, 2048)
    base = {"kind": "run", "ids": ids, "engine": engine, "output_len": cfg.output_len,
            "max_tokens": 0 if cfg.serve else cfg.max_tokens, "temperature": cfg.temperature, "moe": got["moe"],
            "spec": bool(spec),
            "spec_tokens": _spec_tokens(spec), "decoys": decoys(ids, cfg.decoys) if cfg.decoys else None,
            "time_passes": cfg.time_passes,
            # the classes a run times apart (measure.time_passes); --time-by-class off: the whole run's passes only
            "classes": inputs.classes if cfg.time_by_class == "on" else None}
    runs = ["prefill", *(["prefill_split"] if split else []), *fill_runs(cfg)]
    got["runs"] += runs
    fills, i = got["fills"], made
    dataset = _served_dataset(cfg) if cfg.serve else None
    for run in runs:
        i += 1
        if run != "prefill" and "error" in steps["prefill"]:  # nothing to compare the rest with
            steps[run] = {"run": run, "error": REFERENCE_FAILED}
            continue
        connector, run_engine = None, engine
        if run not in ("prefill", "prefill_split"):  # a fill, or an --also-replay run
            fills[run] = fill_config(run, cfg, bank, stats)
            connector = {"kv_connector": "KVFillConnector", "kv_role": "kv_both",
                         "kv_connector_extra_config": fills[run]}
        if run in fills and fills[run].get("fill_mode") == "replay":
            if fills[run]["bank"] is None:
                del fills[run]
                steps[run] = {"run": run, "error": "not run: no bank (the recording failed; see above)"}
                log(f"[{i}/{n_steps}] {run}: not run - no bank (the recording failed)")
                continue
            run_engine, refused = replay_engine(cfg, engine, fills[run], fills[run]["bank"], max_len, log)
            if refused:
                steps[run] = {"run": run, "error": refused}
                log(f"[{i}/{n_steps}] {run}: not run - {refused}")
                i += bool(dataset)
                continue
        done = step(run, {**base, "run": run, "engine": run_engine, "connector": connector}, cfg, i, n_steps, log, env)
        if dataset and run != "prefill_split" and "error" not in done:
            i += 1
            steps[run] = done  # measured, whatever happens to its served part
            done.update(serve_step(run, cfg, run_engine, connector, dataset, base["decoys"], len(ids),
                                   f"[{i}/{n_steps}]", log, env))
            _raise_if_stopped()
        steps[run] = done
        if run == "prefill" and "error" in steps[run] and runs[1:]:
            log(f"real prefill failed: {', '.join(runs[1:])} not run (nothing to compare them with)")
        elif run == "prefill" and runs[1:]:
            left = [r for r in runs[1:] if r != "prefill_split"]  # each fill times as many passes as prefill
            log(f"      about {duration(len(left) * (done.get('step_s', 0) + done.get('served_s', 0)))} left: "
                f"{len(left)} more run(s), each about as long as real prefill's")


def _result(cfg: CheckConfig, inputs: Inputs, kv, config: dict, got: dict, t_start: float, began: float,
            partial: bool = False) -> dict:
    """What ``compare`` and ``report`` read, from ``got`` (``run_all``)."""
    ids, steps, bank, moe = inputs.ids, got["steps"], got["bank"], got["moe"]
    # replay's blocks as vLLM cut them: the block size its engine ran with (vLLM 0.34 picks the attention
    # backend's in the worker), else the one asked, vLLM CPU's default or 16, most GPU backends'
    block = next((steps[r]["block_size"] for r in ("replay", "prefill") if steps.get(r, {}).get("block_size")),
                 None) or int(cfg.engine.get("block_size") or (CPU_BLOCK_SIZE if on_cpu() else 16))
    try:
        coverage = bank_coverage(bank, ids, block) if bank else None
    except (ValueError, OSError):  # a recording the stop cut short
        if not partial:
            raise
        coverage = None
    # --also-replay's runs with a bank of their own: what each wrote, by where its rows came from
    others = {run: bank_coverage(extra["bank"], ids, block) for run, extra in got["fills"].items()
              if run != "replay" and extra.get("fill_mode") == "replay" and extra.get("bank") not in (None, bank)}
    logs = [os.path.join(cfg.out, "logs", f"{prefix}{run}{suffix}.log") for run in steps
            for prefix, suffix in (("", ""), ("served-", "-server"), ("served-", "-client"))]
    return {"prompt_tokens": [len(t) for t in ids], "prompt_classes": inputs.classes,
            "prompt_depths": inputs.depths, "depths": dict(cfg.depths) if cfg.depths else None,
            "max_model_len": inputs.max_len,
            "kv_space": kv, "bank": bank, "bank_recorded": cfg.bank is None,
            "bank_stats": got["stats"], "bank_prompts_held": got["held"], "bank_coverage": coverage,
            "replay_coverage": others, "moe": moe,
            "moe_note": _moe_note(config, moe),
            "speculative_config": cfg.engine.get("speculative_config"),
            "indexer": any(k in config for k in ("index_topk", "index_n_heads")),
            "fills": got["fills"], "steps": steps, "samples": samples(inputs.tok, steps),
            # this check's logs only (an earlier check's stay in --out/logs): vLLM's warnings on timing
            "timing_warnings": report.timing_warnings([p for p in logs if os.path.exists(p)
                                                       and os.path.getmtime(p) >= began - 1]),
            "decoys": cfg.decoys, "runtime_s": round(time.perf_counter() - t_start, 1)}


def replay_engine(cfg: CheckConfig, engine: dict, extra: dict, bank: str, max_len: int, log) -> tuple[dict, str | None]:
    """The replay run's engine flags and, where its bank would have no room,
    why it is not run: under vLLM 0.34's extensible KV cache (CUDA's
    default) the connector loads the bank only after warmup, beside a cache
    sized to leave nothing but vLLM's own peak free, so the utilization that
    leaves the bank room is passed, or a user's one that does not is refused,
    before the engine starts (``device_memory.replay_room``; the peak as real
    prefill's engine, of the same flags, measured it).  Elsewhere the flags as
    they are."""
    from .device_memory import measured_peak, release_before_serving, replay_room

    release_before_serving(None)  # --in-process: the earlier engines' memory back to the driver first
    peak = None
    for name in ("prefill.log", "served-prefill-server.log"):
        path = os.path.join(cfg.out, "logs", name)
        if peak is None and os.path.exists(path):
            with open(path, errors="replace") as f:
                peak = measured_peak(f.read())
    plan = replay_room(engine, extra, bank, max_len, peak)
    if plan is None:
        return engine, None
    if plan.refused:
        return engine, plan.line
    log(f"replay: {plan.line}")
    return (engine if plan.utilization is None else {**engine, "gpu_memory_utilization": plan.utilization}), None


def decoys(ids: list[list[int]], shared: int) -> list[list[int]]:
    """Per prompt an unrecorded one: its first ``shared`` tokens, then its other tokens reversed - and where
    that is the prompt itself (a palindrome), the first of them one id lower (or 1 for id 0)."""
    out = []
    for t in ids:
        tail = t[shared:][::-1]
        if tail == t[shared:]:
            tail = [tail[0] - 1 if tail[0] else 1, *tail[1:]]
        out.append(t[:shared] + tail)
    return out


def _served_dataset(cfg: CheckConfig) -> str:
    from kvfill.record.inputs import read_prompts

    from .serving import served_prompts

    return served_prompts(read_prompts(cfg.prompts), os.path.join(cfg.out, "logs", "served-prompts.jsonl"))


def serve_step(run: str, cfg: CheckConfig, engine: dict, connector, dataset: str, decoys, prompts: int, at: str,
               log, env: dict | None = None) -> dict:
    """``--serve``: the run served and benchmarked (``serving.served``); a
    failure is the run's ``served_error``, its engine figures stay.
    ``env``: the server's environment beside ``child_env`` (``kv_env``)."""
    from .serving import served

    log(f"{at} {run} served: starting (logs {os.path.join(cfg.out, 'logs', f'served-{run}-*.log')})")
    t0 = time.perf_counter()
    got = served(run, cfg, engine, connector, dataset, prompts, {**child_env(cfg), **(env or {})}, log, decoys)
    took = round(time.perf_counter() - t0, 1)
    if "error" in got:
        log(f"{at} {run} served: FAILED, {got['error']}")
        return {"served_error": got["error"], "served_s": took}
    log(f"{at} {run} served: done in {took:.0f} s, {got['served']['request_throughput']:.2f} requests/s")
    return {**got, "served_s": took}


def samples(tok, steps: dict) -> dict:
    """What each run wrote for the first prompt: its first SAMPLE_TOKENS greedy tokens as text."""
    return {run: tok.decode(step["greedy"][0]["tokens"][:SAMPLE_TOKENS]) for run, step in steps.items()
            if step.get("greedy")}


def _spec_tokens(spec) -> int:
    """num_speculative_tokens of a --speculative-config (a dict as parsed, or vLLM's object)."""
    if not spec:
        return 0
    value = spec.get("num_speculative_tokens") if isinstance(spec, dict) else getattr(spec, "num_speculative_tokens", 0)
    return int(value or 0)


def _moe_note(config: dict, moe) -> str | None:
    if moe or probes.moe_shape(config) is None:
        return None
    return ("not measured: the runs are compiled (--no-enforce-eager, -O, or pipeline parallelism on vLLM CPU), and "
            "router hooks do not fire in a graph")

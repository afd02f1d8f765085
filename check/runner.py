"""kvfill-check's one runner: the recording (unless ``--bank``), real
prefill, the split reference where one is needed, and each fill - every
step a process of its own (``kvfill.check.child``), one after another, so one
engine runs at a time and a failed step is reported while the others run.

Progress goes to ``log`` as each step starts, every 30 s while it runs, and
as it ends; each step's own output goes to ``OUT/logs/STEP.log``.

On vLLM CPU each engine's KV space (``VLLM_CPU_KVCACHE_SPACE``) is sized
from the prompts and max_model_len (``kv_space``), unless the user set it;
a host without the memory for it is refused before any step.  SIGTERM,
SIGHUP and SIGINT stop the check (``stop_on_signals``: ``Stopped``): the
running step's process group (or, in-process, its engine) is stopped, and
what a step leaves in its temp folder is removed whatever ended it.  Once
real prefill failed, the steps after it are not run.
"""
from __future__ import annotations

import contextlib
import glob
import json
import math
import os
import pickle
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

from . import probes
from .cli import CheckConfig, CheckError, on_cpu, engine_kwargs, record_call
from .inputs import Inputs, prepare, read_bank

HEARTBEAT_S = 30
SAMPLE_TOKENS = 16
GiB = 2**30
KV_MARGIN = 1.25  # the sized KV space over the estimate (vLLM's blocks, a hybrid's page padding)
CPU_BLOCK_SIZE = 128  # vLLM CPU's block size unless --block-size
WEIGHT_FILES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
STOP_SIGNALS = (signal.SIGTERM, signal.SIGHUP, signal.SIGINT)
REFERENCE_FAILED = "not run: real prefill failed"


class Stopped(BaseException):
    """A signal stopped the check (``stop_on_signals``): SIGTERM (``kill``,
    ``timeout``, job schedulers), SIGHUP (the terminal went away) or SIGINT
    (Ctrl-C).  Not an Exception: no step's error handling takes it for the
    step's own failure."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name

    @property
    def exit_code(self) -> int:
        return 128 + self.signum  # the shell's code for a process a signal ended: 143, 129, 130


_stopped_by: list[int] = []  # the signal stop_on_signals caught, while it holds


@contextlib.contextmanager
def stop_on_signals():
    """SIGTERM, SIGHUP and SIGINT raise ``Stopped`` in the main thread while
    the block runs, so every step's ``finally`` runs: a child step's process
    group is stopped (``step``), an in-process engine shut down.  A further
    signal while stopping is noted, not raised, so the stop is not cut
    short (a child's group gets SIGKILL 15 s after SIGTERM anyway).  A step
    that turned the signal into an error of its own (in-process, vLLM's
    workers got it too) is reported as the signal (``_raise_if_stopped``).
    Outside the main thread (no handler can be set there) nothing changes."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    before = {s: signal.getsignal(s) for s in STOP_SIGNALS}

    def stop(signum, frame):
        if not _stopped_by:
            _stopped_by.append(signum)
            raise Stopped(signum)

    for s in STOP_SIGNALS:
        signal.signal(s, stop)
    try:
        yield
    finally:
        for s, handler in before.items():
            signal.signal(s, handler)
        _stopped_by.clear()


def _raise_if_stopped(cause: BaseException | None = None) -> None:
    if _stopped_by:
        raise Stopped(_stopped_by[0]) from cause


def fill_config(fill: str, cfg: CheckConfig, bank: str | None, stats: dict | None) -> dict:
    """A fill's ``kv_connector_extra_config``."""
    if fill == "replay":
        return {"fill_mode": "replay", "bank": bank, **({"verify": "raise"} if cfg.verify else {})}
    if fill == "normal":
        mean, std = cfg.normal or ((stats["mean"], stats["std"]) if stats else (0.0, 1.0))
        return {"fill_mean": mean, "fill_std": std}
    return {"fill_mean": cfg.constant if fill == "constant" else 0.0, "fill_std": 0.0}


def run_all(cfg: CheckConfig, inputs: Inputs | None = None, log=print) -> dict:
    """Every step; what ``compare`` and ``report`` read.  ``inputs``:
    ``inputs.prepare(cfg)``'s (made here when not given: its CheckError
    comes before anything is written)."""
    t_start = time.perf_counter()
    inputs = inputs or prepare(cfg)
    tok, ids, max_len = inputs.tok, inputs.ids, inputs.max_len
    kv = kv_space(cfg, len(ids), max_len)  # CheckError when the host cannot hold it: before anything is written
    os.makedirs(os.path.join(cfg.out, "logs"), exist_ok=True)
    if kv:
        log(f"KV space of each engine: {kv['gib']} GiB ({kv['source']})")
    env = kv_env(kv)
    for key, value in child_env(cfg).items():
        log(f"vLLM CPU with several workers: {key}={value} (one share of this process's cores each; set it to choose)")
    steps: dict[str, dict] = {}
    bank, made = cfg.bank, cfg.bank is None
    served = cfg.serve * (1 + len(cfg.fills))
    n_steps = made + 1 + (cfg.split == "on") + len(cfg.fills) + served  # the split is known once the bank is
    if made:
        bank = os.path.abspath(os.path.join(cfg.out, "bank.safetensors"))
        steps["record"] = step("record", {"kind": "record", "call": record_call(cfg, bank, max_len)}, cfg, 1,
                               n_steps, log, env)
        if "error" in steps["record"]:
            bank = None
    stats, held = inputs.stats, inputs.held
    if made and bank:
        try:
            stats, held = read_bank(bank, ids)
        except (ValueError, OSError) as exc:  # the recording wrote what kvfill cannot read back
            steps["record"] = {**steps["record"], "error": f"its bank cannot be read: {exc}"}
            log(f"record: its bank cannot be read - {exc}")
            bank = None
    split = cfg.split == "on" or (cfg.split == "auto" and bool(stats and stats["has_state"]))
    n_steps = made + 1 + split + len(cfg.fills) + served
    spec = cfg.engine.get("speculative_config")
    engine = engine_kwargs(cfg, len(ids), max_len)
    if cfg.temperature > 0 and cfg.max_tokens and "max_num_batched_tokens" not in cfg.engine and on_cpu():
        # vLLM CPU cannot rewind a seeded request's generator after a step that sampled for a prompt
        # still in prefill ("CPU Generator does not use offset"): prefill every prompt in one step
        engine["max_num_batched_tokens"] = max(sum(map(len, ids)), max_len, 2048)
    config = probes.model_config(cfg.model, bool(cfg.engine.get("trust_remote_code", False)))
    moe = probes.moe_shape(config) if engine.get("enforce_eager") else None
    base = {"kind": "run", "ids": ids, "engine": engine, "output_len": cfg.output_len,
            "max_tokens": 0 if cfg.serve else cfg.max_tokens, "temperature": cfg.temperature, "moe": moe, "spec": bool(spec),
            "spec_tokens": _spec_tokens(spec), "decoys": decoys(ids, cfg.decoys) if cfg.decoys else None,
            "time_passes": cfg.time_passes}
    runs = ["prefill", *(["prefill_split"] if split else []), *cfg.fills]
    fills, i = {}, made
    dataset = _served_dataset(cfg) if cfg.serve else None
    for run in runs:
        i += 1
        if run != "prefill" and "error" in steps["prefill"]:  # nothing to compare the rest with
            steps[run] = {"run": run, "error": REFERENCE_FAILED}
            continue
        if run == "replay" and bank is None:
            steps[run] = {"run": run, "error": "not run: no bank (the recording failed; see above)"}
            log(f"[{i}/{n_steps}] replay: not run - no bank (the recording failed)")
            continue
        connector = None
        if run in cfg.fills:
            fills[run] = fill_config(run, cfg, bank, stats)
            connector = {"kv_connector": "KVFillConnector", "kv_role": "kv_both",
                         "kv_connector_extra_config": fills[run]}
        steps[run] = step(run, {**base, "run": run, "connector": connector}, cfg, i, n_steps, log, env)
        if dataset and run != "prefill_split" and "error" not in steps[run]:
            i += 1
            steps[run].update(serve_step(run, cfg, engine, connector, dataset, base["decoys"], len(ids),
                                         f"[{i}/{n_steps}]", log, env))
            _raise_if_stopped()
        if run == "prefill" and "error" in steps[run] and runs[1:]:
            log(f"real prefill failed: {', '.join(runs[1:])} not run (nothing to compare them with)")
    return {"prompt_tokens": [len(t) for t in ids], "max_model_len": max_len, "kv_space": kv, "bank": bank,
            "bank_recorded": made,
            "bank_stats": stats, "bank_prompts_held": held, "moe": moe, "moe_note": _moe_note(config, moe),
            "speculative_config": spec,
            "indexer": any(k in config for k in ("index_topk", "index_n_heads")),
            "fills": fills, "steps": steps, "samples": samples(tok, steps),
            "decoys": cfg.decoys, "runtime_s": round(time.perf_counter() - t_start, 1)}


def kv_space(cfg: CheckConfig, prompts: int, max_len: int) -> dict | None:
    """On vLLM CPU, each engine's KV space: ``{"gib": N, "source": why}``,
    the user's ``VLLM_CPU_KVCACHE_SPACE``, else sized for every sequence a
    run holds at once (the prompts, and the decoys with ``--decoys``) at
    ``max_len`` tokens (whole blocks), of the model's KV bytes per token
    over its layers (the drafter's too; kvfill-record's ``estimate``), plus
    a hybrid's recurrent state per sequence, per worker of TP x PP; times
    KV_MARGIN, in whole GiB (vLLM reads an int).  Without it vLLM CPU takes
    0.92 of the NUMA node and refuses to start on a host with less free.
    CheckError when this host's available memory is short of the KV space
    of every worker plus the model's weights.  None elsewhere (a GPU sizes
    its cache by itself)."""
    if not on_cpu():
        return None
    tp = int(cfg.engine.get("tensor_parallel_size") or 1)
    pp = int(cfg.engine.get("pipeline_parallel_size") or 1)
    given = os.environ.get("VLLM_CPU_KVCACHE_SPACE", "")
    if given:
        try:
            gib = int(given)
        except ValueError:
            gib = 0
        if gib < 1:
            raise CheckError(f"VLLM_CPU_KVCACHE_SPACE={given!r}: expected a whole number of GiB >= 1 (each engine's "
                             f"KV space on vLLM CPU), or unset (the check sizes it)")
        kv = {"gib": gib, "source": "VLLM_CPU_KVCACHE_SPACE set by the user"}
    else:
        kv = sized_kv_space(cfg, prompts, max_len)
    _check_host_memory(cfg, kv, tp * pp)
    return kv


def kv_env(kv: dict | None) -> dict:
    """The steps' environment for the KV space ``kv`` sized (a user's
    ``VLLM_CPU_KVCACHE_SPACE`` is in the environment already)."""
    return {"VLLM_CPU_KVCACHE_SPACE": str(kv["gib"])} if kv and kv["source"].startswith("sized") else {}


def sized_kv_space(cfg: CheckConfig, prompts: int, max_len: int) -> dict:
    """``kv_space``'s figure sized for ``prompts`` at ``max_len`` (the host not asked)."""
    from kvfill.record.inputs import estimate, with_drafter
    from kvfill.record.recording import _spec_dict

    tp = int(cfg.engine.get("tensor_parallel_size") or 1)
    pp = int(cfg.engine.get("pipeline_parallel_size") or 1)

    trust = bool(cfg.engine.get("trust_remote_code", False))
    dtype, kv_dtype = cfg.engine.get("dtype") or "auto", cfg.engine.get("kv_cache_dtype") or "auto"
    sequences = prompts * (2 if cfg.decoys else 1)
    block = int(cfg.engine.get("block_size") or CPU_BLOCK_SIZE)
    tokens = -(-max_len // block) * block
    try:
        est = estimate(cfg.model, sequences, sequences * tokens, dtype, kv_dtype, trust_remote_code=trust)
    except Exception as exc:  # noqa: BLE001 - a config transformers cannot read: the steps' vLLM says more
        raise CheckError(f"--model {cfg.model!r}: its config cannot be read to size the KV space "
                         f"({type(exc).__name__}: {str(exc)[:200]}); expected a model transformers reads, or "
                         f"VLLM_CPU_KVCACHE_SPACE set (GiB per engine)") from None
    spec, drafter = _spec_dict(cfg.engine), ""
    if spec:
        try:
            with_draft = with_drafter(est, cfg.model, spec, dtype, kv_dtype, trust_remote_code=trust)
            drafter = f", the drafter's {with_draft.layers - est.layers} included" if with_draft.layers > est.layers \
                else ""
            est = with_draft
        except Exception as exc:  # noqa: BLE001 - a drafter config transformers cannot read
            drafter = f", the drafter's not counted ({type(exc).__name__})"
    state = _state_bytes(cfg)
    split = pp * _tp_split(cfg, tp)
    nbytes = sequences * (tokens * est.bytes_per_token + state) / split
    gib = max(1, math.ceil(nbytes * KV_MARGIN / GiB))
    decoys = f" + {prompts} decoys" if cfg.decoys else ""
    per = f"; per worker of {split}" if split > 1 else ""
    state_note = f" + {state} B of recurrent state per sequence" if state else ""
    return {"gib": gib, "source": f"sized from {prompts} prompts{decoys} x max_model_len {max_len} "
                                  f"({est.bytes_per_token} B per token over {est.layers} layers{drafter}, blocks of "
                                  f"{block}{state_note}{per}: {nbytes / GiB:.3f} GiB, x{KV_MARGIN} margin, whole GiB)"}


def _tp_split(cfg: CheckConfig, tp: int) -> int:
    """How many ways TP splits a token's KV: by KV heads, unless the model
    has fewer than TP (replicated) or latent (MLA) rows, whole on every rank."""
    text = probes.model_config(cfg.model, bool(cfg.engine.get("trust_remote_code", False)))
    text = text.get("text_config") or text
    heads = text.get("num_key_value_heads") or text.get("num_attention_heads") or 0
    return tp if tp > 1 and not text.get("kv_lora_rank") and heads >= tp else 1


def _state_bytes(cfg: CheckConfig) -> int:
    """A hybrid's (or Mamba's) recurrent state per sequence, from vLLM's own
    state shapes (kvfill-record's ``state_bytes_per_sequence``); 0 for a
    model without.  vLLM's engine config is built here, this process's
    environment kept as it was (vLLM's platform sets variables there)."""
    from vllm.engine.arg_utils import EngineArgs

    from kvfill.connector.states import has_recurrent_state, state_bytes_per_sequence

    kw = {k: v for k, v in cfg.engine.items() if k != "speculative_config"}
    saved = dict(os.environ)
    try:
        if not has_recurrent_state(EngineArgs(model=cfg.model, **kw).create_model_config()):
            return 0
        return state_bytes_per_sequence(EngineArgs(model=cfg.model, **kw).create_engine_config())
    except Exception:  # noqa: BLE001 - vLLM refuses the flags: the steps report it in vLLM's words
        return 0
    finally:
        for key in set(os.environ) - set(saved):
            del os.environ[key]
        os.environ.update(saved)


def _check_host_memory(cfg: CheckConfig, kv: dict, workers: int) -> None:
    """CheckError when this host's available memory cannot hold one engine:
    the KV space of each of its ``workers`` and the model's weights."""
    import psutil

    weights = _weight_bytes(cfg.model)
    spec = cfg.engine.get("speculative_config")
    if isinstance(spec, dict) and spec.get("model"):
        weights += _weight_bytes(spec["model"])
    need, free = kv["gib"] * GiB * workers + weights, psutil.virtual_memory().available
    if free < need:
        each = f" x {workers} workers" if workers > 1 else ""
        raise CheckError(f"this host has {free / GiB:.1f} GiB of memory available; each run's engine needs about "
                         f"{need / GiB:.1f} GiB (KV space {kv['gib']} GiB{each}, {kv['source']}; + the weights, "
                         f"{weights / GiB:.2f} GiB): expected a host with more free memory, or fewer or shorter "
                         f"prompts (a smaller --max-model-len, --output-len, --max-tokens)" + (
                             ", or a smaller VLLM_CPU_KVCACHE_SPACE" if "user" in kv["source"] else ""))


def _weight_bytes(model: str) -> int:
    """The bytes of a model's weight files: its folder's, or the hub cache's
    copy of a hub name; 0 when neither is here (vLLM then downloads them)."""
    folder = model
    if not os.path.exists(model):
        try:
            from huggingface_hub import snapshot_download

            folder = snapshot_download(model, local_files_only=True)
        except Exception:  # noqa: BLE001 - not in the local cache
            return 0
    if os.path.isfile(folder):
        return os.path.getsize(folder)
    files = [os.path.join(root, f) for root, _, names in os.walk(folder) for f in names]
    safetensors = [f for f in files if f.endswith(".safetensors")]  # what vLLM loads where a folder has several
    return sum(os.path.getsize(f) for f in safetensors or [f for f in files if f.endswith(WEIGHT_FILES)])


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


def child_env(cfg: CheckConfig) -> dict:
    """On vLLM CPU with several workers (TP x PP) and no ``VLLM_CPU_OMP_THREADS_BIND``:
    this process's cores split evenly between them (``worker_cores``)."""
    workers = int(cfg.engine.get("tensor_parallel_size") or 1) * int(cfg.engine.get("pipeline_parallel_size") or 1)
    return worker_cores(workers) if on_cpu() else {}


def worker_cores(workers: int) -> dict:
    """``VLLM_CPU_OMP_THREADS_BIND`` giving each of ``workers`` vLLM CPU workers
    an even share of this process's cores, unless the user set it.  vLLM's
    own binding ("auto") gives each worker a NUMA node and refuses more
    workers than nodes."""
    if workers < 2 or "VLLM_CPU_OMP_THREADS_BIND" in os.environ:
        return {}
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < workers:
        return {}  # vLLM says why it cannot bind
    per = len(cores) // workers
    return {"VLLM_CPU_OMP_THREADS_BIND": "|".join(",".join(map(str, cores[w * per:(w + 1) * per]))
                                                  for w in range(workers))}


def step(name: str, job: dict, cfg: CheckConfig, i: int, n: int, log, env: dict | None = None) -> dict:
    """One step in a child process, bounded by ``--run-timeout`` (or in this
    one, ``--in-process``); its result, or ``{"error": ...}`` naming how it
    failed and its log.  ``env``: the step's environment beside this
    process's and ``child_env`` (``kv_env``).  The child's temp folder
    (``TMPDIR``: vLLM's rendezvous files, the recorder's and its workers'
    folders) is one of the step's own, removed with what it names in
    /dev/shm however the step ended - a child killed (SIGKILL) cleans
    nothing up itself; so is a recording's work folder beside its bank
    when the step was stopped or killed."""
    if cfg.in_process:
        return _in_process(name, job, cfg, i, n, log, env)
    logs = os.path.join(cfg.out, "logs")
    job_file, result_file, log_file = (os.path.join(logs, f"{name}.{ext}") for ext in ("job", "json", "log"))
    with open(job_file, "wb") as f:
        pickle.dump(job, f)
    if os.path.exists(result_file):
        os.unlink(result_file)
    tmp = tempfile.mkdtemp(prefix=f"kvfill-step-{name}-")
    work = _record_work(job)
    before = set(glob.glob(work)) if work else set()
    env = {**os.environ, **child_env(cfg), **(env or {}), "TMPDIR": tmp,
           "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}  # the hooks live in this process
    log(f"[{i}/{n}] {name}: starting (log {log_file})")
    t0 = time.perf_counter()
    rc = None
    try:
        with open(log_file, "w") as out:
            proc = subprocess.Popen([sys.executable, "-m", "kvfill.check.child", job_file, result_file], stdout=out,
                                    stderr=subprocess.STDOUT, env=env, start_new_session=True)
            try:
                rc = _wait(proc, name, cfg, log)
            finally:
                _stop(proc)  # what of its group is left, also after the child's own exit
    finally:
        _remove_tempdir(tmp)
        if work and (rc is None or rc < 0):  # stopped or killed: the recorder could not remove it
            for folder in set(glob.glob(work)) - before:
                shutil.rmtree(folder, ignore_errors=True)
    took = round(time.perf_counter() - t0, 1)
    os.unlink(job_file)
    if rc == 0 and os.path.exists(result_file):
        with open(result_file) as f:
            result = json.load(f)
        log(f"[{i}/{n}] {name}: done in {took:.0f} s")
        return {**result, "step_s": took}
    why = f"stopped after --run-timeout {cfg.run_timeout:g} s" if rc is None else f"exit {rc}"
    error = f"{why}: {_last_error(log_file)} (log {log_file})"
    log(f"[{i}/{n}] {name}: FAILED, {error}")
    return {"run": name, "error": error, "step_s": took}


def _record_work(job: dict) -> str | None:
    """A recording step's work folders, as a glob: ``kvfill-record-*``
    beside its bank (kvfill-record's ``_work_dir``); None for a run."""
    if job.get("kind") != "record":
        return None
    return os.path.join(glob.escape(os.path.dirname(os.path.abspath(job["call"]["out"]))), "kvfill-record-*")


def _remove_tempdir(folder: str) -> None:
    """A step's temp folder, with the shared-memory segments of each vLLM
    rendezvous file in it (at any depth: the engine's own temp folder is
    inside)."""
    from kvfill.record.engine import remove_vllm_tempdir

    ids = {os.path.basename(p) for p in glob.glob(os.path.join(glob.escape(folder), "**", "vllm_dist_*"),
                                                  recursive=True)}
    remove_vllm_tempdir(folder, ids)


def _in_process(name: str, job: dict, cfg: CheckConfig, i: int, n: int, log, env: dict | None = None) -> dict:
    """The step here, its exception reported as a child's failure is; the raw
    result in logs/NAME.json.  A signal that stopped the check while the
    step ran is raised as such (``Stopped``), whatever the step made of it."""
    import gc
    import traceback

    from .child import execute

    env = {**child_env(cfg), **(env or {}), "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    before = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    log(f"[{i}/{n}] {name}: starting (in this process)")
    t0 = time.perf_counter()
    try:
        result = execute(job)
    except Exception as exc:
        _raise_if_stopped(exc)
        traceback.print_exc()
        error = f"{type(exc).__name__}: {str(exc)[:400]}"
        log(f"[{i}/{n}] {name}: FAILED, {error}")
        return {"run": name, "error": error, "step_s": round(time.perf_counter() - t0, 1)}
    finally:
        for k, v in before.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        gc.collect()  # the engine's memory before the next one's
    _raise_if_stopped()
    took = round(time.perf_counter() - t0, 1)
    with open(os.path.join(cfg.out, "logs", f"{name}.json"), "w") as f:
        json.dump(result, f)
    log(f"[{i}/{n}] {name}: done in {took:.0f} s")
    return {**result, "step_s": took}


def _wait(proc: subprocess.Popen, name: str, cfg: CheckConfig, log) -> int | None:
    """The child's exit status, or None when it ran past ``cfg.run_timeout``
    (read at each look: a caller may shorten it) and was stopped."""
    t0 = time.perf_counter()
    next_beat = HEARTBEAT_S
    while proc.poll() is None:
        elapsed = time.perf_counter() - t0
        if elapsed > cfg.run_timeout:
            _stop(proc)
            return None
        if elapsed >= next_beat:
            log(f"      {name}: running, {elapsed:.0f} s")
            next_beat += HEARTBEAT_S
        time.sleep(0.5)
    return proc.returncode


def _stop(proc: subprocess.Popen) -> None:
    """The step's process group (its leader ``proc``): SIGTERM, then SIGKILL
    to what is left after 15 s; returns once the group is gone (or 5 s after
    SIGKILL).  Also after the leader's own exit: its workers may outlive it."""
    for sig, grace in ((signal.SIGTERM, 15), (signal.SIGKILL, 5)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            proc.poll()  # the leader reaped, if it exited
            return
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline:
            proc.poll()
            try:
                os.killpg(proc.pid, 0)
            except ProcessLookupError:
                return
            time.sleep(0.1)


def _last_error(log_file: str) -> str:
    """The log's last line naming an error, else its last line."""
    with open(log_file, errors="replace") as f:
        lines = [ln.strip() for ln in f if ln.strip()]
    errors = [ln for ln in lines if "Error" in ln or "error:" in ln]
    return (errors or lines or ["no output"])[-1][:400]

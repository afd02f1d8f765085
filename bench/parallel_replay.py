"""Replay under tensor and pipeline parallelism on vLLM CPU: record the same
prompts under each of ``--record`` configurations, replay every bank under
each of ``--replay``, and compare greedy tokens with real prefill under the
replaying configuration.

    python bench/parallel_replay.py                            # record TP 1, TP 2 x replay TP 1, TP 2
    python bench/parallel_replay.py --record tp1 tp2 pp2 --replay tp1 tp2 pp2 --json out/parallel-replay.json

A configuration is ``tpN`` (``--tensor-parallel-size N``) or ``ppN``
(``--pipeline-parallel-size N``).  vLLM CPU runs PP only with compilation on
(with ``enforce_eager`` its warm-up is skipped, and a later stage then has no
buffer for the activations it receives: ``sync_and_gather_intermediate_tensors``
asserts), so PP runs compile (slower to start).

A bank is canonical (every KV head of every layer, ``kvfill/bank/format.py``):
recorded at TP 2, each worker saves its heads and the recorder merges them;
replayed at TP 2, each rank loads only its heads, at PP 2 only its stage's
layers (``kvfill/bank/parts.py``).  The
model is the float32 tiny Llama with peaked next-token distributions (8 KV
heads, so TP 2 splits them 4 + 4).  Two workers on this 2-core machine need
``VLLM_CPU_OMP_THREADS_BIND="0|1"`` (one core per worker; set here).  Each
configuration's runs share one child process (vLLM imported once), one engine
after another; a ``constant`` synthetic fill per replaying configuration
shows that tokens depend on the KV.

A bank recorded under another configuration carries its reduction order (TP
all-reduces partial sums): its KV differs from this configuration's prefill in
the last bits, so tokens are compared for equality and logprobs within
``--tolerance``.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

from kvfill.bench.common import child_result, print_result, table
from kvfill.bench.models import make_model, make_tokenizer
from kvfill.bench.replay_e2e import (
    PEAKED_STD, compare, connector_config, greedy_rows, prompt_ids, write_prompts,
)


def engine_kwargs(config: str) -> dict:
    """vLLM's arguments for ``tpN`` / ``ppN``."""
    kind, size = config[:2], int(config[2:])
    if kind == "tp":  # recorded and replayed eager, as every run here
        return {"tensor_parallel_size": size, "enforce_eager": True}
    return {"pipeline_parallel_size": size, "enforce_eager": size == 1}  # vLLM CPU's PP needs its compile warm-up


def parse_config(text: str) -> str:
    if len(text) < 3 or text[:2] not in ("tp", "pp") or not text[2:].isdigit() or int(text[2:]) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: expected tpN or ppN (N >= 1)")
    return text


def child_env(config: str) -> dict:
    env = dict(os.environ)
    env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    workers = int(config[2:])
    if workers > 1:  # one core per worker (shared/notes/serving-cpu.md)
        env["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(str(c % (os.cpu_count() or 1)) for c in range(workers))
    return env


def generate(a, kt: dict | None) -> list[dict]:
    """Greedy tokens and their logprobs of every prompt on a new engine under ``a.config``."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from kvfill.record.engine import llm_engine

    ids = prompt_ids(a.model, a.prompts_file)
    kw = {"enforce_eager": True, **engine_kwargs(a.config)}
    params = SamplingParams(max_tokens=a.output_len, temperature=0.0, logprobs=1, ignore_eos=True, detokenize=False)
    # stopped on leaving, its workers reaped and vLLM CPU's files removed
    with llm_engine(model=a.model, dtype="float32", skip_tokenizer_init=True, max_model_len=a.max_model_len,
                    max_num_seqs=len(ids), disable_log_stats=True, seed=0, enable_prefix_caching=False,
                    **({"kv_transfer_config": kt} if kt else {}), **kw) as llm:
        return greedy_rows(llm.generate([TokensPrompt(prompt_token_ids=t) for t in ids], params, use_tqdm=False))


def child(a) -> dict:
    """One configuration's steps: ``record:<bank>``, ``prefill``, ``replay:<bank>``, ``constant``."""
    import gc

    from kvfill.record import record

    results = {}
    for step in a.steps.split(","):
        kind, _, bank = step.partition(":")
        if kind == "record":
            record(a.model, a.prompts_file, bank, dtype="float32", max_model_len=a.max_model_len,
                   llm_kwargs=engine_kwargs(a.config), log=lambda line: print(line, flush=True))
        else:
            results[step] = {"run": step, "outputs": generate(a, connector_config(kind, bank))}
        gc.collect()
    return results


def bank_path(out_dir: str, config: str) -> str:
    return os.path.join(out_dir, f"bank-{config}.safetensors")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--record", type=parse_config, nargs="+", default=["tp1", "tp2"], metavar="CONFIG",
                   help="configurations recording a bank: tpN, ppN (default tp1 tp2)")
    p.add_argument("--replay", type=parse_config, nargs="+", default=["tp1", "tp2"], metavar="CONFIG",
                   help="configurations replaying every bank (default tp1 tp2)")
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--prompt-len", type=int, default=200)
    p.add_argument("--output-len", type=int, default=12)
    p.add_argument("--no-constant", action="store_true", help="skip the constant fill runs (the tests' short run)")
    p.add_argument("--tolerance", type=float, default=0.05, help="largest |logprob difference| replay may show")
    p.add_argument("--out-dir", default=None, help="work folder (default out/parallel-replay)")
    p.add_argument("--json", default=None)
    p.add_argument("--config", default="tp1", help=argparse.SUPPRESS)
    p.add_argument("--steps", default=None, help=argparse.SUPPRESS)
    p.add_argument("--model", default=None, help=argparse.SUPPRESS)
    p.add_argument("--prompts-file", default=None, help=argparse.SUPPRESS)
    p.add_argument("--max-model-len", type=int, default=None, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.steps:
        print_result(child(a))
        return 0
    root = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "out")
    out_dir = os.path.abspath(a.out_dir or os.path.join(root, "parallel-replay"))
    os.makedirs(out_dir, exist_ok=True)
    a.model = make_tokenizer(make_model(os.path.abspath(os.path.join(root, "tiny-llama-peaked")),
                                        init_std=PEAKED_STD))
    a.prompts_file = os.path.join(out_dir, "prompts.txt")
    write_prompts(a.prompts_file, a.prompts, a.prompt_len, seed=2)
    a.max_model_len = a.prompt_len + a.output_len + 16
    # Per configuration, in an order where every bank exists before it is
    # replayed: the recording ones first; replays run with the last recording
    # one's steps or after them.
    order = list(dict.fromkeys(a.record + a.replay))
    plan = {c: ([f"record:{bank_path(out_dir, c)}"] if c in a.record else [])
            + (["prefill"] + ([] if a.no_constant else ["constant"]) if c in a.replay else []) for c in order}
    later = {c: [f"replay:{bank_path(out_dir, r)}" for r in dict.fromkeys(a.record)] for c in a.replay}
    last_recording = max(order.index(c) for c in a.record)
    results: dict[str, dict] = {}
    for i, c in enumerate(order):
        results[c] = run(a, c, plan[c] + (later.pop(c, []) if i >= last_recording else []))
    for c, steps in later.items():
        results[c].update(run(a, c, steps))
    rows = []
    for c in dict.fromkeys(a.replay):
        ref = results[c]["prefill"]
        for r in dict.fromkeys(a.record):
            rows.append({**compare(ref, results[c][f"replay:{bank_path(out_dir, r)}"]),
                         "run": f"bank recorded {r}, replayed {c}"})
        if not a.no_constant:
            rows.append({**compare(ref, results[c]["constant"]), "run": f"constant, {c}"})
    print(f"\n{a.prompts} prompts of {a.prompt_len} tokens, {a.output_len} greedy tokens; tiny Llama (8 KV heads), "
          f"float32; each compared with real prefill under the replaying configuration")
    print(table(rows, ["run", "prompts_identical", "tokens_equal_to_prefill", "max_abs_logprob_diff"]))
    replays = [r for r in rows if r["run"].startswith("bank")]
    ok = all(r["identical"] and r["max_abs_logprob_diff"] <= a.tolerance for r in replays) and not any(
        r["identical"] for r in rows if r["run"].startswith("constant"))
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"args": {k: v for k, v in vars(a).items() if k not in ("steps", "config")}, "rows": rows,
                       "outputs": results}, f, indent=1)
    print("replay equals real prefill at every pairing; the synthetic fill differs" if ok else "CLAIM NOT MET")
    return 0 if ok else 1


def run(a, config: str, steps: list[str]) -> dict:
    names = [kind + (f" {os.path.basename(path)}" if path else "") for kind, _, path in (s.partition(":") for s in steps)]
    print(f"{config}: {', '.join(names)} ...", flush=True)
    cmd = [sys.executable, os.path.abspath(__file__), "--config", config, "--steps", ",".join(steps), "--model",
           a.model, "--prompts-file", a.prompts_file, "--max-model-len", str(a.max_model_len), "--output-len",
           str(a.output_len)]
    return child_result(cmd, f"the {config} runs", timeout=600 * len(steps), env=child_env(config))


if __name__ == "__main__":
    sys.exit(main())

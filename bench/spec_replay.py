"""Speculative decoding from replayed KV: do drafts get accepted as after
real prefill?

    python bench/spec_replay.py                    # self-draft (draft_model) on the tiny Llama, 3 x 180-340 tokens
    python bench/spec_replay.py --method ngram     # prompt lookup on the tiny Llama
    python bench/spec_replay.py --record-tp 2 --tp 2   # recorded and replayed at TP 2 (vLLM CPU: one core per worker)

A bank is recorded with the runs' ``--speculative-config`` (kvfill-record
then records the drafter's KV cache layers too), and each run generates
greedy tokens from the same prompts under the same speculative config, one
child process (one per run with ngram):
  * ``prefill``  - no connector: vLLM computes the prompt's KV (and the drafter's)
  * ``replay``   - kvfill, ``fill_mode: replay`` from the bank
  * ``normal``   - kvfill, synthetic normal(0, 1) KV
  * ``constant`` - kvfill, the constant 0.015
Per run it reports the greedy tokens equal to real prefill's and vLLM's own
speculative-decoding counters (``LLM.get_metrics``): drafts, draft tokens,
accepted tokens, and the mean acceptance length (tokens per step:
1 + accepted / drafts), and - for drafters with KV - how many steps' drafts
(the token ids the drafter proposed, watched in vLLM's worker) equal real
prefill's.  The claim checked: replay's tokens, counters and drafts equal
real prefill's, a synthetic fill's differ.

``--method draft_model``: the drafter is the target's own weights in a folder
of their own (``out/tiny-llama-peaked-draft``), so after real prefill it
proposes the target's greedy tokens.  ``--method eagle``: a random EAGLE head for the tiny Llama
(``make_eagle_head``; its one layer caches KV as ``model.layers.4``).
``--method mtp``: a tiny MiMo-style model with one MTP layer
(``make_mtp_model``), served with ``method: mtp``.
``--method ngram``: vLLM's prompt
lookup (``prompt_lookup_min`` 2, ``max`` 5) - no drafter KV, acceptance
follows what the model writes.  On a trained model and real text, where what
the model writes - and so ngram's acceptance - depends on the prompt's KV:
``python bench/check_presets.py real`` (kvfill-check, SmolLM2-135M).
"""
from __future__ import annotations

import argparse
import json
import os
import sys

from kvfill.bench.common import child_result, print_result, run_child, run_each, table
from kvfill.bench.parallel_replay import child_env as _parallel_env
from kvfill.bench.models import make_model, make_tokenizer
from kvfill.bench.replay_e2e import PEAKED_STD, compare, greedy_rows, prompt_ids
from kvfill.bench.spec_models import make_draft, make_eagle_head, make_mtp_model
from kvfill.check import probes

RUNS = ("prefill", "replay", "normal", "constant")
METHODS = ("draft_model", "eagle", "mtp", "ngram")
COUNTERS = probes.SPEC_COUNTERS


def child_env(tp: int) -> dict:
    """A child's environment at tensor parallel size ``tp`` (one core per worker)."""
    return _parallel_env(f"tp{tp}")


def spec_config(a) -> dict:
    if a.method in ("draft_model", "eagle"):
        return {"method": a.method, "model": a.draft, "num_speculative_tokens": a.num_spec}
    if a.method == "mtp":  # the model's own MTP layer; vLLM's MiMo MTP predicts one token
        return {"method": "mtp", "num_speculative_tokens": 1}
    return {"method": "ngram", "num_speculative_tokens": a.num_spec, "prompt_lookup_min": 2, "prompt_lookup_max": 5}


def write_prompts(path: str, lengths: list[int], seed: int) -> None:
    import random

    r = random.Random(seed)
    with open(path, "w") as f:
        for n in lengths:
            f.write(" ".join(f"w{r.randrange(3, 1000)}" for _ in range(n)) + "\n")


def connector_config(run: str, bank: str) -> dict | None:
    extra = {"replay": {"fill_mode": "replay", "bank": bank}, "normal": {"fill_mean": 0.0, "fill_std": 1.0},
             "constant": {"fill_std": 0.0}}.get(run)
    return None if extra is None else {"kv_connector": "KVFillConnector", "kv_role": "kv_both",
                                       "kv_connector_extra_config": extra}


def counters(llm) -> dict:
    """vLLM's speculative-decoding counters of this engine (its metrics)."""
    got = probes.counters(llm)
    return {k: got[k] for k in COUNTERS if k in got}


def run_one(a, run: str) -> dict:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from kvfill.record.engine import llm_engine

    ids = prompt_ids(a.tokenizer, a.prompts_file)
    kw = {}
    kt = connector_config(run, a.bank)
    if kt is not None:
        kw["kv_transfer_config"] = kt
    params = SamplingParams(max_tokens=a.output_len, temperature=0.0, logprobs=1, ignore_eos=True, detokenize=False)
    with llm_engine(model=a.model, tokenizer=a.tokenizer, dtype=a.dtype, enforce_eager=True,
                    max_model_len=a.max_model_len, disable_log_stats=False, enable_prefix_caching=False, seed=0,
                    max_num_seqs=len(ids), tensor_parallel_size=a.tp, speculative_config=spec_config(a), **kw) as llm:
        watched = a.method != "ngram" and all(llm.collective_rpc(probes.watch_drafts))
        outs = llm.generate([TokensPrompt(prompt_token_ids=t) for t in ids], params, use_tqdm=False)
        rows = greedy_rows(outs)
        if watched:  # per prompt, in prompt order: every draft its requests got (TP rank 0's: all ranks agree)
            for r, d in zip(rows, probes.by_prompt(llm.collective_rpc(probes.stop_drafts)[0], outs)):
                r["drafts"] = d or []
        got = counters(llm)
    return {"run": run, "outputs": rows, "counters": got}


def drafts_equal(ref: dict, res: dict) -> str | None:
    """Steps whose drafts equal real prefill's, over prefill's steps (None:
    drafts not watched, ngram)."""
    if "drafts" not in ref["outputs"][0]:
        return None
    same = total = 0
    for r, o in zip(ref["outputs"], res["outputs"]):
        total += len(r["drafts"])
        same += sum(x == y for x, y in zip(r["drafts"], o["drafts"])) if len(r["drafts"]) == len(o["drafts"]) else 0
    return f"{same}/{total}"


def row(ref: dict, res: dict) -> dict:
    c = res["counters"]
    out = compare(ref, res) if res is not ref else {"run": "prefill", "tokens_equal_to_prefill": "reference"}
    out["drafts_equal_to_prefill"] = drafts_equal(ref, res) if res is not ref else "reference"
    drafts = c.get("num_drafts", 0)
    return {**out, **c, "tokens_per_step": round(1 + c.get("num_accepted_tokens", 0) / drafts, 3) if drafts else None}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--method", choices=METHODS, default="draft_model")
    p.add_argument("--num-spec", type=int, default=3, help="num_speculative_tokens")
    p.add_argument("--prompt-lens", type=int, nargs="+", default=[180, 260, 340], metavar="N")
    p.add_argument("--output-len", type=int, default=24)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--runs", nargs="+", choices=RUNS, default=list(RUNS))
    p.add_argument("--record-tp", type=int, default=1, help="the recording's tensor parallel size")
    p.add_argument("--tp", type=int, default=1, help="the runs' tensor parallel size")
    p.add_argument("--json", default=None)
    p.add_argument("--only", default=None, help=argparse.SUPPRESS)
    for hidden in ("--bank", "--prompts-file", "--model", "--draft", "--tokenizer"):
        p.add_argument(hidden, default=None, help=argparse.SUPPRESS)
    p.add_argument("--max-model-len", type=int, default=None, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    root = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "out")
    a.model = os.path.abspath(a.model or os.path.join(
        root, "tiny-mimo-mtp" if a.method == "mtp" else "tiny-llama-peaked"))
    a.tokenizer = os.path.abspath(a.tokenizer or (os.path.join(root, "tiny-llama-peaked") if a.method == "mtp"
                                                  else a.model))
    a.draft = os.path.abspath(a.draft or a.model + ("-eagle" if a.method == "eagle" else "-draft"))
    a.max_model_len = a.max_model_len or max(a.prompt_lens) + a.output_len + a.num_spec + 16
    if a.only:
        print_result(run_each(a.only, lambda run: run_one(a, run)))
        return 0
    out_dir = os.path.join(root, f"spec-replay-{a.method}")
    os.makedirs(out_dir, exist_ok=True)
    a.prompts_file = os.path.join(out_dir, "prompts.txt")
    a.bank = os.path.join(out_dir, "bank.safetensors")
    make_tokenizer(make_model(os.path.join(root, "tiny-llama-peaked"), init_std=PEAKED_STD))
    if a.method == "mtp":
        make_mtp_model(a.model)
    write_prompts(a.prompts_file, a.prompt_lens, seed=1)
    lengths = [len(t) for t in prompt_ids(a.tokenizer, a.prompts_file)]
    if a.method == "draft_model":
        make_draft(a.model, a.draft)
    elif a.method == "eagle":
        make_eagle_head(a.model, a.draft)
    a.max_model_len = max(a.max_model_len, max(lengths) + a.output_len + a.num_spec + 16)
    spec = json.dumps(spec_config(a))
    rec = run_child([sys.executable, "-m", "kvfill.record", "--model", a.model, "--prompts", a.prompts_file,
                     "--out", a.bank, "--dtype", a.dtype, "--max-model-len", str(a.max_model_len),
                     "--tokenizer", a.tokenizer, "--speculative-config", spec, "--tensor-parallel-size",
                     str(a.record_tp), "--enforce-eager"], "recording", timeout=900, env=child_env(a.record_tp))
    print(next(line for line in rec.stdout.splitlines() if line.startswith("wrote")), flush=True)
    runs = [r for r in RUNS if r == "prefill" or r in a.runs]
    cmd = [sys.executable, os.path.abspath(__file__), "--bank", a.bank, "--prompts-file", a.prompts_file, "--model",
           a.model, "--tokenizer", a.tokenizer, "--draft", a.draft, "--dtype", a.dtype, "--method", a.method,
           "--num-spec", str(a.num_spec), "--output-len", str(a.output_len), "--max-model-len", str(a.max_model_len),
           "--tp", str(a.tp)]
    # vLLM CPU fails to start a second engine with ngram in one process (its kernel overrides): one each
    groups = [[r] for r in runs] if a.method == "ngram" else [runs]
    print(f"running {', '.join(runs)} with speculative config {spec} ({len(groups)} process(es)) ...", flush=True)
    results = {}
    for group in groups:
        results.update(child_result([*cmd, "--only", ",".join(group)], f"the {'/'.join(group)} run(s)",
                                    timeout=900 * len(group), env=child_env(a.tp)))
    rows = [row(results["prefill"], results[r]) for r in runs]
    print(f"\n{len(lengths)} prompts of {lengths} tokens, {a.output_len} greedy tokens; model "
          f"{os.path.basename(a.model)}, {a.dtype}, TP {a.tp}; speculative config {spec}; bank recorded with it at "
          f"TP {a.record_tp}")
    print(table(rows, ["run", "tokens_equal_to_prefill", "drafts_equal_to_prefill", *COUNTERS, "tokens_per_step"]))
    ref = rows[0]

    def same(r):  # vLLM's counters, and (where watched) every draft, as real prefill's
        d = r.get("drafts_equal_to_prefill")
        return all(r.get(k) == ref.get(k) for k in COUNTERS) and (d is None or d.split("/")[0] == d.split("/")[1])

    replay = next(r for r in rows if r["run"] == "replay")
    synthetic = [r for r in rows if r["run"] in ("normal", "constant")]
    ok = replay["identical"] and same(replay) and not any(r["identical"] and same(r) for r in synthetic)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"args": {k: v for k, v in vars(a).items() if k != "only"}, "prompt_tokens": lengths,
                       "rows": rows, "outputs": results}, f, indent=1)
    print("replay's tokens and acceptance equal real prefill's; synthetic fills differ" if ok else "CLAIM NOT MET")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

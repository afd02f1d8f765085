"""Replay on hybrid models: attention KV *and* the linear layers' recurrent
state from one recording - does decode continue as after real prefill?

    python bench/hybrid_replay.py                        # tiny Qwen3-Next (gated delta-net + attention + MoE)
    python bench/hybrid_replay.py --kind mamba2          # tiny Granite-4-H (Mamba-2 + attention + MoE)
    python bench/hybrid_replay.py --record-tp 2 --tp 1   # recorded at TP 2, replayed at TP 1 (and --tp 2)
    python bench/hybrid_replay.py --ssm-dtype float32    # vLLM's --mamba-ssm-cache-dtype, recording and runs

A bank is recorded with ``kvfill-record``'s defaults (its state section: each
prompt's state after all but its last token), then each run generates greedy
tokens from the same prompts, one engine after another in a child process:
  * ``prefill``       - no connector: vLLM computes the prompt's KV and state
  * ``prefill_split`` - no connector, each prompt on an engine of its own
    whose chunked prefill computes its first N - 1 tokens in one step and the
    last in the next: real prefill split where a fill splits it
  * ``replay``        - kvfill, ``fill_mode: replay`` (``verify: raise``:
    every written row and state page read back)
  * ``normal``        - kvfill, synthetic normal(0, 1) KV and the zero state
and reports per run the greedy tokens equal to real prefill's, and replay's
against ``prefill_split``.  The claim checked: replay's tokens equal real
prefill's split as the fill splits it, a synthetic fill's differ.  The split
is a floor of its own: the models are bf16 (vLLM CPU runs gated delta-net
in bf16 only), and real prefill carries the state past position N - 1
inside one kernel, where a split stores it in the cache's dtype and
computes the last token in a decode step - enough to flip a near-tied
greedy token of these random-weight models some steps in.  Recorded at
another TP size than the runs', the bank holds that engine's numerics
(bf16 all-reduces round differently); replay is then compared with real
prefill at the recording's TP size (``prefill_at_record_tp``), and the
claim is every prompt's first token as that one's and more of its tokens
than a synthetic fill (the last prompt token and the decode run at the
replaying TP size: its numerics take over).
"""
from __future__ import annotations

import argparse
import json
import os
import sys

from kvfill.bank import Bank
from kvfill.bench.common import child_result, cpu_features, print_result, run_child, run_each, table
from kvfill.bench.models import HYBRID_KINDS, make_hybrid_model
from kvfill.bench.parallel_replay import child_env as _parallel_env
from kvfill.bench.replay_e2e import compare, decoys, greedy_rows, prompt_ids
from kvfill.bench.check_presets import word_prompts

RUNS = ("prefill", "prefill_split", "replay", "normal")


def child_env(tp: int) -> dict:
    return _parallel_env(f"tp{tp}")


def connector_config(run: str, bank: str) -> dict | None:
    extra = {"replay": {"fill_mode": "replay", "bank": bank, "verify": "raise"},
             "normal": {"fill_mean": 0.0, "fill_std": 1.0}}.get(run)
    return None if extra is None else {"kv_connector": "KVFillConnector", "kv_role": "kv_both",
                                       "kv_connector_extra_config": extra}


def ssm_kwargs(a) -> dict:
    return {} if a.ssm_dtype == "auto" else {"mamba_ssm_cache_dtype": a.ssm_dtype}


def run_one(a, run: str) -> dict:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from kvfill.record.engine import llm_engine

    ids = prompt_ids(a.model, a.prompts_file)
    kw = {}
    kt = connector_config(run.removesuffix("_at_record_tp"), a.bank)
    if kt is not None:
        kw["kv_transfer_config"] = kt
    params = SamplingParams(max_tokens=a.output_len, temperature=0.0, logprobs=1, ignore_eos=True, detokenize=False)
    prefix_caching = a.prefix_caching and run != "prefill_split"  # the split reference: as without it
    common = dict(model=a.model, dtype=a.dtype, enforce_eager=True, max_model_len=a.max_model_len,
                  enable_prefix_caching=prefix_caching, disable_log_stats=not prefix_caching, seed=0,
                  tensor_parallel_size=a.tp, **ssm_kwargs(a))
    if run == "prefill_split":  # per prompt: its first N - 1 tokens in one step, the last in the next
        outs = []
        for t in ids:
            with llm_engine(**common, max_num_seqs=1, enable_chunked_prefill=True,
                            max_num_batched_tokens=len(t) - 1) as llm:
                outs += llm.generate([TokensPrompt(prompt_token_ids=t)], params, use_tqdm=False)
        return {"run": run, "outputs": greedy_rows(outs)}
    with llm_engine(**common, max_num_seqs=len(ids), **kw) as llm:
        if prefix_caching and a.shared_prefix:  # cached blocks (and states) of each prompt's first tokens
            llm.generate([TokensPrompt(prompt_token_ids=d) for d in decoys(ids, a.shared_prefix)],
                         SamplingParams(max_tokens=1, ignore_eos=True, detokenize=False), use_tqdm=False)
        outs = llm.generate([TokensPrompt(prompt_token_ids=t) for t in ids], params, use_tqdm=False)
        hits = _prefix_hits(llm) if prefix_caching else None
    return {"run": run, "outputs": greedy_rows(outs), "prefix_cache_hit_tokens": hits}


def _prefix_hits(llm) -> int | None:
    """vLLM's prefix cache hits of this engine, in tokens (its metrics)."""
    from kvfill.check.probes import counters

    return counters(llm).get("prefix_cache_hit_tokens")


def write_nested_prompts(path: str, lengths: list[int], seed: int) -> None:
    """Prompts of ``lengths`` words (one token each), each the first words
    of the longest: every shorter prompt begins the longer ones."""
    import random

    r = random.Random(seed)
    words = [f"w{r.randrange(3, 1000)}" for _ in range(max(lengths))]
    with open(path, "w") as f:
        for n in lengths:
            f.write(" ".join(words[:n]) + "\n")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--kind", choices=HYBRID_KINDS, default="gdn")
    p.add_argument("--prompt-lens", type=int, nargs="+", default=[150, 230, 310], metavar="N")
    p.add_argument("--output-len", type=int, default=10)
    p.add_argument("--ssm-dtype", default="auto",
                   help="vLLM's --mamba-ssm-cache-dtype (auto: vLLM's choice - the model's dtype, or float32 on a CPU "
                        "with AVX-512 BF16; there a bf16 state needs bfloat16 here, and only gated delta-net keeps it)")
    p.add_argument("--dtype", default="bfloat16", help="the model's dtype (vLLM CPU runs gated delta-net in bf16 "
                                                       "only; short_conv runs float32 too)")
    p.add_argument("--runs", nargs="+", choices=RUNS, default=list(RUNS),
                   help="prefill (the reference) or, where vLLM's own prefill fails, prefill_split")
    p.add_argument("--prefix-caching", action="store_true",
                   help="prefill and replay with vLLM's prefix caching (mamba_cache_mode align)")
    p.add_argument("--nested", action="store_true",
                   help="each prompt begins with the one before it (multi-turn chat: turn k+1 begins with turn k); "
                        "each recorded prompt must replay its own state, not a longer one's")
    p.add_argument("--shared-prefix", type=int, default=0, metavar="K",
                   help="with --prefix-caching: before the prompts, decoys sharing their first K tokens")
    p.add_argument("--record-tp", type=int, default=1, help="the recording's tensor parallel size")
    p.add_argument("--tp", type=int, default=1, help="the runs' tensor parallel size")
    p.add_argument("--out-dir", default=None, help="where the prompts and the bank go (default out/hybrid-replay-KIND)")
    p.add_argument("--json", default=None)
    p.add_argument("--only", default=None, help=argparse.SUPPRESS)
    for hidden in ("--bank", "--prompts-file", "--model"):
        p.add_argument(hidden, default=None, help=argparse.SUPPRESS)
    p.add_argument("--max-model-len", type=int, default=None, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    root = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "out")
    a.model = os.path.abspath(a.model or os.path.join(root, f"tiny-hybrid-{a.kind}"))
    a.max_model_len = a.max_model_len or max(a.prompt_lens) + a.output_len + 16
    if a.only:
        print_result(run_each(a.only, lambda run: run_one(a, run)))
        return 0
    make_hybrid_model(a.model, a.kind)
    out_dir = os.path.abspath(a.out_dir or os.path.join(root, f"hybrid-replay-{a.kind}"))
    os.makedirs(out_dir, exist_ok=True)
    a.prompts_file = os.path.join(out_dir, "prompts.txt")
    a.bank = os.path.join(out_dir, "bank.safetensors")
    if a.nested:
        write_nested_prompts(a.prompts_file, a.prompt_lens, seed=1)
    else:
        with open(a.prompts_file, "w") as f:
            f.write("\n".join(word_prompts(a.prompt_lens, seed=1)) + "\n")
    lengths = [len(t) for t in prompt_ids(a.model, a.prompts_file)]
    flags = ["--mamba-ssm-cache-dtype", a.ssm_dtype] if a.ssm_dtype != "auto" else []
    rec = run_child([sys.executable, "-m", "kvfill.record", "--model", a.model, "--prompts", a.prompts_file,
                     "--out", a.bank, "--dtype", a.dtype, "--max-model-len", str(a.max_model_len),
                     "--tensor-parallel-size", str(a.record_tp), "--enforce-eager", *flags], "recording", timeout=900,
                    env=child_env(a.record_tp))
    print(next(line for line in rec.stdout.splitlines() if line.startswith("wrote")), flush=True)
    # what vLLM ran the state in, read off the bank (vLLM CPU picks it by CPU feature when --ssm-dtype is auto)
    states = Bank.load(a.bank).states
    state_dtypes = sorted({str(t.dtype).removeprefix("torch.") for ts in states.values() for t in ts})
    runs = [r for r in RUNS if r in a.runs]
    if not {"prefill", "prefill_split"} & set(runs):
        p.error("--runs needs a reference: prefill or prefill_split")
    cmd = [sys.executable, os.path.abspath(__file__), "--bank", a.bank, "--prompts-file", a.prompts_file, "--model",
           a.model, "--output-len", str(a.output_len), "--max-model-len", str(a.max_model_len),
           "--ssm-dtype", a.ssm_dtype, "--dtype", a.dtype, "--shared-prefix", str(a.shared_prefix),
           *(["--prefix-caching"] if a.prefix_caching else [])]
    print(f"running {', '.join(runs)} at TP {a.tp} ...", flush=True)
    results = child_result([*cmd, "--tp", str(a.tp), "--only", ",".join(runs)], "the runs", timeout=1800,
                           env=child_env(a.tp))
    ref = "prefill" if "prefill" in results else "prefill_split"
    rows = [compare(results[ref], results[r]) for r in runs if r != ref]
    if ref == "prefill" and "prefill_split" in results and "replay" in results:  # the fill's split, computed for real
        rows.append({**compare(results["prefill_split"], results["replay"]), "run": "replay vs prefill_split"})
    if a.record_tp != a.tp:  # the context the bank carries: real prefill at the recording's TP size
        print(f"running prefill at the recording's TP {a.record_tp} ...", flush=True)
        results.update(child_result([*cmd, "--tp", str(a.record_tp), "--only", "prefill_at_record_tp"],
                                    "prefill at the recording's TP size", timeout=900, env=child_env(a.record_tp)))
        rows += [{**compare(results["prefill_at_record_tp"], results[r]), "run": f"{r} vs prefill_at_record_tp"}
                 for r in runs if r in ("replay", "normal")]
    pc = (f"; prefix caching on (decoys sharing {a.shared_prefix} tokens first), prefix cache hits in tokens: "
          f"{ {r: results[r].get('prefix_cache_hit_tokens') for r in runs if r != 'prefill_split'} }"
          if a.prefix_caching else "")
    print(f"\n{len(lengths)} prompts of {lengths} tokens, {a.output_len} greedy tokens; {os.path.basename(a.model)} "
          f"({a.dtype}, --ssm-dtype {a.ssm_dtype}: state tensors {'/'.join(state_dtypes)} on "
          f"{cpu_features()['cpu']}), TP {a.tp}; bank recorded at TP {a.record_tp}{pc}")
    print(f"reference: {ref}" + (" (vLLM's own prefill not run)" if ref != "prefill" else ""))
    print(table(rows, ["run", "tokens_equal_to_prefill", "prompts_identical", "max_abs_logprob_diff"]))
    by = {r["run"]: r for r in rows}
    synthetic_differ = not by.get("normal", {"identical": False})["identical"]
    if a.record_tp != a.tp:
        # the recording's numerics, computed on at another TP size: every prompt's first token as real prefill's
        # at the recording's TP size, and more of its tokens than a synthetic fill
        replay, normal = by["replay vs prefill_at_record_tp"], by.get("normal vs prefill_at_record_tp")
        ok = min(replay["per_prompt"]) >= 1 and (normal is None
                                                 or sum(replay["per_prompt"]) > sum(normal["per_prompt"]))
        claim = ("replay's first tokens equal real prefill's at the recording's TP size, and more of its tokens than "
                 "a synthetic fill's")
    else:
        exact = by.get("replay vs prefill_split", by.get("replay"))  # replay vs the split, however it is named
        ok = exact["identical"] and synthetic_differ
        split = " split as the fill splits it" if "prefill_split" in results else ""
        claim = f"replay's tokens equal real prefill's{split}; a synthetic fill's differ"
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"args": {k: v for k, v in vars(a).items() if k != "only"}, "prompt_tokens": lengths,
                       "state_dtypes": {n: [str(t.dtype).removeprefix("torch.") for t in ts]
                                        for n, ts in sorted(states.items())},
                       "machine": cpu_features(), "rows": rows, "outputs": results}, f, indent=1)
    print(claim if ok else "CLAIM NOT MET")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

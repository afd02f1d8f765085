"""Replay end to end on vLLM: record prompts with real prefill, then decode the
same prompts from replayed KV, and compare with real prefill token for token.

    python bench/replay_e2e.py                     # 4 prompts x 256 tokens, 16 greedy tokens
    python bench/replay_e2e.py --prompts 8 --prompt-len 1024 --output-len 32 --json out/replay-e2e.json
    python bench/replay_e2e.py --shared-prefix 256 --prompt-len 300   # prefix caching on, decoys first
    python bench/replay_e2e.py --compiled [--record-eager]   # runs compiled (vllm serve's default); bank eager

Runs, one engine after another on the same prompts (greedy, top-1 logprob per
generated token; in one child process, each run a new engine):
  * ``prefill``  - no connector: vLLM computes the prompt's KV
  * ``replay``   - kvfill, ``fill_mode: replay`` from a bank recorded over these prompts
  * ``normal``   - kvfill, synthetic normal(0, 0.1) KV
  * ``constant`` - kvfill, the constant 0.015
and reports, per run, how many generated tokens equal real prefill's and the
largest logprob difference over the tokens that agree.  The claim checked:
replay's greedy outputs equal prefill's, logprobs within ``--tolerance``,
while the synthetic fills' outputs differ.  The bank is recorded with the
recorder's defaults: every prompt whole, each its own length, so no position
wraps.

A trained model on real text (SmolLM2-135M): ``python bench/check_presets.py
real`` (kvfill-check), which also compares EOS-honoured lengths and ngram
acceptance; through ``vllm serve`` and ``vllm bench serve``: ``kvfill-check
--serve`` (``python bench/check_presets.py real -- --serve``).

``--compiled``: every run (and the recording) in vLLM's default compilation
mode, as ``vllm serve`` runs (Inductor on vLLM CPU too), not eager;
``--record-eager`` then records the bank eager all the same: what a bank
recorded in another mode than the serve's does to replay's exactness.

``--shared-prefix K``: vLLM's default prefix caching on, and before the
recorded prompts each run generates from a decoy per prompt - its first K
tokens, then other tokens - that was not recorded.  The recorded prompts then
reuse the decoys' cached blocks of their first K tokens, so replay must have
filled those with the recorded prompt's rows (a block's rows are chosen by
its own token prefix, ``kvfill/bank/format.py``).
"""
from __future__ import annotations

import argparse
import json
import os
import random
import sys

from kvfill.bench.common import child_result, print_result, run_child, run_each
from kvfill.bench.models import make_model, make_tokenizer

RUNS = ("prefill", "prefill_split", "replay", "normal", "constant")
PEAKED_STD = 0.15


def write_prompts(path: str, n: int, length: int, seed: int) -> None:
    r = random.Random(seed)
    with open(path, "w") as f:
        for _ in range(n):
            f.write(" ".join(f"w{r.randrange(3, 1000)}" for _ in range(length)) + "\n")


def max_model_len(a) -> int:
    """One value for the recording and every run: vLLM CPU's attention rounds
    differently with another max_model_len (measured: the KV of positions past
    the first block then differs in its last bits)."""
    return a.prompt_len + a.output_len + 16


def prompt_ids(model: str, prompts_file: str) -> list[list[int]]:
    """The prompts' token ids, as the recorder tokenizes them."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    with open(prompts_file) as f:
        return [list(tok(line.rstrip("\n")).input_ids) for line in f if line.strip()]


def connector_config(run: str, bank: str) -> dict | None:
    """The kv_transfer_config of a run (None: no connector, real prefill)."""
    extra = {"replay": {"fill_mode": "replay", "bank": bank}, "normal": {"fill_std": 0.1},
             "constant": {"fill_std": 0.0}}.get(run)
    if extra is None:
        return None
    return {"kv_connector": "KVFillConnector", "kv_role": "kv_both", "kv_connector_extra_config": extra}


def decoys(ids: list[list[int]], shared: int) -> list[list[int]]:
    """Per prompt, an unrecorded one with its first ``shared`` tokens and its
    other tokens reversed."""
    return [t[:shared] + t[shared:][::-1] for t in ids]


def run_one(a, run: str) -> dict:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    ids = prompt_ids(a.model, a.prompts_file)
    kw = {}
    batched = max(2048, a.prompt_len + 16)
    if run == "prefill_split":
        # The last prompt token in a step of its own, after the rest: how a
        # filled request computes it (the rounding floor of computing it apart).
        kw.update(max_num_seqs=1, enable_chunked_prefill=True)
        batched = a.prompt_len - 1
    kt = connector_config(run, a.bank)
    if kt is not None:
        kw["kv_transfer_config"] = kt
    llm = LLM(model=a.model, dtype=a.dtype, skip_tokenizer_init=True, enforce_eager=not a.compiled,
              max_model_len=max_model_len(a),
              max_num_batched_tokens=batched, disable_log_stats=True, enable_prefix_caching=bool(a.shared_prefix),
              seed=0,
              **{"max_num_seqs": len(ids), **kw})
    params = SamplingParams(max_tokens=a.output_len, temperature=0.0, logprobs=1, ignore_eos=True, detokenize=False)
    if a.shared_prefix:
        llm.generate([TokensPrompt(prompt_token_ids=d) for d in decoys(ids, a.shared_prefix)],
                     SamplingParams(max_tokens=1, ignore_eos=True, detokenize=False), use_tqdm=False)
    rows = greedy_rows(llm.generate([TokensPrompt(prompt_token_ids=t) for t in ids], params, use_tqdm=False))
    del llm
    return {"run": run, "outputs": rows}


def greedy_rows(outs) -> list[dict]:
    """Each output's tokens and the logprob of each (``logprobs=1``): what ``compare`` reads."""
    return [{"tokens": list(o.outputs[0].token_ids),
             "logprobs": [lp[t].logprob for t, lp in zip(o.outputs[0].token_ids, o.outputs[0].logprobs)]}
            for o in outs]


def compare(ref: dict, other: dict) -> dict:
    """Tokens equal to prefill's (position by position, up to the first
    difference per prompt) and the largest |logprob difference| over them
    (kvfill-check's comparison, in this script's row format)."""
    from kvfill.check.compare import tokens

    t = tokens(ref["outputs"], other["outputs"])
    per_prompt = [len(r["tokens"]) if f is None else f for r, f in zip(ref["outputs"], t["first_divergence"])]
    return {"run": other["run"], "prompts_identical": f"{t['prompts_identical']}/{t['prompts']}",
            "tokens_equal_to_prefill": f"{t['equal']}/{t['total']}", "per_prompt": per_prompt,
            "max_abs_logprob_diff": t["max_abs_logprob_diff"], "identical": t["identical"]}


def side_by_side(model: str, results: dict, words: int = 8) -> str:
    """The first ``words`` words of each run's output, per prompt."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    lines = []
    for i in range(len(results["prefill"]["outputs"])):
        lines.append(f"prompt {i}:")
        for run, res in results.items():
            toks = res["outputs"][i]["tokens"]
            text = tok.decode(toks) if toks and isinstance(toks[0], int) else "".join(toks)
            lines.append(f"  {run:>13}: {' '.join(text.split()[:words])!r}")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=16)
    p.add_argument("--tolerance", type=float, default=0.05, help="largest |logprob difference| replay may show")
    p.add_argument("--model", default=None,
                   help="model folder (default out/tiny-llama-peaked: the tiny Llama with weights of std 0.15, made "
                        "if missing; std 0.02 gives near-uniform next-token distributions whose argmax rounding decides)")
    p.add_argument("--dtype", default="float32",
                   help="model and KV dtype (default float32: bf16 rounding differs with the batch's shape, which "
                        "alone flips near-tied greedy tokens of a random-weight model; see the README)")
    p.add_argument("--runs", nargs="+", choices=RUNS, default=list(RUNS),
                   help="which runs (prefill is always run: the reference)")
    p.add_argument("--hybrid", action="store_true",
                   help="the Gemma3 model alternating sliding-window (256) and full attention: two KV cache groups")
    p.add_argument("--shared-prefix", type=int, default=0, metavar="K",
                   help="prefix caching on; each run first generates from unrecorded decoys sharing each prompt's "
                        "first K tokens")
    p.add_argument("--compiled", action="store_true",
                   help="every run and the recording compiled (vLLM's default, as vllm serve runs), not eager")
    p.add_argument("--record-eager", action="store_true",
                   help="with --compiled: the bank recorded eager all the same (--enforce-eager)")
    p.add_argument("--json", default=None)
    p.add_argument("--only", default=None, help=argparse.SUPPRESS)
    p.add_argument("--bank", default=None, help=argparse.SUPPRESS)
    p.add_argument("--prompts-file", default=None, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    out_dir = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "out", "replay-e2e")
    default = "tiny-gemma3-hybrid" if a.hybrid else "tiny-llama-peaked"
    a.model = os.path.abspath(a.model or os.path.join(out_dir, "..", default))
    if a.shared_prefix and not 0 < a.shared_prefix < a.prompt_len - 1:
        p.error(f"--shared-prefix {a.shared_prefix}: expected 0 < K < --prompt-len - 1 ({a.prompt_len - 1})")
    if a.record_eager and not a.compiled:
        p.error("--record-eager goes with --compiled (without it every run is eager)")
    if a.only:
        print_result(run_each(a.only, lambda run: run_one(a, run)))
        return 0
    os.makedirs(out_dir, exist_ok=True)
    prompts_file = os.path.join(out_dir, "prompts.txt")
    bank = os.path.join(out_dir, "bank.safetensors")
    make_tokenizer(make_model(a.model, hybrid=True) if a.hybrid else make_model(a.model, init_std=PEAKED_STD))
    write_prompts(prompts_file, a.prompts, a.prompt_len, seed=1)
    lengths = [len(t) for t in prompt_ids(a.model, prompts_file)]
    rec = run_child([sys.executable, "-m", "kvfill.record", "--model", a.model, "--prompts", prompts_file,
                     "--out", bank, "--dtype", a.dtype, "--max-model-len", str(max_model_len(a)),
                     *([] if a.compiled and not a.record_eager else ["--enforce-eager"])], "recording",
                    timeout=900)
    print(next(line for line in rec.stdout.splitlines() if line.startswith("wrote")), flush=True)
    results = {}
    runs = [r for r in RUNS if r == "prefill" or r in a.runs]
    if runs:
        cmd = [sys.executable, os.path.abspath(__file__), "--only", ",".join(runs), "--bank", bank,
               "--prompts-file", prompts_file, "--model", a.model, "--dtype", a.dtype, "--prompt-len",
               str(a.prompt_len), "--output-len", str(a.output_len), "--shared-prefix", str(a.shared_prefix),
               *(["--compiled"] if a.compiled else [])]
        print(f"running {', '.join(runs)} (one engine after another, one process) ...", flush=True)
        results = child_result(cmd, "the runs", timeout=900 * len(runs))
    rows = [compare(results["prefill"], results[r]) for r in RUNS[1:] if r in results]
    from kvfill.bench.common import table

    shared = (f"; prefix caching on, after decoys sharing the first {a.shared_prefix} tokens"
              if a.shared_prefix else "")
    print(f"\n{a.prompts} prompts of {lengths} tokens, {a.output_len} greedy "
          f"tokens; model {os.path.basename(a.model)}, {a.dtype}; runs {'compiled' if a.compiled else 'eager'}; "
          f"replay bank recorded {'eager' if a.record_eager or not a.compiled else 'compiled'} over the same "
          f"prompts{shared}")
    print(table(rows, ["run", "prompts_identical", "tokens_equal_to_prefill", "per_prompt", "max_abs_logprob_diff"]))
    print(side_by_side(a.model, results))
    replay = next(r for r in rows if r["run"] == "replay")
    synthetic = [r for r in rows if r["run"] in ("normal", "constant")]
    ok = replay["identical"] and replay["max_abs_logprob_diff"] <= a.tolerance and not any(
        r["identical"] for r in synthetic)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"args": {k: v for k, v in vars(a).items() if k not in ("only", "bank", "prompts_file")},
                       "prompt_tokens": lengths, "rows": rows, "outputs": results}, f, indent=1)
    print("replay equals real prefill; synthetic fills differ" if ok else "CLAIM NOT MET")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

"""One check run, inside its own process (``kvfill.check.child``): a new vLLM
engine with the user's engine flags and one fill, and what it measures.

Per run, on the same prompts (token ids, tokenized as kvfill-record does):
  * greedy: ``output_len`` tokens per prompt, EOS ignored, with each token's
    logprob; vLLM's speculative-decoding counters, the drafts a drafter
    proposed, and each MoE layer's expert choices for the decode-step
    tokens;
  * timing (``time_passes``): the greedy prompts again, probes off, each
    pure decode step timed (``probes.StepTimer``).  A fill's run alternates
    a pass of its fill with a pass of real prefill in the same engine
    (``kvfill_prefill`` requests), so both see the same host at the same
    minutes; real prefill's run times twice as many passes of its own, the
    check's measure of its own noise.  Per pass: each step's seconds and
    batch, wall, process and thread CPU seconds, tokens per step, the
    host's load before and after; the tokens the requests gained after
    their first step, the request-steps timed and vLLM's accepted tokens
    and drafts, whose tokens per step count every step a request ran
    (``compare.tokens_per_step``), drafted or not;
  * eos: up to ``max_tokens`` per prompt with EOS honoured (as ``vllm bench
    serve`` on a real data set), at ``temperature`` with one seed per prompt,
    the same in every run: each output's length and whether it ended at EOS.
``prefill_split`` (hybrid models): each prompt on an engine of its own whose
chunked prefill computes its first N - 1 tokens in one step and the last in
the next - real prefill split where a fill splits it; greedy only.
"""
from __future__ import annotations

import os
import time

from . import classes, probes
from .compare import tokens_per_step

EOS_SEED = 1000  # prompt i samples with seed EOS_SEED + i in every run


def run(job: dict) -> dict:
    """The run ``job`` describes (runner.run_jobs); its measurements as JSON-able data."""
    if job["run"] == "prefill_split":
        return _split(job)
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from kvfill.record.engine import llm_engine

    ids = job["ids"]
    kw = dict(job["engine"])
    if job.get("connector"):
        kw["kv_transfer_config"] = job["connector"]
    t0 = time.perf_counter()
    with llm_engine(**kw) as llm:
        startup_s = time.perf_counter() - t0
        if job.get("decoys"):  # --decoys: their blocks cached before the prompts come (before any probe counts)
            llm.generate([TokensPrompt(prompt_token_ids=t) for t in job["decoys"]],
                         SamplingParams(max_tokens=1, ignore_eos=True, detokenize=False), use_tqdm=False)
        runner = llm.collective_rpc(probes.model_runner)[0]
        block = llm.collective_rpc(probes.block_size)[0]
        moe, notes = job.get("moe"), []
        hooks = llm.collective_rpc(probes.install_expert_counter, args=tuple(moe))[0] if moe else {"layers": []}
        hooked = hooks["layers"]
        notes += [hooks["note"]] if hooks.get("note") else []
        drafts = False
        if job.get("spec"):
            why_not = [n for n in llm.collective_rpc(probes.watch_drafts) if n]
            drafts, notes = not why_not, notes + why_not[:1]
        prompts = [TokensPrompt(prompt_token_ids=t) for t in ids]
        greedy = SamplingParams(max_tokens=job["output_len"], temperature=0.0, logprobs=1, ignore_eos=True,
                                detokenize=False)
        t0 = time.perf_counter()
        outs = llm.generate(prompts, greedy, use_tqdm=False)
        greedy_s = time.perf_counter() - t0
        after_greedy = probes.counters(llm)
        rows = [{"tokens": list(o.outputs[0].token_ids),
                 "logprobs": [lp[t].logprob for t, lp in zip(o.outputs[0].token_ids, o.outputs[0].logprobs)]}
                for o in outs]
        if drafts:
            for r, d in zip(rows, probes.by_prompt(llm.collective_rpc(probes.stop_drafts)[0], outs)):
                r["drafts"] = d or []
        counts = None
        if hooked:
            counted = llm.collective_rpc(probes.stop_counting)[0]
            counts = probes.by_prompt(counted["counts"], outs)
            if counted["note"]:  # the counts stopped part-way: none are reported as the run's
                notes.append(counted["note"])
                hooked = []
        timing = time_passes(llm, prompts, job)
        by_class = {c: time_passes(llm, [prompts[i] for i in idx], job)  # each class's prompts timed apart
                    for c, idx in classes.groups(job.get("classes")).items()} if timing else {}
        before_eos = probes.counters(llm)
        eos_rows, eos_s, after_eos = _eos(llm, prompts, job)
    result = {"run": job["run"], "model_runner": runner, "block_size": block, "startup_s": round(startup_s, 1),
              "greedy_s": round(greedy_s, 2), "first_token_s": [first_token_s(o) for o in outs], "timing": timing,
              "greedy": rows, "eos": eos_rows,
              "eos_s": round(eos_s, 2), "counters": after_greedy,
              "eos_counters": probes.counters_since(after_eos, before_eos)}
    if by_class:
        result["timing_by_class"] = by_class
    if notes:  # what a probe could not read on this run's model runner
        result["probe_notes"] = notes
    if hooked:
        zeros = {str(layer): [0] * moe[0] for layer in hooked}
        result["expert_layers"] = hooked
        result["expert_counts"] = [[(c or zeros).get(str(layer), [0] * moe[0]) for layer in hooked] for c in counts]
    return result


def first_token_s(out) -> float | None:
    """Seconds from a request's first scheduling to its first token (vLLM's
    engine-core timestamps, ``RequestOutput.metrics``): its prefill, and the
    steps it shared with other requests; None where vLLM kept no stats."""
    m = getattr(out, "metrics", None)
    start, first = getattr(m, "scheduled_ts", 0.0), getattr(m, "first_token_ts", 0.0)
    return round(first - start, 3) if start and first and first >= start else None


def _eos(llm, prompts, job) -> tuple[list[dict], float, dict]:
    """The EOS-honoured run on the same engine: each output's length and end."""
    from vllm import SamplingParams

    if not job["max_tokens"]:
        return [], 0.0, probes.counters(llm)
    params = [SamplingParams(max_tokens=job["max_tokens"], temperature=job["temperature"], seed=EOS_SEED + i,
                             detokenize=False) for i in range(len(prompts))]
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    took = time.perf_counter() - t0
    rows = [{"length": len(o.outputs[0].token_ids), "eos": o.outputs[0].finish_reason == "stop"} for o in outs]
    return rows, took, probes.counters(llm)


def time_passes(llm, prompts, job) -> dict:
    """``job["time_passes"]`` timed passes of each kind over the greedy
    prompts (EOS ignored, no logprobs, probes off; the prefix cache reset
    before each, so every pass fills or prefills its prompts): a fill's run
    alternates "fill" and "real" (its engine prefilling for real:
    ``kvfill_prefill``), starting with the fill; real prefill's run
    alternates "real" and "real'" (its self-comparison).  One untimed pass
    of each kind comes first: an engine's first passes after the greedy
    one ran steps up to 40x slower.  {} when not
    asked for or the engine's steps cannot be timed here."""
    from vllm import SamplingParams

    from kvfill.connector.request_params import PREFILL_PARAM

    n = job.get("time_passes", 0)
    timer = probes.StepTimer(llm, job.get("spec_tokens", 0)) if n else None
    if not n or not timer.available:
        return {}
    kinds = ("fill", "real") if job.get("connector") else ("real", "real'")
    caching = bool(job["engine"].get("enable_prefix_caching"))
    passes = []
    for i in range(-2, 2 * n):  # the first pass of each kind warms up (first steps ran 10-40x slower: measured)
        kind = kinds[i % 2]
        extra = {"kv_transfer_params": {PREFILL_PARAM: True}} if kind == "real" and job.get("connector") else None
        params = SamplingParams(max_tokens=job["output_len"], temperature=0.0, ignore_eos=True, detokenize=False,
                                extra_args=extra)
        if caching:
            llm.reset_prefix_cache()
        before = probes.counters(llm)
        timer.steps = []
        load0, cpu0, thread0, t0 = os.getloadavg()[0], time.process_time(), time.thread_time(), time.perf_counter()
        timer.on = True
        outs = llm.generate(prompts, params, use_tqdm=False)
        timer.on = False
        wall, cpu, thread = time.perf_counter() - t0, time.process_time() - cpu0, time.thread_time() - thread0
        after = probes.counters(llm)
        if i < 0:
            continue
        spec = probes.counters_since(after, before)
        # a request's first token comes with its prefill (or fill) step; every later one in a decode step
        gained = sum(len(o.outputs[0].token_ids) - 1 for o in outs)
        timed = sum(b for _, b in timer.steps)
        accepted = spec.get("num_accepted_tokens", 0)
        passes.append({"kind": kind, "ms": [round(1e3 * t, 4) for t, _ in timer.steps],
                       "batch": [b for _, b in timer.steps], "tokens": gained, "request_steps": timed,
                       "accepted": accepted, "drafts": spec.get("num_drafts", 0),
                       "tokens_per_step": round(tokens_per_step(gained, accepted, timed, spec.get("num_drafts", 0)), 4),
                       "wall_s": round(wall, 4), "cpu_s": round(cpu, 4), "thread_cpu_s": round(thread, 4),
                       "load": [round(load0, 2), round(os.getloadavg()[0], 2)]})
    import torch

    return {"passes": passes, "torch_threads": torch.get_num_threads(), "cores": len(os.sched_getaffinity(0))}


def _split(job: dict) -> dict:
    """Each prompt's first N - 1 tokens in one step, the last in the next (no connector)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from kvfill.record.engine import llm_engine

    greedy = SamplingParams(max_tokens=job["output_len"], temperature=0.0, logprobs=1, ignore_eos=True,
                            detokenize=False)
    rows = []
    for t in job["ids"]:
        kw = {**job["engine"], "max_num_seqs": 1, "enable_chunked_prefill": True,
              "max_num_batched_tokens": max(len(t) - 1, 1), "enable_prefix_caching": False}
        with llm_engine(**kw) as llm:
            o = llm.generate([TokensPrompt(prompt_token_ids=t)], greedy, use_tqdm=False)[0]
        rows.append({"tokens": list(o.outputs[0].token_ids),
                     "logprobs": [lp[x].logprob for x, lp in zip(o.outputs[0].token_ids, o.outputs[0].logprobs)]})
    return {"run": "prefill_split", "greedy": rows}

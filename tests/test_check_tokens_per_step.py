"""kvfill-check's tokens per step count every decode step a request ran,
drafted or not (issue 67): a drafter that proposes on some steps only (an
ngram drafter finding no match) still gains one token on the others, so
"tokens per step" is the tokens each request gained over all its steps -
1 + accepted / request-steps by vLLM's counters - never 1 + accepted /
drafts (tokens per *drafted* step), which made a fill's time per
request-token against real prefill's up to 1.66x too high.  And a step
where neither real prefill nor the fill drafted is no agreement of drafts."""
import time
from types import SimpleNamespace

import pytest

vllm = pytest.importorskip("vllm")  # measure.time_passes builds vLLM's SamplingParams

from kvfill.check import compare, measure, verdict  # noqa: E402

SPEC = 2  # tokens a drafted step proposes
OUTPUT_LEN = 13  # each request's tokens: its first, then 4 cycles of (draft: +2, no draft: +1, no draft: +1) ... to 13


class DraftOnSomeSteps:
    """vLLM's offline engine as measure.time_passes and probes.StepTimer see
    it: an engine core whose scheduler and step_fn the timer wraps, and
    vLLM's speculative-decoding counters as vLLM keeps them (a drafted
    request-step counts one draft, its draft tokens, and the tokens it
    accepted before a cut at max_tokens; a step without a draft counts
    nothing).  Each request drafts on every third of its decode steps and
    accepts one of the two tokens; the second request arrives two steps
    after the first, so one step mixes its prefill with the first one's
    decode (the timer leaves such a step out).  ``truth``: per generate
    call, the tokens the requests gained after their first step and the
    request-steps of every decode step they ran."""

    ARRIVE = (0, 2)

    def __init__(self):
        self.counters = dict.fromkeys(("num_drafts", "num_draft_tokens", "num_accepted_tokens"), 0)
        self.core = SimpleNamespace(scheduler=SimpleNamespace(schedule=self._schedule), step_fn=self._step)
        self.llm_engine = SimpleNamespace(engine_core=SimpleNamespace(engine_core=self.core))
        self.truth = []

    def get_metrics(self):
        return [SimpleNamespace(name=f"vllm:spec_decode_{k}", value=v) for k, v in self.counters.items()]

    def generate(self, prompts, params, use_tqdm=False):
        self.cap, self.clock = params.max_tokens, 0
        self.reqs = [{"id": str(i), "tokens": 0, "steps": 0, "arrive": a} for i, a in zip(range(len(prompts)),
                                                                                          self.ARRIVE)]
        while any(r["tokens"] < self.cap for r in self.reqs):
            self.core.step_fn()  # the attribute the timer replaced, as vLLM's engine core calls it
        self.truth.append((sum(r["tokens"] - 1 for r in self.reqs), sum(r["steps"] for r in self.reqs)))
        return [SimpleNamespace(request_id=r["id"], outputs=[SimpleNamespace(token_ids=list(range(r["tokens"])))])
                for r in self.reqs]

    def _schedule(self):
        new, n = [], {}
        for r in self.reqs:
            if r["tokens"] >= self.cap or r["arrive"] > self.clock:
                continue
            if r["tokens"] == 0:
                new.append(r["id"])
                n[r["id"]] = 40  # its prompt, computed in this step
            else:
                n[r["id"]] = 1 + (SPEC if r["steps"] % 3 == 0 else 0)
        return SimpleNamespace(scheduled_new_reqs=new, num_scheduled_tokens=n,
                               total_num_scheduled_tokens=sum(n.values()))

    def _step(self):
        time.sleep(1e-3)  # a step takes time: the pass's wall seconds divide its CPU seconds
        out = self.core.scheduler.schedule()
        for r in self.reqs:
            k = out.num_scheduled_tokens.get(r["id"])
            if k is None:
                continue
            if r["id"] in out.scheduled_new_reqs:
                r["tokens"] = 1
                continue
            r["steps"] += 1
            if k > 1:
                self.counters["num_drafts"] += 1
                self.counters["num_draft_tokens"] += SPEC
                self.counters["num_accepted_tokens"] += 1
            r["tokens"] = min(r["tokens"] + (2 if k > 1 else 1), self.cap)
        self.clock += 1


def test_a_timed_pass_of_a_drafter_that_drafts_on_some_steps_counts_every_step_it_ran():
    llm = DraftOnSomeSteps()
    job = {"time_passes": 1, "spec_tokens": SPEC, "connector": None, "engine": {}, "output_len": OUTPUT_LEN}
    timing = measure.time_passes(llm, [object(), object()], job)
    passes = timing["passes"]
    assert [p["kind"] for p in passes] == ["real", "real'"]
    for p, (gained, steps) in zip(passes, llm.truth[2:]):  # the two warm-up passes come first
        assert (gained, steps) == (2 * (OUTPUT_LEN - 1), 18)  # 12 tokens over 9 steps a request
        assert p["tokens_per_step"] == round(gained / steps, 4), p  # not 1 + 6 accepted / 6 drafts = 2
        # vLLM's counters: 6 drafted request-steps accepting one token each; the other 12 drafted nothing
        assert (p["tokens"], p["accepted"], p["drafts"]) == (gained, 6, 6)
        assert p["tokens_per_step"] == round(1 + p["accepted"] / steps, 4)
        assert p["request_steps"] == steps - 1  # the step mixing in the second prompt's prefill is not timed
    t = compare.decode_time(timing)
    assert t["tokens_per_step"] == [round(24 / 18, 3)] * 2
    per_token = [ms / passes[0]["tokens_per_step"] for ms, b in zip(passes[0]["ms"], passes[0]["batch"])
                 if b == t["batch"]]
    assert t["ms_per_token"][0] == pytest.approx(sorted(per_token)[len(per_token) // 2], abs=1e-4)


def test_tokens_per_step_is_gained_over_every_step_bounded_by_vllms_counters():
    assert compare.tokens_per_step(24, 6, 18) == 24 / 18  # every decode step timed
    assert compare.tokens_per_step(24, 6, 17) == 24 / 18  # one untimed: every step gains 1 + what it accepted
    assert compare.tokens_per_step(40, 0, 30) == 1.0  # nothing accepted: one token a step, timed or not
    assert compare.tokens_per_step(0, 0, 0) == 1.0  # one token a request: no decode step
    # 4 requests, 24 steps, every draft of 3 accepted whole: vLLM counts 72 accepted, but each request's last
    # draft reached one token past max_tokens - 92 tokens gained, not 24 + 72
    assert compare.tokens_per_step(92, 72, 24, 24) == 92 / 24


def _drafted(tokens: list[int], cycles: int, drafting: bool) -> list[list[int]]:
    """Per decode step the draft proposed: on every third step (when ``drafting``) the next token and a
    wrong one (one accepted), else nothing."""
    out, pos = [], 1
    for _ in range(cycles):
        out += [[tokens[pos], -1] if drafting else [], [], []]
        pos += 4 if drafting else 3
    return out


def _run(run, tokens, drafting):
    rows = [{"tokens": t, "logprobs": [-1.0] * len(t), "drafts": _drafted(t, 3 if drafting else 4, drafting)}
            for t in tokens]
    n = 3 * len(rows) if drafting else 0
    return {"run": run, "greedy": rows, "eos": [], "eos_counters": {},
            "counters": {"num_drafts": n, "num_draft_tokens": SPEC * n, "num_accepted_tokens": n}}


def test_acceptance_lines_give_tokens_per_step_over_every_step_and_drafts_only_where_one_side_drafted():
    """Real prefill drafts on a third of its steps (12 tokens over 9 steps a
    request); replay alike; zeros never drafts (12 over 12).  The spec line
    gives 1.33 tokens per step, not 2 (1 + accepted / drafts), and drafts
    compare only on the 6 steps where real prefill drafted: replay 6/6,
    zeros 0/6 - not the 18/18 and 12/18 that counted the steps where
    neither side proposed anything as agreement."""
    tokens = [list(range(100, 100 + OUTPUT_LEN)), list(range(200, 200 + OUTPUT_LEN))]
    steps = {"prefill": _run("prefill", tokens, True), "replay": _run("replay", tokens, True),
             "zeros": _run("zeros", tokens, False)}
    res = {"steps": steps, "prompt_tokens": [3, 4], "bank_recorded": True, "runtime_s": 1.0, "moe_note": None}
    cmp = compare.compare_all(res)
    assert cmp["prefill"]["spec"]["tokens_per_step"] == round(24 / 18, 3)
    assert cmp["replay"]["drafts_equal"] == {"equal": 6, "total": 6, "neither": 12}
    assert cmp["zeros"]["drafts_equal"] == {"equal": 0, "total": 6, "neither": 18}
    lines = verdict.verdicts(res, cmp)
    replay = next(ln for ln in lines if ln.startswith("replay: acceptance"))
    assert "1.333 tokens per step" in replay and "6/6 steps where either drafted" in replay, replay
    assert "12 steps where neither drafted" in replay, replay

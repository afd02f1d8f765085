"""What changes a request's workload behind kvfill's back is said, and a
refused request fails alone (issue 67, findings 1 and 7): a malformed
``kvfill_prefill`` that reaches the engine core is filled and said once,
never raised; a request vLLM prefills for real although kvfill granted its
tokens (``prompt_logprobs``) is said once; a refused request's blocks that a
neighbour of its step shares are filled by that neighbour, so only what no
request of the step filled goes to vLLM's ``kv_load_failure_policy``.
Through vLLM's own Scheduler (tests/vllm_harness.py)."""
import pytest
import torch

pytest.importorskip("vllm")

from conftest import connector_lines  # noqa: E402
from vllm.sampling_params import SamplingParams  # noqa: E402
from vllm.v1.kv_cache_interface import FullAttentionSpec  # noqa: E402
from vllm.v1.outputs import KVConnectorOutput  # noqa: E402
from vllm.v1.request import Request, RequestStatus  # noqa: E402
from vllm_harness import make_harness, runner_output  # noqa: E402

from kvfill.connector.request_params import PREFILL_PARAM  # noqa: E402

pytestmark = pytest.mark.cpu_only
ATT = dict(block_size=16, num_kv_heads=2, head_size=8, dtype=torch.bfloat16)
FILL = {"fill_mean": 0.1, "fill_std": 0.5, "seed": 5}
LAYERS = ["model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"]
PROMPT = list(range(1, 41))  # blocks of 16: two full blocks, then 8 tokens


@pytest.fixture
def h(tmp_path):
    return make_harness(tmp_path, [(LAYERS, FullAttentionSpec(**ATT))], extra=FILL)


def _add(h, rid: str, prompt: list[int], **params) -> Request:
    """A request as vLLM's engine core receives it: its parameters not
    checked again (kv_transfer_params set after they were made)."""
    extra = params.pop("extra_args", None)
    sp = SamplingParams(max_tokens=2, ignore_eos=True, **params)
    sp.extra_args = extra
    req = Request(rid, list(prompt), sp, None, block_hasher=h.hasher)
    h.scheduler.add_request(req)
    return req


def test_a_malformed_value_that_reaches_the_engine_core_is_filled_and_said_once(h):
    """Past vLLM's front end (an EngineCoreRequest handed to vLLM whole),
    ``"yes"`` raises nothing in the engine core: the request is filled, as
    every request without ``kvfill_prefill: true`` is, and one warning names
    the value - before, nothing said so."""
    with connector_lines() as said:
        for rid, value in (("m1", "yes"), ("m2", 1)):
            _add(h, rid, PROMPT if rid == "m1" else [p + 100 for p in PROMPT],
                 extra_args={"kv_transfer_params": {PREFILL_PARAM: value}})
        out, _ = h.step()
    assert out.num_scheduled_tokens == {"m1": 1, "m2": 1}  # both filled: one token left each
    assert h.worker.worker.stats.data["requests"] == 2
    lines = [s for s in said if PREFILL_PARAM in s]
    assert len(lines) == 1, said
    assert "request m1" in lines[0] and "got 'yes' (str)" in lines[0] and "filled" in lines[0], lines[0]


def test_a_request_vllm_prefills_for_real_behind_kvfills_back_is_said_once(h):
    """A request with ``prompt_logprobs`` skips reading cached KV, so vLLM
    zeroes the connector's grant and prefills it for real: one line per run
    names why - before, the workload changed without a word."""
    with connector_lines() as said:
        for rid, prompt in (("p1", PROMPT), ("p2", [p + 100 for p in PROMPT])):
            _add(h, rid, prompt, prompt_logprobs=1)
        out, _ = h.step()
    assert out.num_scheduled_tokens == {"p1": 40, "p2": 40}  # every prompt token computed by vLLM
    assert h.worker.worker.stats.data["requests"] == 0
    lines = [s for s in said if "prompt_logprobs" in s]
    assert len(lines) == 1, said
    assert "request p1" in lines[0] and "for real" in lines[0] and "once" in lines[0], lines[0]


@pytest.mark.parametrize("policy", ["fail", "recompute"])
def test_a_refused_request_reports_only_blocks_no_neighbour_of_its_step_filled(tmp_path, monkeypatch, policy):
    """``a`` and ``b`` arrive in one step, ``b``'s prompt ``a``'s and two
    more tokens: vLLM caches ``a``'s full blocks when it allocates them, so
    ``b`` finds them in its prefix cache.  ``a``'s fill is refused (the
    engine refuses any plan with ``a``'s last block, which only ``a`` holds).
    Before, every block of ``a`` was reported: ``b``, holding two of them,
    failed with it (``fail``) or lost its step (``recompute``).  Now ``b``
    fills the blocks it shares, ``a`` reports only its own last block, and
    ``b`` decodes on what a fill of its prompt alone writes there."""
    from kvfill.kernels import FillEngine

    h = make_harness(tmp_path, [(LAYERS, FullAttentionSpec(**ATT))], extra=FILL)
    h.worker.worker.load_failure_policy = policy  # what the worker read from kv_transfer_config
    h.scheduler.recompute_kv_load_failures = policy == "recompute"  # what vLLM reads at construction
    a, b = h.add("a", PROMPT), h.add("b", PROMPT + [50, 51])
    out = h.scheduler.schedule()
    (table_a,), (table_b,) = h.block_table("a"), h.block_table("b")
    assert table_b[:2] == table_a[:2] and table_b[2] != table_a[2]  # b's prefix hit: a's blocks, this step
    fill = FillEngine.fill

    def refuses_a(self, plan):
        if any(table_a[2] in e.block_ids.tolist() for e in plan.groups.values()):
            raise ValueError(f"block {table_a[2]} of 'a' does not fit the caches")
        return fill(self, plan)

    monkeypatch.setattr(FillEngine, "fill", refuses_a)
    h.worker.bind_connector_metadata(out.kv_connector_metadata)
    h.worker.start_load_kv(None)
    h.worker.clear_connector_metadata()
    failed = h.worker.get_block_ids_with_load_errors()
    assert failed == {table_a[2]}
    h.scheduler.update_from_output(out, runner_output(["a", "b"], kv_connector_output=KVConnectorOutput(
        invalid_block_ids=failed)))
    assert b.status == RequestStatus.RUNNING and b.num_output_tokens == 1  # b's step kept
    if policy == "fail":
        assert a.status == RequestStatus.FINISHED_ERROR
    else:
        assert a.num_computed_tokens == 32  # a recomputes its own last block, no more
    monkeypatch.setattr(FillEngine, "fill", fill)
    alone = make_harness(tmp_path / "alone", [(LAYERS, FullAttentionSpec(**ATT))], extra=FILL)
    alone.add("b", PROMPT + [50, 51])
    alone.step()
    (table_alone,) = alone.block_table("b")
    for name in LAYERS:  # the shared blocks, whole (b's own third block also holds poison past its prompt)
        for ours, theirs in zip(table_b[:2], table_alone[:2]):
            assert torch.equal(h.views[name][ours].view(torch.int16), alone.views[name][theirs].view(torch.int16))

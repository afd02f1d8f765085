"""What a request asks of kvfill (connector/request_params.py): only a JSON
boolean ``kvfill_prefill`` is taken, refused where vLLM's front end checks
a request's parameters (HTTP 400 in its server, an error offline) and never
where the engine core decodes a request (issue 67, finding 1); and the two
kinds of request - filled, prefilled for real - hash their prefix-cache
blocks apart whatever ``cache_salt`` a client sends (issue 61, finding 5;
issue 67, finding 2).  Against vLLM's own ``SamplingParams``, engine-core
request codec and ``Request`` with its own block hasher; served end to end
in tests/test_malformed_served.py."""
import itertools

import pytest

pytest.importorskip("vllm")

from vllm.exceptions import VLLMValidationError  # noqa: E402
from vllm.sampling_params import SamplingParams  # noqa: E402
from vllm.utils.hashing import sha256  # noqa: E402
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash  # noqa: E402
from vllm.v1.request import Request  # noqa: E402

from kvfill.connector.request_params import (  # noqa: E402
    PREFILL_PARAM, PREFILL_SALT, install_param_check, keep_apart, prefill_param_error,
)

MALFORMED = ["true", "yes", 1, 1.0, None, "", {"nested": True}, [True], 0]
BLOCK = 4
TOKENS = list(range(100, 117))  # 4 full blocks


@pytest.fixture(scope="module")
def model_config(tmp_path_factory):
    from vllm.config import ModelConfig
    from vllm_harness import model_dir

    return ModelConfig(model=model_dir(tmp_path_factory.mktemp("model")), skip_tokenizer_init=True,
                       max_model_len=64, dtype="bfloat16")


def _malformed(value) -> SamplingParams:
    """Parameters carrying a malformed value as the generate endpoint builds
    them: the client's ``sampling_params`` (``skip_clone`` true: vLLM's
    front end passes them on uncopied), ``kv_transfer_params`` merged in
    after they were made."""
    params = SamplingParams(max_tokens=1, skip_clone=True)
    params.extra_args = {"kv_transfer_params": {PREFILL_PARAM: value}}
    return params


@pytest.mark.parametrize("value", MALFORMED, ids=repr)
def test_a_malformed_kvfill_prefill_is_refused_by_vllms_front_end_check_naming_it(value, model_config):
    """``SamplingParams.verify`` is what vLLM's InputProcessor runs in the
    front end for every request (every endpoint, /inference/v1/generate,
    offline ``LLM``): before, it let the value through to the engine core."""
    line = prefill_param_error({PREFILL_PARAM: value})
    assert line is not None and repr(value) in line and "must be a JSON boolean" in line
    install_param_check()
    with pytest.raises(VLLMValidationError, match="kvfill_prefill must be a JSON boolean") as err:
        _malformed(value).verify(model_config, None, None, None)
    assert repr(value) in str(err.value) and err.value.parameter == f"kv_transfer_params.{PREFILL_PARAM}"


def test_the_openai_endpoints_refuse_it_where_they_build_a_requests_parameters():
    """Completions, chat and responses build their parameters with
    ``from_optional`` before a stream starts: a streamed request gets its
    400 there, not an error event inside a 200 stream."""
    install_param_check()
    with pytest.raises(VLLMValidationError, match=r"got 'true' \(str\)"):
        SamplingParams.from_optional(max_tokens=1, extra_args={"kv_transfer_params": {PREFILL_PARAM: "true"}})


def test_the_engine_core_decodes_a_malformed_value_without_raising():
    """msgspec runs ``SamplingParams.__post_init__`` again when the engine
    core decodes a request, on its input-socket thread outside any ``try``:
    before, the check raised there, the thread ended and the server answered
    no request again.  Now the request arrives whole (the scheduler reads
    the value as "not a prefill request": tests/test_workload_changes.py)."""
    from vllm.v1.engine import EngineCoreRequest
    from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder

    install_param_check()
    ids = [1, 2, 3]
    if "ndarray" in repr(EngineCoreRequest.__annotations__["prompt_token_ids"]):  # vLLM 0.34 sends an array
        import numpy as np

        ids = np.asarray(ids, np.int32)
    request = EngineCoreRequest("r", ids, None, _malformed("yes"), None, 0.0, None, None, None)
    decoded = MsgpackDecoder(EngineCoreRequest).decode(MsgpackEncoder().encode(request))
    assert decoded.sampling_params.extra_args == {"kv_transfer_params": {PREFILL_PARAM: "yes"}}


@pytest.mark.parametrize("params", [{PREFILL_PARAM: True}, {PREFILL_PARAM: False}, {}, {"other": "x"}, None])
def test_a_boolean_or_no_kvfill_prefill_is_taken(params, model_config):
    install_param_check()
    install_param_check()  # idempotent: one check, not two
    assert prefill_param_error(params) is None
    extra = {"kv_transfer_params": params} if params is not None else None
    SamplingParams(max_tokens=1, extra_args=extra).verify(model_config, None, None, None)
    assert SamplingParams.from_optional(max_tokens=1, extra_args=extra).extra_args == extra
    assert getattr(SamplingParams.verify, "kvfill_checks", False)
    assert getattr(SamplingParams.__dict__["from_optional"].__func__, "kvfill_checks", False)


def _request(rid: str, tokens, prefill: bool | None, salt: str | None = None) -> Request:
    init_none_hash(sha256)
    params = SamplingParams(max_tokens=1, extra_args={"kv_transfer_params": {PREFILL_PARAM: prefill}}
                            if prefill is not None else None)
    return Request(rid, list(tokens), params, None, cache_salt=salt,
                   block_hasher=get_request_block_hasher(BLOCK, sha256))


def test_real_prefill_requests_hash_apart_from_filled_ones_and_together_among_themselves():
    """The same prompt filled, then asked for real prefill: before the fix
    both had the same block hashes, so the second found the first's filled
    blocks in vLLM's prefix cache.  Salted on arrival (``on_new_request``),
    every block of the real-prefill request hashes apart; two real-prefill
    requests still share theirs; a client's own salt is kept inside."""
    filled, real, real2 = _request("f", TOKENS, None), _request("r", TOKENS, True), _request("r2", TOKENS, True)
    assert real.block_hashes == filled.block_hashes  # what vLLM computed: shared, the defect
    assert not keep_apart(filled) and filled.cache_salt is None  # a filled request without a salt: untouched
    assert keep_apart(real) and keep_apart(real2)
    assert len(real.block_hashes) == len(filled.block_hashes) == 4
    assert not set(real.block_hashes) & set(filled.block_hashes)
    assert real.block_hashes == real2.block_hashes and real.cache_salt == PREFILL_SALT
    assert not keep_apart(real) and real.cache_salt == PREFILL_SALT  # once
    salted, filled_salted = _request("s", TOKENS, True, salt="user"), _request("fs", TOKENS, False, salt="user")
    assert keep_apart(salted) and salted.cache_salt == PREFILL_SALT + "user"
    assert not set(salted.block_hashes) & set(filled_salted.block_hashes + real.block_hashes)
    real.append_output_token_ids([7, 8, 9])  # decoding goes on hashing in the salted namespace
    assert len(real.block_hashes) == 5


# Salts a client may send, kvfill's own prefixes (today's and the old one) among them.
CLIENT_SALTS = [None, "x", "kvfill_prefill:", "kvfill_prefill:x", "kvfill:", "kvfill:x", "kvfill:prefill:",
                "kvfill:prefill:x", "kvfill:fill:", "kvfill:fill:x", "kvfill:fill:kvfill:x"]


def _salted(prefill: bool | None) -> dict:
    """Client salt -> the block hashes of ``TOKENS`` sent with it, salted on arrival."""
    out = {}
    for i, salt in enumerate(CLIENT_SALTS):
        req = _request(f"{prefill}-{i}", TOKENS, prefill, salt)
        keep_apart(req)
        assert not keep_apart(req)  # once, whatever its salt now reads
        out[salt] = req.block_hashes
    return out


def test_no_client_salt_makes_a_filled_request_share_blocks_with_real_prefill():
    """Before: real prefill's salt was ``kvfill_prefill:`` + the client's and
    a filled request kept its own, so a filled request salted
    ``kvfill_prefill:`` shared every block with an unsalted real-prefill
    request (``kvfill_prefill:x`` with one salted ``x``), and a real-prefill
    request salted ``kvfill_prefill:...`` was not salted at all (the
    prefix read as "done")."""
    filled, real = _salted(None), _salted(True)
    shared = [(f, r) for f, r in itertools.product(CLIENT_SALTS, CLIENT_SALTS) if set(filled[f]) & set(real[r])]
    assert shared == []


@pytest.mark.parametrize("prefill", [None, True], ids=["filled", "real prefill"])
def test_within_a_kind_each_client_salt_keeps_its_own_blocks(prefill):
    """The salt map is one-to-one: two clients' salts never meet in one
    kind's namespace, and one salt sent twice shares its blocks."""
    hashes = _salted(prefill)
    for a, b in itertools.combinations(CLIENT_SALTS, 2):
        assert not set(hashes[a]) & set(hashes[b]), (a, b)
    assert _salted(prefill) == hashes

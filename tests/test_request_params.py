"""What a request asks of kvfill (connector/request_params.py): only a JSON
boolean ``kvfill_prefill`` is taken, refused where vLLM checks a request's
own parameters (HTTP 400 in its server); and a real-prefill request's
prefix-cache hashes are kept apart from every filled request's, so neither
decodes on the other's blocks (issue 61, findings 1 and 5).  Against vLLM's
own ``SamplingParams`` and ``Request`` with its own block hasher; served end
to end in tests/test_check_serve.py."""
import pytest

pytest.importorskip("vllm")

from vllm.sampling_params import SamplingParams  # noqa: E402
from vllm.utils.hashing import sha256  # noqa: E402
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash  # noqa: E402
from vllm.v1.request import Request  # noqa: E402

from kvfill.connector.request_params import (  # noqa: E402
    PREFILL_PARAM, PREFILL_SALT, install_param_check, keep_apart, prefill_param_error,
)

MALFORMED = ["true", 1, 1.0, None, "", {"nested": True}, [True], 0]
BLOCK = 4


@pytest.mark.parametrize("value", MALFORMED, ids=repr)
def test_a_kvfill_prefill_that_is_not_a_boolean_is_refused_naming_it(value):
    line = prefill_param_error({PREFILL_PARAM: value})
    assert line is not None and repr(value) in line and "must be a JSON boolean" in line
    install_param_check()
    with pytest.raises(Exception, match="kvfill_prefill must be a JSON boolean") as err:
        SamplingParams(extra_args={"kv_transfer_params": {PREFILL_PARAM: value}})
    assert type(err.value).__name__ == "VLLMValidationError"  # vLLM's server answers it with HTTP 400


@pytest.mark.parametrize("params", [{PREFILL_PARAM: True}, {PREFILL_PARAM: False}, {}, {"other": "x"}, None])
def test_a_boolean_or_no_kvfill_prefill_is_taken(params):
    install_param_check()
    install_param_check()  # idempotent: one check, not two
    assert prefill_param_error(params) is None
    SamplingParams(extra_args={"kv_transfer_params": params} if params is not None else None)
    assert getattr(SamplingParams._verify_extra_args, "kvfill_checks", False)


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
    tokens = list(range(100, 117))  # 4 full blocks
    filled, real, real2 = _request("f", tokens, None), _request("r", tokens, True), _request("r2", tokens, True)
    assert real.block_hashes == filled.block_hashes  # what vLLM computed: shared, the defect
    assert not keep_apart(filled) and filled.cache_salt is None
    assert keep_apart(real) and keep_apart(real2)
    assert len(real.block_hashes) == len(filled.block_hashes) == 4
    assert not set(real.block_hashes) & set(filled.block_hashes)
    assert real.block_hashes == real2.block_hashes and real.cache_salt == PREFILL_SALT
    assert not keep_apart(real)  # once
    salted, filled_salted = _request("s", tokens, True, salt="user"), _request("fs", tokens, False, salt="user")
    assert keep_apart(salted) and salted.cache_salt == PREFILL_SALT + "user"
    assert not set(salted.block_hashes) & set(filled_salted.block_hashes + real.block_hashes)
    real.append_output_token_ids([7, 8, 9])  # decoding goes on hashing in the salted namespace
    assert len(real.block_hashes) == 5

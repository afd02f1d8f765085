"""What a request may ask of kvfill in its ``kv_transfer_params``, checked
where vLLM's front end checks a request's own parameters, and kept apart in
vLLM's prefix cache.

``{"kvfill_prefill": true}`` (``PREFILL_PARAM``) asks vLLM to prefill the
request for real beside filled ones, in the same engine: the baseline a fill
is compared with (kvfill-check times the two interleaved).

* **Only a JSON boolean** is taken.  ``"true"``, ``1``, ``null``, ``[true]``
  and the like were silently a fill, so a client sending them believed it
  measured real prefill.  ``install_param_check`` (run by kvfill's vLLM
  plugin in every vLLM process) adds the check where vLLM validates a
  request in its front end, the process that answers the client:
  ``SamplingParams.verify``, which vLLM's ``InputProcessor`` calls for every
  request it turns into an engine request - every OpenAI endpoint,
  ``/inference/v1/generate``, the offline ``LLM`` - so the server answers
  400 naming the value and ``LLM.generate`` raises; and
  ``SamplingParams.from_optional``, which the OpenAI endpoints build a
  request's parameters with before they start a stream, so a streamed
  request gets its 400 too.  Never in ``SamplingParams.__post_init__``:
  msgspec runs it again when the engine core decodes a request, on its
  input-socket thread outside any ``try``; an exception there ends the
  thread and the engine core never reads another request while ``/health``
  stays 200.  A malformed value that reaches the engine core anyway (a
  front end that hands vLLM an ``EngineCoreRequest`` past its
  ``InputProcessor``) is read as "not a prefill request": the request is
  filled, as every request without ``kvfill_prefill: true`` is, and the
  scheduler says so once (``scheduler.KVFillScheduler.on_new_request``).
* **Real prefill never reads a fill's blocks, nor a fill real prefill's.**
  With prefix caching (``vllm serve``'s default) a real-prefill request of a
  prompt an earlier request had filled found the filled blocks in vLLM's
  prefix cache and decoded on them.  ``keep_apart`` - run when vLLM adds a
  request, before it looks the request up in its prefix cache - gives the
  request the salt ``salt_for`` makes of its kind and the client's own
  ``cache_salt`` and computes its block hashes again.  That map is
  one-to-one and the two kinds' salts never meet, whatever salt a client
  sends: real-prefill requests share blocks among themselves, filled ones
  among themselves, two clients' salts stay apart, and no block crosses
  between the kinds.
"""
from __future__ import annotations

from typing import Any

PREFILL_PARAM = "kvfill_prefill"
SALT_NAMESPACE = "kvfill:"  # every salt kvfill writes starts with it
PREFILL_SALT = SALT_NAMESPACE + "prefill:"  # a real-prefill request's salt: this, then the client's own
FILL_ESCAPE = SALT_NAMESPACE + "fill:"  # a filled request's client salt inside kvfill's namespace: this, then it
SALTED = "kvfill_client_salt"  # set on a request keep_apart has salted: the salt its client sent


def wants_prefill(kv_transfer_params: Any) -> bool:
    """The request asks to be prefilled for real (``PREFILL_PARAM`` true)."""
    return isinstance(kv_transfer_params, dict) and kv_transfer_params.get(PREFILL_PARAM) is True


def reads_no_connector_kv(request: Any) -> bool:
    """vLLM takes no connector KV for this request, whatever is granted (it
    zeroes the grant and prefills the request for real): vLLM 0.34's
    ``Request.skip_reading_external_kv`` (prompt logprobs, a prompt-scoring
    start, ``skip_reading_prefix_cache``), 0.32's ``skip_reading_prefix_cache``
    (which ``prompt_logprobs`` sets)."""
    skips = getattr(request, "skip_reading_external_kv", None)
    if skips is None:
        skips = getattr(request, "skip_reading_prefix_cache", False)
    return bool(skips)


def prefill_param_error(kv_transfer_params: Any) -> str | None:
    """Why a request's ``PREFILL_PARAM`` is refused (None: absent or a bool)."""
    if not isinstance(kv_transfer_params, dict) or PREFILL_PARAM not in kv_transfer_params:
        return None
    value = kv_transfer_params[PREFILL_PARAM]
    if isinstance(value, bool):
        return None
    return (f"kv_transfer_params.{PREFILL_PARAM} must be a JSON boolean (true: vLLM prefills this request for "
            f"real; false or absent: kvfill fills it), got {value!r} ({type(value).__name__})")


def _refuse_malformed(extra_args: Any) -> None:
    """Raise vLLM's validation error (its servers' HTTP 400) for a malformed
    ``PREFILL_PARAM`` in a request's ``extra_args``."""
    params = extra_args.get("kv_transfer_params") if isinstance(extra_args, dict) else None
    line = prefill_param_error(params)
    if line is None:
        return
    try:
        from vllm.exceptions import VLLMValidationError
    except ImportError:  # an older vLLM: its servers answer 400 for a ValueError there too
        raise ValueError(line) from None
    raise VLLMValidationError(line, parameter=f"kv_transfer_params.{PREFILL_PARAM}", value=params[PREFILL_PARAM])


def install_param_check() -> None:
    """``SamplingParams.verify`` and ``SamplingParams.from_optional`` also
    refuse a malformed ``PREFILL_PARAM`` (module docstring); idempotent."""
    from vllm.sampling_params import SamplingParams

    verify = SamplingParams.verify
    if not getattr(verify, "kvfill_checks", False):
        def checked_verify(self, *args, **kwargs):
            _refuse_malformed(self.extra_args)  # first: the value the client got wrong is named before others
            return verify(self, *args, **kwargs)

        checked_verify.kvfill_checks = True
        SamplingParams.verify = checked_verify
    build = SamplingParams.__dict__.get("from_optional")
    if isinstance(build, staticmethod) and not getattr(build.__func__, "kvfill_checks", False):
        def checked_from_optional(*args, **kwargs):
            params = build.__func__(*args, **kwargs)
            _refuse_malformed(params.extra_args)
            return params

        checked_from_optional.kvfill_checks = True
        SamplingParams.from_optional = staticmethod(checked_from_optional)


def salt_for(prefill: bool, client_salt: str | None) -> str | None:
    """The ``cache_salt`` vLLM hashes a request's blocks with, from its kind
    and its client's salt.  One-to-one, and no salt of one kind is a salt of
    the other: a real-prefill salt is ``PREFILL_SALT`` and the client's; a
    filled request keeps its client's salt unless that starts with
    ``SALT_NAMESPACE``, which it then carries behind ``FILL_ESCAPE`` - so
    every filled salt either lies outside the namespace or starts with
    ``FILL_ESCAPE``, never with ``PREFILL_SALT``.  No salt and ``""`` are
    one (vLLM hashes neither), and a filled request without one stays
    without: vLLM's hashes of most requests are not computed twice."""
    if prefill:
        return PREFILL_SALT + (client_salt or "")
    if client_salt and client_salt.startswith(SALT_NAMESPACE):
        return FILL_ESCAPE + client_salt
    return client_salt


def keep_apart(request: Any) -> bool:
    """The request's prefix-cache hashes salted by its kind (``salt_for``),
    before vLLM looks it up; True when its salt changed (then its hashes are
    computed again; with prefix caching off vLLM computes none).  Once per
    request, known by a mark on it: a salt's text cannot tell, a client may
    send any."""
    if hasattr(request, SALTED):
        return False
    client_salt = getattr(request, "cache_salt", None)
    setattr(request, SALTED, client_salt)
    salt = salt_for(wants_prefill(getattr(request, "kv_transfer_params", None)), client_salt)
    if salt == client_salt:
        return False
    request.cache_salt = salt
    del request.block_hashes[:]  # in place: vLLM 0.34 keeps the list out of the cyclic GC
    request.update_block_hashes()
    return True

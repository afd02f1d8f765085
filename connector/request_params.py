"""What a request may ask of kvfill in its ``kv_transfer_params``, checked
where vLLM checks a request's own parameters, and kept apart in vLLM's prefix
cache.

``{"kvfill_prefill": true}`` (``PREFILL_PARAM``) asks vLLM to prefill the
request for real beside filled ones, in the same engine: the baseline a fill
is compared with (kvfill-check times the two interleaved).

* **Only a JSON boolean** is taken.  ``"true"``, ``1``, ``null``, ``[true]``
  and the like were silently a fill, so a client sending them believed it
  measured real prefill.  ``install_param_check`` (run by kvfill's vLLM
  plugin in every vLLM process) adds the check to ``SamplingParams``'
  ``_verify_extra_args``, which vLLM runs where it builds a request's
  sampling parameters: the OpenAI server answers 400 naming the value, the
  offline ``SamplingParams(...)`` raises.
* **Real prefill never reads a fill's blocks, nor a fill real prefill's.**
  With prefix caching (``vllm serve``'s default) a real-prefill request of a
  prompt an earlier request had filled found the filled blocks in vLLM's
  prefix cache and decoded on them.  ``keep_apart`` - the connector's
  ``on_new_request``, which vLLM calls when it adds a request, before it looks
  the request up in its prefix cache - salts a real-prefill request's block
  hashes (vLLM's own ``cache_salt``, prefixed ``PREFILL_SALT``) and computes
  them again: real-prefill requests share blocks among themselves, never
  with a filled request, either way round.  A client's own ``cache_salt`` is
  kept inside the prefixed one.
"""
from __future__ import annotations

from typing import Any

PREFILL_PARAM = "kvfill_prefill"
PREFILL_SALT = "kvfill_prefill:"  # prefixes a real-prefill request's cache_salt


def wants_prefill(kv_transfer_params: Any) -> bool:
    """The request asks to be prefilled for real (``PREFILL_PARAM`` true)."""
    return isinstance(kv_transfer_params, dict) and kv_transfer_params.get(PREFILL_PARAM) is True


def prefill_param_error(kv_transfer_params: Any) -> str | None:
    """Why a request's ``PREFILL_PARAM`` is refused (None: absent or a bool)."""
    if not isinstance(kv_transfer_params, dict) or PREFILL_PARAM not in kv_transfer_params:
        return None
    value = kv_transfer_params[PREFILL_PARAM]
    if isinstance(value, bool):
        return None
    return (f"kv_transfer_params.{PREFILL_PARAM} must be a JSON boolean (true: vLLM prefills this request for "
            f"real; false or absent: kvfill fills it), got {value!r} ({type(value).__name__})")


def install_param_check() -> None:
    """``SamplingParams._verify_extra_args`` also refuses a malformed
    ``PREFILL_PARAM`` (module docstring); idempotent."""
    from vllm.sampling_params import SamplingParams

    try:
        from vllm.exceptions import VLLMValidationError
    except ImportError:  # an older vLLM: its servers answer 400 for a ValueError there too
        VLLMValidationError = None
    verify = getattr(SamplingParams, "_verify_extra_args", None)
    if verify is None or getattr(verify, "kvfill_checks", False):
        return

    def _verify_extra_args(self) -> None:
        verify(self)
        params = (self.extra_args or {}).get("kv_transfer_params")
        line = prefill_param_error(params)
        if line is None:
            return
        if VLLMValidationError is None:
            raise ValueError(line)
        raise VLLMValidationError(line, parameter=f"kv_transfer_params.{PREFILL_PARAM}",
                                  value=params[PREFILL_PARAM])

    _verify_extra_args.kvfill_checks = True
    SamplingParams._verify_extra_args = _verify_extra_args


def keep_apart(request: Any) -> bool:
    """A real-prefill request's prefix-cache hashes salted apart from every
    filled request's (module docstring), before vLLM looks it up; True when
    it was (with prefix caching off vLLM computes no hashes: the salt is
    all that changes)."""
    if not wants_prefill(getattr(request, "kv_transfer_params", None)):
        return False
    salt = getattr(request, "cache_salt", None) or ""
    if salt.startswith(PREFILL_SALT):
        return False
    request.cache_salt = PREFILL_SALT + salt
    del request.block_hashes[:]  # in place: vLLM 0.34 keeps the list out of the cyclic GC
    request.update_block_hashes()
    return True

"""A served check that a real-prefill request is real prefill under vLLM's
prefix cache (``connector/request_params.py``).

On a running kvfill server, one prompt is completed four ways, greedy, one
after another (each bounded in time):

1. filled - kvfill writes its KV (and vLLM caches those blocks);
2. ``kv_transfer_params {"kvfill_prefill": true}`` - vLLM prefills it;
3. ``"kvfill_prefill": true`` with a ``cache_salt`` of its own - a request
   no block cached before can serve: real prefill by construction, the
   reference;
4. ``"kvfill_prefill": "true"`` (a string) - refused with HTTP 400.

The real-prefill request must decode the salted request's tokens; the
filled one must not (else the probe could not tell reuse from real prefill:
reported as inconclusive).  ``bench/serve.py --prefill-probe`` runs it and
stores the outcome; tests/test_bench_scripts.py holds it to that.
"""
from __future__ import annotations

import json
import urllib.error
import urllib.request


def complete(url: str, body: dict, timeout: float) -> tuple[int, dict]:
    """POST ``body`` to a /v1/completions ``url``: (HTTP status, the JSON answer)."""
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.load(r)
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read().decode() or "{}")


def prefill_probe(base_url: str, model: str, ids: list[int], max_tokens: int = 8, timeout: float = 300.0) -> dict:
    """The four completions above; ``ok`` when real prefill decoded the
    salted reference's tokens, the fill did not, and the malformed value got
    a 400 naming it."""
    url = f"{base_url}/v1/completions"
    base = {"model": model, "prompt": ids, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True,
            "return_token_ids": True}

    def tokens(extra: dict) -> list[int] | str:
        status, answer = complete(url, {**base, **extra}, timeout)
        if status != 200:
            return f"HTTP {status}: {answer}"
        choice = answer["choices"][0]
        return list(choice.get("token_ids") or []) or choice["text"]

    out = {"filled": tokens({}),
           "prefill": tokens({"kv_transfer_params": {"kvfill_prefill": True}}),
           "salted": tokens({"kv_transfer_params": {"kvfill_prefill": True}, "cache_salt": "kvfill-prefill-probe"})}
    status, answer = complete(url, {**base, "kv_transfer_params": {"kvfill_prefill": "true"}}, timeout)
    out["malformed"] = {"status": status, "message": str(answer.get("error", answer))[:400]}
    out["real_is_real"] = out["prefill"] == out["salted"]
    out["fill_differs"] = out["filled"] != out["salted"]
    out["malformed_refused"] = status == 400 and "kvfill_prefill must be a JSON boolean" in out["malformed"]["message"]
    out["ok"] = out["real_is_real"] and out["fill_differs"] and out["malformed_refused"]
    return out

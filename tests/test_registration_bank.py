"""A registration keeps no host copy of the bank that the engine does not
read (issue 66, H3).

On a GPU the bank part is read into host memory, then uploaded to the
caches' device (placement "device"): from then on only the device copy is
read, and the host copy, as large as the device one, must go once
registration returns.  On vLLM CPU the "device" copy *is* the host bank, so
the caches here are the accelerator stand-in's (tests/device_rule.py), whose
upload makes a distinct copy as CUDA's does.  The worker is vLLM's, driven
through the real ``register_kv_caches`` and ``load_replay`` (the CPU
harness), so whatever on that path keeps the host rows is caught, not only
the ``Registration`` value.  Placement "host" reads the host rows at every
fill: they stay, and a fill still writes them.
"""
import contextlib
import gc

import pytest
import torch

pytest.importorskip("vllm")
pytestmark = pytest.mark.cpu_only  # the harness runs vLLM's CPU build
from device_rule import DeviceRule, on_device  # noqa: E402
from test_connector import ATT, LAYERS, bank_of_layers  # noqa: E402
from torch.multiprocessing.reductions import StorageWeakRef  # noqa: E402
from vllm.v1.kv_cache_interface import FullAttentionSpec  # noqa: E402
from vllm_harness import make_harness  # noqa: E402

from kvfill.kernels import Bank  # noqa: E402


def replaying(tmp_path, placement: str):
    """A replaying harness over ``bank_of_layers``, registered on the host."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    path = bank_of_layers(tmp_path / "bank.safetensors")
    return make_harness(tmp_path / "h", [(LAYERS, FullAttentionSpec(**ATT))],
                        extra={"fill_mode": "replay", "bank": path, "bank_placement": placement})


def register_on_the_stand_in(tmp_path, monkeypatch, placement: str):
    """A replaying worker registered again over stand-in device caches with
    ``bank_placement``; returns the harness, the device caches and weak
    references to the storages of the host rows ``Bank.load`` read for it."""
    h = replaying(tmp_path, placement)
    loaded = []
    load = Bank.load.__func__

    def kept_load(cls, *args, **kw):
        bank = load(cls, *args, **kw)
        # weak references only: holding the Bank here would keep the rows alive itself
        loaded.extend(StorageWeakRef(t.untyped_storage()) for t in bank.layers.values())
        return bank

    monkeypatch.setattr(Bank, "load", classmethod(kept_load))
    with DeviceRule():
        device = h.poison.to("cpu:0")  # the caches' memory, a copy on the stand-in device
        assert on_device(device)
        h.worker.register_kv_caches(h.views_over(device))
    gc.collect()
    assert len(loaded) == len(LAYERS)  # this registration's load, one storage per layer
    return h, device, loaded


def test_a_device_placed_bank_keeps_no_host_rows_once_registered(tmp_path, monkeypatch):
    h, _, host_rows = register_on_the_stand_in(tmp_path, monkeypatch, "device")
    engine = h.worker.worker.engine
    alive = [LAYERS[i] for i, ref in enumerate(host_rows) if not ref.expired()]
    assert alive == [], f"the host rows of {alive} outlive registration; only their device copies are read"
    # what the engine reads instead: the device copy, one per layer
    assert engine.bank_placement == "device"
    rows = [t.bank for t in engine._registry.tensors if t.bank is not None]
    assert len(rows) == len(LAYERS) and all(on_device(r) for r in rows)


def test_a_host_placed_bank_keeps_the_rows_its_fills_read(tmp_path, monkeypatch):
    """The rows stay, and a fill from them writes what the same fill writes on
    the host (a harness registered there, its engine reading the bank in place)."""
    h, device, host_rows = register_on_the_stand_in(tmp_path / "stand-in", monkeypatch, "host")
    assert h.worker.worker.engine.bank_placement == "host"
    assert all(not ref.expired() for ref in host_rows)  # the engine stages them at every fill
    reference = replaying(tmp_path / "host", "device")
    prompt = list(range(100, 140))
    for harness, rule in ((h, DeviceRule()), (reference, contextlib.nullcontext())):
        harness.add("a", prompt)
        with rule:
            _, meta = harness.step()
        assert meta.reqs_to_fill["a"]
    assert h.block_table("a") == reference.block_table("a")
    assert not torch.equal(reference.raw, reference.poison)
    assert torch.equal(device.view(torch.uint8), reference.raw.view(torch.uint8))

"""fill_blocks under CUDA graph capture, simulated on the CPU.

A CPU machine cannot capture a graph, so these tests patch torch's public
capture query (``torch.cuda.is_current_stream_capturing``, with
``torch.cuda.is_available``) and drive the very path a captured fill takes:
the plan is built on the device with fixed-size torch ops and filled by the
Triton kernel (interpreter) without host checks.  ``gpu/gpu_check.py``
captures and replays a real graph on a GPU.
"""
import gc
import weakref

import pytest
import torch
from oracle import poisoned_buffer

from kvfill.kernels import FillEngine, fill_blocks, verify_blocks
from kvfill.kernels.api import captured_engines, clear_engine_cache, num_cached_engines, release_captured_fills

pytestmark = pytest.mark.cpu_only  # a GPU run captures real graphs in gpu_check instead


@pytest.fixture
def capture(monkeypatch):
    """``capture.on = True``: torch reports the current stream as capturing."""

    class State:
        on = False

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: State.on)
    clear_engine_cache()
    release_captured_fills()
    yield State
    release_captured_fills()
    clear_engine_cache()


def cache(seed=1, blocks=6):
    buf = poisoned_buffer(blocks * 2 * 4 * 8 * 2, seed)
    return buf, buf.view(torch.bfloat16).view(blocks, 2, 4, 8)


KW = dict(mean=0.0, std=1.0, seed=3, backend="triton")


def test_captured_fill_keeps_its_engine_alive_past_eviction_and_clear(capture):
    _, c = cache()
    gc.collect()
    before = {id(o) for o in gc.get_objects() if isinstance(o, FillEngine)}
    fill_blocks([c], [1], **KW)  # warm-up: builds the engine outside capture
    new = [o for o in gc.get_objects() if isinstance(o, FillEngine) and id(o) not in before]
    assert len(new) == 1
    ref = weakref.ref(new[0])
    del new
    capture.on = True
    fill_blocks([c], torch.tensor([2, 4]), **KW)  # "recorded into the graph"
    capture.on = False
    assert captured_engines() == (ref(),)
    for i in range(9):  # more cache sets than the engine cache keeps
        _, other = cache(seed=10 + i)
        fill_blocks([other], [0], **KW)
    clear_engine_cache()
    gc.collect()
    assert num_cached_engines() == 0
    assert ref() is not None, "the captured fill's engine (its layer table) was freed"
    release_captured_fills()
    gc.collect()
    assert ref() is None and captured_engines() == ()


@pytest.mark.parametrize("ids", [[3, 7], (1,), "numpy"])
def test_host_block_ids_are_refused_under_capture_before_anything_else(capture, ids):
    import numpy as np

    buf, c = cache()
    fill_blocks([c], [0], **KW)  # an engine exists: the refusal must not depend on that
    poison = buf.clone()
    capture.on = True
    host_ids = np.array([3, 7]) if ids == "numpy" else ids
    with pytest.raises(RuntimeError, match=r"under CUDA graph capture, block_ids must be a tensor on the "
                                           r"caches' device \(cpu\); got (list|tuple|ndarray)"):
        fill_blocks([c], host_ids, **KW)
    assert torch.equal(buf, poison)


def test_captured_plan_keeps_the_first_of_repeated_ids_and_skips_ids_past_int32(capture):
    """Host rule: a repeated id keeps its first position; ids outside the
    caches write nothing.  2**32 + 1 must not wrap to block 1."""
    buf, c = cache(seed=5)
    ref_buf, ref = cache(seed=5)
    fill_blocks([c], [2], **KW)
    fill_blocks([ref], [2], **KW)
    capture.on = True
    fill_blocks([c], torch.tensor([2, 5, 2, 2**32 + 1, -1, 2**31, 5]), **KW)
    capture.on = False
    fill_blocks([ref], [2, 5], **KW)  # the host path: what the captured fill must equal
    assert torch.equal(buf, ref_buf)
    assert verify_blocks([c], [2, 5], **KW).ok
    assert torch.equal(c[1].view(torch.int16), poisoned_buffer(buf.numel(), 5).view(torch.bfloat16)
                       .view(6, 2, 4, 8)[1].view(torch.int16))


def test_capture_without_a_warm_up_is_refused(capture):
    buf, c = cache()
    poison = buf.clone()
    capture.on = True
    with pytest.raises(RuntimeError, match=r"warm-up call with the same caches and arguments before capture"):
        fill_blocks([c], torch.tensor([1]), **KW)
    assert torch.equal(buf, poison)


def test_capture_with_the_caches_on_another_device_is_refused(capture, monkeypatch):
    """Capture records the current device's stream: a fill of caches on
    another GPU would run eagerly, outside the graph.  Simulated: the engine
    reports cuda:1 while cuda:0 is current."""
    buf, c = cache()
    fill_blocks([c], [0], **KW)
    poison = buf.clone()
    monkeypatch.setattr(FillEngine, "device", property(lambda self: torch.device("cuda", 1)))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    capture.on = True
    with pytest.raises(RuntimeError, match=r"caches' device \(cuda:1\) must be the current device \(cuda:0\)"):
        fill_blocks([c], torch.tensor([1]), **KW)
    assert torch.equal(buf, poison)


def replay_engine_over(c, seed=4):
    from kvfill.kernels import Bank, CacheGroup

    g = torch.Generator(device="cpu").manual_seed(seed)
    # ragged: sequence 1 has 13 rows, so the captured entry at positions 11..14 wraps inside it
    bank = Bank({"l": torch.randn(40 + 13, 2 * 8, generator=g, device="cpu").to(torch.bfloat16)},
                sequence_lengths=[40, 13])
    return FillEngine({"g": CacheGroup({"l": c})}, bank=bank, backend="triton")


def test_a_captured_replay_fill_pins_its_user_held_engine(capture):
    """A replay fill is captured through a user's FillEngine
    (``fill_device_entries``); the graph reads the engine's layer table and
    bank copy, so dropping the user's reference must not free them."""
    buf, c = cache(seed=7)
    ref_buf, ref = cache(seed=7)
    eng = replay_engine_over(c)
    eng.warmup()
    engine_ref = weakref.ref(eng)
    entries = torch.tensor([[2, 0, 4, 11, 1], [4, 0, 4, 4, 0]], dtype=torch.int32)
    capture.on = True
    assert eng.fill_device_entries("g", entries) == 1  # "recorded into the graph"
    capture.on = False
    del eng
    gc.collect()
    assert engine_ref() is not None, "the captured replay fill's engine (layer table, bank copy) was freed"
    assert captured_engines() == (engine_ref(),)
    from kvfill.kernels import GroupFill

    host = replay_engine_over(ref)
    host.fill({"g": GroupFill([2, 4], local_base=[11, 4], sequence=[1, 0])})
    assert torch.equal(buf, ref_buf)
    rows = host._registry.tensors[0].bank.cpu()  # the engine's copy: sequence 1 from row 40
    for slot, row in enumerate([40 + 11, 40 + 12, 40 + 0, 40 + 1]):
        assert torch.equal(c[2, :, slot].reshape(-1).view(torch.int16), rows[row].view(torch.int16)), slot
    release_captured_fills()
    gc.collect()
    assert engine_ref() is None and captured_engines() == ()


def test_a_captured_replay_fill_of_caches_on_another_device_is_refused(capture, monkeypatch):
    """``fill_device_entries`` keeps the capture rule of ``fill_blocks``: with
    cuda:0 current and the engine's caches on cuda:1, the launch would run
    once, eagerly, and be missing from the graph.  Nothing is written."""
    buf, c = cache(seed=9)
    poison = buf.clone()
    eng = replay_engine_over(c)
    eng.warmup()
    monkeypatch.setattr(FillEngine, "device", property(lambda self: torch.device("cuda", 1)))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    capture.on = True
    with pytest.raises(RuntimeError, match=r"caches' device \(cuda:1\) must be the current device \(cuda:0\)"):
        eng.fill_device_entries("g", torch.tensor([[2, 0, 4, 0, 1]], dtype=torch.int32))
    capture.on = False
    assert torch.equal(buf, poison) and captured_engines() == ()


def test_capturing_an_engine_that_was_not_warmed_up_is_refused(capture):
    buf, c = cache(seed=8)
    poison = buf.clone()
    eng = replay_engine_over(c)
    capture.on = True
    with pytest.raises(RuntimeError, match=r"fill_device_entries under CUDA graph capture needs engine.warmup\(\)"):
        eng.fill_device_entries("g", torch.tensor([[2, 0, 4, 0, 1]], dtype=torch.int32))
    capture.on = False
    assert torch.equal(buf, poison) and captured_engines() == ()

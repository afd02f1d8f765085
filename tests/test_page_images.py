"""Page images (torch backend, ``page_images.PageImages``): whole pages of vLLM
CPU's K/V layout already written are copied again for later requests at the
same positions.  Every fill through the store writes the bytes a fill without
it writes (itself checked against the Triton kernel in test_replay.py), and
nothing else: poisoned memory around every write."""
import numpy as np
import pytest
import torch
from oracle import poisoned_buffer
from test_fill_layouts import assert_same_bytes

from kvfill.connector.cpu_layout import cpu_kv_parts
from kvfill.kernels import Bank, CacheGroup, FillEngine, GroupFill, torch_fill, torch_pages

NB, HEADS, SLOTS, DIM, LAYERS = 9, 2, 8, 4, 2
PAGE = SLOTS * 2 * HEADS * DIM * 2  # bytes of a layer's whole page (K and V), bf16
# Two requests at the same positions in other blocks; their last blocks are partial.
FIRST = GroupFill([2, 3, 4], slot_end=[8, 8, 5], local_base=[0, 8, 16])
SECOND = GroupFill([6, 7, 0, 8], slot_end=[8, 8, 8, 3], local_base=[0, 8, 16, 24])


@pytest.fixture(autouse=True)
def tiny_pages_take_the_page_paths(monkeypatch):
    monkeypatch.setattr(torch_pages, "PAGE_BYTES", 0)
    monkeypatch.setattr(torch_fill, "PER_ENTRY_BYTES", 1 << 40)  # partial entries: the index-put path


def engine(buf, page_image_bytes=None, bank=None, std=0.5):
    caches = buf.view(torch.bfloat16).view(LAYERS, NB, HEADS, SLOTS, 2 * DIM)
    layers = {f"l{i}": cpu_kv_parts(caches[i], DIM) for i in range(LAYERS)}
    return FillEngine({"g": CacheGroup(layers, slot_dim=2)}, std=std, seed=3, backend="torch",
                      bank=bank, page_image_bytes=page_image_bytes)


def fill_both(plans, page_image_bytes=None, bank=None, warm=0):
    """The same fills with and without page images, on equal poisoned buffers."""
    out = []
    for images in (page_image_bytes, 0):
        buf = poisoned_buffer(LAYERS * NB * PAGE, seed=4)
        eng = engine(buf, images, bank)
        eng.warmup(warm)
        for plan in plans:
            eng.fill({"g": plan})
            assert eng.verify({"g": plan}).ok
        out.append((buf, eng))
    return out


def staged_calls(monkeypatch):
    """(target, pages) of every fill_pages_staged call: into a store or into a cache."""
    calls = []
    real = torch_pages.fill_pages_staged
    monkeypatch.setattr(torch_pages, "fill_pages_staged",
                        lambda view, layout, ids, *a: calls.append((view.shape[0], list(ids))) or
                        real(view, layout, ids, *a))
    return calls


def test_a_later_request_at_the_same_positions_is_copied_from_the_store(monkeypatch):
    calls = staged_calls(monkeypatch)
    (with_images, eng), (without, _) = fill_both([FIRST, SECOND])
    assert_same_bytes(with_images, without)
    store_pages = [ids for n, ids in calls if n != NB]
    # Images: the first request's two whole pages, then the second's third (position 16) - once per tensor.
    assert sorted(sum(store_pages, [])) == sorted([0, 1] * 2 * LAYERS + [2] * 2 * LAYERS)
    assert sum(im.num_pages for im in eng._backend.images.values()) == 3 * 2  # K and V classes
    untouched = poisoned_buffer(LAYERS * NB * PAGE, seed=4).view(LAYERS, NB, -1)[:, [1, 5]]
    assert torch.equal(with_images.view(LAYERS, NB, -1)[:, [1, 5]], untouched)


def test_partial_blocks_copy_the_slots_of_a_page_the_store_holds(monkeypatch):
    """SECOND's last block (position 24, 3 slots) has no page; after a
    request with a whole page there, a partial block at 24 is copied."""
    third = GroupFill([1, 5], slot_end=[8, 2], local_base=[24, 24])  # block 1 whole, block 5 partial
    (with_images, eng), (without, _) = fill_both([SECOND, third])
    assert_same_bytes(with_images, without)
    split = torch_fill.ClassRows(torch_fill.SlotRows(third.normalized(SLOTS), eng._registry.groups["g"].dcp),
                                 eng._registry.classes[0], next(iter(eng._backend.images.values())))
    assert split.partial.tolist() == [1] and split.rest.size == 0


def test_pages_past_the_budget_are_written_directly(monkeypatch):
    calls = staged_calls(monkeypatch)
    # Room for one page of every tensor (K and V of each layer): position 0 only.
    (with_images, eng), (without, _) = fill_both([FIRST, SECOND], page_image_bytes=LAYERS * PAGE + PAGE // 4)
    assert_same_bytes(with_images, without)
    assert [im.num_pages for im in eng._backend.images.values()] == [1, 1]
    assert any(n == NB for n, _ in calls), "pages past the budget were not written into the caches"


def test_no_budget_keeps_no_images():
    buf = poisoned_buffer(LAYERS * NB * PAGE, seed=4)
    assert engine(buf, page_image_bytes=0)._backend.images == {}
    assert "page images" not in engine(buf, page_image_bytes=0).describe()


def test_replay_keeps_a_page_per_sequence_and_position():
    g = torch.Generator(device="cpu").manual_seed(1)
    bank = Bank({f"l{i}": torch.randn(2, 40, 2 * HEADS * DIM, generator=g, device="cpu").to(torch.bfloat16)
                 for i in range(LAYERS)})
    a = GroupFill([2, 3], local_base=[0, 8], sequence=[0, 0])
    b = GroupFill([4, 5, 6], slot_end=[8, 8, 4], local_base=[0, 8, 16], sequence=[1, 1, 1])
    c = GroupFill([7, 8], slot_end=[8, 6], local_base=[0, 8], sequence=[0, 0])
    (with_images, eng), (without, _) = fill_both([a, b, c], bank=bank)
    assert_same_bytes(with_images, without)
    assert sorted(next(iter(eng._backend.images.values())).index) == [(0, 0), (0, 8), (1, 0), (1, 8)]
    # Sequence 1's pages differ from sequence 0's at the same positions.
    caches = with_images.view(LAYERS, NB, -1)
    assert not torch.equal(caches[:, 2], caches[:, 4])


def test_ragged_replay_pages_wrap_inside_their_own_sequence():
    """Sequence 0 has 5 rows, sequence 1 has 12: pages at positions 0, 8 and
    16 hold wrapped rows (t mod N_s); each page image is kept per sequence
    and position, and copies of it equal the direct fill byte for byte."""
    g = torch.Generator(device="cpu").manual_seed(2)
    rows = torch.randn(5 + 12, 2 * HEADS * DIM, generator=g, device="cpu").to(torch.bfloat16)
    bank = Bank({f"l{i}": rows.roll(i, 0) for i in range(LAYERS)}, sequence_lengths=[5, 12])
    a = GroupFill([2, 3, 4], local_base=[0, 8, 16], sequence=[0, 0, 1])
    b = GroupFill([5, 6, 7], slot_end=[8, 8, 6], local_base=[0, 8, 16], sequence=[0, 0, 1])  # pages again
    c = GroupFill([8, 0], local_base=[0, 8], sequence=[1, 1])
    (with_images, eng), (without, _) = fill_both([a, b, c], bank=bank)
    assert_same_bytes(with_images, without)
    assert sorted(next(iter(eng._backend.images.values())).index) == [(0, 0), (0, 8), (1, 0), (1, 8), (1, 16)]
    caches = with_images.view(torch.bfloat16).view(LAYERS, NB, HEADS, SLOTS, 2 * DIM)
    for layer in range(LAYERS):
        k, v = cpu_kv_parts(caches[layer], DIM)
        want = rows.roll(layer, 0)
        for block, base, seq in [(3, 8, 0), (4, 16, 1), (0, 8, 1)]:
            for slot in range(SLOTS):
                row = [0, 5][seq] + (base + slot) % [5, 12][seq]
                got = torch.cat([k[block, :, slot].reshape(-1), v[block, :, slot].reshape(-1)])
                assert torch.equal(got.view(torch.int16), want[row].view(torch.int16).to(got.device)), \
                    (layer, block, slot)
    untouched = poisoned_buffer(LAYERS * NB * PAGE, seed=4).view(LAYERS, NB, -1)[:, [1]]
    assert torch.equal(with_images.view(LAYERS, NB, -1)[:, [1]], untouched)


def test_warmup_writes_the_images_of_every_position_and_nothing_to_the_caches(monkeypatch):
    buf = poisoned_buffer(LAYERS * NB * PAGE, seed=4)
    eng = engine(buf)
    eng.warmup(3 * SLOTS + 5)  # positions [0, 29): pages at 0, 8, 16 and the one at 24 that holds 24..28
    assert_same_bytes(buf, poisoned_buffer(LAYERS * NB * PAGE, seed=4))
    assert sorted(next(iter(eng._backend.images.values())).index) == [(0, 0), (0, 8), (0, 16), (0, 24)]
    assert "page images: 8 pages of 2 launch class(es)" in eng.describe()
    calls = staged_calls(monkeypatch)
    eng.fill({"g": FIRST})
    eng.fill({"g": GroupFill([5], slot_end=[5], local_base=[24])})  # a last block at the last page
    assert calls == [], "a warmed page was written again"
    assert eng.verify({"g": FIRST}).ok
    assert eng.verify({"g": GroupFill([5], slot_end=[5], local_base=[24])}).ok
    untouched = poisoned_buffer(LAYERS * NB * PAGE, seed=4).view(LAYERS, NB, -1)
    keep = [b for b in range(NB) if b not in (2, 3, 4, 5)]
    assert torch.equal(buf.view(LAYERS, NB, -1)[:, keep], untouched[:, keep])


def test_a_warmed_engine_and_a_cold_one_write_the_same_bytes():
    (warm, _), _ = fill_both([SECOND, FIRST], warm=4 * SLOTS)
    (cold, _), _ = fill_both([SECOND, FIRST])
    assert_same_bytes(warm, cold)


@pytest.mark.parametrize("bad", [-1, 1.5, True, "1"])
def test_a_bad_budget_is_refused_naming_it(bad):
    with pytest.raises(ValueError, match=rf"page_image_bytes must be an int >= 0 \(or None\), got {bad!r}"):
        engine(poisoned_buffer(LAYERS * NB * PAGE, seed=4), page_image_bytes=bad)


def test_the_store_keeps_the_caches_stride_order():
    """A copy between cache and store runs over contiguous spans on both
    sides: the store's strides order the dims as the cache's do."""
    buf = poisoned_buffer(LAYERS * NB * PAGE, seed=4)
    eng = engine(buf)
    eng.fill({"g": FIRST})
    for c in eng._registry.classes:
        images = eng._backend.images[id(c)]
        for i, t in enumerate(c.tensors):
            view = torch_fill.canonical_view(t.tensor, c.layout)
            store = images.stores[i]
            dims = [d for d in range(1, view.dim()) if view.shape[d] > 1]
            assert sorted(dims, key=view.stride) == sorted(dims, key=store.stride)
            assert store.stride(0) == SLOTS * HEADS * DIM  # a page of one part, dense


def test_a_store_that_cannot_grow_forgets_its_new_pages_and_later_fills_stay_right(monkeypatch):
    """The second tensor's store fails to allocate in the first fill: the
    error names the budget, and the next fill writes its pages again instead
    of copying pages that were never written."""
    buf = poisoned_buffer(LAYERS * NB * PAGE, seed=4)
    eng = engine(buf)
    real, calls = torch.empty, []

    def failing_empty(*a, **kw):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("DefaultCPUAllocator: can't allocate memory")
        return real(*a, **kw)

    monkeypatch.setattr(torch_fill.torch, "empty", failing_empty)
    with pytest.raises(MemoryError, match=r"page images: allocating .* MiB for 2 pages of a store failed .*"
                                          r"lower page_image_bytes \(the connector's page_image_mib; 0 keeps none\)"):
        eng.fill({"g": GroupFill([2, 3], local_base=[0, 8])})
    monkeypatch.setattr(torch_fill.torch, "empty", real)
    assert sum(im.num_pages for im in eng._backend.images.values()) == 0
    later = GroupFill([5, 6], local_base=[0, 8])
    eng.fill({"g": later})
    assert eng.verify({"g": later}).ok
    ref = poisoned_buffer(LAYERS * NB * PAGE, seed=4)
    engine(ref, page_image_bytes=0).fill({"g": later})
    caches, want = buf.view(LAYERS, NB, -1), ref.view(LAYERS, NB, -1)
    assert torch.equal(caches[:, [5, 6]], want[:, [5, 6]])


def test_stores_grow_with_the_pages_in_use_and_keep_them():
    buf = poisoned_buffer(LAYERS * NB * PAGE, seed=4)
    eng = engine(buf)
    eng.fill({"g": GroupFill([2], local_base=[0])})
    images = next(iter(eng._backend.images.values()))
    assert images.capacity > 1000 and all(st.shape[0] == 1 for st in images.stores.values())
    eng.fill({"g": GroupFill([3, 4, 5], local_base=[8, 16, 24])})
    assert all(st.shape[0] == 4 for st in images.stores.values())
    again = GroupFill([6, 7, 8, 0], local_base=[0, 8, 16, 24])  # all four from the grown stores
    eng.fill({"g": again})
    assert eng.verify({"g": again}).ok


def test_after_warmup_pages_past_its_positions_are_not_kept():
    buf = poisoned_buffer(LAYERS * NB * PAGE, seed=4)
    eng = engine(buf)
    eng.warmup(2 * SLOTS)
    far = GroupFill([2, 3, 4], local_base=[0, 16, 48])
    eng.fill({"g": far})
    assert eng.verify({"g": far}).ok
    assert sorted(next(iter(eng._backend.images.values())).index) == [(0, 0), (0, 8)]


def test_numpy_integers_are_accepted():
    buf = poisoned_buffer(LAYERS * NB * PAGE, seed=4)
    eng = engine(buf, page_image_bytes=np.int64(1 << 20))
    eng.warmup(np.int64(SLOTS))
    assert sorted(next(iter(eng._backend.images.values())).index) == [(0, 0)]

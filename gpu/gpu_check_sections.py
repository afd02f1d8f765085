"""The GPU check's sections, which gpu/gpu_check.py runs and reports:
byte-exact correctness of every layout x dtype x mode against the torch
backend, CUDA-graph capture of ``fill_blocks`` and of a replay fill, and the
device guard; ``isolated`` makes a case that raises that case's own result.
Torch + triton + kvfill only (the GPU image has no vLLM).
"""
from __future__ import annotations

import math

import torch

from kvfill.kernels import NO_DCP, CacheGroup, DcpGeometry, FillEngine, GroupFill, fill_blocks
from kvfill.kernels import testing as LZ

SLOT_ENTRIES = [(4, 3, 8, 0), (1, 0, 8, 8), (5, 0, 2, 16)]
STATE_ENTRIES = [(4, 0, 1, 7), (2, 0, 1, 9)]
# Replay: a sequence per entry; a ragged bank of sequences of BANK_LENGTHS
# positions, the entries reach position 18, so rows past each one's length wrap.
BANK_LENGTHS = (11, 7, 13)
REPLAY_SLOT_ENTRIES = [(4, 3, 8, 0, 2), (1, 0, 8, 8, 0), (5, 0, 2, 16, 1)]
REPLAY_STATE_ENTRIES = [(4, 0, 1, 7, 1), (2, 0, 1, 9, 2)]


def _engine(layers, case, encoding, backend, std, bank=None, dcp=NO_DCP):
    group = CacheGroup(
        layers, num_blocks=LZ.NUM_BLOCKS, block_dim=case.block_dim, slot_dim=case.slot_dim, encoding=encoding,
        kv=case.kv, dcp=dcp,
    )
    return FillEngine({"g": group}, mean=0.25, std=std, seed=11, backend=backend, bank=bank)


def random_bank(engine, dtype, seed=7, dcp=NO_DCP):
    """Random bits per layer of a (bank-less) engine, in ``dtype``, on the
    host (replay moves bits, it never decodes them; the replaying engine
    uploads its copy): where every layer names its K/V heads, TP rank 1's part
    of a canonical bank of twice the heads (``BankPart``: the slice a rank of
    a TP 2 engine loads, staging permuting it into the cache's order), else a
    bank of the layers' own rows; ``[sum(BANK_LENGTHS), row]`` each; under
    ``dcp``, the positions of that DCP rank."""
    from kvfill.bank import Bank, BankPart

    g = torch.Generator(device="cpu").manual_seed(seed)
    itemsize = torch.empty((), dtype=dtype, device="cpu").element_size()
    formats = engine.row_formats()
    sliced = all(f.kv is not None for f in formats.values())
    layers, kv = {}, {}
    for name, fmt in formats.items():
        row = sum(math.prod(p) for p in fmt.parts) * (2 if sliced else 1)
        raw = torch.randint(0, 256, (sum(BANK_LENGTHS) * row * itemsize,), dtype=torch.uint8, generator=g,
                            device="cpu")
        layers[name] = raw.view(dtype).view(sum(BANK_LENGTHS), row)
        kv[name] = (2 * fmt.kv[0], *fmt.kv[1:]) if sliced else fmt.kv
    bank = Bank(layers, sequence_lengths=BANK_LENGTHS, kv=kv)
    if sliced:
        return bank.select(BankPart(tp_rank=1, tp_size=2, dcp=dcp))
    return bank.select(BankPart(dcp=dcp)) if dcp.sharded else bank


def check_case(case, dtype, encoding, device, mode, dcp=NO_DCP):
    """Bytes of the whole buffer that differ between the Triton fill on the
    device and the torch backend's fill of a host copy (0: byte-exact);
    ``dcp``: the caches are that DCP rank's (its slots hold its positions)."""
    itemsize = torch.empty((), dtype=dtype, device="cpu").element_size()
    g = torch.Generator(device="cpu").manual_seed(99)
    host = torch.randint(0, 256, (case.nbytes(itemsize),), dtype=torch.uint8, generator=g, device="cpu")
    dev = host.to(device, copy=True)  # a copy even on the CPU (smoke runs)
    std = 0.0 if mode == "constant" else 1.0
    bank = None
    if mode == "replay":
        entries = REPLAY_STATE_ENTRIES if case.state_list else REPLAY_SLOT_ENTRIES
        bank = random_bank(_engine(case.make(host.clone(), dtype), case, encoding, "torch", std), dtype, dcp=dcp)
    else:
        entries = STATE_ENTRIES if case.state_list else SLOT_ENTRIES
    plan = {"g": GroupFill(*zip(*entries))}
    _engine(case.make(dev, dtype), case, encoding, "triton", std, bank, dcp).fill(plan)
    _engine(case.make(host, dtype), case, encoding, "torch", std, bank, dcp).fill(plan)
    got = dev.cpu()
    bad = int((got != host).sum())
    return bad


MODES = ("constant", "normal", "replay")
# DCP 2 for the attention fill: layouts whose slots a rank holds differently (a dense view, MLA's, 4-slot
# kernel blocks of 8-slot manager blocks), each rank, an interleave of 1 and of 2 tokens.
DCP_CASES = ("std-LBNHC", "mla", "LBNHC-kernel-split2")
DCP_GEOMETRIES = (DcpGeometry(2, 0, 1), DcpGeometry(2, 1, 1), DcpGeometry(2, 1, 2))


def isolated(name, log, fn, *args, **kwargs):
    """``(fn(...), None)``, or ``(None, error)`` where it raised: one case's
    compile error, out-of-memory or CUDA error is that case's result, and the
    check goes on to the next."""
    try:
        return fn(*args, **kwargs), None
    except Exception as exc:  # noqa: BLE001  (every failure is reported, none ends the run)
        error = f"{type(exc).__name__}: {exc}".splitlines()[0][:300]
        log(f"ERROR {name}: {error}")
        return None, error


def correctness(device, log, budget, part="all", only=None):
    """A row per layout x dtype x mode: ``bad_bytes`` (0: byte-exact; None:
    it raised, ``error`` says what); failures counts both.  ``part``:
    ``first``, every layout and mode in the zoo's first dtype (the sample run
    before the CUDA-graph and speed sections, so those run within a short
    lease); ``rest``, the other dtypes (run after them); ``all``.  ``only``:
    the dtype names to keep of those (None: all)."""
    dtypes = {"first": LZ.DTYPES[:1], "rest": LZ.DTYPES[1:], "all": LZ.DTYPES}[part]
    dtypes = [d for d in dtypes if only is None or d[0] in only]
    if not dtypes:
        return [], 0
    which = {"first": f"({LZ.DTYPES[0][0]})", "rest": "(other dtypes)", "all": "(all dtypes)"}[part]
    rows, failures = [], 0
    for case in LZ.CASES:
        for mode in MODES:
            if not budget.spend(f"correctness {case.name} {mode} {which}"):
                continue
            for dname, dtype, encoding in dtypes:
                bad, error = isolated(f"{case.name} {dname} {mode}", log, check_case, case, dtype, encoding, device,
                                      mode)
                failures += bad != 0
                if bad:
                    log(f"MISMATCH {case.name} {dname} {mode}: {bad} bytes")
                rows.append({"layout": case.name, "dtype": dname, "mode": mode, "bad_bytes": bad, "error": error})
    return rows, failures


def check_attention_dcp(device, log):
    """The attention fill under DCP 2 (``DCP_CASES`` x ``DCP_GEOMETRIES`` x
    normal and replay, bf16): the Triton fill on the device against the
    torch backend's, whole buffers.  Returns the failed cases' names."""
    failed = []
    for case in (c for c in LZ.CASES if c.name in DCP_CASES):
        for dcp in DCP_GEOMETRIES:
            for mode in ("normal", "replay"):
                bad = check_case(case, torch.bfloat16, "auto", device, mode, dcp)
                if bad:
                    failed.append(f"{case.name} DCP {dcp.world_size} rank {dcp.rank} interleave {dcp.interleave} "
                                  f"{mode}: {bad} bytes differ")
    log(f"attention fill under DCP 2: {len(DCP_CASES) * len(DCP_GEOMETRIES) * 2} cases, {len(failed)} differ")
    return failed


def check_graph_capture(device, log):
    """fill_blocks captured in a CUDA graph (kvfill.kernels.capture), replayed
    with new ids after the engine cache was cleared and refilled: the same
    bytes as the host path (repeated id: first position wins; ids past the
    caches and past int32 skipped), and host ids refused under capture.
    Returns the failed checks' names; None where not CUDA."""
    if torch.device(device).type != "cuda":
        return None
    from kvfill.kernels import clear_engine_cache, release_captured_fills

    failed = []
    cache = torch.zeros(16, 2, 8, 32, dtype=torch.bfloat16, device=device)
    ids = torch.tensor([3, 7, 3, 9], device=device)
    kw = dict(mean=0.0, std=1.0, seed=5)
    fill_blocks([cache], ids, **kw)  # warm-up: registers the engine
    torch.cuda.synchronize()
    cache.zero_()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fill_blocks([cache], ids, **kw)
        try:
            fill_blocks([cache], [3, 7], **kw)
            failed.append("host ids accepted under capture")
        except RuntimeError:
            pass
    # Evict every cached engine: the captured fill's must stay alive.
    for i in range(10):
        fill_blocks([torch.zeros(4, 1, 8, 32, device=device)], [i % 4], **kw)
    clear_engine_cache()
    torch.cuda.empty_cache()
    ids.copy_(torch.tensor([1, 2**32 + 1, 1, 99], device=device))  # repeat, past int32, past the caches
    graph.replay()
    torch.cuda.synchronize()
    ref = torch.zeros(16, 2, 8, 32, dtype=torch.bfloat16)
    fill_blocks([ref], [1], **kw, backend="torch")
    if not torch.equal(cache.cpu().view(torch.int16), ref.view(torch.int16)):
        failed.append("replayed bytes differ from the host path")
    del graph
    release_captured_fills()
    for name in failed:
        log(f"CUDA graph: {name}")
    return failed


def check_replay_capture(device, log):
    """A replay fill captured in a CUDA graph through a user-held engine
    (``fill_device_entries``: the plan on the device), replayed with new
    entries after the user's last reference to the engine was dropped and
    the engine cache cleared: the same bytes as the torch backend's host
    fill of the new plan (sequences, positions that wrap).  Returns the
    failed checks' names; None where not CUDA."""
    if torch.device(device).type != "cuda":
        return None
    import gc
    import weakref

    from kvfill.kernels import clear_engine_cache, release_captured_fills

    case = next(c for c in LZ.CASES if c.name == "std-LBNHC")
    dtype = torch.bfloat16
    failed = []
    host = torch.zeros(case.nbytes(2), dtype=torch.uint8, device="cpu")
    dev = host.to(device, copy=True)  # a copy even on the CPU (smoke runs)
    bank = random_bank(_engine(case.make(host.clone(), dtype), case, "auto", "torch", 0.0), dtype)
    eng = _engine(case.make(dev, dtype), case, "auto", "triton", 0.0, bank)
    eng.warmup()
    entries = torch.tensor([[1, 0, 8, 0, 0], [3, 2, 6, 8, 1]], dtype=torch.int32, device=device)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        eng.fill_device_entries("g", entries)
    alive = weakref.ref(eng)
    del eng
    clear_engine_cache()
    gc.collect()
    torch.cuda.empty_cache()
    if alive() is None:
        failed.append("the captured replay fill's engine was freed with its last user reference")
    new = [(4, 3, 8, 0, 2), (1, 0, 8, 8, 0), (5, 0, 2, 16, 1)]  # positions up to 18 of 11: wrap
    entries.copy_(torch.tensor(new, dtype=torch.int32, device=device)[:2])
    graph.replay()
    torch.cuda.synchronize()
    _engine(case.make(host, dtype), case, "auto", "torch", 0.0, bank).fill({"g": GroupFill(*zip(*new[:2]))})
    if not torch.equal(dev.cpu(), host):
        failed.append("replayed bytes differ from the host replay fill")
    del graph
    release_captured_fills()
    for name in failed:
        log(f"CUDA graph (replay): {name}")
    return failed


def check_compiled_capture(device, log):
    """The Triton fill inside an Inductor-compiled step (``fullgraph``, as
    vLLM compiles its model): the step computes the block ids from slot
    numbers, fills them (``fill_blocks``, the custom op) and reads them back;
    on CUDA the compiled step is captured in a CUDA graph, as vLLM captures
    its compiled pieces, and replayed with new slots over a re-poisoned
    cache.  The bytes must equal the torch backend's host fill of the new
    blocks and the step's sum theirs.  Elsewhere the compiled step runs
    twice, the second time with the new slots.  Returns the failed checks."""
    device = torch.device(device)
    cuda = device.type == "cuda"
    shape, kw = (12, 2, 8, 32), dict(mean=0.0, std=1.0, seed=5)
    g = torch.Generator(device="cpu").manual_seed(17)
    poison = torch.randint(0, 256, (math.prod(shape) * 2,), dtype=torch.uint8, generator=g, device="cpu")
    dev = poison.to(device, copy=True)
    cache = dev.view(torch.bfloat16).view(shape)

    def step(cache, slots):
        ids = torch.div(slots, shape[2], rounding_mode="floor")  # a block id per slot, as step metadata has
        fill_blocks([cache], ids, backend="triton", **kw)
        return cache[ids].float().sum()  # read after the fill: Inductor must keep the order

    compiled = torch.compile(step, backend="inductor", fullgraph=True, dynamic=False)
    slots = torch.tensor([24, 72, 8], device=device)
    compiled(cache, slots)  # compiles, and the fill's first call (capture needs it before)
    new = [40, 88, 40]  # blocks 5, 11 and 5 again
    if cuda:
        torch.cuda.synchronize()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            compiled(cache, slots)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            total = compiled(cache, slots)
        dev.copy_(poison)
        slots.copy_(torch.tensor(new, device=device))
        graph.replay()
        torch.cuda.synchronize()
        del graph
    else:
        dev.copy_(poison)
        slots.copy_(torch.tensor(new))
        total = compiled(cache, slots)
    want = poison.clone()
    ref = want.view(torch.bfloat16).view(shape)
    fill_blocks([ref], [n // shape[2] for n in new], backend="torch", **kw)
    failed = []
    bad = int((dev.cpu() != want).sum())
    if bad:
        failed.append(f"{bad} bytes differ from the torch backend's host fill")
    expect = ref[[n // shape[2] for n in new]].float().sum().item()
    if not math.isclose(float(total), expect, rel_tol=1e-3, abs_tol=1e-2):
        failed.append(f"the step read {float(total):.4f} after its fill, the fill's blocks sum to {expect:.4f}")
    if cuda:
        from kvfill.kernels import release_captured_fills

        release_captured_fills()
    log(f"Inductor{' + CUDA graph' if cuda else ''} around the Triton fill: {'ok' if not failed else failed}")
    return failed


def check_device_guard(device, log):
    """With a second GPU current, a fill of caches on the first still lands
    there, ordered after its plan upload.  None with fewer than two GPUs."""
    if torch.device(device).type != "cuda" or torch.cuda.device_count() < 2:
        return None
    cache = torch.zeros(8, 2, 8, 32, dtype=torch.bfloat16, device="cuda:0")
    eng = FillEngine({"g": CacheGroup({"l": cache})}, mean=0.0, std=1.0, seed=3)
    plan = {"g": GroupFill(block_ids=[2, 5])}
    with torch.cuda.device(1):
        eng.fill(plan)
    torch.cuda.synchronize(0)
    ok = eng.verify(plan).ok
    if not ok:
        log("device guard: a fill issued with cuda:1 current missed cuda:0's caches")
    return ok

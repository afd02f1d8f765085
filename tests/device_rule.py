"""An accelerator stand-in on the CPU: torch's default device made a device
of its own, with CUDA's rule that tensors on different devices do not mix.

On a GPU run torch's default device is ``cuda``: a tensor made by a factory
without a device lands there, a bank loaded from a file stays in host memory,
and an op given both raises ("Expected all tensors to be on the same
device").  On the CPU every tensor is a host tensor, so a test that mixes them
passes here and fails on the lent GPU.  ``DeviceRule`` (a TorchFunctionMode)
marks as on the device every tensor made by a factory without a device or
with ``device="cpu:0"`` (``DEVICE``, what ``KVFILL_TEST_DEVICE=cpu:0``
gives the tests), and every result of an op on marked tensors; such a
factory makes a host tensor whatever torch's default device is (``cuda`` in
the GPU run, ``meta`` in the stand-in's), so the rule's own tests hold there; it reports
their ``.device`` as ``cpu:0``, refuses ``.numpy()`` on them, and raises
CUDA's error when an op mixes marked tensors with host tensors of one
element or more (copies, indexing with host indices, moves between the two and
custom ops are allowed, as on CUDA).  The values are real CPU tensors, so every kernel
runs as on the CPU.

Pinned host memory is the stand-in's too (CPU torch has no pinned allocator):
``pin_memory()`` and factories given ``pin_memory=True`` make host tensors
the rule remembers as pinned, and ``is_pinned()`` answers for them.

What a CPU run cannot see otherwise, a ``Ledger`` (``DeviceRule(ledger)``)
counts: every byte allocated on the device (each new storage of a marked
tensor, until its last tensor is freed; the peak; and the temporary CUDA's
copy makes where one side of a copy between host and device is not
contiguous), and every host synchronisation CUDA would make - a copy between
host and device that is blocking or from/to pageable memory, ``.cpu()``,
``.item()``, ``.tolist()``, a device tensor read as a Python bool or number,
ops whose result size depends on the values (``nonzero``, boolean-mask
indexing, ``unique``, ``masked_select``, ``repeat_interleave`` without
``output_size``), ``torch.equal``/``allclose``, and waits on the events of
``kvfill.kernels.host_copy`` (which makes stand-in events under a ledger).
Triton's interpreter's own copies around a launch are not the program's (a
launch on a GPU allocates and waits for nothing): they are not counted.
"""
from __future__ import annotations

import contextlib
import sys
import weakref
from dataclasses import dataclass, field

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

DEVICE = torch.device("cpu", 0)
_MARK = "_kvfill_on_device"

_FACTORIES = {
    torch.empty, torch.zeros, torch.ones, torch.full, torch.rand, torch.randn, torch.randint, torch.randperm,
    torch.arange, torch.linspace, torch.eye, torch.tensor, torch.empty_strided, torch.normal,
}
# Mixing devices is allowed here, as on CUDA: moves and copies, and indexing a device tensor with host indices.
_MIXING = {torch.Tensor.to, torch.Tensor.copy_, torch.Tensor.__getitem__, torch.Tensor.__setitem__,
           torch.Tensor.cpu, torch.Tensor.cuda}


# CUDA syncs the host for these on a device tensor: the result is a host value, or its size depends on the values.
_READS = {torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.__bool__, torch.Tensor.__int__,
          torch.Tensor.__float__, torch.Tensor.__index__, torch.equal, torch.allclose, torch.Tensor.allclose,
          torch.Tensor.equal}
_VALUE_SIZED = {torch.nonzero, torch.Tensor.nonzero, torch.masked_select, torch.Tensor.masked_select, torch.unique,
                torch.Tensor.unique, torch.unique_consecutive, torch.Tensor.unique_consecutive, torch.argwhere}
_REPEAT = {torch.repeat_interleave, torch.Tensor.repeat_interleave}
_PINNED: dict[int, int] = {}  # storage address -> live pinned tensors on it


def _storage(t: torch.Tensor) -> tuple[int, int]:
    s = t.untyped_storage()
    return s.data_ptr(), s.nbytes()


def is_pinned(t: torch.Tensor) -> bool:
    """A host tensor the stand-in pinned (``pin_memory``), or a view of one."""
    return not on_device(t) and _storage(t)[0] in _PINNED


def _pin(t: torch.Tensor) -> torch.Tensor:
    ptr = _storage(t)[0]
    _PINNED[ptr] = _PINNED.get(ptr, 0) + 1
    weakref.finalize(t, _unpin, ptr)
    return t


def _unpin(ptr: int) -> None:
    _PINNED[ptr] -= 1
    if not _PINNED[ptr]:
        del _PINNED[ptr]


def _where() -> str:
    """The innermost frame outside torch, Triton and this file: who caused it."""
    f = sys._getframe(2)
    while f is not None and (f.f_code.co_filename == __file__ or "/torch/" in f.f_code.co_filename
                             or "/triton/" in f.f_code.co_filename or "contextlib" in f.f_code.co_filename):
        f = f.f_back
    return "?" if f is None else f"{f.f_code.co_filename.rsplit('/', 2)[-2:][-1]}:{f.f_lineno} {f.f_code.co_name}"


@dataclass
class Window:
    """What a ``Ledger.window()`` saw: device bytes above its start (``peak``,
    and still held at its end, ``held``), allocations and temporaries
    ``(nbytes, where)``, syncs ``(why, where)``."""

    peak: int = 0
    held: int = 0
    allocations: list = field(default_factory=list)
    temporaries: list = field(default_factory=list)
    syncs: list = field(default_factory=list)


class Ledger:
    """Device bytes and host synchronisations (module docstring)."""

    def __init__(self):
        self.live = self.peak = 0
        self.allocations: list[tuple[int, str]] = []
        self.temporaries: list[tuple[int, str]] = []
        self.syncs: list[tuple[str, str]] = []
        self._refs: dict[int, int] = {}
        self._sizes: dict[int, int] = {}
        self.paused = 0

    def track(self, t: torch.Tensor, inputs: set[int] = frozenset()) -> None:
        """``t`` holds device memory: a new storage (not one of ``inputs``'),
        counted until its last tracked tensor is freed."""
        if self.paused or not isinstance(t, torch.Tensor) or t.is_meta or getattr(t, "_kvfill_ledger", None) is self:
            return
        ptr, nbytes = _storage(t)
        if not nbytes or (ptr in inputs and ptr not in self._refs):
            return  # a view of memory this ledger did not see made (made before it)
        t._kvfill_ledger = self
        n = self._refs.get(ptr, 0)
        self._refs[ptr] = n + 1
        if not n:
            self._sizes[ptr] = nbytes
            self.live += nbytes
            self.peak = max(self.peak, self.live)
            self.allocations.append((nbytes, _where()))
        weakref.finalize(t, self._release, ptr)

    def _release(self, ptr: int) -> None:
        self._refs[ptr] -= 1
        if not self._refs[ptr]:
            del self._refs[ptr]
            self.live -= self._sizes.pop(ptr)

    def temporary(self, nbytes: int) -> None:
        if not self.paused and nbytes:
            self.peak = max(self.peak, self.live + nbytes)
            self.temporaries.append((nbytes, _where()))

    def sync(self, why: str) -> None:
        if not self.paused:
            self.syncs.append((why, _where()))

    @contextlib.contextmanager
    def window(self):
        """Yields a ``Window``, filled in when the block ends."""
        w, start, before = Window(), self.live, self.peak
        marks = len(self.allocations), len(self.temporaries), len(self.syncs)
        self.peak = self.live
        try:
            yield w
        finally:
            w.peak, w.held = self.peak - start, self.live - start
            w.allocations, w.temporaries, w.syncs = (self.allocations[marks[0]:], self.temporaries[marks[1]:],
                                                     self.syncs[marks[2]:])
            self.peak = max(before, self.peak)


class _StandInEvent:
    """``host_copy.record_event`` on the stand-in under a ledger: waiting on it is a host sync."""

    def __init__(self, ledger: Ledger):
        self.ledger = ledger

    def synchronize(self) -> None:
        self.ledger.sync("event wait")


def on_device(t) -> bool:
    return isinstance(t, torch.Tensor) and getattr(t, _MARK, False)


def _is_device(device) -> bool | None:
    """True: the stand-in device; False: the host; None: not given."""
    if device is None:
        return None
    d = torch.device(device) if not isinstance(device, torch.device) else device
    return d.type == "cpu" and d.index is not None  # another device (meta): torch's own rules


def _mark(out, value: bool):
    for t in tree_flatten(out)[0]:
        if isinstance(t, torch.Tensor):
            setattr(t, _MARK, value)
    return out


def _moved(src: torch.Tensor, out: torch.Tensor, to_device: bool) -> torch.Tensor:
    """``out`` of a move of ``src`` marked for where it went: a move to the
    other side is a copy (on the CPU torch hands back ``src`` itself)."""
    if out is src:
        if on_device(src) == to_device:
            return out
        out = src.clone()
    return _mark(out, to_device)


def _op_namespace(func) -> str | None:
    """``kvfill`` for ``torch.ops.kvfill.fill_blocks``; None for a torch function."""
    if isinstance(func, torch._ops.OpOverload):
        return func.namespace
    if isinstance(func, torch._ops.OpOverloadPacket):
        return func._qualified_op_name.split("::")[0]
    return None


class DeviceRule(TorchFunctionMode):
    """The accelerator stand-in (module docstring); enter it for a whole run.
    ``ledger``: where device bytes and host synchronisations are counted."""

    def __init__(self, ledger: Ledger | None = None):
        super().__init__()
        self.ledger = ledger
        self._undo: list = []

    def __enter__(self):
        if torch.Tensor.pin_memory is not torch._C.TensorBase.pin_memory:
            # vLLM CPU's worker module replaces it process-wide with one that returns the tensor (no pinned
            # allocator there): in a process that imported it, the stand-in's pinning would never be asked
            self._undo.append((torch.Tensor, "pin_memory", torch.Tensor.pin_memory))
            torch.Tensor.pin_memory = torch._C.TensorBase.pin_memory
        if self.ledger is not None:
            self._patch()
        return super().__enter__()

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            while self._undo:
                setattr(*self._undo.pop())

    def _patch(self) -> None:
        """Triton's interpreter's copies around a launch paused; host_copy's
        events made stand-in ones."""
        ledger = self.ledger
        try:
            from triton.runtime.interpreter import GridExecutor
        except ImportError:
            GridExecutor = None
        if GridExecutor is not None:
            call = GridExecutor.__call__

            def paused_call(executor, *args, **kwargs):
                ledger.paused += 1
                try:
                    return call(executor, *args, **kwargs)
                finally:
                    ledger.paused -= 1

            self._undo.append((GridExecutor, "__call__", call))
            GridExecutor.__call__ = paused_call
        try:
            from kvfill.kernels import host_copy
        except ImportError:
            return
        record = host_copy.record_event
        self._undo.append((host_copy, "record_event", record))
        host_copy.record_event = lambda device: (_StandInEvent(ledger) if _is_device(device) else record(device))

    def _copy_syncs(self, func, args, kwargs) -> None:
        """A copy between host and device: a sync where CUDA makes one, and
        the device temporary it makes for a non-contiguous side."""
        ledger = self.ledger
        if func is torch.Tensor.copy_:
            dst, src = args[0], args[1]
            blocking = not (args[2] if len(args) > 2 else kwargs.get("non_blocking", False))
        else:  # __setitem__ of a host tensor into a device one
            dst, src, blocking = args[0][args[1]], args[2], True
        if not isinstance(src, torch.Tensor) or on_device(dst) == on_device(src) or src.dim() == 0:
            return
        host = src if on_device(dst) else dst
        if blocking or not is_pinned(host):
            ledger.sync(f"{'blocking' if blocking else 'pageable'} copy {'to' if on_device(dst) else 'from'} the "
                        f"device ({dst.numel() * dst.element_size()} B)")
        if not (dst.is_contiguous() and src.is_contiguous()):
            ledger.temporary(dst.numel() * dst.element_size())

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        ledger = self.ledger
        if torch.compiler.is_compiling():  # Dynamo traces modes: it sees torch's own rules
            return func(*args, **kwargs)
        if getattr(func, "__self__", None) is torch.Tensor.device:  # the property's getter
            return DEVICE if on_device(args[0]) else func(*args, **kwargs)
        if func is torch.Tensor.numpy and on_device(args[0]):
            raise TypeError("can't convert cpu:0 device type tensor to numpy. Use Tensor.cpu() to copy the tensor "
                            "to host memory first.")
        if func is torch.Tensor.is_pinned:
            return is_pinned(args[0])
        if func is torch.Tensor.pin_memory:
            if on_device(args[0]):
                raise RuntimeError("cannot pin a device tensor (the device stand-in): only host memory is pinned")
            return _pin(args[0].clone())
        if func in _FACTORIES or (func is torch.as_tensor and not isinstance(args[0] if args else None,
                                                                            torch.Tensor)):
            where = _is_device(kwargs.get("device"))
            pin = kwargs.get("pin_memory", False)
            kwargs = {k: v for k, v in kwargs.items() if k != "pin_memory"}
            if where is not False:  # the stand-in device is host memory, whatever torch's default device is
                kwargs = dict(kwargs, device="cpu")
            out = _mark(func(*args, **kwargs), where is not False)
            if pin and where is False:
                _pin(out)
            elif ledger is not None and where is not False:
                ledger.track(out)
            return out
        if func is torch.Tensor.to or func is torch.Tensor.cpu:
            src = args[0]
            if func is torch.Tensor.cpu:
                out, where, blocking = _moved(src, func(*args, **kwargs), False), False, True
            else:
                device, _, non_blocking, _ = torch._C._nn._parse_to(
                    *args[1:], **{k: v for k, v in kwargs.items() if k != "copy"})
                where = _is_device(device)
                if where:
                    args = (args[0], *[torch.device("cpu") if isinstance(a, torch.device) or a == "cpu:0" else a
                                       for a in args[1:]])
                    kwargs = {k: ("cpu" if k == "device" else v) for k, v in kwargs.items()}
                out = _moved(src, func(*args, **kwargs), on_device(src) if where is None else where)
                blocking = not non_blocking
            if ledger is not None and where is not None and on_device(src) != where:  # a move across
                host = out if on_device(src) else src
                if blocking or (not on_device(src) and not is_pinned(host)):
                    ledger.sync(f"{'blocking' if blocking else 'pageable'} copy {'to' if where else 'from'} the "
                                f"device ({src.numel() * src.element_size()} B, {func.__name__})")
            if ledger is not None and on_device(out):
                ledger.track(out, {_storage(src)[0]} if on_device(src) else set())
            return out
        tensors = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor) and not t.is_meta]
        marked = [on_device(t) for t in tensors]
        # a custom op (kvfill's fill_blocks) takes both, as on CUDA
        custom = _op_namespace(func) not in (None, "aten")
        host = any(not m and t.dim() > 0 for t, m in zip(tensors, marked))  # a 0-dim host tensor mixes, as on CUDA
        if func not in _MIXING and not custom and any(marked) and host:
            raise RuntimeError(f"Expected all tensors to be on the same device, but found at least two devices, "
                               f"{DEVICE} and cpu! (the device stand-in, in {getattr(func, '__name__', func)})")
        if ledger is not None and any(marked):
            self._count_syncs(func, args, kwargs, tensors, marked)
        out = func(*args, **kwargs)
        if any(marked) and func not in (torch.Tensor.__setitem__, torch.Tensor.copy_):
            _mark(out, True)
            if ledger is not None:
                inputs = {_storage(t)[0] for t, m in zip(tensors, marked) if m}
                for t in tree_flatten(out)[0]:
                    if isinstance(t, torch.Tensor):
                        ledger.track(t, inputs)
        return out

    def _count_syncs(self, func, args, kwargs, tensors, marked) -> None:
        ledger = self.ledger
        name = getattr(func, "__name__", str(func))
        if func in _READS or func in _VALUE_SIZED:
            ledger.sync(f"{name} of a device tensor")
        elif func in _REPEAT and isinstance(args[1] if len(args) > 1 else kwargs.get("repeats"), torch.Tensor) \
                and kwargs.get("output_size") is None:
            ledger.sync(f"{name} without output_size")
        elif func in (torch.Tensor.__getitem__, torch.Tensor.__setitem__):
            index = [t for t in tree_flatten(args[1])[0] if isinstance(t, torch.Tensor)]
            if any(t.dtype == torch.bool and on_device(t) for t in index):
                ledger.sync(f"boolean-mask {name} on the device")
            if on_device(args[0]) and any(not on_device(t) and t.dim() > 0 for t in index):
                ledger.sync(f"host index tensor in {name} of a device tensor (a pageable copy)")
            if func is torch.Tensor.__setitem__ and on_device(args[0]):
                self._copy_syncs(func, args, kwargs)
        elif func is torch.Tensor.copy_:
            self._copy_syncs(func, args, kwargs)


if __name__ == "__main__":
    # python tests/device_rule.py SCRIPT ARGS...: SCRIPT run as __main__ on the stand-in (its device "cpu:0"),
    # as the GPU run would run it on "cuda" (tests/test_device_image.py runs bench/gpu_check.py so).
    import os
    import runpy
    import sys

    if len(sys.argv) < 2:
        sys.exit("usage: python tests/device_rule.py SCRIPT [ARGS...]")
    sys.argv = sys.argv[1:]
    sys.path[0] = os.path.dirname(os.path.abspath(sys.argv[0]))  # as `python SCRIPT` would have it
    with DeviceRule():
        runpy.run_path(sys.argv[0], run_name="__main__")

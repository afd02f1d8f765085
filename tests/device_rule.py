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
custom ops are allowed, as on CUDA), and refuses a Triton launch given a tensor
that is not on the device (CUDA: "Pointer argument cannot be accessed from
Triton (cpu tensor?)").  The values are real CPU tensors, so every kernel
runs as on the CPU.

A rule entered inside another stands, as on a GPU machine, for a stand-in
made in host memory: the outer rule (the GPU run's device, conftest's
``KVFILL_TEST_DEVICE=cpu:0``) sees the inner rule's "device" tensors as host
tensors, so a test that builds its own stand-in and launches Triton kernels
over it fails there as it fails on the lent GPU (without the interpreter,
``make_backend`` refuses Triton over host memory).

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
a device tensor made from host data (``torch.tensor(data)``,
``torch.as_tensor(array, device=...)``: built in pageable host memory and
copied with a blocking copy), a copy whose host side is not contiguous
(CUDA stages it through a pageable host temporary, pinned or not; only a
non-contiguous device side makes a device temporary),
ops whose result size depends on the values (``nonzero``, one-argument
``where``, boolean-mask indexing, ``unique``, ``masked_select``,
``bincount``, ``one_hot`` without ``num_classes``, ``repeat_interleave``
without ``output_size``), ``torch.equal``/``allclose``, and waits on the events of
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
                torch.Tensor.unique, torch.unique_consecutive, torch.Tensor.unique_consecutive, torch.argwhere,
                torch.bincount, torch.Tensor.bincount}  # bincount: CUDA reads the input's max on the host
_WHERE = {torch.where, torch.Tensor.where}  # one argument: nonzero as a tuple
_ONE_HOT = torch.nn.functional.one_hot  # without num_classes: CUDA reads the input's max on the host
_FROM_DATA = {torch.tensor, torch.as_tensor}  # host data -> device: built on the host, copied blocking
_REPEAT = {torch.repeat_interleave, torch.Tensor.repeat_interleave}
_PINNED: dict[int, int] = {}  # storage address -> live pinned tensors on it


def _storage(t: torch.Tensor) -> tuple[int, int]:
    s = t.untyped_storage()
    return s.data_ptr(), s.nbytes()


def is_pinned(t: torch.Tensor) -> bool:
    """A host tensor the stand-in pinned (``pin_memory``), or a view of one
    (only host memory is pinned: ``pin_memory`` refuses a device tensor)."""
    return _storage(t)[0] in _PINNED


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


_ACTIVE: list = []  # the rules entered, innermost last


def on_device(t, mark: str | None = None) -> bool:
    """On the device of the innermost rule entered (``mark``: of the rule
    that marks so)."""
    if mark is None:
        mark = _ACTIVE[-1].mark if _ACTIVE else _MARK
    return isinstance(t, torch.Tensor) and getattr(t, mark, False)


def _is_device(device) -> bool | None:
    """True: the stand-in device; False: the host; None: not given."""
    if device is None:
        return None
    d = torch.device(device) if not isinstance(device, torch.device) else device
    return d.type == "cpu" and d.index is not None  # another device (meta): torch's own rules


def _mark(out, value: bool, mark: str):
    for t in tree_flatten(out)[0]:
        if isinstance(t, torch.Tensor):
            setattr(t, mark, value)
    return out


def _moved(src: torch.Tensor, out: torch.Tensor, to_device: bool, mark: str) -> torch.Tensor:
    """``out`` of a move of ``src`` marked for where it went: a move to the
    other side is a copy (on the CPU torch hands back ``src`` itself)."""
    if out is src:
        if on_device(src, mark) == to_device:
            return out
        out = src.clone()
    return _mark(out, to_device, mark)


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
        self.mark = _MARK
        self._undo: list = []
        # torch runs a custom op's body without this mode (a mode's handler runs with the mode popped): what
        # the body makes is unmarked, so its launches are held only to the op's own host arguments' memory
        self._in_custom: list[set[int]] = []

    def __enter__(self):
        # inside another rule: a stand-in in host memory, as a test's own stand-in is on the GPU run
        self.mark = _MARK if not _ACTIVE else f"{_MARK}_{len(_ACTIVE)}"
        _ACTIVE.append(self)
        if torch.Tensor.pin_memory is not torch._C.TensorBase.pin_memory:
            # vLLM CPU's worker module replaces it process-wide with one that returns the tensor (no pinned
            # allocator there): in a process that imported it, the stand-in's pinning would never be asked
            self._undo.append((torch.Tensor, "pin_memory", torch.Tensor.pin_memory))
            torch.Tensor.pin_memory = torch._C.TensorBase.pin_memory
        self._patch()
        return super().__enter__()

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            _ACTIVE.remove(self)
            while self._undo:
                setattr(*self._undo.pop())

    def _patch(self) -> None:
        """A Triton launch refused a tensor not on the device, as CUDA's
        launcher refuses a host pointer; under a ledger, Triton's
        interpreter's copies around a launch paused and host_copy's events
        made stand-in ones."""
        ledger, mark = self.ledger, self.mark
        try:
            from triton.runtime.interpreter import GridExecutor
        except ImportError:
            GridExecutor = None
        if GridExecutor is not None:
            call = GridExecutor.__call__

            def device_call(executor, *args, **kwargs):
                for i, arg in enumerate((*args, *kwargs.values())):
                    if isinstance(arg, torch.Tensor) and not on_device(arg, mark) and \
                            (not self._in_custom or _storage(arg)[0] in self._in_custom[-1]):
                        raise ValueError(f"Pointer argument (at {i}) cannot be accessed from Triton (cpu tensor?): "
                                         f"a host tensor given to {getattr(executor.fn, '__name__', executor.fn)} "
                                         f"(the device stand-in, as CUDA's launcher refuses it)")
                if ledger is not None:
                    ledger.paused += 1
                try:
                    return call(executor, *args, **kwargs)
                finally:
                    if ledger is not None:
                        ledger.paused -= 1

            self._undo.append((GridExecutor, "__call__", call))
            GridExecutor.__call__ = device_call
        if ledger is None:
            return
        try:
            from kvfill.kernels import host_copy
        except ImportError:
            return
        record = host_copy.record_event
        self._undo.append((host_copy, "record_event", record))
        host_copy.record_event = lambda device: (_StandInEvent(ledger) if _is_device(device) else record(device))

    def _on(self, t) -> bool:
        return on_device(t, self.mark)

    def _copy_syncs(self, func, args, kwargs) -> None:
        """A copy between host and device: a sync where CUDA makes one, and
        the device temporary it makes for a non-contiguous side."""
        ledger = self.ledger
        if func is torch.Tensor.copy_:
            dst, src = args[0], args[1]
            blocking = not (args[2] if len(args) > 2 else kwargs.get("non_blocking", False))
        else:  # __setitem__ of a host tensor into a device one
            dst, src, blocking = args[0][args[1]], args[2], True
        if not isinstance(src, torch.Tensor) or self._on(dst) == self._on(src) or src.dim() == 0:
            return
        host, device = (src, dst) if self._on(dst) else (dst, src)
        # CUDA copies a non-contiguous side through a contiguous temporary on that side: a host one is pageable
        # memory (pinned or not, the host waits), a device one is device memory
        why = "blocking" if blocking else ("pageable" if not is_pinned(host) else
                                           "strided pinned" if not host.is_contiguous() else None)
        if why is not None:
            ledger.sync(f"{why} copy {'to' if self._on(dst) else 'from'} the device "
                        f"({dst.numel() * dst.element_size()} B)")
        if not device.is_contiguous():
            ledger.temporary(device.numel() * device.element_size())

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        ledger, on = self.ledger, self._on
        if torch.compiler.is_compiling():  # Dynamo traces modes: it sees torch's own rules
            return func(*args, **kwargs)
        if getattr(func, "__self__", None) is torch.Tensor.device:  # the property's getter
            return DEVICE if on(args[0]) else func(*args, **kwargs)
        if func is torch.Tensor.numpy and on(args[0]):
            raise TypeError("can't convert cpu:0 device type tensor to numpy. Use Tensor.cpu() to copy the tensor "
                            "to host memory first.")
        if func is torch.Tensor.is_pinned:
            return is_pinned(args[0])
        if func is torch.Tensor.pin_memory:
            if on(args[0]):
                raise RuntimeError("cannot pin a device tensor (the device stand-in): only host memory is pinned")
            return _pin(args[0].clone())
        if func in _FACTORIES or (func is torch.as_tensor and not isinstance(args[0] if args else None,
                                                                            torch.Tensor)):
            return self._factory(func, args, kwargs)
        if func is torch.Tensor.to or func is torch.Tensor.cpu:
            return self._move(func, args, kwargs)
        tensors = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor) and not t.is_meta]
        marked = [on(t) for t in tensors]
        # a custom op (kvfill's fill_blocks) takes both, as on CUDA
        custom = _op_namespace(func) not in (None, "aten")
        host = any(not m and t.dim() > 0 for t, m in zip(tensors, marked))  # a 0-dim host tensor mixes, as on CUDA
        if func not in _MIXING and not custom and any(marked) and host:
            raise RuntimeError(f"Expected all tensors to be on the same device, but found at least two devices, "
                               f"{DEVICE} and cpu! (the device stand-in, in {getattr(func, '__name__', func)})")
        if ledger is not None and any(marked):
            self._count_syncs(func, args, kwargs)
        if custom:
            self._in_custom.append({_storage(t)[0] for t, m in zip(tensors, marked) if not m and t.dim() > 0})
        try:
            out = func(*args, **kwargs)
        finally:
            if custom:
                self._in_custom.pop()
        if any(marked) and func not in (torch.Tensor.__setitem__, torch.Tensor.copy_):
            _mark(out, True, self.mark)
            if ledger is not None:
                inputs = {_storage(t)[0] for t, m in zip(tensors, marked) if m}
                for t in tree_flatten(out)[0]:
                    if isinstance(t, torch.Tensor):
                        ledger.track(t, inputs)
        return out

    def _factory(self, func, args, kwargs):
        """A tensor made where ``device`` says (torch's default: the device);
        from host data on the device, a blocking copy."""
        ledger = self.ledger
        where = _is_device(kwargs.get("device"))
        pin = kwargs.get("pin_memory", False)
        kwargs = {k: v for k, v in kwargs.items() if k != "pin_memory"}
        if where is not False:  # the stand-in device is host memory, whatever torch's default device is
            kwargs = dict(kwargs, device="cpu")
        out = _mark(func(*args, **kwargs), where is not False, self.mark)
        if pin and where is False:
            _pin(out)
        elif ledger is not None and where is not False:
            ledger.track(out)
            data = args[0] if args else kwargs.get("data")
            if func in _FROM_DATA and not self._on(data):  # CUDA builds it on the host, then .to(device)
                ledger.sync(f"blocking copy of host data to the device ({func.__name__}, "
                            f"{out.numel() * out.element_size()} B)")
        return out

    def _move(self, func, args, kwargs):
        """``.to()``/``.cpu()``: marked for where it went; a move across
        syncs where CUDA's would."""
        ledger, on, src = self.ledger, self._on, args[0]
        if func is torch.Tensor.cpu:
            out, where, blocking = _moved(src, func(*args, **kwargs), False, self.mark), False, True
        else:
            device, _, non_blocking, _ = torch._C._nn._parse_to(
                *args[1:], **{k: v for k, v in kwargs.items() if k != "copy"})
            where = _is_device(device)
            if where:
                args = (args[0], *[torch.device("cpu") if isinstance(a, torch.device) or a == "cpu:0" else a
                                   for a in args[1:]])
                kwargs = {k: ("cpu" if k == "device" else v) for k, v in kwargs.items()}
            out = _moved(src, func(*args, **kwargs), on(src) if where is None else where, self.mark)
            blocking = not non_blocking
        if ledger is not None and where is not None and on(src) != where:  # a move across
            host = out if on(src) else src
            why = "blocking" if blocking else ("pageable" if not is_pinned(host) else
                                               "strided pinned" if not host.is_contiguous() else None)
            if why is not None:
                ledger.sync(f"{why} copy {'to' if where else 'from'} the device "
                            f"({src.numel() * src.element_size()} B, {func.__name__})")
        if ledger is not None and on(out):
            ledger.track(out, {_storage(src)[0]} if on(src) else set())
        return out

    def _count_syncs(self, func, args, kwargs) -> None:
        ledger, on = self.ledger, self._on
        name = getattr(func, "__name__", str(func))
        if func in _READS or func in _VALUE_SIZED:
            ledger.sync(f"{name} of a device tensor")
        elif func in _WHERE and len(args) + len(kwargs) == 1:
            ledger.sync(f"{name} with one argument (nonzero)")
        elif func is _ONE_HOT and (args[1] if len(args) > 1 else kwargs.get("num_classes", -1)) == -1:
            ledger.sync(f"{name} without num_classes")
        elif func in _REPEAT and isinstance(args[1] if len(args) > 1 else kwargs.get("repeats"), torch.Tensor) \
                and kwargs.get("output_size") is None:
            ledger.sync(f"{name} without output_size")
        elif func in (torch.Tensor.__getitem__, torch.Tensor.__setitem__):
            index = [t for t in tree_flatten(args[1])[0] if isinstance(t, torch.Tensor)]
            if any(t.dtype == torch.bool and on(t) for t in index):
                ledger.sync(f"boolean-mask {name} on the device")
            if on(args[0]) and any(not on(t) and t.dim() > 0 for t in index):
                ledger.sync(f"host index tensor in {name} of a device tensor (a pageable copy)")
            if func is torch.Tensor.__setitem__ and on(args[0]):
                self._copy_syncs(func, args, kwargs)
        elif func is torch.Tensor.copy_:
            self._copy_syncs(func, args, kwargs)

if __name__ == "__main__":
    # python tests/device_rule.py SCRIPT ARGS...: SCRIPT run as __main__ on the stand-in (its device "cpu:0"),
    # as the GPU run would run it on "cuda" (tests/test_device_image.py runs gpu/gpu_check.py so).
    import os
    import runpy
    import sys

    if len(sys.argv) < 2:
        sys.exit("usage: python tests/device_rule.py SCRIPT [ARGS...]")
    sys.argv = sys.argv[1:]
    sys.path[0] = os.path.dirname(os.path.abspath(sys.argv[0]))  # as `python SCRIPT` would have it
    with DeviceRule():
        runpy.run_path(sys.argv[0], run_name="__main__")

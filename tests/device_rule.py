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
"""
from __future__ import annotations

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
    """The accelerator stand-in (module docstring); enter it for a whole run."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if torch.compiler.is_compiling():  # Dynamo traces modes: it sees torch's own rules
            return func(*args, **kwargs)
        if getattr(func, "__self__", None) is torch.Tensor.device:  # the property's getter
            return DEVICE if on_device(args[0]) else func(*args, **kwargs)
        if func is torch.Tensor.numpy and on_device(args[0]):
            raise TypeError("can't convert cpu:0 device type tensor to numpy. Use Tensor.cpu() to copy the tensor "
                            "to host memory first.")
        if func in _FACTORIES or (func is torch.as_tensor and not isinstance(args[0] if args else None,
                                                                            torch.Tensor)):
            where = _is_device(kwargs.get("device"))
            if where is not False:  # the stand-in device is host memory, whatever torch's default device is
                kwargs = dict(kwargs, device="cpu")
            return _mark(func(*args, **kwargs), where is not False)
        if func is torch.Tensor.to:
            device, _, _, _ = torch._C._nn._parse_to(*args[1:], **{k: v for k, v in kwargs.items() if k != "copy"})
            where = _is_device(device)
            if where:
                args = (args[0], *[torch.device("cpu") if isinstance(a, torch.device) or a == "cpu:0" else a
                                   for a in args[1:]])
                kwargs = {k: ("cpu" if k == "device" else v) for k, v in kwargs.items()}
            return _moved(args[0], func(*args, **kwargs), on_device(args[0]) if where is None else where)
        if func is torch.Tensor.cpu:
            return _moved(args[0], func(*args, **kwargs), False)
        tensors = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor) and not t.is_meta]
        marked = [on_device(t) for t in tensors]
        # a custom op (kvfill's fill_blocks) takes both, as on CUDA
        custom = _op_namespace(func) not in (None, "aten")
        host = any(not m and t.dim() > 0 for t, m in zip(tensors, marked))  # a 0-dim host tensor mixes, as on CUDA
        if func not in _MIXING and not custom and any(marked) and host:
            raise RuntimeError(f"Expected all tensors to be on the same device, but found at least two devices, "
                               f"{DEVICE} and cpu! (the device stand-in, in {getattr(func, '__name__', func)})")
        out = func(*args, **kwargs)
        if any(marked) and func not in (torch.Tensor.__setitem__, torch.Tensor.copy_):
            _mark(out, True)
        return out


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

"""The accelerator stand-in (tests/device_rule.py) holds CUDA's device rule
on the CPU: what would raise on a GPU raises here, what CUDA allows passes."""
import pytest
import torch

from device_rule import DEVICE, DeviceRule, on_device


def test_default_and_cpu0_tensors_are_on_the_device_and_host_ones_are_not():
    with DeviceRule():
        default, explicit = torch.zeros(3), torch.ones(3, device="cpu:0")
        host = torch.zeros(3, device="cpu")
        with torch.device("cpu"):  # as a bank is loaded: into host memory whatever the default device
            loaded = torch.zeros(3)
        assert on_device(default) and on_device(explicit) and not on_device(host) and not on_device(loaded)
        assert default.device == DEVICE and host.device == torch.device("cpu")
        assert on_device(default + explicit) and on_device(host.to(DEVICE)) and not on_device(default.cpu())
        assert on_device(torch.empty(2, device=default.device))  # made on "the cache's device"


def test_mixing_device_and_host_tensors_raises_as_on_cuda():
    with DeviceRule():
        device, host = torch.zeros(3), torch.zeros(3, device="cpu")
        for mixed in (lambda: torch.equal(device, host), lambda: device + host,
                      lambda: host.index_select(0, device.long())):
            with pytest.raises(RuntimeError, match="Expected all tensors to be on the same device"):
                mixed()
        with pytest.raises(TypeError, match="numpy"):
            device.numpy()


def test_what_cuda_allows_across_devices_passes():
    with DeviceRule():
        device, host = torch.zeros(4), torch.arange(4.0, device="cpu")
        device.copy_(host)  # copies between the two
        assert on_device(host.to(DEVICE, copy=True)) and not on_device(device.to("cpu", copy=True))
        assert torch.equal(device, host.to(device.device)) and torch.equal(device.cpu(), host)
        assert device[torch.tensor([1, 2], device="cpu")].tolist() == [1.0, 2.0]  # host indices
        assert (device * torch.tensor(2.0, device="cpu")).tolist() == [0.0, 2.0, 4.0, 6.0]  # a 0-dim host scalar
        host.numpy()

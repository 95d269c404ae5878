"""Saved activations in host memory: what autograd keeps for the backward, copied to pinned host memory in the
forward and back to the device when the backward reads it.

With activation checkpointing what autograd keeps of each decoder layer is the layer's input (the checkpoint's own
hooks hold everything inside the layer), so offloading moves the `layers x tokens x hidden` bytes that dominate a
long-context step off the device (`small` at 2^20 tokens: 12 layers of 768 values a token, 18-36 GiB), for a
device-to-host copy in the forward and a host-to-device copy in the backward. Unlike
`torch.autograd.graph.save_on_cpu`, a tensor that several nodes save is copied once: Block AttnRes passes each
completed block to every later layer, which would otherwise hold one host copy per layer.
"""

from __future__ import annotations

import weakref

import torch


class HostOffload(torch.autograd.graph.saved_tensors_hooks):
    """Context manager: tensors of at least `min_bytes` on a device of `device_types` that autograd saves inside it
    wait for the backward in host memory (pinned when CUDA is present; the copies run on the current stream without
    a host synchronisation). Parameters stay where they are.

    `offloaded_bytes` counts the host copies made, `saved_bytes` every offloaded save (a tensor saved twice counts
    twice there and once in `offloaded_bytes`).
    """

    def __init__(self, min_bytes: int = 1 << 20, device_types: tuple[str, ...] = ("cuda",)):
        self.min_bytes = min_bytes
        self.device_types = device_types
        self.offloaded_bytes = 0
        self.saved_bytes = 0
        # id(tensor) -> (weak reference, version when copied, host copy); the reference tells a reused id apart
        self._copies: dict[int, tuple[weakref.ref, int, torch.Tensor]] = {}
        super().__init__(self._pack, self._unpack)

    def _pack(self, tensor: torch.Tensor):
        nbytes = tensor.numel() * tensor.element_size()
        if (tensor.device.type not in self.device_types or nbytes < self.min_bytes
                or isinstance(tensor, torch.nn.Parameter)):
            return tensor
        self.saved_bytes += nbytes
        ref, version, host = self._copies.get(id(tensor), (None, None, None))
        if ref is None or ref() is not tensor or version != tensor._version:
            host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=torch.cuda.is_available())
            host.copy_(tensor, non_blocking=True)
            self._copies[id(tensor)] = (weakref.ref(tensor), tensor._version, host)
            self.offloaded_bytes += nbytes
        return tensor.device, host

    @staticmethod
    def _unpack(packed):
        if isinstance(packed, torch.Tensor):
            return packed
        device, host = packed
        return host.to(device, non_blocking=True)

    def __enter__(self) -> "HostOffload":
        super().__enter__()
        return self

    def __exit__(self, *exc):
        self._copies.clear()  # the saved nodes hold their host copies until the backward frees them
        return super().__exit__(*exc)


__all__ = ["HostOffload"]

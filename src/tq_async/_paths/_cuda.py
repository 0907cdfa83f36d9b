"""The few CUDA driver calls tq_async makes itself (``libcuda``, through ctypes).

Device arenas (`tq_async._paths._device`) and page-locked shared memory
(`tq_async._paths._pinned`) talk to the driver directly: a service needs no CUDA runtime, and
ctypes lets go of the GIL while the driver works (torch's runtime bindings keep it).
"""

from __future__ import annotations

import ctypes
from typing import Any

from .._errors import DeviceError

__all__ = ["CudaDriver", "driver"]


class _Handle(ctypes.Structure):
    _fields_ = [("reserved", ctypes.c_char * 64)]


class CudaDriver:
    """The few CUDA driver calls device arenas need (``libcuda``, through ctypes).

    Every call makes the device's primary context current for itself (the context torch's
    runtime uses too) and restores the previous one.
    """

    def __init__(self, lib: ctypes.CDLL) -> None:
        self._lib = lib
        self._ctx: dict[int, ctypes.c_void_p] = {}
        self._call("cuInit", ctypes.c_uint(0))

    def _fn(self, name: str) -> Any:
        for n in (f"{name}_v2", name):
            f = getattr(self._lib, n, None)
            if f is not None:
                return f
        raise DeviceError(f"the CUDA driver has no {name}; update the NVIDIA driver")

    def _call(self, name: str, *args: Any) -> None:
        rc = self._fn(name)(*args)
        if rc != 0:
            text = ctypes.c_char_p()
            get = getattr(self._lib, "cuGetErrorString", None)
            if get is not None:
                get(rc, ctypes.byref(text))
            what = (text.value or b"").decode(errors="replace")
            raise DeviceError(f"{name} failed: CUDA error {rc} {what}".rstrip())

    def device_count(self) -> int:
        n = ctypes.c_int()
        self._call("cuDeviceGetCount", ctypes.byref(n))
        return n.value

    def uuid(self, ordinal: int) -> bytes:
        dev = ctypes.c_int()
        self._call("cuDeviceGet", ctypes.byref(dev), ctypes.c_int(ordinal))
        out = ctypes.create_string_buffer(16)
        self._call("cuDeviceGetUuid", out, dev)
        return out.raw

    def ordinal_of(self, uuid: bytes) -> int | None:
        """This process's ordinal of the device ``uuid`` (None: not visible here)."""
        for i in range(self.device_count()):
            if self.uuid(i) == uuid:
                return i
        return None

    def _context(self, ordinal: int) -> ctypes.c_void_p:
        ctx = self._ctx.get(ordinal)
        if ctx is None:
            dev = ctypes.c_int()
            self._call("cuDeviceGet", ctypes.byref(dev), ctypes.c_int(ordinal))
            ctx = ctypes.c_void_p()
            self._call("cuDevicePrimaryCtxRetain", ctypes.byref(ctx), dev)
            self._ctx[ordinal] = ctx
        return ctx

    def run(self, ordinal: int, name: str, *args: Any) -> None:
        """``name(*args)`` with device ``ordinal``'s primary context current."""
        self._call("cuCtxPushCurrent", self._context(ordinal))
        try:
            self._call(name, *args)
        finally:
            self._call("cuCtxPopCurrent", ctypes.byref(ctypes.c_void_p()))

    def alloc(self, ordinal: int, nbytes: int) -> int:
        ptr = ctypes.c_uint64()
        self.run(ordinal, "cuMemAlloc", ctypes.byref(ptr), ctypes.c_size_t(nbytes))
        return ptr.value

    def free(self, ordinal: int, ptr: int) -> None:
        self.run(ordinal, "cuMemFree", ctypes.c_uint64(ptr))

    def ipc_handle(self, ordinal: int, ptr: int) -> bytes:
        handle = _Handle()
        self.run(ordinal, "cuIpcGetMemHandle", ctypes.byref(handle), ctypes.c_uint64(ptr))
        return ctypes.string_at(ctypes.addressof(handle), 64)

    def open_handle(self, ordinal: int, handle: bytes) -> int:
        if len(handle) != 64:
            raise DeviceError(f"a CUDA IPC handle has 64 bytes, got {len(handle)}")
        ptr = ctypes.c_uint64()
        h = _Handle.from_buffer_copy(handle)
        # CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS: the arena may be on another GPU of the host
        self.run(ordinal, "cuIpcOpenMemHandle", ctypes.byref(ptr), h, ctypes.c_uint(1))
        return ptr.value

    def close_handle(self, ordinal: int, ptr: int) -> None:
        self.run(ordinal, "cuIpcCloseMemHandle", ctypes.c_uint64(ptr))

    def to_host(self, ordinal: int, dst: int, src: int, nbytes: int) -> None:
        self.run(
            ordinal,
            "cuMemcpyDtoH",
            ctypes.c_void_p(dst),
            ctypes.c_uint64(src),
            ctypes.c_size_t(nbytes),
        )

    def host_alloc(self, ordinal: int, nbytes: int) -> int:
        """``nbytes`` of page-locked host memory (portable: any context may copy with it)."""
        ptr = ctypes.c_void_p()
        self.run(ordinal, "cuMemHostAlloc", ctypes.byref(ptr), ctypes.c_size_t(nbytes), 1)
        return int(ptr.value or 0)

    def host_free(self, ordinal: int, ptr: int) -> None:
        self.run(ordinal, "cuMemFreeHost", ctypes.c_void_p(ptr))

    def to_device(self, ordinal: int, dst: int, src: int, nbytes: int) -> None:
        self.run(
            ordinal,
            "cuMemcpyHtoD",
            ctypes.c_uint64(dst),
            ctypes.c_void_p(src),
            ctypes.c_size_t(nbytes),
        )


_driver: CudaDriver | None = None
_driver_error: str | None = None


def driver() -> CudaDriver:
    """The CUDA driver of this process (loaded once).

    Raises:
        DeviceError: no NVIDIA driver here (or it failed to initialise).
    """
    global _driver, _driver_error
    if _driver is not None:
        return _driver
    if _driver_error is not None:
        raise DeviceError(_driver_error)
    import ctypes.util  # here: a unit without a device arena never needs it

    try:
        name = ctypes.util.find_library("cuda") or "libcuda.so.1"
        _driver = CudaDriver(ctypes.CDLL(name))
    except (OSError, DeviceError) as exc:
        _driver_error = f"no usable CUDA driver in this process: {exc}"
        raise DeviceError(_driver_error) from None
    return _driver

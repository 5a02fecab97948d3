"""CUDA C++ kernels built at first use: NVRTC (the runtime compiler PyTorch's CUDA wheels ship) to a cubin for the
device's own architecture, the CUDA driver to load and launch it on PyTorch's current stream (so that CUDA graphs
capture it like any other launch). No compiler toolchain is needed on the user's machine, and nothing is built
where the libraries are missing: :func:`build` then returns None with the reason, and callers keep their Triton
path.

    kernel = build(source, "name", ["-DX=1"], device)     # compiled once per (source, options, device)
    kernel.launch(grid, block, [tensor, 3, 2.5, ...])        # tensors by address, ints as int32 (I64 for int64)
"""

from __future__ import annotations

import contextlib
import ctypes
import glob
import logging
import os
import sys
from dataclasses import dataclass, field

import torch

log = logging.getLogger(__name__)

_LIBS: dict = {}
_BUILT: dict = {}  # (source hash, name, options, device index) → Kernel | None
FAILURES: dict = {}  # the same key → why it was not built (for logs and tests)


class I64(int):
    """A kernel argument passed as a 64-bit integer (plain ints go as 32-bit)."""


def _library(kind: str) -> ctypes.CDLL | None:
    """The NVRTC or driver library, found where PyTorch's CUDA wheels put it (or on the loader's path)."""
    if kind in _LIBS:
        return _LIBS[kind]
    if kind == "driver":
        names = ["libcuda.so.1", "libcuda.so", "nvcuda.dll"]
    else:
        major = (torch.version.cuda or "").split(".")[0]
        names = [f"libnvrtc.so.{major}", "libnvrtc.so"]
        for root in sys.path:  # nvidia-cuda-nvrtc-cu12 (nvidia/cuda_nvrtc/lib), the CUDA 13 wheels (nvidia/cu13/lib)
            names += sorted(glob.glob(os.path.join(root, "nvidia", "*", "lib", "libnvrtc.so*")), reverse=True)
        for home in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):  # a toolkit
            if home:
                names += sorted(glob.glob(os.path.join(home, "lib64", "libnvrtc.so*")), reverse=True)
    lib = None
    for name in names:
        try:
            lib = ctypes.CDLL(name)
            break
        except OSError:
            continue
    _LIBS[kind] = lib
    return lib


def _check(result: int, what: str, driver: ctypes.CDLL) -> None:
    if result:
        text = ctypes.c_char_p()
        driver.cuGetErrorString(result, ctypes.byref(text))
        raise RuntimeError(f"{what}: CUDA error {result} ({(text.value or b'?').decode()})")


def _nvrtc(nvrtc: ctypes.CDLL, source: str, name: str, options: list[str]) -> bytes:
    """The cubin of ``source`` (raises with the compiler's log on an error)."""
    prog = ctypes.c_void_p()
    if nvrtc.nvrtcCreateProgram(ctypes.byref(prog), source.encode(), f"{name}.cu".encode(), 0, None, None):
        raise RuntimeError("nvrtcCreateProgram failed")
    try:
        opts = (ctypes.c_char_p * len(options))(*[o.encode() for o in options])
        status = nvrtc.nvrtcCompileProgram(prog, len(options), opts)
        size = ctypes.c_size_t()
        nvrtc.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
        text = ctypes.create_string_buffer(size.value)
        nvrtc.nvrtcGetProgramLog(prog, text)
        if status:
            raise RuntimeError(f"NVRTC could not compile {name}: {text.value.decode(errors='replace')[:2000]}")
        nvrtc.nvrtcGetCUBINSize(prog, ctypes.byref(size))
        cubin = ctypes.create_string_buffer(size.value)
        if nvrtc.nvrtcGetCUBIN(prog, cubin):
            raise RuntimeError("nvrtcGetCUBIN failed")
        return cubin.raw
    finally:
        nvrtc.nvrtcDestroyProgram(ctypes.byref(prog))


@dataclass
class Kernel:
    """A loaded kernel: its function handle, the module that holds it and its registers a thread."""

    function: ctypes.c_void_p
    module: ctypes.c_void_p
    registers: int
    device: int
    occupancy: dict = field(default_factory=dict)  # (threads, shared) → blocks_per_sm
    shared_allowed: int = 0  # dynamic shared memory bytes the kernel was opted in to (allow_shared raises it)

    def allow_shared(self, nbytes: int) -> bool:
        """Let launches ask ``nbytes`` of dynamic shared memory; False where the device cannot give it. Static
        and dynamic shared memory together past 48 KiB need this opt-in per kernel, so it is asked for any size
        (a kernel with 33 KB of static tables and 45 KB of stages did not launch without it)."""
        if nbytes > self.shared_allowed:
            driver = _library("driver")
            with torch.cuda.device(self.device):  # CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
                if driver.cuFuncSetAttribute(self.function, 8, ctypes.c_int(nbytes)):
                    return False
            self.shared_allowed = nbytes
        return True

    def blocks_per_sm(self, threads: int, shared: int = 0) -> int:
        """Blocks of ``threads`` threads one multiprocessor holds at once (the driver's occupancy; asked once)."""
        if (threads, shared) not in self.occupancy:
            out = ctypes.c_int()
            _check(_library("driver").cuOccupancyMaxActiveBlocksPerMultiprocessor(
                ctypes.byref(out), self.function, threads, ctypes.c_size_t(shared)), "occupancy", _library("driver"))
            self.occupancy[threads, shared] = out.value
        return self.occupancy[threads, shared]

    def launch(self, grid: tuple, block: tuple, args: list, shared: int = 0) -> None:
        """Launch on the current stream of the kernel's device; tensors go by address, I64 as 64-bit, other ints
        as 32-bit, floats as float32."""
        values = []
        for a in args:
            if isinstance(a, torch.Tensor):
                values.append(ctypes.c_void_p(a.data_ptr()))
            elif isinstance(a, I64):
                values.append(ctypes.c_int64(a))
            elif isinstance(a, (bool, int)):
                values.append(ctypes.c_int32(int(a)))
            elif isinstance(a, float):
                values.append(ctypes.c_float(a))
            else:
                raise TypeError(f"kernel argument of type {type(a).__name__}")
        params = (ctypes.c_void_p * len(values))(*[ctypes.cast(ctypes.byref(v), ctypes.c_void_p) for v in values])
        stream = torch.cuda.current_stream(self.device).cuda_stream
        driver = _library("driver")
        # (the module lives in its device's primary context: made current where another device is)
        other = torch.cuda.current_device() != self.device
        with torch.cuda.device(self.device) if other else contextlib.nullcontext():
            _check(driver.cuLaunchKernel(self.function, *grid, *block, shared, ctypes.c_void_p(stream), params, None),
                   "cuLaunchKernel", driver)


def build(source: str, name: str, options: list[str], device: torch.device) -> Kernel | None:
    """The extern "C" kernel ``name`` of ``source`` compiled for ``device``'s architecture, loaded; None (and the
    reason in FAILURES, logged once) where NVRTC or the driver is missing or the build fails."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    key = (hash(source), name, tuple(options), index)
    if key in _BUILT:
        return _BUILT[key]
    if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        return None  # (loading a module is no stream's work: built outside a capture, at its eager warm-up step)
    kernel = None
    try:
        nvrtc, driver = _library("nvrtc"), _library("driver")
        if nvrtc is None or driver is None:
            raise RuntimeError("NVRTC or the CUDA driver library was not found")
        major, minor = torch.cuda.get_device_capability(index)
        cubin = _nvrtc(nvrtc, source, name, [f"--gpu-architecture=sm_{major}{minor}", "--std=c++17", *options])
        with torch.cuda.device(index):
            torch.cuda.init()
            torch.empty(1, device=f"cuda:{index}")  # (the primary context current on this thread)
            module, function = ctypes.c_void_p(), ctypes.c_void_p()
            _check(driver.cuModuleLoadData(ctypes.byref(module), cubin), "cuModuleLoadData", driver)
            _check(driver.cuModuleGetFunction(ctypes.byref(function), module, name.encode()), "cuModuleGetFunction",
                   driver)
            regs = ctypes.c_int()
            driver.cuFuncGetAttribute(ctypes.byref(regs), 4, function)  # CU_FUNC_ATTRIBUTE_NUM_REGS
        kernel = Kernel(function, module, regs.value, index)
    except Exception as exc:  # (any failure leaves the caller's other path)
        FAILURES[key] = str(exc)
        log.warning("cuda_build: %s not built (%s); its Triton path runs instead", name, exc)
    _BUILT[key] = kernel
    return kernel

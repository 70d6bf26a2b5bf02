"""The engine owns the launches: compiled kernels' CUfunctions, parameters packed once (by name), raw
``cuLaunchKernel`` (``cuLaunchKernelEx`` with programmatic dependent launch for the kernels that ask for it),
stream-ordered copies, CUDA graph capture and replay. numba is only the compiler: its dispatcher's
per-call argument conversion costs more than most kernels run (docs/gpu.md#launch-cost).
"""
from __future__ import annotations

import ctypes
import inspect
import os

import numpy as np

from . import compat  # noqa: F401  (numpy row_stack alias before numba-cuda compiles anything)
from .graph_gate import SIM_CONDITIONS
from .intrinsics import SIM, pdl_capable

from numba import cuda

if not SIM:
    from cuda.bindings import driver as drv

    _OK = drv.CUresult.CUDA_SUCCESS
else:  # pragma: no cover - names only used on a real device
    drv = None
    _OK = None


# Programmatic dependent launch (P39): kernels that start with pdl_enter (Kernel's pdl: the model's, the encoder's,
# retrieval's) launch with the PDL attribute, so a kernel's launch overlaps the one before it. TOOLTRIE_PDL=0
# launches them plainly (for A/B measurements); the bits are the same either way.
PDL = os.environ.get("TOOLTRIE_PDL", "1") != "0"


def parse_carveout(text: str) -> dict:
    """TOOLTRIE_CARVEOUT, for A/B measurements (P52): the preferred shared-memory carveout, in
    percent of the SM's unified L1/shared, as "N" for every kernel ({"*": N}) or "name=N,name=N" for
    those kernels; empty: none set (the driver picks one per kernel)."""
    items = [i.strip() for i in text.split(",") if i.strip()]
    pairs = [("*", items[0])] if len(items) == 1 and "=" not in items[0] else [i.partition("=")[::2] for i in items]
    if any(not name or not value.isdigit() or int(value) > 100 for name, value in pairs):
        raise ValueError(f"TOOLTRIE_CARVEOUT={text!r}: expected one percent 0-100 for every kernel (\"44\") "
                         f"or kernel=percent pairs (\"k_attn_rows=28,k_gemv=50\")")
    return {name: int(value) for name, value in pairs}


CARVEOUT = parse_carveout(os.environ.get("TOOLTRIE_CARVEOUT", ""))


class CudaError(RuntimeError):
    """A CUDA driver call failed; the message names the call and the driver's error."""


def check(res, what: str = "CUDA call"):
    """Unwrap a cuda.bindings result tuple (err, *values), raising CudaError on failure."""
    err = res[0]
    if err != _OK:
        name = drv.cuGetErrorName(err)[1]
        raise CudaError(f"{what} failed: {name.decode() if isinstance(name, bytes) else name}")
    if len(res) == 1:
        return None
    return res[1] if len(res) == 2 else res[1:]


def dptr(arr) -> int:
    """Device address of a numba device array (or view); under the simulator, which has none, its id."""
    return id(arr) if SIM else int(arr.__cuda_array_interface__["data"][0])


class Scalar:
    """A scalar kernel parameter shared by launches (e.g. the block-table stride of this step): one write
    updates every launch that reads it; a captured graph keeps its value at capture."""

    __slots__ = ("c",)

    def __init__(self, ctype, value=0):
        self.c = ctype(value)

    @property
    def value(self):
        return self.c.value

    @value.setter
    def value(self, v):
        self.c.value = v


_CTYPES = {"int32": ctypes.c_int32, "int64": ctypes.c_int64, "float32": ctypes.c_float,
           "float64": ctypes.c_double, "uint32": ctypes.c_uint32, "uint64": ctypes.c_uint64}


class Kernel:
    """One numba kernel compiled for one tuple of argument types: its CUfunction and its parameter names.

    ``dispatcher.compile`` goes through numba's on-disk cache (``cache=True``), so a restarted
    process loads the cubin instead of recompiling; ``cache_hit`` says which happened.
    """

    def __init__(self, name: str, dispatcher, argtypes, *, pdl: bool = False):
        """name: for TOOLTRIE_CARVEOUT and error messages; argtypes: in the kernel's parameter order; pdl: it
        starts with pdl_enter, so it launches with the PDL attribute. Each caller's registry hands these in."""
        self.name = name
        self.pdl = pdl
        self.dispatcher = dispatcher
        self.argtypes = tuple(argtypes)
        self.params = tuple(inspect.signature(self.dispatcher.py_func).parameters)   # the kernel's names
        if len(self.params) != len(self.argtypes):
            raise TypeError(f"{name}: {len(self.argtypes)} argument types for parameters {self.params}")
        self.func = None
        self.attrs = None
        self.module = None  # the loaded module: its global symbols (constant memory) live there
        self.cache_hit = None
        self._max_dyn_shared = 0
        if SIM:
            return
        hits_before = sum(self.dispatcher._cache_hits.values())
        compiled = self.dispatcher.compile(self.argtypes)
        self.cache_hit = sum(self.dispatcher._cache_hits.values()) > hits_before
        cufunc = compiled._codelibrary.get_cufunc()
        self.attrs = cufunc.attrs
        self._max_dyn_shared = 48 * 1024 - self.attrs.shared   # the default: 48 KiB less static shared
        self.module = cufunc.module
        handle = cufunc.handle
        if isinstance(handle, drv.CUfunction):
            self.func = handle
        else:  # a CUkernel (library API): its function in the current context
            self.func = check(drv.cuKernelGetFunction(handle), f"cuKernelGetFunction({name})")
        carve = CARVEOUT.get(name, CARVEOUT.get("*"))
        if carve is not None:
            attr = drv.CUfunction_attribute.CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT
            check(drv.cuFuncSetAttribute(self.func, attr, carve), f"cuFuncSetAttribute({name})")

    def ordered(self, named: dict) -> list:
        """Keyword arguments in the kernel's parameter order (numba's kernels take positional ones only);
        a missing or unknown name raises TypeError. Called once per Launch, when its parameters are packed."""
        if named.keys() != set(self.params):
            missing, unknown = set(self.params) - named.keys(), named.keys() - set(self.params)
            raise TypeError(f"{self.name}: missing arguments {sorted(missing)}, unknown {sorted(unknown)}")
        return [named[p] for p in self.params]

    def occupancy(self, block: int, shmem: int) -> int:
        """Resident blocks per SM for this block size and dynamic shared memory (opted into first: asked
        before a launch allows it, the driver counts none; P74, docs/gpu.md#registers-occupancy-shared-memory)."""
        if SIM:
            return 2
        self.allow_dynamic_shared(shmem)
        return int(check(drv.cuOccupancyMaxActiveBlocksPerMultiprocessor(self.func, block, shmem),
                         f"cuOccupancyMaxActiveBlocksPerMultiprocessor({self.name})"))

    def allow_dynamic_shared(self, nbytes: int) -> None:
        """Dynamic shared memory above 48 KiB must be opted into per function
        (docs/gpu.md#registers-occupancy-shared-memory)."""
        if SIM or nbytes <= self._max_dyn_shared:
            return
        attr = drv.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
        check(drv.cuFuncSetAttribute(self.func, attr, nbytes), f"cuFuncSetAttribute({self.name})")
        self._max_dyn_shared = nbytes


class Launch:
    """One kernel with its arguments packed once; ``launch(gx, gy)`` enqueues it on the stream. ``args``:
    by parameter name (a dict, put in the kernel's order here, once), or a list in that order."""

    __slots__ = ("kernel", "block", "shmem", "args", "stream", "_vals", "_ptrs", "_addr", "name", "_config")

    def __init__(self, kernel: Kernel, block: int, shmem: int, args: list | dict, stream, name: str = ""):
        if isinstance(args, dict):
            args = kernel.ordered(args)
        if len(args) != len(kernel.argtypes):
            raise TypeError(f"{kernel.name}: {len(args)} arguments for {len(kernel.argtypes)} parameters")
        self.kernel, self.block, self.shmem, self.args = kernel, int(block), int(shmem), list(args)
        self.stream = stream
        self.name = name or kernel.name
        kernel.allow_dynamic_shared(self.shmem)
        vals = []
        for i, (ty, a) in enumerate(zip(kernel.argtypes, args)):
            where = f"{kernel.name} argument {i}"
            if hasattr(ty, "ndim"):  # a 1-D C-contiguous array
                want = np.dtype(str(ty.dtype))
                if a.dtype != want or a.ndim != 1:
                    raise TypeError(f"{where}: want 1-D {want}, got {a.ndim}-D {a.dtype}")
                if not SIM:
                    n, isz = int(a.size), int(a.dtype.itemsize)
                    vals += [ctypes.c_void_p(0), ctypes.c_void_p(0), ctypes.c_int64(n),
                             ctypes.c_int64(isz), ctypes.c_void_p(dptr(a)), ctypes.c_int64(n),
                             ctypes.c_int64(isz)]
            else:
                ct = _CTYPES[str(ty)]
                if isinstance(a, Scalar):
                    if not isinstance(a.c, ct):
                        raise TypeError(f"{where}: shared scalar is {type(a.c).__name__}, want {ct.__name__}")
                    vals.append(a.c)
                else:
                    vals.append(ct(a))
        if SIM:
            self._vals = self._ptrs = self._addr = self._config = None
            return
        self._vals = vals
        self._ptrs = (ctypes.c_void_p * len(vals))(*[ctypes.addressof(v) for v in vals])
        self._addr = ctypes.addressof(self._ptrs)
        pdl = PDL and kernel.pdl and pdl_capable()
        self._config = _pdl_config(self.block, self.shmem, stream) if pdl else None

    def launch(self, gx: int, gy: int = 1, gz: int = 1) -> None:
        if SIM:
            args = [a.value if isinstance(a, Scalar) else a for a in self.args]
            self.kernel.dispatcher[(gx, gy, gz), self.block, 0, self.shmem](*args)
            return
        cfg = self._config
        if cfg is None:
            err, = drv.cuLaunchKernel(self.kernel.func, gx, gy, gz, self.block, 1, 1, self.shmem,
                                      self.stream, self._addr, 0)
        else:
            cfg.gridDimX, cfg.gridDimY, cfg.gridDimZ = gx, gy, gz
            err, = drv.cuLaunchKernelEx(cfg, self.kernel.func, self._addr, 0)
        if err != _OK:
            call = "cuLaunchKernel" if cfg is None else "cuLaunchKernelEx"
            check((err,), f"{call}({self.name}, grid=({gx},{gy},{gz}), block={self.block})")


def _pdl_config(block: int, shmem: int, stream):
    """A cuLaunchKernelEx configuration with the programmatic-stream-serialization attribute (the
    grid is filled in per launch)."""
    attr = drv.CUlaunchAttribute()
    attr.id = drv.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
    attr.value.programmaticStreamSerializationAllowed = 1
    cfg = drv.CUlaunchConfig()
    cfg.blockDimX, cfg.blockDimY, cfg.blockDimZ = block, 1, 1
    cfg.sharedMemBytes = shmem
    cfg.hStream = stream
    cfg.attrs = [attr]
    cfg.numAttrs = 1
    return cfg


class Stream:
    """A stream, plus stream-ordered copies (pinned host memory on a real device)."""

    def __init__(self):
        if SIM:
            self.numba = None
            self.handle = None
            return
        cuda.current_context()
        self.numba = cuda.stream()
        self.handle = drv.CUstream(int(self.numba.handle))

    def h2d(self, dst, src: np.ndarray, count: int) -> None:
        """dst[:count] = src[:count] (src pinned: the copy is asynchronous and capturable)."""
        if count <= 0:
            return
        if SIM:
            dst[:count].copy_to_device(np.ascontiguousarray(src[:count]))
            return
        check(drv.cuMemcpyHtoDAsync(dptr(dst), src.ctypes.data, count * src.itemsize, self.handle),
              "cuMemcpyHtoDAsync")

    def d2h(self, dst: np.ndarray, src, count: int) -> None:
        if count <= 0:
            return
        if SIM:
            dst[:count] = src[:count].copy_to_host()
            return
        check(drv.cuMemcpyDtoHAsync(dst.ctypes.data, dptr(src), count * dst.itemsize, self.handle),
              "cuMemcpyDtoHAsync")

    def d2d(self, dst, src, count: int) -> None:
        """dst[:count] = src[:count], both device arrays of one dtype (asynchronous, capturable)."""
        if count <= 0:
            return
        if SIM:
            dst[:count].copy_to_device(src[:count].copy_to_host())
            return
        check(drv.cuMemcpyDtoDAsync(dptr(dst), dptr(src), count * dst.dtype.itemsize, self.handle),
              "cuMemcpyDtoDAsync")

    def d2d_rows(self, dst, dst_start: int, src, src_start: int, width: int, rows: int, pitch: int) -> None:
        """`rows` runs of `width` elements, run r at start + r * pitch in each flat device array (one
        strided copy: asynchronous, capturable)."""
        if SIM:
            host, out = src.copy_to_host(), dst.copy_to_host()
            for r in range(rows):
                out[dst_start + r * pitch:dst_start + r * pitch + width] = \
                    host[src_start + r * pitch:src_start + r * pitch + width]
            dst.copy_to_device(out)
            return
        size = dst.dtype.itemsize
        copy = drv.CUDA_MEMCPY2D()
        copy.srcMemoryType = copy.dstMemoryType = drv.CUmemorytype.CU_MEMORYTYPE_DEVICE
        copy.srcDevice, copy.dstDevice = dptr(src) + src_start * size, dptr(dst) + dst_start * size
        copy.srcPitch = copy.dstPitch = pitch * size
        copy.WidthInBytes, copy.Height = width * size, rows
        check(drv.cuMemcpy2DAsync(copy, self.handle), "cuMemcpy2DAsync")

    def memset0(self, dst) -> None:
        if SIM:
            dst.copy_to_device(np.zeros(dst.shape, dst.dtype))
            return
        check(drv.cuMemsetD8Async(dptr(dst), 0, dst.size * dst.dtype.itemsize, self.handle),
              "cuMemsetD8Async")

    def synchronize(self) -> None:
        if not SIM:
            check(drv.cuStreamSynchronize(self.handle), "cuStreamSynchronize")

    def record(self, event) -> None:
        if not SIM:
            check(drv.cuEventRecord(event, self.handle), "cuEventRecord")

    def wait(self, event) -> None:
        """Work enqueued after this waits for the work before `event` on its own stream."""
        if not SIM:
            check(drv.cuStreamWaitEvent(self.handle, event, 0), "cuStreamWaitEvent")


def new_event(timing: bool = False):
    if SIM:
        return None
    flags = 0 if timing else drv.CUevent_flags.CU_EVENT_DISABLE_TIMING
    return check(drv.cuEventCreate(flags), "cuEventCreate")


def destroy_event(event) -> None:
    """Release an event of new_event's (for the owners that come and go, such as a catalog version's scorer)."""
    if not SIM and event is not None and drv is not None:
        drv.cuEventDestroy(event)


def event_wait_host(event) -> None:
    if not SIM and event is not None:
        check(drv.cuEventSynchronize(event), "cuEventSynchronize")


def event_ms(start, end) -> float:
    return float(check(drv.cuEventElapsedTime(start, end), "cuEventElapsedTime"))


class Graph:
    """A captured sequence of launches on `stream`, replayed with one cuGraphLaunch.

    ``fn`` must only enqueue work on the stream (no allocation, no host synchronisation, no
    pageable copies): everything it launches is recorded, nothing runs during capture. Every kernel
    must already be compiled and loaded (their owners, such as the model's backend, do that at construction).

    With a ``gate`` (graph_gate.k_gate's Kernel, a device int32 array of done flags, a row count n),
    the captured launches are the body of a conditional IF node after one k_gate launch: at a replay
    the body runs only if some of flags[0..n) is 0.
    """

    def __init__(self, stream: Stream, fn, gate: tuple | None = None):
        self.stream = stream
        self.fn = fn
        self.num_nodes = 0
        self._exec = self._graph = self._gate = None
        if SIM:
            if gate is not None:   # the handle: a key of SIM_CONDITIONS
                kernel, flags, n = gate
                self._gate = Launch(kernel, 1, 0, dict(done=flags, n=n, handle=id(self)), stream.handle)
            return
        self._graph = self._capture(None, fn) if gate is None else self._gated(fn, *gate)
        self._exec = check(drv.cuGraphInstantiate(self._graph, 0), "cuGraphInstantiate")
        _, self.num_nodes = check(drv.cuGraphGetNodes(self._graph, 0), "cuGraphGetNodes")

    def _gated(self, fn, kernel, flags, n):
        """A graph: one k_gate launch setting a conditional handle, then an IF node whose body is fn's."""
        graph = check(drv.cuGraphCreate(0), "cuGraphCreate")
        context = check(drv.cuCtxGetCurrent(), "cuCtxGetCurrent")
        handle = check(drv.cuGraphConditionalHandleCreate(graph, context, 0, 0), "cuGraphConditionalHandleCreate")
        self._gate = Launch(kernel, 1, 0, dict(done=flags, n=n, handle=int(handle)), self.stream.handle)
        self._capture(graph, lambda: self._gate.launch(1))
        gate_node, = check(drv.cuGraphGetNodes(graph, 1), "cuGraphGetNodes")[0]
        params = drv.CUgraphNodeParams()
        params.type = drv.CUgraphNodeType.CU_GRAPH_NODE_TYPE_CONDITIONAL
        params.conditional.handle = handle
        params.conditional.type = drv.CUgraphConditionalNodeType.CU_GRAPH_COND_TYPE_IF
        params.conditional.size = 1
        params.conditional.ctx = context
        add = getattr(drv, "cuGraphAddNode_v2", drv.cuGraphAddNode)   # CUDA 12's name for 13's call
        check(add(graph, [gate_node], None, 1, params), "cuGraphAddNode(conditional IF)")
        self._capture(params.conditional.phGraph_out[0], fn)
        return graph

    def _capture(self, graph, fn):
        """Record fn's launches into `graph` (None: a new graph); the graph recorded into."""
        mode = drv.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_THREAD_LOCAL
        stream = self.stream.handle
        with cuda.defer_cleanup():
            if graph is None:
                check(drv.cuStreamBeginCapture(stream, mode), "cuStreamBeginCapture")
            else:
                check(drv.cuStreamBeginCaptureToGraph(stream, graph, None, None, 0, mode),
                      "cuStreamBeginCaptureToGraph")
            try:
                fn()
            except BaseException:
                drv.cuStreamEndCapture(stream)
                raise
            return check(drv.cuStreamEndCapture(stream), "cuStreamEndCapture")

    def replay(self) -> None:
        if SIM:
            if self._gate is not None:
                self._gate.launch(1)
                if not SIM_CONDITIONS[id(self)]:
                    return
            self.fn()
            return
        err, = drv.cuGraphLaunch(self._exec, self.stream.handle)
        if err != _OK:
            check((err,), "cuGraphLaunch")

    def __del__(self):
        if SIM or drv is None:
            return
        try:
            if self._exec is not None:
                drv.cuGraphExecDestroy(self._exec)
            if self._graph is not None:
                drv.cuGraphDestroy(self._graph)
        except Exception:  # noqa: BLE001 - a destructor at interpreter shutdown: the driver may be gone
            pass

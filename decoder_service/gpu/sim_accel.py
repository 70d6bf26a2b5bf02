"""Make numba's CUDA simulator fast enough to run the model's kernels in tests (simulator only).

``install()`` replaces the simulator's busy-polling ``syncthreads`` with a barrier per block and makes its
static shared arrays atomic; no kernel or result changes (docs/gpu.md#numbas-cuda-simulator).
"""
from __future__ import annotations

import sys
import threading

import numpy as np

_installed = False
_BARRIER_TIMEOUT_S = 120.0


def install() -> bool:
    """Patch the simulator's block manager (idempotent). Returns False where not simulating."""
    global _installed
    import numba
    if not getattr(numba.config, "ENABLE_CUDASIM", 0):
        return False
    if _installed:
        return True
    from numba.cuda.simulator import kernel as simk

    def syncthreads(self):
        try:
            self._manager._tt_barrier.wait(_BARRIER_TIMEOUT_S)
        except threading.BrokenBarrierError:
            raise RuntimeError("syncthreads: another thread of the block failed or never arrived") from None

    orig_thread_run = simk.BlockThread.run

    def thread_run(self):
        orig_thread_run(self)
        if self.exception is not None:
            self._manager._tt_barrier.abort()

    def manager_run(self, grid_point, *args):
        nthreads = int(np.prod(self._block_dim))
        self._tt_barrier = threading.Barrier(nthreads)

        def target():
            self._f(*args)

        threads = [simk.BlockThread(target, self, grid_point, bp, self._debug)
                   for bp in np.ndindex(*self._block_dim)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        for t in threads:  # the first real failure, not the barrier aborts it caused
            if t.exception is not None and "syncthreads:" not in str(t.exception[0]):
                raise t.exception[0].with_traceback(t.exception[1])
        for t in threads:
            if t.exception is not None:
                raise t.exception[0].with_traceback(t.exception[1])

    # The simulator creates a static shared array on first use with an unlocked get-or-create, so two
    # threads of a block starting together can each get their own "shared" array (a rare wrong
    # reduction). Make the creation atomic.
    from numba.cuda.simulator import kernelapi as simapi
    shared_lock = threading.Lock()

    def shared_array(self, shape, dtype, alignment=None):
        # the simulator's FakeCUDAShared.array, with the get-or-create under a lock
        if alignment is not None:
            raise RuntimeError("Array alignment is not supported in cudasim")
        if isinstance(dtype, simapi.types.Type):
            dtype = simapi.numpy_support.as_dtype(dtype)
        if shape == 0:
            count = self._dynshared_size // dtype.itemsize
            return np.frombuffer(self._dynshared.data, dtype=dtype, count=count)
        caller = simapi.traceback.extract_stack(sys._getframe(1), limit=1)[0][0:2]
        with shared_lock:
            res = self._allocations.get(caller)
            if res is None:
                res = np.empty(shape, dtype)
                self._allocations[caller] = res
        return res

    simapi.FakeCUDAShared.array = shared_array
    simk.BlockThread.syncthreads = syncthreads
    simk.BlockThread.run = thread_run
    simk.BlockManager.run = manager_run
    sys.setswitchinterval(5e-5)
    _installed = True
    return True

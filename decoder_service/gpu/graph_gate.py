"""The gate of a conditional graph: its body, a step's forward pass, runs only while some row is still live.

A step launched ahead of rows that all ended at the picks is dropped unread (engine.py); k_gate reads the
rows' done flags and sets the IF node's condition, so such a step costs the gate, not the forward pass
(P72; docs/gpu.md#conditional-graph-nodes). Under the simulator SIM_CONDITIONS stands in for the handle.
"""
from __future__ import annotations

import numba
from numba import cuda

from .intrinsics import SIM

SIM_CONDITIONS: dict[int, int] = {}   # simulator only: handle -> the value k_gate set

if SIM:
    def set_conditional(handle, value):
        SIM_CONDITIONS[int(handle)] = int(value)
else:
    from llvmlite import ir
    from numba.cuda import types as nbt
    from numba.cuda.extending import intrinsic

    @intrinsic
    def set_conditional(typingctx, handle, value):
        """cudaGraphSetConditional(handle, value): a device-runtime builtin that ptxas resolves itself
        (no device runtime library to link)."""
        sig = nbt.void(nbt.uint64, nbt.uint32)

        def codegen(context, builder, sig, args):
            fnty = ir.FunctionType(ir.VoidType(), [ir.IntType(64), ir.IntType(32)])
            fn = builder.module.globals.get("cudaGraphSetConditional") or \
                ir.Function(builder.module, fnty, "cudaGraphSetConditional")
            builder.call(fn, args)
            return context.get_dummy_value()

        return sig, codegen


@cuda.jit(cache=not SIM)
def k_gate(done, n, handle):
    """One thread: the conditional `handle` is 1 (the body runs) if some of done[0..n) is 0, else 0."""
    live = numba.uint32(0)
    for r in range(n):
        if done[r] == 0:
            live = numba.uint32(1)
    set_conditional(handle, live)


GATE_SIGNATURE = (numba.int32[::1], numba.int32, numba.uint64)

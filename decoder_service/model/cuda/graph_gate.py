"""The gate of a conditional graph: its body runs only while some row of the step is still live.

The engine launches a step ahead of its rows' picks (engine.py); when every row's answer ended at
those picks, the step is dropped unread, yet its ~0.7 ms on the device would still run ahead of the next
request. A gated graph (launcher.Graph with a gate) puts the captured forward pass under a conditional
IF node; k_gate, the node before it, reads the rows' done flags (k_select writes them at the picks) and
sets the condition, so a step whose rows have all ended costs the gate instead of the forward pass
(docs/gpu.md#conditional-graph-nodes: conditional nodes, and the device function that sets one).

Under numba's simulator there is no graph: the handle is a key of SIM_CONDITIONS, where the simulated
set_conditional writes, and Graph.replay reads it after running the gate.
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

"""The compiler's view of kernels, without a GPU: registers, spills and shared memory from ptxas for
sm_90, and whether a kernel's PTX is that of another checkout.

    python3 -m bench ptx k_gemm k_attn_mma [--against ../other-checkout] [--storage bfloat16] [--sass]
                           [--max-registers N]

numba compiles each kernel's Python source to PTX (`cuda.compile_ptx`, which needs NVRTC: the
`nvidia-cuda-nvrtc` wheel or a CUDA toolkit) and `ptxas -arch=sm_90 -v` (from a CUDA toolkit, found
on PATH or under /usr/local/cuda*/bin) reports its resources. Kernels compile without their register
caps here (a cap is a launch-time JIT option) unless --max-registers N gives ptxas one (e.g. 64, as
k_attn_rows runs: its spills). With --against, the same kernels are compiled from the other checkout
(its resources printed too) and compared: "identical" (the same PTX, names aside), "same
instructions" (the same instructions in another order or with other register numbers), or
"different". The bit-identical rows of docs/performance.md (e.g. P37, P46) come from this. With --sass,
`cuobjdump -sass` (the `nvidia-cuda-cuobjdump` and `nvidia-cuda-nvdisasm` wheels, or a toolkit) counts the
machine instructions: in all, and in the body of each loop of 60 or more (P42, P44: numba's 64-bit index
arithmetic shows up here; docs/gpu.md#what-numbas-code-generation-adds), and where the PDL wait and trigger
landed (P66, docs/gpu.md#programmatic-dependent-launch-pdl: ptxas moves loads across the wait, and whatever
it puts between the two delays the next kernel's launch).
"""
from __future__ import annotations

import glob
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from bench.common import ROOT


def compile_ptx(tree: Path, names: list[str], storage: str) -> dict:
    """{kernel: PTX} compiled from the kernels module of checkout `tree` (in a child process run in that
    checkout, so that two checkouts' modules never meet)."""
    code = ("import json, sys; from numba import cuda; "
            "import decoder_service.model.cuda.kernels as K; "
            "print(json.dumps({n: cuda.compile_ptx(K.KERNELS[n].py_func, K.signatures(sys.argv[1])[n], "
            "cc=(9, 0))[0] for n in sys.argv[2:]}))")
    out = subprocess.run([sys.executable, "-c", code, storage, *names], capture_output=True, text=True, check=True,
                         cwd=tree, env={**os.environ, "PYTHONPATH": str(tree)})
    return json.loads(out.stdout.splitlines()[-1])


def tool(name: str) -> str:
    """A CUDA tool found on PATH or under /usr/local/cuda*/bin."""
    found = shutil.which(name) or next(iter(sorted(glob.glob(f"/usr/local/cuda*/bin/{name}"))), None)
    if not found:
        raise SystemExit(f"{name} not found: install a CUDA toolkit or put {name} on PATH")
    return found


def assemble(ptx: str, cubin: str, cap: int = 0) -> str:
    """ptxas -v for sm_90 into `cubin` ("/dev/null" for none), under a register cap (0: none); its
    report (stderr)."""
    with tempfile.NamedTemporaryFile("w", suffix=".ptx") as f:
        f.write(ptx)
        f.flush()
        limit = [f"-maxrregcount={cap}"] if cap else []
        return subprocess.run([tool("ptxas"), "-arch=sm_90", "-v", *limit, f.name, "-o", cubin],
                              capture_output=True, text=True, check=True).stderr


def resources(ptx: str, cap: int = 0) -> str:
    """ptxas -v's registers / spill / shared-memory lines for one kernel's PTX."""
    err = assemble(ptx, "/dev/null", cap)
    keep = [ln.split("info    : ")[-1].strip() for ln in err.splitlines() if "registers" in ln or "spill" in ln]
    return "; ".join(keep)


def sass(ptx: str, cap: int = 0) -> str:
    """The kernel's machine instructions (`cuobjdump -sass` of its sm_90 cubin), summarized."""
    with tempfile.TemporaryDirectory() as d:
        cubin = f"{d}/k.cubin"
        assemble(ptx, cubin, cap)
        text = subprocess.run([tool("cuobjdump"), "-sass", cubin], capture_output=True, text=True,
                              check=True).stdout
    return sass_summary(text)


def sass_summary(listing: str) -> str:
    """Instructions in all, and the body sizes of the loops of 60 or more: a backward branch before the
    last unpredicated EXIT (after it come the divergent-warp fallbacks of the shuffles, whose branches
    jump back into the body)."""
    ins = [(int(m.group(1), 16), m.group(2).strip()) for m in
           re.finditer(r"/\*([0-9a-f]{4,})\*/\s+(.*?);", listing)]
    end = max((a for a, op in ins if op == "EXIT"), default=ins[-1][0])
    loops = []
    for a, op in ins:
        m = re.search(r"BRA (?:\S+, )?0x([0-9a-f]+)$", op)
        if m and int(m.group(1), 16) < a <= end:
            size = sum(int(m.group(1), 16) <= b <= a for b, _ in ins)
            if size >= 60:
                loops.append(str(size))
    ops = [op for _, op in ins]
    pdl = ""
    if "ACQBULK" in ops and "PREEXIT" in ops:      # griddepcontrol.wait and .launch_dependents (P66)
        wait = ops.index("ACQBULK")
        loads = sum(any(w.startswith("LDG") for w in op.split()[:2]) for op in ops[:wait])   # [@P] LDG...
        pdl = f"; PDL trigger {ops.index('PREEXIT') - wait:+d} instructions after the wait, {loads} loads before it"
    return f"{len(ins)} instructions; loops: {' '.join(loops) or 'none'}{pdl}"


def _body(ptx: str) -> list[str]:
    """The PTX without comments and with mangled names and shared-array numbers abstracted."""
    out = []
    for ln in ptx.splitlines():
        if ln.startswith("//"):
            continue
        out.append(re.sub(r"_cudapy_smem_\d+", "SMEM", re.sub(r"_ZN[0-9A-Za-z_]+", "NAME", ln)))
    return out


def compare(a: str, b: str) -> str:
    ba, bb = _body(a), _body(b)
    if ba == bb:
        return "identical"

    def regs(lines):
        return sorted(re.sub(r"%(rd|r|f|fd|p|rs|h)\d+", "R", ln) for ln in lines)

    return "same instructions" if regs(ba) == regs(bb) else "different"


def ptx_arguments(ap) -> None:
    ap.add_argument("kernels", nargs="+")
    ap.add_argument("--against", type=Path, help="another checkout to compare the PTX with")
    ap.add_argument("--storage", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    ap.add_argument("--sass", action="store_true", help="count machine instructions (cuobjdump)")
    ap.add_argument("--max-registers", type=int, default=0, help="ptxas's register cap (0: none)")


def ptx(args) -> None:
    cap = args.max_registers
    here = compile_ptx(ROOT, args.kernels, args.storage)
    there = compile_ptx(args.against.resolve(), args.kernels, args.storage) if args.against else {}
    for name in args.kernels:
        line = f"{name}: {resources(here[name], cap)}"
        if there:
            line += f" | against {args.against}: {compare(there[name], here[name])}; {resources(there[name], cap)}"
        if args.sass:
            line += f" | SASS: {sass(here[name], cap)}"
            if there:
                line += f" (against: {sass(there[name], cap)})"
        print(line, flush=True)


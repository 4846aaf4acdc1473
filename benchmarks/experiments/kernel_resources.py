"""Registers, spills and shared memory of the Triton kernels as a GPU launch compiles them, here, without a GPU.

tests/kernels/test_compile_hopper.py compiles every kernel for sm_90 to check that it compiles at all; it gives the
compiler no alignment facts, so loads come out one element wide and the register counts are far above a launch's
(session 16's fused combine, unrolled over its slots: 392-5,704 bytes of spills a thread that way, 72-2,464 with
the facts below). This compiles the same list the way Triton's launcher specialises a real call: every pointer and
every stride argument divisible by 16. It prints, per kernel and tile config: registers per thread, stack (spill)
bytes per thread, shared memory (Triton's dynamic allocation), and the SASS instruction count. Use it before
spending device time on a kernel change: a spill or a jump in registers shows here. The figures come from the
Triton installed here (3.9 with its ptxas), not the GPU machine's (3.6): a guide, close but not equal (session 15
read 234 registers for gather-Q at G = 4 on the H200).

    TRITON_INTERPRET=0 python benchmarks/experiments/kernel_resources.py [--only "gather_q_fwd|combine"]
        [--rows 32,64,128] [--warps 4,8]
"""
from __future__ import annotations

import argparse
import importlib
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", default="", help="substrings of the kernels' names, separated by |")
    ap.add_argument("--rows", default="", help="ROWS values to compile where a kernel has that constexpr")
    ap.add_argument("--warps", default="", help="num_warps values (default: the listed config's)")
    a = ap.parse_args()
    if os.environ.get("TRITON_INTERPRET", "0") == "1":
        sys.exit("error: run with TRITON_INTERPRET=0 (the interpreter compiles nothing)")
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from tests.kernels.test_compile_hopper import KERNELS

    cuobjdump = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    only = [s for s in a.only.split("|") if s]
    for name, path, pointers, constexprs, floats, options in KERNELS:
        if only and not any(s in name for s in only):
            continue
        mod, attr = path.split(".")
        fn = getattr(importlib.import_module(f"kernels.{mod}"), attr)
        while not isinstance(fn, triton.runtime.jit.JITFunction):
            fn = fn.fn
        rows = [int(r) for r in a.rows.split(",") if r] if "ROWS" in constexprs and a.rows else [None]
        warps = [int(w) for w in a.warps.split(",") if w] or [options.get("num_warps", 4)]
        for r in rows:
            for w in warps:
                c = dict(constexprs, **({"ROWS": r} if r else {}))
                sig = {x: "constexpr" if x in c else pointers.get(x, "fp32" if x in floats else "i32")
                       for x in fn.arg_names}
                attrs = {(i,): [["tt.divisibility", 16]] for i, x in enumerate(fn.arg_names)
                         if sig[x].startswith("*") or x.startswith("stride")}
                try:
                    comp = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=c, attrs=attrs),
                                          target=GPUTarget("cuda", 90, 32), options=dict(options, num_warps=w))
                except Exception as e:  # noqa: BLE001 - e.g. a TMA box listed for another tile: a row too
                    print(json.dumps(dict(kernel=name, rows=c.get("ROWS"), warps=w,
                                          error=str(e).strip().splitlines()[-1][:160])), flush=True)
                    continue
                with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
                    f.write(comp.asm["cubin"])
                    f.flush()
                    usage = subprocess.run([str(cuobjdump), "--dump-resource-usage", f.name], capture_output=True,
                                           text=True).stdout
                    sass = subprocess.run([str(cuobjdump), "--dump-sass", f.name], capture_output=True,
                                          text=True).stdout
                reg = re.search(r"REG:(\d+)", usage)
                stack = re.search(r"STACK:(\d+)", usage)
                print(json.dumps(dict(kernel=name, rows=c.get("ROWS"), warps=w,
                                      registers=int(reg.group(1)) if reg else None,
                                      stack_bytes=int(stack.group(1)) if stack else None,
                                      shared_kb=round(comp.metadata.shared / 1024, 1),
                                      sass_instructions=len(re.findall(r"/\*[0-9a-f]{4,}\*/\s+[A-Z@]", sass)))),
                      flush=True)


if __name__ == "__main__":
    main()

"""Compile the MLA quantization kernel's launches (``fp8attn.mla._quant``: amax and quantize passes, with and
without Q, with the saturation count) for sm_90a without a GPU and print one line per launch: its passes,
cuobjdump's resource usage (registers, stack, local memory: spills) and the PTX's floating-point divisions
(there should be none: the kernel multiplies by reciprocals taken outside it, which keeps its bits equal to
the torch form's). Usage (repo root): ``python tools/aot_mla_sm90.py``.
"""

from __future__ import annotations

import os
import re
import sys

os.environ["TRITON_INTERPRET"] = "0"
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import aot_paged_sm90 as aot  # noqa: E402
import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402

from fp8attn import mla  # noqa: E402
from fp8attn.kernels import mla_quant  # noqa: E402


def main():
    cap = aot._Capture(mla_quant._mla_quant_kernel)
    mla_quant._mla_quant_kernel = cap
    T, H, bf = 4096, 128, torch.bfloat16
    parts = [torch.zeros(T, H, d, dtype=bf) for d in (128, 64, 128)] + [
        torch.zeros(T, 64, dtype=bf),
        torch.zeros(T, H, 128, dtype=bf),
    ]
    qn, qp, kn, kp, v = parts
    mla._quant(qn, qp, kn, kp, v, use_triton=True)  # captured: nothing runs
    mla._quant(None, None, kn, kp, v, use_triton=True)
    mla._quant(None, None, kn, kp, v, ds=torch.ones(3), count=True, use_triton=True)
    for _, args, kwargs in cap.calls:
        sig, consts, attrs, opts = aot._specialize(cap.fn, args, kwargs)
        k = triton.compile(
            triton.compiler.ASTSource(fn=cap.fn, signature=sig, constexprs=consts, attrs=attrs),
            target=GPUTarget("cuda", 90, 32),
            options=opts,
        )
        flags = " ".join(f"{n}={int(kwargs[n])}" for n in ("HAS_Q", "AMAX", "QUANT", "COUNT"))
        res, _ = aot._res_usage(k.asm["cubin"])
        divs = sorted(set(re.findall(r"\bdiv\.[\w.]+", k.asm["ptx"])))
        print(f"mla_quant {flags} res: {res} div: {','.join(divs) or 'none'}")


if __name__ == "__main__":
    main()

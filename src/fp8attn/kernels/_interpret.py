"""Work-arounds for triton 3.6's CPU interpreter (TRITON_INTERPRET=1), applied once by kernels/common.

Compiled kernels never see this module's effects.
"""
import torch
import triton.language as tl


def _interpreter_compat():
    """Work around four defects of triton 3.6's CPU interpreter (TRITON_INTERPRET=1 only).

    1. Scalars (program ids, scalar arguments) are 1-element 1-d numpy arrays converted with
       ``int(array)``, which numpy >= 2.4 rejects: any ``range()`` bound computed from a program id
       fails. Convert through ``reshape(-1)[0]``.
    2. Float -> e4m3 casts drop the rounding carry (7.99 -> 4 instead of 8), so a kernel's FP8 P
       would be compared against the wrong numbers. Use torch's round-to-nearest-even cast after
       the saturating clamp the GPU's ``cvt.satfinite`` applies.
    3. ``tl.dot`` of bf16 operands multiplies the raw uint16 bit patterns. Widen them to fp32 first.
    4. fp32 -> bf16 casts truncate (1 + 2**-8 + 2**-10 -> 1.0); the GPU rounds to nearest even. The
       truncation biases every bf16 product operand toward zero (the backward's P and dS: gradients
       came out ~0.5% small). Use torch's round-to-nearest-even cast.

    Compiled kernels are unaffected. Idempotent.
    """
    import numpy as np
    from triton.runtime import interpreter as _ti

    if getattr(_ti, "_fp8attn_compat", False):
        return
    _ti._fp8attn_compat = True

    orig_patch = _ti._patch_lang_tensor

    def patch_lang_tensor(tensor, scope):
        orig_patch(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    _ti._patch_lang_tensor = patch_lang_tensor

    builder = _ti.InterpreterBuilder
    orig_fp_to_fp = builder.create_fp_to_fp

    def create_fp_to_fp(self, src, dst_type, rounding_mode):
        if dst_type.scalar == tl.float8e4nv and src.dtype.scalar in (tl.float32, tl.float16):
            x = torch.from_numpy(np.ascontiguousarray(src.data).astype(np.float32))
            y = x.clamp(-448.0, 448.0).to(torch.float8_e4m3fn).view(torch.uint8).numpy()
            return _ti.TensorHandle(y.reshape(src.data.shape), dst_type.scalar)
        return orig_fp_to_fp(self, src, dst_type, rounding_mode)

    builder.create_fp_to_fp = create_fp_to_fp
    orig_dot = builder.create_dot

    def _widen(h):
        if h.dtype.scalar == tl.bfloat16:
            data = (h.data.astype(np.uint32) << 16).view(np.float32)
            return _ti.TensorHandle(data, tl.float32)
        return h

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        return orig_dot(self, _widen(a), _widen(b), d, input_precision, max_num_imprecise_acc)

    builder.create_dot = create_dot
    orig_trunc = builder.create_fp_trunc

    def create_fp_trunc(self, src, dst_type):
        if dst_type.scalar == tl.bfloat16 and src.dtype.scalar == tl.float32:
            x = torch.from_numpy(np.ascontiguousarray(src.data))
            y = x.to(torch.bfloat16).view(torch.uint16).numpy()
            return _ti.TensorHandle(y.reshape(src.data.shape), tl.bfloat16)
        return orig_trunc(self, src, dst_type)

    builder.create_fp_trunc = create_fp_trunc

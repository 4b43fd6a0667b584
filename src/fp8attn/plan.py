"""Eager call plans: what a validated, dispatched call reduces to, cached per call signature.

Most users call attention eagerly, once per layer per step, with the same shapes every step. The first
call of a signature runs the whole public path (validation, the op, the kernel dispatch rule); when that
call could be served by one kernel launch with no data-dependent decision in between, the path leaves a
*plan*: a small function that allocates the outputs and launches the kernel directly. Later calls with
the same signature run the plan.

A signature holds everything the validation and the dispatch rule read, so equal signatures pass and
dispatch alike: every tensor's shape, strides, dtype, device and 16-byte alignment, every Python
argument, and the environment switches the dispatch reads. What no signature holds -- tensor values --
is never checked on a GPU without ``validate=True`` on either path, so a plan changes no behaviour. Plans
are only used for eager calls of plain tensors outside torch.compile, tracing, torch-function or dispatch
modes and functorch transforms, and never when an input requires grad (such a call records its backward
through the op).

A plan's launches are recorded on its first call and replayed on later ones (``kernels.replay``): the
signature fixes every launch argument but the tensors' addresses, so the launcher's rules and triton's
argument binding run once per signature. A call whose launches cannot be replayed keeps the launcher.
"""

from __future__ import annotations

import os

import torch

from .kernels.planning import dense_out_shapes

__all__ = [
    "Launches",
    "plannable",
    "call_key",
    "tensor_sig",
    "env_sig",
    "lookup",
    "cached",
    "store",
    "obtain",
    "no_plan",
    "eager_ok",
    "clear",
    "dense_tma_plan",
    "dense_bwd_plan",
    "paged_plan",
    "dense_plan",
    "write_kv_plan",
    "quantize_plan",
    "ENV_SWITCHES",
    "MAX_PLANS",
]

# environment switches the dispatch reads (a plan made under one value never serves another)
ENV_SWITCHES = (
    "FP8ATTN_DENSE_BACKEND",
    "FP8ATTN_FORCE_REFERENCE",
    "FP8ATTN_FALLBACK",
    "FP8ATTN_TMA_QK192",
    "FP8ATTN_BWD_BACKEND",
)
MAX_PLANS = 1024

_PLANS: dict = {}


def plannable(q, validate, causal, return_lse, flag, window_size) -> bool:
    """Whether a call's signature may select a plan: a CUDA call without ``validate=True`` whose flags
    (``causal``, ``return_lse`` and a third, ``flag``) are plain bools and whose window is a pair of plain
    ints (as keys ``1 == 1.0 == True``, so other types take the checked path, which refuses or accepts them)."""
    return (
        validate is False
        and type(q) is torch.Tensor
        and q.is_cuda
        and type(causal) is bool
        and type(return_lse) is bool
        and type(flag) is bool
        and type(window_size) is tuple
        and len(window_size) == 2
        and type(window_size[0]) is int
        and type(window_size[1]) is int
    )


def call_key(kind, tensors, args) -> tuple:
    """The signature of a call: its ``kind``, the environment switches, every tensor's ``tensor_sig`` and the
    Python arguments ``args`` with their types (``1 == 1.0 == True`` as dict keys; the checked path tells
    them apart)."""
    # (``tensor_sig`` spelled inline for plain tensors and None: a function call per tensor is a measurable
    # part of a planned call's host time)
    T = torch.Tensor
    return (
        kind,
        env_sig(),
        *[
            None
            if t is None
            else (t.shape, t.stride(), t.dtype, t.device, t.data_ptr() % 16)
            if type(t) is T
            else tensor_sig(t)
            for t in tensors
        ],
        *args,
        *map(type, args),
    )


def tensor_sig(t):
    """The part of a tensor the validation and dispatch read: shape, strides, dtype, device, alignment.
    (``call_key`` spells it inline for plain tensors; tests/core/test_plan_keys.py holds the two equal.)"""
    if t is None:
        return None
    if not isinstance(t, torch.Tensor):  # (the checked path refuses it: a key that is never stored)
        return ("not a tensor", type(t))
    return (t.shape, t.stride(), t.dtype, t.device, t.data_ptr() % 16)


def _environ_data() -> tuple[dict, tuple] | None:
    """``os.environ``'s own dict of encoded names and values, with the encoded ``ENV_SWITCHES``, or None
    where this Python's ``os.environ`` has none. Reading it skips the str encoding and the KeyError that
    ``os.environ.get`` pays for each unset name, on every planned call."""
    env = os.environ
    data, encode = getattr(env, "_data", None), getattr(env, "encodekey", None)
    if not isinstance(data, dict) or encode is None:
        return None
    return data, tuple(encode(k) for k in ENV_SWITCHES)


_ENV = _environ_data()


def env_sig() -> tuple:
    """The values of ``ENV_SWITCHES`` now (encoded where ``os.environ`` stores them so; equality is all a key
    needs)."""
    # (os.environ updates its dict in place: the same object while nothing replaced os.environ)
    if _ENV is not None and getattr(os.environ, "_data", None) is _ENV[0]:
        data, keys = _ENV
        return tuple(map(data.get, keys))
    return tuple(map(os.environ.get, ENV_SWITCHES))


def eager_ok(*ts) -> bool:
    """Whether a call may take a plan: eager, plain CUDA tensors, nothing recording or transforming it."""
    if torch.compiler.is_compiling() or torch._C._len_torch_function_stack() or torch._C._len_torch_dispatch_stack():
        return False
    if torch._C._functorch.peek_interpreter_stack() is not None or torch._C._get_tracing_state() is not None:
        return False
    grad = torch.is_grad_enabled()
    for t in ts:
        if t is not None and (type(t) is not torch.Tensor or (grad and t.requires_grad)):
            return False
    return True


def lookup(key):
    """The plan of ``key``, or None (also for a key holding an unhashable argument: the checked path
    then names the argument)."""
    try:
        return _PLANS.get(key)
    except TypeError:
        return None


def cached(key, tensors):
    """The plan of ``key`` when this call may take it (``eager_ok``), else None."""
    run = lookup(key)
    if run is not None and eager_ok(*tensors):
        return run
    return None


def find(kind, tensors, args):
    """``(key, plan)``: the ``call_key`` of a call and the stored plan it may take (``cached``), or None.
    Under torch.compile ``(None, None)``, before any tensor's address is read (dynamo cannot trace that, and a
    compiled call takes no plan)."""
    if torch.compiler.is_compiling():
        return None, None
    key = call_key(kind, tensors, args)
    return key, cached(key, tensors)


def no_plan(*args):
    """What a signature that takes no plan keeps (``obtain``): its checks then run once, not on every call."""
    return None


def obtain(kind, tensors, args, build):
    """The plan of a call: the one stored for its ``call_key``, else ``build()``'s, stored (a None as ``no_plan``).
    None where the call takes none: compiled or traced (``find``), not ``eager_ok``, or a planless signature."""
    key, run = find(kind, tensors, args)
    if run is None:
        if key is None or not eager_ok(*tensors):
            return None
        run = build() or no_plan
        store(key, run)
    return None if run is no_plan else run


def store(key, plan) -> None:
    if len(_PLANS) >= MAX_PLANS:  # a workload with unbounded signatures: start over rather than grow
        _PLANS.clear()
    try:
        _PLANS[key] = plan
    except TypeError:
        pass


def clear() -> None:
    """Forget every plan (tests; a process that changed what a plan captured, e.g. the current device's
    properties)."""
    _PLANS.clear()


class Launches:
    """The launch part of a plan: ``fn(*slots)`` (a launcher call whose tensors are ``slots``, inputs and
    outputs, None where absent) recorded on a call and replayed after (``kernels.replay``). A refused
    recording is tried again on the next calls, up to ``RECORD_TRIES`` in all (a first call may autotune)."""

    __slots__ = ("fn", "replay", "tries")
    RECORD_TRIES = 3

    def __init__(self, fn):
        self.fn, self.replay, self.tries = fn, None, 0

    def __call__(self, *slots) -> tuple:
        """Launch; returns ``fn``'s result as a tuple (``()`` for None, ``(t,)`` for one tensor)."""
        rp = self.replay
        if rp is not None:
            out = rp.run(slots)
            if out is not None:
                return out
        from .kernels import replay

        if rp is not None or self.tries >= self.RECORD_TRIES:
            return replay.as_tuple(self.fn(*slots))
        self.tries += 1
        result, self.replay = replay.record(lambda: self.fn(*slots), slots)
        return replay.as_tuple(result)


def _descales(qd, kd, vd, batch, nheads_k, device) -> dict:
    """The q/k/v descale keywords of a launcher: each as FA3's (batch, nheads_k) float32 view."""
    from .quant import expand_descale

    return {
        "q_descale": expand_descale(qd, batch, nheads_k, device),
        "k_descale": expand_descale(kd, batch, nheads_k, device),
        "v_descale": expand_descale(vd, batch, nheads_k, device),
    }


def _output_alloc(q, v, varlen, out_dtype, out_scale, return_lse):
    """A plan's per-call outputs, ``alloc(out) -> (o, lse)``: ``out``, or a new tensor of the call's output
    shape and dtype (which the signature fixes: q's dtype, out_dtype, whether out_scale is given), and a new
    float32 LSE when the call returns one."""
    from .kernels.planning import attention_out_dtype

    oshape, lse_shape = dense_out_shapes(q, v, varlen)
    odt = attention_out_dtype(q.dtype, out_dtype, out_scale)
    dev = q.device

    def alloc(out):
        o = out if out is not None else torch.empty(oshape, dtype=odt, device=dev)
        return o, (torch.empty(lse_shape, dtype=torch.float32, device=dev) if return_lse else None)

    return alloc


def dense_tma_plan(
    q, k, v, qd, kd, vd, out, out_scale, *, softmax_scale, causal, window_size, softcap, out_dtype, return_lse
):
    """The plan of a dense (4-D) FP8 call that the Hopper kernel serves with one launch, or None.

    Called by the public path after validation, with its expanded descales; ``None`` when the call needs
    anything else (a V transpose, the Triton kernel, the reference, a fallback report)."""
    if not q.is_cuda or q.dtype != torch.float8_e4m3fn:
        return None
    from .capability import kernel_for

    if kernel_for(q, "dense") is None:
        return None
    from .kernels import dense as kd_
    from .kernels.hopper import dense_launch
    from .kernels.planning import window_flags

    backend = kd_.dense_backend()
    if backend == "triton" or kd_.wants_kmajor_copy(v, True, None, True):
        return None
    alloc = _output_alloc(q, v, False, out_dtype, out_scale, return_lse)
    b, sq, hq, _ = q.shape
    probe_out, probe_lse = alloc(out)
    why = kd_.tma_reason(
        q,
        k,
        v,
        probe_out,
        probe_lse,
        causal=causal,
        window_size=window_size,
        softcap=softcap,
        q_descale=qd,
        k_descale=kd,
        v_descale=vd,
        out_scale=out_scale,
        cu_seqlens_q=None,
        cu_seqlens_k=None,
        seqused_q=None,
        seqused_k=None,
        max_seqlen_q=None,
        descale_block_q=None,
        descale_block_k=None,
        backend=backend,
    )
    if why is not None:
        return None
    from .capability import launch_device

    hk = k.shape[2]
    kernel_causal = window_flags(causal, window_size)[0]
    launch = dense_launch.launch_dense_fwd_tma
    dev = q.device

    def launch_(q, k, v, q_descale, k_descale, v_descale, out_scale, o, lse):
        launch(
            q,
            k,
            v,
            o,
            lse,
            softmax_scale=softmax_scale,
            causal=kernel_causal,
            **_descales(q_descale, k_descale, v_descale, b, hk, dev),
            out_scale=out_scale,
        )

    launches = Launches(launch_)

    def run(q, k, v, q_descale, k_descale, v_descale, out, out_scale):
        o, lse = alloc(out)
        with launch_device(q):
            launches(q, k, v, q_descale, k_descale, v_descale, out_scale, o, lse)
        return (o, lse) if return_lse else o

    run.launches = launches  # type: ignore[attr-defined]
    return run


def dense_bwd_plan(do, q, k, v, out, lse, qd, kd, vd, *, softmax_scale, causal, window_size, softcap, mode, grad_dtype):
    """The plan of a dense (4-D) attention backward that the Hopper backward kernel serves, or None.

    Its launches (the preprocess, which also zeroes the kernel's dQ accumulator; in the fp8 mode the e4m3
    operands; the kernel; dQ's conversion into a dq of ``grad_dtype``) are recorded on the first call and
    replayed after. ``run(do, q, k, v, out, lse, qd, kd, vd) -> (dq, dk, dv)``, new gradients of q's, k's and v's
    shapes in ``grad_dtype``: what ``fp8attn::dense_bwd`` returns for the call (no per-block descales, no
    ``deterministic``). None where the call needs anything else (varlen, a window or softcap, the Triton kernels,
    the reference, a fallback report)."""
    if not q.is_cuda or q.dtype not in (torch.float8_e4m3fn, torch.bfloat16, torch.float16):
        return None
    from .capability import kernel_for, launch_device

    launch = kernel_for(q, "backward")
    if launch is None:
        return None
    from .kernels import backward as kb
    from .kernels.hopper import backward_launch
    from .kernels.planning import window_flags

    kernel_causal, wl, wr, has_window = window_flags(causal, window_size)
    dev = q.device

    def alloc():
        return tuple(torch.empty(t.shape, dtype=grad_dtype, device=dev) for t in (q, k, v))

    why = backward_launch.bwd_unsupported_reason(
        do,
        q,
        k,
        v,
        *alloc(),
        varlen=False,
        mode=mode,
        deterministic=False,
        window=has_window,
        softcap=float(softcap) != 0.0,
    )
    if why is not None or kb.bwd_backend() == "triton":
        return None
    scale, cap = float(softmax_scale), float(softcap)

    def launch_(do, q, k, v, out, lse, q_descale, k_descale, v_descale, dq, dk, dv):
        launch(
            do,
            q,
            k,
            v,
            out,
            lse,
            dq,
            dk,
            dv,
            q_descale=q_descale,
            k_descale=k_descale,
            v_descale=v_descale,
            softmax_scale=scale,
            causal=kernel_causal,
            window_left=wl,
            window_right=wr,
            softcap=cap,
            mode=mode,
            deterministic=False,
        )

    launches = Launches(launch_)

    def run(do, q, k, v, out, lse, q_descale, k_descale, v_descale):
        dq, dk, dv = alloc()
        with launch_device(q):
            launches(do, q, k, v, out, lse, q_descale, k_descale, v_descale, dq, dk, dv)
        return dq, dk, dv

    run.launches = launches  # type: ignore[attr-defined]
    return run


def paged_plan(q, k_cache, cu_seqlens_q, max_seqlen_q, v_cache, *, batch, attn, num_splits, return_lse, append=False):
    """The plan of a paged-cache call (decode, chunked prefill over the cache), or None.

    ``attn``: the validated attention keywords (softmax_scale, causal, window_size, softcap, out_dtype,
    out_scale). The plan launches the paged kernel as the op would, with the call's tensors. ``append``: the
    call also appends fixed-length new tokens (its ``k`` and ``v``, after the other tensors): the append
    kernel writes them and the lengths after them, which the attention reads, as the checked path does."""
    if not q.is_cuda:
        return None
    from .capability import kernel_for, launch_device

    launch = kernel_for(q, "paged")
    appender = kernel_for(q, "append") if append else None
    if launch is None or (append and appender is None):
        return None
    varlen = cu_seqlens_q is not None
    alloc = _output_alloc(q, v_cache, varlen, attn["out_dtype"], attn["out_scale"], return_lse)
    msq = max_seqlen_q if max_seqlen_q is not None else (q.shape[0] if varlen else q.shape[1])
    hk = k_cache.shape[2]
    dev = q.device
    window = (int(attn["window_size"][0]), int(attn["window_size"][1]))
    kw = dict(
        max_seqlen_q=msq,
        softmax_scale=float(attn["softmax_scale"]),
        causal=bool(attn["causal"]),
        window_size=window,
        softcap=float(attn["softcap"]),
        num_splits=int(num_splits),
    )

    def launch_(*slots):
        q, k_cache, v_cache, page_table, cache_seqlens, cu_seqlens_q, qd, kd, vd, ks, vs, out_scale, o, lse = slots[:14]
        if append:
            k, v = slots[14:]
            dk = _descales(qd, kd, vd, batch, hk, dev)
            assert appender is not None
            cache_seqlens = appender(
                k,
                v,
                k_cache,
                v_cache,
                page_table,
                cache_seqlens,
                None,
                k_descale=dk["k_descale"] if kd is not None else None,
                v_descale=dk["v_descale"] if vd is not None else None,
                k_cache_scales=ks,
                v_cache_scales=vs,
            )
        launch(
            q,
            k_cache,
            v_cache,
            page_table,
            cache_seqlens,
            o,
            lse,
            cu_seqlens_q=cu_seqlens_q,
            **_descales(qd, kd, vd, batch, hk, dev),
            k_cache_scales=ks,
            v_cache_scales=vs,
            out_scale=out_scale,
            out_partial=None,
            lse_partial=None,
            **kw,
        )

    launches = Launches(launch_)

    def run(
        q,
        k_cache,
        v_cache,
        page_table,
        cache_seqlens,
        cu_seqlens_q,
        q_descale,
        k_descale,
        v_descale,
        k_cache_scales,
        v_cache_scales,
        out,
        out_scale,
        *new,
    ):
        o, lse = alloc(out)
        with launch_device(q):
            launches(
                q,
                k_cache,
                v_cache,
                page_table,
                cache_seqlens,
                cu_seqlens_q,
                q_descale,
                k_descale,
                v_descale,
                k_cache_scales,
                v_cache_scales,
                out_scale,
                o,
                lse,
                *new,
            )
        return (o, lse) if return_lse else o

    run.launches = launches  # type: ignore[attr-defined]
    return run


def dense_plan(q, k, v, *, batch, attn, varlen, max_seqlen_q=None, max_seqlen_k=None, return_lse):
    """The plan of a dense or varlen call on the kernel path that ``dense_tma_plan`` does not take: the
    kernel-level launcher (``kernels.dense.launch_dense_fwd``, which keeps its own choice of kernel and any
    V transpose) called with the validated arguments, or None (the reference path)."""
    if not q.is_cuda:
        return None
    from .capability import kernel_for, launch_device

    launch = kernel_for(q, "dense")
    if launch is None:
        return None
    alloc = _output_alloc(q, v, varlen, attn["out_dtype"], attn["out_scale"], return_lse)
    hk = k.shape[-2]
    dev = q.device
    kw = dict(
        softmax_scale=float(attn["softmax_scale"]),
        causal=bool(attn["causal"]),
        window_size=(int(attn["window_size"][0]), int(attn["window_size"][1])),
        softcap=float(attn["softcap"]),
        max_seqlen_q=max_seqlen_q,
        max_seqlen_k=max_seqlen_k,
        pack_gqa=bool(attn.get("pack_gqa")),
        descale_block_q=None,
        descale_block_k=None,
    )

    def launch_(q, k, v, qd, kd, vd, out_scale, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, o, lse):
        launch(
            q,
            k,
            v,
            o,
            lse,
            **_descales(qd, kd, vd, batch, hk, dev),
            out_scale=out_scale,
            cu_seqlens_q=cu_seqlens_q,
            cu_seqlens_k=cu_seqlens_k,
            seqused_q=seqused_q,
            seqused_k=seqused_k,
            **kw,
        )

    launches = Launches(launch_)

    def run(
        q,
        k,
        v,
        q_descale,
        k_descale,
        v_descale,
        out,
        out_scale,
        cu_seqlens_q=None,
        cu_seqlens_k=None,
        seqused_q=None,
        seqused_k=None,
    ):
        o, lse = alloc(out)
        with launch_device(q):
            launches(
                q,
                k,
                v,
                q_descale,
                k_descale,
                v_descale,
                out_scale,
                cu_seqlens_q,
                cu_seqlens_k,
                seqused_q,
                seqused_k,
                o,
                lse,
            )
        return (o, lse) if return_lse else o

    run.launches = launches  # type: ignore[attr-defined]
    return run


def write_kv_plan(k):
    """The plan of a validated ``write_kv_cache`` call on the cache kernel, or None (the torch path). The
    plan's function takes the call's ten tensors in ``write_kv_cache``'s order and returns nothing."""
    from .capability import kernel_for, launch_device

    launch = kernel_for(k, "cache")
    if launch is None:
        return None

    def launch_(k, v, k_cache, v_cache, slot_mapping, kd, vd, token_seq_idx, ks, vs):
        launch(
            k,
            v,
            k_cache,
            v_cache,
            slot_mapping,
            k_descale=kd,
            v_descale=vd,
            token_seq_idx=token_seq_idx,
            k_cache_scales=ks,
            v_cache_scales=vs,
        )

    launches = Launches(launch_)

    def run(*tensors):
        with launch_device(tensors[0]):
            launches(*tensors)

    run.launches = launches  # type: ignore[attr-defined]
    return run


def quantize_plan(q, k, granularity, nheads_k, rotate, seed, block_t, v_seq_major):
    """The plan of a validated ``quantize_qkv`` call on the Triton kernels: ``run(q, k, v)`` returns its
    ``(q8, k8, v8, q_descale, k_descale, v_descale)``. The quantized tensors and descales are allocated by
    the launches, so a replayed call returns new memory of the recorded shapes and layouts."""
    from .capability import launch_device
    from .quant import _triton_path, triton_qkv

    vg = "per_head" if granularity == "per_block" else granularity
    b = q.shape[0] if q.dim() == 4 else 1

    def launch_(q, k, v):
        # one launch for the three where every scale group is small (the three launches' bits), else three
        fused = triton_qkv(q, k, v, granularity, nheads_k, rotate, seed, block_t, v_seq_major)
        if fused is None:
            q8, qd = _triton_path(q, granularity, nheads_k, rotate, seed, block_t)
            k8, kd = _triton_path(k, granularity, nheads_k, rotate, seed, block_t)
            v8, vd = _triton_path(v, vg, nheads_k, False, seed, 64, seq_major=v_seq_major)
            fused = q8, k8, v8, qd, kd, vd
        if granularity == "per_tensor":  # one descale, as a stride-0 (batch, nheads_k) view (replayed as one)
            fused = (*fused[:3], *(d.expand(b, nheads_k) for d in fused[3:]))
        return fused

    launches = Launches(launch_)

    def run(q, k, v):
        with launch_device(q):
            return launches(q, k, v)

    run.launches = launches  # type: ignore[attr-defined]
    return run

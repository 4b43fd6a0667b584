"""kernels.replay's recording rules on the CPU, with a stand-in for triton's compiled kernel (its launcher
is the one thing a CPU cannot run): what a replay passes, and every case where it must refuse to exist."""

import pytest
import torch
import triton

from fp8attn.kernels import replay


def _body(x_ptr, y_ptr, n, scale, BLOCK: triton.language.constexpr, MODE: triton.language.constexpr = 3):
    pass


class _Compiled:
    """What ``kernel[grid](...)`` returns: the launcher ``run`` and the handles it is called with."""

    function, packed_metadata = "fn-handle", "metadata"

    def __init__(self, log):
        self.log = log

    def run(self, g0, g1, g2, stream, function, packed, launch_md, enter, exit_, *args):
        self.log.append(((g0, g1, g2), args))


@pytest.fixture
def kernel(monkeypatch):
    """A real JITFunction whose JIT launch returns the stand-in (and fires the launch hook, as triton's
    launcher does); the driver's stream lookup answers without a GPU."""
    jf = triton.runtime.JITFunction(_body)
    log: list = []
    ck = _Compiled(log)

    def run(*args, grid, warmup, **kwargs):
        hook = triton.knobs.runtime.launch_enter_hook
        if hook is not None:
            hook(None)
        log.append(("jit", grid, args, kwargs))
        return ck

    jf.run = run

    class _Driver:
        def get_current_device(self):
            return 0

        def get_current_stream(self, dev):
            return 7

    monkeypatch.setattr(triton.runtime.driver, "_active", _Driver())
    monkeypatch.setattr(replay, "SUPPORTED", True)
    return jf, log


def _launcher(jf, n=64):
    def fn(x, y):
        scratch = torch.empty(n, dtype=torch.float32)  # per-call scratch: re-allocated on replay
        replay.launch(jf, (4, 2), x, scratch, n, 0.5, BLOCK=32)
        # a grid function sees the bound arguments, as triton's launch does
        replay.launch(jf, lambda meta: (meta["n"] // meta["BLOCK"],), scratch, y.t(), n, 0.25, BLOCK=16, MODE=1)

    return fn


def test_replay_passes_the_new_tensors_and_the_recorded_rest(kernel):
    jf, log = kernel
    x, y = torch.randn(64), torch.randn(8, 8)
    _, rp = replay.record(lambda: _launcher(jf)(x, y), (x, y))
    assert rp is not None
    assert [e[0] for e in log] == ["jit", "jit"]
    # the replay keeps no tensor of the recorded call (it would pin their memory)
    assert not any(replay._holds_tensor(v) for _, _, values, *_ in rp.entries for v in values)
    log.clear()
    x2, y2 = torch.randn(64), torch.randn(8, 8)
    assert rp.run((x2, y2)) == ()
    (g1, a1), (g2, a2) = log
    assert g1 == (4, 2, 1) and g2 == (4, 1, 1)
    assert a1[0] is x2 and a1[2:] == (64, 0.5, 32, 3)  # constexprs in signature order, the default filled in
    assert a2[1] is y2 and a2[2:] == (64, 0.25, 16, 1)  # (a view is replaced by its slot: same address)
    assert a1[1] is a2[0] and a1[1].shape == (64,) and a1[1].dtype == torch.float32  # one fresh scratch


def test_replay_with_a_registered_constant(kernel):
    jf, log = kernel
    one = replay.constant(torch.ones(()))
    x = torch.randn(64)
    _, rp = replay.record(lambda: [replay.launch(jf, (1,), x, one.expand(4), 1, 1.0, BLOCK=8)] and None, (x,))
    assert rp is not None
    log.clear()
    x2 = torch.randn(64)
    assert rp.run((x2,)) == () and log[0][1][1] is one


@pytest.mark.parametrize(
    "case",
    ["torch op", "unknown memory", "unrecorded launch", "hooks installed", "no launch"],
)
def test_recording_refused(kernel, case, monkeypatch):
    jf, log = kernel
    x, y = torch.randn(64), torch.randn(64)
    other = torch.randn(64)  # not a slot, not allocated during the call, not a constant

    def fn():
        if case == "torch op":
            y.add_(1)  # work the replay would skip
        if case == "unrecorded launch":
            triton.knobs.runtime.launch_enter_hook(None)  # a launch made without replay.launch
        if case == "no launch":
            return
        arg = other if case == "unknown memory" else y
        replay.launch(jf, (1,), x, arg, 1, 1.0, BLOCK=8)

    if case == "hooks installed":
        monkeypatch.setattr(triton.knobs.runtime, "launch_enter_hook", lambda *a: None)
    chain = triton.knobs.runtime.launch_enter_hook
    before = list(getattr(chain, "calls", []))
    _, rp = replay.record(fn, (x, y))
    assert rp is None
    assert list(getattr(chain, "calls", [])) == before  # the recording's counter is gone


def test_an_address_allocated_twice_names_its_latest_buffer(kernel, monkeypatch):
    """A buffer freed during the call and its address handed to the next allocation (a scratch, then an
    output): each launch replays with a buffer of its own allocation, and the result is the second one.
    (The allocator's reuse of the address is stood in for by an alias counted as an allocation.)"""
    jf, log = kernel
    alias = torch.ops.aten.alias.default
    monkeypatch.setattr(replay, "_ALLOC", replay._ALLOC | {alias})
    x = torch.randn(64)

    def fn():
        a = torch.empty(256)
        replay.launch(jf, (1,), x, a, 1, 1.0, BLOCK=8)
        b = alias(a)  # a second allocation at a's address
        replay.launch(jf, (1,), b, x, 1, 1.0, BLOCK=8)
        return b

    _, rp = replay.record(fn, (x,))
    assert rp is not None and len(rp.allocs) == 2
    log.clear()
    x2 = torch.randn(64)
    (out,) = rp.run((x2,))
    (_, a1), (_, a2) = log
    assert a1[0] is x2 and a2[1] is x2
    assert a2[0] is out and a1[1] is not out and a1[1].shape == out.shape == (256,)


def test_aliased_slots_replay_only_while_aliased(kernel):
    jf, log = kernel
    d = torch.rand(4)
    x = torch.randn(64)

    def fn(x, kd, vd):
        replay.launch(jf, (1,), x, kd, 1, 1.0, BLOCK=8)
        replay.launch(jf, (1,), x, vd, 1, 1.0, BLOCK=8)

    _, rp = replay.record(lambda: fn(x, d, d), (x, d, d))
    assert rp is not None
    log.clear()
    kd, vd = torch.rand(4), torch.rand(4)
    assert rp.run((x, kd, vd)) is None and not log  # k and v descales no longer one tensor: nothing launched
    assert rp.run((x, kd, kd)) is not None and len(log) == 2


def test_replay_not_run_under_launch_hooks(kernel, monkeypatch):
    jf, log = kernel
    x, y = torch.randn(64), torch.randn(8, 8)
    _, rp = replay.record(lambda: _launcher(jf)(x, y), (x, y))
    log.clear()
    monkeypatch.setattr(triton.knobs.runtime, "launch_enter_hook", lambda *a: None)
    assert rp.run((x, y)) is None and not log  # a profiler sees the launches: the caller's launcher runs


def test_replay_rebuilds_the_result_on_the_new_call(kernel):
    """A launcher that allocates and returns its outputs: the replay returns fresh memory of the same
    shapes and views (an expanded view included), and the caller's own output tensors where it passed them."""
    jf, log = kernel

    def fn(x, out):
        y = torch.empty(64, dtype=torch.float16)
        d = torch.empty(4)
        replay.launch(jf, (1,), x, y, 1, 1.0, BLOCK=8)
        replay.launch(jf, (1,), y, d, 1, 1.0, BLOCK=8)
        replay.launch(jf, (1,), x, out, 1, 1.0, BLOCK=8)
        return y, d.expand(3, 4), None, out

    x, out = torch.randn(64), torch.empty(8)
    res, rp = replay.record(lambda: fn(x, out), (x, out))
    assert rp is not None
    log.clear()
    x2, out2 = torch.randn(64), torch.empty(8)
    y, d, none, o = rp.run((x2, out2))
    assert none is None and o is out2
    assert y.shape == (64,) and y.dtype == torch.float16 and y.data_ptr() != res[0].data_ptr()
    assert d.shape == (3, 4) and d.stride() == (0, 1)
    (_, a1), (_, a2), (_, a3) = log
    assert a1[1] is y and a2[0] is y and a2[1].data_ptr() == d.data_ptr() and a3[1] is out2


def test_result_of_unknown_origin_refused(kernel):
    jf, _ = kernel
    x, kept = torch.randn(64), torch.randn(4)
    res, rp = replay.record(lambda: (replay.launch(jf, (1,), x, x, 1, 1.0, BLOCK=8), kept)[1], (x,))
    assert rp is None and "neither an input nor memory the call allocated" in replay.last_refusal


def test_bundled_arguments_replay_with_the_new_tensors(kernel):
    """A kernel taking a tuple of pointers (a bundle): the replay rebuilds the tuple with the new call's
    tensors in their places and keeps the rest of it."""
    jf, log = kernel

    def fn(x, y):
        scratch = torch.empty(16)
        replay.launch(jf, (1,), (x, scratch, y), (3, 1), 2.0, 0.5, BLOCK=8)

    x, y = torch.randn(64), torch.randn(64)
    _, rp = replay.record(lambda: fn(x, y), (x, y))
    assert rp is not None
    log.clear()
    x2, y2 = torch.randn(64), torch.randn(64)
    assert rp.run((x2, y2)) is not None
    ((_, args),) = log
    ptrs = args[0]
    assert ptrs[0] is x2 and ptrs[2] is y2 and ptrs[1].shape == (16,) and args[1] == (3, 1)
    # a tensor two tuples deep is refused (the replay rebuilds one level)
    _, rp = replay.record(lambda: replay.launch(jf, (1,), ((x,),), 1, 1.0, 1.0, BLOCK=8), (x,))
    assert rp is None and "inside a tuple" in replay.last_refusal


class CudaLauncher:
    """Triton 3.6's launcher as a replay sees it (named as the real one): its ``__call__`` hands the C
    launcher (here ``log``'s stub) the same arguments, through triton's own tensor-descriptor wrapper."""

    global_scratch_size = profile_scratch_size = 0
    launch_cooperative_grid, launch_pdl = False, True

    def __init__(self, signature, tensordesc_meta, log):
        from triton.backends.nvidia.driver import wrap_handle_tensordesc

        self.launch = wrap_handle_tensordesc(lambda *a: log.append(a), signature, tensordesc_meta)

    def __call__(self, g0, g1, g2, stream, function, *args):
        self.launch(g0, g1, g2, stream, function, self.launch_cooperative_grid, self.launch_pdl, None, None, *args)


def _compiles_to(jf, launcher):
    """Make ``jf``'s JIT launch return a compiled kernel whose launcher is ``launcher`` (firing the launch
    hook, as triton's launch does)."""

    class _CK:
        function, packed_metadata, run = "fn-handle", "metadata", launcher

    def jit_run(*args, grid, warmup, **kwargs):
        triton.knobs.runtime.launch_enter_hook(None)
        return _CK()

    jf.run = jit_run


def _desc_body(x_ptr, desc, n, BLOCK: triton.language.constexpr):
    pass


@pytest.mark.parametrize("with_meta", [True, False])
def test_direct_launch_passes_what_the_launcher_would(kernel, monkeypatch, with_meta):
    """A replay through the compiled C launcher (skipping triton's Python wrapper) passes it the arguments
    the wrapper would: the TMA descriptor encoded from the new call's base address with the recorded
    metadata, shape and strides (or, without metadata, the descriptor's fields), the bundles rebuilt."""
    jf, _ = kernel
    djf = triton.runtime.JITFunction(_desc_body)
    c_log: list = []
    meta = {"swizzle": 3, "elem_size": 1, "elem_type": 9, "block_size": [64, 128], "fp4_padded": False}
    sig = {"x_ptr": "*fp8e4nv", "desc": "tensordesc<fp8e4nv[64, 128]>", "n": "i32", "BLOCK": "constexpr"}
    launcher = CudaLauncher(sig, [meta] if with_meta else None, c_log)
    _compiles_to(djf, launcher)

    class _Utils:
        @staticmethod
        def fill_tma_descriptor(ptr, *rest):
            return ("tensormap", ptr, *rest)

    monkeypatch.setattr(triton.runtime.driver.active, "utils", _Utils(), raising=False)

    def fn(x, y):
        replay.launch(djf, (3, 2), x, replay.HostDesc(y, [256, 128], [128, 1]), 7, BLOCK=16)

    x, y = torch.randn(64), torch.randn(256, 128)
    _, rp = replay.record(lambda: fn(x, y), (x, y))
    assert rp is not None and type(rp.entries[0]) is replay._Direct
    x2, y2 = torch.randn(64), torch.randn(256, 128)
    rp.run((x2, y2))
    direct = c_log.pop()
    launcher(
        3, 2, 1, 7, "fn-handle", "metadata", None, None, None, x2, replay.HostDesc(y2, [256, 128], [128, 1]), 7, 16
    )
    wrapped = c_log.pop()
    # the same arguments, each pointer as its address (the launcher reads an int as the address itself)
    assert direct == tuple(a.data_ptr() if isinstance(a, torch.Tensor) else a for a in wrapped)
    assert any(isinstance(a, torch.Tensor) for a in wrapped)
    assert not any(isinstance(a, torch.Tensor) for a in direct)
    assert direct[14][1] == y2.data_ptr() if with_meta else direct[14] == y2.data_ptr()


def _bundle_body(ptrs, c_ptr, n, BLOCK: triton.language.constexpr):
    pass


def test_direct_launch_bundles_and_constants_as_addresses(kernel, monkeypatch):
    """Through the C launcher, a bundle's tensors and a registered constant reach it as their addresses: the
    bundle rebuilt with the new call's tensors and this call's scratch, the constant's address fixed."""
    jf = triton.runtime.JITFunction(_bundle_body)
    c_log: list = []
    sig = {"ptrs": "(*fp32, *fp32, *fp32)", "c_ptr": "*fp32", "n": "i32", "BLOCK": "constexpr"}
    launcher = CudaLauncher(sig, None, c_log)

    class _CLauncher:  # (no tensor descriptor: triton's wrapper returns the C launcher itself, no Python code)
        def __call__(self, *a):
            c_log.append(a)

    launcher.launch = _CLauncher()
    _compiles_to(jf, launcher)
    const = replay.constant(torch.randn(8))

    def fn(x, y):
        scratch = torch.empty(16)
        replay.launch(jf, (2,), (x, scratch, y), const, 5, BLOCK=8)

    x, y = torch.randn(64), torch.randn(64)
    _, rp = replay.record(lambda: fn(x, y), (x, y))
    assert rp is not None and type(rp.entries[0]) is replay._Direct
    x2, y2 = torch.randn(64), torch.randn(64)
    rp.run((x2, y2))
    args = c_log.pop()[13:]  # (after the grid, stream, function, flags, metadata and hook slots)
    (px, pscratch, py), pc, n, block = args
    assert (px, py, pc, n, block) == (x2.data_ptr(), y2.data_ptr(), const.data_ptr(), 5, 8)
    assert isinstance(pscratch, int) and pscratch not in (0, x2.data_ptr(), y2.data_ptr(), const.data_ptr())


def test_views_carved_from_one_allocation_replay_at_their_offsets(kernel):
    """Outputs carved from one allocation (as quantize_qkv's are) replay as views of one new buffer at the
    recorded offsets and strides; a kernel given such a view gets its address (the buffer's plus the offset).
    A view whose dtype differs from its buffer's, or a descriptor on such a view, is refused."""
    jf, log = kernel

    def fn(x):
        buf = torch.empty(96)
        a, b = buf.as_strided((4, 8), (8, 1), 0), buf.as_strided((2, 16), (1, 2), 64)
        replay.launch(jf, (1,), x, b, 1, 1.0, BLOCK=8)
        return a, b

    x = torch.randn(64)
    _, rp = replay.record(lambda: fn(x), (x,))
    assert rp is not None
    log.clear()
    x2 = torch.randn(64)
    a2, b2 = rp.run((x2,))
    assert a2.untyped_storage().data_ptr() == b2.untyped_storage().data_ptr() != x2.data_ptr()
    assert (a2.shape, a2.stride(), a2.storage_offset()) == ((4, 8), (8, 1), 0)
    assert (b2.shape, b2.stride(), b2.storage_offset()) == ((2, 16), (1, 2), 64)
    ((_, args),) = log
    assert args[0] is x2 and args[1] == b2.data_ptr()

    def other_dtype(x):
        buf = torch.empty(96)
        replay.launch(jf, (1,), x, buf, 1, 1.0, BLOCK=8)
        return buf[8:].view(torch.int32)

    _, rp = replay.record(lambda: other_dtype(x), (x,))
    assert rp is None and "neither an input nor memory the call allocated" in replay.last_refusal

    def desc_on_view(x):
        buf = torch.empty(96)
        replay.launch(jf, (1,), x, replay.HostDesc(buf[32:], [64], [1]), 1, 1.0, BLOCK=8)

    _, rp = replay.record(lambda: desc_on_view(x), (x,))
    assert rp is None and "descriptor on a view into an allocation" in replay.last_refusal

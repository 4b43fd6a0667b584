"""Launch replay: the kernel launches of one call signature, recorded once, then replayed with new tensors.

An eager call pays, besides its kernels, the host work that derives their launch arguments (tile rules,
strides, grids) and triton's binding of those arguments to the compiled kernel (a specialization pass
over every argument). For calls whose signature fixes every launch argument except the tensors'
addresses -- an eager plan's signature does (``fp8attn.plan``) -- that work gives the same answer each
time. ``record`` runs a launcher once, keeping what each launch passed; ``Replay.run`` later calls the
same compiled kernels with the next call's tensors and nothing else.

Only launches made through ``launch`` are recorded. A recording is refused (``record`` returns no
replay, and the caller keeps its normal path) when anything but those launches reaches the GPU during
it: another triton launch (counted through triton's launch hook), a torch operation other than an
allocation or a view, a pointer argument that is neither one of the call's tensors, nor memory allocated
during the launch (re-allocated on replay), nor a registered constant; a triton version whose launcher
this module does not know; or launch hooks already installed (a profiler).
"""

from __future__ import annotations

import threading

import torch
import triton
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["launch", "record", "constant", "hooks_installed", "as_tuple", "HostDesc", "Replay", "SUPPORTED"]

# the compiled-kernel launcher's calling convention replayed here is triton 3.6's
SUPPORTED = triton.__version__.startswith("3.6.")

_STATE = threading.local()
last_refusal = ""  # why the last refused recording was refused (diagnostics, tests)
_CONSTANTS: dict = {}  # data_ptr -> tensor: persistent tensors kernels only read (``constant``)

_aten = torch.ops.aten
# torch operations a recorded call may run: allocations and views (nothing the replay would skip)
_ALLOC = {_aten.empty.memory_format, _aten.empty_strided.default}
_VIEWS = {
    _aten.view.default,
    _aten.view.dtype,
    _aten._unsafe_view.default,
    _aten.expand.default,
    _aten.t.default,
    _aten.transpose.int,
    _aten.permute.default,
    _aten.select.int,
    _aten.slice.Tensor,
    _aten.as_strided.default,
    _aten.alias.default,
    _aten.detach.default,
    _aten.unsqueeze.default,
    _aten.squeeze.dim,
    _aten.squeeze.dims,
    _aten._reshape_alias.default,
}


def hooks_installed() -> bool:
    """Whether triton launch hooks (a profiler) are installed (triton 3.6 keeps a chain that may be empty)."""
    rt = triton.knobs.runtime
    enter, leave = rt.launch_enter_hook, rt.launch_exit_hook
    return bool(getattr(enter, "calls", enter) or getattr(leave, "calls", leave))


def constant(t: torch.Tensor) -> torch.Tensor:
    """Register ``t`` as persistent and read-only for kernels (a launch passing it replays with it)."""
    _CONSTANTS[t.data_ptr()] = t
    return t


def launch(kernel, grid, *args, **kwargs):
    """``kernel[grid](*args, **kwargs)``; under ``record``, also keeps the launch for replay."""
    ck = kernel[grid](*args, **kwargs)
    rec = getattr(_STATE, "rec", None)
    if rec is not None:
        rec.add(kernel, ck, grid, args, kwargs)
    return ck


class HostDesc:
    """The fields triton 3.6's launcher reads from a host tensor descriptor (it encodes the CUtensorMap from
    them on every launch); ``TensorDescriptor`` adds only checks its launcher already made."""

    __slots__ = ("base", "shape", "strides", "padding")

    def __init__(self, base, shape, strides, padding="zero"):
        self.base, self.shape, self.strides, self.padding = base, shape, strides, padding


class _Guard(TorchDispatchMode):
    """Notes the allocations of a recorded call and whether any other torch operation ran."""

    def __init__(self):
        super().__init__()
        self.allocs: list = []  # (shape, stride, dtype, device) of each allocation, in order
        self.live: dict = {}  # data_ptr -> index of the last allocation at that address
        self.spans: list = []  # (data_ptr, bytes) of each allocation, in order
        self.other: list = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in _ALLOC:
            if out.numel():
                # (an address allocated again was freed first: from then on it names the new buffer, and a
                # replay gives each allocation a buffer of its own)
                self.live[out.data_ptr()] = len(self.allocs)
                self.allocs.append((tuple(out.shape), out.stride(), out.dtype, out.device))
                self.spans.append((out.data_ptr(), out.untyped_storage().nbytes()))
        elif func not in _VIEWS:
            self.other.append(str(func))
        return out

    def inside(self, p):
        """``(allocation index, byte offset)`` of an address inside an allocation of the call (the latest one
        holding it: an earlier one there was freed first), or None."""
        for a in range(len(self.spans) - 1, -1, -1):
            base, size = self.spans[a]
            if base <= p < base + size:
                return a, p - base
        return None


def _holds_tensor(x) -> bool:
    return (
        isinstance(x, torch.Tensor)
        or isinstance(getattr(x, "base", None), torch.Tensor)
        or (isinstance(x, tuple) and any(_holds_tensor(y) for y in x))
    )


class _Recording:
    def __init__(self, slots):
        self.slots = slots
        self.entries: list = []
        self.refused: str | None = None
        self.hook_launches = 0

    def _hook(self, *_):
        self.hook_launches += 1

    def add(self, kernel, ck, grid, args, kwargs):
        if self.refused:
            return
        why = self._add(kernel, ck, grid, args, kwargs)
        if why:
            self.refused = why

    def _add(self, kernel, ck, grid, args, kwargs):
        fn, extra = kernel, {}
        if isinstance(kernel, triton.runtime.Autotuner):
            if kernel.reset_to_zero or kernel.restore_value or kernel.best_config.pre_hook is not None:
                return "an autotuned kernel with hooks"
            fn, extra = kernel.fn, kernel.best_config.all_kwargs()
        if not isinstance(fn, triton.runtime.JITFunction) or ck is None or not hasattr(ck, "packed_metadata"):
            return "not a compiled triton kernel launch"
        values = list(args)
        for p in fn.params[len(args) :]:
            if p.name in kwargs:
                values.append(kwargs[p.name])
            elif p.name in extra:
                values.append(extra[p.name])
            elif p.has_default:
                values.append(p.default)
            else:
                return f"argument {p.name} unset"
        if callable(grid):  # (as triton evaluates it: on the bound arguments, config constexprs included)
            grid = grid(dict(zip(fn.arg_names, values)))
        g = tuple(grid) + (1,) * (3 - len(grid))
        sources = []
        for i, v in enumerate(values):
            if isinstance(v, tuple) and any(_holds_tensor(x) for x in v):  # a bundle of arguments
                items = list(v)
                for j, x in enumerate(items):
                    if isinstance(x, tuple) and any(_holds_tensor(y) for y in x):
                        return f"argument {fn.arg_names[i]}: tensors in a tuple inside a tuple"
                    if isinstance(x, torch.Tensor):
                        src = self._source(x)
                        if src is None:
                            return f"argument {fn.arg_names[i]}[{j}]: memory of no known origin"
                        sources.append(((i, j), src, None))
                        items[j] = None
                    elif _holds_tensor(x):
                        return f"argument {fn.arg_names[i]}[{j}]: a descriptor in a tuple"
                values[i] = tuple(items)
                continue
            desc = None
            if not isinstance(v, torch.Tensor) and isinstance(getattr(v, "base", None), torch.Tensor):
                desc = (list(v.shape), list(v.strides), getattr(v, "padding", "zero"))  # a host TMA descriptor
                v = v.base
            if isinstance(v, torch.Tensor):
                src = self._source(v)
                if src is None:
                    return f"argument {fn.arg_names[i]}: memory of no known origin"
                if desc is not None and src[0] == "alloc_at":
                    return f"argument {fn.arg_names[i]}: a tensor descriptor on a view into an allocation"
                sources.append((i, src, desc))
                values[i] = None  # (the replay holds no tensor of this call)
        self.entries.append((ck, g, values, tuple(sources)))
        return None

    def _source(self, t):
        """Where a pointer argument comes from: ("slot", indices), ("alloc", allocation index), ("const", t) or
        ("alloc_at", (allocation index, byte offset))."""
        p = t.data_ptr()
        hits = tuple(i for i, s in enumerate(self.slots) if isinstance(s, torch.Tensor) and s.data_ptr() == p)
        if hits:
            return ("slot", hits)
        a = self.guard.live.get(p)
        if a is not None:
            return ("alloc", a)
        c = _CONSTANTS.get(p)
        if c is not None:
            return ("const", c)
        at = self.guard.inside(p)
        if at is not None:  # a view into an allocation (several outputs carved from one buffer)
            return ("alloc_at", at)
        return None


def as_tuple(result) -> tuple:
    return () if result is None else result if isinstance(result, tuple) else (result,)


def _output_spec(result, slots, guard):
    """How a replay rebuilds ``fn``'s result (None, a tensor or a tuple of tensors and Nones): per item None,
    ("slot", i), ("alloc", allocation index, shape, strides) (memory the call allocated, possibly viewed) or ("empty",
    shape, strides, dtype, device) (no elements); a string (the reason) when an item is none of these."""
    spec, live = [], guard.live
    for t in as_tuple(result):
        if t is None:
            spec.append(None)
        elif not isinstance(t, torch.Tensor):
            return f"a result of type {type(t).__name__}"
        elif t.numel() == 0:
            spec.append(("empty", tuple(t.shape), t.stride(), t.dtype, t.device))
        else:
            hit = next((i for i, x in enumerate(slots) if x is t), None)
            if hit is not None:
                spec.append(("slot", hit))
            elif t.data_ptr() in live:
                spec.append(("alloc", live[t.data_ptr()], tuple(t.shape), t.stride()))
            elif (
                (at := guard.inside(t.data_ptr())) is not None
                and guard.allocs[at[0]][2] == t.dtype
                and at[1] % t.element_size() == 0
            ):
                spec.append(("alloc", at[0], tuple(t.shape), t.stride(), at[1] // t.element_size()))
            else:
                return "a result that is neither an input nor memory the call allocated"
    return spec


def record(fn, slots):
    """Run ``fn()`` (a launcher call whose tensors are ``slots``, the call's inputs and outputs) and return
    ``(result, replay)``: ``replay`` is a ``Replay`` of its launches (and of ``fn``'s result: the tensors it
    returns, rebuilt on the replayed call's memory), or None when the call cannot be replayed (the module
    docstring says when)."""
    rt = triton.knobs.runtime
    chain = rt.launch_enter_hook
    if not SUPPORTED or getattr(_STATE, "rec", None) is not None or hooks_installed() or not hasattr(chain, "add"):
        return fn(), None
    rec = _Recording(slots)
    rec.guard = guard = _Guard()
    _STATE.rec = rec
    chain.add(rec._hook)  # counts every triton launch of the call
    try:
        with guard:
            result = fn()
    finally:
        _STATE.rec = None
        chain.remove(rec._hook)
    why = rec.refused or (
        f"torch operations ran: {', '.join(sorted(set(guard.other)))}"
        if guard.other
        else f"{rec.hook_launches} triton launches, {len(rec.entries)} through replay.launch"
        if rec.hook_launches != len(rec.entries) or not rec.entries
        else None
    )
    spec = _output_spec(result, slots, guard) if not why else None
    if isinstance(spec, str):
        why = spec
    if why:
        global last_refusal
        last_refusal = why
        return result, None
    return result, Replay(rec.entries, guard.allocs, spec)


def _direct_launcher(ck):
    """``(launch, cooperative, pdl, desc_meta)`` to call triton 3.6's compiled C launcher of ``ck`` directly,
    or None where the kernel needs what its Python wrapper adds (scratch memory) or the wrapper is not the
    one known here. ``desc_meta``: kernel argument index -> the TMA metadata of each tensor-descriptor
    argument (None: the launcher takes the descriptor's fields), which the wrapper would encode per launch."""
    run = ck.run
    if type(run).__name__ != "CudaLauncher" or run.global_scratch_size or run.profile_scratch_size:
        return None
    launch, meta = run.launch, {}
    code = getattr(launch, "__code__", None)
    if code is not None:  # the tensor-descriptor wrapper (``wrap_handle_tensordesc``): read its closure
        if code.co_name != "inner" or not launch.__closure__:
            return None
        cells = dict(zip(code.co_freevars, (c.cell_contents for c in launch.__closure__)))
        if not {"launcher", "tensordesc_indices", "tensordesc_meta"} <= cells.keys():
            return None
        launch = cells["launcher"]
        meta = dict(zip(sorted(cells["tensordesc_indices"]), cells["tensordesc_meta"]))
    return launch, run.launch_cooperative_grid, run.launch_pdl, meta


def _desc_fill_args(meta, desc):
    """The arguments of ``fill_tma_descriptor`` after the base address, and the kernel arguments that follow
    the encoded descriptor, for a descriptor of ``desc = (shape, strides, padding)`` (triton 3.6's
    ``make_tensordesc_arg``)."""
    from triton.backends.nvidia.driver import TMA_DTYPE_DEVICE_TO_HOST

    shape, strides, padding = list(desc[0]), list(desc[1]), desc[2]
    if meta["fp4_padded"]:
        shape[-1] *= 2
    dtype = TMA_DTYPE_DEVICE_TO_HOST[meta["elem_type"]]
    fill = (meta["swizzle"], meta["elem_size"], dtype, meta["block_size"], shape, strides, 1 if padding == "nan" else 0)
    return fill, [*shape, *strides]


class _Direct:
    """One recorded launch, called through the compiled C launcher: the argument list is built once, and a
    replay writes into a copy only the stream, the new call's addresses and their TMA descriptors."""

    __slots__ = ("launch", "template", "subs", "descs", "bundles")

    def __init__(self, ck, grid, values, top, bundles, direct):
        launch, coop, pdl, meta = direct
        self.launch = launch
        self.template = [*grid, None, ck.function, coop, pdl, None, None, ck.packed_metadata, None, None, None]
        sub_at = {i: (kind, ref, desc) for i, kind, ref, desc in top}
        self.subs, self.descs, self.bundles = [], [], []
        bundle_at = dict(bundles)
        for i, v in enumerate(values):
            pos = len(self.template)
            if i in meta and i in sub_at:
                kind, ref, desc = sub_at[i]
                if meta[i] is None:  # the launcher takes the base address and the fields
                    self.template += [None, *desc[0], *desc[1], desc[2] == "nan", *desc[0], *desc[1]]
                    self._sub(pos, kind, ref)
                else:
                    fill, rest = _desc_fill_args(meta[i], desc)
                    self.template += [None, *rest]
                    self.descs.append((pos, kind, ref, fill))
                continue
            self.template.append(v)
            if i in sub_at:
                self._sub(pos, *sub_at[i][:2])
            elif i in bundle_at:
                items = [(j, kind, ref) for j, kind, ref in bundle_at[i] if kind != 2]
                v = list(v)
                for j, kind, ref in bundle_at[i]:
                    if kind == 2:
                        v[j] = ref.data_ptr()
                self.template[pos] = tuple(v)
                if items:
                    self.bundles.append((pos, tuple(v), items))

    def _sub(self, pos, kind, ref):
        # (pointers reach the launcher as addresses: an int skips its data_ptr call and its pointer-attribute
        # query per argument; a constant's address is fixed, so it goes into the template once)
        if kind == 2:
            self.template[pos] = ref.data_ptr()
        else:
            self.subs.append((pos, kind, ref))


class Replay:
    """The recorded launches of one call signature; ``run(slots)`` replays them with a new call's tensors
    (in the recorded order, on the current stream)."""

    __slots__ = ("entries", "allocs", "checks", "outputs")

    def __init__(self, entries, allocs, outputs=()):
        used = {src[1] for *_, sources in entries for _, src, _ in sources if src[0] == "alloc"}
        used |= {src[1][0] for *_, sources in entries for _, src, _ in sources if src[0] == "alloc_at"}
        used |= {o[1] for o in outputs if o is not None and o[0] == "alloc"}
        self.allocs = tuple(allocs[a] for a in sorted(used))
        index = {a: j for j, a in enumerate(sorted(used))}
        self.outputs = tuple(
            None if o is None else ("alloc", index[o[1]], *o[2:]) if o[0] == "alloc" else o for o in outputs
        )
        self.entries = []
        checks = set()
        for ck, grid, values, sources in entries:
            subs = []
            for i, (kind, ref), desc in sources:
                if kind == "slot":
                    if len(ref) > 1:  # aliased slots: the replay holds only while they still alias
                        checks.add(ref)
                    subs.append((i, 0, ref[0], desc))
                elif kind == "alloc":
                    subs.append((i, 1, index[ref], desc))
                elif kind == "alloc_at":  # (kind 3: an address at a byte offset into a re-allocated buffer)
                    subs.append((i, 3, (index[ref[0]], ref[1]), desc))
                else:
                    subs.append((i, 2, ref, desc))
            # (substitutions into a bundle, grouped per argument: one tuple built per argument and call)
            top = tuple(x for x in subs if isinstance(x[0], int))
            bundles: dict = {}
            for (i, j), kind, ref, _ in (x for x in subs if not isinstance(x[0], int)):
                bundles.setdefault(i, []).append((j, kind, ref))
            direct = _direct_launcher(ck)
            if direct is not None and all(i in direct[3] for i, _, _, desc in top if desc is not None):
                self.entries.append(_Direct(ck, grid, values, top, tuple(bundles.items()), direct))
            else:
                self.entries.append((ck, grid, list(values), top, tuple(bundles.items())))
        self.checks = tuple(checks)

    def run(self, slots) -> tuple | None:
        """Launch with ``slots`` (the new call's tensors, in the recorded order) and return the recorded call's
        result rebuilt on this call's memory, as a tuple (``()`` for None, ``(t,)`` for one tensor); None
        (nothing launched) when slots that aliased at recording no longer do, or when launch hooks (a
        profiler, which a replay would not report to) are installed."""
        if hooks_installed():
            return None
        for ref in self.checks:
            p = slots[ref[0]].data_ptr()
            for i in ref[1:]:
                if slots[i].data_ptr() != p:
                    return None
        bufs = [torch.empty_strided(sh, st, dtype=dt, device=dev) for sh, st, dt, dev in self.allocs]
        drv = triton.runtime.driver.active
        stream = drv.get_current_stream(drv.get_current_device())
        for entry in self.entries:
            if type(entry) is _Direct:
                args = entry.template.copy()
                args[3] = stream
                for p, kind, ref in entry.subs:
                    args[p] = (slots[ref] if kind == 0 else bufs[ref]).data_ptr() if kind < 3 else _at(bufs, ref)
                for p, kind, ref, fill in entry.descs:
                    t = slots[ref] if kind == 0 else bufs[ref] if kind == 1 else ref
                    args[p] = drv.utils.fill_tma_descriptor(t.data_ptr(), *fill)
                for p, base, items in entry.bundles:
                    b = list(base)
                    for j, kind, ref in items:
                        b[j] = (slots[ref] if kind == 0 else bufs[ref]).data_ptr() if kind < 3 else _at(bufs, ref)
                    args[p] = tuple(b)
                entry.launch(*args)
                continue
            ck, (g0, g1, g2), values, subs, bundles = entry
            args = values.copy()
            for i, kind, ref, desc in subs:
                t = slots[ref] if kind == 0 else bufs[ref] if kind == 1 else ref if kind == 2 else _at(bufs, ref)
                args[i] = t if desc is None else HostDesc(t, *desc)
            for i, items in bundles:
                b = list(values[i])
                for j, kind, ref in items:
                    b[j] = slots[ref] if kind == 0 else bufs[ref] if kind == 1 else ref if kind == 2 else _at(bufs, ref)
                args[i] = tuple(b)
            ck.run(g0, g1, g2, stream, ck.function, ck.packed_metadata, None, None, None, *args)
        return tuple(self._output(o, slots, bufs) for o in self.outputs)

    @staticmethod
    def _output(o, slots, bufs):
        if o is None:
            return None
        if o[0] == "slot":
            return slots[o[1]]
        if o[0] == "empty":
            return torch.empty_strided(o[1], o[2], dtype=o[3], device=o[4])
        buf, shape, stride = bufs[o[1]], o[2], o[3]
        if len(o) > 4:  # a view at an offset (one of several carved from the buffer)
            return buf.as_strided(shape, stride, o[4])
        return buf if buf.shape == shape and buf.stride() == stride else buf.as_strided(shape, stride)


def _at(bufs, ref):
    """The address at ``ref = (buffer index, byte offset)`` (the launcher takes an int as the address)."""
    return bufs[ref[0]].data_ptr() + ref[1]

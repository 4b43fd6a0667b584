"""Inductor post-grad pass: fuse static per-tensor FP8 output quantization into the attention op.

Rewrites, in the post-grad FX graph (functionalized ATen IR)::

    o, lse = fp8attn.{dense_fwd,paged_fwd,combine}(..., out_scale=None)      # bf16/fp16/fp32 out
    y = view/reshape/...(o)                                                # zero or more views
    q = quant(y, s)                                                        # static per-tensor

or the out= form (a torch.empty / torch.zeros buffer written in place, functionalized by
``auto_functionalized[_v2]``)::

    buf = empty(...) | full(..., 0)
    lse, buf1 = auto_functionalized_v2(fp8attn.*_out, ..., _all_bases=[buf])
    q = quant(view(buf1), s)

into the attention op with ``out_scale=s`` writing e4m3fn directly (an e4m3fn buffer in the out=
form), followed by the same views. ``quant`` is either ``fp8attn::quant_fp8_static(y, s)`` or the
plain torch form ``(y / s).clamp(-448, 448).to(torch.float8_e4m3fn)`` (as decomposed: ``div``, any
float converts, ``clamp_min``/``clamp_max``/``clamp`` with bounds -448 and 448, the e4m3fn convert).

A match is fused only when it is static per-tensor: ``s`` is a Python number or a one-element tensor
that does not depend on the attention output. Everything else is left as it is: per-token / per-group
scales (more than one element), dynamic scales (computed from the output itself, e.g. ``amax``),
other FP8 formats, and outputs (or intermediate views) that have other users.

The fused output skips the 16-bit rounding of the unfused path, so results agree with the unfused
graph to within one e4m3 ulp (usually exactly).
"""

from __future__ import annotations

import operator
from collections import Counter

import torch
import torch.fx as fx

__all__ = ["OutputQuantFusionPass", "fuse_output_quant", "STATS"]

E4M3 = torch.float8_e4m3fn
E4M3_MAX = 448.0
aten = torch.ops.aten
prims = torch.ops.prims

# Cumulative counters over every graph the pass has seen (tests and docs read these).
STATS: Counter = Counter()

_VIEW_OPS = {
    aten.view.default,
    aten.reshape.default,
    aten._unsafe_view.default,
    aten.alias.default,
    aten.squeeze.dim,
    aten.squeeze.dims,
    aten.squeeze.default,
    aten.unsqueeze.default,
    aten.flatten.using_ints,
    aten.permute.default,
    aten.transpose.int,
    aten.t.default,
    aten.as_strided.default,
    aten.expand.default,
}
_CONVERTS = {prims.convert_element_type.default, aten._to_copy.default}


def _attn_ops():
    ns = torch.ops.fp8attn
    functional = {ns.dense_fwd.default, ns.paged_fwd.default, ns.combine.default}
    out_variants = {ns.dense_fwd_out.default, ns.paged_fwd_out.default, ns.combine_out.default}
    return functional, out_variants


def _val(n):
    return n.meta.get("val") if isinstance(n, fx.Node) else None


def _is_call(n, targets):
    return isinstance(n, fx.Node) and n.op == "call_function" and n.target in targets


def _convert_dtype(n):
    if n.target is prims.convert_element_type.default:
        return n.args[1]
    return n.kwargs.get("dtype")


def _is_float_convert(n):
    if not _is_call(n, _CONVERTS):
        return False
    if n.target is aten._to_copy.default and set(n.kwargs) - {"dtype"}:
        return False
    dt = _convert_dtype(n)
    return dt is not None and dt.is_floating_point


def _single_user(n):
    return len(n.users) == 1


# ---------------------------------------------------------------------------------------------
# Matching the quantization
# ---------------------------------------------------------------------------------------------


def _match_quant(node):
    """If ``node`` ends a static-per-tensor-shaped quant, return (x, scale, quant_nodes); else None.

    ``scale`` is an fx.Node or a Python number; quant_nodes are the nodes that disappear (node last).
    Whether the scale is static (independent of x) is checked by the caller.
    """
    if _is_call(node, {torch.ops.fp8attn.quant_fp8_static.default}):
        return node.args[0], node.args[1], [node]
    if not (_is_call(node, _CONVERTS) and _convert_dtype(node) == E4M3):
        return None
    chain = [node]
    lo = hi = None
    cur = node.args[0]
    while True:
        if not isinstance(cur, fx.Node) or not _single_user(cur):
            return None
        if _is_float_convert(cur):
            chain.append(cur)
        elif _is_call(cur, {aten.clamp_min.default}) and lo is None:
            lo = cur.args[1]
            chain.append(cur)
        elif _is_call(cur, {aten.clamp_max.default}) and hi is None:
            hi = cur.args[1]
            chain.append(cur)
        elif _is_call(cur, {aten.clamp.default}) and lo is None and hi is None:
            lo = cur.args[1] if len(cur.args) > 1 else cur.kwargs.get("min")
            hi = cur.args[2] if len(cur.args) > 2 else cur.kwargs.get("max")
            chain.append(cur)
        elif _is_call(cur, {aten.div.Tensor}):
            chain.append(cur)
            break
        else:
            return None
        cur = cur.args[0]
    if not (isinstance(lo, (int, float)) and isinstance(hi, (int, float)) and lo == -E4M3_MAX and hi == E4M3_MAX):
        return None
    div = chain[-1]
    return div.args[0], div.args[1], chain


def _is_static_scale(scale, attn_node):
    """A Python number, or a one-element tensor node that does not depend on ``attn_node``."""
    if isinstance(scale, (int, float)) and not isinstance(scale, bool):
        return float(scale) > 0
    v = _val(scale)
    if not isinstance(v, torch.Tensor) or not v.dtype.is_floating_point:
        return False
    try:
        if int(v.numel()) != 1:
            return False
    except Exception:  # symbolic element count: not provably one element
        return False
    seen, stack = set(), [scale]
    while stack:  # ancestors of the scale must not include the attention node
        n = stack.pop()
        if n is attn_node:
            return False
        if n in seen:
            continue
        seen.add(n)
        stack.extend(n.all_input_nodes)
    return True


def _walk_views(x):
    """From the quant input back through single-user views to the attention output.

    Returns (source, views) with views ordered from the source outwards.
    """
    views = []
    cur = x
    while _is_call(cur, _VIEW_OPS):
        if not _single_user(cur):
            return None, None
        views.append(cur)
        cur = cur.args[0]
    if not isinstance(cur, fx.Node) or not _single_user(cur):
        return None, None
    return cur, list(reversed(views))


# ---------------------------------------------------------------------------------------------
# Rewriting
# ---------------------------------------------------------------------------------------------


def _fake_mode(graph):
    from torch._guards import detect_fake_mode

    vals = [n.meta["val"] for n in graph.nodes if isinstance(n.meta.get("val"), torch.Tensor)]
    return detect_fake_mode(vals)


def _set_val(node, fake_mode):
    args, kwargs = fx.node.map_arg((node.args, node.kwargs), lambda a: a.meta.get("val"))
    with fake_mode:
        node.meta["val"] = node.target(*args, **kwargs)
    return node


def _scale_node(graph, scale, before, device, fake_mode):
    """A float32 one-element tensor node for the scale (inserted before ``before``)."""
    with graph.inserting_before(before):
        if isinstance(scale, fx.Node):
            if _val(scale).dtype == torch.float32:
                return scale
            n = graph.call_function(prims.convert_element_type.default, (scale, torch.float32))
        else:
            n = graph.call_function(
                aten.full.default, ([], float(scale)), {"dtype": torch.float32, "device": device, "pin_memory": False}
            )
    return _set_val(n, fake_mode)


def _replace_views(graph, src_new, views, fake_mode):
    cur = src_new
    for v in views:  # each new view sits where the old one was (its size arguments are defined there)
        with graph.inserting_before(v):
            n = graph.call_function(v.target, (cur,) + tuple(v.args[1:]), dict(v.kwargs))
        _set_val(n, fake_mode)
        cur = n
    return cur


def _erase(graph, nodes):
    for n in nodes:
        if len(n.users) == 0:
            graph.erase_node(n)


def _mirror_getitems(graph, old, new, fake_mode):
    """Give ``new`` (a multi-output node replacing ``old``) a getitem for each getitem user of ``old``,
    right after it; returns {old getitem: new getitem}."""
    _set_val(new, fake_mode)
    anchor, repl = new, {}
    for user in list(old.users):  # getitem(old, i)
        with graph.inserting_after(anchor):
            g = graph.call_function(operator.getitem, (new, user.args[1]))
        _set_val(g, fake_mode)
        repl[user] = g
        anchor = g
    return repl


def _fuse_functional(graph, attn, getitem0, views, quant_nodes, scale, fake_mode):
    op = attn.target
    names = [a.name for a in op._schema.arguments]
    args = (
        list(attn.args)
        + [
            a.default_value if a.has_default_value() else None  # (dense_fwd's bwd_mode has one)
            for a in op._schema.arguments[len(attn.args) :]
        ]
    )
    for k, v in attn.kwargs.items():
        args[names.index(k)] = v
    dev = _val(getitem0).device
    s = _scale_node(graph, scale, attn, dev, fake_mode)
    args[names.index("out_scale")] = s
    if "out_dtype" in names:
        args[names.index("out_dtype")] = None
    with graph.inserting_after(attn):
        new = graph.call_function(op, tuple(args))
    repl = _mirror_getitems(graph, attn, new, fake_mode)
    out = _replace_views(graph, repl[getitem0], views, fake_mode)
    last = quant_nodes[0]
    last.replace_all_uses_with(out)
    for old, g in repl.items():
        if old is not getitem0:
            old.replace_all_uses_with(g)
    _erase(graph, quant_nodes + list(reversed(views)) + [getitem0] + [u for u in repl if u is not getitem0] + [attn])
    return len(quant_nodes)


def _fuse_out_variant(graph, af, base_getitem, views, quant_nodes, scale, fake_mode):
    kw = dict(af.kwargs)
    bases = kw.get("_all_bases")
    if not bases:  # (the output buffer is the first base; a split workspace adds two more, kept as they are)
        return 0
    buf = bases[0]
    if not _is_call(buf, {aten.empty.memory_format, aten.full.default, aten.zeros.default, aten.empty_strided.default}):
        return 0
    if buf.target is aten.full.default and buf.args[1] != 0:
        return 0
    if any(u is not af and not (u.op == "call_function" and "sym_" in str(u.target)) for u in buf.users):
        return 0
    # the new e4m3fn buffer, same shape/strides as the old one
    with graph.inserting_after(buf):
        nb = graph.call_function(buf.target, buf.args, {**buf.kwargs, "dtype": E4M3})
    _set_val(nb, fake_mode)
    dev = _val(buf).device
    s = _scale_node(graph, scale, af, dev, fake_mode)
    kw["out_scale"] = s
    if "out_dtype" in kw:
        kw["out_dtype"] = None
    kw["_all_bases"] = [nb, *bases[1:]]
    with graph.inserting_after(af):
        new = graph.call_function(af.target, af.args, kw)
    repl = _mirror_getitems(graph, af, new, fake_mode)
    out = _replace_views(graph, repl[base_getitem], views, fake_mode)
    quant_nodes[0].replace_all_uses_with(out)
    for old, g in repl.items():
        if old is not base_getitem:
            old.replace_all_uses_with(g)
    _erase(
        graph, quant_nodes + list(reversed(views)) + [base_getitem] + [u for u in repl if u is not base_getitem] + [af]
    )
    buf.replace_all_uses_with(nb)
    _erase(graph, [buf])
    return len(quant_nodes)


def fuse_output_quant(graph: fx.Graph) -> dict:
    """Apply the fusion to ``graph`` in place. Returns {"fused": n, "removed_quant_nodes": m,
    "skipped": k} for this graph (also added to :data:`STATS`)."""
    functional, out_variants = _attn_ops()
    af_targets = {
        t
        for t in (
            getattr(torch.ops.higher_order, "auto_functionalized", None),
            getattr(torch.ops.higher_order, "auto_functionalized_v2", None),
        )
        if t is not None
    }
    stats = Counter()
    fake_mode = None
    for node in list(graph.nodes):
        if node.graph is not graph or node.op != "call_function":
            continue
        m = _match_quant(node)
        if m is None:
            continue
        x, scale, quant_nodes = m
        src, views = _walk_views(x)
        if src is None or src.target is not operator.getitem:
            continue
        parent, idx = src.args
        if _is_call(parent, functional) and idx == 0:
            kind = "functional"
        elif (
            _is_call(parent, af_targets)
            and parent.args[0] in out_variants
            and idx == 1
            and "_all_bases" in parent.kwargs
        ):
            kind = "out"
        else:
            continue
        outv = _val(src)
        if outv is None or outv.dtype not in (torch.bfloat16, torch.float16, torch.float32):
            continue
        qv, xv = _val(quant_nodes[0]), _val(x)
        if qv is None or xv is None or tuple(qv.shape) != tuple(xv.shape):
            stats["skipped"] += 1  # the scale broadcasts the shape: not per-tensor
            continue
        if not _is_static_scale(scale, parent):
            stats["skipped"] += 1  # dynamic or per-token/group scale: leave unfused
            continue
        if fake_mode is None:
            fake_mode = _fake_mode(graph)
        if kind == "functional":
            removed = _fuse_functional(graph, parent, src, views, quant_nodes, scale, fake_mode)
        else:
            removed = _fuse_out_variant(graph, parent, src, views, quant_nodes, scale, fake_mode)
        if removed:
            stats["fused"] += 1
            stats["removed_quant_nodes"] += removed
    if stats["fused"]:
        graph.lint()
        try:
            from torch._dynamo.utils import counters

            counters["inductor"]["fp8attn_output_quant_fused"] += stats["fused"]
        except Exception:  # pragma: no cover
            pass
    STATS.update(stats)
    return dict(stats)


try:
    from torch._inductor.custom_graph_pass import CustomGraphPass as _Base
except ImportError:  # pragma: no cover - very old torch
    _Base = object


class OutputQuantFusionPass(_Base):
    """The post-grad pass object installed by :func:`fp8attn.compile.enable_output_quant_fusion`.

    ``chained`` is a previously installed post-grad custom pass that runs first.
    """

    def __init__(self, chained=None):
        self.chained = chained
        self.last_stats: dict = {}

    def __call__(self, graph: fx.Graph) -> None:
        if self.chained is not None:
            self.chained(graph)
        self.last_stats = fuse_output_quant(graph)

    def uuid(self):
        from torch._inductor.custom_graph_pass import get_hash_for_files

        h = get_hash_for_files((__file__,)).hex()
        if self.chained is not None:
            inner = getattr(self.chained, "uuid", lambda: None)()
            if inner is None:
                return None  # an uncacheable chained pass makes the pair uncacheable
            h = f"{h}-{inner}"
        return h

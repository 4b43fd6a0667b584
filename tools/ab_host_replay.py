"""One-process A/B of two host-side choices of a planned call's replay (H200 evidence for docs/decisions.md).

* Pointer arguments handed to triton's compiled C launcher as ints (``kernels.replay``) against tensors (the
  launcher then calls ``data_ptr`` and queries the pointer's attributes per argument): the same recorded
  ``Replay`` objects of ``fp8attn bench host``'s tiny d64 entries replayed both ways, 7 interleaved rounds of
  300 calls, medians; the whole call and torch SDPA bf16 timed beside them.
* ``quantize_qkv``'s six outputs as six allocations (three per-tensor descales expanded after) against two
  allocations carved into six views (``quant._carve``).

Writes benchmarks/results/<gpu>/explore/host_replay_ab.json. Usage: ``python tools/ab_host_replay.py`` on a GPU.
"""

import json
import statistics
from pathlib import Path

import torch
import triton

from fp8attn.bench.common import gpu_dirname, results_header
from fp8attn.bench.host import _entries, _timed
from fp8attn.kernels import replay

CAP = {}
orig = replay.Replay.run


def cap(self, slots):
    CAP.setdefault(id(self), (self, slots))
    return orig(self, slots)


def run_tensor(self, slots):
    """``Replay.run`` with every pointer handed to the C launcher as a tensor (the ``_Direct`` entries only)."""
    if replay.hooks_installed():
        return None
    bufs = [torch.empty_strided(sh, st, dtype=dt, device=dev) for sh, st, dt, dev in self.allocs]
    drv = triton.runtime.driver.active
    stream = drv.get_current_stream(drv.get_current_device())
    for entry in self.entries:
        assert type(entry) is replay._Direct
        args = entry.template.copy()
        args[3] = stream
        for p, kind, ref in entry.subs:
            args[p] = slots[ref] if kind == 0 else bufs[ref] if kind == 1 else replay._at(bufs, ref)
        for p, kind, ref, fill in entry.descs:
            t = slots[ref] if kind == 0 else bufs[ref] if kind == 1 else ref
            args[p] = drv.utils.fill_tma_descriptor(t.data_ptr(), *fill)
        for p, base, items in entry.bundles:
            b = list(base)
            for j, kind, ref in items:
                b[j] = slots[ref] if kind == 0 else bufs[ref] if kind == 1 else replay._at(bufs, ref)
            args[p] = tuple(b)
        entry.launch(*args)
    return tuple(self._output(o, slots, bufs) for o in self.outputs)


replay.Replay.run = cap
e, peers, params = _entries("tiny", 64)
rows = {}
names = [
    "flash_attn_func",
    "flash_attn_varlen_func",
    "flash_attn_with_kvcache decode",
    "flash_attn_with_kvcache decode+append",
    "write_kv_cache",
    "quantize_qkv",
]
with torch.no_grad():
    for name in names:
        CAP.clear()
        for _ in range(5):
            e[name]()
        torch.cuda.synchronize()
        reps = list(CAP.values())
        if not reps:
            print(name, "no replay")
            continue
        ptrs = sum(len(en.subs) + sum(len(i) for _, _, i in en.bundles) for r, _ in reps for en in r.entries)
        fns = {
            "int": lambda reps=reps: [orig(r, s) for r, s in reps],
            "tensor": lambda reps=reps: [run_tensor(r, s) for r, s in reps],
            "call": e[name],
            "sdpa": peers["sdpa_bf16 decode" if ("kv" in name) else "sdpa_bf16 dense"],
        }
        runs = {k: [] for k in fns}
        for f in fns.values():  # warm-up
            f()
            f()
        for _ in range(7):
            for k, f in fns.items():
                runs[k].append(_timed(f, 300)[0] * 1e3)
        rows[name] = {k: statistics.median(v) for k, v in runs.items()}
        rows[name]["pointer_args"] = ptrs
# the allocations of a quantize_qkv call, before (six tensors, three per-tensor descales expanded) and after
# (two allocations, six views carved from them), as a replay makes them (tiny shapes: 1 x 128 x 4 x 64)
dev = "cuda"
e8 = torch.float8_e4m3fn


def six():
    ys = [torch.empty_strided((1, 128, 4, 64), (32768, 256, 64, 1), dtype=e8, device=dev) for _ in range(3)]
    ds = [torch.empty_strided((1, 1), (1, 1), dtype=torch.float32, device=dev).expand(1, 4) for _ in range(3)]
    return ys, ds


def two():
    b8 = torch.empty_strided((3 * 32768,), (1,), dtype=e8, device=dev)
    b4 = torch.empty_strided((96,), (1,), dtype=torch.float32, device=dev)
    return (
        [b8.as_strided((1, 128, 4, 64), (32768, 256, 64, 1), i * 32768) for i in range(3)],
        [b4.as_strided((1, 4), (0, 0), i * 32) for i in range(3)],
    )


ar = {"six": [], "two": []}
for _ in range(7):
    for k, f in (("six", six), ("two", two)):
        ar[k].append(_timed(f, 300)[0] * 1e3)
rows["alloc quantize_qkv outputs"] = {k: statistics.median(v) for k, v in ar.items()}
print(
    "alloc six tensors + 3 expands: %.1f us; two + six views: %.1f us"
    % (rows["alloc quantize_qkv outputs"]["six"], rows["alloc quantize_qkv outputs"]["two"])
)
print(f"{'entry':42s} {'ptrs':>4s} {'replay int':>10s} {'tensor':>7s} {'call':>7s} {'sdpa':>7s} (us)")
for n, r in rows.items():
    if "int" not in r:
        continue
    print(f"{n:42s} {r['pointer_args']:4d} {r['int']:10.1f} {r['tensor']:7.1f} {r['call']:7.1f} {r['sdpa']:7.1f}")
doc = results_header("host_replay_ab")
doc["description"] = __doc__
doc["command"] = "python tools/ab_host_replay.py"
doc["cases"] = [{"case": n, "us": r} for n, r in rows.items()]
out = Path("benchmarks") / "results" / gpu_dirname() / "explore" / "host_replay_ab.json"
out.write_text(json.dumps(doc, indent=1) + "\n")
print(f"wrote {out}")

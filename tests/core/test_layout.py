"""Package layout: the core loads without the serving, benchmark, integration and command-line packages, and
the import paths that moved in this release still resolve to the same objects."""

import importlib
import subprocess
import sys

import pytest

# fp8attn's direct children that are not the core: users of the API, and aliases of moved modules
_OUTSIDE_CORE = ("serving", "bench", "integrations", "cli", "__main__", "engine", "models", "demo", "data")

_CORE_IMPORT = """
import pkgutil, sys
import fp8attn
outside = {outside!r}
core = [m.name for m in pkgutil.iter_modules(fp8attn.__path__) if m.name not in outside and m.name != "kernels"]
for name in core:
    __import__("fp8attn." + name)
loaded = sorted(m for m in sys.modules if m.split(".")[:2][-1] in outside and m.startswith("fp8attn."))
print(len(core), loaded)
"""


def test_core_never_loads_serving_bench_integrations_or_cli():
    code = _CORE_IMPORT.format(outside=_OUTSIDE_CORE)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    n, loaded = r.stdout.split(" ", 1)
    assert int(n) >= 10 and loaded.strip() == "[]", r.stdout


@pytest.mark.parametrize(
    "old, new, names",
    [
        ("fp8attn.engine", "fp8attn.serving.engine", ("LLMEngine", "EngineConfig", "PagedKVCache", "SamplingParams")),
        ("fp8attn.engine.bench", "fp8attn.bench.engine", ("main", "run", "time_decode")),
        ("fp8attn.models", "fp8attn.serving.models", ("LlamaModel", "LlamaConfig", "load_pretrained", "require")),
        ("fp8attn.demo", "fp8attn.serving.demo", ("demo_main", "drive_main", "DEMO_PACKAGES")),
        ("fp8attn.data", "fp8attn.serving.data", ("sample_prompts", "load_first_turns", "sharegpt_path")),
        (
            "fp8attn.paged",
            "fp8attn.paged_cache",
            ("alloc_paged_cache", "is_v_seq_major", "make_page_table", "split_workspace"),
        ),
        ("fp8attn.qkv", "fp8attn.quant", ("quantize_one", "descale_shape", "empty_seq_major")),
    ],
)
def test_moved_modules_keep_their_old_import_paths(old, new, names):
    o, n = importlib.import_module(old), importlib.import_module(new)
    for name in names:
        assert getattr(o, name) is getattr(n, name), f"{old}.{name}"
        assert name in o.__all__, f"{old}.__all__ lacks {name}"

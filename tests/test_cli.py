"""The `fp8attn` command: info and accuracy-demo."""
import os
import re
import subprocess
import sys

from fp8attn import cli

API_FUNCTIONS = ("flash_attn_func", "flash_attn_varlen_func", "flash_attn_with_kvcache", "flash_attn_combine")


def _run(*args, timeout=120):
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    return subprocess.run([sys.executable, "-m", "fp8attn", *args], capture_output=True, text=True, timeout=timeout,
                          env=env)


def test_info_module_entry_point():
    r = _run("info")
    assert r.returncode == 0, r.stderr
    out = r.stdout
    import torch

    import fp8attn

    assert fp8attn.__version__ in out
    assert torch.__version__ in out
    assert re.search(r"^device\s+cpu$", out, re.M)
    for fn in API_FUNCTIONS:
        m = re.search(rf"^{fn}\s+(\S.*)$", out, re.M)
        assert m, f"info does not list {fn}:\n{out}"
        assert "reference" in m.group(1), f"{fn}: expected the reference path on a CPU-only run, got {m.group(1)!r}"


def test_info_in_process(capsys):
    assert cli.main(["info"]) == 0
    assert "flash_attn_with_kvcache" in capsys.readouterr().out


def test_accuracy_demo_prints_table(capsys):
    assert cli.main(["accuracy-demo", "--seqlen", "64"]) == 0
    lines = [ln for ln in capsys.readouterr().out.splitlines() if ln.strip()]
    assert "bf16" in lines[0] and "fp8" in lines[0]
    rows = lines[1:]
    assert len(rows) == 4  # 2 distributions x causal False/True
    for row in rows:
        errs = [float(x) for x in row.split()[-3:]]
        assert all(0 <= e < 0.2 for e in errs), row
        bf16, fp8_tensor, fp8_head = errs
        assert bf16 < fp8_tensor  # bf16 is the more precise format


def test_accuracy_demo_console_script():
    r = _run("accuracy-demo", "--seqlen", "64")
    assert r.returncode == 0, r.stderr
    assert len([ln for ln in r.stdout.splitlines() if ln.strip()]) == 5


def test_no_command_and_unknown_command():
    assert cli.main([]) == 2
    assert cli.main(["frobnicate"]) == 2


def test_every_bench_routine_resolves_to_a_function():
    import importlib

    from fp8attn.cli import BENCH_ROUTINES

    for name, (module, fn) in BENCH_ROUTINES.items():
        assert callable(getattr(importlib.import_module(module), fn)), name

"""The `fp8attn` command: info and accuracy-demo."""

import os
import re
import subprocess
import sys

from fp8attn import cli

API_FUNCTIONS = ("flash_attn_func", "flash_attn_varlen_func", "flash_attn_with_kvcache", "flash_attn_combine")


def _run(*args, timeout=120):
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    return subprocess.run(
        [sys.executable, "-m", "fp8attn", *args], capture_output=True, text=True, timeout=timeout, env=env
    )


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


def test_help_lists_every_command_with_a_description(capsys):
    assert cli.main(["--help"]) == 0
    out = capsys.readouterr().out
    for name, desc in cli.COMMANDS.items():
        assert re.search(rf"^\s+{re.escape(name)}\b", out, re.M), f"--help does not list {name}:\n{out}"
        assert " ".join(desc.split()[:4]) in " ".join(out.split()), f"{name}: no description in --help"


def test_info_help_and_unknown_arguments(capsys):
    assert cli.main(["info", "--help"]) == 0
    assert "fallback mode" in capsys.readouterr().out
    assert cli.main(["info", "--bogus"]) == 2
    assert "unrecognized arguments: --bogus" in capsys.readouterr().err
    assert cli.main(["bench", "dense", "--bogus"]) == 2


def test_info_shows_each_entry_status_and_the_fallback_mode(capsys, monkeypatch):
    from fp8attn.capability import ENTRIES

    monkeypatch.setenv("FP8ATTN_FALLBACK", "error")
    assert cli.main(["info"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"^fallback mode\s+error\b", out, re.M), out
    for fn in ENTRIES:
        m = re.search(rf"^{fn}\s+(\S+): (\S.*)$", out, re.M)
        assert m, f"info does not list {fn}:\n{out}"
        assert m.group(1) in ("hopper", "triton", "reference") and m.group(2)


def test_accuracy_demo_refuses_bad_sizes_in_one_line(capsys):
    assert cli.main(["accuracy-demo", "--headdim", "12", "--seqlen", "8"]) == 2
    err = capsys.readouterr().err.strip()
    assert "Traceback" not in err and len(err.splitlines()) == 1 and "head dimension" in err, err
    for opt in ("--seqlen", "--heads", "--headdim"):
        assert cli.main(["accuracy-demo", opt, "0"]) == 2
        assert "positive integer" in capsys.readouterr().err


def test_bench_help_says_which_routines_need_a_gpu(capsys):
    assert cli.main(["bench", "--help"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "need a CUDA GPU" in out
    for name in cli.BENCH_ROUTINES:
        assert name in out
    assert "accuracy" in out.split("also run on a CPU")[1]


def test_every_drive_option_has_help_and_shows_its_default():
    import argparse

    from fp8attn.serving.demo import _drive_parser

    p = _drive_parser()
    text = " ".join(p.format_help().split())
    for action in p._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        assert action.help, f"drive {action.option_strings}: no help text"
        assert f"{action.option_strings[0]}" in text
    assert text.count("(default:") >= len(p._actions) - 1, text


def test_bench_accuracy_progress_line(capsys):
    from fp8attn.bench import accuracy

    accuracy._progress(1, 3, "bf16 S128")
    assert capsys.readouterr().err.strip() == "accuracy [1/3] bf16 S128"

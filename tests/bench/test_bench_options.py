"""`fp8attn bench <routine>` options: parsing, which routine takes which, where option runs write, the
command stamped into the results, and the dense launcher's rule overrides (FP8ATTN_DENSE_RULES)."""

import json
import os
import sys
import types

import pytest

from fp8attn import cli
from fp8attn.kernels.hopper import dense_launch as dense_tma


def _err(capsys):
    return capsys.readouterr().err


@pytest.mark.parametrize(
    "argv, words",
    [
        (["bench", "decode", "--shapes", "64x", "--name", "n"], "expected shapes"),
        (["bench", "decode", "--shapes", "64x4096,1x2x3", "--name", "n"], "all of one rank"),
        (["bench", "decode", "--splits", "0,-2", "--name", "n"], "non-negative"),
        (["bench", "decode", "--configs", "{num_warps: 8}", "--name", "n"], "JSON"),
        (["bench", "decode", "--configs", "[1, 2]", "--name", "n"], "list of objects"),
        (["bench", "decode", "--splits", "0", "--name", "../up"], "file name"),
    ],
)
def test_bad_option_values_are_usage_errors(capsys, argv, words):
    assert cli.main(argv) == 2
    assert words in _err(capsys)


def test_an_option_the_routine_does_not_take_names_the_routines_that_do(capsys):
    assert cli.main(["bench", "host", "--splits", "0,2", "--name", "n"]) == 2
    err = _err(capsys)
    assert "host takes no --splits" in err and "decode, decode-fp8q, prefill-chunked" in err


def test_an_option_needs_a_name_so_the_committed_file_stays(capsys):
    assert cli.main(["bench", "decode", "--read-ceiling"]) == 2
    assert "--name" in _err(capsys)


def test_every_option_is_taken_by_some_routine():
    for flag in cli.BENCH_OPTIONS:
        assert [r for r in cli.BENCH_ROUTINES if cli._takes(r, flag)], f"--{flag}: no routine takes it"


def test_help_shows_the_routine_options(capsys):
    assert cli.main(["bench", "--help"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    for flag, (_, text) in cli.BENCH_OPTIONS.items():
        assert f"--{flag}" in out and " ".join(text.split()[:3]) in out, flag
    assert "(default: None)" not in out[out.index("routine options") :]


def _fake_routine(monkeypatch, tmp_path):
    """Register routine ``fake`` (CPU): writes fake.json and fake.png like a real routine, records its kwargs."""
    seen = {}

    def run(out_dir=None, quick=False, shapes=None, splits=None):
        from pathlib import Path

        seen.update(out_dir=out_dir, quick=quick, shapes=shapes, splits=splits)
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        (out / "fake.png").write_bytes(b"png")
        path = out / "fake.json"
        path.write_text(json.dumps({"routine": "fake", "cases": []}))
        return path

    mod = types.ModuleType("fake_bench_routine")
    mod.run = run
    monkeypatch.setitem(sys.modules, "fake_bench_routine", mod)
    monkeypatch.setitem(cli.BENCH_ROUTINES, "fake", ("fake_bench_routine", "run"))
    monkeypatch.setattr(cli, "CPU_ROUTINES", cli.CPU_ROUTINES + ("fake",))
    return seen


def test_a_named_run_writes_beside_the_routine_file_and_stamps_its_command(monkeypatch, tmp_path, capsys):
    seen = _fake_routine(monkeypatch, tmp_path)
    (tmp_path / "fake.json").write_text("committed")
    (tmp_path / "fake.png").write_bytes(b"committed")
    argv = [
        "bench",
        "fake",
        "--out-dir",
        str(tmp_path),
        "--shapes",
        "2x64,1x128",
        "--splits",
        "0,3",
        "--name",
        "fake-sweep",
    ]
    assert cli.main(argv) == 0
    assert seen["shapes"] == ((2, 64), (1, 128)) and seen["splits"] == (0, 3) and seen["quick"] is False
    assert seen["out_dir"] != str(tmp_path)  # a scratch folder: the routine's own files are never rewritten
    assert (tmp_path / "fake.json").read_text() == "committed"
    assert (tmp_path / "fake.png").read_bytes() == b"committed"
    assert (tmp_path / "fake-sweep.png").read_bytes() == b"png"
    doc = json.loads((tmp_path / "fake-sweep.json").read_text())
    assert doc["routine"] == "fake"
    assert doc["command"] == "fp8attn bench fake --shapes 2x64,1x128 --splits 0,3 --name fake-sweep"
    assert "wrote" in capsys.readouterr().out


def test_a_plain_run_stamps_its_command_in_place(monkeypatch, tmp_path):
    _fake_routine(monkeypatch, tmp_path)
    assert cli.main(["bench", "fake", f"--out-dir={tmp_path}", "--quick"]) == 0
    assert json.loads((tmp_path / "fake.json").read_text())["command"] == "fp8attn bench fake --quick"


def test_dense_rules_parse_and_refuse_unknown_values():
    assert dense_tma.dense_rules(None) == {} and dense_tma.dense_rules("") == {}
    assert dense_tma.dense_rules(" kperm=0, consumers=3,persistent=1 ") == {"kperm": 0, "consumers": 3, "persistent": 1}
    assert dense_tma.dense_rules("stages=3") == {"stages": 3}
    for bad in ("kperm=2", "stages=5", "rings=3", "ws", "consumers=x"):
        with pytest.raises(ValueError, match="FP8ATTN_DENSE_RULES"):
            dense_tma.dense_rules(bad)


def test_ws_grid_override_beats_the_length_rule(monkeypatch):
    monkeypatch.setattr(dense_tma, "_num_sms", lambda index: 132)
    assert dense_tma.ws_grid(1000, True, 16384, 0, head_dim=128) == (1000, 1)  # per block beyond 8k queries
    assert dense_tma.ws_grid(1000, True, 16384, 0, head_dim=128, persistent=True) == (132, 1)
    assert dense_tma.ws_grid(1000, False, 1024, 0, head_dim=128, persistent=False) == (1000, 1)


def test_mla_pipeline_refuses_the_attention_only_options_before_any_gpu_work():
    from fp8attn.bench import mla

    for kw in ({"seqlen": 4096}, {"dense_rules": "stages=3"}):
        with pytest.raises(ValueError, match="--attention"):
            mla.run(**kw)


def test_with_env_restores_the_variable(monkeypatch):
    from fp8attn.bench.common import with_env

    monkeypatch.setenv("FP8ATTN_DENSE_BACKEND", "triton")
    assert with_env("FP8ATTN_DENSE_BACKEND", "tma", lambda: os.environ["FP8ATTN_DENSE_BACKEND"]) == "tma"
    assert os.environ["FP8ATTN_DENSE_BACKEND"] == "triton"
    monkeypatch.delenv("FP8ATTN_DENSE_RULES", raising=False)
    with pytest.raises(RuntimeError):
        with_env("FP8ATTN_DENSE_RULES", "kperm=0", lambda: (_ for _ in ()).throw(RuntimeError("boom")))
    assert "FP8ATTN_DENSE_RULES" not in os.environ


def test_read_ceiling_is_skipped_where_the_bytes_fit_in_l2():
    import torch

    from fp8attn.bench.paged import _read_ceiling_peer

    kc = vc = torch.empty(4, 16, 8, 128, dtype=torch.float8_e4m3fn)
    peer = _read_ceiling_peer(kc, vc, 2 * kc.numel())
    assert peer["ms"] is None and "L2" in peer["skipped"]


def test_every_results_file_names_a_command_that_parses():
    """Each committed results file records the `fp8attn bench` command that reproduces it: the routine exists
    and takes the options given."""
    import shlex
    from pathlib import Path

    files = sorted((Path(__file__).resolve().parents[2] / "benchmarks" / "results").rglob("*.json"))
    assert files
    for f in files:
        cmd = json.loads(f.read_text()).get("command")
        assert cmd, f"{f.name}: no command"
        argv = shlex.split(cmd)
        assert argv[:2] == ["fp8attn", "bench"], f"{f.name}: {cmd}"
        a = cli.build_parser().parse_args(argv[1:])
        cli._bench_options(a)  # raises for an option the routine does not take


@pytest.mark.parametrize("shape", [(1, 4096), (1, 100, 200)])
def test_prefill_chunked_refuses_bad_shapes_before_any_case(shape):
    from fp8attn.bench.paged import run_prefill_chunked

    with pytest.raises(ValueError, match="batch x keys x queries"):
        run_prefill_chunked(shapes=(shape,))


def test_set_dense_rules_round_trips_and_refuses_bad_values_without_changing_them():
    from fp8attn.bench.dense import _with_rules

    before = dense_tma.set_dense_rules("kperm=0,stages=3")
    try:
        assert dense_tma._DENSE_RULES == {"kperm": 0, "stages": 3}
        with pytest.raises(ValueError, match="FP8ATTN_DENSE_RULES"):
            dense_tma.set_dense_rules("kperm=7")
        assert dense_tma._DENSE_RULES == {"kperm": 0, "stages": 3}
        assert _with_rules("", lambda: dict(dense_tma._DENSE_RULES)) == {}
        assert dense_tma._DENSE_RULES == {"kperm": 0, "stages": 3}
    finally:
        assert dense_tma.set_dense_rules(before) == "kperm=0,stages=3"


def test_dense_rules_come_from_the_environment_on_first_use(monkeypatch):
    monkeypatch.setattr(dense_tma, "_DENSE_RULES", None)
    monkeypatch.setenv("FP8ATTN_DENSE_RULES", "persistent=0")
    assert dense_tma._dense_rules_now() == {"persistent": 0}
    monkeypatch.setattr(dense_tma, "_DENSE_RULES", None)
    monkeypatch.setenv("FP8ATTN_DENSE_RULES", "persistent=9")
    with pytest.raises(ValueError, match="FP8ATTN_DENSE_RULES"):
        dense_tma._dense_rules_now()

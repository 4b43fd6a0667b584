"""The README's quickstart runs as written (CPU path) and prints what its comment says."""

import contextlib
import io
import pathlib
import re

README = pathlib.Path(__file__).resolve().parents[2] / "README.md"


def test_quickstart_runs():
    text = README.read_text()
    block = re.search(r"## Quickstart\s+```python\n(.*?)```", text, re.S)
    assert block, "README has no python quickstart block"
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        exec(compile(block.group(1), "README quickstart", "exec"), {})
    assert "torch.bfloat16 torch.Size([2, 1024, 8, 128])" in buf.getvalue()


def test_readme_gives_the_two_setup_commands():
    text = README.read_text()
    assert "make demo" in text and "make test" in text

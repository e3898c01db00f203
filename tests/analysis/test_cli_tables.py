"""The `fastlm analyze` tables at 80 columns: every line fits and no number is cut to '…'."""

import io

import pytest
from rich.cells import cell_len
from rich.console import Console

from fastlm.cli import main, output

WIDTH = 80


@pytest.mark.parametrize(
    "argv",
    [
        ["analyze", "xent"],
        ["analyze", "xent", "--batch", "1", "--vocab", "7"],  # tiny sizes: kB and µs, not GB and ms
        ["analyze", "conv1d"],
        ["analyze", "conv1d", "--batch", "64", "--length", "131072", "--activation", "silu", "--no-bias"],
        ["analyze", "attention"],
        ["analyze", "mha"],  # compute- and memory-bound stages side by side
        ["analyze", "mlp", "--batch", "1024", "--seq", "65536", "--d-model", "65536"],  # values past 1e18 FLOPs
        ["analyze", "memory"],
        # every fsdp row, communication and the context sweep
        ["analyze", "memory", "--preset", "10b", "--parallel", "fsdp", "--gpus", "4", "--recompute", "--contexts", "1"],
        ["analyze", "parallel"],
        ["analyze", "parallel", "--y", "21", "--x", "3"],  # the branch without a compute-bound batch
    ],
)
def test_table_fits_80_columns(argv, monkeypatch):
    out = io.StringIO()
    monkeypatch.setattr(output, "console", Console(file=out, width=WIDTH, force_terminal=False))
    assert main(argv) == 0
    text = out.getvalue()
    assert "┃" in text  # a table was drawn
    widest = max(text.splitlines(), key=cell_len)
    assert cell_len(widest) <= WIDTH, widest
    assert "…" not in text

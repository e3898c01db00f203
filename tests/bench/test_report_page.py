"""`fastlm report`'s page without a GPU: its one CPU note first, the sections' own notes left out."""

from fastlm.bench.bandwidth import CPU_NOTE
from fastlm.bench.host import HostBenchmark
from fastlm.cli.report import without_cpu_notes


def test_the_sections_cpu_notes_are_left_out_and_their_tables_kept():
    host_note = f"**{HostBenchmark.cpu_note}**"  # bold in its section
    section = "\n\n".join(["## Norms", CPU_NOTE, "| a | b |\n| --- | --- |", host_note, "![plot](p.png)"])
    assert without_cpu_notes(section) == "## Norms\n\n| a | b |\n| --- | --- |\n\n![plot](p.png)"

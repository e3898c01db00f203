import time

from fastlm.utils.progress import ordinal, progress_steps


def test_piped_progress_speaks_at_once_and_while_a_long_step_runs(capsys):
    with progress_steps("work", 2, heartbeat_s=0.05) as step:
        time.sleep(0.3)  # a step six heartbeats long
        step("first")
        step("second")  # a quick one: no heartbeat
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "work: 2 measurements"
    beats = lines[1:-2]
    assert len(beats) >= 3 and all(line.startswith("work 0/2: the 1st running for ") for line in beats)
    assert lines[-2:] == ["work 1/2: first", "work 2/2: second"]


def test_progress_names_its_unit():
    assert [ordinal(n) for n in (1, 2, 3, 4, 11, 12, 13, 21, 22, 101, 111)] == [
        "1st", "2nd", "3rd", "4th", "11th", "12th", "13th", "21st", "22nd", "101st", "111th"
    ]  # fmt: skip

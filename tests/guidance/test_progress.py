"""Progress without a terminal: plain lines every ~10 % and 30 s (whichever is later), and a final one."""
from __future__ import annotations

import io

import pytest

from fedguide.guidance.progress import Every, PlainLines, clock_text, interactive, progress, rate_text


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def lines_of(stream: io.StringIO) -> list[str]:
    return stream.getvalue().splitlines()


def test_a_line_needs_both_ten_percent_more_and_thirty_seconds():
    out, clock = io.StringIO(), Clock()
    bar = PlainLines(stream=out, clock=clock)
    task = bar.add_task("image features", total=1000, unit="img")
    clock.now += 5
    bar.update(task, advance=500)  # half done, but only 5 s since the start: not yet
    assert lines_of(out) == []
    clock.now += 25
    bar.update(task, advance=10)  # 30 s and 51 %: due
    assert lines_of(out) == ["image features: 510/1000 (51%) 17.0 img/s, 00:29 left"]
    clock.now += 600
    bar.update(task, advance=50)  # 10 minutes later but only 5 % more: not yet
    assert len(lines_of(out)) == 1
    bar.update(task, advance=50)  # 15 % more since the last line, and long after it
    assert lines_of(out)[-1].startswith("image features: 610/1000 (61%) 1.0 s/img, ")
    clock.now += 1
    bar.update(task, advance=100)  # 10 % more, but only 1 s after the last line
    assert len(lines_of(out)) == 2


def test_the_final_line_comes_at_once_and_only_once():
    out, clock = io.StringIO(), Clock()
    bar = PlainLines(stream=out, clock=clock)
    task = bar.add_task("sampling", total=4, unit="img")
    clock.now += 8
    bar.update(task, advance=4)
    bar.update(task, advance=0)
    assert lines_of(out) == ["sampling: 4/4 (100%) 2.0 s/img, 00:08 in all"]


def test_at_most_about_ten_lines_for_a_long_steady_step():
    out, clock = io.StringIO(), Clock()
    bar = PlainLines(stream=out, clock=clock)
    task = bar.add_task("features", total=10_000)
    for _ in range(10_000):  # 1 item per second: 10 % takes 1000 s, far longer than 30 s
        clock.now += 1
        bar.update(task, advance=1)
    shown = lines_of(out)
    assert len(shown) == 10  # 9 at 10 %, 20 %, ... 90 % and the final one
    assert shown[0] == "features: 1000/10000 (10%) 1.0 it/s, 2:30:00 left"
    assert shown[-1].endswith("2:46:40 in all")


def test_a_fast_step_prints_no_more_than_one_line_per_interval():
    out, clock = io.StringIO(), Clock()
    bar = PlainLines(stream=out, clock=clock, every=Every(fraction=0.1, seconds=30))
    task = bar.add_task("rounds", total=100, unit="round")
    for _ in range(99):  # a round per second: 10 % every 10 s, so the 30 s rule decides
        clock.now += 1
        bar.update(task, advance=1)
    assert [line.split(" ")[1] for line in lines_of(out)] == ["30/100", "60/100", "90/100"]


def test_a_resumed_step_counts_only_its_own_items_in_the_rate():
    out, clock = io.StringIO(), Clock()
    bar = PlainLines(stream=out, clock=clock)
    task = bar.add_task("features", total=100, completed=60)
    clock.now += 40
    bar.update(task, advance=20)
    assert lines_of(out) == ["features: 80/100 (80%) 2.0 s/it, 00:40 left"]


def test_no_final_line_when_asked_for_none():
    out, clock = io.StringIO(), Clock()
    bar = PlainLines(stream=out, clock=clock, final=False)
    task = bar.add_task("rounds", total=2)
    bar.update(task, advance=2)
    assert out.getvalue() == ""


def test_progress_writes_plain_lines_to_stderr_off_a_terminal(capsys):
    assert not interactive()  # pytest captures stderr: not a terminal
    with progress(3, "alignment targets", unit="img") as advance:
        advance(2)
        advance(1)
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith("alignment targets: 3/3 (100%) ") and err[0].endswith(" in all")
    with progress(3, "quiet", enabled=False) as advance:
        advance(3)
    assert capsys.readouterr().err == ""


def test_progress_takes_injected_lines():
    out, clock = io.StringIO(), Clock()
    with progress(10, "UNet", unit="step", lines=PlainLines(stream=out, clock=clock)) as advance:
        clock.now += 31
        advance(5)
        advance(5)
    assert lines_of(out)[0] == "UNet: 5/10 (50%) 6.2 s/step, 00:31 left"
    assert lines_of(out)[1].startswith("UNet: 10/10 (100%) ")


@pytest.mark.parametrize("seconds, text", [(0, "00:00"), (59.6, "01:00"), (674, "11:14"), (3600, "1:00:00")])
def test_clock_text(seconds, text):
    assert clock_text(seconds) == text


def test_rate_text_turns_slow_rates_around():
    assert rate_text(23.14, "img") == "23.1 img/s"
    assert rate_text(0.25, "round") == "4.0 s/round"


def test_a_terminal_is_interactive():
    class Tty(io.StringIO):
        def isatty(self) -> bool:
            return True

    assert interactive(Tty()) and not interactive(io.StringIO())


# ---- the rounds of a run (cli.py) -----------------------------------------------------------------------
def test_the_command_line_shows_rounds_as_plain_lines_off_a_terminal():
    from rich.console import Console
    from rich.progress import Progress

    from fedguide.cli import _progress

    plain = _progress(Console(file=io.StringIO()), quiet=False)
    assert isinstance(plain, PlainLines) and plain.unit == "round" and not plain.final  # the run's last line follows
    assert isinstance(_progress(Console(file=io.StringIO(), force_terminal=True), quiet=False), Progress)
    assert _progress(Console(file=io.StringIO()), quiet=True) is None


def test_a_run_adds_rate_and_time_left_beside_its_round_lines(tmp_path):
    from tests.tiny import tiny_config

    from fedguide.fl.engine import Experiment
    from fedguide.fl.setup import prepare

    out, clock, logged = io.StringIO(), Clock(), []

    def log(line):
        logged.append(line)
        clock.now += 20  # every round takes 20 s of the injected clock

    lines = PlainLines(stream=out, clock=clock, unit="round", final=False)
    Experiment(prepare(tiny_config(train={"rounds": 5})), tmp_path / "run", log=log, progress=lines).run()
    assert sum(line.startswith("round ") for line in logged) == 5  # one round line each, as on a terminal
    # 30 s since the last line: after rounds 2 and 4 (40 s, 80 s); the run's own final line ends it.
    assert lines_of(out) == ["rounds: 2/5 (40%) 20.0 s/round, 01:00 left",
                             "rounds: 4/5 (80%) 20.0 s/round, 00:20 left"]

"""The console's pieces alone: lines above the bar, file-only records, the legend of a run without validation."""

import io
import logging
import warnings

import pyte

from nemo_fp8.utils.console import FILE_ONLY, ConsoleHandler, LinesAboveBar, StepBar, run_console
from nemo_fp8.utils.plots import plot_parity


class _Terminal(io.StringIO):
    def isatty(self):
        return True


def test_lines_wait_for_their_newline_and_a_carriage_return_keeps_the_last_state():
    out, tee = io.StringIO(), io.StringIO()
    s = LinesAboveBar(out, tee)
    s.write("half a ")
    assert out.getvalue() == ""
    s.write("line\nbar 10%\rbar 50%\rbar 100%\n\x1b[36m(worker)\x1b[0m hi\n")
    assert out.getvalue() == "half a line\nbar 100%\n\x1b[36m(worker)\x1b[0m hi\n"
    assert tee.getvalue() == "half a line\nbar 100%\n(worker) hi\n"  # the log file: no colour codes


def test_a_line_written_while_the_bar_shows_goes_above_it(monkeypatch):
    term = _Terminal()
    monkeypatch.setattr("sys.stderr", term)
    monkeypatch.setattr("sys.stdout", term)
    with run_console(None):
        bar = StepBar(range(1, 3), 0, 2, "grpo")
        for _ in bar:
            print("row")
    screen = pyte.Screen(80, 10)
    screen.set_mode(pyte.modes.LNM)
    pyte.Stream(screen).feed(term.getvalue())
    shown = [line.rstrip() for line in screen.display if line.strip()]
    assert shown[:2] == ["row", "row"] and shown[2].startswith("grpo: 100%") and len(shown) == 3, shown

def test_file_only_records_reach_the_log_file_not_the_console(tmp_path, monkeypatch):
    term = io.StringIO()
    monkeypatch.setattr("sys.stderr", term)
    log = logging.getLogger("test_console_units")
    handler = ConsoleHandler()
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    try:
        with run_console(tmp_path / "console.log") as log_file:
            log.info("before the run owns its folder")
            assert not (tmp_path / "console.log").exists()  # a refused run leaves nothing behind
            log_file.open()
            log.info("checkpoint saved: x", extra=FILE_ONLY)
            log.info("shown")
    finally:
        log.removeHandler(handler)
    assert "shown" in term.getvalue() and "checkpoint saved" not in term.getvalue()
    text = (tmp_path / "console.log").read_text()
    assert "checkpoint saved: x" in text and text.count("shown") == 1  # the console's copy is not added twice
    assert text.index("before the run owns") < text.index("checkpoint saved")


def test_plot_of_a_run_without_validation_warns_nothing(tmp_path):
    rows = [{"step": s, "train/reward_mean": 0.1 * s, "mismatch/gen_kl_error": 1e-3} for s in range(1, 4)]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert plot_parity({"run": rows}, tmp_path / "c.png").exists()


def test_each_thread_keeps_its_own_partial_line():
    """``print`` writes its text and its newline in two calls; another thread's whole line between them stays whole."""
    import threading

    out = io.StringIO()
    s = LinesAboveBar(out)
    s.write("main thread: ")
    t = threading.Thread(target=lambda: (s.write("ray log line"), s.write("\n")))
    t.start()
    t.join()
    s.write("done\n")
    s.write("left open")
    s.end_partial_lines()
    assert out.getvalue().splitlines() == ["ray log line", "main thread: done", "left open"]

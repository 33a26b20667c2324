"""What a person sees: the tiny job in a real pseudo-terminal, its screen rebuilt by a terminal emulator (pyte), and
the same job with its output redirected to a pipe (nemo_fp8/utils/console.py)."""

import fcntl
import os
import pty
import re
import select
import struct
import subprocess
import sys
import termios
import time
from pathlib import Path

import pyte
import pytest

from nemo_fp8.utils.logger import ROW_COLUMNS
from tests.integration.test_main_job import FAST, SCRIPT

REPO = Path(__file__).resolve().parents[2]
COLS, LINES = 160, 50
STEPS = 3
ROW = re.compile(r"^\s*(\d+)(\s+\S+){%d}\s*$" % (len(ROW_COLUMNS) - 1))  # a whole row: every column's cell
BAR = re.compile(r"\d+/\d+ \[[^\]]*(s/step|step/s|\?)")  # tqdm's counter and rate: a progress bar's line
FOREIGN = ("Writing model shards", "Loading weights", "No artists with labels", "validation @ step",
           "Token authentication is enabled")


def _job(model_dir, out: Path) -> list[str]:
    return [sys.executable, str(SCRIPT), f"policy.model_name={model_dir}", "policy.tiny_model.build_if_missing=false",
            f"logger.log_dir={out / 'logs'}", f"checkpointing.checkpoint_dir={out / 'ckpt'}", *FAST,
            f"grpo.max_num_steps={STEPS}", "checkpointing.save_period=1", "checkpointing.keep_last_k=5"]


def _run_in_terminal(cmd: list[str], timeout_s: float = 300) -> tuple[int, bytes]:
    """Run ``cmd`` with stdin, stdout and stderr on one pseudo-terminal of COLS x LINES; its exit code and bytes."""
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", LINES, COLS, 0, 0))
    env = {**os.environ, "TERM": "xterm", "COLUMNS": str(COLS), "LINES": str(LINES), "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(cmd, stdin=slave, stdout=slave, stderr=slave, cwd=REPO, env=env, close_fds=True)
    os.close(slave)
    out, deadline = bytearray(), time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        ready, _, _ = select.select([master], [], [], 0.5)
        if ready:
            try:
                chunk = os.read(master, 65536)
            except OSError:  # EIO: every writer of the terminal has closed it
                break
            if not chunk:
                break
            out += chunk
        elif proc.poll() is not None:
            break
    else:
        proc.kill()
    os.close(master)
    return proc.wait(timeout=30), bytes(out)


def _screen_lines(raw: bytes) -> list[str]:
    """The lines a terminal shows after ``raw``: a screen tall enough that nothing scrolls off it."""
    screen = pyte.Screen(COLS, 2000)
    screen.set_mode(pyte.modes.LNM)  # a line feed returns the carriage too (a pipe's bare "\n", as a terminal shows it)
    pyte.ByteStream(screen).feed(raw)
    lines = [line.rstrip() for line in screen.display]
    while lines and not lines[-1]:
        lines.pop()
    return lines


def _check_console(lines: list[str], bars_expected: int) -> None:
    header = [i for i, line in enumerate(lines) if line.split()[:3] == ["step", "reward", "val_acc"]]
    assert len(header) == 1, lines
    rows = [line for line in lines if ROW.match(line)]
    assert [int(r.split()[0]) for r in rows] == list(range(STEPS + 1)), "\n".join(lines)  # each step once, whole
    assert all(len(r.split()) == len(ROW_COLUMNS) for r in rows)
    assert [line for line in lines if BAR.search(line)] == [line for line in lines if line.startswith("grpo:")]
    assert len([line for line in lines if line.startswith("grpo:")]) == bars_expected, "\n".join(lines)
    for text in FOREIGN:
        assert not any(text in line for line in lines), (text, "\n".join(lines))
    assert not any("checkpoint saved" in line for line in lines)  # in console.log only
    assert lines[-1].startswith(f"done: {STEPS} steps; final validation accuracy"), "\n".join(lines[-5:])


def _check_log_file(out: Path) -> None:
    log = (out / "logs" / "console.log").read_text()
    for step in range(1, STEPS + 1):
        assert f"checkpoint saved: {out / 'ckpt' / f'step_{step}'}" in log
    assert "preflight:" in log and "\x1b[" not in log
    rows = [line for line in log.splitlines() if ROW.match(line)]
    assert [int(r.split()[0]) for r in rows] == list(range(STEPS + 1))


@pytest.mark.slow
def test_terminal_shows_one_row_per_step_one_bar_and_the_summary_last(tiny_model_dir, tmp_path):
    code, raw = _run_in_terminal(_job(tiny_model_dir, tmp_path))
    lines = _screen_lines(raw)
    assert code == 0, "\n".join(lines[-40:])
    _check_console(lines, bars_expected=1)
    _check_log_file(tmp_path)


@pytest.mark.slow
def test_redirected_output_has_the_same_rows_and_no_bar(tiny_model_dir, tmp_path):
    proc = subprocess.run(_job(tiny_model_dir, tmp_path), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          timeout=300, cwd=REPO, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    lines = _screen_lines(proc.stdout)
    assert proc.returncode == 0, "\n".join(lines[-40:])
    _check_console(lines, bars_expected=0)
    assert b"\r" not in proc.stdout  # no bar redraws in a log file
    _check_log_file(tmp_path)

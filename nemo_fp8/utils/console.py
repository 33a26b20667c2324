"""The run's console: one row per step and one progress bar pinned at the bottom; the run's log file keeps the rest.

What a run shows (NeMo-RL and verl print one block or line per step):

- the step table's rows and every other whole line (the driver's log records, what Ray forwards from the workers'
  stdout and stderr, prints) are written *above* the progress bar: the bar is cleared, the line written, the bar
  drawn again under the tqdm lock, as ``tqdm.write`` does for its own writes. Partial lines wait for their newline,
  so nothing is cut mid-line by a bar redraw;
- per-step messages (a checkpoint saved) are logged with ``extra=FILE_ONLY``: they go to
  ``<logger.log_dir>/console.log`` and not to the console (the row's ``ckpt_s`` column says a checkpoint was written);
- libraries' own progress bars (Hugging Face's "Loading weights" / "Writing model shards", per step in the workers)
  are turned off at their source (:func:`quiet_library_progress`);
- ``console.log`` gets every log record and every line the console showed, with or without a terminal. Redirected to a
  file (no terminal), the bar is off (tqdm's ``disable=None``) and the console holds the same rows and lines.
"""

from __future__ import annotations

import contextlib
import io
import logging
import re
import sys
import threading
from pathlib import Path
from typing import IO, Iterable, Iterator, Optional

from tqdm import tqdm

FILE_ONLY = {"console": False}  # ``logger.info(..., extra=FILE_ONLY)``: the run's log file only
LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"

_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")  # colour codes (Ray's worker prefixes): not in the log file
_bars: list[tqdm] = []  # the bars drawn now (cleared and redrawn around every line written above them)


def _write_above_bars(stream: IO[str], text: str) -> None:
    """Write whole lines ``text`` to ``stream`` above the bars shown now (each cleared, then redrawn)."""
    with tqdm.get_lock():
        for bar in _bars:
            bar.clear(nolock=True)
        stream.write(text)
        stream.flush()
        for bar in _bars:
            bar.refresh(nolock=True)


class LinesAboveBar(io.TextIOBase):
    """A text stream that writes whole lines to ``stream`` above the progress bars, and a copy to ``tee``.

    A carriage return without a newline (another program's progress bar) keeps only the text after it: the line
    shows its last state once, when its newline comes. Each thread's partial line is its own (``print`` writes the
    text and its newline in two calls, and Ray's log thread prints while the main thread does).
    """

    def __init__(self, stream: IO[str], tee: Optional[IO[str]] = None):
        super().__init__()
        self.stream, self.tee = stream, tee
        self._partial: dict[int, str] = {}  # thread id -> its line so far

    def write(self, s: str) -> int:
        me = threading.get_ident()
        with tqdm.get_lock():
            text = self._partial.pop(me, "") + s
            if "\n" not in text:
                self._partial[me] = text
                return len(s)
            lines, rest = text.rsplit("\n", 1)
            if rest:
                self._partial[me] = rest
            lines = "\n".join(part.rsplit("\r", 1)[-1] for part in lines.split("\n")) + "\n"
            _write_above_bars(self.stream, lines)
            if self.tee is not None:
                self.tee.write(_ANSI.sub("", lines))
                self.tee.flush()
        return len(s)

    def end_partial_lines(self) -> None:
        """Write every thread's unfinished line, ended (at the end of the run)."""
        with tqdm.get_lock():
            rests, self._partial = list(self._partial.values()), {}
        for rest in rests:
            self.write(rest + "\n")

    def flush(self) -> None:
        self.stream.flush()

    def isatty(self) -> bool:
        return bool(getattr(self.stream, "isatty", lambda: False)())

    def fileno(self) -> int:
        return self.stream.fileno()

    @property
    def encoding(self):
        return getattr(self.stream, "encoding", "utf-8")


def _underlying(stream: IO[str]) -> IO[str]:
    return stream.stream if isinstance(stream, LinesAboveBar) else stream


class ConsoleHandler(logging.StreamHandler):
    """The console's log handler: writes to the ``sys.stderr`` of the moment (above the bar while one is shown,
    not copied to ``console.log``, which has its own handler), and drops records logged with ``extra=FILE_ONLY``."""

    def __init__(self):
        super().__init__(sys.stderr)
        self.addFilter(lambda record: getattr(record, "console", True))

    def emit(self, record: logging.LogRecord) -> None:
        try:
            text = self.format(record) + "\n"
            stream = sys.stderr
            if isinstance(stream, LinesAboveBar):
                _write_above_bars(stream.stream, text)
            else:
                stream.write(text)
                stream.flush()
        except Exception:  # logging's own rule: a failing handler reports and goes on
            self.handleError(record)


def configure_console_logging(level: int = logging.INFO) -> None:
    """The root logger's console handler (:class:`ConsoleHandler`, ``LOG_FORMAT``), replacing any stream handler
    ``logging.basicConfig`` made; library progress bars off (:func:`quiet_library_progress`)."""
    root = logging.getLogger()
    for h in list(root.handlers):
        if type(h) is logging.StreamHandler or isinstance(h, ConsoleHandler):
            root.removeHandler(h)
    handler = ConsoleHandler()
    handler.setFormatter(logging.Formatter(LOG_FORMAT))
    root.addHandler(handler)
    root.setLevel(level)
    quiet_library_progress()


def quiet_library_progress() -> None:
    """Turn off Hugging Face's progress bars (transformers' "Loading weights", "Writing model shards"; the hub's
    downloads) in this process: in a Ray worker they arrive on the driver's console as fragments, every step."""
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
    except ImportError:
        pass
    try:
        from huggingface_hub.utils import disable_progress_bars

        disable_progress_bars()
    except ImportError:
        pass


class LogFile(io.TextIOBase):
    """The run's log file, written from the first :meth:`open` on: what comes before (the preflight's lines) is
    kept in memory and written then, so a run refused before it owns its folders creates none."""

    def __init__(self, path: Path):
        super().__init__()
        self.path, self._file, self._early = Path(path), None, []

    def open(self) -> None:
        """Create the folder and the file (appended to: a resumed run continues it) and write what came before."""
        if self._file is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._file = open(self.path, "a", encoding="utf-8")
            self._file.write("".join(self._early))
            self._file.flush()
            self._early = []

    def write(self, s: str) -> int:
        if self._file is None:
            self._early.append(s)
        else:
            self._file.write(s)
        return len(s)

    def flush(self) -> None:
        if self._file is not None:
            self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
        self._early = []
        super().close()


@contextlib.contextmanager
def run_console(log_file: Optional[Path]) -> Iterator[Optional[LogFile]]:
    """For the block: ``sys.stdout`` / ``sys.stderr`` write whole lines above the progress bar
    (:class:`LinesAboveBar`), and ``log_file`` (None: none) gets every log record at INFO and above plus a copy of
    every line written to the console, from the yielded :class:`LogFile`'s ``open()`` on (earlier lines are kept
    for it). Put back as they were at the end."""
    handler = out_file = None
    if log_file is not None:
        out_file = LogFile(log_file)
        handler = logging.StreamHandler(out_file)
        handler.setFormatter(logging.Formatter(LOG_FORMAT))
        handler.setLevel(logging.INFO)
        logging.getLogger().addHandler(handler)
    saved = sys.stdout, sys.stderr
    sys.stdout, sys.stderr = (LinesAboveBar(_underlying(s), out_file) for s in saved)
    try:
        yield out_file
    finally:
        for s in (sys.stdout, sys.stderr):
            if isinstance(s, LinesAboveBar):
                s.end_partial_lines()
        sys.stdout, sys.stderr = saved
        _bars.clear()  # a bar an error left open draws no more
        if handler is not None:
            logging.getLogger().removeHandler(handler)
            handler.close()
            out_file.close()


class StepBar(tqdm):
    """The run's one progress bar, over the step numbers: on the real stderr (not through :class:`LinesAboveBar`),
    off where stderr is no terminal; lines written to the console while it is open go above it. ``close()`` (at the
    end of the iteration, or by the caller after an error) leaves it on screen at its last state."""

    def __init__(self, steps: Iterable[int], initial: int, total: int, desc: str):
        super().__init__(steps, initial=initial, total=total, desc=desc, unit="step", dynamic_ncols=True,
                         file=_underlying(sys.stderr), disable=None)
        with tqdm.get_lock():
            _bars.append(self)

    def close(self) -> None:
        with tqdm.get_lock():
            if self in _bars:
                _bars.remove(self)
        super().close()

"""Metrics: one console row per step, JSONL, TensorBoard, optional wandb, and a closing PNG."""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path
from typing import Any

from tqdm import tqdm

from nemo_fp8.utils.config import LoggerConfig
from nemo_fp8.utils.run_dir import RunFailed, os_error_reason

logger = logging.getLogger(__name__)

# (metric key, column header, format) of the console row; missing values print as "-".
ROW_COLUMNS = [
    ("step", "step", "{:>5d}"),
    ("train/reward_mean", "reward", "{:>7.3f}"),
    ("val/accuracy", "val_acc", "{:>7.3f}"),
    ("mismatch/gen_kl_error", "gen_kl", "{:>9.2e}"),
    ("mismatch/token_mult_prob_error", "mult_prob", "{:>9.4f}"),
    ("loss/is_weight_mean", "is_mean", "{:>7.3f}"),
    ("loss/is_weight_min", "is_min", "{:>7.3f}"),
    ("loss/is_weight_max", "is_max", "{:>7.3f}"),
    ("loss/is_frac_tokens_truncated", "is_trunc", "{:>8.4f}"),
    ("perf/rollout_tokens_per_s", "tok/s", "{:>8.0f}"),
    ("generation/engines", "engines", "{:>7.0f}"),
    ("generation/engine_imbalance", "eng_imb", "{:>7.2f}"),
    ("timing/step", "step_s", "{:>7.2f}"),
    ("timing/checkpoint", "ckpt_s", "{:>6.2f}"),  # "-": no checkpoint this step
]


def format_header() -> str:
    return " ".join(f"{h:>{len(f.format(0) if 'd' in f else f.format(0.0))}}" for _, h, f in ROW_COLUMNS)


def format_row(metrics: dict[str, Any]) -> str:
    cells = []
    for key, header, fmt in ROW_COLUMNS:
        width = len(fmt.format(0) if "d" in fmt else fmt.format(0.0))
        v = metrics.get(key)
        cells.append(fmt.format(v) if v is not None and not (isinstance(v, float) and math.isnan(v)) else f"{'-':>{width}}")
    return " ".join(cells)


class MetricsWriteError(RunFailed):
    """``metrics.jsonl`` could not be written (a full disk, a read-only file system, the folder removed, an I/O
    error); the message names the file and the error. The trainer ends the run with it and the resume hint; the
    step's checkpoint, written after its row, is not committed, so ``--resume`` redoes that step."""


class MetricsLogger:
    """Writes ``metrics.jsonl`` (one object per step), TensorBoard scalars and wandb (if enabled).

    ``log(step, metrics)`` takes flat ``group/name`` keys. ``close()`` writes ``curves.png``.
    ``metrics.jsonl`` is only ever appended to: a fresh run into a folder with another run's
    metrics is refused before this is built (``utils/run_dir.claim_fresh``), and a resumed run
    repairs the file first (``repair_metrics``).
    """

    def __init__(self, cfg: LoggerConfig, run_config: dict, resume: bool = False):
        self.cfg = cfg
        self.dir = Path(cfg.log_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.jsonl_path = self.dir / "metrics.jsonl"
        self._tb = self._wandb = None
        if cfg.tensorboard_enabled:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(log_dir=str(self.dir / "tensorboard"))
        if cfg.wandb_enabled:
            import wandb

            self._wandb = wandb.init(project=cfg.wandb.project, name=cfg.wandb.name, mode=cfg.wandb.mode,
                                     config=run_config, dir=str(self.dir), resume="allow" if resume else None)
        self._printed_header = False

    def log(self, step: int, metrics: dict[str, float]) -> None:
        """Append step ``step``'s row to ``metrics.jsonl``, then TensorBoard, wandb and the console.

        Raises:
            MetricsWriteError: ``metrics.jsonl`` could not be written (any ``OSError``; names the file and why).
        """
        row = {"step": step, **{k: (float(v) if isinstance(v, (int, float)) else v) for k, v in metrics.items()}}
        try:
            with self.jsonl_path.open("a") as f:
                f.write(json.dumps(row) + "\n")
        except OSError as e:
            raise MetricsWriteError(f"the metrics file {self.jsonl_path} (logger.log_dir) could not be written at "
                                    f"step {step}: {os_error_reason(e)}") from e
        numeric = {k: v for k, v in row.items() if isinstance(v, float) and k != "step"}
        if self._tb is not None:
            for k, v in numeric.items():
                self._tb.add_scalar(k, v, step)
            self._tb.flush()
        if self._wandb is not None:
            self._wandb.log(numeric, step=step)
        if not self._printed_header:
            tqdm.write(format_header())
            self._printed_header = True
        tqdm.write(format_row(row))

    def close(self) -> Path | None:
        """Flush writers and draw the reward/mismatch curves; returns the PNG path (or None). A folder that can no
        longer be written (the run may be ending because of it, ``MetricsWriteError``) is logged, not raised: it
        must not replace the error that ends the run."""
        try:
            if self._tb is not None:
                self._tb.close()
            if self._wandb is not None:
                self._wandb.finish()
            if self.cfg.plot_enabled and self.jsonl_path.exists():
                return plot_curves(self.jsonl_path, self.dir / "curves.png")
        except OSError as e:
            logger.warning("closing the metrics writers in %s: %s", self.dir, os_error_reason(e))
        return None


def plot_curves(jsonl_path: Path, png_path: Path) -> Path:
    """Draw validation accuracy, reward, gen_kl_error and token_mult_prob_error against step
    (the parity report's four panels, ``nemo_fp8.utils.plots.plot_parity``, for one run)."""
    from nemo_fp8.utils.plots import plot_parity

    name = str(Path(jsonl_path).parent.name)
    return plot_parity({name: read_metrics(jsonl_path)}, png_path, title=name)


def read_metrics(jsonl_path: Path) -> list[dict]:
    """The rows of a ``metrics.jsonl``; a line that does not parse (a partial last line) is skipped."""
    rows = []
    for line in Path(jsonl_path).read_text(errors="replace").splitlines():
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if isinstance(row, dict):
            rows.append(row)
    return rows


def repair_metrics(jsonl_path: Path, resume_step: int) -> int:
    """Make ``metrics.jsonl`` consistent before a resumed run appends to it; returns rows moved.

    A partial last line (a kill while writing) and the rows a resumed run will write again (steps
    after ``resume_step``; all rows when it restarts from step 0) are moved, not deleted, to
    ``metrics.superseded.jsonl`` beside it. The file is rewritten atomically.
    """
    jsonl_path = Path(jsonl_path)
    if not jsonl_path.is_file():
        return 0
    keep, moved = [], []
    for line in jsonl_path.read_text(errors="replace").splitlines():
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            ok = isinstance(row, dict) and resume_step > 0 and int(row.get("step", -1)) <= resume_step
        except (ValueError, TypeError):
            ok = False
        (keep if ok else moved).append(line)
    if moved:
        with (jsonl_path.parent / "metrics.superseded.jsonl").open("a") as f:
            f.write("".join(x + "\n" for x in moved))
        tmp = jsonl_path.with_suffix(".jsonl.tmp")
        tmp.write_text("".join(x + "\n" for x in keep))
        tmp.replace(jsonl_path)
        logger.info("metrics: %d row(s) after step %d or unreadable moved to metrics.superseded.jsonl", len(moved),
                    resume_step)
    return len(moved)

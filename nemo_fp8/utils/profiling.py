"""An opt-in ``torch.profiler`` window over a few micro-batches of one training call, set by the config section
``policy.profile`` (``nemo_fp8.utils.config.ProfileConfig``), so a run of the unchanged command can be profiled
with overrides (``policy.profile.dir=prof``) and the run's ``config.yaml`` says it was:

* ``dir``: where each rank writes its table (None: no profiling, no cost);
* ``train_call``: which training call of the process to profile (1-based, default 3: the first two carry the
  warm-up: kernel selection, allocator growth);
* ``micro_batches``: how many micro-batches it records (default 6, after one untimed);
* ``trace``: also the Chrome trace of the window, ``train_call<N>_rank<R>.json.gz`` (chrome://tracing or
  Perfetto; tens of MB for an 8B model's 6 micro-batches).

The output, ``train_call<N>_rank<R>.txt``, holds three parts: the window's wall time against its GPU kernel
time (NCCL's share apart: a collective that waits for a peer rank counts as kernel time), then
``key_averages()`` sorted by device time (the kernels and ops a slow phase spends its time in) and sorted by
self CPU time (where the host goes when the GPU waits on it: Python in an autograd Function, a blocking copy).
"""

from __future__ import annotations

import gzip
import shutil
import time
from pathlib import Path
from typing import Optional

from nemo_fp8.utils.config import ProfileConfig


class TrainProfiler:
    """``step()`` after every micro-batch, ``close()`` after the call; a no-op unless this call is the profiled one.

    Args:
        call: this training call's number in the process (1-based).
        rank: the policy rank (names the output files).
        cfg: the ``policy.profile`` section.
    """

    def __init__(self, call: int, rank: int, cfg: ProfileConfig):
        self._prof = None
        if not cfg.dir or call != cfg.train_call:
            return
        import torch

        active, out, self._trace = cfg.micro_batches, cfg.dir, cfg.trace
        activities = [torch.profiler.ProfilerActivity.CPU]
        if torch.cuda.is_available():
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        self.path: Optional[Path] = Path(out) / f"train_call{call}_rank{rank}.txt"
        self._prof = torch.profiler.profile(activities=activities,
                                            schedule=torch.profiler.schedule(wait=0, warmup=1, active=active, repeat=1),
                                            on_trace_ready=self._write)
        self._active, self._steps, self._recorded, self._t0, self._wall = active, 0, 0, 0.0, 0.0
        self._sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
        self._prof.start()

    def _write(self, prof) -> None:
        from torch.autograd import DeviceType

        events = prof.key_averages()
        # kernels only: torch's table total leaves out GPU-side annotations (``ProfilerStep*``, ``nccl:coalesced``)
        kernels = [e for e in events
                   if e.device_type == DeviceType.CUDA and not getattr(e, "is_user_annotation", False)]
        gpu_s = sum(e.self_device_time_total for e in kernels) / 1e6
        nccl_s = sum(e.self_device_time_total for e in kernels if "nccl" in e.key.lower()) / 1e6
        head = (f"window: {self._recorded} micro-batches, wall {self._wall:.3f} s, GPU kernels {gpu_s:.3f} s "
                f"(NCCL {nccl_s:.3f} s, other {gpu_s - nccl_s:.3f} s)\n")
        by_device = "device_time_total" if gpu_s else "cpu_time_total"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.write_text(head + f"\n# by {by_device}\n"
                             + events.table(sort_by=by_device, row_limit=60, max_name_column_width=90)
                             + "\n# by self_cpu_time_total\n"
                             + events.table(sort_by="self_cpu_time_total", row_limit=40, max_name_column_width=90))
        if self._trace:
            raw = self.path.with_suffix(".json")
            prof.export_chrome_trace(str(raw))
            with open(raw, "rb") as src, gzip.open(str(raw) + ".gz", "wb") as dst:
                shutil.copyfileobj(src, dst)
            raw.unlink()

    def step(self) -> None:
        if self._prof is None:
            return
        self._steps += 1  # schedule: step 1 ends the untimed warm-up micro-batch, step 1 + active ends the window
        if self._steps == 1:
            self._sync()
            self._t0 = time.perf_counter()
        elif self._steps == 1 + self._active:
            self._stop_clock()
        self._prof.step()

    def _stop_clock(self) -> None:
        self._sync()
        self._wall = time.perf_counter() - self._t0
        self._recorded = self._steps - 1

    def close(self) -> None:
        """Ends the window; a call with fewer micro-batches than the window writes what it recorded."""
        if self._prof is not None:
            if 1 < self._steps < 1 + self._active:
                self._stop_clock()
            self._prof.stop()
            self._prof = None

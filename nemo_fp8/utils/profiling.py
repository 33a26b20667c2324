"""An opt-in ``torch.profiler`` window over a few micro-batches of one training call, set by environment
variables so a run of the unchanged command can be profiled (as NeMo-RL's ``NRL_NSYS_*`` variables do for nsys):

* ``NEMO_FP8_PROFILE_DIR``: where each rank writes its table (unset: no profiling, no cost);
* ``NEMO_FP8_PROFILE_TRAIN_CALL``: which training call of the process to profile (1-based, default 3: the first
  two carry the warm-up: kernel selection, allocator growth);
* ``NEMO_FP8_PROFILE_MICRO_BATCHES``: how many micro-batches it records (default 6, after one untimed).

The output, ``train_call<N>_rank<R>.txt``, is ``key_averages()`` sorted by device time: the kernels and ops that a
slow phase spends its time in, without a multi-gigabyte trace.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Optional


class TrainProfiler:
    """``step()`` after every micro-batch, ``close()`` after the call; a no-op unless this call is the profiled one."""

    def __init__(self, call: int, rank: int):
        self._prof = None
        out = os.environ.get("NEMO_FP8_PROFILE_DIR")
        if not out or call != int(os.environ.get("NEMO_FP8_PROFILE_TRAIN_CALL", "3")):
            return
        import torch

        active = int(os.environ.get("NEMO_FP8_PROFILE_MICRO_BATCHES", "6"))
        activities = [torch.profiler.ProfilerActivity.CPU]
        if torch.cuda.is_available():
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        self.path: Optional[Path] = Path(out) / f"train_call{call}_rank{rank}.txt"
        self._prof = torch.profiler.profile(activities=activities,
                                            schedule=torch.profiler.schedule(wait=0, warmup=1, active=active, repeat=1),
                                            on_trace_ready=self._write)
        self._prof.start()

    def _write(self, prof) -> None:
        sort = "device_time_total" if any(e.device_time_total for e in prof.key_averages()) else "cpu_time_total"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.write_text(prof.key_averages().table(sort_by=sort, row_limit=60, max_name_column_width=90))

    def step(self) -> None:
        if self._prof is not None:
            self._prof.step()

    def close(self) -> None:
        if self._prof is not None:
            self._prof.stop()
            self._prof = None

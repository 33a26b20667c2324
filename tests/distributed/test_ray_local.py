"""init_ray starts a Ray cluster of the run's own even while another run's local cluster is up."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_a_second_run_starts_its_own_cluster_beside_a_running_one():
    tmp = tempfile.mkdtemp(prefix="rl", dir="/tmp")  # short: Ray's socket paths live below it
    env = {**os.environ, "RAY_TMPDIR": tmp, "PYTHONPATH": str(REPO), "RAY_USAGE_STATS_ENABLED": "0"}
    env.pop("RAY_ADDRESS", None)
    other = subprocess.Popen([sys.executable, "-c", "import ray, time; ray.init(num_cpus=1, include_dashboard=False); "
                              "print(ray.get_runtime_context().gcs_address, flush=True); time.sleep(300)"],
                             env=env, stdout=subprocess.PIPE, text=True)
    try:
        address = other.stdout.readline().strip()
        assert ":" in address
        # what `ray start` leaves for later drivers (Ray's ray_current_cluster, below $RAY_TMPDIR/ray)
        (Path(tmp) / "ray").mkdir(exist_ok=True)
        (Path(tmp) / "ray" / "ray_current_cluster").write_text(address)
        # without address="local", ray.init finds the other run's cluster and refuses num_cpus for it
        run = subprocess.run([sys.executable, "-c", "import ray; from nemo_fp8.distributed.cluster import "
                              "init_ray; init_ray(None, 3); print(int(ray.cluster_resources()['CPU']))"],
                             env=env, capture_output=True, text=True, timeout=600)
        assert run.returncode == 0, run.stderr[-3000:]
        assert run.stdout.split()[-1] == "3"
    finally:
        other.terminate()
        other.wait(60)
        shutil.rmtree(tmp, ignore_errors=True)

"""CPU counts from the affinity mask, and the split of a machine's CPUs among runs side by side."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from nemo_fp8.utils.cpus import split_cpus, usable_cpus

REPO = Path(__file__).resolve().parents[2]


def test_split_cpus_gives_disjoint_blocks_of_consecutive_ids():
    assert split_cpus(range(8), 4) == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert split_cpus([5, 0, 1, 2, 3, 4, 6], 3) == [[0, 1, 2], [3, 4], [5, 6]]  # sorted; the remainder goes first
    blocks = split_cpus(range(64), 12, min_per_slot=4)
    assert len(blocks) == 12 and sorted(c for b in blocks for c in b) == list(range(64))
    assert [len(b) for b in blocks] == [6] * 4 + [5] * 8
    assert split_cpus(range(6), 2, min_per_slot=4) is None  # 3 each: too few, the caller leaves the runs unbound
    assert split_cpus([3], 1) == [[3]]
    with pytest.raises(ValueError, match="slots"):
        split_cpus(range(4), 0)


def test_usable_cpus_is_at_least_one_and_at_most_the_machine():
    assert 1 <= usable_cpus() <= (os.cpu_count() or 1)


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity") or usable_cpus() < 2, reason="needs 2 CPUs to bind to one")
def test_a_process_bound_to_one_cpu_sizes_preflight_threads_and_ray_to_it(tmp_path):
    """Bound to one CPU (as compare_precision binds runs side by side), the preflight's resources and the local Ray
    cluster count that CPU, not the machine's (Ray itself counts the machine)."""
    one = min(os.sched_getaffinity(0))
    code = f"""
import os, ray
os.sched_setaffinity(0, {{{one}}})
from nemo_fp8.config import load_config
from nemo_fp8.preflight import available_resources
from nemo_fp8.distributed.cluster import init_ray
from nemo_fp8.utils.cpus import usable_cpus
cfg = load_config({str(REPO / 'examples' / 'configs' / 'grpo_math_tiny_fp8.yaml')!r},
                  ["policy.device=cpu", "cluster.num_cpus=null", "logger.log_dir={tmp_path / 'logs'}"])
print("usable", usable_cpus(), "preflight", available_resources(cfg)["CPU"])
init_ray(None, None)
print("ray", ray.cluster_resources()["CPU"])
ray.shutdown()
"""
    env = {**os.environ, "PYTHONPATH": str(REPO), "RAY_ADDRESS": ""}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path, env=env,
                         timeout=180)
    assert out.returncode == 0, out.stdout + out.stderr[-3000:]
    assert "usable 1 preflight 1.0" in out.stdout and "ray 1.0" in out.stdout, out.stdout

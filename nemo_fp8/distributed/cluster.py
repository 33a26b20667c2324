"""Starting or joining the Ray cluster, and finding a free port for a rendezvous."""

from __future__ import annotations

import logging
import os
import socket
from typing import Any, Optional

import ray

from nemo_fp8.utils.cpus import usable_cpus

logger = logging.getLogger(__name__)


def init_ray(address: Optional[str], num_cpus: Optional[int]) -> None:
    """Start (``address`` None: a local cluster of this process's own, even where other runs have theirs)
    or join a Ray cluster, once per driver process.

    A local cluster gets ``num_cpus`` CPUs, by default the ones this process may run on (its affinity mask,
    :func:`nemo_fp8.utils.cpus.usable_cpus`; Ray itself counts the whole machine): runs bound to a share of the
    machine's cores then schedule for that share. Ray's dashboard and usage stats are
    off; workers inherit the driver's ``PYTHONPATH`` plus the repository root, so ``nemo_fp8`` imports there
    without an install too.
    """
    if ray.is_initialized():
        return
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    repo_root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    pythonpath = os.pathsep.join(p for p in (repo_root, os.environ.get("PYTHONPATH")) if p)
    env_vars = {"PYTHONPATH": pythonpath, "TOKENIZERS_PARALLELISM": "false"}
    kwargs: dict[str, Any] = dict(include_dashboard=False, log_to_driver=True, configure_logging=False,
                                  runtime_env={"env_vars": env_vars})
    if address:
        ray.init(address=address, **kwargs)
    else:  # "local": a cluster of this run's own; with None Ray joins the newest other local run's cluster
        # (concurrent runs on one machine, compare_precision --parallel), unless RAY_ADDRESS names one
        ray.init(address=None if os.environ.get("RAY_ADDRESS") else "local", num_cpus=num_cpus or usable_cpus(),
                 **kwargs)
    logger.info("ray: %s", ray.cluster_resources())


def free_address() -> tuple[str, int]:
    """(this node's IP, a port free on it now) for a rendezvous this process will serve."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        port = s.getsockname()[1]
    return ray.util.get_node_ip_address(), port

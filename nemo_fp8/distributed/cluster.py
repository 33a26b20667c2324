"""Starting or joining the Ray cluster, and finding a free port for a rendezvous."""

from __future__ import annotations

import contextlib
import logging
import os
import socket
from typing import Any, Iterator, Optional

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
        _quiet_token_auth_notice()
        with ray_services_in_own_process_group():
            ray.init(address=None if os.environ.get("RAY_ADDRESS") else "local", num_cpus=num_cpus or usable_cpus(),
                     **kwargs)
    logger.info("ray: %s", ray.cluster_resources())



def _quiet_token_auth_notice() -> None:
    """Drop Ray's start-up notice that token authentication is on (a warning on every local ``ray.init``, where
    ``RAY_AUTH_MODE`` is unset): the cluster is this run's own, started here, and the notice asks nothing of the
    user. Authentication itself is unchanged; other records of that logger pass."""
    log = logging.getLogger("ray._private.authentication.authentication_token_setup")
    if not any(isinstance(f, _TokenAuthNotice) for f in log.filters):
        log.addFilter(_TokenAuthNotice())


class _TokenAuthNotice(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("Token authentication is enabled for this Ray cluster")


@contextlib.contextmanager
def ray_services_in_own_process_group() -> Iterator[None]:
    """Inside the block, the processes a local ``ray.init`` starts (GCS, raylet, its agents) each lead a process
    group of their own (``subprocess.Popen(process_group=0)``, Linux), so a SIGTERM to the driver's process group
    (``timeout``, ``kill -- -PGID``) does not reach them.

    Why: with the raylet gone, the driver's Ray core worker ends the process at its next touch of the object store
    (``connection.cc``: "The connection to the plasma store is failed. Terminate the process", exit code 1, no
    Python code runs), often within 50 ms of the signal and before the driver has said how to resume. With the
    services alive, the driver disconnects first (``ray.shutdown()``) and kills what is left after
    (:func:`nemo_fp8.distributed.teardown.fast_teardown`). They still share the driver's fate: Ray sets
    ``PR_SET_PDEATHSIG`` on them, and this project's reaper kills what is left of a killed driver. Ray has no
    option for this; the block swaps Ray's ``ConsolePopen`` (``ray._private.services``, the one place it starts
    its processes) for a subclass and puts it back. Where that class is missing the block does nothing.
    """
    from ray._private import services

    base = getattr(services, "ConsolePopen", None)
    if base is None or os.name != "posix":
        yield
        return

    class _OwnGroupPopen(base):
        def __init__(self, *args, **kwargs):
            kwargs.setdefault("process_group", 0)
            super().__init__(*args, **kwargs)

    services.ConsolePopen = _OwnGroupPopen
    try:
        yield
    finally:
        services.ConsolePopen = base


def free_address() -> tuple[str, int]:
    """(this node's IP, a port free on it now) for a rendezvous this process will serve."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        port = s.getsockname()[1]
    return ray.util.get_node_ip_address(), port

"""Ray actors for the generation and policy backends, and driver-side handles for them.

Each backend runs in its own Ray actor (its own process, with its own torch threads and, on a
GPU host, its own GPU share); the driver runs the GRPO loop through ``RemoteGeneration`` /
``RemotePolicy``, which implement the same interfaces as the local backends, so the loop
cannot tell them apart. The refit passes the policy's weights to the generation actor as one
Ray object reference: they go actor to actor through the object store, not through the driver.
"""

from __future__ import annotations

import logging
import os
from typing import Any, Callable

import ray

logger = logging.getLogger(__name__)


def init_ray(address: str | None, num_cpus: int | None) -> None:
    """Start (``address`` None) or join a Ray cluster, once per driver process.

    Ray's dashboard and usage stats are off; workers inherit the driver's ``PYTHONPATH`` plus
    the repository root, so ``nemo_fp8`` imports there without an install too.
    """
    if ray.is_initialized():
        return
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    repo_root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    pythonpath = os.pathsep.join(p for p in (repo_root, os.environ.get("PYTHONPATH")) if p)
    kwargs: dict[str, Any] = dict(include_dashboard=False, log_to_driver=True, configure_logging=False,
                                  runtime_env={"env_vars": {"PYTHONPATH": pythonpath, "TOKENIZERS_PARALLELISM": "false"}})
    if address:
        ray.init(address=address, **kwargs)
    else:
        ray.init(num_cpus=num_cpus, **kwargs)
    logger.info("ray: %s", ray.cluster_resources())


class BackendActor:
    """Holds one backend object; ``call(method, *args)`` runs one of its methods.

    ``factory`` is a picklable callable that builds the backend inside the actor process.
    """

    def __init__(self, factory: Callable[..., Any], kwargs: dict, torch_threads: int | None):
        import torch

        if torch_threads:
            torch.set_num_threads(torch_threads)
        logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
        self.backend = factory(**kwargs)

    def ready(self) -> bool:
        return True

    def call(self, method: str, *args, **kwargs):
        return getattr(self.backend, method)(*args, **kwargs)

    def state_for_refit(self) -> dict:
        """Policy side of the refit: all weights by HF name, as one object."""
        return dict(self.backend.named_weights())


RemoteBackendActor = ray.remote(BackendActor)


def spawn(factory: Callable[..., Any], kwargs: dict, num_cpus: float, num_gpus: float,
          torch_threads: int | None, name: str):
    """Start a ``BackendActor`` and wait until its backend is built (errors surface here)."""
    actor = RemoteBackendActor.options(num_cpus=num_cpus, num_gpus=num_gpus, name=None,
                                       max_concurrency=1).remote(factory, kwargs, torch_threads)
    ray.get(actor.ready.remote())  # blocks on __init__; re-raises its exception
    logger.info("ray actor %s ready", name)
    return actor


class RemoteGeneration:
    """``GenerationBackend`` whose work runs in a Ray actor."""

    def __init__(self, actor):
        self.actor = actor

    def generate(self, prompt_token_ids, sampling):
        return ray.get(self.actor.call.remote("generate", prompt_token_ids, sampling))

    def update_weights(self, named_tensors) -> None:
        ray.get(self.actor.call.remote("update_weights", named_tensors))

    def refit_from(self, policy: "RemotePolicy") -> None:
        """Refit from a policy actor: the weights go actor to actor as one object reference."""
        ray.get(self.actor.call.remote("update_weights", policy.actor.state_for_refit.remote()))


class RemotePolicy:
    """``PolicyBackend`` whose work runs in a Ray actor."""

    def __init__(self, actor):
        self.actor = actor

    def get_logprobs(self, batch, reference: bool = False):
        return ray.get(self.actor.call.remote("get_logprobs", batch, reference))

    def train(self, batch, loss_fn):
        return ray.get(self.actor.call.remote("train", batch, loss_fn))

    def named_weights(self):
        return iter(ray.get(self.actor.state_for_refit.remote()).items())

    def save(self, path) -> None:
        ray.get(self.actor.call.remote("save", str(path)))

    def load(self, path) -> None:
        ray.get(self.actor.call.remote("load", str(path)))

"""One Ray fan-out: call a method on a group of actors, gather the answers, fail fast and say who failed.

Every worker group (``nemo_fp8.policy.group.PolicyGroup``, ``nemo_fp8.generation.group.GenerationGroup``) talks
to its actors through these three functions instead of writing ``ray.get([w.x.remote() for w in workers])`` by
hand (verl's dispatch idea, written here as plain functions):

* ``call_all(actors, "method", *args)``: the same call on every actor, answers in actor order;
* ``call_each(actors, "method", per_actor_args)``: one call per actor with its own arguments (a rank's shard);
* ``shutdown_actors(actors, timeout_s)``: the bounded teardown both groups share: every actor's ``shutdown``,
  waited for at most ``timeout_s``, then every actor ended (``ray.kill``) whatever happened.

``gather`` under them waits for the calls one answer at a time and raises the first failure as soon as it
happens (the other calls are not waited for). With ``error`` set (``EngineError``) a failure becomes that
exception naming the actor's label: "``<what>: engine 1 (node ..., GPUs 0) died: ...``"; without it Ray's own
exception is raised as is (``RayTaskError``, ``RayActorError``), which ``nemo_fp8.distributed.teardown.
describe_failure`` names at the top.
"""

from __future__ import annotations

import time
from typing import Any, Optional, Sequence

import ray


def gather(refs: Sequence, what: str = "call", labels: Optional[Sequence[str]] = None,
           timeout_s: Optional[float] = None, error: Optional[type[Exception]] = None) -> list:
    """``ray.get`` of ``refs``, in order, raising the first failure as soon as it happens.

    Args:
        refs: one object ref per actor call.
        what: the call's name, first in an error message.
        labels: per ref, who answers it (``engine 1 (node ..., CPU)``); default ``actor <i>``.
        timeout_s: how long to wait for all answers; None: no limit.
        error: the exception class a failure or a late answer becomes (``EngineError``); None: Ray's exception as
            it is and ``TimeoutError`` for late answers.

    Raises:
        error (or ``TimeoutError``): calls not answered within ``timeout_s``, their labels named.
        error (or the ``ray.exceptions.RayError`` itself): a call raised, or its actor died.
    """
    from nemo_fp8.distributed.teardown import describe_dead_actor

    labels = list(labels) if labels is not None else [f"actor {i}" for i in range(len(refs))]
    index = {ref: k for k, ref in enumerate(refs)}
    out: list = [None] * len(refs)
    pending = list(refs)
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    while pending:
        if deadline is None:
            done, pending = ray.wait(pending, num_returns=1)
        else:
            done, pending = ray.wait(pending, num_returns=1, timeout=max(0.0, deadline - time.monotonic()))
        if not done:
            late = ", ".join(labels[index[r]] for r in pending)
            raise (error or TimeoutError)(f"{what}: {late} did not answer within {timeout_s:.0f} s")
        k = index[done[0]]
        try:
            out[k] = ray.get(done[0])
        except ray.exceptions.RayActorError as e:  # its process died
            if error is None:
                raise
            raise error(f"{what}: {labels[k]} died: {describe_dead_actor(e)}") from e
        except Exception as e:  # RayTaskError: the actor raised; name its own exception, not Ray's wrapper
            if error is None:
                raise
            cause = getattr(e, "cause", None) or e
            raise error(f"{what}: {labels[k]} failed: {type(cause).__name__}: {cause}") from e
    return out


def call_all(actors: Sequence, method: str, *args: Any, timeout_s: Optional[float] = None,
             labels: Optional[Sequence[str]] = None, error: Optional[type[Exception]] = None, **kwargs: Any) -> list:
    """``actor.method(*args, **kwargs)`` on every actor at once; their answers in actor order (``gather``).

    Raises:
        AttributeError: an actor class without ``method`` (before any call is sent).
        What ``gather`` raises.
    """
    calls = [getattr(a, method) for a in actors]
    return gather([c.remote(*args, **kwargs) for c in calls], method, labels, timeout_s, error)


def call_each(actors: Sequence, method: str, per_actor_args: Sequence[tuple], timeout_s: Optional[float] = None,
              labels: Optional[Sequence[str]] = None, error: Optional[type[Exception]] = None) -> list:
    """``actors[i].method(*per_actor_args[i])`` on every actor at once (a rank's own shard); answers in actor order.

    Raises:
        ValueError: not one argument tuple per actor.
        What ``gather`` raises.
    """
    if len(per_actor_args) != len(actors):
        raise ValueError(f"call_each({method!r}): {len(per_actor_args)} argument tuples for {len(actors)} actors")
    calls = [getattr(a, method) for a in actors]
    return gather([c.remote(*a) for c, a in zip(calls, per_actor_args)], method, labels, timeout_s, error)


def shutdown_actors(actors: Sequence, timeout_s: Optional[float] = None, labels: Optional[Sequence[str]] = None,
                    error: Optional[type[Exception]] = None) -> None:
    """Call every actor's ``shutdown``, wait at most ``timeout_s`` (an actor still busy with the call a Ctrl-C
    interrupted answers only after it), then end every actor (``ray.kill``), also when a call failed or was late.

    Raises:
        What ``gather`` raises: a late actor (named), one whose ``shutdown`` raised, or one that died.
    """
    try:
        call_all(actors, "shutdown", timeout_s=timeout_s, labels=labels, error=error)
    finally:
        for a in actors:
            ray.kill(a)

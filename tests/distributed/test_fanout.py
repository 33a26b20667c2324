"""The Ray fan-out (``nemo_fp8.distributed.fanout``) on a local Ray: answers in actor order, per-actor arguments,
the first failure named at once, late actors named, and the bounded shutdown ending every actor."""

import time

import pytest
import ray

from nemo_fp8.distributed.cluster import init_ray
from nemo_fp8.distributed.fanout import call_all, call_each, gather, shutdown_actors
from nemo_fp8.utils.run_dir import RunFailed


@ray.remote(num_cpus=0)
class Echo:
    def __init__(self, rank: int):
        self.rank = rank

    def scaled(self, factor: int, offset: int = 0) -> int:
        return self.rank * factor + offset

    def sleep_then(self, seconds: float) -> int:
        time.sleep(seconds)
        return self.rank

    def fail(self) -> None:
        raise ValueError(f"rank {self.rank} refuses")

    def shutdown(self) -> None:
        time.sleep(30 if self.rank == 1 else 0)  # rank 1 is busy past any bound below


@pytest.fixture(scope="module")
def actors():
    init_ray(None, num_cpus=2)
    group = [Echo.remote(r) for r in range(3)]
    yield group
    ray.shutdown()


def test_call_all_and_call_each_answer_in_actor_order(actors):
    assert call_all(actors, "scaled", 10, offset=1) == [1, 11, 21]
    assert call_each(actors, "scaled", [(1,), (2,), (3, 5)]) == [0, 2, 11]
    with pytest.raises(ValueError, match="2 argument tuples for 3 actors"):
        call_each(actors, "scaled", [(1,), (2,)])
    with pytest.raises(AttributeError):
        call_all(actors, "no_such_method")


def test_a_failure_is_raised_as_it_is_or_as_the_named_error(actors):
    with pytest.raises(ray.exceptions.RayTaskError, match="refuses"):
        call_all(actors, "fail")
    labels = ["engine 0 (here)", "engine 1 (there)", "engine 2 (elsewhere)"]
    with pytest.raises(RunFailed, match=r"fail: engine \d \(\w+\) failed: ValueError: rank \d refuses"):
        call_all(actors, "fail", labels=labels, error=RunFailed)


def test_late_answers_are_named_and_the_fast_ones_are_not_waited_for(actors):
    refs = [a.sleep_then.remote(s) for a, s in zip(actors, (0.0, 20.0, 0.0))]
    t0 = time.monotonic()
    with pytest.raises(TimeoutError, match=r"^sleep: rank 1 did not answer within 1 s$"):
        gather(refs, "sleep", ["rank 0", "rank 1", "rank 2"], timeout_s=1.0)
    assert time.monotonic() - t0 < 10


def test_shutdown_actors_ends_every_actor_even_when_one_is_late(actors):
    group = [Echo.remote(r) for r in range(3)]
    call_all(group, "scaled", 1)  # started (a loaded machine may take seconds)
    with pytest.raises(TimeoutError, match=r"^shutdown: policy rank 1 did not answer within 2 s$"):
        shutdown_actors(group, timeout_s=2.0, labels=[f"policy rank {r}" for r in range(3)])
    for a in group:  # ray.kill is asynchronous: a call right after it may still be answered, then none is
        assert actor_ends_within(a, 30)


def actor_ends_within(actor, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            ray.get(actor.scaled.remote(1), timeout=seconds)
        except ray.exceptions.RayActorError:
            return True
        time.sleep(0.1)
    return False


class Group:
    """A worker group of real actors, as ``GenerationGroup`` and ``PolicyGroup`` shut theirs down."""

    def __init__(self, actors):
        self.actors = actors

    def shutdown(self, timeout_s=None) -> None:
        shutdown_actors(self.actors, timeout_s)


def test_workers_shut_both_groups_down_at_once(actors):
    from nemo_fp8.trainer import Workers

    busy = [Echo.remote(1), Echo.remote(1)]  # each shutdown call is busy for 30 s
    assert call_all(busy, "scaled", 1) == [1, 1]  # both started
    t0 = time.monotonic()
    Workers(policy=Group(busy[:1]), generation=Group(busy[1:]), refitter=None).shutdown(timeout_s=3.0)
    assert 3.0 <= time.monotonic() - t0 < 5.5  # one bound, not one per group
    for a in busy:
        with pytest.raises(ray.exceptions.RayActorError):
            ray.get(a.scaled.remote(1), timeout=30)

"""The trajectory buffer between the asynchronous collector and the trainer: hand-over, bounds, age guard, errors."""

import threading
import time

import pytest
import torch

from nemo_fp8.algorithms.trajectory_buffer import StepRollouts, TrajectoryBuffer
from nemo_fp8.batch import TrainBatch


def made(step: int, versions: list[int], rows: int = 2) -> StepRollouts:
    parts = []
    for _ in versions:
        ids = torch.ones(rows, 5, dtype=torch.long)
        parts.append(TrainBatch(ids, torch.full((rows,), 2), torch.full((rows,), 3), torch.zeros(rows),
                                torch.zeros(rows, 5)))
    return StepRollouts(step, parts, [], versions, {"position": step})


def test_take_waits_for_its_step_and_tags_rows_with_versions():
    buf = TrajectoryBuffer(2)
    got = {}
    t = threading.Thread(target=lambda: got.update(out=buf.take(2, max_age=1)))
    t.start()
    buf.put(made(1, [0]))
    time.sleep(0.3)
    assert "out" not in got and len(buf) == 1  # step 1's rollouts do not satisfy a wait for step 2
    buf.put(made(2, [0, 1], rows=3))
    t.join(5)
    assert got["out"].step == 2 and len(buf) == 1
    assert got["out"].row_versions().tolist() == [0, 0, 0, 1, 1, 1]


def test_put_waits_for_room_and_gives_up_when_stopped():
    buf = TrajectoryBuffer(1)
    assert buf.put(made(1, [0])) is not None
    stop = threading.Event()
    threading.Timer(0.3, stop.set).start()
    assert buf.put(made(2, [0]), stopped=stop.is_set) is None and len(buf) == 1
    roomy = TrajectoryBuffer(3)
    roomy.put(made(1, [0]))
    with pytest.raises(ValueError, match="step 1 has rollouts already"):
        roomy.put(made(1, [0]))


def test_rollouts_older_than_the_limit_are_refused():
    buf = TrajectoryBuffer(3)
    buf.put(made(4, [1, 2]))  # step 4 trains version 3: ages 2 and 1
    with pytest.raises(RuntimeError, match="weight version 1, older than grpo.async_grpo.max_trajectory_age_steps=1"):
        buf.take(4, max_age=1)
    buf.put(made(5, [3, 4]))
    assert buf.take(5, max_age=1).versions == [3, 4]


def test_the_collectors_error_reaches_the_trainer_and_a_dead_collector_is_no_endless_wait():
    buf = TrajectoryBuffer(2)
    with pytest.raises(RuntimeError, match="the collector stopped before making step 1"):
        buf.take(1, max_age=1, alive=lambda: False)
    err = KeyError("engine 0 died")
    buf.fail(err)
    with pytest.raises(KeyError) as e:
        buf.take(1, max_age=1)
    assert e.value is err
    with pytest.raises(ValueError, match="capacity must be >= 1"):
        TrajectoryBuffer(0)


def test_clear_drops_every_step():
    buf = TrajectoryBuffer(3)
    buf.put(made(1, [0]))
    buf.put(made(2, [0]))
    assert buf.clear() == 2 and len(buf) == 0

"""Tests for the endless, resumable PromptDataloader."""

import pytest

from nemo_fp8.data import MathExample, PromptDataloader, PromptSample


def _samples(n):
    return [
        PromptSample(MathExample(problem=f"p{i}", answer=str(i), data_source="t", index=i), f"p{i}", [i])
        for i in range(n)
    ]


def _ids(batch):
    return [s.example.index for s in batch]


def test_epochs_cover_data_and_drop_last():
    loader = PromptDataloader(_samples(10), batch_size=3, seed=0)
    assert len(loader) == 3
    it = iter(loader)
    epoch0 = [_ids(next(it)) for _ in range(3)]
    epoch1 = [_ids(next(it)) for _ in range(3)]
    for epoch in (epoch0, epoch1):
        flat = [i for b in epoch for i in b]
        assert all(len(b) == 3 for b in epoch)
        assert len(set(flat)) == 9
    assert epoch0 != epoch1  # a new permutation each epoch
    assert loader.state_dict()["epoch"] == 1


def test_seeded_and_unshuffled():
    a = PromptDataloader(_samples(20), batch_size=4, seed=5)
    b = PromptDataloader(_samples(20), batch_size=4, seed=5)
    c = PromptDataloader(_samples(20), batch_size=4, seed=6)
    first_a = [_ids(next(a)) for _ in range(10)]
    assert first_a == [_ids(next(b)) for _ in range(10)]
    assert first_a != [_ids(next(c)) for _ in range(10)]
    plain = PromptDataloader(_samples(6), batch_size=2, seed=0, shuffle=False)
    assert [_ids(next(plain)) for _ in range(4)] == [[0, 1], [2, 3], [4, 5], [0, 1]]


@pytest.mark.parametrize("consumed", [0, 1, 2, 3, 5, 7])
def test_resume_matches_uninterrupted(consumed):
    samples = _samples(11)
    reference = PromptDataloader(samples, batch_size=3, seed=42)
    expected = [_ids(next(reference)) for _ in range(consumed + 8)]

    loader = PromptDataloader(samples, batch_size=3, seed=42)
    for _ in range(consumed):
        next(loader)
    state = loader.state_dict()
    assert {"epoch", "position"} <= set(state)

    resumed = PromptDataloader(samples, batch_size=3, seed=42)
    resumed.load_state_dict(dict(state))
    assert [_ids(next(resumed)) for _ in range(8)] == expected[consumed:]


def test_bad_args_and_state():
    with pytest.raises(ValueError):
        PromptDataloader([], batch_size=1, seed=0)
    with pytest.raises(ValueError):
        PromptDataloader(_samples(3), batch_size=4, seed=0)
    loader = PromptDataloader(_samples(5), batch_size=2, seed=0)
    with pytest.raises(ValueError, match="seed"):
        loader.load_state_dict({"epoch": 0, "position": 0, "seed": 1})
    with pytest.raises(ValueError, match="num_samples"):
        loader.load_state_dict({"epoch": 0, "position": 0, "num_samples": 9})
    with pytest.raises(KeyError):
        loader.load_state_dict({"epoch": 0})

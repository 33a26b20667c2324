"""The Megatron backend's colocated release (``ColocationMixin``), the parts that run without megatron-core."""

import gc

from nemo_fp8.policy.megatron.colocation import ColocationMixin


class Cycle:
    """A reference cycle: freed only by the cyclic collector."""

    def __init__(self):
        self.me = self


def test_full_collections_freeze_their_survivors_only_the_first_times():
    """``_collect_garbage``: every collection frees cyclic garbage; the survivors of the first
    ``FROZEN_FULL_COLLECTS`` full ones are frozen (later collections skip them), those of later full ones and of
    young-only ones are not (what frozen cycles can leak stays bounded)."""
    mixin = ColocationMixin()
    survivors = []
    try:
        for i in range(mixin.FROZEN_FULL_COLLECTS):
            survivors.append([i])  # alive at the collection: frozen
            Cycle()  # garbage: collected, not frozen
            before = gc.get_freeze_count()
            mixin._collect_garbage(2)
            assert gc.get_freeze_count() > before and mixin._frozen_collects == i + 1
        frozen = gc.get_freeze_count()
        for generation in (1, 2):  # young-only, then a full one past the first ones: neither freezes
            survivors.append([generation])
            Cycle(), Cycle()
            found = mixin._collect_garbage(generation)
            assert gc.get_freeze_count() == frozen
            # what it found: at least the two cycles (each an instance and its __dict__); no GPU, nothing freed there
            assert found["gc_collected"] >= 2 and found["gc_freed_gib"] == 0
            assert not any(isinstance(o, Cycle) for o in gc.get_objects())  # the cycle was collected
        assert mixin._frozen_collects == mixin.FROZEN_FULL_COLLECTS
    finally:
        gc.unfreeze()

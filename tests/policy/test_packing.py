"""Sequence packing, the pure part: bins, balance over data-parallel ranks, the THD layout, the config."""

import random

import pytest
import torch

from nemo_fp8.config import load_config
from nemo_fp8.policy.packing import (ALGORITHMS, balance_bins, block_causal_mask, pack_bins, pack_rows, packing_shape,
                                     plan_logprobs, plan_train, real_token_mask, row_size, unpack)
from tests.conftest import REPO


def rollout_lengths(n: int, seed: int = 0) -> list[int]:
    """A rollout's spread: a 512-token prompt plus 256..3,072 response tokens."""
    rng = random.Random(seed)
    return [512 + rng.randint(256, 3072) for _ in range(n)]


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_bins_never_exceed_the_budget_and_hold_every_sequence_once(algorithm):
    lengths = rollout_lengths(64)
    bins = pack_bins(lengths, 4096, algorithm)
    assert sorted(i for b in bins for i in b) == list(range(64))
    assert all(sum(lengths[i] for i in b) <= 4096 for b in bins)
    # no worse than first fit by more than a bin or two: packing actually fills bins
    assert len(bins) <= -(-sum(lengths) // 4096) * 1.5


def test_modified_first_fit_decreasing_finds_the_optimum_of_a_small_case():
    lengths = [1000, 3000, 2000, 1000, 500, 500, 4000, 90]
    bins = pack_bins(lengths, 4096, "modified_first_fit_decreasing")
    assert len(bins) == 3 and all(sum(lengths[i] for i in b) <= 4096 for b in bins)  # 12,090 tokens: 3 bins


def test_bin_count_is_raised_to_a_multiple_of_the_ranks_and_too_few_sequences_fail():
    bins = pack_bins([10] * 7, 4096, "first_fit_decreasing", min_bins=4, bin_multiple=4)
    assert len(bins) == 4 and all(b for b in bins)
    with pytest.raises(ValueError, match="cannot fill 4 bins"):
        pack_bins([10] * 3, 4096, min_bins=4, bin_multiple=4)
    with pytest.raises(ValueError, match="exceeds the budget of 4096"):
        pack_bins([5000], 4096)


def test_every_rank_gets_the_same_number_of_micro_batches_with_balanced_tokens():
    lengths = rollout_lengths(128, seed=3)
    shape = packing_shape(4096, "modified_first_fit_decreasing", 64, "blockwise")
    plans = plan_train(lengths, 64, 4, shape)
    assert sorted(r for p in plans for r in p.rows) == list(range(128))
    for g in range(2):
        counts = {len(p.micro_batches[g]) for p in plans}
        assert len(counts) == 1, counts
        tokens = [sum(shape.padded_length(lengths[p.rows[i]]) for mb in p.micro_batches[g] for i in mb) for p in plans]
        assert max(tokens) - min(tokens) <= 4096, tokens  # within one bin of each other
        for p in plans:  # a global batch's rows stay in it
            rows = [p.rows[i] for mb in p.micro_batches[g] for i in mb]
            assert all(64 * g <= r < 64 * (g + 1) for r in rows)
            assert all(sum(shape.padded_length(lengths[p.rows[i]]) for i in mb) <= 4096 for mb in p.micro_batches[g])


def test_balance_bins_equal_sizes():
    groups = balance_bins([9, 8, 1, 1, 5, 4], 2)
    assert sorted(map(len, groups)) == [3, 3]
    assert sorted(i for g in groups for i in g) == list(range(6))
    with pytest.raises(ValueError, match="do not split evenly"):
        balance_bins([1, 2, 3], 2)


def test_plan_logprobs_with_more_ranks_than_rows():
    shape = packing_shape(128, "first_fit_decreasing")
    plans = plan_logprobs([5, 6], 4, shape)
    assert [len(p.rows) for p in plans] == [1, 1, 0, 0]


def test_pack_rows_layout_and_round_trip():
    ids = torch.tensor([[5, 6, 7, 0, 0], [8, 9, 1, 2, 3]])
    packed = pack_rows(ids, torch.tensor([3, 5]), seq_multiple=4, total_multiple=16, pad_token_id=0)
    assert packed.cu_seqlens.tolist() == [0, 3, 8] and packed.cu_seqlens.dtype == torch.int32
    assert packed.cu_seqlens_padded.tolist() == [0, 4, 16] and packed.cu_seqlens_padded.dtype == torch.int32
    assert packed.token_ids.tolist() == [[5, 6, 7, 0, 8, 9, 1, 2, 3] + [0] * 7]
    assert packed.position_ids.tolist() == [[0, 1, 2, 3] + list(range(12))]
    assert packed.max_seqlen == 12 and packed.real_tokens == 8 and packed.total_tokens == 16
    assert packed.offsets == (0, 4, 16)  # the host copy unpack reads (no device read per micro-batch)
    same = pack_rows(ids, [3, 5], seq_multiple=4, total_multiple=16, pad_token_id=0)  # host lengths as a list
    assert same.token_ids.equal(packed.token_ids) and same.cu_seqlens.equal(packed.cu_seqlens)
    back = unpack(packed.token_ids[0], packed, 5)
    assert back.tolist() == [[5, 6, 7, 0, 0], [8, 9, 1, 2, 3]]
    mask = block_causal_mask(packed.cu_seqlens_padded, 16)
    assert mask[5, 4] and not mask[4, 3] and not mask[4, 5] and mask[3, 0]


def test_fixed_shape_rows_have_one_size_and_a_constant_number_of_segments():
    ids = torch.tensor([[5, 6, 7, 0, 0], [8, 9, 1, 2, 3]])
    free = pack_rows(ids, [3, 5], seq_multiple=4, total_multiple=16)
    packed = pack_rows(ids, [3, 5], seq_multiple=4, total_multiple=16, fixed_sizes=(32, 64))
    assert packed.total_tokens == 32 and packed.max_seqlen == 32  # the smallest fixed size that holds 16 tokens
    assert packed.cu_seqlens_padded.tolist() == [0, 4, 32] + [32] * 6  # 32 // 4 + 1 entries: zero-length segments
    assert packed.cu_seqlens.tolist() == [0, 3, 8] + [8] * 6
    assert packed.token_ids[0, :16].equal(free.token_ids[0]) and not packed.token_ids[0, 16:].any()
    assert packed.position_ids.tolist() == [[0, 1, 2, 3] + list(range(28))]  # the last segment absorbs the padding
    assert unpack(packed.token_ids[0], packed, 5).tolist() == ids.tolist()
    assert real_token_mask(packed).sum() == 8
    one = pack_rows(ids[:1], [3], seq_multiple=4, total_multiple=16, fixed_sizes=(32, 64))  # one sequence
    assert one.total_tokens == 32 and one.cu_seqlens_padded.numel() == 9
    # a real token sees what it saw in the free row; the zero-length segments add no block to the mask
    mask, free_mask = block_causal_mask(packed.cu_seqlens_padded, 32), block_causal_mask(free.cu_seqlens_padded, 16)
    assert mask[:16, :16].equal(free_mask)
    long = torch.randint(1, 9, (3, 20))
    assert pack_rows(long, [20, 20, 20], seq_multiple=4, total_multiple=16, fixed_sizes=(32, 64)).total_tokens == 64
    with pytest.raises(ValueError, match="larger than every fixed row size"):
        pack_rows(torch.randint(1, 9, (4, 20)), [20] * 4, seq_multiple=4, fixed_sizes=(32, 64))
    assert row_size(40, 16) == 48 and row_size(40, 16, (64, 128)) == 64


def test_fixed_shape_config_sets_both_budgets_as_the_row_sizes():
    shape = _cfg("policy.sequence_packing.fixed_shape=true").policy.packing_shape("train")
    assert shape.fixed_sizes == (4096, 16384) and shape.capacity == 4096
    assert shape.row_tokens([100, 200]) == 4096 and shape.row_tokens([4096, 4096]) == 16384
    assert _cfg().policy.packing_shape("logprobs").fixed_sizes == ()
    assert _cfg().policy.packing_shape("train").row_tokens([100, 200]) == 384  # 128 + 256, the recipe's 128


TP2 = ["policy.megatron_cfg.tensor_model_parallel_size=2", "policy.data_parallel_size=4"]  # sequence parallel


def _cfg(*overrides):
    return load_config(REPO / "examples" / "configs" / "grpo_math_8B_megatron_fp8.yaml", list(overrides))


def test_the_example_configs_pack_with_the_8b_recipe_values():
    for name in ("grpo_math_8B_megatron.yaml", "grpo_math_8B_megatron_fp8.yaml", "grpo_math_tiny_megatron_fp8.yaml"):
        sp = load_config(REPO / "examples" / "configs" / name).policy.sequence_packing
        assert sp.enabled and sp.algorithm == "modified_first_fit_decreasing"
    sp = _cfg().policy.sequence_packing
    assert (sp.train_mb_tokens, sp.logprob_mb_tokens, sp.sequence_length_round) == (4096, 16384, 64)
    shape = _cfg().policy.packing_shape("train")
    assert shape.total_multiple == 128 and shape.seq_multiple == 64  # blockwise, tensor parallel 1 (the configs')
    shape = _cfg(*TP2).policy.packing_shape("train")
    assert shape.total_multiple == 128 * 2 and shape.seq_multiple == 64  # blockwise x tensor parallel 2 (SP)


@pytest.mark.parametrize("overrides, match", [
    (["policy.sequence_packing.train_mb_tokens=4000"], "train_mb_tokens: sequence packing: a budget of 4000"),
    (["policy.sequence_packing.logprob_mb_tokens=16000"], "logprob_mb_tokens: sequence packing: a budget of 16000"),
    (["policy.sequence_packing.train_mb_tokens=2048"], "train_mb_tokens: 2048 tokens cannot hold a sequence"),
    (["policy.max_total_sequence_length=4100"], "train_mb_tokens: 4096 tokens cannot hold a sequence of "
                                                "policy.max_total_sequence_length=4100"),
    (["policy.megatron_cfg.fp8_cfg.fp8_recipe=tensorwise", "policy.sequence_packing.train_mb_tokens=4112",
      "policy.sequence_packing.sequence_length_round=2"],
     "not a multiple of 32"),
    (["policy.sequence_packing.algorithm=best_fit"], "algorithm"),
    (["policy.sequence_packing.enabled=false", "policy.sequence_packing.fixed_shape=true"],
     "fixed_shape: true pads packed rows; it needs sequence_packing.enabled: true"),
])
def test_bad_packing_configs_are_refused_naming_the_key(overrides, match):
    with pytest.raises(ValueError, match=match):  # at tensor parallel 2: sequence parallelism doubles the multiples
        _cfg("policy.sequence_packing.enabled=true", *TP2, *overrides)


def test_a_budget_fine_for_bf16_is_refused_for_blockwise_fp8():
    bf16 = ["policy.megatron_cfg.fp8_cfg.enabled=false", "policy.megatron_cfg.sequence_parallel=false",
            "policy.sequence_packing.train_mb_tokens=4160"]
    assert _cfg(*bf16).policy.sequence_packing.train_mb_tokens == 4160
    with pytest.raises(ValueError, match="multiple of 128 .FP8 recipe blockwise"):
        _cfg(*bf16[1:])

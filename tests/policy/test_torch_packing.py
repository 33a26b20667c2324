"""Sequence packing on the torch reference backend (fp32, tiny model): packed == unpacked."""

import pytest
import torch

from nemo_fp8.algorithms.loss import ClippedPGLossFn
from nemo_fp8.batch import TrainBatch
from nemo_fp8.distributed.placement import create_placement_group, plan_cluster
from nemo_fp8.policy.group import PolicyGroup
from nemo_fp8.policy.torch_backend import TorchPolicyBackend, logprob_micro_batches
from nemo_fp8.policy.spec import PolicySpec

CPU = torch.device("cpu")
BASE = ("policy.precision=float32", "policy.megatron_cfg.fp8_cfg.enabled=false", "policy.train_global_batch_size=8",
        "policy.train_micro_batch_size=2", "policy.logprob_batch_size=3", "grpo.num_prompts_per_step=8",
        "grpo.num_generations_per_prompt=1", "loss_fn.use_importance_sampling_correction=true")
PACKED = ("policy.shared_prefix_forward=false", "policy.sequence_packing.enabled=true", "policy.sequence_packing.train_mb_tokens=128",
          "policy.sequence_packing.logprob_mb_tokens=256", "policy.sequence_packing.sequence_length_round=8")


def make_batch(vocab: int, n: int = 16, seed: int = 0) -> TrainBatch:
    """``n`` rows of random tokens: prompts of 2..12 tokens, responses of 0..40 (some empty)."""
    g = torch.Generator().manual_seed(seed)
    prompt = torch.randint(2, 13, (n,), generator=g)
    response = torch.randint(0, 41, (n,), generator=g)
    response[3] = 0
    width = int((prompt + response).max())
    ids = torch.randint(3, vocab, (n, width), generator=g)
    ids[torch.arange(width)[None, :] >= (prompt + response)[:, None]] = 0
    adv = torch.randn(n, generator=g)
    gen_lp = -torch.rand(n, width, generator=g) * (torch.arange(width)[None, :] >= prompt[:, None])
    batch = TrainBatch(ids, prompt, response, adv, gen_lp * TrainBatch(ids, prompt, response, adv, gen_lp).token_mask)
    return batch.validate()


@pytest.fixture
def backends(tiny_cfg):
    """(unpacked, packed) backends with the same initial weights."""
    out = []
    for extra in ((), PACKED):
        cfg = tiny_cfg(*BASE, *extra)
        torch.manual_seed(0)
        out.append((cfg, TorchPolicyBackend(PolicySpec.from_config(cfg.policy, CPU))))
    out[1][1].model.load_state_dict(out[0][1].model.state_dict())
    return out


def test_packed_logprobs_loss_and_gradients_equal_unpacked(backends):
    (cfg, plain), (_, packed) = backends
    batch = make_batch(plain.model.config.vocab_size)
    mbs = logprob_micro_batches(packed.spec, batch)
    assert len(mbs) < len(logprob_micro_batches(plain.spec, batch)) and max(map(len, mbs)) > 1  # really packed
    lp = plain.get_logprobs(batch)
    torch.testing.assert_close(packed.get_logprobs(batch), lp, rtol=0, atol=1e-5)
    batch.prev_logprobs = lp
    results = []
    for pol in (plain, packed):
        pol.optimizer.step = lambda: None  # keep the weights: compare this step's gradients
        metrics = pol.train(batch, ClippedPGLossFn(cfg.loss_fn))
        grads = torch.cat([p.grad.flatten() for p in pol.model.parameters() if p.grad is not None])
        results.append((metrics, grads))
    (m0, g0), (m1, g1) = results
    torch.testing.assert_close(g1, g0, rtol=0, atol=1e-5)
    assert g0.abs().max() > 1e-3  # a real gradient
    for k in ("loss", "grad_norm", "is_weight_mean", "clip_fraction"):
        assert m1[k] == pytest.approx(m0[k], rel=1e-5, abs=1e-6), k
    # fewer micro-batches per global batch, less padding
    assert m1["micro_batches"] < m0["micro_batches"] == 4
    assert 0 < m0["packing_efficiency"] < 1 and 0 < m1["packing_efficiency"] <= 1


def test_fixed_shape_packing_gives_the_same_logprobs_loss_and_gradients(tiny_cfg):
    """Rows padded to a fixed size (the static shapes of CUDA graphs): the padding is masked out, so log-probs, loss
    and gradients are the packed run's; only the computed tokens (the packing efficiency) change."""
    runs = []
    for extra in ((), ("policy.sequence_packing.fixed_shape=true",)):
        cfg = tiny_cfg(*BASE, *PACKED, *extra)
        torch.manual_seed(0)
        runs.append((cfg, TorchPolicyBackend(PolicySpec.from_config(cfg.policy, CPU))))
    (cfg, free), (_, fixed) = runs
    fixed.model.load_state_dict(free.model.state_dict())
    assert fixed.spec.train_packing.fixed_sizes == (128, 256) and free.spec.train_packing.fixed_sizes == ()
    batch = make_batch(free.model.config.vocab_size)
    lp = free.get_logprobs(batch)
    torch.testing.assert_close(fixed.get_logprobs(batch), lp, rtol=0, atol=1e-5)
    batch.prev_logprobs = lp
    out = []
    for pol in (free, fixed):
        pol.optimizer.step = lambda: None
        metrics = pol.train(batch, ClippedPGLossFn(cfg.loss_fn))
        out.append((metrics, torch.cat([p.grad.flatten() for p in pol.model.parameters() if p.grad is not None])))
    (m0, g0), (m1, g1) = out
    torch.testing.assert_close(g1, g0, rtol=0, atol=1e-5)
    assert g0.abs().max() > 1e-3
    for k in ("loss", "grad_norm", "is_weight_mean", "clip_fraction"):
        assert m1[k] == pytest.approx(m0[k], rel=1e-5, abs=1e-6), k
    assert m1["micro_batches"] == m0["micro_batches"]  # the same bins, each computing its fixed size
    assert 0 < m1["packing_efficiency"] < m0["packing_efficiency"]


def test_changing_one_sequence_never_changes_another_in_its_bin(backends):
    _, (_, packed) = backends
    batch = make_batch(packed.model.config.vocab_size, seed=1)
    bins = [b for b in logprob_micro_batches(packed.spec, batch) if len(b) > 1]
    assert bins
    before = packed.get_logprobs(batch)
    for b in bins:
        changed = TrainBatch(batch.token_ids.clone(), batch.prompt_lengths, batch.response_lengths, batch.advantages,
                             batch.generation_logprobs)
        victim = b[0]
        n = int(batch.prompt_lengths[victim] + batch.response_lengths[victim])
        changed.token_ids[victim, :n] = (changed.token_ids[victim, :n] + 7) % packed.model.config.vocab_size
        assert logprob_micro_batches(packed.spec, changed) == logprob_micro_batches(packed.spec, batch)
        after = packed.get_logprobs(changed)
        others = [i for i in b if i != victim]
        assert torch.equal(after[others], before[others])
        if batch.response_lengths[victim] > 1:
            assert not torch.equal(after[victim], before[victim])


def test_two_data_parallel_ranks_packed_train_like_one(ray_cluster, tiny_cfg):
    """PolicyGroup with packing: the balanced plan over 2 ranks gives the update of 1 rank, and the
    log-probs (rows balanced by tokens over the ranks) come back in the batch's order."""
    cfg = tiny_cfg(*BASE, *PACKED, "policy.optimizer.lr=1e-3")
    from transformers import AutoConfig

    batch = make_batch(AutoConfig.from_pretrained(cfg.policy.model_name).vocab_size)
    results = {}
    for dp in (1, 2):
        dcfg = cfg.policy.model_copy(update={"data_parallel_size": dp})
        plan = plan_cluster(dp, use_gpu=False, colocated=True)
        pg = create_placement_group(plan)
        group = PolicyGroup.start(pg, plan, PolicySpec.from_config(dcfg, CPU), torch_threads=1)
        try:
            batch.prev_logprobs = group.get_logprobs(batch)
            metrics = group.train(batch, ClippedPGLossFn(cfg.loss_fn))
            results[dp] = (batch.prev_logprobs, metrics, group.get_logprobs(batch))
        finally:
            group.shutdown()
            pg.remove()
    (lp1, m1, after1), (lp2, m2, after2) = results[1], results[2]
    torch.testing.assert_close(lp2, lp1, rtol=0, atol=1e-5)
    for k in ("loss", "grad_norm", "is_weight_mean"):
        assert m2[k] == pytest.approx(m1[k], rel=1e-5, abs=1e-6), k
    torch.testing.assert_close(after2, after1, rtol=0, atol=1e-5)  # the same update
    assert not torch.allclose(after1, lp1)  # a real one

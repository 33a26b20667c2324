"""count_host_syncs (nemo_fp8.utils.host_sync) and the no-host-sync contract of the loss."""

import pickle

import pytest
import torch

from nemo_fp8.algorithms.loss import ClippedPGLossConfig, ClippedPGLossFn, clipped_pg_loss
from nemo_fp8.algorithms.metrics import LOSS_METRIC_REDUCTIONS
from nemo_fp8.utils.metrics import MetricAccumulator
from nemo_fp8.batch import TrainBatch
from nemo_fp8.utils.host_sync import SYNC_METHODS, count_host_syncs


def test_counter_counts_each_kind_and_restores_methods():
    saved = {name: torch.Tensor.__dict__.get(name) for name in SYNC_METHODS}
    x = torch.tensor([1.0, 2.0, 3.0])
    s = torch.tensor(2.0)
    mask = x > 1
    with count_host_syncs() as c:
        s.item()
        float(s)
        int(s)
        bool(s)
        if s > 1:  # bool() of a comparison
            pass
        x.tolist()
        x.numpy()
        x[mask]
        x[:, None][mask]  # mask inside a tuple index counts too (x[:, None] does not)
        x[1:]  # plain indexing is not a sync
        x[torch.tensor([0, 2])]  # integer-tensor indexing is not a sync
        x.nonzero()
        list(range(3))[torch.tensor(1)]  # __index__
    assert dict(c.calls) == {"item": 1, "float": 1, "int": 2, "bool": 2, "tolist": 1, "numpy": 1,
                             "bool_mask_getitem": 2, "nonzero": 1}
    assert c.count == 11
    assert {name: torch.Tensor.__dict__.get(name) for name in SYNC_METHODS} == saved
    # results are unchanged while counting
    with count_host_syncs():
        assert x[mask].tolist() == [2.0, 3.0] and s.item() == 2.0


def test_counter_nested_and_restored_after_exception():
    saved = torch.Tensor.__dict__.get("item")
    with pytest.raises(RuntimeError):
        with count_host_syncs() as outer:
            torch.tensor(1.0).item()
            with count_host_syncs() as inner:
                torch.tensor(1.0).item()
            raise RuntimeError("boom")
    assert outer.count == 2 and inner.count == 1
    assert torch.Tensor.__dict__.get("item") is saved
    with count_host_syncs() as after:
        pass
    torch.tensor(1.0).item()  # outside: not counted
    assert after.count == 0


def _batch(B=5, T=7, seed=0):
    g = torch.Generator().manual_seed(seed)
    prev = -torch.rand(B, T, generator=g) * 3
    lp = (prev + torch.randn(B, T, generator=g) * 0.3).requires_grad_(True)
    gen = prev + torch.randn(B, T, generator=g) * 0.3
    ref = prev + torch.randn(B, T, generator=g) * 0.3
    adv = torch.randn(B, generator=g)
    mask = (torch.rand(B, T, generator=g) > 0.3).float()
    mask[0] = 0.0
    return lp, prev, gen, ref, adv, mask


IS_OPTIONS = [("tis", 1.2, 0.8), ("tis", None, None), ("icepop", 1.2, 0.8), ("seq-mask-tis", 1.2, 0.8),
              ("seq-tis", 1.2, 0.8), (None, 2.0, None)]


@pytest.mark.parametrize("token_level", [True, False])
@pytest.mark.parametrize("kind,hi,lo", IS_OPTIONS)
@pytest.mark.parametrize("global_counts", ["none", "python", "tensor"])
def test_clipped_pg_loss_does_no_host_sync(token_level, kind, hi, lo, global_counts):
    lp, prev, gen, ref, adv, mask = _batch()
    cfg = ClippedPGLossConfig(
        ratio_clip_max=0.28, ratio_clip_c=3.0, reference_policy_kl_penalty=0.05, token_level_loss=token_level,
        use_importance_sampling_correction=kind is not None, truncated_importance_sampling_type=kind or "tis",
        truncated_importance_sampling_ratio=hi, truncated_importance_sampling_ratio_min=lo)
    counts = {"none": {}, "python": dict(global_valid_tokens=40.0, global_valid_seqs=8),
              "tensor": dict(global_valid_tokens=torch.tensor(40.0), global_valid_seqs=torch.tensor([8]))}
    with count_host_syncs() as syncs:
        loss, metrics = clipped_pg_loss(lp, prev, gen, adv, mask, cfg, reference_logprobs=ref,
                                        **counts[global_counts])
        acc = MetricAccumulator(LOSS_METRIC_REDUCTIONS)
        acc.add(metrics)
        acc.add(metrics)
        merged = acc.merge(acc)
    assert syncs.count == 0, syncs.calls
    assert set(metrics) == set(LOSS_METRIC_REDUCTIONS)
    for v in metrics.values():
        assert v.shape == () and v.dtype == torch.float32 and v.device == lp.device and v.grad_fn is None
    loss.backward()
    with count_host_syncs() as syncs:
        out = merged.result()
    assert syncs.calls == {"tolist": 1}  # one host transfer for all metrics
    assert out["num_valid_tokens"] == 4 * mask.sum().item()


def test_loss_fn_through_a_train_batch_does_no_host_sync_and_pickles():
    B, T = 3, 6
    g = torch.Generator().manual_seed(1)
    batch = TrainBatch(token_ids=torch.randint(1, 9, (B, T), generator=g), prompt_lengths=torch.tensor([2, 3, 2]),
                       response_lengths=torch.tensor([4, 0, 3]), advantages=torch.randn(B, generator=g),
                       generation_logprobs=-torch.rand(B, T, generator=g), prev_logprobs=-torch.rand(B, T, generator=g),
                       reference_logprobs=-torch.rand(B, T, generator=g)).validate()
    cfg = ClippedPGLossConfig(reference_policy_kl_penalty=0.1, use_importance_sampling_correction=True,
                              truncated_importance_sampling_ratio_min=0.5)
    fn = pickle.loads(pickle.dumps(ClippedPGLossFn(cfg)))
    assert fn.cfg == cfg and fn.metric_reductions == LOSS_METRIC_REDUCTIONS
    lp = (-torch.rand(B, T, generator=g)).requires_grad_(True)
    with count_host_syncs() as syncs:
        loss, metrics = fn(lp, batch, 7.0, 2.0)
    assert syncs.count == 0, syncs.calls
    assert set(metrics) == set(fn.metric_reductions)
    assert metrics["num_valid_tokens"].item() == 7.0 and metrics["num_valid_seqs"].item() == 2.0
    loss.backward()
    assert torch.isfinite(lp.grad).all()


def test_old_style_code_is_caught():
    # the counter is a meaningful check: the patterns the loss used before are counted
    x = torch.randn(3, 4)
    valid = x > 0
    with count_host_syncs() as syncs:
        n = int(valid.sum().item())
        if n > 0:
            x[valid].min().item()
    assert syncs.calls["item"] == 2 and syncs.calls["bool_mask_getitem"] == 1

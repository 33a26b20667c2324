"""Shared-prefix forward on the torch backend (float64, tiny model): the same log-probs and gradients as the
unshared forward, responses that never see each other, and the config that refuses what it cannot run."""

import pytest
import torch

from nemo_fp8.algorithms.loss import ClippedPGLossFn
from nemo_fp8.batch import TrainBatch
from nemo_fp8.config import ConfigError
from nemo_fp8.policy.shared_prefix import (group_by_prompt, pack_shared_prefix, shared_prefix_mask,
                                          shared_prefix_tokens)
from nemo_fp8.policy.spec import PolicySpec
from nemo_fp8.policy.torch_backend import TorchPolicyBackend, row_micro_batches

CPU = torch.device("cpu")
GROUP_SIZES = (8, 1, 5, 2, 8, 3)  # 27 rows; the group of 1 is a prompt of its own
BASE = ("policy.precision=float64", "policy.megatron_cfg.fp8_cfg.enabled=false", "policy.train_global_batch_size=27",
        "policy.train_micro_batch_size=9", "policy.logprob_batch_size=27", "grpo.num_prompts_per_step=27",
        "grpo.num_generations_per_prompt=1", "loss_fn.use_importance_sampling_correction=true")


def make_grouped_batch(vocab: int, seed: int = 0) -> TrainBatch:
    """Groups of ``GROUP_SIZES`` rows sharing a random prompt (3..20 tokens, two prompts of equal length),
    random responses of 0..8 tokens, rows shuffled."""
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(3, vocab, (int(n),), generator=g) for n in (12, 3, 20, 7, 12, 9)]
    rows = [(p, torch.randint(3, vocab, (int(torch.randint(0, 9, (1,), generator=g)),), generator=g))
            for p, size in zip(prompts, GROUP_SIZES) for _ in range(size)]
    rows[1] = (rows[1][0], torch.randint(3, vocab, (8,), generator=g))  # the longest response
    rows = [rows[i] for i in torch.randperm(len(rows), generator=g).tolist()]
    width = max(len(p) + len(r) for p, r in rows)
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    for i, (p, r) in enumerate(rows):
        ids[i, :len(p) + len(r)] = torch.cat([p, r])
    prompt = torch.tensor([len(p) for p, _ in rows])
    response = torch.tensor([len(r) for _, r in rows])
    adv = torch.randn(len(rows), generator=g)
    mask = TrainBatch(ids, prompt, response, adv, torch.zeros(ids.shape)).token_mask
    return TrainBatch(ids, prompt, response, adv, -torch.rand(ids.shape, generator=g) * mask).validate()


@pytest.fixture
def backends(tiny_cfg):
    """(unshared, shared) float64 backends with the same initial weights."""
    out = []
    for shared in ("false", "true"):
        cfg = tiny_cfg(*BASE, f"policy.shared_prefix_forward={shared}")
        torch.manual_seed(0)
        out.append((cfg, TorchPolicyBackend(PolicySpec.from_config(cfg.policy, CPU))))
    out[1][1].model.load_state_dict(out[0][1].model.state_dict())
    return out


def test_group_by_prompt_finds_groups_by_content_in_any_order():
    ids = torch.tensor([[5, 6, 7, 1], [9, 9, 2, 0], [5, 6, 3, 0], [5, 6, 7, 4], [9, 9, 2, 8]])
    # rows 0 and 3: prompt [5, 6, 7]; row 2: [5, 6] (a prefix of it, another prompt); rows 1, 4: [9, 9, 2]
    assert group_by_prompt(ids, [3, 3, 2, 3, 3]) == [[0, 3], [1, 4], [2]]


def test_mask_prompt_causal_responses_see_prompt_and_themselves_only():
    # packed row: prompt (2 tokens), response 1 (2 tokens), response 2 (1 token), one padding token
    mask = shared_prefix_mask(torch.tensor([[0, 0, 1, 1, 2, -1]]))[0, 0].int()
    expected = torch.tensor([[1, 0, 0, 0, 0, 0],
                             [1, 1, 0, 0, 0, 0],
                             [1, 1, 1, 0, 0, 0],
                             [1, 1, 1, 1, 0, 0],
                             [1, 1, 0, 0, 1, 0],
                             [1, 1, 0, 0, 0, 1]])
    assert torch.equal(mask, expected)


def test_pack_positions_and_score_index():
    # rows 0 and 2 share prompt [5, 6]; row 1 has prompt [7] and an empty response
    ids = torch.tensor([[5, 6, 10, 11], [7, 0, 0, 0], [5, 6, 12, 0]])
    packed = pack_shared_prefix(ids, [2, 1, 2], [2, 0, 1])
    assert packed.groups == [[0, 2], [1]]
    assert packed.token_ids.tolist() == [[5, 6, 10, 11, 12], [7, 0, 0, 0, 0]]
    assert packed.position_ids[0].tolist() == [0, 1, 2, 3, 2]
    # token 10 (row 0, col 2) from the prompt's last token (1), 11 from 10 (2), 12 (row 2, col 2) from 6 (1)
    assert list(zip(packed.score_row.tolist(), packed.score_col.tolist(), packed.score_group.tolist(),
                    packed.score_source.tolist(), packed.score_target.tolist())) == \
        [(0, 2, 0, 1, 10), (0, 3, 0, 2, 11), (2, 2, 0, 1, 12)]
    with pytest.raises(ValueError, match="prompt lengths"):
        pack_shared_prefix(ids, [0, 1, 2], [2, 0, 1])


def test_shared_logprobs_and_gradients_equal_unshared(backends):
    """Log-probs equal (float64 logits, the same float32 log-softmax); gradients to float64 rounding (measured 2e-17):
    the float64 model computes its norms in float64 (``models.hf.compute_in_float64``). With transformers' float32
    norm a shared prompt token's norm backward rounds the sum of its responses' gradients to float32 once where
    separate rows round each (measured 2.5e-9 of a largest gradient of 0.08)."""
    (cfg, plain), (_, shared) = backends
    batch = make_grouped_batch(plain.model.config.vocab_size)
    packed = pack_shared_prefix(batch.token_ids, batch.prompt_lengths.tolist(), batch.response_lengths.tolist())
    assert sorted(map(len, packed.groups)) == sorted(GROUP_SIZES)  # found by content, shuffled rows
    assert packed.computed_tokens < 0.6 * batch.token_ids.numel()  # each prompt computed once
    lp = plain.get_logprobs(batch)
    lp_shared = shared.get_logprobs(batch)
    assert lp.abs().sum() > 1 and torch.equal(lp_shared != 0, lp != 0)
    torch.testing.assert_close(lp_shared, lp, rtol=0, atol=1e-12)
    batch.prev_logprobs = lp
    results = []
    for pol in (plain, shared):
        pol.optimizer.step = lambda: None  # keep the weights: compare this step's gradients
        metrics = pol.train(batch, ClippedPGLossFn(cfg.loss_fn))
        grads = torch.cat([p.grad.flatten() for p in pol.model.parameters() if p.grad is not None])
        results.append((metrics, grads))
    (m0, g0), (m1, g1) = results
    assert g0.dtype == torch.float64 and g0.abs().max() > 1e-3  # a real gradient
    torch.testing.assert_close(g1, g0, rtol=0, atol=1e-10)
    for k in ("loss", "grad_norm", "is_weight_mean"):
        assert m1[k] == pytest.approx(m0[k], rel=1e-10, abs=1e-12), k


def test_packing_efficiency_counts_the_shared_layout(backends):
    """With the shared-prefix forward, ``packing_efficiency`` is that layout's: real tokens (each prompt once, every
    response) over the packed rows' computed tokens, micro-batch by micro-batch; not the unshared rows'."""
    (cfg, plain), (_, shared) = backends
    batch = make_grouped_batch(plain.model.config.vocab_size)
    batch.prev_logprobs = plain.get_logprobs(batch)
    [gb_rows] = row_micro_batches(batch.size, 27, 9)
    real = computed = 0
    for rows in gb_rows:
        sel = torch.tensor(rows)
        packed = pack_shared_prefix(batch.token_ids[sel], batch.prompt_lengths[sel].tolist(),
                                    batch.response_lengths[sel].tolist())
        r, c = shared_prefix_tokens(batch.token_ids[sel], batch.prompt_lengths[sel].tolist(),
                                    batch.response_lengths[sel].tolist())
        assert c == packed.computed_tokens and r == int((packed.token_ids != 0).sum())  # ids >= 3: 0 is padding
        real, computed = real + r, computed + c
    metrics = {name: pol.train(batch, ClippedPGLossFn(cfg.loss_fn)) for name, pol in (("plain", plain),
                                                                                       ("shared", shared))}
    assert metrics["shared"]["packing_efficiency"] == pytest.approx(real / computed)
    unshared_real = int((batch.prompt_lengths + batch.response_lengths).sum())
    assert real < unshared_real  # the prompts counted once
    assert metrics["plain"]["packing_efficiency"] != pytest.approx(metrics["shared"]["packing_efficiency"])


def test_a_response_never_sees_another(backends):
    _, (_, shared) = backends
    batch = make_grouped_batch(shared.model.config.vocab_size, seed=1)
    before = shared.get_logprobs(batch)
    groups = [g for g in pack_shared_prefix(batch.token_ids, batch.prompt_lengths.tolist(),
                                            batch.response_lengths.tolist()).groups if len(g) > 1]
    changed = batch.token_ids.clone()
    for g in groups:  # in every group, new tokens for the responses of all rows but the first
        for i in g[1:]:
            p, r = int(batch.prompt_lengths[i]), int(batch.response_lengths[i])
            changed[i, p:p + r] = (changed[i, p:p + r] + 1) % shared.model.config.vocab_size
    after = shared.get_logprobs(TrainBatch(changed, batch.prompt_lengths, batch.response_lengths, batch.advantages,
                                           batch.generation_logprobs))
    first, rest = [g[0] for g in groups], [i for g in groups for i in g[1:] if batch.response_lengths[i] > 1]
    torch.testing.assert_close(after[first], before[first], rtol=0, atol=0)
    assert rest and all(not torch.equal(after[i], before[i]) for i in rest)  # the changed rows did change


@pytest.mark.parametrize("overrides, match", [
    (["policy.megatron_cfg.enabled=true"], r"shared_prefix_forward: true needs the torch backend"),
    (["policy.sequence_packing.enabled=true"], r"shared_prefix_forward: true cannot run with "
                                               r"policy.sequence_packing.enabled"),
    (["policy.megatron_cfg.pipeline_model_parallel_size=2"], r"shared_prefix_forward: true runs in the one-stage"),
])
def test_config_refuses_what_shared_prefix_cannot_run(tiny_cfg, overrides, match):
    assert tiny_cfg("policy.shared_prefix_forward=true").policy.shared_prefix_forward
    with pytest.raises(ConfigError, match=match):
        tiny_cfg("policy.shared_prefix_forward=true", *overrides)

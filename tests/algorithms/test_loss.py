"""Hand-computed checks for nemo_fp8.algorithms.loss."""

import math
import warnings
from pathlib import Path

import pytest
import torch

from nemo_fp8.algorithms.loss import (
    ClippedPGLossConfig,
    clipped_pg_loss,
    importance_sampling_weights,
    kl_penalty_per_token,
)
from nemo_fp8.algorithms.is_corrections import IS_CORRECTIONS, register_is_correction
from nemo_fp8.algorithms.loss import TRUNCATED_IS_TYPES
from nemo_fp8.algorithms.metrics import LOSS_METRIC_REDUCTIONS
from nemo_fp8.config import ConfigError, load_config

LN = math.log
TINY_CONFIG = Path(__file__).resolve().parents[2] / "examples" / "configs" / "grpo_math_tiny.yaml"


def floats(metrics):
    """Check the metric contract (0-dim float32 detached tensors) and return python floats."""
    for k, v in metrics.items():
        assert isinstance(v, torch.Tensor) and v.shape == () and v.dtype == torch.float32, (k, v)
        assert not v.requires_grad and v.grad_fn is None, k
    return {k: v.item() for k, v in metrics.items()}


def lp_of(*ratios):
    """[1, T] log-probs whose exp are the given ratios against prev = 0."""
    return torch.tensor([[LN(r) for r in ratios]], dtype=torch.float32)


# --------------------------------------------------------------------------- #
# config validation
# --------------------------------------------------------------------------- #


@pytest.mark.parametrize(
    "kwargs, key",
    [
        (dict(ratio_clip_min=1.0), "ratio_clip_min"),
        (dict(ratio_clip_min=-0.1), "ratio_clip_min"),
        (dict(ratio_clip_max=-0.1), "ratio_clip_max"),
        (dict(ratio_clip_c=1.0), "ratio_clip_c"),
        (dict(ratio_clip_c=0.5), "ratio_clip_c"),
        (dict(reference_policy_kl_penalty=-1.0), "reference_policy_kl_penalty"),
        (dict(token_level_loss="yes"), "token_level_loss"),
        (dict(token_level_loss=1), "token_level_loss"),
        (dict(use_importance_sampling_correction=1), "use_importance_sampling_correction"),
        (dict(use_importance_sampling_correction="true"), "use_importance_sampling_correction"),
        (dict(allow_fp8_rollout_without_is_correction=0), "allow_fp8_rollout_without_is_correction"),
        (dict(truncated_importance_sampling_type="mis"), "truncated_importance_sampling_type"),
        (dict(truncated_importance_sampling_ratio=0.0), "truncated_importance_sampling_ratio"),
        (dict(truncated_importance_sampling_ratio_min=-1.0), "truncated_importance_sampling_ratio_min"),
        (dict(truncated_importance_sampling_type="icepop"), "truncated_importance_sampling_ratio_min"),
        (
            dict(truncated_importance_sampling_type="icepop", truncated_importance_sampling_ratio_min=1.5),
            "truncated_importance_sampling_ratio_min",
        ),
        (
            dict(
                truncated_importance_sampling_type="seq-mask-tis",
                truncated_importance_sampling_ratio_min=0.5,
                truncated_importance_sampling_ratio=0.9,
            ),
            "truncated_importance_sampling_ratio: must be set and > 1",
        ),
        (
            dict(truncated_importance_sampling_ratio_min=2.5, truncated_importance_sampling_ratio=2.0),
            "truncated_importance_sampling_ratio_min: 2.5 must be <= truncated_importance_sampling_ratio",
        ),
        (
            dict(truncated_importance_sampling_type="seq-tis", truncated_importance_sampling_ratio_min=3.0),
            "truncated_importance_sampling_ratio_min",
        ),
        (
            dict(truncated_importance_sampling_type="seq-mask-tis", truncated_importance_sampling_ratio=None,
                 truncated_importance_sampling_ratio_min=0.5),
            "truncated_importance_sampling_ratio",
        ),
        (dict(kl_input_clamp_value=0.0), "kl_input_clamp_value"),
        (dict(kl_output_clamp_value=-1.0), "kl_output_clamp_value"),
    ],
)
def test_config_validation_names_the_key(kwargs, key):
    with pytest.raises(ValueError, match=key):
        ClippedPGLossConfig(**kwargs)


def test_valid_configs_without_warnings():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ClippedPGLossConfig()
        ClippedPGLossConfig(ratio_clip_max=0.28, ratio_clip_c=3.0, reference_policy_kl_penalty=0.01)
        ClippedPGLossConfig(truncated_importance_sampling_type="icepop",
                            truncated_importance_sampling_ratio_min=0.5, truncated_importance_sampling_ratio=5.0)
        ClippedPGLossConfig(truncated_importance_sampling_type="seq-tis", truncated_importance_sampling_ratio=None)
        # ratio_min is used by tis / seq-tis now (clamp to [min, ratio]), so no "ignored" warning
        cfg = ClippedPGLossConfig(truncated_importance_sampling_ratio_min=0.5)
        assert cfg.truncated_importance_sampling_ratio_min == 0.5
        ClippedPGLossConfig(truncated_importance_sampling_ratio_min=0.5, truncated_importance_sampling_ratio=None)
        ClippedPGLossConfig(token_level_loss=False, use_importance_sampling_correction=True)


def test_the_config_lists_the_registered_is_corrections():
    assert TRUNCATED_IS_TYPES == tuple(IS_CORRECTIONS) == ("tis", "icepop", "seq-mask-tis", "seq-tis")
    assert all(c.name == name for name, c in IS_CORRECTIONS.items())
    # the registry says which corrections need a window around 1; the config's checks follow it
    assert {name for name, c in IS_CORRECTIONS.items() if c.window} == {"icepop", "seq-mask-tis"}
    for name, c in IS_CORRECTIONS.items():
        kwargs = dict(truncated_importance_sampling_type=name, truncated_importance_sampling_ratio_min=1.5,
                      truncated_importance_sampling_ratio=3.0)  # lo > 1: fine for a clamp, not for a window
        if c.window:
            with pytest.raises(ValueError, match="truncated_importance_sampling_ratio_min: must be set and < 1"):
                ClippedPGLossConfig(**kwargs)
        else:
            ClippedPGLossConfig(**kwargs)


def test_an_unknown_is_correction_is_a_config_error_naming_the_valid_ones():
    with pytest.raises(ValueError, match="truncated_importance_sampling_type") as e:
        ClippedPGLossConfig(truncated_importance_sampling_type="mis")
    with pytest.raises(ConfigError, match="loss_fn.truncated_importance_sampling_type") as e2:
        load_config(TINY_CONFIG, ["loss_fn.truncated_importance_sampling_type=mis"])
    for msg in (str(e.value), str(e2.value)):
        assert all(f"'{name}'" in msg for name in IS_CORRECTIONS), msg


def test_an_is_correction_name_registers_once():
    with pytest.raises(ValueError, match="'tis' is already registered"):
        register_is_correction("tis", window=False)(lambda r, log_r, valid, lo, hi: (r, valid, valid))
    assert IS_CORRECTIONS["tis"].fn.__name__ == "tis"


# --------------------------------------------------------------------------- #
# importance-sampling weights
# --------------------------------------------------------------------------- #


def is_cfg(kind="tis", hi=2.0, lo=None):
    return ClippedPGLossConfig(
        use_importance_sampling_correction=True,
        truncated_importance_sampling_type=kind,
        truncated_importance_sampling_ratio=hi,
        truncated_importance_sampling_ratio_min=lo,
    )


def is_weights(*args):
    w, s = importance_sampling_weights(*args)
    return w, floats(s)


def test_tis_1x3_by_hand():
    # prev - gen = ln [3, 0.5, 1] -> weights [min(3, 2), 0.5, 1] = [2, 0.5, 1]
    prev = torch.zeros(1, 3)
    gen = -lp_of(3.0, 0.5, 1.0)
    w, s = is_weights(prev, gen, torch.ones(1, 3), is_cfg("tis", 2.0))
    torch.testing.assert_close(w, torch.tensor([[2.0, 0.5, 1.0]]))
    assert s["is_weight_mean"] == pytest.approx(3.5 / 3)
    assert s["is_weight_min"] == pytest.approx(0.5)
    assert s["is_weight_max"] == pytest.approx(2.0)
    assert s["is_frac_tokens_truncated"] == pytest.approx(1 / 3)
    assert s["is_frac_tokens_masked"] == 0.0
    assert s["is_frac_seqs_masked"] == 0.0


def test_tis_clamps_to_ratio_min_too():
    # NeMo-RL's tis clamps to [ratio_min, ratio]: ratios [3, 0.5, 1, 0.2], [0.6, 2] -> [2, 0.6, 1, 0.6]
    prev = torch.zeros(1, 4)
    gen = -lp_of(3.0, 0.5, 1.0, 0.2)
    w, s = is_weights(prev, gen, torch.ones(1, 4), is_cfg("tis", 2.0, 0.6))
    torch.testing.assert_close(w, torch.tensor([[2.0, 0.6, 1.0, 0.6]]))
    assert s["is_frac_tokens_truncated"] == pytest.approx(3 / 4)  # clamped at either bound
    assert s["is_weight_min"] == pytest.approx(0.6) and s["is_weight_max"] == pytest.approx(2.0)
    assert s["is_frac_tokens_masked"] == 0.0
    # lower bound only (ratio=None): [3, 0.6, 1, 0.6], 2 of 4 clamped
    w, s = is_weights(prev, gen, torch.ones(1, 4), is_cfg("tis", None, 0.6))
    torch.testing.assert_close(w, torch.tensor([[3.0, 0.6, 1.0, 0.6]]))
    assert s["is_frac_tokens_truncated"] == pytest.approx(0.5)


def test_seq_tis_clamps_to_ratio_min_too():
    # sequence ratios: row0 1.5 * 1.2 = 1.8 (kept), row1 0.5 * 0.4 = 0.2 -> 0.5, row2 4 -> 2
    prev = torch.zeros(3, 2)
    gen = -torch.tensor([[LN(1.5), LN(1.2)], [LN(0.5), LN(0.4)], [LN(2.0), LN(2.0)]])
    mask = torch.tensor([[1.0, 1.0], [1.0, 1.0], [1.0, 0.0]])
    gen[2, 1] = 0.0  # row2: only its first token is valid -> ratio 2, not clamped
    w, s = is_weights(prev, gen, mask, is_cfg("seq-tis", 2.0, 0.5))
    torch.testing.assert_close(w, torch.tensor([[1.8, 1.8], [0.5, 0.5], [2.0, 0.0]]))
    assert s["is_frac_tokens_truncated"] == pytest.approx(2 / 5)
    gen[2, 1] = -LN(2.0)
    mask[2, 1] = 1.0  # now 4 -> clamped to 2
    w, s = is_weights(prev, gen, mask, is_cfg("seq-tis", 2.0, 0.5))
    torch.testing.assert_close(w, torch.tensor([[1.8, 1.8], [0.5, 0.5], [2.0, 2.0]]))
    assert s["is_frac_tokens_truncated"] == pytest.approx(4 / 6)


def test_tis_without_cap_and_mask_zeroes_outside():
    prev = torch.zeros(1, 3)
    gen = torch.tensor([[-LN(3.0), 0.0, -500.0]])  # last token masked, huge ratio there
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    w, s = is_weights(prev, gen, mask, is_cfg("tis", None))
    torch.testing.assert_close(w, torch.tensor([[3.0, 1.0, 0.0]]))
    assert s["is_weight_max"] == pytest.approx(3.0)
    assert s["is_frac_tokens_truncated"] == 0.0


def test_icepop_by_hand():
    # ratios [3, 0.5, 1.5, 0.4] with window [0.5, 2] -> [0, 0.5, 1.5, 0]
    prev = torch.zeros(1, 4)
    gen = -lp_of(3.0, 0.5, 1.5, 0.4)
    gen[0, 1] = LN(2.0) - 1e-6  # ratio just above 0.5 (avoid float ties at the bound)
    w, s = is_weights(prev, gen, torch.ones(1, 4), is_cfg("icepop", 2.0, 0.5))
    torch.testing.assert_close(w, torch.tensor([[0.0, 0.5, 1.5, 0.0]]), atol=1e-5, rtol=0)
    assert s["is_frac_tokens_masked"] == pytest.approx(0.5)
    assert s["is_frac_tokens_truncated"] == pytest.approx(0.5)
    assert s["is_frac_seqs_masked"] == 0.0
    assert s["is_weight_min"] == 0.0


def test_seq_mask_tis_by_hand():
    # row0: log r = [ln 3, 0] -> geo mean sqrt(3) = 1.73 in [0.5, 2]: kept, raw weights [3, 1] (3 not capped)
    # row1: log r = [ln 4, ln 2] (+ a masked token) -> geo mean sqrt(8) = 2.83 > 2: whole sequence zeroed
    prev = torch.zeros(2, 3)
    gen = -torch.tensor([[LN(3.0), 0.0, 0.0], [LN(4.0), LN(2.0), 7.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 0.0]])
    w, s = is_weights(prev, gen, mask, is_cfg("seq-mask-tis", 2.0, 0.5))
    torch.testing.assert_close(w, torch.tensor([[3.0, 1.0, 0.0], [0.0, 0.0, 0.0]]))
    assert s["is_frac_tokens_masked"] == pytest.approx(0.5)
    assert s["is_frac_seqs_masked"] == pytest.approx(0.5)
    assert s["is_weight_max"] == pytest.approx(3.0)


def test_seq_tis_by_hand():
    # row0: sum log r = ln(1.5 * 1.2) -> 1.8 on both tokens; row1: ln(2 * 2) -> 4, capped to 2
    prev = torch.zeros(2, 3)
    gen = -torch.tensor([[LN(1.5), LN(1.2), 0.0], [LN(2.0), LN(2.0), 5.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 0.0]])
    w, s = is_weights(prev, gen, mask, is_cfg("seq-tis", 2.0))
    torch.testing.assert_close(w, torch.tensor([[1.8, 1.8, 0.0], [2.0, 2.0, 0.0]]))
    assert s["is_frac_tokens_truncated"] == pytest.approx(0.5)
    assert s["is_frac_tokens_masked"] == 0.0


def test_is_off_gives_mask_weights():
    prev = torch.zeros(1, 3)
    gen = -lp_of(3.0, 0.5, 1.0)
    mask = torch.tensor([[1.0, 0.0, 1.0]])
    w, s = is_weights(prev, gen, mask, ClippedPGLossConfig())
    torch.testing.assert_close(w, mask)
    assert s["is_weight_mean"] == 1.0 and s["is_frac_tokens_truncated"] == 0.0


@pytest.mark.parametrize("kind,hi,lo", [("tis", 2.0, None), ("icepop", 2.0, 0.5),
                                        ("seq-mask-tis", 2.0, 0.5), ("seq-tis", 2.0, None)])
def test_is_weights_have_no_grad(kind, hi, lo):
    prev = torch.randn(2, 4, requires_grad=True)
    gen = torch.randn(2, 4, requires_grad=True)
    w, _ = is_weights(prev, gen, torch.ones(2, 4), is_cfg(kind, hi, lo))
    assert w.grad_fn is None and not w.requires_grad
    assert w.dtype == torch.float32


def test_is_weights_empty_mask_stats_are_zero():
    w, s = is_weights(torch.zeros(1, 2), torch.zeros(1, 2), torch.zeros(1, 2), is_cfg())
    assert w.abs().sum() == 0
    assert all(v == 0.0 for v in s.values())


# --------------------------------------------------------------------------- #
# the loss: hand cases and analytic gradients
# --------------------------------------------------------------------------- #


def run(lp, adv, cfg, prev=None, gen=None, mask=None, **kw):
    lp = lp.clone().requires_grad_(True)
    prev = torch.zeros_like(lp) if prev is None else prev
    gen = prev.clone() if gen is None else gen
    mask = torch.ones_like(lp) if mask is None else mask
    loss, m = clipped_pg_loss(lp, prev, gen, adv, mask, cfg, **kw)
    assert set(m) == set(LOSS_METRIC_REDUCTIONS)
    assert all(v.device == lp.device for v in m.values())
    loss.backward()
    return loss, floats(m), lp.grad


def test_ppo_clip_hand_case_and_gradient():
    # A = [1, 1, -1, -1], r = [1.5, 1.1, 0.5, 0.9], eps = 0.2
    # t0: max(-1.5, -1.2) = -1.2 clipped (grad 0); t1: -1.1 (grad -1.1)
    # t2: max(0.5, 0.8) = 0.8 clipped (grad 0);   t3: 0.9 (grad 0.9)
    lp = lp_of(1.5, 1.1, 0.5, 0.9)
    adv = torch.tensor([[1.0, 1.0, -1.0, -1.0]])
    loss, m, grad = run(lp, adv, ClippedPGLossConfig())
    assert loss.item() == pytest.approx((-1.2 - 1.1 + 0.8 + 0.9) / 4, abs=1e-6)
    torch.testing.assert_close(grad, torch.tensor([[0.0, -1.1 / 4, 0.0, 0.9 / 4]]))
    assert m["clip_fraction"] == pytest.approx(0.5)
    assert m["ratio_mean"] == pytest.approx((1.5 + 1.1 + 0.5 + 0.9) / 4, abs=1e-6)
    assert m["ratio_min"] == pytest.approx(0.5) and m["ratio_max"] == pytest.approx(1.5)
    assert m["pg_loss"] == pytest.approx(m["loss"]) and m["kl_penalty"] == 0.0


def test_clip_higher_keeps_gradient_above_symmetric_bound():
    lp = lp_of(1.25)
    adv = torch.tensor([1.0])
    _, m_sym, g_sym = run(lp, adv, ClippedPGLossConfig(ratio_clip_max=0.2))
    _, m_hi, g_hi = run(lp, adv, ClippedPGLossConfig(ratio_clip_max=0.28))
    assert g_sym.item() == 0.0 and m_sym["clip_fraction"] == 1.0
    assert g_hi.item() == pytest.approx(-1.25) and m_hi["clip_fraction"] == 0.0


def test_dual_clip_hand_case():
    # A = -1 everywhere; r = [5, 2]; c = 3.
    # without dual clip: losses [5, 2], grads [5, 2] (d(-A r)/dlp = -A r)
    # with c = 3: t0 capped at 3 (grad 0), t1 unchanged (2 < 3)
    lp = lp_of(5.0, 2.0)
    adv = torch.tensor([-1.0])
    loss, _, grad = run(lp, adv, ClippedPGLossConfig())
    assert loss.item() == pytest.approx(3.5, abs=1e-5)
    torch.testing.assert_close(grad, torch.tensor([[2.5, 1.0]]))
    loss, m, grad = run(lp, adv, ClippedPGLossConfig(ratio_clip_c=3.0))
    assert loss.item() == pytest.approx(2.5, abs=1e-5)
    torch.testing.assert_close(grad, torch.tensor([[0.0, 1.0]]))
    assert m["dual_clip_fraction"] == pytest.approx(0.5)
    # positive advantages are untouched by the dual clip: max(-5, -1.2) = -1.2
    loss, _, _ = run(lp_of(5.0), torch.tensor([1.0]), ClippedPGLossConfig(ratio_clip_c=3.0))
    assert loss.item() == pytest.approx(-1.2, abs=1e-6)


def test_is_weight_scales_loss_and_gradient():
    # IS ratios prev/gen = [3, 0.5] -> TIS(C=2) weights [2, 0.5]; policy ratios r = [1.1, 0.9], A = 1
    # losses: 2 * -1.1 = -2.2, 0.5 * -0.9 = -0.45 -> mean -1.325; grads [-2.2, -0.45] / 2
    lp = lp_of(1.1, 0.9)
    prev = torch.zeros(1, 2)
    gen = -lp_of(3.0, 0.5)
    loss, m, grad = run(lp, torch.tensor([1.0]), is_cfg("tis", 2.0), prev=prev, gen=gen)
    assert loss.item() == pytest.approx(-1.325, abs=1e-6)
    torch.testing.assert_close(grad, torch.tensor([[-1.1, -0.225]]))
    assert m["is_weight_max"] == pytest.approx(2.0)
    assert m["is_frac_tokens_truncated"] == pytest.approx(0.5)


def test_kl_penalty_hand_case_and_gradient():
    # A = 0; x = ref - lp = [ln 2, 0]: k3 = [2 - 1 - ln 2, 0].
    # NeMo-RL multiplies k3 by w = exp(lp - lp.detach()) (value 1, dw/dlp = 1), so per token
    # d(w k3)/dlp = k3 + (1 - e^x) = -x = lp - ref = [-ln 2, 0]  (k3 alone would give 1 - e^x = [-1, 0]).
    lp = torch.zeros(1, 2)
    ref = torch.tensor([[LN(2.0), 0.0]])
    cfg = ClippedPGLossConfig(reference_policy_kl_penalty=0.1)
    loss, m, grad = run(lp, torch.tensor([0.0]), cfg, reference_logprobs=ref)
    k3 = 1.0 - LN(2.0)
    assert loss.item() == pytest.approx(0.1 * k3 / 2, abs=1e-7)  # value unchanged by the factor
    assert m["kl_penalty"] == pytest.approx(k3 / 2, abs=1e-6)
    torch.testing.assert_close(grad, torch.tensor([[-0.1 * LN(2.0) / 2, 0.0]]))
    # beta = 0: KL only reported, not in the loss or its gradient
    loss0, m0, grad0 = run(lp, torch.tensor([0.0]), ClippedPGLossConfig(), reference_logprobs=ref)
    assert loss0.item() == 0.0 and m0["kl_penalty"] == pytest.approx(k3 / 2, abs=1e-6)
    assert grad0.abs().sum() == 0


@pytest.mark.parametrize("token_level", [True, False])
def test_kl_gradient_closed_form_against_autograd(token_level):
    # With A = 0 only the KL term has a gradient: beta * (lp - ref) / N per valid token at token
    # level (N = valid tokens), beta * (lp - ref) / (n_seq * tokens of its sequence) at sequence level.
    lp, prev, gen, ref, _, mask = random_batch(B=4, T=5, seed=7)
    beta = 0.3
    cfg = ClippedPGLossConfig(reference_policy_kl_penalty=beta, token_level_loss=token_level,
                              kl_input_clamp_value=None, kl_output_clamp_value=None)
    _, _, grad = run(lp, torch.zeros(4), cfg, prev=prev, gen=gen, mask=mask, reference_logprobs=ref)
    if token_level:
        norm = mask.sum()
    else:
        norm = (mask.sum(-1) > 0).sum() * mask.sum(-1, keepdim=True).clamp(min=1)
    expected = beta * (lp - ref) * mask / norm
    torch.testing.assert_close(grad, expected)


def test_kl_clamped_tokens_get_no_gradient():
    # x = ref - lp: token0 x = -3 < -(input clamp 2): k3(-2) = e^-2 + 1 (no grad from k3 nor from the
    # factor); token1 k3(1.5) = e^1.5 - 2.5 = 1.98 > output clamp 1.5 (clamped: no grad);
    # token2 x = 0.5 free: grad lp - ref = -0.5.
    lp = torch.zeros(1, 3, requires_grad=True)
    ref = torch.tensor([[-3.0, 1.5, 0.5]])
    kl = kl_penalty_per_token(lp, ref, input_clamp=2.0, output_clamp=1.5)
    torch.testing.assert_close(kl.detach(), torch.tensor([[math.exp(-2) + 1, 1.5, math.exp(0.5) - 1.5]]))
    kl.sum().backward()
    torch.testing.assert_close(lp.grad, torch.tensor([[0.0, 0.0, -0.5]]))


def test_kl_factor_matches_explicit_score_function_gradient():
    # The same gradient written out: k3(ref - lp) d/dlp[lp] + d/dlp[k3(ref - lp)] (surrogate
    # k3.detach() * lp + k3), computed by autograd on an independent expression.
    torch.manual_seed(1)
    lp0 = torch.randn(2, 3) * 0.5
    ref = lp0 + torch.randn(2, 3) * 0.5
    a = lp0.clone().requires_grad_(True)
    kl_penalty_per_token(a, ref, None, None).sum().backward()
    b = lp0.clone().requires_grad_(True)
    k3 = torch.exp(ref - b) - 1 - (ref - b)
    (k3.detach() * b + k3).sum().backward()
    torch.testing.assert_close(a.grad, b.grad)
    torch.testing.assert_close(a.grad, lp0 - ref)


def test_approx_kl_metric():
    # prev = 0, lp = ln 2: k3(prev - lp) = 0.5 - 1 + ln 2
    _, m, _ = run(lp_of(2.0), torch.tensor([0.0]), ClippedPGLossConfig())
    assert m["approx_kl"] == pytest.approx(LN(2.0) - 0.5, abs=1e-6)


def test_token_vs_sequence_level_aggregation():
    # ratio 1 -> per-token loss = -A. row0: one valid token (-2); row1: three tokens (-1 each); row2 empty.
    adv = torch.tensor([[2.0, 9.0, 9.0], [1.0, 1.0, 1.0], [5.0, 5.0, 5.0]])
    mask = torch.tensor([[1.0, 0.0, 0.0], [1.0, 1.0, 1.0], [0.0, 0.0, 0.0]])
    lp = torch.zeros(3, 3)
    loss_tok, m_tok, _ = run(lp, adv, ClippedPGLossConfig(token_level_loss=True), mask=mask)
    loss_seq, m_seq, _ = run(lp, adv, ClippedPGLossConfig(token_level_loss=False), mask=mask)
    assert loss_tok.item() == pytest.approx((-2 - 3) / 4)  # -1.25
    assert loss_seq.item() == pytest.approx((-2 + -1) / 2)  # -1.5 (empty row not counted)
    assert m_seq["num_valid_seqs"] == 2.0 and m_tok["num_valid_tokens"] == 4.0


def test_sequence_advantages_broadcast_equals_token_advantages():
    torch.manual_seed(0)
    lp, prev = torch.randn(3, 4) * 0.3, torch.randn(3, 4) * 0.3
    adv = torch.randn(3)
    cfg = ClippedPGLossConfig()
    a, _, ga = run(lp, adv, cfg, prev=prev)
    b, _, gb = run(lp, adv[:, None].expand(3, 4).clone(), cfg, prev=prev)
    assert a.item() == pytest.approx(b.item())
    torch.testing.assert_close(ga, gb)


# --------------------------------------------------------------------------- #
# masks, micro-batches, degenerate inputs, no grad to detached inputs
# --------------------------------------------------------------------------- #


def random_batch(B=6, T=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    prev = -torch.rand(B, T, generator=g) * 3
    lp = prev + torch.randn(B, T, generator=g) * 0.3
    gen = prev + torch.randn(B, T, generator=g) * 0.3
    ref = prev + torch.randn(B, T, generator=g) * 0.3
    adv = torch.randn(B, T, generator=g)
    mask = (torch.rand(B, T, generator=g) > 0.3).float()
    mask[0] = 0.0  # one fully masked sequence
    mask[1, 0] = 1.0
    return lp, prev, gen, ref, adv, mask


FULL_CFG = dict(
    ratio_clip_max=0.28,
    ratio_clip_c=3.0,
    reference_policy_kl_penalty=0.05,
    use_importance_sampling_correction=True,
    truncated_importance_sampling_ratio=1.2,
)


@pytest.mark.parametrize("token_level", [True, False])
@pytest.mark.parametrize("kind,lo", [("tis", None), ("icepop", 0.8), ("seq-mask-tis", 0.8), ("seq-tis", None)])
def test_masked_positions_do_not_matter(token_level, kind, lo):
    lp, prev, gen, ref, adv, mask = random_batch()
    cfg = ClippedPGLossConfig(**{**FULL_CFG, "token_level_loss": token_level,
                                 "truncated_importance_sampling_type": kind,
                                 "truncated_importance_sampling_ratio_min": lo})
    loss, m, grad = run(lp, adv, cfg, prev=prev, gen=gen, mask=mask, reference_logprobs=ref)
    off = mask == 0
    garbage = [lp.clone(), prev.clone(), gen.clone(), ref.clone(), adv.clone()]
    for i, t in enumerate(garbage):
        t[off] = [1e4, -1e4, float("inf"), float("-inf"), float("nan")][i]
    loss2, m2, grad2 = run(garbage[0], garbage[4], cfg, prev=garbage[1], gen=garbage[2], mask=mask,
                           reference_logprobs=garbage[3])
    assert loss2.item() == loss.item()
    torch.testing.assert_close(grad2, grad)
    assert torch.isfinite(grad2).all()
    assert (grad2[off] == 0).all()
    assert m2 == m


@pytest.mark.parametrize("token_level", [True, False])
def test_all_masked_batch_is_zero_without_nan(token_level):
    lp, prev, gen, ref, adv, _ = random_batch()
    cfg = ClippedPGLossConfig(**{**FULL_CFG, "token_level_loss": token_level})
    loss, m, grad = run(lp, adv, cfg, prev=prev, gen=gen, mask=torch.zeros_like(lp), reference_logprobs=ref)
    assert loss.item() == 0.0
    assert (grad == 0).all()
    assert all(math.isfinite(v) for v in m.values())


@pytest.mark.parametrize("token_level", [True, False])
def test_micro_batches_sum_to_full_batch(token_level):
    lp, prev, gen, ref, adv, mask = random_batch(B=6, T=5, seed=3)
    cfg = ClippedPGLossConfig(**{**FULL_CFG, "token_level_loss": token_level})
    full, m_full, g_full = run(lp, adv, cfg, prev=prev, gen=gen, mask=mask, reference_logprobs=ref)
    n_tok = float(mask.sum())
    n_seq = float((mask.sum(-1) > 0).sum())
    total, g_parts, kl_total = 0.0, [], 0.0
    for s in (slice(0, 2), slice(2, 3), slice(3, 6)):
        part, m, g = run(lp[s], adv[s], cfg, prev=prev[s], gen=gen[s], mask=mask[s], reference_logprobs=ref[s],
                         global_valid_tokens=n_tok, global_valid_seqs=n_seq)
        total += part.item()
        kl_total += m["kl_penalty"]
        g_parts.append(g)
    assert total == pytest.approx(full.item(), abs=1e-6)
    assert kl_total == pytest.approx(m_full["kl_penalty"], abs=1e-6)
    torch.testing.assert_close(torch.cat(g_parts), g_full)
    # without the global counts the parts would be normalised locally and not sum up
    local = sum(run(lp[s], adv[s], cfg, prev=prev[s], gen=gen[s], mask=mask[s], reference_logprobs=ref[s])[0].item()
                for s in (slice(0, 2), slice(2, 3), slice(3, 6)))
    assert local != pytest.approx(full.item(), abs=1e-4)


def test_no_grad_reaches_prev_generation_reference_or_advantages():
    lp, prev, gen, ref, adv, mask = random_batch()
    lp.requires_grad_(True)
    others = [t.clone().requires_grad_(True) for t in (prev, gen, ref, adv)]
    loss, _ = clipped_pg_loss(lp, others[0], others[1], others[3], mask,
                              ClippedPGLossConfig(**FULL_CFG), reference_logprobs=others[2])
    loss.backward()
    assert lp.grad is not None
    assert all(t.grad is None for t in others)


def test_ratio_clip_zero_grad_when_clipped_even_with_is():
    # r = 1.5 > 1.2 with A > 0: clipped, zero gradient regardless of the IS weight
    lp = lp_of(1.5)
    _, _, grad = run(lp, torch.tensor([1.0]), is_cfg("tis", 2.0), gen=-lp_of(1.7))
    assert grad.item() == 0.0


# --------------------------------------------------------------------------- #
# errors
# --------------------------------------------------------------------------- #


def test_shape_errors_name_tensors():
    lp = torch.zeros(2, 4)
    ok = dict(prev_logprobs=torch.zeros(2, 4), generation_logprobs=torch.zeros(2, 4),
              advantages=torch.zeros(2), token_mask=torch.ones(2, 4), cfg=ClippedPGLossConfig())
    for name, bad in [("prev_logprobs", torch.zeros(2, 3)), ("generation_logprobs", torch.zeros(4, 2)),
                      ("token_mask", torch.ones(2)), ("advantages", torch.zeros(3)),
                      ("advantages", torch.zeros(2, 3))]:
        with pytest.raises(ValueError, match=name):
            clipped_pg_loss(lp, **{**ok, name: bad})
    with pytest.raises(ValueError, match="reference_logprobs"):
        clipped_pg_loss(lp, **ok, reference_logprobs=torch.zeros(2, 5))
    with pytest.raises(ValueError, match="reference_logprobs"):
        clipped_pg_loss(lp, **{**ok, "cfg": ClippedPGLossConfig(reference_policy_kl_penalty=0.1)})
    with pytest.raises(ValueError, match="logprobs"):
        clipped_pg_loss(torch.zeros(8), **ok)


def test_global_count_errors():
    # Python numbers are checked on the host; tensors are not read (no sync), and the global
    # count is no longer compared with this batch's own count (that needs a sync per micro-batch).
    lp = torch.zeros(2, 4)
    args = (torch.zeros(2, 4), torch.zeros(2, 4), torch.zeros(2), torch.ones(2, 4), ClippedPGLossConfig())
    seq_cfg = ClippedPGLossConfig(token_level_loss=False)
    for bad in (-1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="global_valid_tokens"):
            clipped_pg_loss(lp, *args, global_valid_tokens=bad)
        with pytest.raises(ValueError, match="global_valid_seqs"):
            clipped_pg_loss(lp, *args[:-1], seq_cfg, global_valid_seqs=bad)
    with pytest.raises(ValueError, match="global_valid_tokens"):
        clipped_pg_loss(lp, *args, global_valid_tokens=torch.tensor([8.0, 8.0]))
    with pytest.raises(TypeError, match="global_valid_tokens"):
        clipped_pg_loss(lp, *args, global_valid_tokens="8")
    # tensors (0-dim or one element, float or int) are accepted as global counts
    adv = torch.ones(2)
    for given in (torch.tensor(16.0), torch.tensor([16]), 16, 16.0):
        loss, _ = clipped_pg_loss(lp, *args[:2], adv, *args[3:], global_valid_tokens=given)
        assert loss.item() == pytest.approx(-0.5)  # -8 / 16
    # a zero count (nothing valid anywhere) is replaced by 1: 0, not nan
    empty = torch.zeros(2, 4)
    for given in (0, torch.tensor(0.0)):
        loss, _ = clipped_pg_loss(lp, *args[:3], empty, args[4], global_valid_tokens=given)
        assert loss.item() == 0.0


def test_config_copy_and_validation():
    cfg = ClippedPGLossConfig().model_copy(update={"ratio_clip_max": 0.28})
    assert cfg.ratio_clip_max == 0.28
    # model_copy(update=...) skips validation (pydantic); model_validate and assignment check
    with pytest.raises(ValueError, match="ratio_clip_c"):
        ClippedPGLossConfig.model_validate({**cfg.model_dump(), "ratio_clip_c": 1.0})
    with pytest.raises(ValueError, match="ratio_clip_c"):
        cfg.ratio_clip_c = 1.0
    with pytest.raises(ValueError, match="token_level_loss"):
        cfg.token_level_loss = 1
    assert cfg.ratio_clip_c is None and cfg.token_level_loss is True

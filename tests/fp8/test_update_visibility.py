"""nemo_fp8/fp8/update_visibility.py and tools/fp8_update_visibility.py: how much of an update an FP8 engine sees."""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import pytest
import torch

from nemo_fp8.fp8.update_visibility import STAT_KEYS, update_visibility_sums, visibility_from_sums

REPO = Path(__file__).resolve().parents[2]


def test_hand_computed_single_block():
    """One block whose amax is 448, so scale_inv = 1 and the FP8 grid is e4m3's own: spacing 1 on [8, 16)."""
    before = torch.tensor([[448.0, 10.0], [20.0, 30.0]])
    below = before.clone()
    below[0, 1] = 10.5  # bf16 holds it; e4m3 rounds the tie to even: 10, so the FP8 engine sees no change
    s = update_visibility_sums(before, below)
    assert s == {"elements": 4.0, "bf16_changed": 1.0, "fp8_changed": 0.0, "update_sq": 0.25, "fp8_update_sq": 0.0,
                 "error_sq": 0.25, "dot": 0.0}
    r = visibility_from_sums(s)
    assert (r["bf16_changed_frac"], r["fp8_changed_frac"], r["rel_error"], r["norm_ratio"]) == (0.25, 0.0, 1.0, 0.0)
    assert math.isnan(r["cosine"])
    above = before.clone()
    above[0, 1] = 10.75  # rounds to 11: the engine sees +1 for a +0.75 update
    r = visibility_from_sums(update_visibility_sums(before, above))
    assert r["fp8_changed_frac"] == 0.25 and r["rel_error"] == pytest.approx(0.25 / 0.75)
    assert r["cosine"] == pytest.approx(1.0) and r["norm_ratio"] == pytest.approx(1 / 0.75)


def test_no_update_and_bad_shapes():
    w = torch.randn(128, 256) * 0.02
    r = visibility_from_sums(update_visibility_sums(w, w.clone()))
    assert r["bf16_changed_frac"] == 0.0 and r["fp8_changed_frac"] == 0.0 and math.isnan(r["rel_error"])
    with pytest.raises(ValueError, match="same 2-D"):
        update_visibility_sums(w, w[:, :128])
    with pytest.raises(ValueError, match="same 2-D"):
        update_visibility_sums(w.flatten(), w.flatten())


def test_small_updates_reach_few_fp8_values_as_noise_large_ones_intact():
    """Weights of std 0.02 (block amax ~0.09, e4m3 spacing ~1.6e-3 near |w| = 0.02; bf16's is 16x finer).
    +-1e-5 per element (about what one Adam step at lr 1e-5 does): bf16 moves a quarter of the values, FP8 a few
    percent, and the FP8 view of the update is mostly rounding noise. +-2e-2 (10x the FP8 spacing) arrives intact."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(256, 384, generator=g) * 0.02
    sign = torch.randint(0, 2, w.shape, generator=g).float() * 2 - 1
    small = visibility_from_sums(update_visibility_sums(w, w + 1e-5 * sign))
    assert 0.15 < small["bf16_changed_frac"] < 0.35 and small["fp8_changed_frac"] < 0.06
    assert small["rel_error"] > 2.0 and small["cosine"] < 0.5
    large = visibility_from_sums(update_visibility_sums(w, w + 2e-2 * sign))
    assert large["fp8_changed_frac"] == 1.0 and large["rel_error"] < 0.1 and large["cosine"] > 0.99
    pow2 = visibility_from_sums(update_visibility_sums(w, w + 1e-5 * sign, scale_mode="pow2"))
    assert pow2["fp8_changed_frac"] < 0.06 and pow2["rel_error"] > 2.0  # the coarse grid, not the scale, decides


def test_sums_add_across_weights():
    g = torch.Generator().manual_seed(1)
    a, b = torch.randn(128, 128, generator=g) * 0.02, torch.randn(256, 128, generator=g) * 0.05
    sa, sb = update_visibility_sums(a, a * 1.01), update_visibility_sums(b, b + 1e-3)
    total = {k: sa[k] + sb[k] for k in STAT_KEYS}
    both = update_visibility_sums(torch.cat([a, b]), torch.cat([a * 1.01, b + 1e-3]), weight_block_size=(128, 128))
    for k in STAT_KEYS:
        assert total[k] == pytest.approx(both[k], rel=1e-12), k


def _tool():
    spec = importlib.util.spec_from_file_location("fp8_update_visibility", REPO / "tools" / "fp8_update_visibility.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_tool_on_two_checkpoints(tmp_path, capsys):
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(2)
    before = {"model.layers.0.self_attn.q_proj.weight": torch.randn(256, 128, generator=g) * 0.02,
              "model.layers.0.mlp.down_proj.weight": torch.randn(128, 256, generator=g) * 0.02,
              "model.layers.0.input_layernorm.weight": torch.ones(128),  # not a linear weight: left out
              "model.embed_tokens.weight": torch.randn(512, 128, generator=g)}  # not a *_proj: left out
    after = {k: v.clone() for k, v in before.items()}
    after["model.layers.0.self_attn.q_proj.weight"] += 2e-2
    (tmp_path / "a").mkdir()
    (tmp_path / "b" / "policy" / "model").mkdir(parents=True)  # a checkpoint folder: policy/model
    save_file({k: v.to(torch.bfloat16) for k, v in before.items()}, str(tmp_path / "a" / "model.safetensors"))
    save_file({k: v.to(torch.bfloat16) for k, v in after.items()},
              str(tmp_path / "b" / "policy" / "model" / "model.safetensors"))
    assert _tool().main(["--before", str(tmp_path / "a"), "--after", str(tmp_path / "b")]) == 0
    out = capsys.readouterr().out
    rows = {line.split("|")[1].strip(): [c.strip() for c in line.split("|")[2:-1]] for line in out.splitlines()
            if line.startswith("| ") and not line.startswith("| weights")}
    assert list(rows) == ["down_proj", "q_proj", "all"]
    assert rows["down_proj"][1:3] == ["0.0000", "0.0000"] and rows["down_proj"][3] == "nan"
    assert rows["q_proj"][1:3] == ["1.0000", "1.0000"] and float(rows["q_proj"][3]) < 0.1
    assert rows["all"][0] == f"{2 * 256 * 128:,}" and rows["all"][1] == "0.5000"
    assert _tool().main(["--before", str(tmp_path / "a"), "--after", str(tmp_path / "nowhere")]) == 2
    assert "no *.safetensors" in capsys.readouterr().err

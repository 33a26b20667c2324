"""FP8 KV scales: the formula, the refit names, and the per-layer metrics."""

from __future__ import annotations

import pytest
import torch

from nemo_fp8.fp8.kv_scales import KvScales, calibration_rows, parse_kv_scale_name


def test_from_amax_and_named_tensors_round_trip():
    amax = [torch.tensor([448.0, 1.0, 0.0]), torch.tensor([2.0, 3.0, 4.0]), torch.tensor([0.5, 0.25, 8.0])]
    kv = KvScales.from_amax(*amax, step=7, margin=2.0)
    torch.testing.assert_close(kv.k_scale, torch.tensor([2.0, 3.0, 4.0]) * 2.0 / 448.0)
    assert kv.q_scale[0] == 2.0 and kv.q_scale[2] > 0  # an all-zero tensor still gets a positive scale
    got = {parse_kv_scale_name(n): float(t) for n, t in kv.named_tensors()}
    assert len(got) == 9 and got[(2, "v")] == float(kv.v_scale[2]) and got[(1, "q")] == float(kv.q_scale[1])
    with pytest.raises(ValueError, match="margin"):
        KvScales.from_amax(*amax, step=0, margin=0.5)


def test_metrics_hold_every_layers_scales_and_their_range():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.rand(5, generator=g) * 10 for _ in range(3))
    kv = KvScales.from_amax(q, k, v, step=1)
    m = kv.metrics()
    per_layer = {key: val for key, val in m.items() if key.startswith("kv_scales/layer_")}
    assert len(per_layer) == 15
    for i in range(5):
        for kind, t in (("q", kv.q_scale), ("k", kv.k_scale), ("v", kv.v_scale)):
            assert m[f"kv_scales/layer_{i}/{kind}_scale"] == float(t[i])  # exactly what the refit sends
    assert m["kv_scales/v_scale_max"] == max(m[f"kv_scales/layer_{i}/v_scale"] for i in range(5))
    assert m["kv_scales/k_scale_min"] == min(m[f"kv_scales/layer_{i}/k_scale"] for i in range(5))
    assert all(isinstance(val, float) for val in m.values())


def test_calibration_rows_spread_over_the_batch():
    assert calibration_rows(512, None).tolist() == list(range(512))
    assert calibration_rows(100, 256).tolist() == list(range(100))  # a cap above the batch: every row
    rows = calibration_rows(512, 256)
    assert rows.numel() == 256 and rows[0] == 0 and torch.all(rows[1:] > rows[:-1]) and rows[-1] < 512
    # 32 prompts x 16 samples, laid out group by group: a cap of 32 keeps one member of every group
    assert sorted(set((calibration_rows(512, 32) // 16).tolist())) == list(range(32))
    assert calibration_rows(10, 3).tolist() == [0, 3, 6]
    assert calibration_rows(0, 4).numel() == 0
    with pytest.raises(ValueError, match="max_samples >= 1"):
        calibration_rows(8, 0)

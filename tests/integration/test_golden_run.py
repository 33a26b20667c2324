"""Golden run: the tiny FP8 config's first GRPO steps, pinned (torchtune-style recipe regression test).

Same seed, the shipped tiny model, in-process torch backends, one torch thread, float64 (``golden.py`` says
why): the per-step reward, loss and mismatch must stay what they were when pinned, on any x86-64 CPU and
whichever kernels torch picks there. The test runs the steps three times: as this machine chooses, and in
subprocesses under ``ATEN_CPU_CAPABILITY=default`` (torch's kernels without SIMD) and ``MKL_CBWR=COMPATIBLE``
(MKL's portable branch), the variables that make one machine run another CPU type's kernels. A change of
backend, refit, loss or sampling that alters the numbers fails here and must be explained (then re-pin: run
this file with ``NEMO_FP8_PRINT_GOLDEN=1`` and paste the printed table).
"""

import json
import os
import subprocess
import sys

import pytest

from tests.integration.golden import KEYS, REPO, golden_values

# step -> values of KEYS (golden.KEYS: reward mean, response length mean, loss, grad norm, IS weight mean,
# gen_kl_error), pinned with torch 2.13.0 CPU, the tiny recipe's sampling temperature 0.7, dynamic sampling,
# prefilled "Answer: " (docs/first-run.md) and the float64 model's norms and RoPE in float64 (``compute_in_float64``:
# before it they ran in float32 and one of step 1's 128 rewards differed).
GOLDEN = {
    1: (0.2890625, 3.125, -0.00380285969004035, 12.06366471972887, 0.9996498078107834, 0.002344406908378005),
    2: (0.2890625, 3.265625, 0.005073000997072086, 4.637702611462917, 1.003286390848782, 0.0024423280265182257),
    3: (0.28125, 3.0078125, -0.00034186115954071283, 11.656683846564071, 1.0039728972418556, 0.005219567567110062),
}
# Reward and length are means of discrete values: a different sampled token changes them, so they match exactly.
# The rest differ between kernel variants only by float32 rounding in the log-probs and the loss's reductions:
# measured up to 1.5e-5 relative (the loss is a small sum of terms of either sign), so pinned at 2e-4.
EXACT = {"train/reward_mean", "train/response_length_mean"}
REL = 2e-4
# kernel variants run in subprocesses: name -> the environment variable that selects them
VARIANTS = {"aten-default": ("ATEN_CPU_CAPABILITY", "default"), "mkl-compatible": ("MKL_CBWR", "COMPATIBLE")}


def mismatches(got: dict[int, tuple[float, ...]]) -> list[str]:
    """Each value of ``got`` outside its pin, as ``step N key: got != pinned``."""
    out = []
    for step, want in GOLDEN.items():
        for key, g, w in zip(KEYS, got[step], want):
            ok = g == w if key in EXACT else g == pytest.approx(w, rel=REL, abs=1e-9)
            if not ok:
                out.append(f"step {step} {key}: {g!r} != pinned {w!r}")
    return out


@pytest.mark.slow
def test_tiny_fp8_golden_run_on_any_cpu_kernels(shipped_tiny_model, tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("ATEN_CPU_CAPABILITY", "MKL_CBWR")}
    procs = {}
    for name, (var, value) in VARIANTS.items():
        procs[name] = subprocess.Popen(
            [sys.executable, "-m", "tests.integration.golden", str(shipped_tiny_model), str(tmp_path / name)],
            cwd=REPO, env={**env, var: value}, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    got = {"native": golden_values(shipped_tiny_model, tmp_path / "native")}
    for name, proc in procs.items():
        out, err = proc.communicate(timeout=900)
        assert proc.returncode == 0, f"{name}: {err[-2000:]}"
        got[name] = {int(k): tuple(v) for k, v in json.loads(out.strip().splitlines()[-1]).items()}
    if os.environ.get("NEMO_FP8_PRINT_GOLDEN"):
        print("\n".join(f"    {s}: ({', '.join(repr(v) for v in vals)})," for s, vals in got["native"].items()))
    bad = {name: m for name, values in got.items() if (m := mismatches(values))}
    assert not bad, bad

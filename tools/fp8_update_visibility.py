#!/usr/bin/env python
"""How much of a training run's update a block-FP8 rollout engine sees, from two checkpoints.

    python tools/fp8_update_visibility.py --before models/small-qwen3 \
        --after results/compare/gpu/fp8+tis/step_100/policy/model            # the GPU parity runs' last step
    python tools/fp8_update_visibility.py --before models/tiny-qwen3-arith \
        --after results/grpo_math_tiny_fp8/step_40/policy/model              # the CPU tiny job (40 steps)

Both folders hold HF safetensors (a model folder, or a checkpoint's ``policy/model``). For each
linear weight the FP8 engine quantizes (2-D ``*_proj.weight``: q/k/v/o, gate/up/down), it compares
the update a bf16 engine sees (bf16(after) - bf16(before)) with the one a 128x128 block-FP8 engine
sees (Q(after) - Q(before), ``nemo_fp8.fp8.update_visibility``) and prints a table per projection
kind: the fractions of bf16 and FP8 values that moved, the relative error of the FP8 view of the
update, its cosine with the bf16 view, and its norm ratio. CPU only; no engine.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

from nemo_fp8.fp8.update_visibility import STAT_KEYS, update_visibility_sums, visibility_from_sums

LINEAR = re.compile(r"(?P<kind>[a-z_]+_proj)\.weight$")


def load_weights(folder: Path) -> dict:
    """Name -> tensor from every ``*.safetensors`` in ``folder`` (or its ``policy/model``).

    Raises:
        FileNotFoundError: no safetensors there.
    """
    from safetensors.torch import load_file

    for d in (folder, folder / "policy" / "model", folder / "model"):
        files = sorted(d.glob("*.safetensors"))
        if files:
            out = {}
            for f in files:
                out.update(load_file(str(f)))
            return out
    raise FileNotFoundError(f"{folder}: no *.safetensors (give a model folder or a checkpoint's policy/model)")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--before", type=Path, required=True, help="weights at the earlier refit (HF safetensors folder)")
    p.add_argument("--after", type=Path, required=True, help="weights at the later refit")
    p.add_argument("--pow2", action="store_true", help="power-of-two block scales (DeepGEMM E8M0) instead of fp32")
    p.add_argument("--block", type=int, default=128, help="weight block size (square), default 128")
    args = p.parse_args(argv)
    try:
        w0, w1 = load_weights(args.before), load_weights(args.after)
    except FileNotFoundError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    names = [n for n in sorted(w0) if LINEAR.search(n) and w0[n].dim() == 2]
    missing = [n for n in names if n not in w1 or w1[n].shape != w0[n].shape]
    if not names or missing:
        print(f"error: {len(names)} linear *_proj.weight tensors in --before; missing or reshaped in --after: "
              f"{missing[:5]}", file=sys.stderr)
        return 2
    sums: dict[str, dict[str, float]] = {}
    for n in names:
        s = update_visibility_sums(w0[n], w1[n], (args.block, args.block), scale_mode="pow2" if args.pow2 else "fp32",
                                   name=n)
        for kind in (LINEAR.search(n)["kind"], "all"):
            acc = sums.setdefault(kind, dict.fromkeys(STAT_KEYS, 0.0))
            for k in STAT_KEYS:
                acc[k] += s[k]
    print(f"{args.before} -> {args.after}: {len(names)} linear weights, {args.block}x{args.block} blocks, "
          f"{'pow2' if args.pow2 else 'fp32'} scales")
    print("| weights | elements | bf16 values moved | FP8 values moved | FP8 update error | cosine | norm ratio |")
    print("|---|---|---|---|---|---|---|")
    for kind in sorted(sums, key=lambda k: (k == "all", k)):
        r = visibility_from_sums(sums[kind])
        print(f"| {kind} | {int(sums[kind]['elements']):,} | {r['bf16_changed_frac']:.4f} | {r['fp8_changed_frac']:.4f} "
              f"| {r['rel_error']:.3f} | {r['cosine']:.3f} | {r['norm_ratio']:.3f} |")
    print("FP8 update error: ||Q(after) - Q(before) - (after - before)|| / ||after - before|| with both in bf16 "
          "(0: the FP8 engine sees the bf16 update exactly; 1: an error as large as the update).")
    return 0


if __name__ == "__main__":
    sys.exit(main())

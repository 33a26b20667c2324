#!/usr/bin/env python
"""The refit alone, many times over: the run's own workers and refit, no training between (issue 70's bench).

    python tools/bench_refit.py --config examples/configs/grpo_math_8B_megatron_fp8_1gpu.yaml --refits 20 \\
        --out logs/bench_refit/fp8 policy.model_name=models/qwen3-8b-random
    python tools/check_metrics.py logs/bench_refit/fp8 'mean(timing/refit_total[1:]) <= 0.5' \\
        'last(memory/device_used_gib) - first(memory/device_used_gib) <= 1.0'

Starts what ``examples/run_grpo_math.py`` starts for the config (the preflight, Ray, the policy's ranks, the engines,
the weight sync: ``nemo_fp8.trainer.start_workers``), then repeats what each GRPO step does around a rollout: the
policy moves to the next version (``RefitController.mark_stale``, with FP8 KV the scales measured once and carried
to each version), the refit runs, the engine wakes and goes back to sleep (``RefitController.generating``: a rollout
of nothing). Each refit is one row of ``<out>/metrics.jsonl`` (``step`` = the refit's number): the step's timers
(``timing/refit``, its parts ``timing/refit/*``, the releases ``timing/release_{before,after}/*``,
``timing/engine_wake``, ``timing/engine_sleep``; ``timing/refit_total``: refit + wake + sleep, what issue 70 bounds),
the refit's bytes (``refit/gbytes``, ``refit/num_buckets``, ...), what the trainer holds beside the awake engine
(``memory/beside_engine_*``, colocated with its state kept) and the policy rank's device-wide reading after the sleep
(``memory/device_used_gib``: every process on its GPU, the engine's sleeping remains included). Prints one line per
refit and a summary over the refits after the first (warm-up: first-use allocations, the engine's first reload).

No training runs between refits: the release before the transfer has no activation peak to return, so the mission's
``release_before`` parts are what this leaves out; the weights' values do not change the transfer's work.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
from pathlib import Path

from mission_report import HBM_COPY_GBPS  # the refit's floor: the H200's device-to-device copy bandwidth, GB/s

REPO = Path(__file__).resolve().parents[1]
DEFAULT_CONFIG = REPO / "examples" / "configs" / "grpo_math_8B_megatron_fp8_1gpu.yaml"


def refit_rows(workers, refits: int, kv_scales=None) -> list[dict]:
    """``refits`` refits of versions 0, 1, ... through ``workers.refitter`` (a ``nemo_fp8.trainer.Workers``).

    Args:
        workers: the run's workers; their refitter starts stale at version 0 (``start_workers``).
        refits: how many, >= 1.
        kv_scales: a ``KvScales`` for the engine's FP8 KV cache (required when the refitter requires them),
            relabelled to each version (the transfer carries them the same).

    Returns:
        list[dict]: one row per refit: ``step`` (1-based), the timers (seconds), ``timing/refit_total``, the refit's
        metrics and the policy's ``memory/device_used_gib`` (``cuda_memory_gib``, on GPU only).

    Raises:
        ValueError: ``refits`` < 1, or FP8 KV without ``kv_scales``.
    """
    from nemo_fp8.utils.timer import Timer

    if refits < 1:
        raise ValueError(f"--refits must be >= 1, got {refits}")
    refitter = workers.refitter
    if refitter.requires_kv_scales and kv_scales is None:
        raise ValueError("the engine runs an FP8 KV cache: pass kv_scales (policy.calibrate_kv_scales)")
    rows = []
    for i in range(refits):
        scales = dataclasses.replace(kv_scales, step=i) if kv_scales is not None else None
        refitter.mark_stale(i, scales)
        timer = Timer()
        metrics = refitter.refit_if_stale(timer)  # what generating() runs first; here for its metrics
        with refitter.generating(timer):  # the wake and the sleep (nothing stale left to refit)
            pass
        row = {"step": i + 1, **{f"timing/{k}": v for k, v in timer.pop().items()}, **metrics}
        row["timing/refit_total"] = sum(row.get(f"timing/{k}", 0.0) for k in ("refit", "engine_wake", "engine_sleep"))
        used = (workers.policy.cuda_memory_gib() or {}).get("device_used_gib")
        if used is not None:
            row["memory/device_used_gib"] = used
        rows.append(row)
    return rows


def summary(rows: list[dict], hbm_gbps: float = HBM_COPY_GBPS) -> str:
    """Lines: the mean of each timer over the refits after the first (all of them if there is one), the bytes sent,
    the transfer's GB/s and its ratio to the HBM floor (2 x GB / ``hbm_gbps``: read once, write once), and the
    device memory's growth from the first refit to the last."""
    timed = rows[1:] or rows
    keys = sorted({k for r in timed for k in r if k.startswith("timing/")})
    lines = [f"over refits {timed[0]['step']}-{timed[-1]['step']} (mean s):"]
    lines += [f"  {k[len('timing/'):]:<32} {statistics.fmean(r.get(k, 0.0) for r in timed):8.3f}" for k in keys]
    gb = statistics.fmean(r.get("refit/gbytes", 0.0) for r in timed)
    transfer = statistics.fmean(r.get("timing/refit/transfer", 0.0) for r in timed)
    if gb and transfer:
        floor_s = 2 * gb / hbm_gbps
        lines.append(f"  sent {gb:.2f} GB a refit: {gb / transfer:.1f} GB/s, {transfer / floor_s:.0f}x the floor "
                     f"({floor_s * 1e3:.1f} ms at {hbm_gbps:,.0f} GB/s)")
    used = [r["memory/device_used_gib"] for r in rows if "memory/device_used_gib" in r]
    if len(used) > 1:
        lines.append(f"  device memory after refit {rows[0]['step']}: {used[0]:.2f} GiB, after refit "
                     f"{rows[-1]['step']}: {used[-1]:.2f} GiB ({used[-1] - used[0]:+.2f})")
    return "\n".join(lines)


def row_line(row: dict) -> str:
    """One refit's line: its total, its parts and its memory."""
    parts = ", ".join(f"{k[len('timing/'):]} {v:.3f}" for k, v in row.items()
                      if k.startswith("timing/") and k != "timing/refit_total")
    used = f"; device {row['memory/device_used_gib']:.2f} GiB" if "memory/device_used_gib" in row else ""
    return f"refit {row['step']}: {row['timing/refit_total']:.3f} s ({parts}){used}"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default=str(DEFAULT_CONFIG), help="the run's YAML (default: %(default)s)")
    ap.add_argument("--refits", type=int, default=20, help="refits to run, >= 1 (default 20)")
    ap.add_argument("--out", default="logs/bench_refit", help="folder for metrics.jsonl (default %(default)s)")
    ap.add_argument("overrides", nargs="*", help="key=value overrides of the config, as run_grpo_math.py takes")
    args = ap.parse_args(argv)
    if args.refits < 1:
        ap.error(f"--refits must be >= 1, got {args.refits}")

    from nemo_fp8.algorithms.grpo import prompts_batch
    from nemo_fp8.config import ConfigError, load_config
    from nemo_fp8.distributed.cluster import init_ray
    from nemo_fp8.models.hf import load_tokenizer
    from nemo_fp8.preflight import check_cluster, preflight, with_local_model
    from nemo_fp8.trainer import ensure_model, prepare_prompts, start_workers
    from nemo_fp8.utils.run_dir import RunSetupError

    try:
        cfg = load_config(args.config, args.overrides)
        preflight(cfg)
    except (ConfigError, RunSetupError, FileNotFoundError) as e:
        print(f"bench_refit: {e}", file=sys.stderr)
        return 2
    cfg = with_local_model(cfg)
    ensure_model(cfg)
    tokenizer = load_tokenizer(cfg.policy.tokenizer.name or cfg.policy.model_name)
    init_ray(cfg.cluster.address, cfg.cluster.num_cpus)
    check_cluster(cfg)
    workers = start_workers(cfg, tokenizer)
    try:
        kv_scales = None
        if workers.refitter.requires_kv_scales:  # scales of the starting weights from the first prompts, as a run
            train, _ = prepare_prompts(cfg, tokenizer)
            kv_scales = workers.policy.calibrate_kv_scales(
                prompts_batch(train[: cfg.grpo.num_prompts_per_step], tokenizer.pad_token_id), 0,
                cfg.policy.generation.vllm_cfg.kv_scale_margin)
        rows = refit_rows(workers, args.refits, kv_scales)
    finally:
        workers.shutdown()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    for r in rows:
        print(row_line(r))
    print(summary(rows))
    print(f"rows: {out / 'metrics.jsonl'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python
"""Peak extra memory and time of one refit, bucketed vs the whole model as one object, side by side.

    python tools/measure_refit_memory.py                       # the tiny model + a 100M-parameter Qwen3
    python tools/measure_refit_memory.py --params 100 --bucket-mb 64 --precision fp8

Starts the run's real worker groups on CPU (Ray actors, torch backends), refits the engine through
the object store twice per mode (the first warms up), and samples both processes' private
(``RssAnon``) and shared (``RssShmem``: Ray's object store) memory every 0.5 ms during the second.
"One object" is the old refit (the whole state dict as one Ray object); "buckets" is
``ObjectStoreWeightSync`` with ``policy.weight_sync.bucket_size_mb``. Prints one table.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path


MiB = 2**20
REPO = Path(__file__).resolve().parents[1]


def build_random_qwen3(path: Path, params_m: int, tokenizer_dir: Path) -> Path:
    """A Qwen3 with about ``params_m`` million parameters and random weights, saved as HF safetensors."""
    import torch
    from transformers import AutoTokenizer, Qwen3Config, Qwen3ForCausalLM

    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    hidden, inter = 768, 3072
    per_layer = 4 * hidden * hidden + 3 * hidden * inter  # attention + MLP (GQA ignored: an estimate)
    layers = max(1, round(params_m * 1e6 / per_layer))
    torch.manual_seed(0)
    config = Qwen3Config(vocab_size=len(tok), hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                         num_attention_heads=12, num_key_value_heads=4, head_dim=64, max_position_embeddings=128,
                         tie_word_embeddings=False, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
    Qwen3ForCausalLM(config).save_pretrained(path)
    tok.save_pretrained(path)
    return path


def measure(model: Path, bucket_mb: float, precision: str) -> list[dict]:
    import ray

    from nemo_fp8.config import load_config
    from nemo_fp8.distributed.weight_sync import ObjectStoreWeightSync
    from nemo_fp8.models.hf import load_tokenizer
    from nemo_fp8.trainer import start_workers

    cfg = load_config(REPO / "examples" / "configs" / "grpo_math_tiny_fp8.yaml", [
        f"policy.model_name={model}", "policy.tiny_model.build_if_missing=false",
        f"policy.generation.vllm_cfg.precision={precision}", f"policy.weight_sync.bucket_size_mb={bucket_mb}",
        "cluster.num_cpus=4"])
    workers = start_workers(cfg, load_tokenizer(str(model)))
    rows = []
    try:
        bucketed = workers.refitter.weight_sync
        whole = ObjectStoreWeightSync(bucketed.policy_worker, bucketed.generation_worker, bucket_bytes=2**50)
        actors = {"engine": bucketed.generation_worker, "policy": bucketed.policy_worker}
        # Buckets first: shared pages of the object store stay mapped once touched, so whichever mode
        # runs second would find them resident already.
        for name, sync in ((f"{bucket_mb:g} MiB buckets", bucketed), ("one object (old)", whole)):
            sync.sync(version=1)  # warm-up
            ray.get([a.watch_memory.remote(True) for a in actors.values()])
            t0 = time.perf_counter()
            stats = sync.sync(version=2)
            seconds = time.perf_counter() - t0
            peaks = dict(zip(actors, ray.get([a.watch_memory.remote(False) for a in actors.values()])))
            rows.append({"mode": name, "buckets": stats.num_buckets, "payload_mib": stats.bytes / MiB,
                         "seconds": seconds, **{f"{a}_{k}": v / MiB for a, p in peaks.items() for k, v in p.items()}})
    finally:
        workers.shutdown()
        ray.shutdown()
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--params", type=int, default=100, help="size of the random model, millions (default 100)")
    ap.add_argument("--bucket-mb", type=float, default=16.0)
    ap.add_argument("--precision", choices=["bfloat16", "fp8"], default="fp8")
    ap.add_argument("--tiny", default="models/tiny-qwen3-arith", help="the tiny model (built by tools/make_tiny_model.py)")
    args = ap.parse_args()
    tiny = Path(args.tiny)
    if not (tiny / "config.json").is_file():
        print(f"no tiny model at {tiny}: run tools/make_tiny_model.py --out {tiny} first", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory() as tmp:
        models = {"tiny": tiny, f"{args.params}M": build_random_qwen3(Path(tmp) / "big", args.params, tiny)}
        print(f"{'model':>6} {'mode':>18} {'buckets':>7} {'MiB sent':>8} {'s':>6} {'engine priv':>11} "
              f"{'engine shm':>10} {'policy priv':>11} {'policy shm':>10}   (peak extra MiB)")
        for label, path in models.items():
            for r in measure(path, args.bucket_mb, args.precision):
                print(f"{label:>6} {r['mode']:>18} {r['buckets']:>7d} {r['payload_mib']:>8.0f} {r['seconds']:>6.2f} "
                      f"{r['engine_anon_extra']:>11.1f} {r['engine_shmem_extra']:>10.1f} "
                      f"{r['policy_anon_extra']:>11.1f} {r['policy_shmem_extra']:>10.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

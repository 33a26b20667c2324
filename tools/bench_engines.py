"""Data-parallel rollout benchmark: one step's rollout tokens/s with 1, 2, 4, ... engines (``GenerationGroup``).

The engines run as the trainer runs them (``nemo_fp8.distributed``: one Ray actor per engine, each in a
``STRICT_PACK`` bundle of ``--tp`` GPUs, the step's prompts spread by expected tokens, the samples of a prompt
on one engine), on GPUs of their own (no policy). Each engine count starts fresh engines, warms them up with
a short rollout, then times one rollout of ``--prompts`` x ``--samples`` responses of up to ``--output-len``
tokens (a generation-bound step: NeMo-RL's 8B recipe rolls out 512 x 1,024). Generated tokens are counted
from the responses (EOS ends some early).

    python tools/bench_engines.py --engines 1,2,4 [--model DIR | --shape small|8b] [--layers N] [--tp 1]
        [--precision fp8] [--prompts 32] [--samples 16] [--input-len 128] [--output-len 1024]
        [--gpu-mem 0.85] [--shares 2,4] [--out rows.json]

Without ``--model`` a random-weight Qwen3 is written (``--shape small``: hidden 1024, 16 layers, ~270M
parameters; ``8b``: Qwen3-8B's shape, ``--layers`` of its 36). ``--backend torch`` runs the torch reference
engines on the CPU (orchestration check; its speed means nothing).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

SHAPES = {
    "small": dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=16, num_attention_heads=8,
                  num_key_value_heads=4, head_dim=128, vocab_size=32768),
    "8b": dict(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
               num_key_value_heads=8, head_dim=128, vocab_size=151936),
}


def write_model(shape: str, root: Path, layers: int = 0) -> Path:
    """A random-weight bf16 Qwen3 checkpoint of ``SHAPES[shape]`` (``layers`` > 0: that many decoder layers)."""
    import torch
    from transformers import AutoModelForCausalLM, Qwen3Config

    dims = dict(SHAPES[shape], **({"num_hidden_layers": layers} if layers else {}))
    cfg = Qwen3Config(max_position_embeddings=8192, tie_word_embeddings=False, bos_token_id=0, eos_token_id=1,
                      pad_token_id=0, **dims)
    torch.manual_seed(0)
    path = root / f"qwen3_{shape}_{dims['num_hidden_layers']}l"
    AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).save_pretrained(str(path))
    return path


def engines_only_plan(num_engines: int, tp: int, use_gpu: bool):
    """A ``ClusterPlan`` of ``num_engines`` engines of ``tp`` GPUs each in bundles of their own, no policy."""
    from nemo_fp8.distributed.placement import ClusterPlan

    res = {"CPU": 1.0, "GPU": float(tp)} if use_gpu else {"CPU": 1.0}
    return ClusterPlan([dict(res) for _ in range(num_engines)], [], [(i, dict(res)) for i in range(num_engines)],
                       engine_gpus=tp if use_gpu else 0, strategy="STRICT_PACK" if use_gpu else "PACK")


def step_prompts(num_prompts: int, samples: int, input_len: int, vocab: int, seed: int = 0) -> list[list[int]]:
    """``num_prompts`` random prompts of ``input_len`` token ids in [2, vocab), each repeated ``samples`` times."""
    import torch

    g = torch.Generator().manual_seed(seed)
    distinct = [torch.randint(2, vocab, (input_len,), generator=g).tolist() for _ in range(num_prompts)]
    return [p for p in distinct for _ in range(samples)]


def bench(a, model: Path, num_engines: int, shares: tuple[int, ...] = ()) -> dict:
    """One engine count: start, warm up, time one rollout, shut down; the row.

    ``shares`` (one engine): also time the engine on ``1/n`` of the step's prompts for each ``n``, the load each
    of ``n`` engines gets: ``share_tokens_per_s[n]``. ``n`` times that is what ``n`` engines reach if each runs
    as fast as one engine on its share (the engine's own ceiling at that batch, measured in the same run)."""
    import torch

    from nemo_fp8.generation.group import GenerationGroup
    from nemo_fp8.distributed.placement import create_placement_group
    from nemo_fp8.generation import GenerationSpec, SamplingParams
    from nemo_fp8.generation.config import VllmConfig

    use_gpu = a.backend == "vllm"
    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    spec = GenerationSpec(backend=a.backend, model_name=str(model),
                          vllm_cfg=VllmConfig(precision=a.precision, tensor_parallel_size=a.tp,
                                              gpu_memory_utilization=a.gpu_mem),
                          device=None if use_gpu else torch.device("cpu"), pad_token_id=0, eos_token_id=1,
                          max_total_sequence_length=a.input_len + a.output_len, batch_size=a.batch_size,
                          offload_when_idle=False, weight_transfer="ipc" if use_gpu else None)
    plan = engines_only_plan(num_engines, a.tp, use_gpu)
    placement = create_placement_group(plan, timeout_s=120)
    try:
        t0 = time.perf_counter()
        group = GenerationGroup.start(placement, plan, spec, torch_threads=a.torch_threads)
        start_s = time.perf_counter() - t0
        try:
            group.generate(step_prompts(num_engines, 2, a.input_len, vocab, seed=1), SamplingParams(16, seed=1))
            group.pop_engine_metrics()
            prompts = step_prompts(a.prompts, a.samples, a.input_len, vocab)
            t0 = time.perf_counter()
            out = group.generate(prompts, SamplingParams(max_new_tokens=a.output_len, temperature=1.0, seed=7))
            seconds = time.perf_counter() - t0
            m = group.pop_engine_metrics()
            share_tps = {}
            for n in shares:  # the first prompts / n prompts: the same requests, a smaller batch
                part = prompts[:len(prompts) // n]
                t1 = time.perf_counter()
                o = group.generate(part, SamplingParams(max_new_tokens=a.output_len, temperature=1.0, seed=7))
                share_tps[n] = round(int(o.response_lengths.sum()) / (time.perf_counter() - t1), 1)
            group.pop_engine_metrics()
        finally:
            group.shutdown()
    finally:
        placement.remove()
    tokens = int(out.response_lengths.sum())
    return {"engines": num_engines, "tp": a.tp, "precision": a.precision, "responses": len(prompts),
            "tokens": tokens, "seconds": round(seconds, 3), "tokens_per_s": round(tokens / seconds, 1),
            "engine_start_s": round(start_s, 1),
            "engine_tokens": [int(m[f"generation/engine_{e}/tokens"]) for e in range(num_engines)],
            "engine_seconds": [round(m[f"generation/engine_{e}/seconds"], 3) for e in range(num_engines)],
            "imbalance": round(m.get("generation/engine_imbalance", 1.0), 3),
            **({"share_tokens_per_s": share_tps} if share_tps else {})}


def table(rows: list[dict]) -> str:
    """The result table; ``x1`` is each row's tokens/s over the one-engine row's (or the first row's).

    ``ceiling``: n engines' tokens/s if each ran as fast as the one engine did on its share of the step
    (``n x share_tokens_per_s[n]`` over the one-engine row's, same run); ``of ceiling``: x1 / ceiling."""
    one = next((r for r in rows if r["engines"] == 1), rows[0])
    base, shares = one["tokens_per_s"], one.get("share_tokens_per_s", {})
    lines = ["engines  tp  responses   tokens  seconds  tokens/s     x1  imbalance  ceiling  of ceiling"]
    for r in rows:
        share = shares.get(r["engines"]) or shares.get(str(r["engines"]))  # JSON keys are strings
        ceiling = r["engines"] * share / base if share else None
        lines.append(f"{r['engines']:>7} {r['tp']:>3} {r['responses']:>10} {r['tokens']:>8} {r['seconds']:>8.2f} "
                     f"{r['tokens_per_s']:>9.0f} {r['tokens_per_s'] / base:>6.2f} {r['imbalance']:>10.2f} "
                     + (f"{ceiling:>8.2f} {r['tokens_per_s'] / base / ceiling:>11.2f}" if ceiling else
                        f"{'-':>8} {'-':>11}"))
    return "\n".join(lines)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engines", default="1,2,4", help="comma list of engine counts (%(default)s)")
    ap.add_argument("--backend", default="vllm", choices=("vllm", "torch"))
    ap.add_argument("--model", default=None, help="HF checkpoint folder (default: a random Qwen3 of --shape)")
    ap.add_argument("--shape", default="small", choices=sorted(SHAPES))
    ap.add_argument("--layers", type=int, default=0, help="decoder layers of the random model (0: the shape's)")
    ap.add_argument("--tp", type=int, default=1, help="GPUs per engine (vLLM tensor_parallel_size)")
    ap.add_argument("--precision", default="fp8", choices=("fp8", "bfloat16"))
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--samples", type=int, default=16)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=1024)
    ap.add_argument("--batch-size", type=int, default=64, help="torch engine rows per forward pass")
    ap.add_argument("--gpu-mem", type=float, default=0.85, help="gpu_memory_utilization of every engine")
    ap.add_argument("--torch-threads", type=int, default=None)
    ap.add_argument("--shares", default=None,
                    help="engine counts whose share of the step the one-engine row also times, comma list "
                         "(default: the counts above 1 of --engines; lets --engines 1 alone give the ceiling column)")
    ap.add_argument("--out", default=None, help="write the rows as JSON here")
    return ap.parse_args(argv)


def main(argv=None) -> list[dict]:
    """Run every engine count of ``--engines``; prints each row as JSON, then the table; returns the rows."""
    import ray

    from nemo_fp8.distributed.cluster import init_ray

    a = parse_args(argv)
    model = Path(a.model) if a.model else write_model(a.shape, Path(tempfile.mkdtemp(prefix="bench_engines_")),
                                                      a.layers)
    init_ray(None, None)
    rows = []
    try:
        counts = [int(x) for x in a.engines.split(",")]
        shares = tuple(int(x) for x in a.shares.split(",")) if a.shares else tuple(c for c in counts if c > 1)
        for i, n in enumerate(counts):
            if i and a.backend == "vllm":
                time.sleep(10)  # the previous engines' processes end: their GPU memory returns before vLLM measures
            rows.append(bench(a, model, n, shares if n == 1 else ()))
            print(json.dumps(rows[-1]), flush=True)
            if a.out:
                Path(a.out).write_text(json.dumps(rows, indent=1))
    finally:
        ray.shutdown()
    print(table(rows))
    return rows


if __name__ == "__main__":
    main()

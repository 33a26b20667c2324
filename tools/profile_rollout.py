"""Where a rollout's time goes, BF16 vs FP8, side by side: GPU kernel time per decode step by category.

Answers "where does the dense shape's distance to the seeds' +18% go" (issue 7) with a profile
rather than a guess. Each precision runs in its own subprocess (clean GPU memory) on the same
dummy-weight model as ``tools/bench_rollout.py`` (same precisions, same engine settings), with
vLLM's engine in-process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) so that ``torch.profiler`` (CUPTI)
sees every kernel, CUDA-graph replays included. One decode-heavy batch is profiled after a
warm-up; kernel time is summed by category and divided by the number of decode steps
(``--output-len``):

    gemm       dense GEMMs (cuBLAS/nvjet, CUTLASS, DeepGEMM): the part FP8 halves the bytes of
    moe        fused-MoE expert kernels
    attention  attention and the KV-cache writes (FlashAttention, reshape_and_cache)
    quant      activation quantization (per-token-group FP8), incl. norm+quant fusions
    sampler    logits processing and sampling (softmax, top-k/p, argmax, gumbel, sort)
    norm_act   RMSNorm, RoPE, SiLU-and-mul (unfused)
    other      copies, fills, elementwise, everything else

plus ``host``: wall time per step not covered by GPU kernels (scheduling, input preparation,
launch gaps: the part FP8 cannot speed up). The ratios column is FP8 / BF16 per category.

    python tools/profile_rollout.py [--model dense|moe] [--precisions bf16,fp8-deepgemm]
        [--num-layers N] [--batch 256] [--input-len 256] [--output-len 256] [--gpu-mem 0.9]
        [--eager] [--timeout 600] [--out rows.json]

DeepGEMM precisions compile their kernels on first use: warm the cache first (the 1-layer engine at the
start of ``tests/test_suites/llm/bench-rollout-dense.sh``). ``--eager`` turns CUDA graphs off (use it if the profile shows almost no kernel time,
i.e. graph replays were not traced; launch overhead then inflates ``host``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

from bench_rollout import PRECISIONS, SHAPES, child_result, engine_config, engine_spec, write_config

CATEGORIES = ("gemm", "moe", "attention", "quant", "sampler", "norm_act", "other")
# (category, substrings of the lower-cased kernel name), first match wins: MoE and attention before the
# GEMM patterns (their kernels are GEMMs too), quantization before norms (vLLM fuses rms_norm + FP8 quant).
_RULES = (
    ("moe", ("fused_moe", "moe_", "_moe", "expert", "grouped_gemm", "m_grouped", "permute")),
    ("attention", ("flash", "fmha", "attn", "attention", "reshape_and_cache", "paged", "sdpa")),
    # TransformerEngine's (training, tools/bench_train.py --profile): cast(+transpose), amax and scale kernels
    ("quant", ("quant", "fp8_cast", "ue8m0", "e8m0", "scaled_fp8", "cast_transpose", "amax", "cast_fp8",
               "compute_scale")),
    ("gemm", ("gemm", "cutlass", "nvjet", "xmma", "cublas", "matmul", "wgmma", "sm90_", "deep_gemm", "mma_")),
    ("sampler", ("sampl", "topk", "top_k", "top_p", "softmax", "argmax", "gumbel", "exponential", "multinomial",
                 "sort", "cumsum", "logprob", "penalt")),
    ("norm_act", ("rms", "norm", "rsqrt", "rotary", "rope", "silu", "act_and_mul", "gelu", "swiglu")),
)


def categorize(kernel_name: str) -> str:
    """The category (one of ``CATEGORIES``) of a CUDA kernel, from its name (rules in ``_RULES``).

    Inductor names a kernel after the ops it fused, so its group quantizer fused into SiLU / RMSNorm
    (``custom_ops: ["-quant_fp8"]``) carries the name of the GEMM op it feeds (``..._clamp_..._fp8_gemm_nt_op_...``):
    an Inductor kernel (``triton_``) with the FP8 cast's ``clamp`` is quantization, checked before the GEMM patterns.
    """
    n = kernel_name.lower()
    for cat, keys in _RULES:
        if cat == "gemm" and n.startswith("triton_") and "clamp" in n:
            return "quant"
        if any(k in n for k in keys):
            return cat
    return "other"


def summarize(kernels: list[tuple[str, float]], wall_s: float, steps: int) -> dict:
    """Per-step milliseconds by category from ``(kernel name, total device microseconds)`` pairs.

    Args:
        kernels: every kernel's summed device time over the profiled run, in microseconds.
        wall_s: the profiled run's wall time, seconds.
        steps: decode steps in it (> 0).

    Returns:
        ``{category: ms per step}`` for every ``CATEGORIES`` entry, plus ``gpu`` (their sum), ``wall``
        and ``host`` (wall - gpu, at least 0: time no kernel ran; kernels of different streams that
        overlap make ``gpu`` an upper bound of busy time), and ``top``: the 8 longest kernels
        ``[name, category, ms per step]``.

    Raises:
        ValueError: ``steps`` < 1.
    """
    if steps < 1:
        raise ValueError(f"summarize: steps must be >= 1, got {steps}")
    out = {c: 0.0 for c in CATEGORIES}
    for name, us in kernels:
        out[categorize(name)] += us / 1e3 / steps
    out["gpu"] = sum(out[c] for c in CATEGORIES)
    out["wall"] = wall_s * 1e3 / steps
    out["host"] = max(out["wall"] - out["gpu"], 0.0)
    top = sorted(kernels, key=lambda k: -k[1])[:8]
    out["top"] = [[name[:90], categorize(name), us / 1e3 / steps] for name, us in top]
    return out


def format_table(rows: list[dict], baseline: str = "bf16") -> str:
    """Side-by-side table: ms per decode step of each category for each precision, and the ratio of
    every other precision to ``baseline`` (``x bf16``) where the baseline ran."""
    ok = [r for r in rows if "profile" in r]
    base = next((r["profile"] for r in ok if r["precision"] == baseline), None)
    keys = list(CATEGORIES) + ["gpu", "host", "wall"]
    head = f"{'ms / decode step':<18}" + "".join(f" {r['precision']:>{max(16, len(r['precision']))}}" for r in ok)
    others = [r for r in ok if r["precision"] != baseline] if base else []
    head += "".join(f"{r['precision'] + ' x ' + baseline:>26}" for r in others)
    lines = [head]
    for k in keys:
        line = f"{k:<18}" + "".join(f" {r['profile'][k]:{max(16, len(r['precision']))}.3f}" for r in ok)
        for r in others:
            line += f"{(r['profile'][k] / base[k] if base[k] > 0 else float('nan')):26.3f}"
        lines.append(line)
    for r in rows:
        if "error" in r:
            lines.append(f"{r['precision']}: {r['error'][-400:]}")
    return "\n".join(lines)


def profile_engine(a) -> dict:
    """Child: one in-process engine, a warm-up, one profiled batch; returns its row."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine in this process: CUPTI sees its kernels
    import torch
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    cfg = engine_config(a.precision, a.gpu_mem, a.input_len + a.output_len + 16)
    extra = {"max_num_seqs": max(a.batch, 8)}
    if a.eager:
        extra["enforce_eager"] = True
    spec = engine_spec(a.precision, cfg, a.model_dir, extra)
    from vllm import LLM, SamplingParams

    llm = LLM(**spec.engine_kwargs)
    g = torch.Generator().manual_seed(0)
    prompts = [{"prompt_token_ids": torch.randint(100, 100000, (a.input_len,), generator=g).tolist()}
               for _ in range(a.batch)]
    sp = SamplingParams(max_tokens=a.output_len, ignore_eos=True, temperature=1.0, detokenize=False)
    llm.generate(prompts[:8], SamplingParams(max_tokens=32, ignore_eos=True, detokenize=False), use_tqdm=False)
    llm.generate(prompts, sp, use_tqdm=False)  # warm-up at the profiled batch size
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        outs = llm.generate(prompts, sp, use_tqdm=False)
        torch.cuda.synchronize()
        wall = time.perf_counter() - t0
    kernels = [(e.key, float(e.self_device_time_total)) for e in prof.key_averages()
               if e.device_type == DeviceType.CUDA and e.self_device_time_total > 0]
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    prof_row = summarize(kernels, wall, a.output_len)
    return {"precision": a.precision, "tok_s": tokens / wall, "profile": prof_row,
            "kernels_traced": len(kernels), "eager": a.eager}


def run_child(a, model: Path, prec: str) -> dict:
    cmd = [sys.executable, __file__, "--child", "--model", a.model, "--model-dir", str(model), "--precisions", prec]
    for k in ("batch", "input_len", "output_len", "gpu_mem"):
        cmd += [f"--{k.replace('_', '-')}", str(getattr(a, k))]
    if a.eager:
        cmd.append("--eager")
    return {"precision": prec, **child_result(cmd, prec, a.timeout)}


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="dense", choices=list(SHAPES))
    ap.add_argument("--precisions", default="bf16,fp8-cutlass", help=f"comma list of {', '.join(PRECISIONS)}")
    ap.add_argument("--num-layers", type=int, default=0, help="decoder layers (0: the full depth)")
    ap.add_argument("--batch", type=int, default=256, help="sequences decoded together")
    ap.add_argument("--input-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=256, help="decode steps profiled")
    ap.add_argument("--gpu-mem", type=float, default=0.9)
    ap.add_argument("--eager", action="store_true", help="no CUDA graphs")
    ap.add_argument("--timeout", type=int, default=600, help="seconds per engine subprocess")
    ap.add_argument("--out", default=None)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--model-dir", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    unknown = [p for p in a.precisions.split(",") if p not in PRECISIONS]
    if unknown:
        ap.error(f"--precisions: unknown {unknown}; valid: {list(PRECISIONS)}")
    for k in ("batch", "input_len", "output_len"):
        if getattr(a, k) < 1:
            ap.error(f"--{k.replace('_', '-')} must be >= 1, got {getattr(a, k)}")
    return a


def main(argv=None):
    a = parse_args(argv)
    if a.child:
        a.precision = a.precisions
        print("RESULT " + json.dumps(profile_engine(a)), flush=True)
        return
    model = write_config(a.model, Path(tempfile.mkdtemp(prefix="profile_rollout_")), a.num_layers)
    rows = []
    for prec in a.precisions.split(","):
        r = run_child(a, model, prec)
        rows.append(r)
        print(json.dumps(r), flush=True)
        if a.out:
            Path(a.out).write_text(json.dumps(rows, indent=1))
    print(f"\n{a.model} shape ({SHAPES[a.model]}), {a.num_layers or 'all'} layers, dummy weights; batch {a.batch} x "
          f"({a.input_len} in, {a.output_len} out), one profiled run per precision, CUDA graphs "
          f"{'off' if a.eager else 'on'}; ms per decode step (prefill included, spread over the steps)")
    print(format_table(rows))
    for r in rows:
        if "profile" in r:
            print(f"{r['precision']}: {r['tok_s']:.0f} tok/s, {r['kernels_traced']} kernels traced; longest: " +
                  "; ".join(f"{n} [{c}] {ms:.3f}" for n, c, ms in r["profile"]["top"][:5]))


if __name__ == "__main__":
    main()

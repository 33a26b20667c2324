"""Rollout benchmark: BF16 vs FP8 W8A8 (DeepGEMM or CUTLASS) vs FP8 W8A8 + FP8 KV cache in vLLM.

One run prints one table, with every ratio measured side by side in that run. Each engine runs in
its own subprocess (clean GPU memory) on a dummy-weight model built from a Qwen3-8B- ("dense")
or Qwen3-30B-A3B-shaped ("moe") config. Every engine of a run gets the same
``gpu_memory_utilization``, ``max_num_seqs`` and ``max_model_len`` (read back from each engine
and checked: the table says "like-for-like" or names the difference), so FP8's smaller weights
and FP8 KV's smaller cache entries show up as KV capacity and throughput, nothing else.

    python tools/bench_rollout.py [--models dense,moe] [--precisions bf16,fp8-cutlass,fp8-kv,...]
        [--num-layers N|dense=N,moe=M] [--num-prompts 512] [--input-len 256] [--output-len 2048]
        [--rl-prompts 32] [--rl-samples 16] [--fixed-seeded] [--max-num-seqs 512]
        [--gpu-mem 0.9 | --gpu-mem-gib GIB] [--refit [--refit-bucket-mb 256]] [--timeout 900] [--budget-s S]
        [--out rows.json]

    python tools/bench_rollout.py --engines 1,2,4 [...]   # data-parallel engines: tools/bench_engines.py

Precisions (``PRECISIONS``):
    bf16             BF16 weights and KV cache.
    fp8-deepgemm     FP8 W8A8 blockwise (128x128 weights, 1x128 activations), DeepGEMM linears
                     (E8M0 scales); DeepGEMM compiles its kernels on first use (minutes on a fresh host).
    fp8-cutlass      the same with ``VLLM_USE_DEEP_GEMM=0``: CUTLASS linears, Triton fused MoE.
    fp8-kv           fp8-cutlass + ``kv_cache_dtype="fp8"`` (per-layer static q/k/v scales; FP8
                     attention with FlashAttention 3 on Hopper). Its linear-only baseline: fp8-cutlass.
    fp8-deepgemm-kv  fp8-deepgemm + FP8 KV cache. Its linear-only baseline: fp8-deepgemm.
    fp8-deepgemm-fused  fp8-deepgemm with vLLM's own fused SiLU-and-mul / RMSNorm + group-quant kernels
                     left on, as plain vLLM runs: they write fp32 activation scales, so this engine does
                     not honour pow2_activation_scaling_factors at those sites (the project's compiled
                     FP8 engines turn them off: ``engine_args.compilation_config``). The A/B of what that
                     costs or saves.
    fp8-deepgemm-fused-kv  fp8-deepgemm-fused + FP8 KV cache (plain vLLM's FP8 KV engine). Its linear-only
                     baseline: fp8-deepgemm-fused.
    fp8-cutlass-fp8router  fp8-cutlass with the MoE routers (``mlp.gate``) in FP8 too, as a plain vLLM
                     block-FP8 config with no ``ignored_layers`` runs them (the host README's MoE measurement).
                     The project keeps routers BF16 (layer-precision policy). The A/B for the MoE shape's
                     distance to that measurement.
    fp8-deepgemm-inductor  fp8-deepgemm with vLLM's per-token-group activation quantizer run as its torch code
                     (``compilation_config.custom_ops: ["-quant_fp8"]``), which Inductor can fuse into the
                     RMSNorm / SiLU-and-mul kernels before it instead of launching vLLM's CUDA op after them.
                     vLLM 0.22 turns the CUDA op on for block FP8 because the compiled torch quantizer alone
                     was slower on H100 (vllm-project/vllm#25094); fused with its producer it is not measured.
    fp8-deepgemm-inductor-kv  the same + FP8 KV cache. Its linear-only baseline: fp8-deepgemm-inductor.
    bf16-v1, fp8-deepgemm-v2, fp8-deepgemm-kv-v2  bf16 / fp8-deepgemm / fp8-deepgemm-kv with vLLM's GPU model
                     runner pinned (``vllm_cfg.model_runner``). vLLM 0.22 runs its V2 runner only for unquantized
                     models of its list (Qwen3ForCausalLM), so by default BF16 engines run V2 and FP8 ones V1; these
                     rows compare FP8 and BF16 on one runner. The runner table gives each against its default.

The last column names each engine's attention and its live activation scale format
(``act=pow2|fp32|mixed``, ``engine_args.live_activation_scales``).

Workloads: "fixed": ``--num-prompts`` x (``--input-len`` in, ``--output-len`` out), ignore_eos;
"RL-like": ``--rl-prompts`` prompts x ``--rl-samples`` samples (default 64 x 32: one rollout of the
8B GRPO configs), long-tailed response lengths (lognormal around output-len / 4, capped at
output-len); both seeded, identical for every engine.

Columns: output tokens/s (fixed, RL-like) and KV cache capacity in tokens, each with its ratio to
BF16 (x bf16) and, for FP8-KV rows, to the FP8-linear-only engine with the same kernels (x fp8);
"fill": the fixed workload's KV demand (prompts x (in + out) tokens) / capacity (> 1: not every
sequence fits at once, the engine is KV-bound); weight memory; engine start seconds. ``--refit``
(dense rows): seconds for a full state dict (bf16 on the GPU -> quantize for FP8 -> CUDA IPC ->
layerwise reload) in buckets of ``--refit-bucket-mb``, with one IPC handle per tensor and packed (one
per bucket, ``policy.weight_sync.packed``) side by side in a table of their own, and for FP8 the
quantization kernel's GB/s (bytes read + written).

Options: ``--num-layers N`` cuts both shapes to N decoder layers, ``dense=N,moe=M`` each its own
(0 or absent: the full 36 / 48);
``--gpu-mem-gib G`` sets ``gpu_memory_utilization`` to G GiB / the device's memory (one value for
all engines, computed once) instead of ``--gpu-mem``; ``--budget-s S`` stops starting engines
once S seconds have passed (the rest are listed as skipped and the table is still printed);
``--timeout`` caps each engine's subprocess; ``--out`` writes the rows as JSON after each engine.

Reading a reduced run (fewer layers, a small ``--gpu-mem-gib`` so that BF16 is KV-bound within a
short workload): the weights then take a larger share of each engine's memory than in a full-size
deployment, which overstates FP8-linear's KV capacity gain over BF16 (and its throughput gain when
KV-bound). FP8 KV over FP8 linear-only (same weights, half the bytes per cached token) does not
depend on that share.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from lab.random_checkpoint import QWEN3_SHAPES, write_shape_config

SHAPES = {"dense": QWEN3_SHAPES["qwen3-8b"], "moe": QWEN3_SHAPES["qwen3-30b-a3b"]}
SHAPE_NAMES = {"dense": "qwen3-8b", "moe": "qwen3-30b-a3b"}


@dataclass(frozen=True)
class Precision:
    """One engine variant: FP8 weights or not, DeepGEMM or CUTLASS linears, KV cache dtype, and the
    FP8-linear-only variant an FP8-KV row is compared with (None for the others)."""

    fp8: bool
    deep_gemm: bool
    kv_cache_dtype: str
    linear_baseline: Optional[str] = None
    vllm_act_quant_fusion: bool = False  # keep vLLM's fp32-scale fused act/norm-quant kernels (plain vLLM)
    fp8_router: bool = False  # MoE routers (mlp.gate) FP8 too, as a plain vLLM block-FP8 config without ignored_layers
    inductor_act_quant: bool = False  # vLLM's group quantizer as torch code (custom_ops "-quant_fp8"), Inductor-fused
    model_runner: str = "auto"  # vllm_cfg.model_runner: vLLM's choice, or its V1 / V2 GPU model runner pinned


PRECISIONS = {
    "bf16": Precision(False, False, "auto"),
    "fp8-deepgemm": Precision(True, True, "auto"),
    "fp8-cutlass": Precision(True, False, "auto"),
    "fp8-kv": Precision(True, False, "fp8", "fp8-cutlass"),
    "fp8-deepgemm-kv": Precision(True, True, "fp8", "fp8-deepgemm"),
    "fp8-deepgemm-fused": Precision(True, True, "auto", vllm_act_quant_fusion=True),
    "fp8-deepgemm-fused-kv": Precision(True, True, "fp8", "fp8-deepgemm-fused", vllm_act_quant_fusion=True),
    "fp8-cutlass-fp8router": Precision(True, False, "auto", fp8_router=True),
    "fp8-deepgemm-inductor": Precision(True, True, "auto", inductor_act_quant=True),
    "fp8-deepgemm-inductor-kv": Precision(True, True, "fp8", "fp8-deepgemm-inductor", inductor_act_quant=True),
    "bf16-v1": Precision(False, False, "auto", model_runner="v1"),
    "fp8-deepgemm-v2": Precision(True, True, "auto", model_runner="v2"),
    "fp8-deepgemm-kv-v2": Precision(True, True, "fp8", "fp8-deepgemm-v2", model_runner="v2"),
}
# engine settings that must be equal across the engines of one model for the ratios to mean anything
LIKE_FOR_LIKE = ("gpu_memory_utilization", "max_num_seqs", "max_num_batched_tokens", "max_model_len")


def write_config(kind: str, root: Path, num_layers: int = 0) -> Path:
    """Save the ``kind`` shape's HF config (``num_layers`` > 0: that many decoder layers) under ``root``."""
    return write_shape_config(SHAPE_NAMES[kind], root / kind, num_layers)


def rl_lengths(n: int, output_len: int, seed: int = 1) -> list[int]:
    """``n`` long-tailed response lengths: lognormal around ``output_len / 4`` (sigma 0.8), in [16, output_len].

    Seeded, so every engine of a run gets the same lengths.
    """
    import math

    import torch

    z = torch.randn(n, generator=torch.Generator().manual_seed(seed))
    return (math.log(output_len / 4.0) + 0.8 * z).exp().clamp(16, output_len).long().tolist()


def engine_settings(llm) -> dict:
    """What the engine actually runs with (read back, not what was asked for)."""
    vc = llm.llm_engine.vllm_config
    cc, sc = vc.cache_config, vc.scheduler_config
    out = {"gpu_memory_utilization": float(cc.gpu_memory_utilization), "max_num_seqs": int(sc.max_num_seqs),
           "max_num_batched_tokens": int(sc.max_num_batched_tokens), "max_model_len": int(vc.model_config.max_model_len),
           "kv_cache_dtype": str(cc.cache_dtype), "block_size": int(cc.block_size)}
    attn = llm.collective_rpc("nemo_fp8_attn_scales")[0]
    first = attn[sorted(attn)[0]] if attn else {}
    out.update(attn_impl=first.get("impl"), fa_version=first.get("fa_version"), fp8_query=first.get("query_quant"))
    conv = llm.collective_rpc("nemo_fp8_scale_convention")[0]
    out["linear_kernels"], out["act_scales"] = conv["linear_kernels"], conv.get("act_scales")
    out["model_runner"] = conv.get("model_runner")  # the worker's own, not the config's wish
    return out


def engine_config(precision: str, gpu_mem: float, max_model_len: int):
    """The ``VllmConfig`` of one ``PRECISIONS`` entry (DeepGEMM ones with power-of-two scales, as its E8M0 needs)."""
    from nemo_fp8.generation.config import VllmConfig

    p = PRECISIONS[precision]
    return VllmConfig(precision="fp8" if p.fp8 else "bfloat16", use_deep_gemm=p.deep_gemm,
                      pow2_weight_scaling_factors=p.deep_gemm, pow2_activation_scaling_factors=p.deep_gemm,
                      kv_cache_dtype=p.kv_cache_dtype, gpu_memory_utilization=gpu_mem, max_model_len=max_model_len,
                      model_runner=p.model_runner)


def engine_spec(precision: str, cfg, model_dir, extra: dict):
    """``init_fp8`` for one ``PRECISIONS`` entry, then its A/B change (``ab_engine_kwargs``)."""
    from nemo_fp8.generation.vllm.engine_args import init_fp8

    spec = init_fp8(cfg, model_dir, model_dir, colocated=False, extra=extra)
    ab_engine_kwargs(precision, spec.engine_kwargs)
    return spec


def ab_engine_kwargs(precision: str, kwargs: dict) -> dict:
    """Apply one ``PRECISIONS`` entry's difference from the project's engine to its vLLM ``kwargs`` (in place):
    ``vllm_act_quant_fusion`` drops the compilation config that turns vLLM's fused activation-quant kernels off
    (``engine_args.compilation_config``); ``inductor_act_quant`` adds ``-quant_fp8`` to its ``custom_ops``;
    ``fp8_router`` takes the MoE routers (``*.mlp.gate``) out of ``ignored_layers``."""
    p = PRECISIONS[precision]
    if p.vllm_act_quant_fusion:
        kwargs.pop("compilation_config", None)
    if p.inductor_act_quant:
        kwargs.setdefault("compilation_config", {}).setdefault("custom_ops", []).append("-quant_fp8")
    if p.fp8_router:
        qc = kwargs["hf_overrides"]["quantization_config"]
        qc["ignored_layers"] = [n for n in qc["ignored_layers"] if not n.endswith(".mlp.gate")]
    return kwargs


def child_result(cmd: list[str], precision: str, timeout: int) -> dict:
    """Run one engine child (``VLLM_USE_DEEP_GEMM`` as ``precision`` needs); the dict of its last
    ``RESULT {json}`` line, or ``{"error": ...}`` (its output's tail, or the timeout)."""
    env = dict(os.environ, VLLM_USE_DEEP_GEMM="1" if PRECISIONS[precision].deep_gemm else "0")
    try:
        p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
        line = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")]
        return json.loads(line[-1][7:]) if line else {"error": (p.stderr or p.stdout)[-1500:]}
    except subprocess.TimeoutExpired:
        return {"error": f"timeout after {timeout}s"}


def run_engine(a) -> dict:
    """Child: start one engine, measure, return one row (printed as a JSON line by ``main``)."""
    cfg = engine_config(a.precision, a.gpu_mem, a.input_len + a.output_len + 16)
    spec = engine_spec(a.precision, cfg, a.model, {"max_num_seqs": a.max_num_seqs})
    import torch
    from vllm import LLM, SamplingParams

    t0 = time.perf_counter()
    llm = LLM(**spec.engine_kwargs)
    start_s = time.perf_counter() - t0
    cc = llm.llm_engine.vllm_config.cache_config
    kv_tokens = int(cc.num_gpu_blocks or 0) * int(cc.block_size)
    info = llm.collective_rpc("nemo_fp8_param_info")[0]
    esize = {"float8_e4m3fn": 1, "bfloat16": 2, "float32": 4}
    weight_gib = sum(esize.get(d, 2) * int(torch.tensor(s).prod()) for d, s, _ in info.values()) / 2**30
    g = torch.Generator().manual_seed(0)

    def rand_prompt(n):
        return {"prompt_token_ids": torch.randint(100, 100000, (n,), generator=g).tolist()}

    # warm-up (DeepGEMM JIT, CUDA graphs)
    llm.generate([rand_prompt(a.input_len)] * 8, SamplingParams(max_tokens=32, ignore_eos=True, detokenize=False),
                 use_tqdm=False)
    res = {"precision": a.precision, "start_s": start_s, "kv_tokens": kv_tokens, "weight_gib": weight_gib,
           "engine": engine_settings(llm)}
    prompts = [rand_prompt(a.input_len) for _ in range(a.num_prompts)]
    sp = SamplingParams(max_tokens=a.output_len, ignore_eos=True, temperature=1.0, detokenize=False)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, sp, use_tqdm=False)
    dt = time.perf_counter() - t0
    res["fixed_tok_s"] = sum(len(o.outputs[0].token_ids) for o in outs) / dt
    if a.fixed_seeded:  # the same prompts with a seed each, as the GRPO rollout sends them by default
        sps = [SamplingParams(max_tokens=a.output_len, ignore_eos=True, temperature=1.0, seed=i, detokenize=False)
               for i in range(len(prompts))]
        t0 = time.perf_counter()
        outs = llm.generate(prompts, sps, use_tqdm=False)
        res["fixed_seeded_tok_s"] = sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - t0)
    if a.rl_prompts:
        lens = rl_lengths(a.rl_prompts * a.rl_samples, a.output_len)
        lo = min(64, a.input_len)
        base = [rand_prompt(int(torch.randint(lo, a.input_len + 1, (1,), generator=g))) for _ in range(a.rl_prompts)]
        reqs = [base[i // a.rl_samples] for i in range(len(lens))]
        sps = [SamplingParams(max_tokens=n, ignore_eos=True, temperature=1.0, seed=i, detokenize=False)
               for i, n in enumerate(lens)]
        t0 = time.perf_counter()
        outs = llm.generate(reqs, sps, use_tqdm=False)
        dt = time.perf_counter() - t0
        res["rl_tok_s"] = sum(len(o.outputs[0].token_ids) for o in outs) / dt
        if a.rl_unseeded:  # the same requests without their own seeds (vllm_cfg.seed_each_request: false)
            for sp in sps:
                sp.seed = None
            t0 = time.perf_counter()
            outs = llm.generate(reqs, sps, use_tqdm=False)
            res["rl_unseeded_tok_s"] = sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - t0)
    if a.refit:
        try:  # the throughput above stands whatever the refit does
            res.update(bench_refit(llm, spec, a.model, int(a.refit_bucket_mb * 2**20)))
        except Exception as e:  # noqa: BLE001 - reported in the row and the refit table
            res["refit_error"] = f"{type(e).__name__}: {e}"[-500:]
    return res


def bench_refit(llm, spec, model_dir, bucket_bytes: int) -> dict:
    """Full state dict (random bf16 on the GPU, as the trainer holds it) -> engine, timed: the CUDA IPC refit with
    one handle per tensor and packed (one per bucket, ``policy.weight_sync.packed``), alternated, three each.

    Returns ``refit_s`` / ``refit_packed_s`` (the fastest of each), all times, the tensors and updates of one refit,
    ``refit_packed_same_tokens`` (greedy tokens after every packed refit equal those after the first per-tensor one),
    ``refit_repeat_same_tokens`` (the same after every per-tensor refit: the engine's own repeatability, without
    which a packed mismatch says nothing about the load), and
    for an FP8 engine ``quant_gb_s``, the quantization kernel alone (bytes read + written per second)."""
    import torch
    from vllm import SamplingParams

    from nemo_fp8.generation.vllm.refit import meta_model
    from nemo_fp8.generation.vllm.quantize_gpu import quantize_blockwise_gpu
    from nemo_fp8.generation.vllm.refit import send_weights_ipc

    plan = spec.refit_plan
    meta = meta_model(model_dir)
    state = {}
    for n, p in meta.state_dict().items():
        t = torch.empty(p.shape, dtype=torch.bfloat16, device="cuda")
        t.normal_(0, 0.02) if t.dim() > 1 else t.fill_(1.0)
        state[n] = t
    del meta
    nbytes = sum(t.numel() * 2 for t in state.values())
    greedy = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, detokenize=False)
    prompts = [{"prompt_token_ids": list(range(1000 + 7 * i, 1032 + 7 * i))} for i in range(8)]
    times: dict[bool, list[float]] = {False: [], True: []}
    tokens: dict[bool, list] = {False: [], True: []}
    updates = {}
    for packed in (False, True) * 3:
        sent = []

        def update(payload, sent=sent):
            sent.append(1)
            llm.update_weights(payload)

        torch.cuda.synchronize()
        t0 = time.perf_counter()
        llm.start_weight_update(is_checkpoint_format=True)
        n = send_weights_ipc(state.items(), update, plan, bucket_bytes=bucket_bytes, packed=packed)
        llm.finish_weight_update()
        torch.cuda.synchronize()
        times[packed].append(time.perf_counter() - t0)
        updates[packed] = len(sent)
        tokens[packed].append([list(o.outputs[0].token_ids) for o in llm.generate(prompts, greedy, use_tqdm=False)])
    res = {"refit_s": min(times[False]), "refit_packed_s": min(times[True]), "refit_s_all": times[False],
           "refit_packed_s_all": times[True], "refit_tensors": n, "refit_updates": updates[False],
           "refit_packed_updates": updates[True], "refit_bucket_mb": bucket_bytes / 2**20,
           "refit_packed_same_tokens": all(t == tokens[False][0] for t in tokens[True]),
           "refit_repeat_same_tokens": all(t == tokens[False][0] for t in tokens[False]), "state_gib": nbytes / 2**30}
    # quantization kernel alone: bytes read (bf16) + written (fp8 + scales)
    ws = [t for n, t in state.items() if plan.is_fp8_weight(n)]
    if not ws:
        return res
    for w in ws[:4]:
        quantize_blockwise_gpu(w, plan.scale_mode)
    torch.cuda.synchronize()
    ev0, ev1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    ev0.record()
    for w in ws:
        quantize_blockwise_gpu(w, plan.scale_mode)
    ev1.record()
    torch.cuda.synchronize()
    qbytes = sum(w.numel() * 3 + (w.numel() // 16384) * 4 for w in ws)
    return res | {"quant_gb_s": qbytes / (ev0.elapsed_time(ev1) / 1e3) / 1e9}


def device_memory_gib() -> float:
    """Total memory of CUDA device 0 in GiB, asked in a subprocess (this process keeps no CUDA context)."""
    code = "import torch; print(torch.cuda.get_device_properties(0).total_memory)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    return int(out.stdout.strip().splitlines()[-1]) / 2**30


def parse_num_layers(text: str) -> dict[str, int]:
    """``"12"`` -> every shape 12 layers; ``"dense=12,moe=8"`` -> per shape; ``"0"`` -> full depth.

    Raises:
        argparse.ArgumentTypeError: an unknown shape or a negative / non-integer count.
    """
    try:
        if "=" not in text:
            n = int(text)
            out = {k: n for k in SHAPES}
        else:
            out = {k.strip(): int(v) for k, v in (part.split("=", 1) for part in text.split(","))}
    except ValueError:
        raise argparse.ArgumentTypeError(f"--num-layers: {text!r}; valid: N or dense=N,moe=M") from None
    bad = {k: v for k, v in out.items() if k not in SHAPES or v < 0}
    if bad:
        raise argparse.ArgumentTypeError(f"--num-layers: {bad}; shapes {list(SHAPES)}, counts >= 0")
    return out


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="dense,moe", help="comma list of %(default)s")
    ap.add_argument("--precisions", default="bf16,fp8-cutlass,fp8-kv,fp8-deepgemm,fp8-deepgemm-kv", help=f"comma list of {', '.join(PRECISIONS)}")
    ap.add_argument("--num-layers", type=parse_num_layers, default={},
                    help="decoder layers: N for both shapes, or dense=N,moe=M (0 or absent: full depth)")
    ap.add_argument("--num-prompts", type=int, default=512)
    ap.add_argument("--input-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=2048)
    ap.add_argument("--rl-prompts", type=int, default=64,
                    help="0: no RL-like workload (default: grpo_math_8B_megatron*.yaml's 64 prompts x 32 samples)")
    ap.add_argument("--rl-samples", type=int, default=32)
    ap.add_argument("--rl-unseeded", action="store_true",
                    help="also time the RL-like workload without per-request seeds (vllm_cfg.seed_each_request: "
                         "false): vLLM's sampler draws seeded requests' noise one request at a time")
    ap.add_argument("--fixed-seeded", action="store_true",
                    help="also time the fixed workload with a seed per request (vllm_cfg.seed_each_request: true, "
                         "the GRPO rollout's default); the mission suite's rollout ceiling reads it")
    ap.add_argument("--max-num-seqs", type=int, default=512)
    ap.add_argument("--gpu-mem", type=float, default=0.9, help="gpu_memory_utilization of every engine")
    ap.add_argument("--gpu-mem-gib", type=float, default=None,
                    help="instead of --gpu-mem: this many GiB of the device, as one fraction for every engine")
    ap.add_argument("--refit", action="store_true",
                    help="also time a full refit into each engine, per-tensor and packed CUDA IPC (dense only)")
    ap.add_argument("--refit-bucket-mb", type=float, default=256.0,
                    help="the refit's bucket size in MiB (policy.weight_sync.bucket_size_mb; default its default)")
    ap.add_argument("--timeout", type=int, default=900, help="seconds per engine subprocess")
    ap.add_argument("--budget-s", type=float, default=0, help="start no engine after this many seconds (0: no limit)")
    ap.add_argument("--out", default=None)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--model", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--precision", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    unknown = [p for p in a.precisions.split(",") if p not in PRECISIONS]
    if unknown:
        ap.error(f"--precisions: unknown {unknown}; valid: {list(PRECISIONS)}")
    if any(m not in SHAPES for m in a.models.split(",")):
        ap.error(f"--models: valid: {list(SHAPES)}")
    return a


def main():
    if "--engines" in sys.argv[1:]:  # data-parallel rollout, 1 / 2 / 4 engines: tools/bench_engines.py
        import importlib.util

        spec = importlib.util.spec_from_file_location("bench_engines", Path(__file__).with_name("bench_engines.py"))
        engines = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(engines)
        engines.main(sys.argv[1:])
        return
    a = parse_args()
    if a.child:
        print("RESULT " + json.dumps(run_engine(a)), flush=True)
        return
    t_start = time.monotonic()
    if a.gpu_mem_gib is not None:
        total = device_memory_gib()
        a.gpu_mem = round(min(a.gpu_mem_gib / total, 0.95), 4)
        print(f"--gpu-mem-gib {a.gpu_mem_gib}: gpu_memory_utilization {a.gpu_mem} of {total:.1f} GiB", flush=True)
    root = Path(tempfile.mkdtemp(prefix="bench_rollout_"))
    rows = []
    for kind in a.models.split(","):
        model = write_config(kind, root, a.num_layers.get(kind, 0))
        for prec in a.precisions.split(","):
            left = a.budget_s - (time.monotonic() - t_start) if a.budget_s else float(a.timeout)
            if left < 30:
                r = {"error": f"skipped: --budget-s {a.budget_s:.0f} spent"}
            else:
                r = run_child(a, model, prec, timeout=int(min(a.timeout, left)), refit=a.refit and kind == "dense")
            r.update(model=kind, precision=prec)
            rows.append(r)
            print(json.dumps(r), flush=True)
            if a.out:
                Path(a.out).write_text(json.dumps(rows, indent=1))
    print_table(rows, a)


def run_child(a, model: Path, prec: str, timeout: int, refit: bool) -> dict:
    """One engine in a fresh subprocess; its row, or ``{"error": ...}``."""
    cmd = [sys.executable, __file__, "--child", "--model", str(model), "--precision", prec]
    for k in ("num_prompts", "input_len", "output_len", "rl_prompts", "rl_samples", "max_num_seqs", "gpu_mem"):
        cmd += [f"--{k.replace('_', '-')}", str(getattr(a, k))]
    if refit:
        cmd += ["--refit", "--refit-bucket-mb", str(a.refit_bucket_mb)]
    if a.rl_unseeded:
        cmd.append("--rl-unseeded")
    if a.fixed_seeded:
        cmd.append("--fixed-seeded")
    return child_result(cmd, prec, timeout)


def like_for_like(rows) -> list[str]:
    """Per model, the ``LIKE_FOR_LIKE`` engine settings that differ between its engines (empty: none)."""
    problems = []
    for model in dict.fromkeys(r["model"] for r in rows):
        ok = [r for r in rows if r["model"] == model and "engine" in r]
        for k in LIKE_FOR_LIKE:
            vals = {r["precision"]: r["engine"].get(k) for r in ok}
            if len(set(vals.values())) > 1:
                problems.append(f"{model} {k}: {vals}")
    return problems


def print_table(rows, a):
    """The one table of the run: absolute numbers and ratios (to BF16, and FP8-KV to FP8 linear-only)."""
    demand = a.num_prompts * (a.input_len + a.output_len)
    print(f"\nfixed: {a.num_prompts} prompts x ({a.input_len} in, {a.output_len} out), KV demand {demand} tokens; "
          f"RL-like: {a.rl_prompts} prompts x {a.rl_samples} samples, lognormal lengths <= {a.output_len}")
    layers = ", ".join(f"{k} {a.num_layers.get(k) or SHAPES[k]['num_hidden_layers']} layers" for k in SHAPES)
    print(f"shapes: dense = Qwen3-8B, moe = Qwen3-30B-A3B ({layers}); dummy weights. x fp8 (same linear kernels, "
          "FP8 KV cache or not): " + ", ".join(f"{k} / {p.linear_baseline}" for k, p in PRECISIONS.items()
                                               if p.linear_baseline))
    problems = like_for_like(rows)
    ref = next((r["engine"] for r in rows if "engine" in r), {})
    if problems:
        print("NOT like-for-like: " + "; ".join(problems))
    elif ref:
        print("like-for-like: every engine ran with " + ", ".join(f"{k}={ref.get(k)}" for k in LIKE_FOR_LIKE))
    hdr = (f"{'model':6} {'precision':21} {'fixed tok/s':>11} {'x bf16':>7} {'x fp8':>6} {'RL tok/s':>9} {'x bf16':>7} "
           f"{'x fp8':>6} {'KV tokens':>10} {'x bf16':>7} {'x fp8':>6} {'fill':>5} {'weights GiB':>11} {'start s':>8} "
           f"{'refit s':>8} {'quant GB/s':>10}  kv / attention / activation scales")
    print(hdr)
    ok = {(r["model"], r["precision"]): r for r in rows if "error" not in r}
    for r in rows:
        if "error" in r:
            print(f"{r['model']:6} {r['precision']:21} ERROR {r['error'][-300:]!r}")
            continue
        b = ok.get((r["model"], "bf16"), {})
        lb = PRECISIONS[r["precision"]].linear_baseline
        f8 = ok.get((r["model"], lb), {}) if lb else {}

        def ratio(k, base):
            return f"{r[k] / base[k]:.3f}" if r.get(k) and base.get(k) else "-"

        e = r.get("engine", {})
        attn = (f"{e.get('kv_cache_dtype')} / {e.get('attn_impl')} FA{e.get('fa_version')} fp8-q={e.get('fp8_query')}"
                f" act={e.get('act_scales')} runner={e.get('model_runner')}")
        print(f"{r['model']:6} {r['precision']:21} {r['fixed_tok_s']:11.0f} {ratio('fixed_tok_s', b):>7} "
              f"{ratio('fixed_tok_s', f8):>6} {r.get('rl_tok_s', 0):9.0f} {ratio('rl_tok_s', b):>7} "
              f"{ratio('rl_tok_s', f8):>6} {r['kv_tokens']:10d} {ratio('kv_tokens', b):>7} {ratio('kv_tokens', f8):>6} "
              f"{demand / max(r['kv_tokens'], 1):5.2f} {r['weight_gib']:11.2f} {r['start_s']:8.1f} "
              f"{r.get('refit_s', float('nan')):8.3f} {r.get('quant_gb_s', float('nan')):10.0f}  {attn}")
    print_runner_table(rows, ok)
    print_refit_table(rows)
    print_seeding_table(rows, ok, "fixed_seeded_tok_s", "fixed_tok_s", "tok/s", "x unseeded",
                        "fixed workload with a seed per request (policy.generation.vllm_cfg.seed_each_request: true)")
    print_seeding_table(rows, ok, "rl_unseeded_tok_s", "rl_tok_s", "RL tok/s", "x seeded",
                        "RL-like without per-request seeds (policy.generation.vllm_cfg.seed_each_request: false)")


def print_runner_table(rows, ok) -> None:
    """The model-runner A/B: each row of a pinned runner (``-v1`` / ``-v2``) against the same engine on vLLM's own
    choice (the name without the suffix), fixed and seeded tokens/s. Nothing when no such pair ran."""
    pairs = [(r, ok.get((r["model"], r["precision"].rsplit("-", 1)[0]))) for r in rows
             if "error" not in r and PRECISIONS[r["precision"]].model_runner != "auto"]
    pairs = [(r, base) for r, base in pairs if base]
    if not pairs:
        return
    print("\nmodel runner (vLLM 0.22's own choice: V2 for unquantized Qwen3, V1 for quantized models)")
    print(f"{'model':6} {'precision':21} {'runner':>6} {'vs':21} {'runner':>6} {'x fixed':>8} {'x seeded':>9}")
    for r, base in pairs:
        def x(k):
            return f"{r[k] / base[k]:.3f}" if r.get(k) and base.get(k) else "-"
        print(f"{r['model']:6} {r['precision']:21} {r['engine'].get('model_runner', '?'):>6} {base['precision']:21} "
              f"{base['engine'].get('model_runner', '?'):>6} {x('fixed_tok_s'):>8} {x('fixed_seeded_tok_s'):>9}")


def print_refit_table(rows) -> None:
    """``--refit``: per engine, the full refit with one CUDA IPC handle per tensor against packed buckets (one
    handle per bucket), each the fastest of three, whether greedy tokens after every packed refit agree with those
    after a per-tensor one, and whether they agree among the per-tensor refits themselves. Nothing without."""
    picked = [r for r in rows if r.get("refit_s") or r.get("refit_error")]
    if not picked:
        return
    print(f"\nrefit over CUDA IPC: a full state dict (bf16 on the GPU) -> the engine, buckets of "
          f"{picked[0].get('refit_bucket_mb', 0):.0f} MiB; per tensor vs packed (policy.weight_sync.packed)")
    print(f"{'model':6} {'precision':21} {'tensors':>7} {'per tensor s':>12} {'updates':>7} {'packed s':>8} "
          f"{'updates':>7} {'x per tensor':>12} {'same tokens':>11} {'repeats agree':>13}")
    for r in picked:
        if r.get("refit_error"):
            print(f"{r['model']:6} {r['precision']:21} ERROR {r['refit_error']!r}")
            continue
        print(f"{r['model']:6} {r['precision']:21} {r['refit_tensors']:7d} {r['refit_s']:12.3f} "
              f"{r['refit_updates']:7d} {r['refit_packed_s']:8.3f} {r['refit_packed_updates']:7d} "
              f"{r['refit_packed_s'] / r['refit_s']:12.3f} {str(r['refit_packed_same_tokens']):>11} "
              f"{str(r.get('refit_repeat_same_tokens', '-')):>13}")


def print_seeding_table(rows, ok, key: str, other: str, head: str, other_head: str, title: str) -> None:
    """The per-request-seed A/B: each engine's ``key`` tokens/s, its ratio to the same engine's ``other`` run (the
    same requests, seeded the other way) and to BF16's ``key``. Nothing when no row has ``key``."""
    picked = [r for r in rows if r.get(key)]
    if not picked:
        return
    print(f"\n{title}")
    print(f"{'model':6} {'precision':21} {head:>9} {other_head:>10} {'x bf16':>7}")
    for r in picked:
        tps, b = r[key], ok.get((r["model"], "bf16"), {}).get(key)
        print(f"{r['model']:6} {r['precision']:21} {tps:9.0f} {tps / r[other]:10.3f} {tps / b if b else float('nan'):7.3f}")

if __name__ == "__main__":
    main()

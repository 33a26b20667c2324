"""Rollout benchmark: BF16 vs FP8 W8A8 (DeepGEMM and CUTLASS) in vLLM, plus refit speed.

One run prints one table. Each engine runs in its own subprocess (clean GPU memory) on a
dummy-weight model built from a Qwen3-8B- or Qwen3-30B-A3B-shaped config:

    python tools/bench_rollout.py --models dense,moe --precisions bf16,fp8-deepgemm,fp8-cutlass \
        --num-prompts 512 --input-len 256 --output-len 2048 --rl-prompts 64 --rl-samples 16 --refit

Columns: output tokens/s (fixed lengths: ignore_eos; RL-like: prompts x samples, long-tailed
lengths), ratio to BF16, KV cache tokens, weight memory, engine start time. ``--refit``: seconds
for a full 8B state dict (bf16 on the GPU -> quantize -> CUDA IPC -> layerwise reload) and the
quantization kernel's GB/s (bytes read + written).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

SHAPES = {
    "dense": dict(model_type="qwen3", architectures=["Qwen3ForCausalLM"], hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                  num_attention_heads=32, num_key_value_heads=8, head_dim=128, vocab_size=151936,
                  max_position_embeddings=40960, tie_word_embeddings=False, rope_theta=1e6),
    "moe": dict(model_type="qwen3_moe", architectures=["Qwen3MoeForCausalLM"], hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
                num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4, head_dim=128, vocab_size=151936,
                num_experts=128, num_experts_per_tok=8, decoder_sparse_step=1, max_position_embeddings=40960,
                tie_word_embeddings=False, rope_theta=1e6),
}


def write_config(kind: str, root: Path) -> Path:
    from transformers import AutoConfig

    d = root / kind
    d.mkdir(parents=True, exist_ok=True)
    AutoConfig.for_model(**SHAPES[kind]).save_pretrained(str(d))
    return d


def run_engine(a) -> dict:
    """Child: start one engine, measure, print one JSON line."""
    from nemo_fp8.generation.config import VllmConfig
    from nemo_fp8.generation.vllm.engine_args import init_fp8

    fp8 = a.precision.startswith("fp8")
    cfg = VllmConfig(precision="fp8" if fp8 else "bfloat16", use_deep_gemm=a.precision == "fp8-deepgemm",
                     pow2_weight_scaling_factors=a.precision == "fp8-deepgemm",
                     pow2_activation_scaling_factors=a.precision == "fp8-deepgemm",
                     gpu_memory_utilization=a.gpu_mem, max_model_len=a.input_len + a.output_len + 16)
    spec = init_fp8(cfg, a.model, a.model, colocated=False, extra={"max_num_seqs": a.max_num_seqs})
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
    res = {"precision": a.precision, "start_s": start_s, "kv_tokens": kv_tokens, "weight_gib": weight_gib}
    prompts = [rand_prompt(a.input_len) for _ in range(a.num_prompts)]
    sp = SamplingParams(max_tokens=a.output_len, ignore_eos=True, temperature=1.0, detokenize=False)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, sp, use_tqdm=False)
    dt = time.perf_counter() - t0
    res["fixed_tok_s"] = sum(len(o.outputs[0].token_ids) for o in outs) / dt
    if a.rl_prompts:
        # RL-like: prompts x samples, long-tailed response lengths (lognormal, capped)
        lens = torch.distributions.LogNormal(torch.log(torch.tensor(a.output_len / 4.0)), 0.8).sample(
            (a.rl_prompts * a.rl_samples,)).clamp(16, a.output_len).long().tolist()
        base = [rand_prompt(int(torch.randint(64, a.input_len + 1, (1,), generator=g))) for _ in range(a.rl_prompts)]
        reqs = [base[i // a.rl_samples] for i in range(len(lens))]
        sps = [SamplingParams(max_tokens=n, ignore_eos=True, temperature=1.0, seed=i, detokenize=False)
               for i, n in enumerate(lens)]
        t0 = time.perf_counter()
        outs = llm.generate(reqs, sps, use_tqdm=False)
        dt = time.perf_counter() - t0
        res["rl_tok_s"] = sum(len(o.outputs[0].token_ids) for o in outs) / dt
    if a.refit and fp8:
        res.update(bench_refit(llm, spec, a.model))
    return res


def bench_refit(llm, spec, model_dir) -> dict:
    """Full state dict (random bf16 on the GPU, as the trainer holds it) -> engine, timed."""
    import torch

    from nemo_fp8.generation.vllm.engine_args import meta_model
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
    times = []
    for _ in range(3):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        llm.start_weight_update(is_checkpoint_format=True)
        send_weights_ipc(state.items(), llm.update_weights, plan, bucket_bytes=2 << 30)
        llm.finish_weight_update()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    # quantization kernel alone: bytes read (bf16) + written (fp8 + scales)
    ws = [t for n, t in state.items() if plan.is_fp8_weight(n)]
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
    return {"refit_s": min(times), "refit_s_all": times, "state_gib": nbytes / 2**30,
            "quant_gb_s": qbytes / (ev0.elapsed_time(ev1) / 1e3) / 1e9}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="dense,moe")
    ap.add_argument("--precisions", default="bf16,fp8-deepgemm,fp8-cutlass")
    ap.add_argument("--num-prompts", type=int, default=512)
    ap.add_argument("--input-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=2048)
    ap.add_argument("--rl-prompts", type=int, default=32)
    ap.add_argument("--rl-samples", type=int, default=16)
    ap.add_argument("--max-num-seqs", type=int, default=512)
    ap.add_argument("--gpu-mem", type=float, default=0.9)
    ap.add_argument("--refit", action="store_true")
    ap.add_argument("--timeout", type=int, default=900)
    ap.add_argument("--out", default=None)
    ap.add_argument("--child", action="store_true")
    ap.add_argument("--model", default=None)
    ap.add_argument("--precision", default=None)
    a = ap.parse_args()
    if a.child:
        print("RESULT " + json.dumps(run_engine(a)), flush=True)
        return
    root = Path(tempfile.mkdtemp(prefix="bench_rollout_"))
    rows = []
    for kind in a.models.split(","):
        model = write_config(kind, root)
        for prec in a.precisions.split(","):
            cmd = [sys.executable, __file__, "--child", "--model", str(model), "--precision", prec]
            for k in ("num_prompts", "input_len", "output_len", "rl_prompts", "rl_samples", "max_num_seqs", "gpu_mem"):
                cmd += [f"--{k.replace('_', '-')}", str(getattr(a, k))]
            if a.refit and kind == "dense":
                cmd.append("--refit")
            env = dict(os.environ, VLLM_USE_DEEP_GEMM="1" if prec == "fp8-deepgemm" else "0")
            try:
                p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=a.timeout)
                line = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")]
                r = json.loads(line[-1][7:]) if line else {"error": (p.stderr or p.stdout)[-1500:]}
            except subprocess.TimeoutExpired:
                r = {"error": f"timeout after {a.timeout}s"}
            r.update(model=kind, precision=prec)
            rows.append(r)
            print(json.dumps(r), flush=True)
            if a.out:
                Path(a.out).write_text(json.dumps(rows, indent=1))
    print_table(rows, a)


def print_table(rows, a):
    print(f"\nfixed: {a.num_prompts} prompts x ({a.input_len} in, {a.output_len} out); RL-like: {a.rl_prompts} prompts x "
          f"{a.rl_samples} samples, lognormal lengths <= {a.output_len}")
    hdr = f"{'model':6} {'precision':13} {'fixed tok/s':>11} {'vs bf16':>8} {'RL tok/s':>9} {'vs bf16':>8} " \
          f"{'KV tokens':>10} {'weights GiB':>11} {'start s':>8} {'refit s':>8} {'quant GB/s':>10}"
    print(hdr)
    base = {r["model"]: r for r in rows if r["precision"] == "bf16" and "error" not in r}
    for r in rows:
        if "error" in r:
            print(f"{r['model']:6} {r['precision']:13} ERROR {r['error'][-300:]!r}")
            continue
        b = base.get(r["model"], {})
        rf = lambda k: f"{r[k] / b[k]:.3f}" if k in r and b.get(k) else "-"  # noqa: E731
        print(f"{r['model']:6} {r['precision']:13} {r['fixed_tok_s']:11.0f} {rf('fixed_tok_s'):>8} "
              f"{r.get('rl_tok_s', 0):9.0f} {rf('rl_tok_s'):>8} {r['kv_tokens']:10d} {r['weight_gib']:11.2f} "
              f"{r['start_s']:8.1f} {r.get('refit_s', float('nan')):8.3f} {r.get('quant_gb_s', float('nan')):10.0f}")


if __name__ == "__main__":
    main()

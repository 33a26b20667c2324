"""vLLM FP8 engine: Qwen3-MoE-shaped model refit, and the power-of-two scale convention (GPU host)."""

from __future__ import annotations

import gc
import os

import pytest
import torch

pytestmark = pytest.mark.gpu
vllm = pytest.importorskip("vllm")

from nemo_fp8.fp8 import quantize_weight_blockwise  # noqa: E402
from nemo_fp8.generation.interfaces import SamplingParams  # noqa: E402
from tests.gpu.helpers import engine as _engine, engine_params as _engine_params, hf_state as _hf_state  # noqa: E402
from tests.gpu.helpers import perturbed as _perturbed, prompts as _prompts, refit as _refit, save_qwen3 as _save_qwen3  # noqa: E402


def test_pow2_convention_is_live_and_bit_exact(tmp_path):
    os.environ.setdefault("VLLM_USE_DEEP_GEMM", "0")
    path = _save_qwen3(tmp_path / "q3", seed=3)
    be = _engine(path, pow2_weight_scaling_factors=True, pow2_activation_scaling_factors=True)
    try:
        conv = be.llm.collective_rpc("nemo_fp8_scale_convention")[0]
        print("pow2 scale convention:", conv)
        assert conv["act_ue8m0"] == [True]
        # compiled engine: vLLM's fused act/norm-quant kernels (fp32 scales only) are off, so every input is pow2
        assert conv["compiled"] and not conv["fuse_act_quant"] and not conv["fuse_norm_quant"]
        assert conv["act_scales"] == "pow2"
        state = _hf_state(path)
        got = _engine_params(be, ["model.layers.2.mlp.gate_up_proj.weight", "model.layers.2.mlp.gate_up_proj.weight_scale_inv"])
        qs = [quantize_weight_blockwise(state[f"model.layers.2.mlp.{p}_proj.weight"].cuda(), scale_mode="pow2")
              for p in ("gate", "up")]
        s = got["model.layers.2.mlp.gate_up_proj.weight_scale_inv"]
        assert torch.equal(s, torch.cat([s_ for _, s_ in qs]).cpu())
        assert torch.equal(torch.exp2(torch.log2(s).round()), s)  # every scale is a power of two
        assert torch.equal(got["model.layers.2.mlp.gate_up_proj.weight"].view(torch.uint8),
                           torch.cat([q for q, _ in qs]).view(torch.uint8).cpu())
        out = be.generate(_prompts(8), SamplingParams(max_new_tokens=16, greedy=True))
        assert int(out.response_lengths.sum()) > 0
    finally:
        be.shutdown()
        del be
        gc.collect()


def test_qwen3_moe_rolls_out_and_refits(tmp_path):
    """The fused-MoE FP8 weights refit like the dense ones: the initial refit is our quantization bit for
    bit, a perturbed refit changes the rollout, and refitting the first weights again restores every engine
    parameter bit for bit (and so the greedy rollout, if the engine is deterministic, which is checked
    first by generating twice)."""
    os.environ.setdefault("VLLM_USE_DEEP_GEMM", "0")
    path = _save_qwen3(tmp_path / "moe", moe=True, seed=4)
    be = _engine(path)
    try:
        state = _hf_state(path)
        all_names = list(be.llm.collective_rpc("nemo_fp8_param_info")[0])
        names = [n for n in all_names if "layers.1.mlp.experts" in n]
        print("engine expert params:", names)
        got = _engine_params(be, names)
        w13 = next(n for n in names if n.endswith("w13_weight"))
        # the checkpoint holds the experts one by one (transformers 5 fuses them only in memory)
        q_g, _ = quantize_weight_blockwise(state["model.layers.1.mlp.experts.0.gate_proj.weight"].cuda())
        q_u, _ = quantize_weight_blockwise(state["model.layers.1.mlp.experts.0.up_proj.weight"].cuda())
        assert got[w13].dtype == torch.float8_e4m3fn
        assert torch.equal(got[w13][0].view(torch.uint8), torch.cat([q_g, q_u]).view(torch.uint8).cpu())
        before = _engine_params(be, all_names)
        prompts, sp = _prompts(16, seed=5), SamplingParams(max_new_tokens=24, greedy=True)
        a = be.generate(prompts, sp)
        a_again = be.generate(prompts, sp)
        same_twice = torch.equal(a.token_ids, a_again.token_ids)
        print(f"MoE: same weights, generated twice: identical {same_twice}, max |logprob diff| "
              f"{(a.generation_logprobs - a_again.generation_logprobs).abs().max().item():.2e}")
        _refit(be, _perturbed(state, 9), 1)
        b = be.generate(prompts, sp)
        _refit(be, state, 2)
        after = _engine_params(be, all_names)
        differ = [n for n in all_names if not torch.equal(before[n].view(torch.uint8), after[n].view(torch.uint8))]
        a2 = be.generate(prompts, sp)
        changed = sum(not torch.equal(a.token_ids[i], b.token_ids[i]) for i in range(16))
        print(f"MoE: second refit changed {changed}/16; after refitting the first weights again "
              f"{len(all_names) - len(differ)}/{len(all_names)} engine params bit-identical (differ: {differ[:8]}); "
              f"rollout identical: {torch.equal(a.token_ids, a2.token_ids)}")
        assert changed >= 12
        assert not differ, f"engine params not restored by the refit: {differ}"
        if same_twice:
            assert torch.equal(a.token_ids, a2.token_ids)
    finally:
        be.shutdown()
        del be
        gc.collect()

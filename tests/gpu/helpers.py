"""Shared pieces of the GPU tests (``tests/gpu``): random-weight Qwen3-shaped checkpoints, prompts,
vLLM engines of ``VllmGenerationBackend``, engine-side reads through the worker extension, and
teacher-forced scoring. Imports no vLLM at module level (the tests skip without it).
"""

from __future__ import annotations

import torch

from nemo_fp8.generation.config import VllmConfig
from nemo_fp8.policy.spec import PolicySpec

EOS = 1
MAX_LEN = 384


# Dimensions shared by the test checkpoints (every Linear FP8-eligible: multiples of 128).
_DIMS = dict(hidden_size=1024, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4, head_dim=128,
             vocab_size=4096, max_position_embeddings=2048, initializer_range=0.05, tie_word_embeddings=False,
             bos_token_id=0, eos_token_id=EOS, pad_token_id=0)


def _save_random(path, cfg, seed):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).save_pretrained(str(path))
    return path


def save_llama(path, seed=0):
    """Save a random-weight Llama checkpoint (bf16, the shapes of ``save_qwen3``'s dense model); returns ``path``."""
    from transformers import LlamaConfig

    return _save_random(path, LlamaConfig(intermediate_size=3072, **_DIMS), seed)


def save_qwen3(path, moe=False, seed=0):
    """Save a random-weight Qwen3 (or Qwen3-MoE) checkpoint, bf16, every Linear FP8-eligible; returns ``path``.

    Shape: hidden 1024, 4 layers, 8 heads / 4 KV heads of 128, vocab 4096 (dense MLP 3072; MoE: 8
    experts of 256, top 2).
    """
    from transformers import Qwen3Config, Qwen3MoeConfig

    cfg = Qwen3MoeConfig(intermediate_size=1024, moe_intermediate_size=256, num_experts=8, num_experts_per_tok=2,
                         decoder_sparse_step=1, **_DIMS) if moe else Qwen3Config(intermediate_size=3072, **_DIMS)
    return _save_random(path, cfg, seed)


def perturbed(state, seed):
    """``state`` (name -> tensor) plus N(0, 0.02) noise, same dtypes."""
    g = torch.Generator().manual_seed(seed)
    return {k: (v.float() + 0.02 * torch.randn(v.shape, generator=g)).to(v.dtype) for k, v in state.items()}


def prompts(n=32, seed=0):
    """``n`` random prompts of 8..47 token ids in [2, 4096) (no EOS, no pad)."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(2, 4096, (int(torch.randint(8, 48, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]


def hf_state(path):
    """name -> CPU tensor of every tensor in the checkpoint at ``path``."""
    from nemo_fp8.models.hf import iter_checkpoint

    return dict(iter_checkpoint(str(path)))


def engine(path, **cfg):
    """A colocated FP8 ``VllmGenerationBackend`` on ``path`` (20% of GPU memory, 64 sequences).

    ``cfg``: further ``VllmConfig`` fields (e.g. ``kv_cache_dtype="fp8"``; ``precision="bfloat16"`` for a BF16 one).
    """
    from nemo_fp8.generation.vllm.backend import VllmGenerationBackend

    vcfg = VllmConfig(**{"precision": "fp8", "gpu_memory_utilization": 0.2, **cfg})
    return VllmGenerationBackend(str(path), vcfg, pad_token_id=0, eos_token_id=EOS, max_total_sequence_length=MAX_LEN,
                                 colocated=True, engine_overrides={"max_num_seqs": 64})


def engine_params(backend, names):
    """name -> CPU copy of the engine's parameter (exact bytes, engine dtype and shape) on worker 0."""
    return engine_params_per_rank(backend, names)[0]


def engine_params_per_rank(backend, names):
    """``engine_params`` of every worker, in tensor-parallel rank order (``collective_rpc`` answers once per
    worker): each holds its shard of a tensor-parallel engine's parameters."""
    return decode_engine_params(backend.engine_params(names))


def decode_engine_params(per_worker):
    """What ``Fp8WorkerExtension.nemo_fp8_params`` answered per worker (name -> (dtype name, shape, raw bytes);
    also ``GenerationWorker.engine_params``) -> per worker, name -> CPU tensor of the engine's dtype and shape."""
    dtypes = {"float8_e4m3fn": torch.float8_e4m3fn, "float32": torch.float32, "bfloat16": torch.bfloat16}
    return [{n: torch.frombuffer(bytearray(b), dtype=torch.uint8).view(dtypes[d]).reshape(s)
             for n, (d, s, b) in raw.items()}
            for raw in per_worker]


def refit(backend, state, version):
    """Full weight refit of ``state`` without KV scales (the engine's KV cache must not be FP8)."""
    backend.start_weight_update(version)
    backend.update_weights(state.items())
    return backend.finish_weight_update(require_kv_scales=False)


@torch.no_grad()
def score(model, out):
    """Teacher-forced log-probs of each response token of ``out`` under ``model``.

    Returns [B, T] float32 on the CPU, aligned to the token, 0 outside the responses.
    """
    ids = out.token_ids.cuda()
    mask = (torch.arange(ids.shape[1])[None] < (out.prompt_lengths + out.response_lengths)[:, None]).long().cuda()
    logp = torch.log_softmax(model(input_ids=ids, attention_mask=mask).logits.float(), -1)
    lp = torch.zeros(ids.shape, dtype=torch.float32, device="cuda")
    lp[:, 1:] = logp[:, :-1].gather(-1, ids[:, 1:, None]).squeeze(-1)
    return (lp * out.token_mask.cuda()).cpu()


def fused_fp8_reference(state: dict, layers) -> dict:
    """vLLM parameter name -> our reference quantization (e4m3 ``weight``, fp32 ``weight_scale_inv``) of the HF
    weights ``state`` in ``layers``, fused as vLLM holds them at tensor parallel 1 (q|k|v and gate|up by rows,
    each part's 128x128 blocks its own). Needs CUDA (the quantizer runs where the engine's would)."""
    from nemo_fp8.fp8 import quantize_weight_blockwise

    def q(name):
        w, s = quantize_weight_blockwise(state[name].cuda(), (128, 128), scale_mode="fp32")
        return w.cpu(), s.cpu()

    out = {}
    for i in layers:
        pre = f"model.layers.{i}"
        fused = {f"{pre}.self_attn.qkv_proj": [q(f"{pre}.self_attn.{p}_proj.weight") for p in "qkv"],
                 f"{pre}.mlp.gate_up_proj": [q(f"{pre}.mlp.{p}_proj.weight") for p in ("gate", "up")],
                 f"{pre}.self_attn.o_proj": [q(f"{pre}.self_attn.o_proj.weight")],
                 f"{pre}.mlp.down_proj": [q(f"{pre}.mlp.down_proj.weight")]}
        for module, parts in fused.items():
            out[f"{module}.weight"] = torch.cat([w for w, _ in parts])
            out[f"{module}.weight_scale_inv"] = torch.cat([s for _, s in parts])
    return out


def save_perturbed_policy(policy_cfg, path, scale: float = 0.05, seed: int = 0) -> dict:
    """Save to ``path`` (``TorchPolicyBackend.save``) the policy of ``policy_cfg`` with every parameter moved by
    ``scale`` x N(0, 1) noise (``seed``): weights a refit must visibly change the rollouts to. Returns its
    ``named_weights()`` (HF names -> CPU tensors), what the engines must hold after refitting it."""
    from nemo_fp8.policy.torch_backend import TorchPolicyBackend

    changed = TorchPolicyBackend(PolicySpec.from_config(policy_cfg, torch.device("cpu")))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in changed.model.parameters():
            p.add_(scale * torch.randn(p.shape, generator=gen))
    changed.save(path)
    return {n: t.clone() for n, t in changed.named_weights()}

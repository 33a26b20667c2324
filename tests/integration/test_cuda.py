"""The same torch backends and GRPO step on a CUDA device (skipped where there is none)."""

import pytest
import torch

from nemo_fp8.algorithms.grpo import RefitController, grpo_step
from nemo_fp8.batch import TrainBatch
from nemo_fp8.data import PromptDataloader
from nemo_fp8.distributed.weight_sync import InProcessWeightSync
from nemo_fp8.fp8 import Fp8BlockLinear
from nemo_fp8.generation import SamplingParams
from nemo_fp8.generation.torch_backend import TorchGenerationBackend
from nemo_fp8.models.hf import load_tokenizer
from nemo_fp8.policy.torch_backend import TorchPolicyBackend
from nemo_fp8.trainer import prepare_prompts
from nemo_fp8.utils.timer import Timer
from nemo_fp8.policy.spec import PolicySpec

pytestmark = pytest.mark.gpu
CUDA = torch.device("cuda")


def backends(cfg, device):
    tok = load_tokenizer(cfg.policy.model_name)
    policy = TorchPolicyBackend(PolicySpec.from_config(cfg.policy, device,
                                                       temperature=cfg.policy.generation.temperature))
    gen = TorchGenerationBackend(cfg.policy.model_name, cfg.policy.generation.vllm_cfg, device, tok.pad_token_id,
                                 tok.eos_token_id, cfg.policy.max_total_sequence_length, batch_size=64)
    gen.update_weights(policy.named_weights())
    return tok, policy, gen


def test_fp8_rollout_on_cuda_matches_the_trainer(tiny_cfg):
    cfg = tiny_cfg()
    tok, policy, gen = backends(cfg, CUDA)
    q = gen.model.model.layers[1].self_attn.q_proj
    assert isinstance(q, Fp8BlockLinear) and q.weight.is_cuda and q.weight.dtype == torch.float8_e4m3fn
    ptr = q.weight.data_ptr()
    prompts = [tok.encode("Q: What is 12 + 30?\n", add_special_tokens=False)] * 32
    out = gen.generate(prompts, SamplingParams(max_new_tokens=10, seed=0)).validate()
    batch = TrainBatch(out.token_ids, out.prompt_lengths, out.response_lengths, torch.zeros(32),
                       out.generation_logprobs)
    prev = policy.get_logprobs(batch)
    m = batch.token_mask.bool()
    assert (prev - out.generation_logprobs)[m].abs().mean() < 0.05
    gen.update_weights(policy.named_weights())
    assert q.weight.data_ptr() == ptr


@pytest.mark.parametrize("recipe", ["tensorwise", "blockwise"])
def test_grpo_step_on_cuda_with_fp8_training(tiny_cfg, recipe):
    cfg = tiny_cfg("grpo.num_prompts_per_step=8", "grpo.num_generations_per_prompt=8",
                   "policy.train_global_batch_size=64", "policy.train_micro_batch_size=32",
                   "policy.megatron_cfg.fp8_cfg.enabled=true", f"policy.megatron_cfg.fp8_cfg.fp8_recipe={recipe}",
                   "policy.megatron_cfg.fp8_cfg.fp8=hybrid")
    tok, policy, gen = backends(cfg, CUDA)
    train, _ = prepare_prompts(cfg, tok)
    refitter = RefitController(policy, gen, InProcessWeightSync(policy, gen, 64 * 2**20))
    metrics = grpo_step(1, iter(PromptDataloader(train, 8, seed=0)), policy, gen,
                        lambda r, a: [float(len(x) % 2 == 0) for x in r], tok, cfg, Timer(), refitter)
    for key in ("mismatch/gen_kl_error", "loss/is_weight_mean", "loss/grad_norm"):
        assert torch.isfinite(torch.tensor(metrics[key])), key
    assert metrics["train/num_sequences_trained"] == 64

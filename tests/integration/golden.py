"""The golden run's computation: the tiny FP8 config's first GRPO steps, in float64 on CPU.

Used by ``test_golden_run.py`` in-process and, under other CPU kernel variants, in a subprocess:

    python -m tests.integration.golden MODEL_DIR OUT_DIR      # prints {step: [values of KEYS]} as JSON

Why float64: which kernels torch runs (and so the summation order of every matmul and reduction) depends on
the CPU (MKL's and ATen's dispatch by instruction set). In float32/bfloat16 the last-bit differences flip
FP8 roundings and then sampled tokens, so a run's numbers differ from CPU to CPU by percents. In float64
(trainer and rollout engine; the engine's FP8 layers then accumulate their e4m3 products exactly) the kernels'
differences stay near 1e-16 and every rounding, FP8 cast and sampled token comes out the same.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from nemo_fp8.policy.spec import PolicySpec

KEYS = ("train/reward_mean", "train/response_length_mean", "loss/loss", "loss/grad_norm", "loss/is_weight_mean",
        "mismatch/gen_kl_error")
STEPS = (1, 2, 3)
REPO = Path(__file__).resolve().parents[2]


def golden_config(model_dir: Path, out_dir: Path):
    """The shipped tiny FP8 config as the golden run uses it (dynamic sampling on, as shipped)."""
    from nemo_fp8.config import load_config

    return load_config(REPO / "examples" / "configs" / "grpo_math_tiny_fp8.yaml", [
        f"policy.model_name={model_dir}", "policy.tiny_model.build_if_missing=false",
        f"logger.log_dir={out_dir / 'logs'}", f"checkpointing.checkpoint_dir={out_dir / 'ckpt'}",
        "logger.tensorboard_enabled=false", "grpo.use_dynamic_sampling=true",
        "grpo.num_prompts_per_step=8", "grpo.num_generations_per_prompt=8",
        "policy.train_global_batch_size=32", "policy.train_micro_batch_size=16",
        "policy.weight_sync.bucket_size_mb=1"])


def golden_values(model_dir: Path, out_dir: Path) -> dict[int, tuple[float, ...]]:
    """Run ``STEPS`` GRPO steps of the golden config with one torch thread; returns step -> values of ``KEYS``."""
    from nemo_fp8.algorithms.grpo import RefitController, grpo_step
    from nemo_fp8.data import PromptDataloader
    from nemo_fp8.distributed.weight_sync import InProcessWeightSync
    from nemo_fp8.generation.torch_backend import TorchGenerationBackend
    from nemo_fp8.models.hf import load_tokenizer
    from nemo_fp8.policy.torch_backend import TorchPolicyBackend
    from nemo_fp8.rewards.math_reward import score_response
    from nemo_fp8.trainer import prepare_prompts
    from nemo_fp8.utils.timer import Timer

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        cfg = golden_config(model_dir, out_dir)
        torch.manual_seed(cfg.grpo.seed)
        tok = load_tokenizer(cfg.policy.model_name)
        train, _ = prepare_prompts(cfg, tok)
        policy = TorchPolicyBackend(PolicySpec.from_config(cfg.policy.model_copy(update={"precision": "float64"}),
                                                           torch.device("cpu"),
                                                           temperature=cfg.policy.generation.temperature))
        gen = TorchGenerationBackend(cfg.policy.model_name, cfg.policy.generation.vllm_cfg, torch.device("cpu"),
                                     tok.pad_token_id, tok.eos_token_id, cfg.policy.max_total_sequence_length,
                                     batch_size=64, dtype=torch.float64)
        refitter = RefitController(policy, gen, InProcessWeightSync(policy, gen, 2**20))
        batches = iter(PromptDataloader(train, cfg.grpo.num_prompts_per_step, seed=cfg.data.seed))

        def reward(responses, answers):  # the math reward, in this process (plain numbers need no math-verify)
            return [score_response(r, a) for r, a in zip(responses, answers)]

        out = {}
        for step in STEPS:
            m = grpo_step(step, batches, policy, gen, reward, tok, cfg, Timer(), refitter)
            out[step] = tuple(float(m[k]) for k in KEYS)
        return out
    finally:
        torch.set_num_threads(threads)


if __name__ == "__main__":
    values = golden_values(Path(sys.argv[1]), Path(sys.argv[2]))
    print(json.dumps({str(k): v for k, v in values.items()}))

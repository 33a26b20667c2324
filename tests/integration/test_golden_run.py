"""Golden run: the tiny FP8 config's first GRPO steps, pinned (torchtune-style recipe regression test).

Same seed, same tiny model (the session fixture), in-process torch backends, one torch thread:
the per-step reward, loss and mismatch must stay what they were when pinned. A change of backend,
refit, loss or sampling that alters the numbers fails here and must be explained (then re-pin:
run this file with ``NEMO_FP8_PRINT_GOLDEN=1`` and paste the printed table).
"""

import os

import pytest
import torch

from nemo_fp8.algorithms.grpo import RefitController, grpo_step
from nemo_fp8.data import PromptDataloader
from nemo_fp8.distributed.weight_sync import InProcessWeightSync
from nemo_fp8.generation.torch_backend import TorchGenerationBackend
from nemo_fp8.models.hf import load_tokenizer
from nemo_fp8.policy.torch_backend import TorchPolicyBackend
from nemo_fp8.trainer import prepare_prompts
from nemo_fp8.utils.timer import Timer

KEYS = ("train/reward_mean", "train/response_length_mean", "loss/loss", "loss/grad_norm", "loss/is_weight_mean",
        "mismatch/gen_kl_error")
# step -> values of KEYS, pinned on the 2-core CPU machine (torch 2.13.0 CPU, one thread), with the tiny
# recipe's sampling temperature 0.7, dynamic sampling and prefilled "Answer: " (responses of about 3 tokens), and
# the torch engine's prompt pass shared by a prompt's repeats (docs/first-run.md).
GOLDEN = {
    1: (0.6875, 3.203125, 0.0395701858215034, 1.9641892313957214, 1.0004940648305984, 8.290469122584909e-05),
    2: (0.734375, 3.109375, -0.05489992303773761, 2.0987234115600586, 1.0011422963518846, 0.00016872129344847053),
    3: (0.703125, 3.0, -0.06810695095919073, 2.4477678537368774, 0.9996577271901584, 0.0001409271062584594),
}


@pytest.mark.slow
def test_tiny_fp8_golden_run(tiny_cfg):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        cfg = tiny_cfg("grpo.use_dynamic_sampling=true",  # the recipe's, as shipped (conftest turns it off)
                       "grpo.num_prompts_per_step=8", "grpo.num_generations_per_prompt=8",
                       "policy.train_global_batch_size=32", "policy.train_micro_batch_size=16",
                       "policy.weight_sync.bucket_size_mb=1")
        torch.manual_seed(cfg.grpo.seed)
        tok = load_tokenizer(cfg.policy.model_name)
        train, _ = prepare_prompts(cfg, tok)
        policy = TorchPolicyBackend(cfg.policy, torch.device("cpu"), temperature=cfg.policy.generation.temperature)
        gen = TorchGenerationBackend(cfg.policy.model_name, cfg.policy.generation.vllm_cfg, torch.device("cpu"),
                                     tok.pad_token_id, tok.eos_token_id, cfg.policy.max_total_sequence_length,
                                     batch_size=64)
        refitter = RefitController(policy, gen, InProcessWeightSync(policy, gen, 2**20))
        batches = iter(PromptDataloader(train, cfg.grpo.num_prompts_per_step, seed=cfg.data.seed))
        got = {}
        # The session's tiny model barely knows arithmetic (its math reward is ~0, so no update):
        # reward even-length responses instead, so every step trains on real advantages.
        def reward(responses, answers):
            return [float(len(r) % 2 == 0) for r in responses]

        for step in GOLDEN:
            m = grpo_step(step, batches, policy, gen, reward, tok, cfg, Timer(), refitter)
            got[step] = tuple(m[k] for k in KEYS)
    finally:
        torch.set_num_threads(threads)
    if os.environ.get("NEMO_FP8_PRINT_GOLDEN"):
        print("\n".join(f"    {s}: ({', '.join(repr(v) for v in vals)})," for s, vals in got.items()))
    for step, want in GOLDEN.items():
        assert want is not None, f"pin the golden values first (NEMO_FP8_PRINT_GOLDEN=1): {got}"
        for key, g, w in zip(KEYS, got[step], want):
            assert g == pytest.approx(w, rel=1e-4, abs=1e-7), f"step {step} {key}: {g} != pinned {w}"

"""Wiring a validated config into a running GRPO job: setup -> train -> cleanup.

``run(cfg, resume)`` builds the data, the reward, the Ray actors for the policy and the
generation engine, restores a checkpoint when asked, refits the engine from the policy and
runs ``nemo_fp8.algorithms.grpo.grpo_train``. The entry point ``examples/run_grpo_math.py``
only parses arguments and calls it.
"""

from __future__ import annotations

import logging
import os
import random
from dataclasses import dataclass
from pathlib import Path

import torch

from nemo_fp8.algorithms.grpo import grpo_train, refit
from nemo_fp8.config import MasterConfig, config_to_yaml
from nemo_fp8.data import (MathExample, PromptDataloader, PromptFormatter, PromptSample, load_math_dataset,
                           make_arithmetic_problems, tokenize_prompts)
from nemo_fp8.models.hf import load_tokenizer, resolve_device
from nemo_fp8.utils.checkpoint import CheckpointManager
from nemo_fp8.utils.logger import MetricsLogger

logger = logging.getLogger(__name__)


def ensure_model(cfg: MasterConfig) -> None:
    """Build the tiny model when ``policy.model_name`` is missing and ``tiny_model.build_if_missing``.

    Raises:
        FileNotFoundError: the model folder is missing and may not be built.
    """
    path = Path(cfg.policy.model_name)
    if (path / "config.json").is_file():
        return
    tiny = cfg.policy.tiny_model
    if not tiny.build_if_missing:
        raise FileNotFoundError(f"policy.model_name: no HF checkpoint at {path} (needs config.json); set "
                                "policy.tiny_model.build_if_missing=true to build the tiny model there, or point "
                                "it at a local checkpoint")
    from nemo_fp8.models.tiny import TinyModelSpec, build_tiny_model

    logger.info("building the tiny model at %s (tools/make_tiny_model.py does the same)", path)
    build_tiny_model(path, TinyModelSpec(sft_steps=tiny.sft_steps, max_operand=tiny.max_operand, seed=tiny.seed),
                     device=str(resolve_device(cfg.policy.device)))


def load_examples(cfg: MasterConfig) -> tuple[list[MathExample], list[MathExample]]:
    """(train, validation) problems from ``data.*``; validation never overlaps training."""
    d, n_val = cfg.data, cfg.grpo.max_val_samples
    if d.dataset == "synthetic":
        val = make_arithmetic_problems(d.num_synthetic_val, seed=d.seed + 1, max_operand=d.synthetic_max_operand)
        held_out = {e.problem for e in val}
        train = [e for e in make_arithmetic_problems(d.num_synthetic_train, seed=d.seed,
                                                     max_operand=d.synthetic_max_operand) if e.problem not in held_out]
        return train, val[:n_val]
    train = load_math_dataset(d.train_path, schema=d.dataset, limit=d.max_train_samples)
    if d.val_path:
        return train, load_math_dataset(d.val_path, schema=d.dataset, limit=n_val)
    if len(train) <= n_val:
        raise ValueError(f"data.train_path has {len(train)} problems; with no data.val_path, "
                         f"grpo.max_val_samples={n_val} are held out of it (valid: fewer than {len(train)})")
    return train[:-n_val], train[-n_val:]


def prepare_prompts(cfg: MasterConfig, tokenizer) -> tuple[list[PromptSample], list[PromptSample]]:
    """Format and tokenize prompts; over-long prompts are dropped and counted."""
    d = cfg.data
    formatter = PromptFormatter(d.prompt_template, use_chat_template=d.use_chat_template, system_prompt=d.system_prompt)
    train_ex, val_ex = load_examples(cfg)
    train, dropped_t = tokenize_prompts(train_ex, tokenizer, formatter, d.max_input_seq_length)
    val, dropped_v = tokenize_prompts(val_ex, tokenizer, formatter, d.max_input_seq_length)
    logger.info("data: %d train prompts (%d dropped > %d tokens), %d validation (%d dropped)", len(train), dropped_t,
                d.max_input_seq_length, len(val), dropped_v)
    if len(train) < cfg.grpo.num_prompts_per_step or not val:
        raise ValueError(f"data: {len(train)} train / {len(val)} validation prompts left after dropping those over "
                         f"data.max_input_seq_length={d.max_input_seq_length}; need >= grpo.num_prompts_per_step="
                         f"{cfg.grpo.num_prompts_per_step} and >= 1")
    return train, val


@dataclass
class Workers:
    policy: object
    generation: object


def start_workers(cfg: MasterConfig, tokenizer) -> Workers:
    """Start Ray and one actor per backend; colocated actors share the GPU on a GPU host."""
    from nemo_fp8.distributed.workers import RemoteGeneration, RemotePolicy, init_ray, spawn
    from nemo_fp8.generation import build_generation_backend
    from nemo_fp8.policy import build_policy_backend

    device = resolve_device(cfg.policy.device)
    init_ray(cfg.cluster.address, cfg.cluster.num_cpus)
    gpus = (0.5 if cfg.policy.generation.colocated.enabled else 1.0) if device.type == "cuda" else 0.0
    threads = cfg.cluster.torch_threads_per_worker or os.cpu_count()
    gen_cfg = cfg.policy.generation
    generation = spawn(build_generation_backend, dict(
        backend=gen_cfg.backend, model_name=cfg.policy.model_name, vllm_cfg=gen_cfg.vllm_cfg, device=device,
        pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
        max_total_sequence_length=cfg.policy.max_total_sequence_length,
        batch_size=cfg.policy.generation_batch_size), num_cpus=1, num_gpus=gpus, torch_threads=threads,
        name="generation")
    policy = spawn(build_policy_backend, dict(
        megatron=cfg.policy.megatron_cfg.enabled, cfg=cfg.policy, device=device, temperature=gen_cfg.temperature,
        keep_reference=cfg.loss_fn.reference_policy_kl_penalty > 0), num_cpus=1, num_gpus=gpus,
        torch_threads=threads, name="policy")
    return Workers(RemotePolicy(policy), RemoteGeneration(generation))


def run(cfg: MasterConfig, resume: bool = False) -> dict[str, float]:
    """Run the GRPO job described by ``cfg``; returns the last step's metrics."""
    import ray

    from nemo_fp8.rewards import MathRewardScorer

    random.seed(cfg.grpo.seed)
    torch.manual_seed(cfg.grpo.seed)
    ensure_model(cfg)
    tokenizer = load_tokenizer(cfg.policy.tokenizer.name or cfg.policy.model_name)
    train, val = prepare_prompts(cfg, tokenizer)
    dataloader = PromptDataloader(train, cfg.grpo.num_prompts_per_step, seed=cfg.data.seed, shuffle=cfg.data.shuffle)
    checkpointer = CheckpointManager(cfg.checkpointing.checkpoint_dir, cfg.checkpointing.keep_last_k)
    config_yaml = config_to_yaml(cfg)
    latest = checkpointer.latest() if resume else None
    if resume and latest is None:
        logger.warning("--resume: no checkpoint under %s; starting from step 0", cfg.checkpointing.checkpoint_dir)

    workers = start_workers(cfg, tokenizer)
    start_step = 0
    if latest is not None:
        state = CheckpointManager.load_trainer_state(latest)
        workers.policy.load(latest / "policy")
        dataloader.load_state_dict(state["dataloader"])
        start_step = int(state["step"])
        logger.info("resumed from %s (step %d)", latest, start_step)
    refit(workers.policy, workers.generation)  # the engine always starts from the policy's weights

    metrics_logger = MetricsLogger(cfg.logger, cfg.model_dump(mode="json"), resume=latest is not None)
    (Path(cfg.logger.log_dir) / "config.yaml").write_text(config_yaml)
    scorer = MathRewardScorer(num_workers=cfg.env.math.num_workers, timeout_s=cfg.env.math.timeout_s)
    try:
        return grpo_train(cfg, workers.policy, workers.generation, scorer, tokenizer, dataloader, val,
                          metrics_logger, checkpointer, start_step, config_yaml)
    except KeyboardInterrupt:
        done = checkpointer.latest()
        logger.warning("interrupted; last checkpoint: %s; continue with --resume", done)
        raise
    finally:
        png = metrics_logger.close()
        if png:
            logger.info("curves: %s", png)
        scorer.close()
        ray.shutdown()

"""Preflight: checks that run before anything expensive (the model build, Ray, the actors).

``preflight(cfg)`` opens the data files and parses every record the run will read, checks the model
path (a folder with ``config.json`` and intact safetensors headers, a hub id that resolves, or an empty
or missing tiny-model build target),
compares the resources the actors will ask Ray for with what the cluster has, and the megatron
trainer's weights, gradients and optimizer state with one GPU's memory. Every error
names the file (and line) or the config key; all problems are reported at once in one
``PreflightError``.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

from nemo_fp8.config import MasterConfig
from nemo_fp8.utils.cpus import usable_cpus
from nemo_fp8.utils.run_dir import RunSetupError

logger = logging.getLogger(__name__)

class PreflightError(RunSetupError):
    """One or more preflight problems, one per line, each naming a file, line or key."""


def check_data(cfg: MasterConfig) -> list[str]:
    """Parse every record of ``data.train_path`` / ``data.val_path`` that the run will read (up to
    ``data.max_train_samples`` / ``grpo.max_val_samples``; cheap next to a run).

    Returns one line per problem (missing file, a directory / FIFO / socket / device, wrong extension, not UTF-8,
    invalid JSON, not Parquet, missing schema keys, no records at all, too many empty gold answers), each naming the
    key and the file (and line). The few rows with an empty gold answer that are dropped are logged as a warning
    (count and first rows, ``nemo_fp8.data.datasets.MAX_EMPTY_ANSWER_FRACTION``).
    """
    from nemo_fp8.data.datasets import load_math_file

    d = cfg.data
    if d.dataset == "synthetic":
        return []
    errs = []
    for key, path, limit in (("data.train_path", d.train_path, d.max_train_samples),
                             ("data.val_path", d.val_path, cfg.grpo.max_val_samples)):
        if not path:
            continue
        try:
            loaded = load_math_file(path, schema=d.dataset, limit=limit)
        except FileNotFoundError:
            errs.append(f"{key}: file not found: {path}")
            continue
        except ValueError as e:  # DatasetFormatError is a ValueError; so are bad extensions and non-files
            errs.append(f"{key}: {e}")
            continue
        if not loaded.rows:
            errs.append(f"{key}: {path} has no records (empty file)")
        elif loaded.empty_answer_rows:
            logger.warning("preflight: %s: %s: %s", key, path, loaded.dropped_note())
    return errs


def model_folder_errors(path: Path, can_build: bool) -> list[str]:
    """What keeps the HF checkpoint folder ``path`` from loading: a file, a folder without ``config.json``
    (allowed only as an empty or missing tiny-model build target, ``can_build``), no weights, or a
    safetensors file whose header or size is wrong (truncated copy or download)."""
    from nemo_fp8.utils.checkpoint import check_safetensors

    key = "policy.model_name"
    if path.is_file():
        return [f"{key}: {path} is a file; an HF checkpoint folder (config.json + weights) is needed"]
    if not (path / "config.json").is_file():
        if not can_build:
            what = "is not a folder" if not path.exists() else "has no config.json"
            return [f"{key}: {path} {what} (an HF checkpoint folder is needed); set "
                    "policy.tiny_model.build_if_missing=true to build the tiny model there, or point it at a "
                    "local checkpoint or a Hugging Face hub id"]
        if path.is_dir() and any(path.iterdir()):
            return [f"{key}: {path} is not empty but has no config.json: not a checkpoint, and the tiny model "
                    "is only built into an empty or new folder (choose another folder or empty it)"]
        parent = next((p for p in [path, *path.parents] if p.exists()), Path("."))
        if not os.access(parent, os.W_OK):
            return [f"{key}: cannot build the tiny model at {path} ({parent} is not writable)"]
        return []
    weights = sorted(path.glob("*.safetensors"))
    if not weights and not any(path.glob("*.bin")):
        return [f"{key}: {path} has config.json but no weights (*.safetensors)"]
    return [f"{key}: {f}: {why}" for f in weights if (why := check_safetensors(f)) is not None]


def folder_errors(key: str, path: Path) -> list[str]:
    """What keeps the run from writing into the folder ``path`` (``key`` names it): a file in its place, a file
    where one of its parents should be, or no write access where it is or would be created (a read-only file
    system, missing permission). Root ignores permission bits but not a read-only mount: ``os.access`` says both."""
    if path.exists() and not path.is_dir():
        return [f"{key}: {path} is a file; a folder is needed (choose another {key} or move the file)"]
    existing = next((p for p in [path, *path.parents] if p.exists()), Path("/"))
    if not existing.is_dir():
        return [f"{key}: {path} cannot be created: {existing} is a file"]
    if not os.access(existing, os.W_OK | os.X_OK):
        readonly = bool(os.statvfs(existing).f_flag & os.ST_RDONLY)
        why = "is on a read-only file system" if readonly else "is not writable (permissions)"
        what = f"{path} {why}" if existing == path else f"{path} cannot be created: {existing} {why}"
        return [f"{key}: {what}; choose another {key}"]
    return []


def check_run_folders(cfg: MasterConfig) -> None:
    """``logger.log_dir`` and (with checkpointing on) ``checkpointing.checkpoint_dir`` can be created and written
    (``folder_errors``); runs first, before the folders are locked.

    Raises:
        PreflightError: one line per folder that cannot be used, naming its key and path.
    """
    folders = [("logger.log_dir", cfg.logger.log_dir)]
    if cfg.checkpointing.enabled:
        folders.append(("checkpointing.checkpoint_dir", cfg.checkpointing.checkpoint_dir))
    errs = [e for key, path in folders for e in folder_errors(key, Path(path))]
    if errs:
        raise PreflightError("preflight failed:\n" + "\n".join(f"  - {e}" for e in errs))


def check_model(cfg: MasterConfig) -> list[str]:
    """``policy.model_name`` is an HF folder (or may be built there) or a hub id that resolves
    (``nemo_fp8.models.hub``); ``policy.tokenizer.name`` likewise when it is a local path or hub id."""
    from nemo_fp8.models.hub import (TINY_BUILD_HINT, ModelNotFoundError, is_hub_id, is_tiny_build_target,
                                     resolve_hub_model)

    pol = cfg.policy
    can_build = is_tiny_build_target(pol.model_name, pol.tiny_model.build_if_missing)
    if is_hub_id(pol.model_name) and not can_build:
        try:
            path = resolve_hub_model(pol.model_name)
        except ModelNotFoundError as e:
            return [f"{e} ({TINY_BUILD_HINT})" if pol.tiny_model.build_if_missing else str(e)]
    else:
        path = Path(pol.model_name)
    errs = model_folder_errors(path, can_build)
    tok = pol.tokenizer.name
    if tok and is_hub_id(tok):
        try:
            resolve_hub_model(tok)
        except ModelNotFoundError as e:
            errs.append(str(e).replace("policy.model_name", "policy.tokenizer.name"))
    elif tok and (tok.startswith((".", "/")) or Path(tok).exists()) and not Path(tok).is_dir():
        errs.append(f"policy.tokenizer.name: {tok} is not a folder")
    return errs


def check_pipeline_layers(cfg: MasterConfig) -> list[str]:
    """With pipeline parallelism, the model's decoder layers (``num_hidden_layers`` of ``policy.model_name``'s
    ``config.json``) split evenly over ``pipeline_model_parallel_size`` stages x ``virtual_pipeline_model_parallel_size``
    chunks, as megatron-core builds them (``get_num_layers_to_build``; the torch backend's stages split them the same
    way, ``nemo_fp8.distributed.pipeline.stage_layers``). Nothing to check without a local config."""
    m = cfg.policy.megatron_cfg
    pp, vpp = m.pipeline_model_parallel_size, m.virtual_pipeline_model_parallel_size or 1
    path = Path(cfg.policy.model_name) / "config.json"
    if pp == 1 or not path.is_file():
        return []
    try:
        layers = int(json.loads(path.read_text())["num_hidden_layers"])
    except (ValueError, KeyError, TypeError):
        return []  # model_folder_errors names a broken config.json
    if layers % (pp * vpp) == 0:
        return []
    valid = [d for d in range(1, layers + 1) if layers % d == 0]
    return [f"policy.megatron_cfg.pipeline_model_parallel_size: {pp} stages x virtual_pipeline_model_parallel_size "
            f"{m.virtual_pipeline_model_parallel_size} chunks do not split the {layers} decoder layers of {path} "
            f"evenly; stages x chunks must divide {layers}: one of {valid}"]


def with_local_model(cfg: MasterConfig) -> MasterConfig:
    """``cfg`` with a hub id in ``policy.model_name`` / ``policy.tokenizer.name`` replaced by its local snapshot
    folder (what the actors load); other configs unchanged. Call after ``preflight`` (which resolved them)."""
    from nemo_fp8.models.hub import is_hub_id, is_tiny_build_target, resolve_hub_model

    pol, update = cfg.policy, {}
    if is_hub_id(pol.model_name) and not is_tiny_build_target(pol.model_name, pol.tiny_model.build_if_missing):
        update["model_name"] = str(resolve_hub_model(pol.model_name))
    if pol.tokenizer.name and is_hub_id(pol.tokenizer.name):
        update["tokenizer"] = pol.tokenizer.model_copy(update={"name": str(resolve_hub_model(pol.tokenizer.name))})
    return cfg.model_copy(update={"policy": pol.model_copy(update=update)}) if update else cfg


def required_resources(cfg: MasterConfig) -> dict[str, float]:
    """Ray resources the run's actors ask for, ``{"CPU": n, "GPU": g}``: the placement plan of
    ``nemo_fp8.distributed.placement.plan_from_config`` that ``trainer.start_workers`` reserves.

    Raises:
        ValueError: engines that do not fit the policy's GPUs (``plan_cluster``).
    """
    import torch

    from nemo_fp8.distributed.placement import plan_from_config

    # policy.device=cuda without a GPU is config_support_errors' line; here it only sizes the plan
    cuda = cfg.policy.device == "cuda" or (cfg.policy.device == "auto" and torch.cuda.is_available())
    need = plan_from_config(cfg.policy, cfg.cluster, cuda).required()
    return {"CPU": need.get("CPU", 0.0), "GPU": need.get("GPU", 0.0)}


def idle_gpus_warning(cfg: MasterConfig, need: dict[str, float]) -> str | None:
    """A line when the actors (``need``: ``required_resources``) take fewer GPUs than ``cluster.gpus_per_node x
    cluster.num_nodes`` declares, naming the ``policy.data_parallel_size`` that would use them all; None when
    they take them all, or no GPU count is declared. A warning, not an error: a smaller run on a large node is
    allowed, but a config that declares a node and trains on part of it is usually a missing data parallel size
    (NeMo-RL derives data parallelism from the cluster's GPUs)."""
    declared = cfg.cluster.gpus_per_node * cfg.cluster.num_nodes
    used = int(need.get("GPU", 0))
    if not declared or not used or used >= declared:
        return None
    p = cfg.policy
    model_parallel = p.tensor_parallel_size * p.pipeline_parallel_size
    fix = (f"; policy.data_parallel_size={declared // model_parallel} uses them all"
           if p.generation.colocated.enabled and declared % model_parallel == 0 else "")
    engines = "engines colocated" if p.generation.colocated.enabled else "the engines on GPUs of their own"
    pipeline = f" x pipeline parallel {p.pipeline_parallel_size}" if p.pipeline_parallel_size > 1 else ""
    return (f"cluster.gpus_per_node x cluster.num_nodes: {declared} GPUs declared, the run uses {used} "
            f"(policy.data_parallel_size={p.data_parallel_size} x tensor parallel {p.tensor_parallel_size}{pipeline}, "
            f"{engines}){fix}")


def available_resources(cfg: MasterConfig) -> dict[str, float] | None:
    """What a local Ray started with ``cluster.num_cpus`` will have (default: the CPUs this process may run on,
    :func:`nemo_fp8.utils.cpus.usable_cpus`, as ``init_ray`` starts it; None: joining a cluster, unknown before
    connecting; ``check_cluster`` compares after ``ray.init``)."""
    if cfg.cluster.address:
        return None
    import torch

    return {"CPU": float(cfg.cluster.num_cpus or usable_cpus()),
            "GPU": float(torch.cuda.device_count() if torch.cuda.is_available() else 0)}


def compare_resources(need: dict[str, float], have: dict[str, float], cfg: MasterConfig) -> list[str]:
    """Lines for each resource the actors need more of than the cluster has."""
    errs = []
    if need.get("CPU", 0) > have.get("CPU", 0):
        errs.append(f"cluster.num_cpus: the actors need {need['CPU']:g} CPUs (one per rollout engine, "
                    "policy.generation.num_engines, default one per policy rank on CPU, + one per policy rank, "
                    f"policy.world_size={cfg.policy.world_size}: data parallel x tensor parallel x pipeline stages) "
                    f"but the cluster has "
                    f"{have.get('CPU', 0):g}; Ray would wait forever (valid: >= {need['CPU']:g})")
    per_node, nodes = cfg.cluster.gpus_per_node, cfg.cluster.num_nodes
    if per_node and need.get("GPU", 0) > per_node * nodes:
        errs.append(f"cluster.num_nodes x cluster.gpus_per_node: the actors need {need['GPU']:g} GPUs (policy ranks, "
                    f"plus engines on GPUs of their own) but {nodes} x {per_node} = {nodes * per_node} are declared")
    if need.get("GPU", 0) > have.get("GPU", 0):
        errs.append(f"policy.device: the actors need {need['GPU']:g} GPUs (one per policy rank, plus "
                    "policy.generation.vllm_cfg.tensor_parallel_size for an engine that is not colocated) but the "
                    f"cluster has {have.get('GPU', 0):g}")
    return errs


def check_resources(cfg: MasterConfig) -> list[str]:
    """The placement plan's errors (engines that do not fit), else what the actors need against what a local Ray
    will have."""
    try:
        need = required_resources(cfg)
    except ValueError as e:
        return [str(e)]
    have = available_resources(cfg)
    return [] if have is None else compare_resources(need, have, cfg)


def check_cluster(cfg: MasterConfig) -> None:
    """After ``ray.init``: the cluster's resources against ``required_resources``.

    Raises:
        PreflightError: the cluster cannot place the actors.
    """
    import ray

    have = {k: float(v) for k, v in ray.cluster_resources().items()}
    errs = compare_resources(required_resources(cfg), have, cfg)
    if errs:
        raise PreflightError("preflight failed:\n" + "\n".join(f"  - {e}" for e in errs))


def gpu_total_bytes() -> int | None:
    """Total memory of GPU 0 from ``nvidia-smi`` (None without it). Not through torch: that would make a
    CUDA context in the driver process, memory the engine and trainer then lack."""
    import shutil
    import subprocess

    if shutil.which("nvidia-smi") is None:
        return None
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=memory.total", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=20, check=True).stdout
        return int(out.split()[0]) * 2**20  # MiB
    except (subprocess.SubprocessError, OSError, ValueError, IndexError):
        return None


def trainer_memory_checks(cfg: MasterConfig, gpu_bytes: int | None = None,
                          host_bytes: int | None = None) -> tuple[list[str], list[str]]:
    """(errors, warnings) of the megatron trainer's memory (``nemo_fp8.policy.megatron.memory``), from one read
    of the checkpoint's headers and of the GPU's size. Errors: its weights, gradients and optimizer state against
    one GPU's memory, and its optimizer state in host memory against this machine's (``trainer_memory_errors``).
    Warnings: its backward pass (state, gradients, FP8 weight copies, the micro-batch's
    activations, an estimate) against one GPU's memory (``activation_memory_warnings``; needs the checkpoint's
    ``config.json``). Skipped without the megatron backend, a local safetensors checkpoint at
    ``policy.model_name`` or a GPU (``gpu_bytes`` None: ``gpu_total_bytes``; ``host_bytes`` None:
    ``host_total_bytes``)."""
    from nemo_fp8.policy.megatron.memory import (activation_memory_warnings, checkpoint_parameter_counts,
                                                 checkpoint_shape, trainer_memory_errors)

    if not cfg.policy.megatron_cfg.enabled or cfg.cluster.address:
        return [], []
    try:
        n, matrices = checkpoint_parameter_counts(cfg.policy.model_name)
    except FileNotFoundError:  # no local safetensors checkpoint (yet): nothing to estimate from
        return [], []
    except ValueError as e:
        return [f"policy.model_name: {e}"], []
    gpu_bytes = gpu_bytes if gpu_bytes is not None else gpu_total_bytes()
    if not gpu_bytes:
        return [], []
    errs = trainer_memory_errors(cfg.policy, gpu_bytes, n, host_bytes, matrices)
    shape = checkpoint_shape(cfg.policy.model_name)
    return errs, activation_memory_warnings(cfg.policy, gpu_bytes, n, shape, matrices) if shape else []


def check_trainer_memory(cfg: MasterConfig, gpu_bytes: int | None = None, host_bytes: int | None = None) -> list[str]:
    """The errors of ``trainer_memory_checks``."""
    return trainer_memory_checks(cfg, gpu_bytes, host_bytes)[0]


def activation_warnings(cfg: MasterConfig, gpu_bytes: int | None = None) -> list[str]:
    """The warnings of ``trainer_memory_checks``."""
    return trainer_memory_checks(cfg, gpu_bytes)[1]


def schedule_warnings(cfg: MasterConfig) -> list[str]:
    """The learning-rate schedule's parts this run never reaches (``policy.schedule.schedule_warnings``), each
    naming its key: the optimizer of the backend that trains (``policy.megatron_cfg.optimizer`` or
    ``policy.optimizer``) over ``grpo.max_num_steps`` x the optimizer updates of one step."""
    from nemo_fp8.policy.schedule import schedule_warnings as warnings_for

    pol = cfg.policy
    key, o = (("policy.megatron_cfg.optimizer", pol.megatron_cfg.optimizer) if pol.megatron_cfg.enabled
              else ("policy.optimizer", pol.optimizer))
    per_step = max(1, cfg.grpo.num_prompts_per_step * cfg.grpo.num_generations_per_prompt
                   // pol.train_global_batch_size)
    lines = warnings_for(cfg.grpo.max_num_steps * per_step, o.lr, warmup_steps=o.lr_warmup_steps,
                         init_lr=o.lr_warmup_init, decay_style=o.lr_decay_style, decay_steps=o.lr_decay_steps,
                         min_lr=o.min_lr, wsd_decay_steps=o.wsd_decay_steps, wsd_decay_style=o.lr_wsd_decay_style)
    return [f"{key}.{line} (grpo.max_num_steps={cfg.grpo.max_num_steps} x {per_step} per step)" for line in lines]


#: The trajectory age above which the preflight warns. NeMo-RL's async GRPO guide sets 1; each step of age is one
#: more step of rollouts held in the driver and one more update between the weights that sampled a rollout and
#: the ones it trains, which the truncated importance weights (C = 2 in the shipped recipes) correct less and less.
#: Past 8 the value is more likely a typo or "no limit" than a choice. A warning, not an error: a study of
#: staleness may want it.
USUAL_MAX_TRAJECTORY_AGE = 8

#: Bytes the trajectory buffer keeps per token of a rollout: the engine output's token id (int64) and log-prob
#: (float32), and the training rows' copy of both (``StepRollouts.rollouts`` and ``.parts``).
BUFFER_BYTES_PER_TOKEN = 2 * (8 + 4)


def _size(n: float) -> str:
    return f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def async_age_warning(cfg: MasterConfig) -> str | None:
    """A line when ``grpo.async_grpo.max_trajectory_age_steps`` is above ``USUAL_MAX_TRAJECTORY_AGE`` with
    asynchronous GRPO on: how stale a rollout may get, and the driver memory of the trajectory buffer, whose
    capacity is age + 1 steps (at most ``grpo.max_num_steps`` of them are ever made) of ``num_prompts_per_step x
    num_generations_per_prompt`` rollouts (x ``dynamic_sampling_max_gen_batches`` rounds with dynamic sampling) of
    up to the prompt limit + ``max_new_tokens`` tokens, ``BUFFER_BYTES_PER_TOKEN`` each. None otherwise."""
    a, g = cfg.grpo.async_grpo, cfg.grpo
    age = a.max_trajectory_age_steps
    if not a.enabled or a.wait_for_current_weights or age <= USUAL_MAX_TRAJECTORY_AGE:
        return None
    total = cfg.policy.max_total_sequence_length
    tokens = min(total, min(cfg.data.max_input_seq_length, total - 1) + cfg.policy.generation.max_new_tokens)
    rounds = g.dynamic_sampling_max_gen_batches if g.use_dynamic_sampling else 1
    rows = g.num_prompts_per_step * g.num_generations_per_prompt
    held = min(age + 1, g.max_num_steps)
    bytes_held = held * rounds * rows * tokens * BUFFER_BYTES_PER_TOKEN
    by_rounds = f" x {rounds} generation rounds (dynamic sampling)" if rounds > 1 else ""
    return (f"grpo.async_grpo.max_trajectory_age_steps: {age} lets a rollout train up to {age} steps after the "
            f"weights that made it, and the trajectory buffer hold up to {age + 1} steps of rollouts: with "
            f"grpo.max_num_steps={g.max_num_steps}, at most {held} steps{by_rounds} x {rows} rollouts x {tokens} "
            f"tokens x {BUFFER_BYTES_PER_TOKEN} bytes = {_size(bytes_held)} in the driver process (valid: >= 1; "
            f"NeMo-RL's guide uses 1, and this warning comes above {USUAL_MAX_TRAJECTORY_AGE})")


def preflight(cfg: MasterConfig) -> None:
    """Hardware/engine support, data, model and resources checks, before the model build and Ray.

    Raises:
        PreflightError: lists every problem, each naming its key and file (and line).
    """
    from nemo_fp8.env_check import config_support_errors

    # What this machine cannot run (FP8 kernels, engines, CUDA): tools/check_env.py shows why.
    errs = config_support_errors(cfg) + check_data(cfg) + check_model(cfg) + check_resources(cfg) \
        + check_pipeline_layers(cfg)
    memory_warnings = []
    if not errs:  # the model folder and resources are fine: is the trainer's state smaller than a GPU?
        errs, memory_warnings = trainer_memory_checks(cfg)
    if errs:
        raise PreflightError("preflight failed:\n" + "\n".join(f"  - {e}" for e in errs))
    need = required_resources(cfg)
    idle = idle_gpus_warning(cfg, need)
    if idle:
        logger.warning("preflight: %s", idle)
    for line in memory_warnings + schedule_warnings(cfg) + [w for w in (async_age_warning(cfg),) if w]:
        logger.warning("preflight: %s", line)
    logger.info("preflight: data, model path, resources (%s) and trainer memory ok", need)

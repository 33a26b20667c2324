"""What the megatron trainer's weights, gradients and optimizer state take on each GPU at the optimizer step.

Pure arithmetic on the config and the checkpoint's parameter count (safetensors headers, nothing
loaded): the preflight refuses a layout whose state cannot fit before Ray, vLLM or Megatron start.
That state is a lower bound of the trainer's memory: activations, logits, TransformerEngine's FP8 weight
copies and the colocated engine's memory come on top. A training pass's backward (the state, its gradients and
FP8 copies, one micro-batch's activations from the model's shape: ``activation_bytes``) gets a warning where it
may not fit (``activation_memory_warnings``).

Bytes per parameter, megatron-core 0.18's distributed optimizer with TransformerEngine 2.11's FusedAdam
(``megatron/core/optimizer/distrib_optimizer.py``, ``transformer_engine/pytorch/optimizers/fused_adam.py``):

* every data-parallel rank: the weights (2 in bf16/fp16, 1 with ``fp8_param``) and the gradient
  buffer (4 with ``grad_reduce_in_fp32``, else 2);
* sharded over data parallel (the distributed optimizer; replicated without it):
  standard Adam: fp32 main params 4 + fp32 moments 8, plus an fp32 copy of the gradient shard 4
  when the buffer is 16-bit (``shard_main_param.grad = shard_model_grad.float()``);
  precision-aware Adam without FP8 training: main params 2 (``store_param_remainders``: the 16
  bits bf16 weights lack) or 4, the moments in their dtypes, no gradient copy (``decoupled_grad``);
  with FP8 training (a recipe other than delayed scaling) megatron-core keeps the standard fp32 main
  params and gradient copy and FusedAdam only the moments. Either way, during the step an fp32 copy
  of every 16-bit moment of the whole parameter group: FusedAdam's ``step`` unscales them all
  (``get_unscaled_state``) before its one multi-tensor kernel. 16-bit moments shrink the state
  between steps, hardly its peak;
  SGD: main params 4 + momentum 4 (+ the gradient copy);
  optimizer CPU offload (``optimizer_cpu_offload``, megatron-core's ``HybridDeviceOptimizer`` in
  ``megatron/core/optimizer/cpu_offloading``, with the precision-aware optimizer, so megatron-core keeps
  no main params of its own): the fraction ``f = optimizer_offload_fraction`` of the parameters has fp32
  main params, fp32 moments and a pinned fp32 gradient copy in host memory (16 bytes each on the host),
  the rest fp32 main params + moments on the GPU (12) plus an fp32 copy of a 16-bit gradient (4).

TransformerEngine's FP8 weight copies (FP8 training without ``fp8_param``): each FP8 linear keeps its weight
quantized for the forward (rowwise) and for the backward's data gradient (columnwise) between micro-batches,
2 bytes per parameter of the decoder layers' weight matrices (``checkpoint_parameter_counts``; embeddings, output
layer, norms and MoE routers stay BF16), divided by tensor parallelism. On the 8B mission layout (tensor parallel
2) the FP8 trainer's peak allocation was 55.7 GiB against this module's 45.8 GiB of state without them
(``docs/performance.md``, the 4-GPU mission); with them, 52.2 GiB, and the rest is activations. At tensor
parallel 1 they are 12.9 GiB for Qwen3-8B: a layout that would otherwise pass on an 80 GB GPU and run out of
memory in its first step. With megatron-core's ``disable_parameter_transpose_cache``
(``override_transformer_config``) TE keeps no such cache: each forward quantizes its weights afresh (reading the
bf16 weights once more per micro-batch: by its bytes about 1% of an 8B pass of 16,384 tokens), so with activation
checkpointing only the layer being recomputed holds FP8 copies (about 0.4 GiB for Qwen3-8B, inside the recompute
working set) and the estimate counts none; without checkpointing every layer saves its copy for the backward and
they count in full.

Model parallelism divides all of it: tensor parallelism splits every matrix, pipeline parallelism
(``pipeline_model_parallel_size`` P) gives each stage 1/P of the decoder layers, the first stage the embedding and
the last the output layer. For a model with untied embeddings (Llama-3.1-8B: 0.53B each, 7.0B in the layers) the
two ends weigh the same and every stage holds about 1/P of the parameters, what the estimate counts; with tied
embeddings the last stage holds a copy of the embedding too (megatron-core), which the estimate leaves out.

Host memory (``TrainerMemory.host``): the optimizer CPU offload's part, plus, when the engine is
colocated, what the backend moves out of the GPU around every generation: the weights (megatron-core's
pinned ``param_data_cpu``, ``offload_after_refit``; the gradient buffer is freed, not copied) and,
without the optimizer CPU offload, the optimizer state kept on the GPU during training (the moments,
into a pinned host arena, ``offload_before_refit``). With the offload the GPU share of the state stays
on the GPU: moved out as well, an 8B trainer's state with half offloaded does not fit a 125 GiB host
(Ray's memory monitor kills the trainer).

Why the estimate counts FusedAdam's fp32 copies: an 8B trainer with bf16 moments and a bf16 gradient buffer
on one 141 GiB GPU runs out of memory inside FusedAdam's step, BF16 or FP8 training alike. Besides PyTorch's
allocator the trainer process holds about 7.8 GiB (CUDA context, cuBLAS, NCCL, TransformerEngine
workspaces): ``NON_TORCH_BYTES``. The runs behind these numbers: docs/multi-gpu.md, docs/results/README.md.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass, field
from pathlib import Path

from nemo_fp8.policy.config import PolicyConfig

GiB = 2**30
# The trainer process's GPU memory outside PyTorch's allocator, 8B model (see the module docstring).
NON_TORCH_BYTES = int(7.8 * GiB)
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}  # optimizer.exp_avg_dtype / exp_avg_sq_dtype names
REBUILT_PARTS = ("grads", "fp8_weight_copies", "unscaled_moments")  # made anew by every step (between_steps)
# One training micro-batch's activations with activation_checkpointing (megatron-core recomputes every layer), bytes
# per token: each layer's input kept for its recompute (layers x hidden x 2, bf16), the logits and their gradient
# (vocab x 2 x 2: the fused log-prob kernel keeps no fp32 copy of either) and one layer's recompute working set,
# RECOMPUTE_BYTES_PER_HIDDEN x hidden: what the other two leave of the measured peak of a BF16 run at 16,384-token
# micro-batches, checked against an FP8 run at 4,096 (docs/multi-gpu.md gives the runs and their numbers).
RECOMPUTE_BYTES_PER_HIDDEN = 145
# Without checkpointing each layer keeps its activations: 34 x hidden bytes per token in 16 bits (Korthikanti et al.
# 2022, "Reducing Activation Recomputation in Large Transformer Models", eq. 1 without the attention scores, which
# flash attention does not store)
LAYER_BYTES_PER_HIDDEN = 34
# What PyTorch's allocator reserved above its peak allocation in that BF16 run (docs/multi-gpu.md)
ALLOCATOR_SLACK = 0.09


@dataclass(frozen=True)
class TrainerMemory:
    """Per-GPU bytes of the trainer's state at the optimizer step (``estimate_trainer_memory``).

    Attributes:
        parameters: the whole model's parameter count.
        per_gpu: bytes per GPU, weights + gradients + optimizer state at the step's peak.
        parts: name -> bytes per GPU (``weights``, ``grads``, ``main_params``, ``moments``,
            ``grad_copy``, ``unscaled_moments``), the terms of ``per_gpu``.
        bytes_per_param: name -> bytes per parameter before dividing over the ranks.
    """

    parameters: int
    per_gpu: float
    parts: dict[str, float] = field(default_factory=dict)
    bytes_per_param: dict[str, float] = field(default_factory=dict)
    host: float = 0.0

    def backward_peak(self, activations: float) -> float:
        """Bytes per GPU in a training pass's backward: the state between steps, the gradient buffer and TE's FP8
        weight copies made again, and ``activations`` (``activation_bytes``); Adam's temporaries come later, at the
        step (``per_gpu``)."""
        rebuilt = self.parts.get("grads", 0.0) + self.parts.get("fp8_weight_copies", 0.0)
        return self.between_steps + rebuilt + activations

    @property
    def between_steps(self) -> float:
        """Bytes per GPU that stay while a colocated engine runs beside the trainer (``offload_trainer=false``): the
        state less what each step makes anew (``REBUILT_PARTS``: the gradient buffer and TransformerEngine's FP8
        weight copies, freed before the engine wakes, ``release_cached_memory``; FusedAdam's fp32 copies of 16-bit
        moments, which live only inside the optimizer step)."""
        return self.per_gpu - sum(self.parts.get(k, 0.0) for k in REBUILT_PARTS)

    def describe(self) -> str:
        """``'18.0 B/param: weights 2, grads 2, ... -> 137.3 GiB per GPU'`` (and the host part, if any)."""
        total = sum(self.bytes_per_param.values())
        terms = ", ".join(f"{k} {v:g}" for k, v in self.bytes_per_param.items() if v)
        host = f", {self.host / GiB:.1f} GiB in host memory" if self.host else ""
        return f"{total:g} B/param ({terms}) -> {self.per_gpu / GiB:.1f} GiB per GPU{host}"


def estimate_trainer_memory(num_parameters: int, cfg: PolicyConfig, fp8_weight_params: int = 0) -> TrainerMemory:
    """Bytes per GPU of the megatron trainer's weights, gradients and optimizer state at the optimizer step.

    Args:
        num_parameters: the model's parameter count (``checkpoint_parameter_counts``).
        cfg: the policy config (``megatron_cfg``: optimizer, DDP, ``fp8_param``, tensor and pipeline parallel
            sizes; ``data_parallel_size``).
        fp8_weight_params: parameters of the decoder layers' weight matrices (``checkpoint_parameter_counts``):
            with FP8 training and no ``fp8_param``, TransformerEngine's FP8 copies of them count 2 bytes each
            (``fp8_weight_copies``, module docstring); 0 leaves them out.

    Returns:
        TrainerMemory: per GPU; tensor and pipeline parallelism divide everything, data parallelism the optimizer
        state (with the distributed optimizer); ``host``: bytes of host memory per rank (the optimizer
        CPU offload and, colocated with ``offload_trainer``, the state moved out around generation).
        Formulas and sources: the module docstring.
    """
    m = cfg.megatron_cfg
    o = m.optimizer
    tp, dp = m.tensor_model_parallel_size * m.pipeline_model_parallel_size, cfg.data_parallel_size  # model parallel
    grad = 4 if m.distributed_data_parallel_config.grad_reduce_in_fp32 else 2
    per_param = {"weights": 1 if m.fp8_cfg.fp8_param else 2, "grads": grad}
    grad_copy = 4 if grad != 4 else 0
    moments = ([DTYPE_BYTES[o.exp_avg_dtype], DTYPE_BYTES[o.exp_avg_sq_dtype]]
               if o.use_precision_aware_optimizer else [4, 4])
    unscaled = sum(4 for b in moments if b < 4)
    host_per_param = 0.0
    if o.optimizer_cpu_offload:  # HybridDeviceOptimizer: fp32 params + moments (+ fp32 gradient) per device part
        f = o.optimizer_offload_fraction
        opt = {"main_params": 4 * (1 - f), "moments": 8 * (1 - f), "grad_copy": grad_copy * (1 - f)}
        host_per_param = 16 * f
    elif o.optimizer == "sgd":
        opt = {"main_params": 4, "moments": 4, "grad_copy": grad_copy}
    elif o.use_precision_aware_optimizer and not m.fp8_cfg.enabled:
        # megatron-core's use_precision_aware_optimizer_no_fp8_or_ds_fp8: FusedAdam holds the main params
        opt = {"main_params": 2 if o.bf16 else 4, "moments": sum(moments), "unscaled_moments": unscaled}
    else:  # standard Adam, or precision-aware with FP8 training (tensorwise / blockwise): megatron-core's fp32
        # main params and the gradient's fp32 copy, FusedAdam's moments in their dtypes
        opt = {"main_params": 4, "moments": sum(moments), "grad_copy": grad_copy, "unscaled_moments": unscaled}
    shard = dp if o.use_distributed_optimizer else 1
    parts = {k: num_parameters / tp * v for k, v in per_param.items()}
    parts.update({k: num_parameters / tp / shard * v for k, v in opt.items()})
    copies = 2 * fp8_weight_params if m.fp8_cfg.enabled and not m.fp8_cfg.fp8_param else 0
    if copies and m.activation_checkpointing and fp8_weights_uncached(cfg):
        copies = 0  # each layer quantizes its weights afresh, one layer's copies at a time (module docstring)
    if copies:  # rowwise + columnwise FP8 weights of every TE linear, kept between micro-batches
        parts["fp8_weight_copies"] = copies / tp
        per_param["fp8_weight_copies"] = copies / num_parameters
    moved = cfg.generation.colocated.moves_trainer_state  # to host around each generation (module docstring)
    arena = opt["moments"] if moved and not o.optimizer_cpu_offload else 0
    weights_out = per_param["weights"] if moved else 0
    return TrainerMemory(num_parameters, sum(parts.values()), parts, {**per_param, **opt},
                         host=num_parameters / tp / shard * (host_per_param + arena) + num_parameters / tp * weights_out)


def fp8_weights_uncached(cfg: PolicyConfig) -> bool:
    """True when megatron-core passes TransformerEngine no ``is_first_microbatch``
    (``override_transformer_config.disable_parameter_transpose_cache``): every forward quantizes its FP8 weights
    afresh and keeps no copy between micro-batches."""
    return bool(cfg.megatron_cfg.override_transformer_config.get("disable_parameter_transpose_cache", False))


def train_mb_tokens(cfg: PolicyConfig) -> int:
    """Tokens of one training micro-batch: ``sequence_packing.train_mb_tokens`` when packing, else
    ``train_micro_batch_size`` rows of ``max_total_sequence_length``."""
    if cfg.sequence_packing.enabled:
        return cfg.sequence_packing.train_mb_tokens
    return cfg.train_micro_batch_size * cfg.max_total_sequence_length


def activation_bytes(cfg: PolicyConfig, layers: int, hidden: int, vocab: int, tokens: int | None = None) -> float:
    """Bytes per GPU of one training micro-batch's activations (module constants ``RECOMPUTE_BYTES_PER_HIDDEN``,
    ``LAYER_BYTES_PER_HIDDEN``: with and without ``activation_checkpointing``), divided by tensor parallelism.

    Args:
        cfg: the policy config (``megatron_cfg.activation_checkpointing``, tensor parallelism, the micro-batch).
        layers, hidden, vocab: the model's ``num_hidden_layers``, ``hidden_size``, ``vocab_size``.
        tokens: the micro-batch's tokens (default: ``train_mb_tokens(cfg)``).

    Returns:
        float: bytes; an estimate calibrated on Qwen3-8B (the constants' sources).
    """
    m = cfg.megatron_cfg
    tokens = train_mb_tokens(cfg) if tokens is None else tokens
    per_layer = 2 if m.activation_checkpointing else LAYER_BYTES_PER_HIDDEN
    recompute = RECOMPUTE_BYTES_PER_HIDDEN if m.activation_checkpointing else 0
    per_token = layers * hidden * per_layer + 4 * vocab + recompute * hidden
    return tokens * per_token / m.tensor_model_parallel_size


def checkpoint_shape(model_dir: str | Path) -> tuple[int, int, int] | None:
    """(``num_hidden_layers``, ``hidden_size``, ``vocab_size``) of an HF checkpoint folder's ``config.json``; None
    when it has no such file or keys (a multimodal config nests them)."""
    path = Path(model_dir) / "config.json"
    try:
        c = json.loads(path.read_text())
        return int(c["num_hidden_layers"]), int(c["hidden_size"]), int(c["vocab_size"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def activation_memory_warnings(cfg: PolicyConfig, gpu_bytes: int, num_parameters: int,
                               shape: tuple[int, int, int], fp8_weight_params: int = 0) -> list[str]:
    """One line when a training pass's backward (``TrainerMemory.backward_peak`` with ``activation_bytes``), with
    the allocator's slack (``ALLOCATOR_SLACK``) and ``NON_TORCH_BYTES``, may not fit ``gpu_bytes``: the estimate, the
    largest ``train_mb_tokens`` that would (packing on) and the other keys that make room. A warning, not an error:
    the activations are an estimate. Empty for pipeline parallelism (stages hold different micro-batch counts)."""
    if cfg.megatron_cfg.pipeline_model_parallel_size > 1:
        return []
    est = estimate_trainer_memory(num_parameters, cfg, fp8_weight_params)
    act = activation_bytes(cfg, *shape)
    peak = est.backward_peak(act)
    if peak * (1 + ALLOCATOR_SLACK) + NON_TORCH_BYTES <= gpu_bytes:
        return []
    tokens = train_mb_tokens(cfg)
    room = (gpu_bytes - NON_TORCH_BYTES) / (1 + ALLOCATOR_SLACK) - est.backward_peak(0.0)
    fit = int(room / (act / tokens)) // 1024 * 1024 if room > 0 else 0
    hints = []
    if cfg.sequence_packing.enabled and fit >= cfg.max_total_sequence_length:
        hints.append(f"policy.sequence_packing.train_mb_tokens <= {fit:,} (now {tokens:,})")
    if not cfg.megatron_cfg.activation_checkpointing:
        hints.append("policy.megatron_cfg.activation_checkpointing=true")
    if est.parts.get("fp8_weight_copies") and cfg.megatron_cfg.activation_checkpointing:
        hints.append("policy.megatron_cfg.override_transformer_config.disable_parameter_transpose_cache=true "
                     f"(no FP8 weight copies kept: {est.parts['fp8_weight_copies'] / GiB:.1f} GiB)")
    if not cfg.megatron_cfg.train_expandable_segments and cfg.weight_sync.method == "cuda_ipc":
        hints.append("policy.megatron_cfg.train_expandable_segments=true (less of the slack)")
    return [f"policy.sequence_packing.train_mb_tokens: a training pass of {tokens:,} tokens may run out of GPU memory: "
            f"its backward holds about {peak / GiB:.1f} GiB ({est.backward_peak(0.0) / GiB:.1f} of state, gradients"
            f"{' and FP8 weight copies' if est.parts.get('fp8_weight_copies') else ''}, {act / GiB:.1f} of "
            f"activations), with the allocator's ~{ALLOCATOR_SLACK:.0%} above its peak and "
            f"~{NON_TORCH_BYTES / GiB:.1f} GiB outside PyTorch more than the GPU's {gpu_bytes / GiB:.1f} GiB"
            + (f"; {'; '.join(hints)}" if hints else "")]


def _is_decoder_matrix(name: str, shape: list[int]) -> bool:
    """A decoder layer's 2-D weight that TransformerEngine trains in FP8: not a norm, not an MoE router."""
    return ".layers." in name and len(shape) == 2 and "norm" not in name and not name.endswith("mlp.gate.weight")


def checkpoint_parameter_counts(model_dir: str | Path) -> tuple[int, int]:
    """(all parameters, those of the decoder layers' weight matrices) of an HF checkpoint folder, from its
    safetensors headers (no tensor is read). The second count is what FP8 training quantizes (the
    ``fp8_weight_params`` of ``estimate_trainer_memory``).

    Raises:
        FileNotFoundError: no ``*.safetensors`` file in ``model_dir``.
        ValueError: a file whose header is not safetensors (names the file).
    """
    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{model_dir}: no *.safetensors file")
    total = matrices = 0
    for f in files:
        with open(f, "rb") as fh:
            raw = fh.read(8)
            try:
                (n,) = struct.unpack("<Q", raw)
                header = json.loads(fh.read(n))
            except (struct.error, ValueError, UnicodeDecodeError) as e:
                raise ValueError(f"{f}: not a safetensors file ({e})") from None
        for name, meta in header.items():
            if name != "__metadata__":
                count = 1
                for d in meta["shape"]:
                    count *= d
                total += count
                matrices += count if _is_decoder_matrix(name, meta["shape"]) else 0
    return total, matrices


# Share of the machine's memory the trainer's state in host memory may take: the rest is for Ray's object store,
# the engine's and the trainer's processes, and the checkpoint being read.
HOST_OFFLOAD_SHARE = 0.75


def host_total_bytes() -> int:
    """This machine's physical memory in bytes (``sysconf``; 0 where it is not available)."""
    import os

    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):
        return 0


def trainer_memory_errors(cfg: PolicyConfig, gpu_bytes: int, num_parameters: int,
                          host_bytes: int | None = None, fp8_weight_params: int = 0) -> list[str]:
    """One line when the trainer's state at the optimizer step plus ``NON_TORCH_BYTES`` exceeds ``gpu_bytes``,
    and one when its host part (``TrainerMemory.host``, all local ranks: the optimizer CPU offload and what
    leaves the GPU around a colocated generation) exceeds ``HOST_OFFLOAD_SHARE`` of ``host_bytes`` (None:
    ``host_total_bytes()``; 0: not checked).

    Each line gives the estimate by part and the keys that lower it. Nothing when it fits: activations
    are not counted, nor the colocated engine while the trainer offloads around generation, so a layout
    that passes may still run out of memory. With ``policy.generation.colocated.offload_trainer=false`` the
    vLLM or SGLang engine wakes beside the trainer's state between steps (``TrainerMemory.between_steps``: the
    gradient buffer and TE's FP8 weight copies are freed first): that plus the engine's share of the GPU
    (``GenerationConfig.engine_memory_fraction``) must fit as well as the state at the optimizer step (the engine
    asleep).
    """
    est = estimate_trainer_memory(num_parameters, cfg, fp8_weight_params)
    errs = []
    host_bytes = host_total_bytes() if host_bytes is None else host_bytes
    host_need = est.host * cfg.world_size
    if host_need and host_bytes and host_need > HOST_OFFLOAD_SHARE * host_bytes:
        o = cfg.megatron_cfg.optimizer
        why = [f"optimizer_cpu_offload with optimizer_offload_fraction={o.optimizer_offload_fraction:g}"] \
            if o.optimizer_cpu_offload else []
        if cfg.generation.colocated.moves_trainer_state:
            moved = "the weights" if o.optimizer_cpu_offload else "the weights and the optimizer state"
            why.append(f"the colocated engine ({moved} leave the GPU while it runs)")
        errs.append(f"policy.megatron_cfg.optimizer: {' and '.join(why)} puts {host_need / GiB:.1f} GiB in host "
                    f"memory for {num_parameters / 1e9:.2f}B parameters, more than {HOST_OFFLOAD_SHARE:.0%} of this "
                    f"machine's {host_bytes / GiB:.1f} GiB; "
                    + ("lower the fraction" if o.optimizer_cpu_offload else
                       "16-bit moments (exp_avg_dtype / exp_avg_sq_dtype) halve it; generation on other GPUs "
                       "(policy.generation.colocated.enabled=false) keeps it on the GPU"))
    g = cfg.generation
    engine = (g.engine_memory_fraction * gpu_bytes  # vLLM's or SGLang's share; 0 for the torch engine
              if g.colocated.enabled and not g.colocated.offload_trainer else 0.0)
    if max(est.per_gpu, est.between_steps + engine if engine else 0.0) + NON_TORCH_BYTES <= gpu_bytes:
        return errs
    m = cfg.megatron_cfg
    hints = [f"policy.megatron_cfg.tensor_model_parallel_size (now {m.tensor_model_parallel_size}) or "
             f"pipeline_model_parallel_size (now {m.pipeline_model_parallel_size}) divides all of it",
             f"more data-parallel ranks (policy.data_parallel_size, now {cfg.data_parallel_size}) divide the optimizer "
             "state" + ("" if m.optimizer.use_distributed_optimizer else " with optimizer.use_distributed_optimizer=true")]
    if m.distributed_data_parallel_config.grad_reduce_in_fp32:
        hints.append("distributed_data_parallel_config.grad_reduce_in_fp32=false halves the gradient buffer")
    if est.bytes_per_param.get("unscaled_moments"):
        hints.append("16-bit moments (exp_avg_dtype / exp_avg_sq_dtype) save memory between steps but TransformerEngine's "
                     "FusedAdam unscales them all to fp32 during the step")
    if est.parts.get("fp8_weight_copies"):
        hints.append(f"fp8_cfg.fp8_param=true keeps the weights in FP8 instead of BF16 weights plus "
                     f"TransformerEngine's FP8 copies ({est.parts['fp8_weight_copies'] / GiB:.1f} GiB per GPU)"
                     + (", or override_transformer_config.disable_parameter_transpose_cache=true quantizes them "
                        "afresh each micro-batch" if m.activation_checkpointing else ""))
    if not m.optimizer.optimizer_cpu_offload or m.optimizer.optimizer_offload_fraction < 1:
        hints.append("optimizer.optimizer_cpu_offload=true with a larger optimizer_offload_fraction (and "
                     "use_precision_aware_optimizer=true) moves Adam's state to host memory")
    beside = ""
    if engine:
        share_key = "sglang_cfg.mem_fraction_static" if g.backend == "sglang" else "vllm_cfg.gpu_memory_utilization"
        beside = (f" (or {est.between_steps / GiB:.1f} GiB between steps, gradients and TransformerEngine's FP8 "
                  f"weight copies freed, plus the engine's {engine / GiB:.1f} GiB, {share_key}="
                  f"{g.engine_memory_fraction:g}, awake beside them with colocated.offload_trainer=false)")
        hints.insert(0, "policy.generation.colocated.offload_trainer=true moves the trainer's state out while the "
                        "engine runs")
    return errs + [f"policy.megatron_cfg: the trainer's weights, gradients and optimizer state need {est.describe()} at the "
            f"optimizer step for {num_parameters / 1e9:.2f}B parameters, plus ~{NON_TORCH_BYTES / GiB:.1f} GiB outside "
            f"PyTorch's allocator{beside}, more than the GPU's {gpu_bytes / GiB:.1f} GiB; " + "; ".join(hints)]

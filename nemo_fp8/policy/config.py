"""Config section ``policy``: the model, the trainer (torch or Megatron) and its FP8 recipe.

Key names follow NeMo-RL's ``PolicyConfig`` / ``MegatronConfig``; the rollout engine's section
(``policy.generation``) lives in ``nemo_fp8/generation/config.py`` and the refit's
(``policy.weight_sync``) in ``nemo_fp8/distributed/config.py``.
"""

from __future__ import annotations

from typing import Any, Literal, Optional

from pydantic import Field

from nemo_fp8.distributed.config import WeightSyncConfig, colocated_engine_error
from nemo_fp8.generation.config import GenerationConfig
from nemo_fp8.policy.packing import ALGORITHMS, PackingShape, packing_shape
from nemo_fp8.policy.schedule import schedule_errors
from nemo_fp8.utils.config import ProfileConfig, StrictConfig


class Fp8TrainingConfig(StrictConfig):
    """TransformerEngine FP8 training (the torch backend emulates the same recipe)."""

    enabled: bool = False
    fp8: Literal["e4m3", "hybrid"] = "e4m3"
    fp8_recipe: Literal["tensorwise", "blockwise"] = "blockwise"
    fp8_param: bool = False

    def config_errors(self) -> list[str]:
        if not (self.fp8_param and not self.enabled):
            return []
        return ["fp8_param: true needs policy.megatron_cfg.fp8_cfg.enabled=true"]


def _schedule_errors(o: "OptimizerConfig | MegatronOptimizerConfig") -> list[str]:
    return schedule_errors(o.lr, o.lr_warmup_init, o.lr_warmup_steps, o.lr_decay_style, o.lr_decay_steps, o.min_lr,
                           o.wsd_decay_steps, o.lr_wsd_decay_style)


class MegatronOptimizerConfig(StrictConfig):
    optimizer: Literal["adam", "sgd"] = "adam"
    lr: float = Field(5e-7, gt=0)
    min_lr: float = Field(5e-8, ge=0)
    weight_decay: float = Field(0.01, ge=0)
    bf16: bool = True
    fp16: bool = False
    params_dtype: Literal["float32", "bfloat16"] = "float32"
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    clip_grad: Optional[float] = Field(None, gt=0)  # None: policy.max_grad_norm
    # fp16 dynamic loss scaling: 2^16, torch.amp.GradScaler's start. megatron-core's default 2^32 overflows
    # fp16 gradients on the first update (NaN gradients at iteration 0), and with its
    # hysteresis of 2 every halving costs two skipped updates: 32 lost GRPO steps before 2^16.
    initial_loss_scale: float = Field(2.0**16, gt=0)
    use_distributed_optimizer: bool = True
    # megatron-core's precision-aware optimizer (TransformerEngine's FusedAdam): Adam's moments stored in 16 bits,
    # and with bf16 weights the fp32 main params kept as 16-bit remainders (megatron-core's store_param_remainders);
    # computation stays fp32. 12 -> 6 bytes of optimizer state per parameter between steps; during the step
    # TransformerEngine 2.11's FusedAdam holds fp32 copies of every 16-bit moment, so the peak hardly falls: an 8B
    # trainer does not fit one GPU this way (nemo_fp8/policy/megatron/memory.py; the preflight refuses such layouts).
    use_precision_aware_optimizer: bool = False
    exp_avg_dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    exp_avg_sq_dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    # megatron-core's optimizer CPU offload (HybridDeviceOptimizer; the keys of NeMo-RL, verl and slime): Adam's fp32
    # main params and moments of `optimizer_offload_fraction` of the parameters live in pinned host memory and are
    # stepped there by torch's CPU Adam, the rest on the GPU by TransformerEngine's FusedAdam (fp32 moments).
    # How an 8B trainer and its state can fit one 141 GiB GPU next to the sleeping engine (memory.py estimates both
    # the GPU and the host side); needs use_precision_aware_optimizer (as megatron-core's recipes set it).
    optimizer_cpu_offload: bool = False
    optimizer_offload_fraction: float = Field(0.0, ge=0.0, le=1.0)
    overlap_cpu_optimizer_d2h_h2d: bool = True
    # linear warm-up over this many optimizer updates from lr_warmup_init to lr, then constant (megatron-core's
    # OptimizerParamScheduler lr_warmup_steps / init_lr; NeMo-RL's scheduler.lr_warmup_iters / lr_warmup_init)
    lr_warmup_steps: int = Field(0, ge=0)
    lr_warmup_init: float = Field(0.0, ge=0)
    # after the warm-up: constant (default) or a decay to min_lr that ends at update lr_decay_steps; "WSD" stays at
    # lr until its last wsd_decay_steps updates, then falls with lr_wsd_decay_style (megatron-core's
    # OptimizerParamScheduler lr_decay_style / lr_decay_steps / wsd_decay_steps / lr_wsd_decay_style)
    lr_decay_style: Literal["constant", "linear", "cosine", "WSD"] = "constant"
    lr_decay_steps: Optional[int] = Field(None, ge=1)
    wsd_decay_steps: Optional[int] = Field(None, ge=1)
    lr_wsd_decay_style: Literal["linear", "cosine", "exponential", "minus_sqrt"] = "linear"

    def config_errors(self) -> list[str]:
        errs = _schedule_errors(self)
        if self.optimizer_cpu_offload:
            need = [w for w, bad in (("optimizer=adam", self.optimizer != "adam"),
                                     ("use_distributed_optimizer=true", not self.use_distributed_optimizer),
                                     ("use_precision_aware_optimizer=true", not self.use_precision_aware_optimizer),
                                     ("exp_avg_dtype=float32 and exp_avg_sq_dtype=float32 (the offloaded optimizer "
                                      "keeps fp32 moments)",
                                      self.exp_avg_dtype != "float32" or self.exp_avg_sq_dtype != "float32"),
                                     ("fp16=false (HybridDeviceOptimizer supports bf16 mixed precision)", self.fp16))
                    if bad]
            if need:
                errs.append(f"optimizer_cpu_offload=true (megatron-core's HybridDeviceOptimizer) needs {', '.join(need)}")
            if self.optimizer_offload_fraction == 0.0:
                errs.append("optimizer_cpu_offload=true with optimizer_offload_fraction=0.0 offloads nothing; "
                            "set a fraction in (0, 1] (1.0: all optimizer state on the host)")
        if self.optimizer == "sgd" and self.use_distributed_optimizer and not self.optimizer_cpu_offload:
            # megatron-core 0.18's DistributedOptimizer asserts Adam (its checkpoint format)
            errs.append("optimizer=sgd needs use_distributed_optimizer=false (megatron-core's distributed optimizer "
                        "supports only Adam)")
        if self.bf16 and self.fp16:
            errs.append("bf16 and fp16 are both true; pick one (fp16 trains with dynamic loss scaling)")
        low = [k for k in ("exp_avg_dtype", "exp_avg_sq_dtype") if getattr(self, k) != "float32"]
        if low and not self.use_precision_aware_optimizer:
            errs.append(f"{', '.join(f'{k}={getattr(self, k)}' for k in low)} needs use_precision_aware_optimizer=true "
                        "(megatron-core stores optimizer state in 16 bits only in its precision-aware optimizer)")
        if self.use_precision_aware_optimizer and (self.optimizer != "adam" or not self.use_distributed_optimizer):
            errs.append(f"use_precision_aware_optimizer needs optimizer=adam and use_distributed_optimizer=true (got "
                        f"optimizer={self.optimizer}, use_distributed_optimizer={self.use_distributed_optimizer})")
        return errs


class DistributedDataParallelConfig(StrictConfig):
    """megatron-core's ``DistributedDataParallelConfig`` keys that a user may change (NeMo-RL's section name)."""

    # fp32 gradient buffer (4 bytes per parameter); false: gradients accumulate and reduce in the weights' dtype
    # (bf16: 2 bytes), as NeMo-RL's large-model recipes set it
    grad_reduce_in_fp32: bool = True


# TransformerConfig attributes this project sets itself (``settings.provider_overrides``), each with the key
# that sets it: ``override_transformer_config`` may not set them behind those keys' backs
MANAGED_TRANSFORMER_KEYS = {
    "tensor_model_parallel_size": "policy.megatron_cfg.tensor_model_parallel_size",
    "pipeline_model_parallel_size": "policy.megatron_cfg.pipeline_model_parallel_size",
    "virtual_pipeline_model_parallel_size": "policy.megatron_cfg.virtual_pipeline_model_parallel_size",
    "variable_seq_lengths": "the backend (on with pipeline parallelism: stages exchange each micro-batch's shape)",
    "context_parallel_size": "policy.megatron_cfg.context_parallel_size",
    "expert_model_parallel_size": "policy.megatron_cfg.expert_model_parallel_size",
    "sequence_parallel": "policy.megatron_cfg.sequence_parallel",
    "gradient_accumulation_fusion": "policy.megatron_cfg.fuse_wgrad_accumulation (TE layers; megatron-core's flag "
                                    "also needs APEX for its output layer)",
    "apply_rope_fusion": "policy.megatron_cfg.apply_rope_fusion",
    "bias_activation_fusion": "policy.megatron_cfg.bias_activation_fusion",
    "calculate_per_token_loss": "the backend (on: the loss is normalised by the global batch's token count)",
    "bf16": "policy.megatron_cfg.optimizer.bf16 / policy.precision",
    "fp16": "policy.megatron_cfg.optimizer.fp16",
    "params_dtype": "policy.megatron_cfg.optimizer.bf16|fp16 / policy.precision",
    "pipeline_dtype": "policy.megatron_cfg.optimizer.bf16|fp16 / policy.precision",
    "autocast_dtype": "policy.megatron_cfg.optimizer.bf16|fp16 / policy.precision",
    "recompute_granularity": "policy.megatron_cfg.activation_checkpointing",
    "recompute_method": "policy.megatron_cfg.activation_checkpointing",
    "recompute_num_layers": "policy.megatron_cfg.activation_checkpointing",
    "fp8": "policy.megatron_cfg.fp8_cfg.fp8 / fp8_cfg.enabled",
    "fp8_recipe": "policy.megatron_cfg.fp8_cfg.fp8_recipe",
    "fp8_param": "policy.megatron_cfg.fp8_cfg.fp8_param",
    "first_last_layers_bf16": "policy.generation.vllm_cfg.num_first_layers_in_bf16 / num_last_layers_in_bf16",
    "num_layers_at_start_in_bf16": "policy.generation.vllm_cfg.num_first_layers_in_bf16",
    "num_layers_at_end_in_bf16": "policy.generation.vllm_cfg.num_last_layers_in_bf16",
}

# megatron_cfg keys that switch a fused kernel of the megatron backend (all on by default)
ENGINE_FUSIONS = ("fuse_wgrad_accumulation", "apply_rope_fusion", "bias_activation_fusion")


class MegatronConfig(StrictConfig):
    enabled: bool = False
    tensor_model_parallel_size: int = Field(1, ge=1)
    pipeline_model_parallel_size: int = Field(
        1, ge=1, description="pipeline stages of each replica (megatron-core's schedules: 1F1B, or interleaved with "
        "virtual_pipeline_model_parallel_size; the torch backend runs the same stages, nemo_fp8/policy/torch_pipeline.py); "
        "the decoder layers split evenly over the stages")
    virtual_pipeline_model_parallel_size: Optional[int] = Field(
        None, ge=1, description="model chunks per pipeline stage (megatron-core's interleaved 1F1B schedule; the megatron "
        "backend only); null: one chunk. Needs pipeline_model_parallel_size > 1 and at least that many micro-batches "
        "per step")
    context_parallel_size: int = Field(1, ge=1)
    expert_model_parallel_size: int = Field(1, ge=1)
    sequence_parallel: bool = False
    activation_checkpointing: bool = False
    logprob_kernel: Literal["chunked", "fused", "te"] = Field(
        "chunked", description="per-token log-probs from the vocab-parallel logits: 'chunked' (ours, fp32 chunks "
        "recomputed in backward), 'fused' (the same math in one Triton pass each way) or 'te' "
        "(TransformerEngine's fused parallel_cross_entropy, its gradient stored in the bf16 logits in the forward)")
    fuse_wgrad_accumulation: bool = Field(
        True, description="TransformerEngine layers accumulate weight gradients into the DDP gradient buffer "
        "(main_grad) inside the wgrad GEMM instead of a separate add (TE's fuse_wgrad_accumulation; megatron-core's "
        "gradient_accumulation_fusion without its APEX part)")
    apply_rope_fusion: bool = Field(
        True, description="megatron-core's apply_rope_fusion (NeMo-RL's key): rotary embeddings in TE's fused kernel "
        "instead of elementwise torch ops")
    bias_activation_fusion: bool = Field(
        True, description="megatron-core's bias_activation_fusion (NeMo-RL's key): the MLP's SwiGLU in one fused kernel "
        "each way instead of separate silu and multiply")
    env_vars: dict[str, str] = Field(
        default_factory=dict, description="environment variables of the policy's rank processes (NeMo-RL's "
        "policy.megatron_cfg.env_vars), over the defaults (megatron_env_vars): e.g. {PYTORCH_CUDA_ALLOC_CONF: "
        "'expandable_segments:False'} turns the default expandable segments off")
    train_expandable_segments: bool = Field(
        False, description="with the cuda_ipc refit, whose handles need cudaMalloc segments: the allocator switches "
        "to expandable segments while the trainer computes log-probs and trains and back before each refit "
        "(nemo_fp8.utils.memory.set_expandable_segments), so what a step frees (activations, TE's FP8 weight "
        "copies, the gradient buffer) goes back to the device page by page before the engine wakes, instead of "
        "staying reserved in segments that the step's other allocations (Adam's moments at the first step) share")
    optimizer: MegatronOptimizerConfig = MegatronOptimizerConfig()
    distributed_data_parallel_config: DistributedDataParallelConfig = DistributedDataParallelConfig()
    fp8_cfg: Fp8TrainingConfig = Fp8TrainingConfig()
    override_transformer_config: dict[str, Any] = Field(
        default_factory=dict, description="more megatron-core TransformerConfig attributes, set on Megatron-Bridge's "
        "provider after this project's own (verl's actor.megatron.override_transformer_config), e.g. "
        "{moe_router_padding_for_quantization: true}; a name the provider lacks fails at start-up")

    def config_errors(self) -> list[str]:
        errs = []
        for key in self.override_transformer_config:
            if key in MANAGED_TRANSFORMER_KEYS:
                errs.append(f"override_transformer_config.{key}: set by {MANAGED_TRANSFORMER_KEYS[key]}, "
                            "not by an override")
        if self.override_transformer_config and not self.enabled:
            errs.append("override_transformer_config: megatron-core settings need the megatron backend "
                        "(policy.megatron_cfg.enabled=true)")
        if self.fp8_cfg.fp8_param and not self.enabled:
            errs.append("fp8_cfg.fp8_param: FP8 parameters need the megatron backend (policy.megatron_cfg.enabled=true); "
                        "the torch backend emulates activations/weights only")
        if self.optimizer.fp16 and not self.enabled:
            errs.append("optimizer.fp16: FP16 training with loss scaling needs the megatron backend "
                        "(policy.megatron_cfg.enabled=true)")
        for key in ("context_parallel_size", "expert_model_parallel_size"):
            if getattr(self, key) != 1:
                errs.append(f"{key}: {getattr(self, key)} is not supported by this build (valid: 1; tensor, "
                            "pipeline and data parallelism are)")
        vpp = self.virtual_pipeline_model_parallel_size
        if vpp is not None and vpp > 1 and self.pipeline_model_parallel_size == 1:
            errs.append(f"virtual_pipeline_model_parallel_size: {vpp} interleaves model chunks over pipeline stages; "
                        "it needs pipeline_model_parallel_size > 1 (or null)")
        elif vpp is not None and vpp > 1 and not self.enabled:
            errs.append(f"virtual_pipeline_model_parallel_size: {vpp}: only the megatron backend interleaves "
                        "(policy.megatron_cfg.enabled=true); the torch backend runs one chunk per stage (valid: null or 1)")
        if self.logprob_kernel != "chunked" and not self.enabled:
            errs.append(f"logprob_kernel: {self.logprob_kernel!r} is a kernel of the megatron backend "
                        "(policy.megatron_cfg.enabled=true); valid without it: 'chunked'")
        if not self.enabled and (self.optimizer.use_precision_aware_optimizer
                                 or not self.distributed_data_parallel_config.grad_reduce_in_fp32):
            errs.append("optimizer.use_precision_aware_optimizer / distributed_data_parallel_config.grad_reduce_in_fp32 "
                        "set the megatron backend's memory (policy.megatron_cfg.enabled=true); the torch backend "
                        "trains with fp32 AdamW (policy.optimizer)")
        off = [k for k in ENGINE_FUSIONS if not getattr(self, k)]
        if off and not self.enabled:
            errs.append(f"{', '.join(off)}: false is a setting of the megatron backend's kernels "
                        "(policy.megatron_cfg.enabled=true); the torch backend has none of these fusions")
        if self.env_vars and not self.enabled:
            errs.append("env_vars: the environment of the megatron backend's rank processes "
                        "(policy.megatron_cfg.enabled=true); the torch backend takes the driver's environment")
        if self.tensor_model_parallel_size > 1 and not self.enabled:
            errs.append(f"tensor_model_parallel_size: {self.tensor_model_parallel_size} needs the megatron backend "
                        "(policy.megatron_cfg.enabled=true); the torch backend is data and pipeline parallel only")
        return errs


# The allocator's expandable segments in the policy's rank processes (NeMo-RL's configure_expandable_segments does the
# same on Hopper): a packed training step near the GPU's capacity (the trainer beside its sleeping engines) otherwise
# fragments the cache into blocks too small for the next micro-batch, and each miss frees and re-maps the whole cache
# (``num_alloc_retries``). Not for the vLLM engines: their sleep mode's allocator refuses expandable segments. Not
# with the cuda_ipc refit either: a tensor in an expandable segment travels as a file descriptor that the engine
# fetches with pidfd_getfd, which containers refuse ("Operation not permitted", pytorch/pytorch#165685; NeMo-RL
# warns of it at its IPC sender).
MEGATRON_DEFAULT_ENV_VARS = {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}


def _expandable(env: dict[str, str]) -> bool:
    return "expandable_segments:true" in env.get("PYTORCH_CUDA_ALLOC_CONF", "").replace(" ", "").lower()


def _train_expandable_errors(cfg: "PolicyConfig") -> list[str]:
    """Why ``megatron_cfg.train_expandable_segments`` cannot run with ``cfg`` (empty: it can): it is for the megatron
    backend under the colocated cuda_ipc refit with the trainer's state kept on the GPU (``offload_trainer: false``:
    weights moved back during training would land in expandable segments, and a weight shared as it is would then
    have no legacy handle), packed (a bucket's buffer is large enough never to be a cached remnant of an expandable
    segment, ``PACKED_MIN_BUFFER_BYTES``; unpacked FP8 tensors are small ones), without an FP8 KV cache (its scales
    travel as small tensors of their own, which may reuse such a remnant)."""
    why = [w for w, bad in (("megatron_cfg.enabled: true", not cfg.megatron_cfg.enabled),
                            ("weight_sync.method: 'cuda_ipc' (the other refits run expandable segments throughout: "
                             "the default PYTORCH_CUDA_ALLOC_CONF)", cfg.weight_sync.method != "cuda_ipc"),
                            ("generation.colocated.offload_trainer: false", cfg.generation.colocated.offload_trainer),
                            ("weight_sync.packed: true", not cfg.weight_sync.packed),
                            ("generation.vllm_cfg.kv_cache_dtype other than fp8",
                             cfg.generation.vllm_cfg.kv_cache_is_fp8)) if bad]
    return [f"megatron_cfg.train_expandable_segments: true needs {', '.join(why)}"] if why else []


def megatron_env_vars(cfg: "PolicyConfig") -> dict[str, str]:
    """The environment variables of the megatron backend's rank processes: ``MEGATRON_DEFAULT_ENV_VARS`` (unless the
    refit is ``cuda_ipc``) under ``megatron_cfg.env_vars`` (the config wins); none for the torch backend."""
    m = cfg.megatron_cfg
    if not m.enabled:
        return {}
    defaults = {} if cfg.weight_sync.method == "cuda_ipc" else MEGATRON_DEFAULT_ENV_VARS
    return {**defaults, **m.env_vars}


class OptimizerConfig(StrictConfig):
    """AdamW for the torch reference policy; the learning rate warms up linearly from ``lr_warmup_init``
    over ``lr_warmup_steps`` optimizer updates, then stays at ``lr`` or decays to ``min_lr``
    (``lr_decay_style``; ``nemo_fp8.policy.schedule.scheduled_lr``, the megatron backend's schedule)."""

    lr: float = Field(1e-5, gt=0)
    min_lr: float = Field(0.0, ge=0)
    weight_decay: float = Field(0.0, ge=0)
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = Field(1e-8, gt=0)
    lr_warmup_steps: int = Field(0, ge=0)
    lr_warmup_init: float = Field(0.0, ge=0)
    # after the warm-up: constant (default) or a decay to min_lr that ends at update lr_decay_steps; "WSD" stays at
    # lr until its last wsd_decay_steps updates, then falls with lr_wsd_decay_style (megatron-core's
    # OptimizerParamScheduler lr_decay_style / lr_decay_steps / wsd_decay_steps / lr_wsd_decay_style)
    lr_decay_style: Literal["constant", "linear", "cosine", "WSD"] = "constant"
    lr_decay_steps: Optional[int] = Field(None, ge=1)
    wsd_decay_steps: Optional[int] = Field(None, ge=1)
    lr_wsd_decay_style: Literal["linear", "cosine", "exponential", "minus_sqrt"] = "linear"

    def config_errors(self) -> list[str]:
        return _schedule_errors(self)


class TokenizerConfig(StrictConfig):
    name: Optional[str] = None  # defaults to policy.model_name


class TinyModelConfig(StrictConfig):
    """``tools/make_tiny_model.py`` settings, used when ``build_if_missing`` is true."""

    build_if_missing: bool = False
    sft_steps: int = Field(400, ge=0)
    max_operand: int = Field(49, ge=1)
    seed: int = 1234


class SequencePackingConfig(StrictConfig):
    """Micro-batches by token budget (NeMo-RL's ``policy.sequence_packing``; ``nemo_fp8.policy.packing``):
    whole sequences packed into bins of at most ``train_mb_tokens`` (training) / ``logprob_mb_tokens``
    (log-probs, KV calibration) tokens, each bin one THD row; replaces ``train_micro_batch_size`` and
    ``logprob_batch_size`` when enabled. Each sequence counts (and is padded to) its length rounded up
    to ``sequence_length_round``; a bin's row is padded to the FP8 recipe's token multiple."""

    enabled: bool = False
    algorithm: Literal[ALGORITHMS] = "modified_first_fit_decreasing"  # type: ignore[valid-type]
    train_mb_tokens: int = Field(4096, ge=1)
    logprob_mb_tokens: int = Field(16384, ge=1)
    sequence_length_round: int = Field(64, ge=1)
    fixed_shape: bool = Field(
        False, description="every packed row padded to train_mb_tokens (a log-prob row longer than that to "
        "logprob_mb_tokens) and its cu_seqlens to a constant length (nemo_fp8.policy.packing, fixed shapes): the "
        "static shapes that CUDA graphs of the training pass replay on; the padding counts in the packing efficiency")


class PolicyConfig(StrictConfig):
    """The trained model. ``data_parallel_size`` ranks each hold a replica and a shard of
    every global batch (gradients are summed across ranks, so the update equals one rank's)."""

    model_name: str
    tokenizer: TokenizerConfig = TokenizerConfig()
    tiny_model: TinyModelConfig = TinyModelConfig()
    # float64: the torch trainer, for CPU runs that are the same on every CPU type (with
    # policy.generation.reference_dtype: float64); the megatron backend trains float64 as float32, in fp32
    # (policy/megatron/settings.py: bf16 only with optimizer.bf16 or precision bfloat16)
    precision: Literal["float32", "bfloat16", "float64"] = "bfloat16"
    device: Literal["auto", "cpu", "cuda"] = "auto"
    data_parallel_size: int = Field(1, ge=1)
    train_global_batch_size: int = Field(512, ge=1)
    train_micro_batch_size: int = Field(4, ge=1)
    logprob_batch_size: int = Field(4, ge=1)
    generation_batch_size: int = Field(32, ge=1)
    max_total_sequence_length: int = Field(1024, ge=2)
    max_grad_norm: float = Field(1.0, gt=0)
    optimizer: OptimizerConfig = OptimizerConfig()
    megatron_cfg: MegatronConfig = MegatronConfig()
    sequence_packing: SequencePackingConfig = SequencePackingConfig()
    # torch backend: a micro-batch's rows with equal prompts run as one row [prompt, response_1, ...], the prompt
    # computed once (Prefix Grouper's shared-prefix forward; verl's actor.use_prefix_grouper); the same log-probs
    # and gradients up to float rounding (nemo_fp8/policy/shared_prefix.py)
    shared_prefix_forward: bool = False
    generation: GenerationConfig = GenerationConfig()
    weight_sync: WeightSyncConfig = WeightSyncConfig()
    profile: ProfileConfig = ProfileConfig()

    @property
    def tensor_parallel_size(self) -> int:
        """Megatron tensor parallelism (1 with the torch backend)."""
        return self.megatron_cfg.tensor_model_parallel_size if self.megatron_cfg.enabled else 1

    @property
    def pipeline_parallel_size(self) -> int:
        """Pipeline stages of each replica (``megatron_cfg.pipeline_model_parallel_size``), read by both backends (the
        torch backend's stages: ``nemo_fp8.policy.torch_pipeline``)."""
        return self.megatron_cfg.pipeline_model_parallel_size

    @property
    def interleaved_pipeline(self) -> bool:
        """megatron-core's interleaved schedule: pipeline stages with ``virtual_pipeline_model_parallel_size`` > 1."""
        m = self.megatron_cfg
        return m.enabled and m.pipeline_model_parallel_size > 1 and (m.virtual_pipeline_model_parallel_size or 1) > 1

    @property
    def world_size(self) -> int:
        """Policy ranks (one GPU each on CUDA): ``data_parallel_size x tensor_parallel_size x pipeline_parallel_size``."""
        return self.data_parallel_size * self.tensor_parallel_size * self.pipeline_parallel_size

    def packing_shape(self, budget: Literal["train", "logprobs"]) -> PackingShape:
        """The bin layout of ``sequence_packing`` for training or log-probs: the budget, each sequence
        padded to ``sequence_length_round`` and the parallel layout's multiple, the packed row to the
        FP8 recipe's token multiple (``nemo_fp8.policy.packing.packing_shape``; the torch backend uses
        the megatron recipe's numbers too, so both backends build the same bins).

        Raises:
            ValueError: a budget that is not a multiple of what the layout needs (``config_errors``
                reports it at load, naming the key).
        """
        sp, m = self.sequence_packing, self.megatron_cfg
        f = m.fp8_cfg
        fixed = (sp.train_mb_tokens, sp.logprob_mb_tokens) if sp.fixed_shape else ()
        return packing_shape(sp.train_mb_tokens if budget == "train" else sp.logprob_mb_tokens, sp.algorithm,
                             sp.sequence_length_round, f.fp8_recipe if f.enabled else None,
                             self.tensor_parallel_size, m.enabled and m.sequence_parallel,
                             m.context_parallel_size if m.enabled else 1,
                             bins_multiple=self.pipeline_parallel_size if self.interleaved_pipeline else 1,
                             fixed_sizes=fixed)

    def _packing_errors(self) -> list[str]:
        sp = self.sequence_packing
        if not sp.enabled:
            return ["sequence_packing.fixed_shape: true pads packed rows; it needs sequence_packing.enabled: true "
                    "(or fixed_shape: false)"] if sp.fixed_shape else []
        errs = []
        for budget, key in (("train", "train_mb_tokens"), ("logprobs", "logprob_mb_tokens")):
            try:
                shape = self.packing_shape(budget)  # type: ignore[arg-type]
            except ValueError as e:
                errs.append(f"sequence_packing.{key}: {e}")
                continue
            longest = shape.padded_length(self.max_total_sequence_length)
            if longest > shape.capacity:
                errs.append(f"sequence_packing.{key}: {shape.capacity} tokens cannot hold a sequence of "
                            f"policy.max_total_sequence_length={self.max_total_sequence_length} (padded to "
                            f"{longest} by sequence_length_round={sp.sequence_length_round}); valid: >= {longest}")
        if self.train_global_batch_size % self.data_parallel_size:
            errs.append(f"sequence_packing: policy.train_global_batch_size={self.train_global_batch_size} must be a "
                        f"multiple of policy.data_parallel_size={self.data_parallel_size}")
        return errs

    def _shared_prefix_errors(self) -> list[str]:
        """``shared_prefix_forward`` runs in the one-stage torch backend, on micro-batches of whole rows."""
        if not self.shared_prefix_forward:
            return []
        errs = []
        if self.megatron_cfg.enabled:
            errs.append("shared_prefix_forward: true needs the torch backend (policy.megatron_cfg.enabled: false); "
                        "the megatron backend has no shared-prefix forward (with megatron: "
                        "policy.shared_prefix_forward=false)")
        if self.sequence_packing.enabled:
            errs.append("shared_prefix_forward: true cannot run with policy.sequence_packing.enabled: true: packing "
                        "bins rows by length, not by prompt, and budgets every row's copy of its prompt; set one of "
                        "them to false")
        if self.pipeline_parallel_size > 1:
            errs.append(f"shared_prefix_forward: true runs in the one-stage torch backend; pipeline stages "
                        f"(policy.megatron_cfg.pipeline_model_parallel_size={self.pipeline_parallel_size}, "
                        "nemo_fp8/policy/torch_pipeline.py) run the unshared forward (valid with stages: "
                        "policy.shared_prefix_forward=false)")
        return errs

    def config_errors(self) -> list[str]:
        gbs, mbs, dp = self.train_global_batch_size, self.train_micro_batch_size, self.data_parallel_size
        errs = self._packing_errors() + self._shared_prefix_errors()
        if gbs % (mbs * dp) != 0:
            errs.append(f"train_micro_batch_size: {mbs} x policy.data_parallel_size={dp} must divide "
                        f"policy.train_global_batch_size={gbs}")
        elif self.interleaved_pipeline and not self.sequence_packing.enabled \
                and (gbs // (mbs * dp)) % self.pipeline_parallel_size:
            errs.append(f"train_micro_batch_size: {gbs // (mbs * dp)} micro-batches per data-parallel rank; "
                        "megatron-core's interleaved schedule (megatron_cfg.virtual_pipeline_model_parallel_size) "
                        f"needs a multiple of pipeline_model_parallel_size={self.pipeline_parallel_size}")
        engine_gpus = self.generation.engine_gpus
        if self.generation.colocated.enabled and engine_gpus > 1:
            why = colocated_engine_error(engine_gpus, self.world_size)
            if why:
                errs.append(f"generation.vllm_cfg.tensor_parallel_size: {why}")
        if self.device == "cuda" and not errs:
            try:
                self.generation.resolve_num_engines(self.world_size, use_gpu=True)
            except ValueError as e:
                errs.append(str(e).removeprefix("policy."))
        if self.weight_sync.method == "cuda_ipc" and _expandable(self.megatron_cfg.env_vars):
            errs.append("megatron_cfg.env_vars: PYTORCH_CUDA_ALLOC_CONF with expandable_segments:True and "
                        "weight_sync.method: 'cuda_ipc' cannot run together: a tensor in an expandable segment is "
                        "shared through pidfd_getfd, which containers refuse (pytorch/pytorch#165685); drop "
                        "expandable_segments or use weight_sync.method 'object_store'")
        if self.megatron_cfg.train_expandable_segments:
            errs.extend(_train_expandable_errors(self))
        if self.weight_sync.method == "cuda_ipc":
            why = [w for w, bad in (("generation.backend: vllm", self.generation.backend != "vllm"),
                                    ("generation.colocated.enabled: true", not self.generation.colocated.enabled),
                                    ("device: cuda or auto", self.device == "cpu"),
                                    ("a one-GPU engine (generation.vllm_cfg.tensor_parallel_size: 1, not "
                                     f"{engine_gpus}: the rank's handles are for its own GPU only, the engine's other "
                                     "workers would find none)", engine_gpus > 1)) if bad]
            if why:
                errs.append(f"weight_sync.method: 'cuda_ipc' hands CUDA IPC handles from each policy rank to the "
                            f"vLLM engine on its GPU; it needs {', '.join(why)} (valid otherwise: 'auto', "
                            "'object_store')")
        if self.weight_sync.pack_in_place and not self.weight_sync.packed:
            errs.append("weight_sync.pack_in_place: true fills the packed CUDA IPC buckets in place; it needs "
                        "weight_sync.packed: true (and weight_sync.method: cuda_ipc)")
        if self.weight_sync.packed and self.weight_sync.method != "cuda_ipc":
            errs.append(f"weight_sync.packed: true packs the buckets of the CUDA IPC refit; weight_sync.method is "
                        f"{self.weight_sync.method!r} (valid with packed: 'cuda_ipc'; or packed: false)")
        if self.weight_sync.method == "nccl":
            why = [w for w, bad in (("generation.backend: vllm", self.generation.backend != "vllm"),
                                    ("generation.colocated.enabled: false (the engine on GPUs of its own: NCCL "
                                     "cannot put two ranks of one group on one GPU)",
                                     self.generation.colocated.enabled),
                                    ("device: cuda or auto", self.device == "cpu")) if bad]
            if why:
                errs.append(f"weight_sync.method: 'nccl' broadcasts the weights from the policy's rank 0 to the GPUs "
                            f"of a vLLM engine of its own (vLLM's NCCL weight-transfer engine); it needs "
                            f"{', '.join(why)} (valid otherwise: 'auto', 'object_store')")
        return errs

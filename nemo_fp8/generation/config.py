"""Config section of the rollout engine: ``policy.generation`` (with ``vllm_cfg`` and ``sglang_cfg``).

Key names follow NeMo-RL's ``VllmConfig`` (``nemo_rl/models/generation/vllm/config.py``). The
torch reference backend honours every precision key, so CPU runs use the same YAML. ``backend: sglang`` reuses
``vllm_cfg``'s precision keys and takes its engine knobs from ``sglang_cfg`` (``nemo_fp8.generation.sglang.config``
says why).
"""

from __future__ import annotations

from typing import Literal, Optional

from pydantic import Field

from nemo_fp8.distributed.config import SUPPORTED_TENSOR_PARALLEL_SIZES, colocated_engine_error  # noqa: F401
from nemo_fp8.generation.interfaces import ResponseLimits
from nemo_fp8.generation.sglang.config import SglangConfig, sglang_generation_errors
from nemo_fp8.utils.config import StrictConfig

SUPPORTED_WEIGHT_BLOCK_SIZE = [128, 128]


class VllmConfig(StrictConfig):
    """Rollout precision and engine settings (see the README's precision table)."""

    precision: Literal["bfloat16", "fp8"] = "bfloat16"
    use_deep_gemm: bool = False
    deep_gemm_warmup: Literal["relax", "full", "skip"] = Field(
        "relax", description="vLLM's VLLM_DEEP_GEMM_WARMUP with use_deep_gemm: at start-up DeepGEMM compiles its "
        "kernels for the M sizes where its block choice changes (relax, vLLM's default), for every M up to "
        "max_num_batched_tokens (full), or for none, each compiled at its first use instead (skip): on a fresh host "
        "the start-up warm-up can take longer than a run (docs/vllm-fp8-rollout.md); DG_JIT_CACHE_DIR keeps the "
        "kernels for the next start")
    num_first_layers_in_bf16: int = Field(0, ge=0)
    num_last_layers_in_bf16: int = Field(0, ge=0)
    fp8_ignore_patterns: list[str] = Field(default_factory=list)
    pow2_weight_scaling_factors: bool = False
    pow2_activation_scaling_factors: bool = False
    weight_block_size: list[int] = Field(default_factory=lambda: list(SUPPORTED_WEIGHT_BLOCK_SIZE))
    kv_cache_dtype: Literal["auto", "fp8"] = "auto"
    kv_scale_margin: float = Field(1.0, ge=1.0, description="FP8 KV scale = amax * margin / 448 (head-room >= 1)")
    kv_calibration_max_samples: Optional[int] = Field(
        256, ge=1, description="sequences of the step's batch the FP8 KV calibration forward reads, evenly spaced "
        "(every prompt's group keeps members while it is >= grpo.num_prompts_per_step); null: all of them. "
        "NeMo-RL's max_calib_samples (default 256): the per-layer amax settles on far fewer sequences than a "
        "training batch, and the forward over all of them costs nearly a log-prob pass per step")
    gpu_memory_utilization: float = Field(0.6, gt=0, le=1)
    kv_cache_memory_bytes: Optional[int] = Field(
        None, ge=1, description="vLLM's kv_cache_memory_bytes: a fixed KV cache size per GPU that skips vLLM's "
        "memory profiling (which fails when another process on the GPU frees memory while it profiles)")
    tensor_parallel_size: int = Field(
        1, ge=1, description="vLLM's tensor parallelism: each engine runs on this many GPUs of one node, those of "
        "n consecutive policy ranks when colocated, else GPUs of its own (nemo_fp8/distributed/placement.py)")
    max_model_len: Optional[int] = Field(None, ge=1)
    enforce_eager: bool = False
    seed_each_request: bool = Field(
        True, description="each sampled request carries its own seed (SamplingParams.seed, request_seed), so a "
        "prompt's samples do not depend on which engine or batch serves it. vLLM 0.22's V2 model runner draws every "
        "request's Gumbel noise from its seed in one kernel (no cost); its V1 runner draws each seeded request's "
        "noise in a Python loop, one kernel per request per decode step (see model_runner). false: the engine's "
        "seeded generator draws the batch's noise at once (NeMo-RL's and verl's rollouts), reproducible for the same "
        "engines and batches only")
    sleep_level: Literal[1, 2] = Field(
        1, description="vLLM's sleep level between rollouts when colocated (LLM.sleep). 1: the weights are copied "
        "to host memory and back at each sleep and wake (NeMo-RL's); 2: they are discarded, nothing is copied "
        "(verl's for vLLM >= 0.18): the loop then refits before every wake, and the refit's completeness check "
        "(every weight of the model arrived) leaves no weight stale. vLLM saves and restores the model's buffers "
        "(rotary caches, KV scales) itself")
    refit_format: Literal["checkpoint", "kernel"] = Field(
        "checkpoint", description="how the engine takes a refit (vLLM's start_weight_update is_checkpoint_format). "
        "checkpoint: HF-named tensors through the model's weight loaders and vLLM's layerwise reload, which re-runs "
        "each layer's quantization processing; kernel: tensors stacked into the engine's own parameters (fused "
        "q/k/v and gate/up) and copied in place, no loaders, no processing (nemo_fp8/generation/vllm/"
        "kernel_format.py): for BF16 engines and FP8 ones on CUTLASS's block-scaled kernel (use_deep_gemm: false), "
        "tensor parallel 1, without an FP8 KV cache, refit by CUDA IPC or from the engine's own process")
    model_runner: Literal["auto", "v1", "v2"] = Field(
        "auto", description="vLLM's GPU model runner (VLLM_USE_V2_MODEL_RUNNER). auto: vLLM's choice; vLLM 0.22 "
        "picks V2 only for unquantized dense models of its list (Qwen3ForCausalLM), so a BF16 Qwen3 engine runs V2 "
        "and an FP8 one V1 (vllm/config/vllm.py, use_v2_model_runner). v1 / v2: that runner for every precision, "
        "so FP8 and BF16 engines compare like for like")

    @property
    def kv_cache_is_fp8(self) -> bool:
        """``kv_cache_dtype == "fp8"``: an FP8 KV cache, whose per-layer q/k/v scales every refit must carry."""
        return self.kv_cache_dtype == "fp8"

    def config_errors(self) -> list[str]:
        errs = []
        if self.deep_gemm_warmup != "relax" and not self.use_deep_gemm:
            errs.append(f"deep_gemm_warmup: {self.deep_gemm_warmup!r} sets DeepGEMM's warm-up, which runs only with "
                        "use_deep_gemm: true (valid without it: 'relax', the default)")
        if self.weight_block_size != SUPPORTED_WEIGHT_BLOCK_SIZE:
            errs.append(f"weight_block_size: {self.weight_block_size} is not supported (valid: "
                        f"{SUPPORTED_WEIGHT_BLOCK_SIZE}, the block size of vLLM/DeepGEMM block-scaled FP8 kernels)")
        if self.kv_cache_is_fp8 and self.precision != "fp8":
            errs.append("kv_cache_dtype: 'fp8' needs policy.generation.vllm_cfg.precision='fp8' "
                        "(valid with bfloat16 precision: 'auto')")
        if self.refit_format == "kernel":
            why = [w for w, bad in (("use_deep_gemm: false (DeepGEMM re-lays its weights out after loading)",
                                     self.precision == "fp8" and self.use_deep_gemm),
                                    ("tensor_parallel_size: 1", self.tensor_parallel_size != 1),
                                    ("kv_cache_dtype: 'auto' (the FP8 KV scales load through the attention layers' "
                                     "own processing)", self.kv_cache_is_fp8)) if bad]
            if why:
                errs.append(f"refit_format: 'kernel' needs {', '.join(why)} (valid otherwise: 'checkpoint')")
        return errs


class EngineResources(StrictConfig):
    """The GPUs of engines that are not colocated (NeMo-RL's ``policy.generation.colocated.resources``).

    Attributes:
        gpus_per_node: GPUs for engines on each node (None: ``vllm_cfg.tensor_parallel_size``, one engine);
            a multiple of ``tensor_parallel_size`` (an engine never spans nodes).
        num_nodes: nodes with such GPUs (None: 1).
    """

    gpus_per_node: Optional[int] = Field(None, ge=1)
    num_nodes: Optional[int] = Field(None, ge=1)


class ColocationConfig(StrictConfig):
    """Trainer and engine share the GPUs; the engine sleeps while the trainer works.

    Attributes:
        enabled: share the GPUs (NeMo-RL's colocated mode); false: the engine gets GPUs of its own.
        offload_trainer: colocated only. True (NeMo-RL's colocated refit): before each refit the trainer
            frees its gradients and moves its optimizer state to host memory, after it its weights, so the
            engine wakes into the freed memory; they come back before the next training pass. False: the
            trainer keeps all of it on the GPU beside the awake engine (verl's actor ``param_offload`` /
            ``optimizer_offload`` off), which saves two host round trips of the trainer's state per step
            where the GPU holds both: small models (of the parity config's 200M model's 2.0 s refit, 0.7 s was
            the weight transfer; the rest, about 1.2 s, includes these moves). The preflight then counts the engine's
            ``gpu_memory_utilization`` share on top of the trainer's state. Without colocation nothing is
            moved either way.
        resources: not colocated: the engines' own GPUs (``EngineResources``); unused when colocated.
    """

    enabled: bool = True
    offload_trainer: bool = True
    resources: EngineResources = EngineResources()

    @property
    def moves_trainer_state(self) -> bool:
        """Whether the trainer's state leaves the GPU around each generation (colocated and ``offload_trainer``)."""
        return self.enabled and self.offload_trainer


class ResponseLimitsConfig(StrictConfig):
    """``policy.generation.response_limits``: long-tailed per-request response limits for measuring rollouts
    (``nemo_fp8.generation.interfaces.ResponseLimits``). Each rollout request's own ``max_new_tokens`` is a lognormal
    draw around ``median_tokens`` (log-space spread ``sigma``), clamped to ``[min_tokens, max_new_tokens]``.
    Validation keeps ``max_new_tokens``. Meant for timing runs on a model that seldom stops (the random 8B
    checkpoint), whose responses then follow the draws; on a trained model a limit truncates responses."""

    median_tokens: int = Field(ge=1)
    sigma: float = Field(1.0, gt=0, le=4)
    min_tokens: int = Field(1, ge=1)

    def limits(self) -> ResponseLimits:
        return ResponseLimits(median_tokens=self.median_tokens, sigma=self.sigma, min_tokens=self.min_tokens)


class GenerationConfig(StrictConfig):
    backend: Literal["torch", "vllm", "sglang"] = "torch"
    # the torch reference engine's high-precision dtype (what vLLM runs in bf16: attention, norms, embeddings,
    # lm_head, and FP8 layers' outputs); float64 makes a CPU run the same on every CPU type, whichever kernels torch
    # picks there (FP8 layers then accumulate exactly), with policy.precision: float64 (docs/first-run.md).
    # vLLM ignores it, as the torch engine ignores vllm_cfg's engine-only keys
    reference_dtype: Literal["bfloat16", "float64"] = "bfloat16"
    max_new_tokens: int = Field(512, ge=1)
    temperature: float = Field(1.0, gt=0)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: Optional[int] = Field(None, ge=1)
    stop_token_ids: Optional[list[int]] = None
    vllm_cfg: VllmConfig = VllmConfig()
    # backend: sglang only: SGLang's engine knobs (vllm_cfg's precision keys still apply)
    sglang_cfg: SglangConfig = SglangConfig()
    colocated: ColocationConfig = ColocationConfig()
    response_limits: Optional[ResponseLimitsConfig] = None
    num_engines: Optional[int] = Field(
        None, ge=1, description="rollout engines (data parallel). None: every GPU of the run, GPUs / "
        "vllm_cfg.tensor_parallel_size (colocated: the policy's GPUs; else colocated.resources'); on CPU, one torch "
        "engine per policy rank. A number: that many, at most the GPUs' count / tensor_parallel_size")

    def config_errors(self) -> list[str]:
        errs = []
        if self.top_p != 1.0 or self.top_k is not None:
            errs.append("top_p/top_k: must be 1.0/null; the trainer's log-probs cannot reproduce a truncated sampling "
                        "distribution, so IS correction would be wrong")
        tp = self.vllm_cfg.tensor_parallel_size
        if self.backend == "vllm" and tp not in SUPPORTED_TENSOR_PARALLEL_SIZES:
            errs.append(f"vllm_cfg.tensor_parallel_size: {tp} is not supported (valid: "
                        f"{', '.join(map(str, SUPPORTED_TENSOR_PARALLEL_SIZES))})")
        if self.backend == "sglang":
            errs.extend(sglang_generation_errors(self.sglang_cfg, self.vllm_cfg))
        lim = self.response_limits
        if lim is not None and not lim.min_tokens <= lim.median_tokens <= self.max_new_tokens:
            errs.append(f"response_limits: min_tokens={lim.min_tokens} <= median_tokens={lim.median_tokens} <= "
                        f"max_new_tokens={self.max_new_tokens} does not hold; valid: a median between the two bounds")
        per_node = self.colocated.resources.gpus_per_node
        if not self.colocated.enabled and per_node is not None and per_node % self.engine_gpus:
            errs.append(f"colocated.resources.gpus_per_node: {per_node} is not a multiple of "
                        f"vllm_cfg.tensor_parallel_size={self.engine_gpus} (an engine never spans nodes); valid: "
                        f"multiples of {self.engine_gpus}")
        return errs

    @property
    def sleep_discards_weights(self) -> bool:
        """A colocated engine whose sleep drops its weights (vLLM ``vllm_cfg.sleep_level == 2``; SGLang without
        ``sglang_cfg.cpu_weight_backup``): the loop refits before every wake (``RefitController``)."""
        if not self.colocated.enabled:
            return False
        if self.backend == "sglang":
            return not self.sglang_cfg.cpu_weight_backup
        return self.backend == "vllm" and self.vllm_cfg.sleep_level == 2

    @property
    def engine_memory_fraction(self) -> float:
        """The share of a GPU's memory a real engine claims (vLLM ``gpu_memory_utilization``, SGLang
        ``mem_fraction_static``); 0 for the torch engine. The memory preflight counts it beside a colocated
        trainer that keeps its state on the GPU."""
        if self.backend == "vllm":
            return self.vllm_cfg.gpu_memory_utilization
        if self.backend == "sglang":
            return self.sglang_cfg.mem_fraction_static
        return 0.0

    @property
    def own_engine_gpus(self) -> int:
        """Not colocated: the GPUs of the engines, ``resources.gpus_per_node x resources.num_nodes`` (default: one
        engine's, ``engine_gpus``)."""
        res = self.colocated.resources
        return (res.gpus_per_node or self.engine_gpus) * (res.num_nodes or 1)

    def resolve_num_engines(self, policy_world_size: int, use_gpu: bool) -> int:
        """How many engines the run starts (``num_engines``, or every GPU's share when None).

        On CPU: one torch engine per policy rank. On GPUs, colocated: policy world size / ``engine_gpus``;
        not colocated: ``own_engine_gpus / engine_gpus``.

        Raises:
            ValueError: ``num_engines`` above that count (names the keys and the valid range).
        """
        if not use_gpu:
            return self.num_engines or policy_world_size
        gpus = policy_world_size if self.colocated.enabled else self.own_engine_gpus
        most = max(1, gpus // self.engine_gpus)
        if self.num_engines is not None and self.num_engines > most:
            where = ("the policy's GPUs (policy world size)" if self.colocated.enabled
                     else "policy.generation.colocated.resources.gpus_per_node x num_nodes")
            raise ValueError(f"policy.generation.num_engines: {self.num_engines} engines of "
                             f"policy.generation.vllm_cfg.tensor_parallel_size={self.engine_gpus} GPU(s) need "
                             f"{self.num_engines * self.engine_gpus} GPUs, but {where} gives {gpus}; valid: 1 to "
                             f"{most}")
        return self.num_engines or most

    @property
    def engine_gpus(self) -> int:
        """GPUs of the rollout engine: vLLM's ``tensor_parallel_size``, SGLang's ``sglang_cfg.tp_size``; 1 for the
        torch engine (which has no tensor parallelism and leaves the key alone)."""
        if self.backend == "sglang":
            return self.sglang_cfg.tp_size
        return self.vllm_cfg.tensor_parallel_size if self.backend == "vllm" else 1

"""Policy backend ``megatron``: Megatron-core + TransformerEngine FP8 training, built by Megatron-Bridge.

One instance is one rank of ``world_size = data_parallel_size x tensor_model_parallel_size x
pipeline_model_parallel_size`` (megatron-core's rank order ``tp-cp-ep-dp-pp``: tensor-parallel ranks are
neighbours, pipeline stages farthest apart). Each rank is a Ray actor on one GPU (``nemo_fp8.policy.group``); the
ranks of one data-parallel group see the same rows. With pipeline parallelism megatron-core's schedules run the
micro-batches and log-probs, losses and metrics exist on the last stage only (``nemo_fp8.policy.megatron.pipeline``).

Build (the path seen working on the GPU host, ``../shared/gpu-host/README.md``):
``AutoBridge.from_hf_pretrained(<local HF checkpoint>)`` -> ``to_megatron_provider()`` -> our
``settings.provider_overrides`` (parallelism, dtype, the FP8 recipe) -> ``finalize()`` ->
``provide_distributed_model`` (TE layer spec, mcore DDP) -> ``get_megatron_optimizer``
(fp32 master weights, optionally distributed) -> ``OptimizerParamScheduler``.

FP8: megatron-core enters TE's ``fp8_autocast`` per decoder layer with the recipe of
``get_fp8_recipe`` (``megatron/core/fp8_utils.py``), and leaves the first / last
``num_layers_at_{start,end}_in_bf16`` layers outside it; we only set the config. Sequences are
right padded to the recipe's multiple (``settings.sequence_pad_multiple``), or with
``policy.sequence_packing`` packed into THD rows (megatron-core's ``PackedSeqParams``, ``_packed_forward``).

Log-probs: ``vocab_parallel_token_logprobs`` on the vocab-parallel logits, chunked, so no
full-vocabulary fp32 logits exist for the batch (``megatron_cfg.logprob_kernel: fused``: the same
math in one Triton pass each way), or (``megatron_cfg.logprob_kernel: te``)
TransformerEngine's fused ``parallel_cross_entropy`` through ``fused_token_logprobs``; loss and
metrics through the same ``LossFn`` and ``MetricAccumulator`` as the torch backend.

Refit: ``named_weights`` streams Megatron-Bridge's ``export_hf_weights`` (HF names, tensor-
parallel shards gathered; every tensor-parallel rank must iterate it, see ``drain_weights``).
Colocated with the engine, what moves or is freed around each refit: ``nemo_fp8.policy.megatron.colocation``.
"""

from __future__ import annotations

import gc
import logging
import math
import os
from pathlib import Path
from typing import Iterator, Optional, Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from nemo_fp8.batch import TrainBatch
from nemo_fp8.fp8.kv_scales import KvScales
from nemo_fp8.policy.interfaces import LossFn
from nemo_fp8.policy.megatron import checkpoint, pipeline, settings
from nemo_fp8.policy.megatron.colocation import ColocationMixin
from nemo_fp8.policy.megatron.logprobs import DEFAULT_CHUNK_SIZE, fused_token_logprobs, vocab_parallel_token_logprobs
from nemo_fp8.policy.megatron.support import check_recipe_supported
from nemo_fp8.policy.megatron.te_model import fuse_te_wgrad_accumulation, requantize_fp8_weights, unwrap
from nemo_fp8.policy.offload import HostBuffers
from nemo_fp8.policy.packing import PackedRows, real_token_mask, unpack
from nemo_fp8.policy.torch_backend import (ShardTrainResult, batched_logprobs, global_batches, logprob_micro_batches,
                                           micro_batches_on, pack_micro_batch, reduce_train_results, row_index,
                                           scoring_model, train_micro_batches)
from nemo_fp8.policy.spec import PolicySpec
from nemo_fp8.utils.memory import CudaMemoryWindow
from nemo_fp8.utils.metrics import MetricAccumulator
from nemo_fp8.utils.profiling import TrainProfiler

logger = logging.getLogger(__name__)


def packed_seq_kwargs(packed: PackedRows, device: torch.device) -> dict:
    """megatron-core ``PackedSeqParams`` fields of a packed row (THD): ``cu_seqlens_q/kv`` the padded offsets
    ([n + 1] int32 on ``device``), ``max_seqlen_q/kv`` and ``total_tokens`` host ints.

    As NeMo-RL's ``_pack_sequences_for_megatron``, the padded offsets serve as the sequences' bounds: each segment's
    padding sits after its real tokens, so with causal attention no real token sees it, and every TE attention
    backend accepts the layout. ``cu_seqlens_q/kv_padded`` stay None: given, TransformerEngine's
    ``DotProductAttention.forward`` compares them with ``cu_seqlens_q/kv`` (``torch.equal`` on two device tensors, to
    detect padding between sequences) in every attention layer, a host sync per layer that lets the host run at
    most one layer ahead of the GPU; with them None TE and megatron-core's RoPE use ``cu_seqlens_q/kv``, the same
    offsets (megatron-core's RL packing, ``megatron/rl/sequence_packing_utils.py``, passes None too).
    """
    cu = packed.cu_seqlens_padded.to(device)
    return dict(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, cu_seqlens_q_padded=None,
                cu_seqlens_kv_padded=None, max_seqlen_q=int(packed.max_seqlen), max_seqlen_kv=int(packed.max_seqlen),
                total_tokens=int(packed.total_tokens))


class MegatronPolicyBackend(ColocationMixin):
    """``PolicyBackend`` on Megatron-core + TransformerEngine (see the module docstring).

    Args:
        spec: the rank's ``PolicySpec``: ``spec.cfg`` the ``policy`` section (``megatron_cfg`` holds parallelism,
            optimizer and fp8_cfg); ``spec.device`` must be a CUDA device (the rank's GPU); ``spec.temperature``
            divides the logits; ``spec.keep_reference`` keeps a frozen copy of the initial model for the KL
            penalty; ``spec.seed`` is megatron-core's model-parallel RNG seed; ``spec.train_packing`` /
            ``logprob_packing`` the sequence packing's bin layouts (None: packing off).
        rank, world_size: this rank and ``data_parallel_size x tensor_model_parallel_size x pipeline_model_parallel_size``.
        dist_init_method: ``tcp://host:port`` of rank 0; None with one rank: an in-process store
            (``torch.distributed.HashStore``), no port to race for (a probed free port was once
            taken by another process between the probe and the bind: EADDRINUSE at start-up).
        load_weights: False builds the model from ``cfg.model_name``'s ``config.json`` with random
            weights (benchmarks: no checkpoint to write, like vLLM's ``load_format="dummy"``).

    Raises:
        RuntimeError: no CUDA device; the FP8 recipe cannot run here (``check_recipe_supported``);
            TransformerEngine already imported with the other block-scaling convention.
        ValueError: ``world_size`` is not ``data_parallel_size x tensor_model_parallel_size x
            pipeline_model_parallel_size``; several ranks without ``dist_init_method``.
    """

    def __init__(self, spec: PolicySpec, rank: int = 0, world_size: int = 1, dist_init_method: Optional[str] = None,
                 load_weights: bool = True):
        cfg, device = spec.cfg, spec.device
        if device.type != "cuda" or not torch.cuda.is_available():
            raise RuntimeError("policy.megatron_cfg.enabled=true needs a CUDA GPU (megatron-core + TransformerEngine); "
                               "on CPU use the torch reference backend (policy.megatron_cfg.enabled=false)")
        m = cfg.megatron_cfg
        tp, pp = m.tensor_model_parallel_size, m.pipeline_model_parallel_size
        if world_size != cfg.world_size:
            raise ValueError(f"megatron: {world_size} ranks, but policy.data_parallel_size={cfg.data_parallel_size} x "
                             f"policy.megatron_cfg.tensor_model_parallel_size={tp} x pipeline_model_parallel_size={pp}"
                             f" = {cfg.world_size}")
        self.spec, self.cfg, self.temperature = spec, cfg, spec.temperature
        self.rank, self.world_size = rank, world_size
        os.environ.update(settings.block_scaling_env(cfg))  # read by TE at import: before any TE import
        self.device = torch.device("cuda", 0 if device.index is None else device.index)  # Ray: the visible GPU
        torch.cuda.set_device(self.device)
        check_recipe_supported(cfg)
        self._check_block_scaling_convention()

        from megatron.core import parallel_state
        from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

        if not dist.is_initialized():
            if dist_init_method is None and world_size > 1:
                raise ValueError(f"megatron: {world_size} ranks need dist_init_method (tcp://host:port of rank 0)")
            rendezvous = dict(init_method=dist_init_method) if dist_init_method else dict(store=dist.HashStore())
            dist.init_process_group("nccl", rank=rank, world_size=world_size, device_id=self.device, **rendezvous)
        self.pp_size, self.vpp_size = pp, m.virtual_pipeline_model_parallel_size
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                                 virtual_pipeline_model_parallel_size=self.vpp_size)
        model_parallel_cuda_manual_seed(spec.seed)
        self.tp_size, self.tp_rank = tp, parallel_state.get_tensor_model_parallel_rank()
        self.tp_group = parallel_state.get_tensor_model_parallel_group() if tp > 1 else None
        self.dp_group = parallel_state.get_data_parallel_group()
        self.dp_rank, self.dp_size = parallel_state.get_data_parallel_rank(), cfg.data_parallel_size
        self.pad_multiple = settings.sequence_pad_multiple(cfg)

        # chunks: this rank's model chunks (one per virtual pipeline stage; the whole model without PP), DDP-wrapped
        self.bridge, self.chunks, self.reference_chunks = self._build(spec.keep_reference, load_weights)
        self.model = self.chunks[0]
        self.optimizer, self.scheduler = self._build_optimizer()
        config = unwrap(self.model).config
        config.finalize_model_grads_func = None  # train_shard finalises, without the schedule's 1/token-count scale
        if pp > 1:  # fp16's loss scale reaches the last stage's backward through the schedule (Megatron-LM's way)
            config.grad_scale_func = self.optimizer.scale_loss
        if load_weights and self._fp8_param:
            self._load_fp8_params_and_main_params()
        self.num_updates = 0
        self._train_calls = 0  # train_shard calls so far (the opt-in profiler's policy.profile.train_call)
        self._offloaded: set[str] = set()
        self._host = HostBuffers()  # the optimizer state's host memory, reused at every colocated refit
        if cfg.generation.colocated.moves_trainer_state:
            if not m.optimizer.optimizer_cpu_offload:
                self._host.reserve(self._adam_moment_bytes())  # pinned now, not inside the first refit after training
            self._pin_weight_host_copies()
        self._state_on_host: list[tuple[dict, str]] = []  # (optimizer state dict, key) that _move_optimizer_state moved
        logger.info("megatron policy rank %d/%d (tp %d, dp %d, pp %d of %d): fp8=%s recipe=%s fp8_param=%s "
                    "bf16 layers %s", rank, world_size, self.tp_rank, self.dp_rank,
                    parallel_state.get_pipeline_model_parallel_rank(), pp,
                    m.fp8_cfg.fp8 if m.fp8_cfg.enabled else None, m.fp8_cfg.fp8_recipe if m.fp8_cfg.enabled else None,
                    m.fp8_cfg.fp8_param, settings.bf16_layer_counts(cfg))
        self._freeze_built_objects()

    # ----------------------------------------------------------------------- build
    def _check_block_scaling_convention(self) -> None:
        if not (self.cfg.megatron_cfg.fp8_cfg.enabled and self.cfg.megatron_cfg.fp8_cfg.fp8_recipe == "blockwise"):
            return
        from transformer_engine.common.recipe import Float8BlockScaling

        want_fp32 = settings.block_scaling_env(self.cfg)["NVTE_FP8_BLOCK_SCALING_FP32_SCALES"] == "1"
        if Float8BlockScaling.use_f32_scales != want_fp32:
            raise RuntimeError("TransformerEngine was imported in this process before the megatron backend set "
                               f"NVTE_FP8_BLOCK_SCALING_FP32_SCALES={int(want_fp32)} (policy.generation.vllm_cfg."
                               "pow2_weight_scaling_factors); start the backend in a fresh process")

    @property
    def _fp8_param(self) -> bool:
        f = self.cfg.megatron_cfg.fp8_cfg
        return f.enabled and f.fp8_param

    def _build(self, keep_reference: bool, load_weights: bool):
        """(bridge, DDP model chunks, frozen reference chunks or None): one chunk per virtual pipeline stage
        (Bridge's ``get_model`` builds each with its stage's layers, embedding and output layer). With ``fp8_param``
        the weights load after the optimizer exists (``_load_fp8_params_and_main_params``); otherwise in Bridge's
        pre-wrap hook."""
        from megatron.bridge import AutoBridge
        from megatron.core.distributed import DistributedDataParallelConfig

        dtype = settings.train_dtype(self.cfg)
        if load_weights:
            bridge = AutoBridge.from_hf_pretrained(self.cfg.model_name, torch_dtype=dtype)
        else:
            from transformers import AutoConfig

            bridge = AutoBridge.from_hf_config(AutoConfig.from_pretrained(self.cfg.model_name))
        # fp8_param: TE keeps each FP8 weight's value at init as its "high-precision init value" and
        # the distributed optimizer seeds its fp32 main params from it (megatron-core
        # distrib_optimizer.py); Bridge's load hook skips the init (the value is uninitialised
        # memory), so the first optimizer step would write garbage. Initialise, load later.
        provider = bridge.to_megatron_provider(load_weights=load_weights and not self._fp8_param)
        for key, value in settings.provider_overrides(self.cfg).items():
            if not hasattr(provider, key):
                raise ValueError(f"policy.megatron_cfg.override_transformer_config.{key}: {type(provider).__name__} "
                                 "(a megatron-core TransformerConfig) has no such attribute")
            setattr(provider, key, value)
        provider.finalize()
        ddp = DistributedDataParallelConfig(**settings.ddp_config_kwargs(self.cfg))
        chunks = provider.provide_distributed_model(ddp_config=ddp, wrap_with_ddp=True)
        if self.cfg.megatron_cfg.fuse_wgrad_accumulation:
            n = sum(fuse_te_wgrad_accumulation(chunk) for chunk in chunks)
            logger.info("TE wgrad GEMMs accumulate into main_grad in %d modules", n)
        reference = None
        if keep_reference:  # a second copy, frozen, without DDP (the HF weights load again)
            reference = [c.eval().requires_grad_(False) for c in provider.provide_distributed_model(wrap_with_ddp=False)]
            if load_weights and self._fp8_param:
                bridge.load_hf_weights(reference)
        return bridge, chunks, reference

    def _load_fp8_params_and_main_params(self) -> None:
        """fp8_param: load the HF weights into the FP8 parameters (quantized in place) and the exact
        bf16 values into the optimizer's fp32 main params.

        Bridge's own HF-initialised path: ``load_hf_weights`` then ``optimizer.reload_model_params``
        (megatron/bridge/training/checkpointing.py); ``export_weight_dtype="fp8"`` makes Bridge keep
        each unquantized shard while loading (``unquantized_state_dict``), as NeMo-RL's
        ``load_main_params_from_ckpt`` does from its checkpoint, so the main params are not the
        dequantized FP8 values.
        """
        previous = self.bridge.export_weight_dtype
        self.bridge.export_weight_dtype = "fp8"  # only for the capture; the refit exports bf16
        try:
            self.bridge.load_hf_weights(self.chunks)
        finally:
            self.bridge.export_weight_dtype = previous
        unquantized = getattr(self.bridge, "unquantized_state_dict", None)
        self.optimizer.reload_model_params(state_dict=unquantized)
        self.bridge.unquantized_state_dict = None

    def _build_optimizer(self):
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
        from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

        optimizer = get_megatron_optimizer(OptimizerConfig(**settings.optimizer_config_kwargs(self.cfg)), self.chunks)
        return optimizer, OptimizerParamScheduler(optimizer, **settings.scheduler_kwargs(self.cfg))

    # ----------------------------------------------------------------------- forward
    def _padded_len(self, t: int) -> int:
        return -(-t // self.pad_multiple) * self.pad_multiple

    def _padded_forward(self, model, ids: Tensor) -> tuple[Tensor, Tensor]:
        """(logits [B, T_pad, V / tp], ids [B, T_pad]): ``ids`` [B, T] right padded to the recipe's multiple
        (causal attention: padding leaves the real positions unchanged), positions 0..T_pad-1."""
        b, t = ids.shape
        padded = self._padded_len(t)
        ids_p = torch.nn.functional.pad(ids, (0, padded - t), value=0)
        pos = torch.arange(padded, device=ids.device).expand(b, padded)
        return model(input_ids=ids_p, position_ids=pos, attention_mask=None), ids_p

    def _packed_forward(self, model, packed: PackedRows) -> Tensor:
        """Logits ``[1, T_total, V / tp]`` of one packed row in THD layout.

        megatron-core's ``PackedSeqParams(qkv_format="thd")`` carries the segment offsets to TE's attention
        (attention never crosses ``cu_seqlens``) and to RoPE, which restarts at every segment
        (``apply_rotary_pos_emb`` with ``cu_seqlens``; the position ids, restarting too, are only read by
        learned position embeddings); ``packed_seq_kwargs`` gives its fields.
        """
        from megatron.core.packed_seq_params import PackedSeqParams

        params = PackedSeqParams(**packed_seq_kwargs(packed, self.device))
        return model(input_ids=packed.token_ids, position_ids=packed.position_ids, attention_mask=None,
                     packed_seq_params=params)

    def _token_logprobs(self, logits: Tensor, ids: Tensor) -> Tensor:
        """[B, T] float32 log-probs of ``ids`` [B, T] from vocab-parallel ``logits`` [B, T, V / tp]
        (``megatron_cfg.logprob_kernel``)."""
        if self.cfg.megatron_cfg.logprob_kernel == "te":
            from transformer_engine.pytorch import parallel_cross_entropy

            return fused_token_logprobs(logits, ids, lambda x, y, g: parallel_cross_entropy(x, y, 0.0, False, g),
                                        self.temperature, group=self.tp_group)
        return vocab_parallel_token_logprobs(logits, ids, self.temperature, vocab_start=self.tp_rank * logits.shape[-1],
                                             group=self.tp_group, chunk_size=DEFAULT_CHUNK_SIZE,
                                             fused=self.cfg.megatron_cfg.logprob_kernel == "fused")

    def _forward(self, model, mb: TrainBatch, lengths: Optional[Sequence[int]] = None) -> tuple[Tensor, object]:
        """(output, ids): a model chunk's forward on ``mb``, a THD row with sequence packing (``ids`` the
        ``PackedRows``) or right padded (``ids`` the padded ``[B, T_pad]`` ids). The output is the logits on the last
        pipeline stage, the hidden states on the others. ``lengths`` as in ``pack_micro_batch``."""
        if self.spec.train_packing is not None:
            packed = pack_micro_batch(self.spec.train_packing, mb, lengths)
            return self._packed_forward(model, packed), packed
        return self._padded_forward(model, mb.token_ids)

    def _logprobs_of(self, logits: Tensor, ids, mb: TrainBatch) -> Tensor:
        """[B, T] float32 log-probs of ``mb`` from ``_forward``'s logits, 0 outside responses; a packed row's
        log-probs unpacked to ``mb``'s layout (a segment's first log-prob, scored from the previous segment, falls on
        a prompt token: masked)."""
        if isinstance(ids, PackedRows):
            lp = self._token_logprobs(logits, ids.token_ids)  # [1, T_total]
            return unpack(lp[0], ids, mb.token_ids.shape[1]) * mb.token_mask
        return self._token_logprobs(logits, ids)[:, :mb.token_ids.shape[1]] * mb.token_mask

    def _forward_logprobs(self, model, mb: TrainBatch, lengths: Optional[Sequence[int]] = None) -> Tensor:
        """[B, T] float32 log-probs of ``mb`` (on the device) through the whole model (no pipeline parallelism)."""
        return self._logprobs_of(*self._forward(model, mb, lengths), mb)

    @torch.no_grad()
    def get_logprobs(self, batch: TrainBatch, reference: bool = False) -> Tensor:
        """[B, T] float32 (CPU) log-probs of ``batch``'s responses; 0 elsewhere. With pipeline parallelism only the
        last stage's ranks return them (the others zeros; ``PolicyGroup`` reads the last stage).

        Raises:
            ValueError: ``reference=True`` without a reference model.
        """
        self.prepare_for_training()
        chunks = scoring_model(self.chunks, self.reference_chunks, reference)
        for chunk in chunks:
            chunk.eval()
            requantize_fp8_weights(chunk)
        micro_batches = logprob_micro_batches(self.spec, batch)
        if self.pp_size == 1:
            return batched_logprobs(lambda mb, lengths: self._forward_logprobs(chunks[0], mb, lengths), batch,
                                    micro_batches, self.device)
        out = torch.zeros(batch.token_ids.shape, dtype=torch.float32, device=self.device)

        def keep(index, mb, lengths, ids, logits):
            rows = row_index(micro_batches[index])
            out[rows if isinstance(rows, slice) else rows.to(self.device), :max(lengths)] = \
                self._logprobs_of(logits, ids, mb).float()

        items = list(micro_batches_on(batch, micro_batches, self.device, batch.sequence_lengths()))
        pipeline.run_micro_batches(chunks, items, self._forward, keep, True, self.pp_size, self.vpp_size)
        return out.cpu()

    # ----------------------------------------------------------------------- training
    def train(self, batch: TrainBatch, loss_fn: LossFn) -> dict[str, float]:
        """One optimizer step per ``train_global_batch_size`` rows (single data-parallel rank)."""
        return reduce_train_results([self.train_shard(batch, loss_fn)])

    def train_shard(self, batch: TrainBatch, loss_fn: LossFn,
                    micro_batches: Optional[list[list[list[int]]]] = None) -> ShardTrainResult:
        """This rank's part of ``train`` (its data-parallel group's rows of every global batch; with
        ``micro_batches``, ``PolicyGroup``'s packing plan, the rows and micro-batches it names, else
        ``train_micro_batches``: packed into THD rows with ``policy.sequence_packing``).

        Each micro-batch's loss is normalised by its global batch's valid token / sequence counts
        (summed over data-parallel ranks); megatron-core sums gradients across ranks
        (``calculate_per_token_loss``), so the update equals one rank's on the whole batch. The gradients are
        finalised by megatron-core's ``finalize_model_grads`` (Megatron-LM's training loop does the same): the
        data-parallel reduction, the sum over tensor-parallel ranks of the weights each holds whole but sees only
        part of (layer norms under sequence parallelism, Qwen3's q/k norms: they would drift apart per rank without
        it) and the tied embedding's gradient between the first and last pipeline stage. fp16
        scales the loss (``optimizer.scale_loss``); a step skipped for overflow is logged and
        reported as ``grad_norm`` NaN. With pipeline parallelism the metrics come from the last stage.

        Raises:
            ValueError: the batch fails validation or is not a multiple of the per-rank global batch.
            FloatingPointError: a non-finite gradient norm in bf16 / fp32 training.
        """
        from megatron.core.distributed import finalize_model_grads

        self.prepare_for_training()
        for chunk in self.chunks:
            chunk.train()
        memory = CudaMemoryWindow(self.device)
        memory.start()
        self._train_calls += 1
        prof = TrainProfiler(self._train_calls, self.rank, self.cfg.profile)
        result = ShardTrainResult([], [])
        if micro_batches is None:
            batch, micro_batches = train_micro_batches(self.spec, batch, self.dp_size)
        lengths = batch.sequence_lengths()
        for gb_rows, (n_tokens, n_seqs, mbs) in zip(
                micro_batches, global_batches(batch, micro_batches, self.device, self.dp_size, self.dp_group)):
            result.add_tokens(self.spec.train_packing, lengths, gb_rows, self.pad_multiple)
            for chunk in self.chunks:
                chunk.zero_grad_buffer()
                requantize_fp8_weights(chunk)  # the previous global batch's update changed the weights
            self.optimizer.zero_grad()
            acc = MetricAccumulator(loss_fn.metric_reductions)

            def loss_of(mb, logprobs, n_tokens=n_tokens, n_seqs=n_seqs, acc=acc):
                loss, metrics = loss_fn(logprobs, mb, n_tokens, n_seqs)
                acc.add(metrics)
                prof.step()
                return loss

            if self.pp_size == 1:
                for mb, mb_lengths in mbs:
                    self.optimizer.scale_loss(loss_of(mb, self._forward_logprobs(self.model, mb, mb_lengths))).backward()
            else:
                pipeline.run_micro_batches(
                    self.chunks, list(mbs), self._forward,
                    lambda index, mb, lengths, ids, logits: loss_of(mb, self._logprobs_of(logits, ids, mb)),
                    False, self.pp_size, self.vpp_size)
            finalize_model_grads(self.chunks)
            lr = float(self.optimizer.param_groups[0]["lr"])  # this update's (the scheduler steps after it)
            ok, grad_norm, _ = self.optimizer.step()
            if ok:
                self.scheduler.step(increment=1)
                self.num_updates += 1
                grad_norm = float(grad_norm)
                if not math.isfinite(grad_norm):
                    raise FloatingPointError(f"train: non-finite gradient norm {grad_norm} at update {self.num_updates}")
            else:  # fp16 overflow: megatron-core lowered the loss scale and skipped the update
                logger.warning("train: update skipped (fp16 overflow); loss scale now %s",
                               float(self.optimizer.get_loss_scale()))
                grad_norm = float("nan")
            result.accumulators.append(acc.cpu())
            result.grad_norms.append(grad_norm)
            result.lrs.append(lr)
        prof.close()
        result.memory = memory.metrics("memory/train_")
        return result

    # ----------------------------------------------------------------------- FP8 KV calibration
    @torch.no_grad()
    def calibrate_kv_scales(self, batch: TrainBatch, step: int, margin: float = 1.0) -> KvScales:
        """Per-layer amax of q, k, v over ``batch``'s real tokens -> e4m3 KV scales.

        q and k are read where attention consumes them: the inputs of each layer's
        ``core_attention`` (after q/k layernorm and RoPE), ``[S, B, heads / tp, head_dim]``, or
        ``[T_total, heads / tp, head_dim]`` for a packed THD row (``policy.sequence_packing``: the
        log-prob bins; padding tokens masked out).
        The amax is the max over tensor-parallel ranks (each holds some heads),
        data-parallel ranks and pipeline stages (each fills the rows of its layers: megatron-core's global
        ``layer_number``).
        """
        self.prepare_for_training()
        layers = [layer for chunk in self.chunks for layer in unwrap(chunk).decoder.layers]  # this stage's
        num_layers = int(unwrap(self.model).config.num_layers)  # the whole model's
        amax = torch.zeros(3, num_layers, dtype=torch.float32, device=self.device)  # [q|k|v, L]
        valid: dict[str, Tensor] = {}

        def hook_for(layer_idx: int):
            def hook(_module, args):
                real = valid["mask"]  # [S, B] bool, or [T_total] for a packed row
                for row, x in enumerate(args[:3]):
                    per_token = x.detach().abs().flatten(real.dim()).amax(-1).float()  # [S, B] / [T_total]
                    a = torch.where(real[: per_token.shape[0]], per_token, torch.zeros_like(per_token)).amax()
                    amax[row, layer_idx] = torch.maximum(amax[row, layer_idx], a)
            return hook

        handles = [layer.self_attention.core_attention.register_forward_pre_hook(hook_for(layer.layer_number - 1))
                   for layer in layers]
        for chunk in self.chunks:
            chunk.eval()
            requantize_fp8_weights(chunk)

        def forward(chunk, mb, lengths):
            if self.spec.train_packing is not None:
                valid["mask"] = real_token_mask(pack_micro_batch(self.spec.train_packing, mb, lengths))  # [T_total]
            else:
                seq_lens = mb.prompt_lengths + mb.response_lengths
                padded = self._padded_len(mb.token_ids.shape[1])
                valid["mask"] = torch.arange(padded, device=self.device)[:, None] < seq_lens[None, :]  # [S, B]
            return self._forward(chunk, mb, lengths)

        items = micro_batches_on(batch, logprob_micro_batches(self.spec, batch), self.device, batch.sequence_lengths())
        try:
            if self.pp_size == 1:
                for mb, lengths in items:
                    forward(self.model, mb, lengths)
            else:
                pipeline.run_micro_batches(self.chunks, list(items), forward, lambda *_: None, True, self.pp_size,
                                           self.vpp_size)
        finally:
            for h in handles:
                h.remove()
        dist.all_reduce(amax, op=dist.ReduceOp.MAX)  # every rank: tensor-, pipeline- and data-parallel
        return KvScales.from_amax(amax[0], amax[1], amax[2], step=step, margin=margin)

    # ----------------------------------------------------------------------- weights and lifecycle
    def named_weights(self) -> Iterator[tuple[str, Tensor]]:
        """(HF name, tensor) for every weight: Megatron-Bridge's ``export_hf_weights``, streamed.

        Every tensor-parallel rank and pipeline stage of the replica must iterate it at the same time (it gathers
        tensor-parallel shards and broadcasts each stage's layers to the others);
        the non-sending ranks call ``drain_weights``. Streams from wherever the weights are.
        """
        for name, tensor in self.bridge.export_hf_weights(self.chunks, cpu=False, show_progress=False):
            yield name, tensor

    def drain_weights(self) -> int:
        """Take part in an export that another rank sends (the gathers need every rank); returns the count."""
        return sum(1 for _ in self.named_weights())

    # ----------------------------------------------------------------------- checkpoints
    def save(self, path: str | Path) -> None:
        """Every rank: model + optimizer as megatron-core's distributed checkpoint, the weights as an HF checkpoint
        (``nemo_fp8.policy.megatron.checkpoint.save``)."""
        self.prepare_for_training()
        checkpoint.save(self, Path(path))

    def load(self, path: str | Path) -> None:
        """Load what ``save`` wrote (``nemo_fp8.policy.megatron.checkpoint.load``; learning rate and weight decay
        follow the config's schedule).

        Raises:
            FileNotFoundError: ``path`` lacks ``megatron/`` or ``optimizer.pt``.
        """
        self.prepare_for_training()
        checkpoint.load(self, Path(path))
        # the config's schedule at the checkpoint's update count (a warm-up continues where it was), not the
        # checkpoint's learning rate and weight decay
        self.scheduler.num_steps = 0
        self.scheduler.step(increment=self.num_updates)

    def shutdown(self) -> None:
        """Leave the process groups and drop the model."""
        from megatron.core import parallel_state

        self.model = self.optimizer = None  # type: ignore[assignment]
        self.chunks = self.reference_chunks = []
        gc.collect()
        if parallel_state.is_initialized():
            parallel_state.destroy_model_parallel()
        if dist.is_initialized():
            dist.destroy_process_group()

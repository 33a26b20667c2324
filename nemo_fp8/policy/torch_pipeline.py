"""Pipeline parallelism in the torch reference policy: the CPU twin of the megatron backend's stages.

With ``policy.megatron_cfg.pipeline_model_parallel_size = pp > 1`` (the megatron backend off) the policy's
``dp x pp`` ranks join one ``torch.distributed`` group (gloo on CPU, NCCL on CUDA) laid out as megatron-core lays
them out (``nemo_fp8.distributed.pipeline.ParallelLayout``: ``rank = dp_rank + dp * pp_rank``). Each rank holds one
stage of one replica:

* stage ``p`` keeps only its decoder layers (``stage_layers``: megatron-core's even split); stage 0 the embedding,
  the last stage the final norm and ``lm_head``. A model with tied embeddings (the tiny Qwen3) is split as
  megatron-core splits it: the last stage keeps its own copy of the embedding as the output layer, and after each
  backward the first and last stage sum that weight's gradient (megatron's embedding group,
  ``finalize_model_grads``), so both copies take the same update and stay equal;
* every stage receives the whole micro-batch and builds positions, rotary embeddings and the attention mask from
  it (padded rows, or packed rows with a block-causal mask); only the hidden states ``[b, t, hidden]`` (and their
  gradients) travel between stages, by ``send`` / ``recv``;
* GPipe schedule: all forwards of a global batch's micro-batches, then all backwards in the same order (every stage
  walks the same order, so the blocking point-to-point calls cannot deadlock). It holds every micro-batch's
  activations; megatron-core's 1F1B holds at most ``pp`` of them. The update is the same either way;
* log-probs and the loss are computed on the last stage, whose answers ``PolicyGroup`` reads
  (``ParallelLayout.read_rank``); gradients are summed over the data-parallel ranks of each stage, the clipping
  norm is the global one (the squared norms summed over the stages; the output layer's copy of a tied embedding
  counted once, as megatron-core's ``param_is_not_shared``); each stage's AdamW steps its own parameters.

The refit: rank 0 (stage 0 of replica 0) streams every tensor of the full model under its global HF name, its own
first, then each later stage's, received from that stage's replica-0 rank (which joins through ``drain_weights``):
every tensor once, in the full model's ``state_dict`` order. ``save`` gathers the same stream into one HF
checkpoint on rank 0 (``model/``, loadable by every tool); each stage of replica 0 writes its optimizer state
(``optimizer.pt`` for stage 0, ``optimizer_pp{p}.pt`` for the others), so ``--resume`` needs the same
``pipeline_model_parallel_size``.
"""

from __future__ import annotations

import copy
import logging
import math
from pathlib import Path
from typing import Callable, Iterator, Optional, Sequence

import torch
import torch.distributed as dist
from torch import Tensor, nn

from nemo_fp8.batch import TrainBatch
from nemo_fp8.distributed.pipeline import PP_KEY, global_layer_name, stage_layers
from nemo_fp8.fp8.kv_scales import KvScales
from nemo_fp8.models.hf import DTYPES, attention_mask_for, load_causal_lm, record_qkv_amax, token_logprobs
from nemo_fp8.policy.interfaces import LossFn
from nemo_fp8.policy.packing import block_causal_mask, unpack
from nemo_fp8.policy.spec import PolicySpec
from nemo_fp8.policy.torch_backend import (ShardTrainResult, TorchPolicyBackend, enable_fp8_training,
                                           global_batches, logprob_micro_batches, micro_batches_on,
                                           pack_micro_batch, row_index, scoring_model, train_micro_batches)
from nemo_fp8.utils.metrics import MetricAccumulator

logger = logging.getLogger(__name__)

# (token ids [b, t], attention mask: [b, t] padding or [1, 1, T, T] block-causal, position ids or None,
#  finish: the last stage's logits [b, t, V] -> masked log-probs [b, t] in the micro-batch's layout)
StageInputs = tuple[Tensor, Tensor, Optional[Tensor], Callable[[Tensor], Tensor]]


def split_stage(model: nn.Module, layers: range, first: bool, last: bool) -> nn.Module:
    """Keep only stage ``layers`` of an HF decoder LM (``model.model.layers``, ``embed_tokens``, ``norm``,
    ``lm_head``), in place: the embedding on the first stage, the final norm and ``lm_head`` on the last. A tied
    ``lm_head`` on a last stage without the embedding keeps the same tensor as a weight of its own (megatron-core's
    output-layer copy). Layers keep their global ``layer_idx`` (KV calibration rows); their module names restart
    at 0 (``global_layer_name`` maps them back).

    Raises:
        ValueError: a model without ``model.layers`` / ``embed_tokens`` / ``norm`` / ``lm_head``.
    """
    inner = getattr(model, "model", None)
    if inner is None or not all(hasattr(inner, a) for a in ("layers", "embed_tokens", "norm")) \
            or not hasattr(model, "lm_head"):
        raise ValueError(f"{PP_KEY} > 1 in the torch backend needs an HF decoder LM with model.layers, "
                         f"model.embed_tokens, model.norm and lm_head; {type(model).__name__} has other parts")
    inner.layers = nn.ModuleList([inner.layers[i] for i in layers])
    if not first:
        inner.embed_tokens = None
    if not last:
        inner.norm = None
        model.lm_head = None
    return model


def stage_forward(model: nn.Module, layer_ids: Sequence[int], ids: Tensor, attention_mask: Tensor,
                  position_ids: Optional[Tensor], hidden: Optional[Tensor]) -> Tensor:
    """One stage's part of the HF decoder forward (``Qwen3Model.forward`` / ``Qwen3ForCausalLM.forward`` of
    transformers 5.x, step for step, so PP 1 and PP n compute the same numbers).

    Args:
        model: a ``split_stage`` model.
        layer_ids: the global index of each kept layer (its ``config.layer_types`` entry).
        ids: [b, t] int64 token ids (the first stage embeds them; the others only need the shape).
        attention_mask: [b, t] 1 on real tokens, or a 4-D boolean mask (packed rows).
        position_ids: [1 or b, t] int64, or None: 0..t-1.
        hidden: [b, t, hidden] from the previous stage; None on the first stage.

    Returns:
        [b, t, hidden] hidden states, or on the last stage [b, t, V] logits.
    """
    from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

    inner = model.model
    h = inner.embed_tokens(ids) if hidden is None else hidden
    if position_ids is None:
        position_ids = torch.arange(h.shape[1], device=h.device)[None]
    args = dict(config=inner.config, inputs_embeds=h, attention_mask=attention_mask, cache=None,
                position_ids=position_ids)
    masks = {"full_attention": create_causal_mask(**args)}
    if getattr(inner, "has_sliding_layers", False):
        masks["sliding_attention"] = create_sliding_window_causal_mask(**args)
    types = getattr(inner.config, "layer_types", None)
    rope = inner.rotary_emb(h, position_ids)
    for i, layer in zip(layer_ids, inner.layers):
        h = layer(h, attention_mask=masks[types[i] if types else "full_attention"], position_embeddings=rope,
                  position_ids=position_ids)
    if model.lm_head is None:
        return h
    return model.lm_head(inner.norm(h))


class TorchPipelineBackend(TorchPolicyBackend):
    """One rank (one stage of one data-parallel replica) of the torch policy with pipeline stages; see the module
    docstring. The lifecycle (offload, learning-rate schedule) is ``TorchPolicyBackend``'s.

    Args:
        spec: the run's ``PolicySpec`` (``spec.pp_size`` stages, ``spec.vpp_size`` None).
        rank, world_size: this rank of ``dp x pp`` (``spec.layout``'s order).
        dist_init_method: ``tcp://host:port`` of rank 0.

    Raises:
        ValueError: a virtual pipeline size, a world size that is not ``data_parallel_size x pp``, layers that do
            not split evenly over the stages (the message names the key), or no ``dist_init_method``.
    """

    def __init__(self, spec: PolicySpec, rank: int, world_size: int, dist_init_method: Optional[str]):
        cfg = spec.cfg
        if (spec.vpp_size or 1) > 1:
            raise ValueError("policy.megatron_cfg.virtual_pipeline_model_parallel_size: only the megatron backend "
                             "interleaves (valid for the torch backend: null)")
        layout = spec.layout
        if layout.world_size != world_size:
            raise ValueError(f"TorchPipelineBackend: {world_size} ranks, the layout {layout} needs "
                             f"{layout.world_size}")
        if dist_init_method is None:
            raise ValueError("TorchPipelineBackend: pipeline stages need dist_init_method (tcp://host:port of rank 0)")
        self.spec, self.cfg, self.device, self.temperature = spec, cfg, spec.device, spec.temperature
        self.layout, self.rank = layout, rank
        _, self.dp_rank, self.pp_rank = layout.coords(rank)
        self.dp_size, self.pp_size = layout.dp, layout.pp
        self.first, self.last = self.pp_rank == 0, self.pp_rank == layout.pp - 1
        dist.init_process_group("nccl" if self.device.type == "cuda" else "gloo", init_method=dist_init_method,
                                rank=rank, world_size=world_size)
        model = load_causal_lm(cfg.model_name, DTYPES[cfg.precision], self.device)
        self.num_layers = int(model.config.num_hidden_layers)
        self.layer_ids = stage_layers(self.num_layers, layout.pp, self.pp_rank)[0]
        self.tied = bool(getattr(model.config, "tie_word_embeddings", False))
        self._make_groups()
        reference = copy.deepcopy(model).eval().requires_grad_(False) if spec.keep_reference else None
        self.fp8_modules = enable_fp8_training(model, cfg) if cfg.megatron_cfg.fp8_cfg.enabled else []  # global names
        self.model = split_stage(model, self.layer_ids, self.first, self.last)
        self.reference = split_stage(reference, self.layer_ids, self.first, self.last) if reference else None
        opt = cfg.optimizer
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=opt.lr, weight_decay=opt.weight_decay,
                                           betas=tuple(opt.betas), eps=opt.eps)
        self.num_updates = 0
        self._offloaded: set[str] = set()
        logger.info("policy rank %d: pipeline stage %d/%d (layers %d..%d), data-parallel rank %d/%d", rank,
                    self.pp_rank, layout.pp, self.layer_ids.start, self.layer_ids.stop - 1, self.dp_rank, layout.dp)

    def _make_groups(self) -> None:
        """This rank's data-parallel group (its stage's ranks), pipeline group (its replica's stages) and, with
        tied embeddings, embedding group (its replica's first and last stage). Every rank creates every group, in
        one order (``new_group`` is collective over the whole world)."""
        lay = self.layout
        self.dp_group = self.pp_group = self.embedding_group = None
        for p in range(lay.pp):
            g = dist.new_group(lay.data_parallel_ranks(0, p))
            if p == self.pp_rank:
                self.dp_group = g
        for d in range(lay.dp):
            ranks = lay.stage_ranks(0, d)
            g = dist.new_group(ranks)
            e = dist.new_group([ranks[0], ranks[-1]]) if self.tied else None
            if d == self.dp_rank:
                self.pp_group, self.embedding_group = g, e

    def _peer(self, step: int) -> int:
        """The rank of the stage ``step`` away in this replica (-1: previous, +1: next)."""
        return self.layout.rank_of(0, self.dp_rank, self.pp_rank + step)

    # ----------------------------------------------------------------------- the stage forward
    def _stage_inputs(self, mb: TrainBatch, lengths: Optional[Sequence[int]]) -> StageInputs:
        """What every stage derives from the micro-batch itself: padded rows, or with sequence packing one packed
        row with a block-causal mask and restarting positions (``TorchPolicyBackend._forward_packed``'s)."""
        mask_out = mb.token_mask.to(self.device)
        if self.spec.train_packing is None:
            ids = mb.token_ids.to(self.device)
            attn = attention_mask_for(mb.prompt_lengths, mb.response_lengths, ids.shape[1]).to(self.device)
            return ids, attn, None, lambda logits: token_logprobs(logits, ids, self.temperature) * mask_out
        packed = pack_micro_batch(self.spec.train_packing, mb, lengths)
        ids = packed.token_ids.to(self.device)
        attn = block_causal_mask(packed.cu_seqlens_padded.to(self.device), packed.total_tokens)[None, None]
        width = mb.token_ids.shape[1]
        return (ids, attn, packed.position_ids.to(self.device),
                lambda logits: unpack(token_logprobs(logits, ids, self.temperature)[0], packed, width) * mask_out)

    def _forward(self, model: nn.Module, inputs: StageInputs, grad: bool) -> tuple[Optional[Tensor], Tensor]:
        """(the hidden states received, or None on stage 0; this stage's output): receive from the previous
        stage, run this stage, send to the next one (the last stage keeps its logits)."""
        ids, attn, pos, _ = inputs
        received = None
        if not self.first:
            received = torch.empty(*ids.shape, model.config.hidden_size, dtype=DTYPES[self.cfg.precision],
                                   device=self.device)
            dist.recv(received, self._peer(-1))
            received.requires_grad_(grad)
        out = stage_forward(model, self.layer_ids, ids, attn, pos, received)
        if not self.last:
            dist.send(out.detach().contiguous(), self._peer(+1))
        return received, out

    # ----------------------------------------------------------------------- log-probs
    @torch.no_grad()
    def get_logprobs(self, batch: TrainBatch, reference: bool = False) -> Tensor:
        """[B, T] float32 (CPU) log-probs of ``batch``'s responses on the last stage (zeros on the others, which
        only pass hidden states on).

        Raises:
            ValueError: ``reference=True`` without a reference model.
        """
        self.prepare_for_training()
        model = scoring_model(self.model, self.reference, reference)
        was_training = model.training
        model.eval()
        out = torch.zeros(batch.token_ids.shape, dtype=torch.float32)
        lengths = batch.sequence_lengths()
        mbs = logprob_micro_batches(self.spec, batch)
        for rows, (mb, lens) in zip(mbs, micro_batches_on(batch, mbs, self.device, lengths)):
            inputs = self._stage_inputs(mb, lens)
            _, logits = self._forward(model, inputs, grad=False)
            if self.last:
                out[row_index(rows), :max(lens)] = inputs[3](logits).float().cpu()
        model.train(was_training)
        return out

    # ----------------------------------------------------------------------- training
    def train_shard(self, batch: TrainBatch, loss_fn: LossFn,
                    micro_batches: Optional[list[list[list[int]]]] = None) -> ShardTrainResult:
        """This stage's part of ``TorchPolicyBackend.train_shard`` (the same arguments, rows and micro-batches;
        every stage of a data-parallel group gets the same ones). The result's metrics are the last stage's (the
        other stages' accumulators are empty); the grad norm is the global one on every stage.

        Raises:
            ValueError: as ``TorchPolicyBackend.train_shard``.
            FloatingPointError: a non-finite global gradient norm (on every stage).
        """
        self.prepare_for_training()
        self.model.train()
        result = ShardTrainResult([], [])
        if micro_batches is None:
            batch, micro_batches = train_micro_batches(self.spec, batch, self.dp_size)
        lengths = batch.sequence_lengths()
        for gb_rows, (n_tokens, n_seqs, mbs) in zip(
                micro_batches, global_batches(batch, micro_batches, self.device, self.dp_size, self.dp_group)):
            result.add_tokens(self.spec.train_packing, lengths, gb_rows)
            self.optimizer.zero_grad(set_to_none=True)
            acc = MetricAccumulator(loss_fn.metric_reductions)
            held = []  # GPipe: every micro-batch's (received, output or loss) until the backward pass
            for mb, mb_lengths in mbs:
                inputs = self._stage_inputs(mb, mb_lengths)
                received, out = self._forward(self.model, inputs, grad=True)
                if self.last:
                    loss, metrics = loss_fn(inputs[3](out), mb, n_tokens, n_seqs)
                    acc.add(metrics)
                    out = loss
                held.append((received, out))
            for received, out in held:
                if self.last:
                    out.backward()
                else:
                    grad = torch.empty_like(out)
                    dist.recv(grad, self._peer(+1))
                    out.backward(grad)
                if not self.first:
                    dist.send(received.grad.contiguous(), self._peer(-1))
            del held
            self._reduce_grads()
            grad_norm = self._clip_grads()
            if not math.isfinite(grad_norm):
                raise FloatingPointError(f"train: non-finite gradient norm {grad_norm} at update {self.num_updates}")
            self._set_lr()
            self.optimizer.step()
            self.num_updates += 1
            if self.last:
                result.accumulators.append(acc.cpu())
            result.grad_norms.append(grad_norm)
            result.lrs.append(self.optimizer.param_groups[0]["lr"])
        return result

    def _shared_embedding(self) -> Optional[Tensor]:
        """The tied embedding's copy on this stage (stage 0: the embedding, the last stage: ``lm_head``), or None
        (untied, or a middle stage)."""
        if not self.tied:
            return None
        if self.first:
            return self.model.model.embed_tokens.weight
        return self.model.lm_head.weight if self.last else None

    def _reduce_grads(self) -> None:
        """Sum gradients over this stage's data-parallel ranks, then the tied embedding's over the first and last
        stage (megatron-core's ``finalize_model_grads`` order)."""
        if self.dp_size > 1:
            grads = [p.grad for p in self.model.parameters() if p.grad is not None]
            for dtype in {g.dtype for g in grads}:
                group = [g for g in grads if g.dtype == dtype]
                flat = torch.cat([g.reshape(-1) for g in group])
                dist.all_reduce(flat, group=self.dp_group)
                offset = 0
                for g in group:
                    g.copy_(flat[offset:offset + g.numel()].view_as(g))
                    offset += g.numel()
        shared = self._shared_embedding()
        if shared is not None:
            if shared.grad is None:
                shared.grad = torch.zeros_like(shared)
            dist.all_reduce(shared.grad, group=self.embedding_group)

    def _clip_grads(self) -> float:
        """Clip to ``policy.max_grad_norm`` by the global L2 norm over every stage (the squared norms summed in
        the pipeline group; the last stage's copy of a tied embedding left out, it is stage 0's gradient); the
        formula of ``torch.nn.utils.clip_grad_norm_``: ``g *= min(1, max_norm / (norm + 1e-6))``. Returns the
        norm before clipping."""
        params = [p for p in self.model.parameters() if p.grad is not None]
        skip = self.model.lm_head.weight if (self.tied and self.last and not self.first) else None
        counted = [p.grad for p in params if p is not skip]
        sq = torch.stack([torch.linalg.vector_norm(g) for g in counted]).square().sum() if counted \
            else torch.zeros((), device=self.device)
        sq = sq.to(torch.float64) if sq.dtype != torch.float64 else sq
        dist.all_reduce(sq, group=self.pp_group)
        norm = sq.sqrt()
        coef = (self.cfg.max_grad_norm / (norm + 1e-6)).clamp(max=1.0)
        for p in params:
            p.grad.mul_(coef.to(p.grad.dtype))
        return float(norm)

    # ----------------------------------------------------------------------- FP8 KV calibration
    @torch.no_grad()
    def calibrate_kv_scales(self, batch: TrainBatch, step: int, margin: float = 1.0) -> KvScales:
        """``TorchPolicyBackend.calibrate_kv_scales`` over the stages: each stage records its layers' q/k/v amax
        as the batch passes through, then the max over every rank (all stages and replicas)."""
        self.prepare_for_training()
        was_training = self.model.training
        self.model.eval()
        amax = torch.zeros(3, self.num_layers, dtype=torch.float32, device=self.device)  # [q|k|v, L]
        step_rows = self.cfg.logprob_batch_size
        for i in range(0, batch.size, step_rows):
            mb = batch.select(slice(i, i + step_rows)).trimmed()
            ids = mb.token_ids.to(self.device)
            attn = attention_mask_for(mb.prompt_lengths, mb.response_lengths, ids.shape[1]).to(self.device)
            with record_qkv_amax(self.model, attn, amax):
                self._forward(self.model, (ids, attn, None, lambda x: x), grad=False)
        self.model.train(was_training)
        dist.all_reduce(amax, op=dist.ReduceOp.MAX)
        return KvScales.from_amax(amax[0], amax[1], amax[2], step=step, margin=margin)

    # ----------------------------------------------------------------------- weights
    def local_named_weights(self) -> Iterator[tuple[str, Tensor]]:
        """(global HF name, detached tensor) of this stage's weights, in ``state_dict`` order."""
        offset = self.layer_ids.start
        for name, t in self.model.state_dict().items():
            if t.is_floating_point() and not name.endswith("inv_freq"):
                yield global_layer_name(name, offset), t.detach()

    def named_weights(self) -> Iterator[tuple[str, Tensor]]:
        """On rank 0: every weight of the full model, each once under its global name (this stage's, then each
        later stage's from replica 0's rank of that stage, which runs ``drain_weights`` meanwhile); on any other
        rank: its own stage's.
        """
        yield from self.local_named_weights()
        if self.rank != 0:
            return
        for src in self.layout.replica_ranks(0)[1:]:
            meta = [None]
            dist.recv_object_list(meta, src)
            for name, shape, dtype in meta[0]:
                t = torch.empty(shape, dtype=dtype, device=self.device)
                dist.recv(t, src)
                yield name, t

    def drain_weights(self) -> int:
        """Send this stage's weights to rank 0 for its ``named_weights`` (replica 0's later stages; the other
        ranks send nothing). Returns the tensors sent."""
        if self.rank == 0 or self.rank not in self.layout.replica_ranks(0):
            return 0
        weights = list(self.local_named_weights())
        dist.send_object_list([[(n, tuple(t.shape), t.dtype) for n, t in weights]], 0)
        for _, t in weights:
            dist.send(t.contiguous(), 0)
        return len(weights)

    def shutdown(self) -> None:
        """Leave the process group and drop the model."""
        if dist.is_initialized():
            dist.destroy_process_group()
        self.model = self.reference = None  # type: ignore[assignment]

    def save(self, path: str | Path) -> None:
        """Rank 0 writes the full model as one HF checkpoint (``model/config.json`` + ``model.safetensors``, the
        tied ``lm_head.weight`` left out as ``save_pretrained`` does) from the export stream; each stage of replica
        0 writes its optimizer state (stage 0: ``optimizer.pt``, stage ``p``: ``optimizer_pp{p}.pt``). Collective: every
        rank calls it and returns once the checkpoint is complete."""
        from safetensors.torch import save_file

        if self.dp_rank == 0:
            path = Path(path)
            path.mkdir(parents=True, exist_ok=True)
            self.prepare_for_training()
            if self.rank == 0:
                state = {n: t.detach().to("cpu", copy=True).contiguous() for n, t in self.named_weights()}
                if self.tied:
                    state.pop("lm_head.weight", None)
                (path / "model").mkdir(exist_ok=True)
                self.model.config.save_pretrained(path / "model")
                save_file(state, str(path / "model" / "model.safetensors"), metadata={"format": "pt"})
            else:
                self.drain_weights()
            torch.save({"optimizer": self.optimizer.state_dict(), "num_updates": self.num_updates,
                        "pipeline_stages": self.pp_size}, path / self._optimizer_file())
        dist.barrier()  # every rank returns once the whole checkpoint is written

    def _optimizer_file(self) -> str:
        return "optimizer.pt" if self.first else f"optimizer_pp{self.pp_rank}.pt"

    def load(self, path: str | Path) -> None:
        """Load what ``save`` wrote: this stage's weights out of the full checkpoint, then its optimizer state.

        Raises:
            FileNotFoundError: ``path`` lacks ``model/*.safetensors`` or this stage's optimizer file.
            ValueError: a checkpoint of another number of pipeline stages, or weights missing.
        """
        from safetensors.torch import load_file

        self.prepare_for_training()
        path = Path(path)
        files = sorted((path / "model").glob("*.safetensors"))
        opt_file = path / self._optimizer_file()
        if not files or not opt_file.is_file():
            raise FileNotFoundError(f"policy checkpoint {path} needs model/*.safetensors and {opt_file.name} "
                                    f"(written with {PP_KEY}={self.pp_size})")
        full = {}
        for f in files:
            full.update(load_file(str(f), device=str(self.device)))
        if self.tied and "lm_head.weight" not in full and "model.embed_tokens.weight" in full:
            full["lm_head.weight"] = full["model.embed_tokens.weight"]
        offset = self.layer_ids.start
        state, missing = {}, []
        for name, t in self.model.state_dict().items():
            if name.endswith("inv_freq"):
                continue
            key = global_layer_name(name, offset)
            if key in full:
                state[name] = full[key]
            else:
                missing.append(key)
        if missing:
            raise ValueError(f"policy checkpoint {path}: missing {missing[:5]} for pipeline stage {self.pp_rank}")
        self.model.load_state_dict(state, strict=False)
        extra = torch.load(opt_file, map_location=self.device, weights_only=True)
        if int(extra.get("pipeline_stages", 1)) != self.pp_size:
            raise ValueError(f"policy checkpoint {path}: optimizer state of {extra.get('pipeline_stages', 1)} "
                             f"pipeline stage(s), this run has {PP_KEY}={self.pp_size} (resume with the same value)")
        self.optimizer.load_state_dict(extra["optimizer"])
        for group in self.optimizer.param_groups:
            group["weight_decay"] = self.cfg.optimizer.weight_decay
        self.num_updates = int(extra["num_updates"])
        self._set_lr()

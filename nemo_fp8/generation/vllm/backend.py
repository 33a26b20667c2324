"""``VllmGenerationBackend``: the rollout engine behind ``GenerationBackend``, in FP8 or BF16.

Owns one ``vllm.LLM`` started from the model's config with ``load_format="dummy"``: the first
refit brings the real weights (the backend does that itself from ``model_name``'s checkpoint when
``load_initial_weights`` is set). Refit: ``start_weight_update`` -> ``update_weights`` (buckets of
HF-named high-precision tensors, quantized on the GPU and sent over CUDA IPC; the trainer may call
``send_weights_ipc`` / ``send_weights_nccl`` from ``refit`` directly instead) ->
``finish_weight_update`` (vLLM's layerwise reload, in place; with ``vllm_cfg.refit_format: kernel`` the tensors
are stacked into the engine's own parameters and vLLM copies them in, ``kernel_format``). Generation returns
``processed_logprobs``: log-probs of the distribution actually sampled (logits / temperature).
Sleep/wake (level 1) for colocation.

Tensor parallelism (``vllm_cfg.tensor_parallel_size`` n > 1): vLLM's multiprocessing executor runs
one worker per GPU of this process's ``CUDA_VISIBLE_DEVICES`` (the trainer's engine actor sets it
to its n GPUs, ``nemo_fp8.generation.group``). ``update_weights`` quantizes each bucket on
``cuda:0``, copies it to ``cuda:1 .. cuda:n-1`` and sends every worker the handle of the copy on
its own GPU (``send_weights_ipc(devices=...)``); each worker loads the full tensors and keeps its
shard. The trainer-side CUDA IPC refit (``direct_refit_spec``) sends one GPU's handles and is
refused for such an engine.

NCCL engine (``weight_transfer="nccl"``, ``policy.weight_sync.method: nccl``; the engine on GPUs of its
own): vLLM 0.22's ``NCCLWeightTransferEngine``. ``init_weight_transfer`` joins the engine's n workers to
the trainer's NCCL group once (ranks 1..n; the trainer is rank 0); each refit's buckets are broadcast by
the trainer (``refit.send_weights_nccl``), the engine actor only passes their names/dtypes/shapes to
``LLM.update_weights`` (``receive_update``). Such an engine takes no tensors itself: ``update_weights``
is refused and the initial load from ``model_name`` is skipped, so it holds dummy weights until the
trainer's first refit (version 0, before the first rollout) and ``generate`` refuses until then.
"""

from __future__ import annotations

import logging
from typing import Iterable, Mapping, Optional, Sequence

import torch
from torch import Tensor

from nemo_fp8.batch import GenerationOutput
from nemo_fp8.fp8.kv_scales import KV_SCALE_NAME, is_kv_scale_name, parse_kv_scale_name
from nemo_fp8.generation.config import VllmConfig
from nemo_fp8.generation.interfaces import (SamplingParams, WeightVersion, one_engine_metrics, request_max_new_tokens,
                                            request_seed)
from nemo_fp8.generation.vllm.engine_args import init_fp8
from nemo_fp8.generation.vllm.kernel_format import KernelLayout
from nemo_fp8.generation.vllm.refit import DEFAULT_BUCKET_BYTES, nccl_init_info, send_weights_ipc
from nemo_fp8.models.hf import iter_checkpoint, model_config

logger = logging.getLogger(__name__)


class VllmGenerationBackend:
    """See the module docstring.

    Args:
        model_name: local HF folder (config; weights when ``load_initial_weights``).
        vllm_cfg: ``policy.generation.vllm_cfg``.
        pad_token_id, eos_token_id: from the tokenizer.
        max_total_sequence_length: prompt + response cap (also the engine's ``max_model_len``
            unless ``vllm_cfg.max_model_len`` is set).
        colocated: enable sleep mode (trainer on the same GPU).
        load_initial_weights: refit version 0 from ``model_name``'s safetensors at start (CUDA IPC; ignored by
            an NCCL engine, whose first weights come from the trainer's first refit).
        seed: engine seed.
        engine_overrides: extra ``vllm.LLM`` keyword arguments (tests, benchmarks).
        weight_transfer: vLLM's ``weight_transfer_config`` backend: ``"ipc"`` (tensors handed to this process,
            ``update_weights``, or CUDA IPC handles from a trainer on the same GPU) or ``"nccl"`` (broadcast
            from a trainer on other GPUs; module docstring).

    Raises:
        ValueError: invalid engine config, or ``weight_transfer`` not ``"ipc"`` / ``"nccl"`` (``init_fp8``).
    """

    def __init__(self, model_name: str, vllm_cfg: VllmConfig, pad_token_id: int, eos_token_id: int,
                 max_total_sequence_length: int, colocated: bool = True, load_initial_weights: bool = True,
                 seed: int = 0, bucket_bytes: int = DEFAULT_BUCKET_BYTES, engine_overrides: Optional[dict] = None,
                 device: Optional[torch.device] = None, batch_size: Optional[int] = None,
                 weight_transfer: str = "ipc"):
        from vllm import LLM

        self.vllm_cfg = vllm_cfg
        self.pad_token_id, self.eos_token_id = pad_token_id, eos_token_id
        self.max_total_sequence_length = max_total_sequence_length
        self.bucket_bytes = bucket_bytes
        overrides = dict(engine_overrides or {})
        if vllm_cfg.max_model_len is None:
            overrides.setdefault("max_model_len", max_total_sequence_length)
        self.spec = init_fp8(vllm_cfg, model_name, model_name, weight_transfer=weight_transfer, colocated=colocated,
                             seed=seed, extra=overrides)
        self.weight_transfer = weight_transfer
        self._nccl_joined = False  # init_weight_transfer done: this engine's workers hold an NCCL communicator
        self.plan = self.spec.refit_plan
        # A tied lm_head is the embedding in vLLM: the trainer's state dict still lists it; skip it.
        self._tied = {"lm_head.weight"} if _tie_word_embeddings(model_name) else set()
        self.num_layers = int(model_config(model_name)["num_hidden_layers"])
        self.kv_fp8 = vllm_cfg.kv_cache_is_fp8
        tp = vllm_cfg.tensor_parallel_size
        # The engine's workers' GPUs as this process numbers them (vLLM's worker i runs on cuda:i).
        self.refit_devices = [torch.device("cuda", i) for i in range(tp)] if tp > 1 else None
        self.llm = LLM(**self.spec.engine_kwargs)
        # vllm_cfg.refit_format: kernel: every refit, the first load too, copies into the engine's own parameters
        self.kernel_layout = self._kernel_layout() if vllm_cfg.refit_format == "kernel" else None
        self._version = WeightVersion()
        self._pending: Optional[int] = None
        self._seen: set[str] = set()
        self._sent = 0
        self._asleep_tags: set[str] = set()  # what sleep() released and no wake_up restored yet
        self._discarded = False  # sleep(level=2) dropped the weights; only a complete refit brings them back
        self._kv_held: dict = {}  # FP8 KV: the scales the last refit left in the layers (restored after a KV wake)
        self._refused: Optional[str] = None  # why the last refit was refused (the engine must not generate)
        if load_initial_weights and weight_transfer == "nccl":
            logger.info("NCCL weight transfer: no initial load from %s; the trainer's first refit brings the weights",
                        model_name)
        elif load_initial_weights:
            self.start_weight_update(0)
            self.update_weights(iter_checkpoint(model_name))
            self.finish_weight_update(require_kv_scales=False)

    # ------------------------------------------------------------------ refit

    def _kernel_layout(self) -> KernelLayout:
        """The engine's parameters as its worker reports them (``nemo_fp8_kernel_params``), checked against the
        converted tensors of a whole refit (``RefitPlan.converted_shapes``, ``KernelLayout.check``); then every
        parameter's ``requires_grad`` turned off (``nemo_fp8_freeze_params``) for vLLM's direct copy.

        Raises:
            RuntimeError: an FP8 engine whose linears run another kernel than CUTLASS's block-scaled one (DeepGEMM
                re-lays its weights out after loading: not a format a refit can copy into).
            ValueError: a refit that would not cover the engine's parameters (``KernelLayout.check``).
        """
        info = self.llm.collective_rpc("nemo_fp8_kernel_params")[0]
        if self.vllm_cfg.precision == "fp8" and info["linear_kernels"] != ["CutlassFp8BlockScaledMMKernel"]:
            raise RuntimeError(f"vllm_cfg.refit_format: 'kernel' needs the FP8 linears on CUTLASS's block-scaled "
                               f"kernel, this engine runs {info['linear_kernels']} (use_deep_gemm: false; or "
                               "refit_format: checkpoint)")
        layout = KernelLayout({n: (d, list(s)) for n, (d, s) in info["params"].items()}, info["packed"])
        layout.check(self.plan.converted_shapes(), skip=self._tied)
        self.llm.collective_rpc("nemo_fp8_freeze_params")  # vLLM's direct copy refuses parameters requiring grad
        return layout

    def start_weight_update(self, version: int) -> None:
        if self._pending is not None:
            raise RuntimeError(f"start_weight_update({version}): a refit to version {self._pending} is in progress")
        if "weights" in self._asleep_tags:  # a refit needs the weights back, not the KV cache yet
            self.llm.wake_up(tags=["weights"])
            self._asleep_tags.discard("weights")
        self.llm.start_weight_update(is_checkpoint_format=self.kernel_layout is None)
        self._pending, self._seen, self._sent = version, set(), 0

    def update_weights(self, named_tensors: Mapping[str, Tensor] | Iterable[tuple[str, Tensor]],
                       packed: bool = False, packer=None) -> None:
        """Load one bucket of ``(HF name, high-precision tensor)`` (any device): quantized on ``cuda:0`` and sent
        to the engine's workers over CUDA IPC (``send_weights_ipc``; ``packed`` / ``packer``: its packed buckets,
        filled in place by a ``packed_in_place.InPlacePacker`` after the first refit).

        Raises:
            RuntimeError: no refit in progress; or an NCCL engine (its weights arrive only by broadcast from
                the trainer, ``policy.weight_sync.method: nccl``).
            KeyError: a name the engine's model has no weight for.
        """
        if self.weight_transfer == "nccl":
            raise RuntimeError("update_weights: this engine was built with vLLM's NCCL weight transfer "
                               "(policy.weight_sync.method='nccl'); it receives weights only by NCCL broadcast from "
                               "the trainer (NcclWeightSync), not as tensors handed to it (CUDA IPC)")
        if self._pending is None:
            raise RuntimeError("update_weights before start_weight_update")
        items = [(n, t) for n, t in (named_tensors.items() if isinstance(named_tensors, Mapping) else named_tensors)
                 if n not in self._tied]
        self._seen.update(self.plan.checked_names(n for n, _ in items))
        self._sent += send_weights_ipc(items, self.llm.update_weights, self.plan, self.bucket_bytes,
                                       devices=self.refit_devices, layout=self.kernel_layout, packed=packed,
                                       packer=packer)

    def direct_refit_spec(self) -> dict:
        """What a trainer needs to send straight to this engine (``send_weights_ipc`` in its own process):
        ``plan`` (``RefitPlan``), ``skip`` (HF names the engine does not take: a tied ``lm_head``) and ``layout``
        (the ``KernelLayout`` its refits are copied in, ``vllm_cfg.refit_format: kernel``; else None).

        An NCCL engine of any tensor parallelism answers too: the broadcast reaches every worker.

        Raises:
            RuntimeError: a tensor-parallel CUDA IPC engine: a trainer's handles cover its own GPU only, the
                other workers would find none (``policy.weight_sync.method``: ``object_store`` or ``auto`` instead).
        """
        if self.refit_devices is not None and self.weight_transfer == "ipc":
            raise RuntimeError(f"direct CUDA IPC refit into an engine of tensor_parallel_size={len(self.refit_devices)}"
                               ": the trainer's handles are for its own GPU only; use policy.weight_sync.method "
                               "'object_store' or 'auto' (the engine then sends every worker its own copy)")
        return {"plan": self.plan, "skip": set(self._tied), "layout": self.kernel_layout}

    def receive_update(self, payload: dict) -> None:
        """One bucket a trainer sent directly: ``payload`` is ``{"update_info": ...}`` of vLLM's weight-transfer
        engine, loaded by ``LLM.update_weights``. ``note_sent`` records the names after.

        CUDA IPC: the info carries the handles. NCCL: it carries names/dtypes/shapes only and the call returns
        once the workers have received the trainer's broadcast of them and loaded it (vLLM 0.22's
        ``NCCLWeightTransferEngine.receive_weights``).

        Raises:
            RuntimeError: no refit in progress (``start_weight_update`` first).
        """
        if self._pending is None:
            raise RuntimeError("receive_update before start_weight_update")
        self.llm.update_weights(payload)

    def note_sent(self, names: Iterable[str], num_tensors: int) -> None:
        """Record tensors the trainer sent directly (``send_weights_ipc``/``_nccl``) for the checks.

        Raises:
            KeyError: a name the generation model has no weight for.
        """
        self._seen.update(self.plan.checked_names(names))
        self._sent += num_tensors

    def init_weight_transfer(self, master_address: str, master_port: int, world_size: int,
                             rank_offset: int = 1) -> None:
        """Join this engine's workers to the trainer's NCCL group (once, at start; NCCL engine only).

        The workers take ranks ``rank_offset..rank_offset+n-1`` of ``world_size`` (``refit.nccl_init_info``;
        engine ``i`` of ``e`` engines of ``n`` GPUs: ``rank_offset = 1 + i*n``, ``world_size = 1 + e*n``) through
        ``LLM.init_weight_transfer_engine`` and block until every rank, the trainer's rank 0 among them, joins
        (``refit.nccl_trainer_init`` at ``master_address:master_port``, called at the same time).

        Raises:
            RuntimeError: a CUDA IPC engine (``weight_transfer="ipc"``), or joined already.
            ValueError: ranks ``rank_offset..rank_offset+n-1`` do not fit ``1..world_size-1``.
        """
        if self.weight_transfer != "nccl":
            raise RuntimeError("init_weight_transfer: this engine was built with vLLM's IPC weight transfer; an NCCL "
                               "group needs weight_transfer='nccl' (policy.weight_sync.method='nccl')")
        if self._nccl_joined:
            raise RuntimeError("init_weight_transfer: this engine's workers joined an NCCL group already")
        tp = self.vllm_cfg.tensor_parallel_size
        if rank_offset < 1 or rank_offset + tp > world_size or (world_size - 1) % tp:
            raise ValueError(f"init_weight_transfer: world_size={world_size}, rank_offset={rank_offset}, but the group "
                             f"is the trainer's rank 0 plus the engines' workers, {tp} per engine: this engine's ranks "
                             f"{rank_offset}..{rank_offset + tp - 1} must lie in 1..{world_size - 1}")
        self.llm.init_weight_transfer_engine({"init_info": nccl_init_info(master_address, master_port, world_size,
                                                                          rank_offset)})
        self._nccl_joined = True

    def engine_params(self, names: list[str]) -> list[dict]:
        """Raw bytes of engine parameters, per worker in tensor-parallel rank order (diagnostics and tests).

        Returns one dict per worker: vLLM parameter name (e.g. ``model.layers.0.self_attn.qkv_proj.weight``) ->
        (dtype name, shape, raw bytes) of that worker's shard (``Fp8WorkerExtension.nemo_fp8_params``).

        Raises:
            KeyError: a name the engine has no parameter for (raised in the workers).
        """
        return self.llm.collective_rpc("nemo_fp8_params", args=(list(names),))

    def finish_weight_update(self, require_kv_scales: bool = True) -> WeightVersion:
        """End the refit: vLLM's layerwise reload, then the completeness checks; returns the versions held.

        A refused refit leaves the engine refusing to generate until a later refit succeeds
        (its weights are already the new ones, its KV scales may be the previous step's).

        Args:
            require_kv_scales: with ``kv_cache_dtype='fp8'``, refuse a refit that carried no
                ``model.layers.{i}.self_attn.{q,k,v}_scale`` (False only for the initial load).

        Raises:
            RuntimeError: no refit in progress; weights of the plan that did not arrive; KV scales
                for only some (layer, q/k/v) pairs (vLLM reloads the scales of the attention layers
                that received some and keeps the others'); or FP8 KV cache and no KV scales (vLLM
                would silently keep the previous step's).
        """
        if self._pending is None:
            raise RuntimeError("finish_weight_update before start_weight_update")
        version, self._pending = self._pending, None
        self.llm.finish_weight_update()
        missing = sorted(self.plan.expected - self._seen) if self.plan.expected is not None else []
        if missing:
            self._refused = (f"refit to version {version}: {len(missing)} weights did not arrive (e.g. {missing[:3]}); "
                             "the engine would mix two policy versions")
            raise RuntimeError(self._refused)
        scales = {n for n in self._seen if is_kv_scale_name(n)}
        want = {KV_SCALE_NAME.format(layer=i, kind=k) for i in range(self.num_layers) for k in "qkv"}
        if scales and scales != want:
            missing = sorted(want - scales, key=parse_kv_scale_name)
            extra = sorted(scales - want, key=parse_kv_scale_name)
            self._refused = (f"refit to version {version}: KV scales for {len(scales & want)} of {len(want)} "
                             f"(layer, q/k/v) pairs (missing e.g. {missing[:3]}, unknown layers e.g. {extra[:3]}); "
                             "send all, or the engine would mix two steps' scales")
            raise RuntimeError(self._refused)
        got_scales = bool(scales)
        if self.kv_fp8 and require_kv_scales and not got_scales:
            self._refused = (f"refit to version {version}: kv_cache_dtype='fp8' but no KV scales were sent; vLLM "
                             "would silently keep the previous step's scales")
            raise RuntimeError(self._refused)
        self._refused = None
        self._discarded = False
        if self.kv_fp8 and got_scales:  # read back now: vLLM resets them when the KV cache wakes
            held = self.llm.collective_rpc("nemo_fp8_attn_scales")
            self._kv_held = {n: {k: rec[k] for k in "qkv"} for n, rec in (held[0] if held else {}).items()}
        kv = version if got_scales else self._version.kv_scales
        self._version = WeightVersion(weights=version, kv_scales=kv, num_tensors=self._sent)
        return self._version

    def weight_version(self) -> WeightVersion:
        return self._version

    # ------------------------------------------------------------------ generation

    def prepare_for_generation(self) -> None:
        """Wake what sleep released (the KV cache; the weights too unless a refit already woke them).

        Raises:
            RuntimeError: ``sleep_level=2`` discarded the weights and no complete refit has brought them back.
        """
        if self._discarded:
            raise RuntimeError("prepare_for_generation: sleep(level=2) discarded the engine's weights "
                               "(policy.generation.vllm_cfg.sleep_level=2) and no refit has written them since: "
                               "refit before waking the engine")
        if self._asleep_tags:  # wake only what is still asleep: waking a tag twice fails in cumem
            kv_woke = "kv_cache" in self._asleep_tags
            self.llm.wake_up(tags=sorted(self._asleep_tags))
            self._asleep_tags.clear()
            if kv_woke and self.kv_fp8 and self._kv_held:
                self._restore_kv_scales()

    def _restore_kv_scales(self) -> None:
        """Put the last refit's FP8 KV scales back after the KV cache woke (vLLM's V1 runner resets k/v to 1.0 then,
        ``Fp8WorkerExtension.nemo_fp8_restore_kv_scales``), and check them live.

        Raises:
            RuntimeError: a layer reads other scales than the refit left (the rollout would run on them).
        """
        self.llm.collective_rpc("nemo_fp8_restore_kv_scales", args=(self._kv_held,))
        live = self.llm.collective_rpc("nemo_fp8_attn_scales")
        for name, want in self._kv_held.items():
            for rank, layers in enumerate(live):
                got = {k: layers.get(name, {}).get(k) for k in "qkv"}
                if got != want:
                    raise RuntimeError(f"FP8 KV cache: after the engine's wake, {name} on worker {rank} reads scales "
                                       f"{got}, not the refit's {want}: the rollout would run on them")

    def finish_generation(self) -> None:
        """Sleep (colocated engines): ``vllm_cfg.sleep_level`` 1 copies the weights to host memory, 2 discards them
        (the held version becomes -1: the next rollout needs a refit first); the KV cache is discarded either
        way."""
        if self.spec.engine_kwargs.get("enable_sleep_mode") and not self._asleep_tags:
            level = self.vllm_cfg.sleep_level
            self.llm.sleep(level=level)
            self._asleep_tags = {"weights", "kv_cache"}
            if level == 2:
                self._discarded = True
                self._version = WeightVersion(weights=-1, kv_scales=-1, num_tensors=0)

    def generate(self, prompt_token_ids: list[list[int]], sampling: SamplingParams,
                 request_seeds: Optional[Sequence[int]] = None,
                 chunk_sizes: Optional[Sequence[int]] = None) -> GenerationOutput:
        """One response per prompt (greedy or seeded sampling); returns a right-padded ``GenerationOutput``.

        ``request_seeds``: each request's ``SamplingParams.seed`` (default ``request_seed(sampling.seed, i)``, the
        same seeds a one-engine call gets), unless ``vllm_cfg.seed_each_request`` is false: then no request has
        a seed and vLLM samples the batch from its engine-seeded generator. ``chunk_sizes`` is ignored (vLLM
        schedules its own batches). With ``sampling.response_limits`` each request's ``max_tokens`` is its own
        (``request_max_new_tokens``, drawn from the same per-request seeds whether or not they reach vLLM).

        Raises:
            RuntimeError: a refit in progress or refused; ``kv_cache_dtype='fp8'`` and no KV
                scales ever loaded (vLLM would run on its default 1.0); or no refit yet (the engine's
                dummy weights: an NCCL engine, or ``load_initial_weights=False``).
            ValueError: no prompts, or a prompt that is empty or leaves no room under
                ``max_total_sequence_length``.
        """
        if self._pending is not None:
            raise RuntimeError(f"generate: the refit to version {self._pending} is in progress "
                               "(finish_weight_update first)")
        if self._refused is not None:
            raise RuntimeError(f"generate: the last refit was refused ({self._refused}); refit again first")
        if self.kv_fp8 and self._version.kv_scales < 0:
            raise RuntimeError("generate: kv_cache_dtype='fp8' but no KV scales were ever loaded; they arrive with "
                               "the refit (the policy's calibrate_kv_scales), never default to 1.0")
        if self._version.weights < 0:
            source = "the trainer's first refit over NCCL" if self.weight_transfer == "nccl" else "the first refit"
            raise RuntimeError(f"generate: the engine holds no policy weights yet (dummy weights until {source}); "
                               "refit first")
        if not prompt_token_ids:
            raise ValueError("generate: no prompts")
        from vllm import SamplingParams as VSP

        seeded = not sampling.greedy and self.vllm_cfg.seed_each_request
        limits = request_max_new_tokens(sampling, len(prompt_token_ids), request_seeds)
        params = []
        for i, p in enumerate(prompt_token_ids):
            if not p or len(p) >= self.max_total_sequence_length:
                raise ValueError(f"generate: prompt {i} has {len(p)} tokens; valid: 1 to "
                                 f"{self.max_total_sequence_length - 1} (max_total_sequence_length - 1)")
            params.append(VSP(
                n=1, temperature=0.0 if sampling.greedy else sampling.temperature, top_p=1.0, top_k=0,
                max_tokens=min(limits[i], self.max_total_sequence_length - len(p)),
                seed=None if not seeded else (int(request_seeds[i]) if request_seeds is not None
                                              else request_seed(sampling.seed, i)),
                logprobs=0, detokenize=False,
                stop_token_ids=[self.eos_token_id, *sampling.stop_token_ids]))
        outs = self.llm.generate([{"prompt_token_ids": list(p)} for p in prompt_token_ids], params, use_tqdm=False)
        return outputs_to_batch(prompt_token_ids, [o.outputs[0] for o in outs], self.pad_token_id,
                                {self.eos_token_id, *sampling.stop_token_ids})

    def pop_engine_metrics(self) -> dict[str, float]:
        """``generation/engines``: one engine in this process (a group adds each engine's tokens and seconds), and
        ``generation/kv_capacity_tokens`` (``kv_capacity_tokens``) where vLLM reports it."""
        return one_engine_metrics(self.kv_capacity_tokens())

    def kv_capacity_tokens(self) -> Optional[int]:
        """Tokens the engine's KV cache holds at once: vLLM's ``cache_config.num_gpu_blocks x block_size``, what its
        memory profiling at start left of ``gpu_memory_utilization`` x the GPU after the weights, the activation
        peak and CUDA graphs (an FP8 KV cache holds twice BF16's in the same bytes). Fixed for the engine's life:
        sleep and wake give the same cache back. None before vLLM has set the block count."""
        # the engine client's copy of the config (vLLM V1 fills num_gpu_blocks in from the engine core's handshake);
        # a vLLM without it reports no capacity rather than failing the run
        cache = getattr(getattr(getattr(self.llm, "llm_engine", None), "vllm_config", None), "cache_config", None)
        blocks = getattr(cache, "num_gpu_blocks", None)
        return int(blocks) * int(cache.block_size) if blocks else None

    def shutdown(self) -> None:
        """Release the NCCL communicator (an NCCL engine that joined a group) and shut the engine down.

        vLLM 0.22's ``NCCLWeightTransferEngine.shutdown`` (run by the workers' own shutdown) only drops its
        reference to the communicator; ``Fp8WorkerExtension.nemo_fp8_close_weight_transfer`` first aborts it
        (``PyNcclCommunicator.destroy``), so no worker is left waiting on the trainer. Best effort, never raises.
        """
        llm, self.llm = getattr(self, "llm", None), None
        if llm is not None and getattr(self, "_nccl_joined", False):
            self._nccl_joined = False
            try:
                llm.collective_rpc("nemo_fp8_close_weight_transfer")
            except Exception:  # best effort: the workers may be gone already
                logger.debug("closing the NCCL weight transfer failed", exc_info=True)
        if llm is not None:
            try:
                llm.llm_engine.engine_core.shutdown()
            except Exception:  # best effort: the engine may be gone already
                logger.debug("engine shutdown failed", exc_info=True)
            del llm


def outputs_to_batch(prompts: list[list[int]], completions, pad_token_id: int, stop_ids: set[int]) -> GenerationOutput:
    """vLLM ``CompletionOutput``s -> right-padded ``GenerationOutput`` (logprob aligned to its token)."""
    b = len(prompts)
    resp = [list(c.token_ids) for c in completions]
    total = max(len(p) + len(r) for p, r in zip(prompts, resp))
    token_ids = torch.full((b, total), pad_token_id, dtype=torch.long)
    gen_lp = torch.zeros((b, total), dtype=torch.float32)
    truncated = torch.zeros(b, dtype=torch.bool)
    for i, (p, r, c) in enumerate(zip(prompts, resp, completions)):
        n = len(p)
        token_ids[i, :n] = torch.tensor(p)
        if r:
            token_ids[i, n:n + len(r)] = torch.tensor(r)
            lps = c.logprobs or []
            gen_lp[i, n:n + len(r)] = torch.tensor([lps[j][tok].logprob for j, tok in enumerate(r)], dtype=torch.float32)
        truncated[i] = not (r and r[-1] in stop_ids)
    return GenerationOutput(token_ids, torch.tensor([len(p) for p in prompts]), torch.tensor([len(r) for r in resp]),
                            gen_lp, truncated).validate()


def _tie_word_embeddings(model_name: str) -> bool:
    return bool(model_config(model_name).get("tie_word_embeddings", False))

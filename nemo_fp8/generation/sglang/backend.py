"""``SglangGenerationBackend``: SGLang 0.5.17 as the rollout engine behind ``GenerationBackend``, FP8 or BF16.

Owns one ``sglang.srt.entrypoints.engine.Engine`` in this process (the engine actor), started from the model's BF16
config with an FP8 block quantization config laid over it and dummy weights (``engine_args``); the first refit (the
backend's initial load, version 0, from ``model_name``'s safetensors) brings the real weights.

Refit (``start_weight_update`` -> ``update_weights`` x N -> ``finish_weight_update``), in place through SGLang's own
``update_weights_from_tensor``: each bucket of HF-named tensors is converted on this process's GPU (``RefitPlan``:
this project's blockwise quantizer, e4m3 ``weight`` + fp32 ``weight_scale_inv``), packed into one flattened bucket
and handed to the engine's scheduler over CUDA IPC (``transport``), which loads it with ``model.load_weights`` into
the existing parameters; an ``engine_hooks.synchronize`` request after it makes the copies complete before the
bucket's memory is released. ``finish_weight_update`` checks that every weight of the model arrived and, with an FP8
KV cache, the ``k``/``v`` scales of every layer (``refit.refit_problem``), then tags the engine with the version:
SGLang stamps it on every output, and ``generate`` refuses outputs of another version.

Colocation (``colocated=True``: ``enable_memory_saver``): ``finish_generation`` releases the KV cache, the CUDA
graphs and the weights (``release_memory_occupation``); without ``sglang_cfg.cpu_weight_backup`` the weights' memory
is handed back without a copy, so the engine then holds no version (-1) and ``prepare_for_generation`` refuses until
a refit has rewritten all of them (the loop refits before every wake: ``GenerationConfig.sleep_discards_weights``);
KV scales, parameters too, come back with that refit. ``start_weight_update`` resumes the weights' memory,
``prepare_for_generation`` the rest.
"""

from __future__ import annotations

import logging
import math
from typing import Iterable, Iterator, Mapping, Optional, Sequence

import torch
from torch import Tensor

from nemo_fp8.batch import GenerationOutput
from nemo_fp8.fp8.kv_scales import is_kv_scale_name
from nemo_fp8.generation.config import VllmConfig
from nemo_fp8.generation.interfaces import (SamplingParams, WeightVersion, one_engine_metrics, request_max_new_tokens,
                                            request_seed)
from nemo_fp8.generation.sglang import engine_hooks, transport
from nemo_fp8.generation.sglang.config import SglangConfig
from nemo_fp8.generation.sglang.engine_args import READBACK_HOOK, SYNC_HOOK, build_engine_spec
from nemo_fp8.generation.sglang.refit import (DEFAULT_BUCKET_BYTES, FlatBucket, RefitLedger, check_kv_scale,
                                              flat_buckets, refit_problem, sent_kv_scale)
from nemo_fp8.models.hf import iter_checkpoint, model_config

logger = logging.getLogger(__name__)

MEMORY_TAGS = ("kv_cache", "weights", "cuda_graph")  # sglang.srt.constants GPU_MEMORY_ALL_TYPES


class SglangGenerationBackend:
    """See the module docstring.

    Args:
        model_name: local HF folder (config; weights when ``load_initial_weights``).
        vllm_cfg: ``policy.generation.vllm_cfg`` (precision keys); sglang_cfg: ``policy.generation.sglang_cfg``.
        pad_token_id, eos_token_id: from the tokenizer.
        max_total_sequence_length: prompt + response cap (the engine's context length unless
            ``sglang_cfg.context_length``).
        colocated: release memory between rollouts (trainer on the same GPU).
        load_initial_weights: refit version 0 from ``model_name``'s safetensors at start.
        bucket_bytes: converted bytes per flattened bucket.
        engine_overrides: extra ``Engine`` keyword arguments (tests, benchmarks).
        device: where buckets are converted and shared from (default: this process's current CUDA device, the
            engine's GPU).

    Raises:
        ValueError: invalid config (``engine_args.build_engine_spec``).
    """

    def __init__(self, model_name: str, vllm_cfg: VllmConfig, sglang_cfg: SglangConfig, pad_token_id: int,
                 eos_token_id: int, max_total_sequence_length: int, colocated: bool = True,
                 load_initial_weights: bool = True, bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                 engine_overrides: Optional[dict] = None, device: Optional[torch.device] = None):
        from sglang.srt.entrypoints.engine import Engine

        self.vllm_cfg, self.sglang_cfg = vllm_cfg, sglang_cfg
        self.pad_token_id, self.eos_token_id = pad_token_id, eos_token_id
        self.max_total_sequence_length = max_total_sequence_length
        self.bucket_bytes, self.colocated = bucket_bytes, colocated
        self.spec = build_engine_spec(vllm_cfg, sglang_cfg, model_name, model_name, colocated=colocated,
                                      max_total_sequence_length=max_total_sequence_length, extra=engine_overrides)
        self.context_length = int(self.spec.engine_kwargs["context_length"])
        self.plan = self.spec.refit_plan
        self.num_layers = self.spec.num_layers
        self.kv_fp8 = vllm_cfg.kv_cache_is_fp8
        # SGLang loads a tied lm_head from the embedding: the trainer's state dict still lists it; skip it
        self._tied = {"lm_head.weight"} if model_config(model_name).get("tie_word_embeddings") else set()
        if device is None or (device.type == "cuda" and device.index is None):
            device = torch.device("cuda", torch.cuda.current_device())
        self.device = device
        self.engine = Engine(**self.spec.engine_kwargs)
        self._version = WeightVersion()
        self._ledger: Optional[RefitLedger] = None
        self._refused: Optional[str] = None  # why the last refit was refused (the engine must not generate)
        self._released: set[str] = set()     # memory tags released and not resumed yet
        self._discarded = False              # a release dropped the weights; only a complete refit brings them back
        self._needs_flush = False            # a refit since the last rollout: the prefix cache holds old KV
        if load_initial_weights:
            try:
                self.start_weight_update(0)
                self.update_weights(iter_checkpoint(model_name))
                self.finish_weight_update(require_kv_scales=False)
            except BaseException:
                self.shutdown()  # the engine's processes would outlive this half-built backend
                raise

    # ------------------------------------------------------------------ refit

    def start_weight_update(self, version: int) -> None:
        """Begin a refit to ``version``; resumes the weights' memory if a release took it.

        Raises:
            RuntimeError: a refit is in progress.
        """
        if self._ledger is not None:
            raise RuntimeError(f"start_weight_update({version}): a refit to version {self._ledger.version} is in "
                               "progress")
        if "weights" in self._released:  # the refit needs the weights' memory back, not the KV cache yet
            self.engine.resume_memory_occupation(tags=["weights"])
            self._released.discard("weights")
        self._ledger = RefitLedger(version)

    def _abort(self, why: str) -> None:
        """End the refit in progress as refused: the engine may hold part of it, so it must not generate."""
        version = self._ledger.version if self._ledger is not None else "?"
        self._ledger = None
        self._refused = f"refit to version {version}: {why}"

    def _check_bucket(self, items: list[tuple[str, Tensor]]) -> None:
        """Record one bucket's names in the refit's ledger after checking them: weight names the model has, KV scales
        finite and > 0. Raises before anything of the bucket is converted or sent."""
        ledger = self._ledger
        ledger.weights.update(self.plan.checked_names(n for n, _ in items if not is_kv_scale_name(n)))
        for name, t in items:
            if is_kv_scale_name(name):
                check_kv_scale(name, t)
                if sent_kv_scale(name):  # q_scale: SGLang has none (refit.py); not sent
                    ledger.kv_scales.add(name)

    def _converted(self, items: list[tuple[str, Tensor]]) -> Iterator[tuple[str, Tensor]]:
        """What SGLang loads for ``items``, converted lazily on ``self.device`` (``RefitPlan.convert``), so at most
        one bucket of converted tensors exists at a time."""
        for name, t in items:
            if is_kv_scale_name(name) and not sent_kv_scale(name):
                continue
            yield from self.plan.convert(name, t, self.device)

    def update_weights(self, named_tensors: Mapping[str, Tensor] | Iterable[tuple[str, Tensor]]) -> None:
        """Load one bucket of ``(HF name, high-precision tensor)`` (any device; module docstring).

        Raises:
            RuntimeError: no refit in progress, or the engine failed to load a bucket.
            KeyError: a name the model has no weight for; ValueError: a KV scale that is not finite and > 0. Both
                are raised before anything of the bucket is sent.
            Any of these refuses the refit: the engine then refuses to generate until a later complete refit.
        """
        if self._ledger is None:
            raise RuntimeError("update_weights before start_weight_update")
        pairs = named_tensors.items() if isinstance(named_tensors, Mapping) else named_tensors
        items = [(n, t) for n, t in pairs if n not in self._tied]
        try:
            self._check_bucket(items)
            for bucket in flat_buckets(self._converted(items), self.bucket_bytes):
                self._send(bucket)
                self._ledger.tensors += len(bucket.entries)
                del bucket
                self._ipc_collect()
        except (KeyError, ValueError, RuntimeError) as e:
            self._abort(str(e))
            raise
        self._ipc_collect()

    def _send(self, bucket: FlatBucket) -> None:
        """One flattened bucket into the engine, then the engine-side device sync (``engine_hooks.synchronize``), so
        the engine's copies out of the bucket are done before its memory is freed or reused."""
        transport.update_from_tensor(self.engine, [transport.serialize_flat_bucket(bucket)], "flattened_bucket")
        transport.update_from_tensor(self.engine, [transport.serialize_named_tensors([])], SYNC_HOOK)

    def _ipc_collect(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.ipc_collect()  # free the buckets the engine's process has released

    def finish_weight_update(self, require_kv_scales: bool = True) -> WeightVersion:
        """End the refit: the completeness checks, then the engine's version tag; returns the versions held.

        Args:
            require_kv_scales: with ``kv_cache_dtype='fp8'``, refuse a refit without KV scales (False only for the
                initial load, whose checkpoint has none).

        Raises:
            RuntimeError: no refit in progress; ``refit.refit_problem``'s reasons (weights that did not arrive, KV
                scales of some layers only, none with an FP8 KV cache); or the engine failed the version tag. A
                refused refit leaves the engine refusing to generate until a later one succeeds.
        """
        if self._ledger is None:
            raise RuntimeError("finish_weight_update before start_weight_update")
        ledger, self._ledger = self._ledger, None
        problem = refit_problem(self.plan.expected, ledger, self.num_layers, self.kv_fp8, require_kv_scales)
        if problem is not None:
            self._refused = problem
            raise RuntimeError(problem)
        try:
            transport.update_from_tensor(self.engine, [transport.serialize_named_tensors([])], SYNC_HOOK,
                                         weight_version=str(ledger.version))
        except RuntimeError as e:  # the weights are the new ones, the tag is not: serve nothing until a refit
            self._refused = f"refit to version {ledger.version}: tagging the engine failed: {e}"
            raise
        self._refused, self._discarded, self._needs_flush = None, False, True
        kv = ledger.version if ledger.kv_scales else self._version.kv_scales
        self._version = WeightVersion(weights=ledger.version, kv_scales=kv, num_tensors=ledger.tensors)
        return self._version

    def weight_version(self) -> WeightVersion:
        return self._version

    # ------------------------------------------------------------------ colocation

    def prepare_for_generation(self) -> None:
        """Resume what a release took (the KV cache and CUDA graphs; the weights too unless a refit already did).

        Raises:
            RuntimeError: the release discarded the weights (``sglang_cfg.cpu_weight_backup: false``) and no complete
                refit has rewritten them.
        """
        if self._discarded:
            raise RuntimeError("prepare_for_generation: releasing the engine's memory discarded its weights "
                               "(policy.generation.sglang_cfg.cpu_weight_backup=false) and no refit has written them "
                               "since: refit before waking the engine")
        if self._released:
            self.engine.resume_memory_occupation(tags=sorted(self._released))
            self._released.clear()

    def finish_generation(self) -> None:
        """Release the KV cache, CUDA graphs and weights (colocated engines). Without ``cpu_weight_backup`` the
        weights are discarded: the held version becomes -1 and the next rollout needs a refit first."""
        if not self.colocated or self._released:
            return
        self.engine.release_memory_occupation(tags=list(MEMORY_TAGS))
        self._released = set(MEMORY_TAGS)
        if not self.sglang_cfg.cpu_weight_backup:
            self._discarded = True
            self._version = WeightVersion(weights=-1, kv_scales=-1, num_tensors=0)

    # ------------------------------------------------------------------ generation

    def _check_can_generate(self) -> None:
        if self._ledger is not None:
            raise RuntimeError(f"generate: the refit to version {self._ledger.version} is in progress "
                               "(finish_weight_update first)")
        if self._refused is not None:
            raise RuntimeError(f"generate: the last refit was refused ({self._refused}); refit again first")
        if self._released:
            raise RuntimeError(f"generate: the engine's {sorted(self._released)} memory is released; "
                               "prepare_for_generation first")
        if self.kv_fp8 and self._version.kv_scales < 0:
            raise RuntimeError("generate: kv_cache_dtype='fp8' but no KV scales were ever loaded; they arrive with "
                               "the refit (the policy's calibrate_kv_scales), never default to 1.0")
        if self._version.weights < 0:
            raise RuntimeError("generate: the engine holds no policy weights (dummy weights until the first refit, or "
                               "discarded by a release); refit first")

    def generate(self, prompt_token_ids: list[list[int]], sampling: SamplingParams,
                 request_seeds: Optional[Sequence[int]] = None,
                 chunk_sizes: Optional[Sequence[int]] = None) -> GenerationOutput:
        """One response per prompt (greedy or sampled); a right-padded ``GenerationOutput``.

        ``request_seeds``: each request's ``sampling_seed`` (default ``request_seed(sampling.seed, i)``); SGLang
        samples by it only with ``sglang_cfg.enable_deterministic_inference``. ``chunk_sizes`` is ignored (SGLang
        schedules its own batches). Log-probs: SGLang's of the distribution sampled (``Sampler.forward``:
        ``log(softmax(logits / temperature))``); greedy: of the raw logits.

        Raises:
            RuntimeError: a refit in progress or refused, memory released, no weights or (FP8 KV) no scales loaded;
                an output SGLang aborted, or tagged with another policy version than the engine's.
            ValueError: no prompts, or a prompt that is empty or leaves no room under the context length.
        """
        self._check_can_generate()
        if not prompt_token_ids:
            raise ValueError("generate: no prompts")
        limits = request_max_new_tokens(sampling, len(prompt_token_ids), request_seeds)
        seeds = [int(request_seeds[i]) if request_seeds is not None else request_seed(sampling.seed, i)
                 for i in range(len(prompt_token_ids))]
        params = sampling_params(prompt_token_ids, sampling, limits, seeds, self.context_length, self.eos_token_id)
        if self._needs_flush:  # the prefix cache holds KV of the previous weights (and scales)
            self.engine.flush_cache()
            self._needs_flush = False
        outs = self.engine.generate(input_ids=[list(p) for p in prompt_token_ids], sampling_params=params,
                                    return_logprob=True)
        return outputs_to_batch(prompt_token_ids, outs, self.pad_token_id, str(self._version.weights))

    def engine_state(self) -> dict:
        """What the engine holds, read in its own process (``engine_hooks.read_engine_state``; GPU tests, diagnostics).

        Returns:
            ``kv_scales``: layer -> ``{"k", "v"}`` (the ``k_scale`` / ``v_scale`` tensors FA3 reads) and
            ``{"k_float", "v_float"}`` (SGLang's load-time floats, None where unset); ``{}`` for a BF16 engine, whose
            attention layers hold no scales. ``param_ptrs``: every parameter's ``data_ptr`` in
            ``named_parameters`` order. ``memory``: the engine process's ``allocated``, ``reserved`` and ``free``
            bytes of its GPU.

        Raises:
            RuntimeError: the weights' memory is released (reading it would touch unmapped memory), or the engine has
                more parameters than the read-back buffer holds.
        """
        if "weights" in self._released:
            raise RuntimeError("engine_state: the engine's weights are released; resume them first")
        gpu = torch.device("cuda", torch.cuda.current_device())  # written by the engine through CUDA IPC
        capacity = 1 + 2 * len(self.plan.expected or ()) + 2 * self.num_layers + 64
        kv = torch.full((self.num_layers, 4), math.nan, dtype=torch.float32, device=gpu)
        ptrs = torch.zeros(capacity, dtype=torch.int64, device=gpu)
        mem = torch.zeros(3, dtype=torch.int64, device=gpu)
        payload = transport.serialize_named_tensors([(engine_hooks.KV_SCALES, kv), (engine_hooks.PARAM_PTRS, ptrs),
                                                     (engine_hooks.MEMORY, mem)])
        transport.update_from_tensor(self.engine, [payload], READBACK_HOOK)
        return parse_engine_state(kv.cpu(), ptrs.cpu(), mem.cpu())

    def pop_engine_metrics(self) -> dict[str, float]:
        """``generation/engines``: one engine in this process (a group adds each engine's tokens and seconds), and
        ``generation/kv_capacity_tokens`` (``kv_capacity_tokens``) where SGLang reports it."""
        return one_engine_metrics(self.kv_capacity_tokens())

    def kv_capacity_tokens(self) -> Optional[int]:
        """Tokens the engine's KV cache holds at once: SGLang's ``max_total_num_tokens`` (``Engine.get_server_info``,
        the scheduler's token pool: what ``mem_fraction_static`` x the GPU left after the weights; an FP8 KV cache
        holds twice BF16's in the same bytes). Fixed for the engine's life (a memory release gives the same pool
        back), so read once. None where the engine does not report it."""
        if not hasattr(self, "_kv_capacity"):
            info = self.engine.get_server_info() if hasattr(self.engine, "get_server_info") else {}
            tokens = info.get("max_total_num_tokens") if isinstance(info, dict) else None
            self._kv_capacity = int(tokens) if tokens else None
        return self._kv_capacity

    def shutdown(self) -> None:
        """Shut the engine and its processes down. Best effort, never raises.

        SGLang 0.5.17's ``Engine.shutdown`` ends every child process of this process (``kill_process_tree`` of its
        pid): in an engine actor those are the engine's own; a process holding other children should hold no engine.
        """
        engine, self.engine = getattr(self, "engine", None), None
        if engine is not None:
            try:
                engine.shutdown()
            except Exception:  # best effort: the engine may be gone already
                logger.debug("SGLang engine shutdown failed", exc_info=True)


def sampling_params(prompts: Sequence[Sequence[int]], sampling: SamplingParams, limits: Sequence[int],
                    seeds: Sequence[int], context_length: int, eos_token_id: int) -> list[dict]:
    """SGLang ``sampling_params`` dicts, one per prompt (``srt/sampling/sampling_params.py`` field names).

    Full-vocabulary sampling (``top_p`` 1, ``top_k`` -1: the trainer's log-probs cannot reproduce a truncated
    distribution); greedy is ``temperature`` 0 (SGLang's ``top_k=1``); ``max_new_tokens`` is the request's limit, at
    most what the context leaves; stops at the EOS and ``sampling.stop_token_ids``.

    Raises:
        ValueError: a prompt that is empty or leaves no room under ``context_length``.
    """
    out = []
    for i, p in enumerate(prompts):
        if not p or len(p) >= context_length:
            raise ValueError(f"generate: prompt {i} has {len(p)} tokens; valid: 1 to {context_length - 1} "
                             "(the engine's context length - 1)")
        out.append({"max_new_tokens": min(int(limits[i]), context_length - len(p)),
                    "temperature": 0.0 if sampling.greedy else float(sampling.temperature), "top_p": 1.0, "top_k": -1,
                    "stop_token_ids": [eos_token_id, *sampling.stop_token_ids], "sampling_seed": int(seeds[i])})
    return out


def outputs_to_batch(prompts: Sequence[Sequence[int]], outs: Sequence[dict], pad_token_id: int,
                     weight_version: Optional[str] = None) -> GenerationOutput:
    """SGLang ``Engine.generate`` outputs -> right-padded ``GenerationOutput`` (each log-prob at its token).

    Args:
        prompts: the prompts, in order.
        outs: one dict per prompt: ``output_ids`` and ``meta_info`` with ``output_token_logprobs`` (``(logprob,
            token_id, None)`` per token, ``TokenizerManager.detokenize_logprob_tokens``), ``finish_reason``
            (``{"type": "stop" | "length" | "abort", ...}``) and ``weight_version``.
        pad_token_id: pads the rows.
        weight_version: the version every output must carry (None: not checked).

    Raises:
        RuntimeError: an aborted request, an output of another weight version, or log-probs that do not match the
            tokens (each named by its row).
    """
    if len(outs) != len(prompts):
        raise RuntimeError(f"generate: {len(outs)} outputs for {len(prompts)} prompts")
    resp, lps, truncated = [], [], []
    for i, o in enumerate(outs):
        meta = o["meta_info"]
        finish = meta.get("finish_reason") or {}
        if finish.get("type") == "abort":
            raise RuntimeError(f"generate: SGLang aborted request {i}: {finish.get('message', finish)}")
        if weight_version is not None and str(meta.get("weight_version")) != weight_version:
            raise RuntimeError(f"generate: request {i} was served by weights of version {meta.get('weight_version')!r},"
                               f" the engine should hold {weight_version!r}: a refit was lost or raced the rollout")
        ids, logprobs = list(o["output_ids"]), meta.get("output_token_logprobs") or []
        if len(logprobs) != len(ids) or any(int(tok) != t for (_, tok, *_), t in zip(logprobs, ids)):
            raise RuntimeError(f"generate: request {i}: {len(logprobs)} log-probs for {len(ids)} tokens, or for other "
                               "tokens")
        resp.append(ids)
        lps.append([float(lp) for lp, *_ in logprobs])
        truncated.append(finish.get("type") != "stop")
    b = len(prompts)
    total = max(len(p) + len(r) for p, r in zip(prompts, resp))
    token_ids = torch.full((b, total), pad_token_id, dtype=torch.long)
    gen_lp = torch.zeros((b, total), dtype=torch.float32)
    for i, (p, r, lp) in enumerate(zip(prompts, resp, lps)):
        token_ids[i, :len(p)] = torch.tensor(list(p))
        if r:
            token_ids[i, len(p):len(p) + len(r)] = torch.tensor(r)
            gen_lp[i, len(p):len(p) + len(r)] = torch.tensor(lp, dtype=torch.float32)
    return GenerationOutput(token_ids, torch.tensor([len(p) for p in prompts]), torch.tensor([len(r) for r in resp]),
                            gen_lp, torch.tensor(truncated)).validate()


def parse_engine_state(kv: Tensor, ptrs: Tensor, mem: Tensor) -> dict:
    """``engine_state``'s answer from the read-back tensors (layout: ``engine_hooks``).

    Raises:
        RuntimeError: more parameters than ``ptrs`` holds.
    """
    count = int(ptrs[0])
    if count > ptrs.numel() - 1:
        raise RuntimeError(f"engine_state: the engine has {count} parameters, the read-back held {ptrs.numel() - 1}")
    nan_none = lambda x: None if math.isnan(x) else x  # noqa: E731
    scales = {i: {"k": float(row[0]), "v": float(row[1]), "k_float": nan_none(float(row[2])),
                  "v_float": nan_none(float(row[3]))} for i, row in enumerate(kv) if not math.isnan(float(row[0]))}
    return {"kv_scales": scales, "param_ptrs": [int(x) for x in ptrs[1:1 + count]],
            "memory": {"allocated": int(mem[0]), "reserved": int(mem[1]), "free": int(mem[2])}}

"""Reference generation backend: an HF causal LM with a KV-cache sampling loop, in pure torch.

Precision ``bfloat16`` runs the model in bf16. Precision ``fp8`` additionally replaces every
FP8-eligible Linear (``nemo_fp8.fp8.plan_layer_precision``) by ``Fp8BlockLinear``: W8A8 with
128x128 weight blocks and 1x128 activation groups, the numerics of vLLM's block-scaled FP8
kernels, with weights quantized at every refit (``update_weights``, bucket by bucket). Runs on
CPU, or CUDA when there is one, with the same code; slow, and meant to pin down numerics, not to
serve. FP8 KV scales sent with the weights are kept with their version (``kv_scales``); with
``kv_cache_dtype: fp8`` attention runs on q, k, v quantized to e4m3 with those static per-layer
scales, as vLLM's FP8 KV cache with FlashAttention 3 does.
"""

from __future__ import annotations

import inspect
import logging
from typing import Iterable, Mapping, Optional, Sequence

import torch
from torch import Tensor, nn

from nemo_fp8.batch import GenerationOutput, concat_padded
from nemo_fp8.generation.config import VllmConfig
from nemo_fp8.fp8 import Fp8BlockLinear, LayerPrecisionPlan, plan_layer_precision
from nemo_fp8.fp8.kv_scales import is_kv_scale_name, parse_kv_scale_name
from nemo_fp8.generation.interfaces import SamplingParams, WeightVersion, request_max_new_tokens
from nemo_fp8.models.hf import enable_fp8_kv_attention, load_causal_lm

logger = logging.getLogger(__name__)


def convert_to_fp8_inference(model: nn.Module, vllm_cfg: VllmConfig) -> LayerPrecisionPlan:
    """Swap the FP8-eligible Linears of ``model`` for ``Fp8BlockLinear`` in place; return the plan.

    Scale modes follow ``pow2_weight_scaling_factors`` / ``pow2_activation_scaling_factors``
    (power-of-two scales, as DeepGEMM's E8M0 path uses).
    """
    plan = plan_layer_precision(model, vllm_cfg.num_first_layers_in_bf16, vllm_cfg.num_last_layers_in_bf16,
                                vllm_cfg.fp8_ignore_patterns)
    for name in plan.fp8_modules:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        fp8 = Fp8BlockLinear.from_linear(
            getattr(parent, child),
            weight_block_size=tuple(vllm_cfg.weight_block_size),
            weight_scale_mode="pow2" if vllm_cfg.pow2_weight_scaling_factors else "fp32",
            act_scale_mode="pow2" if vllm_cfg.pow2_activation_scaling_factors else "fp32",
        )
        setattr(parent, child, fp8)
    logger.info("fp8 rollout: %d Linear modules in FP8, %d kept high precision (vLLM ignored_layers: %d)",
                len(plan.fp8_modules), len(plan.high_precision_modules), len(plan.vllm_ignored_layers))
    return plan


class TorchGenerationBackend:
    """``GenerationBackend`` in pure torch (see the module docstring).

    Args:
        model_name: local HF checkpoint folder (architecture and initial weights).
        vllm_cfg: precision and FP8 settings (``precision``, layer policy, scale modes).
        device: torch device.
        pad_token_id, eos_token_id: from the tokenizer.
        max_total_sequence_length: prompt + response cap per sequence.
        batch_size: prompts per forward pass (``policy.generation_batch_size``).
        offload_when_idle: colocated with the trainer on a GPU: ``finish_generation`` moves the
            model to host memory (the reference's stand-in for vLLM's sleep mode).
        dtype: the high-precision dtype of the model (vLLM's ``dtype``: bfloat16); float64 makes a CPU run
            independent of which kernels the CPU picks (FP8 layers then accumulate exactly, in float64), for
            tests that pin numbers.
    """

    def __init__(self, model_name: str, vllm_cfg: VllmConfig, device: torch.device, pad_token_id: int,
                 eos_token_id: int, max_total_sequence_length: int, batch_size: int = 64,
                 offload_when_idle: bool = False, dtype: torch.dtype = torch.bfloat16):
        self.device = device
        self.pad_token_id, self.eos_token_id = pad_token_id, eos_token_id
        self.max_total_sequence_length = max_total_sequence_length
        self.batch_size = batch_size
        self.precision = vllm_cfg.precision
        self.model = load_causal_lm(model_name, dtype, device).eval().requires_grad_(False)
        self.plan = convert_to_fp8_inference(self.model, vllm_cfg) if vllm_cfg.precision == "fp8" else None
        self._targets = self._refit_targets()
        out_emb = self.model.get_output_embeddings()
        tied = getattr(self.model.config, "tie_word_embeddings", False)
        # A tied lm_head shares the embedding's storage: the policy streams the weight once.
        self._tied = {n for n, (m, _) in self._targets.items() if tied and m is out_emb}
        self.num_layers = int(self.model.config.num_hidden_layers)
        self.offload_when_idle = offload_when_idle
        self.kv_scales: dict[str, Tensor] | None = None  # {'q'|'k'|'v': [num_layers] fp32}, from the refit
        # FP8 KV cache: attention runs on q/k/v through e4m3 with these static per-layer scales.
        self._kv_modules = enable_fp8_kv_attention(self.model) if vllm_cfg.kv_cache_is_fp8 else None
        self._version = WeightVersion()
        self._pending: dict | None = None
        self._asleep = False

    def _refit_targets(self) -> dict[str, tuple[nn.Module, str]]:
        """HF weight name -> (module, attribute) for every tensor a refit may write."""
        targets = {}
        for mod_name, module in self.model.named_modules():
            for attr, t in list(module.named_parameters(recurse=False)) + list(module.named_buffers(recurse=False)):
                if t is None or attr == "weight_scale_inv" or not t.is_floating_point():
                    continue
                if attr.endswith("inv_freq"):  # rotary tables are derived, not weights
                    continue
                targets[f"{mod_name}.{attr}" if mod_name else attr] = (module, attr)
        return targets

    # ----------------------------------------------------------------------- refit
    def start_weight_update(self, version: int) -> None:
        """Begin a refit to policy ``version``; the buckets that follow must cover every weight."""
        self._pending = {"version": int(version), "seen": set(), "kv": {}}

    @torch.no_grad()
    def update_weights(self, named_tensors: Mapping[str, Tensor] | Iterable[tuple[str, Tensor]]) -> None:
        """Load one bucket: copy each named high-precision tensor in place; FP8 layers re-quantize.

        ``model.layers.{i}.self_attn.{q,k,v}_scale`` entries are FP8 KV scales: kept with the
        update's version (``kv_scales``). Called outside ``start_weight_update`` /
        ``finish_weight_update`` it is one complete refit on its own (version unchanged).

        Raises:
            KeyError: a name this model does not have (lists a few valid names).
            ValueError: shape mismatch or NaN/Inf in an FP8 layer's weight.
        """
        standalone = self._pending is None
        if standalone:
            self.start_weight_update(self._version.weights)
        items = named_tensors.items() if isinstance(named_tensors, Mapping) else named_tensors
        for name, tensor in items:
            if is_kv_scale_name(name):
                self._pending["kv"][parse_kv_scale_name(name)] = float(tensor.reshape(()))
                continue
            if name not in self._targets:
                raise KeyError(f"refit: the generation model has no weight {name!r} "
                               f"(e.g. {sorted(self._targets)[:3]})")
            module, attr = self._targets[name]
            if isinstance(module, Fp8BlockLinear):
                (module.load_weight if attr == "weight" else module.load_bias)(tensor)
            else:
                target = getattr(module, attr)
                if target.shape != tensor.shape:
                    raise ValueError(f"refit: {name} has shape {tuple(tensor.shape)}, expected {tuple(target.shape)}")
                target.copy_(tensor)
            self._pending["seen"].add(name)
        if standalone:
            self.finish_weight_update(require_all=False)

    def finish_weight_update(self, require_all: bool = True) -> WeightVersion:
        """End the refit started by ``start_weight_update``; return the versions now loaded.

        Raises:
            RuntimeError: no refit in progress; or (``require_all``) weights that did not arrive,
                or KV scales for only some layers: the engine would mix two policy versions.
        """
        if self._pending is None:
            raise RuntimeError("finish_weight_update: no weight update in progress (call start_weight_update first)")
        pending, self._pending = self._pending, None
        missing = [n for n in self._targets if n not in pending["seen"] and n not in self._tied]
        if missing and require_all:
            raise RuntimeError(f"refit to version {pending['version']}: {len(missing)} weights did not arrive, "
                               f"e.g. {missing[:3]}; the engine would mix two policy versions")
        kv_step = self._version.kv_scales
        if pending["kv"]:
            layers = {layer for layer, _ in pending["kv"]}
            want = {(layer, kind) for layer in range(self.num_layers) for kind in "qkv"}
            if set(pending["kv"]) != want:
                raise RuntimeError(f"refit to version {pending['version']}: KV scales for {len(pending['kv'])} of "
                                   f"{len(want)} (layer, q/k/v) pairs (layers {sorted(layers)[:4]}...); send all")
            self.kv_scales = {kind: torch.tensor([pending["kv"][(i, kind)] for i in range(self.num_layers)])
                              for kind in "qkv"}
            kv_step = pending["version"]
            for i, module in enumerate(self._kv_modules or []):
                module.fp8_kv_scales = torch.stack([self.kv_scales[k][i] for k in "qkv"]).to(self.device)
        self._version = WeightVersion(pending["version"], kv_step, len(pending["seen"]) + len(pending["kv"]))
        return self._version

    def weight_version(self) -> WeightVersion:
        return self._version

    def engine_params(self, names: list[str]) -> list[dict]:
        """Raw parameters and buffers, as ``VllmGenerationBackend.engine_params`` answers (one worker): name (e.g.
        ``model.layers.0.mlp.down_proj.weight``, an FP8 layer's e4m3 weight, or its ``weight_scale_inv``) ->
        (dtype name, shape, raw bytes). Diagnostics and tests (every engine holds the same bytes after a refit).

        Raises:
            KeyError: a name the model has no parameter or buffer for.
        """
        tensors = dict(self.model.named_parameters())
        tensors.update(self.model.named_buffers())
        out = {}
        for n in names:
            t = tensors[n].detach().contiguous().cpu()
            out[n] = (str(t.dtype).split(".")[-1], list(t.shape), t.view(torch.uint8).numpy().tobytes())
        return [out]

    # ----------------------------------------------------------------------- lifecycle
    def prepare_for_generation(self) -> None:
        """Wake: move the model back to its device (after ``finish_generation`` offloaded it)."""
        if self._asleep:
            self.model.to(self.device)
            self._asleep = False

    def finish_generation(self) -> None:
        """Sleep when colocated on a GPU: move the model to host memory and free the cache."""
        if self.offload_when_idle and self.device.type == "cuda":
            self.model.to("cpu")
            torch.cuda.empty_cache()
            self._asleep = True

    def pop_engine_metrics(self) -> dict[str, float]:
        """``generation/engines``: one engine in this process (a group adds each engine's tokens and seconds)."""
        return {"generation/engines": 1.0}

    def shutdown(self) -> None:
        """Drop the model (and its device memory)."""
        self.model = None  # type: ignore[assignment]
        self._targets = {}
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    @torch.no_grad()
    def generate(self, prompt_token_ids: list[list[int]], sampling: SamplingParams,
                 request_seeds: Optional[Sequence[int]] = None,
                 chunk_sizes: Optional[Sequence[int]] = None) -> GenerationOutput:
        """Sample one response per prompt; returns a right-padded ``GenerationOutput``.

        Args:
            request_seeds: one seed per prompt: each row samples from a generator of its own, so a row's tokens
                depend only on its seed and its logits (data-parallel engines, ``request_seed``). None: one
                generator seeded ``sampling.seed`` draws for the whole batch.
            chunk_sizes: rows of each forward batch, in order (sum = number of prompts); None: ``batch_size``
                rows each. A row's logits depend (by bf16 rounding) on the rows it is batched with, so engines
                that must agree bit for bit get the same batches.

        Raises:
            ValueError: an empty prompt, or a prompt that leaves no room under
                ``max_total_sequence_length``; ``request_seeds`` / ``chunk_sizes`` that do not cover the prompts.
            RuntimeError: called during a weight update or while asleep.
        """
        if self._pending is not None:
            raise RuntimeError("generate: a weight update is in progress (finish_weight_update first)")
        if self._asleep:
            raise RuntimeError("generate: the engine is asleep (call prepare_for_generation first)")
        if self._kv_modules is not None and self.kv_scales is None:
            raise RuntimeError("generate: kv_cache_dtype='fp8' but no KV scales were ever loaded; they arrive with the "
                               "refit (the policy's calibrate_kv_scales), never default to 1.0")
        if not prompt_token_ids:
            raise ValueError("generate: no prompts")
        for i, p in enumerate(prompt_token_ids):
            if not p or len(p) >= self.max_total_sequence_length:
                raise ValueError(f"generate: prompt {i} has {len(p)} tokens; valid: 1 to "
                                 f"{self.max_total_sequence_length - 1} (max_total_sequence_length - 1)")
        n = len(prompt_token_ids)
        sizes = list(chunk_sizes) if chunk_sizes is not None else [min(self.batch_size, n - i)
                                                                   for i in range(0, n, self.batch_size)]
        if sum(sizes) != n or min(sizes) < 1:
            raise ValueError(f"generate: chunk_sizes {sizes} do not cover the {n} prompts")
        if request_seeds is not None and len(request_seeds) != n:
            raise ValueError(f"generate: {len(request_seeds)} request_seeds for {n} prompts")
        shared = torch.Generator(device=self.device).manual_seed(sampling.seed) if request_seeds is None else None
        limits = request_max_new_tokens(sampling, n, request_seeds)
        chunks, start = [], 0
        for size in sizes:
            rows = slice(start, start + size)
            gens = shared if shared is not None else [torch.Generator(device=self.device).manual_seed(int(s))
                                                      for s in request_seeds[rows]]
            chunks.append(self._generate_chunk(prompt_token_ids[rows], sampling, gens, limits[rows]))
            start += size
        return _concat_outputs(chunks, self.pad_token_id)

    def _generate_chunk(self, prompts: list[list[int]], sampling: SamplingParams,
                        gen: torch.Generator | list[torch.Generator], max_new_tokens: list[int]):
        """One forward batch; ``gen``: one generator for the batch, or one per row; ``max_new_tokens``: each row's
        token limit (``request_max_new_tokens``)."""
        b, dev = len(prompts), self.device
        plen = torch.tensor([len(p) for p in prompts], device=dev)  # [B]
        width = int(plen.max())
        # Left-pad for the decode loop; converted back to right padding at the end.
        ids = torch.full((b, width), self.pad_token_id, dtype=torch.long, device=dev)  # [B, P]
        attn = torch.zeros((b, width), dtype=torch.long, device=dev)
        for i, p in enumerate(prompts):
            ids[i, width - len(p):] = torch.tensor(p, device=dev)
            attn[i, width - len(p):] = 1
        limit = torch.minimum(self.max_total_sequence_length - plen, torch.tensor(max_new_tokens, device=dev))  # [B]
        stop_ids = torch.tensor((self.eos_token_id, *sampling.stop_token_ids), device=dev)

        pos = (attn.cumsum(-1) - 1).clamp(min=0)  # [B, P]
        # GRPO asks for n responses to each prompt: the prompt pass runs once per distinct prompt, and its KV cache
        # and last logits are copied to the repeats (the work vLLM's prefix caching saves). The prompt pass is most
        # of a short rollout's time, and the FP8 emulation's cost grows with its rows.
        first, inverse = _distinct_rows(prompts)
        sel = torch.tensor(first, device=dev)  # [U]
        cache_kw = _cache_kwarg(self.model)
        out = self.model(input_ids=ids[sel], attention_mask=attn[sel], position_ids=pos[sel], use_cache=True)
        cache, logits = _output_cache(out), out.logits[:, -1]  # [U, V]
        if len(first) < b:
            rows = torch.tensor(inverse, device=dev)  # [B]
            cache.reorder_cache(rows)  # [U, ...] -> [B, ...] per layer
            logits = logits[rows]  # [B, V]
        next_pos = pos[:, -1:] + 1  # [B, 1]
        tokens, logprobs = [], []
        done = torch.zeros(b, dtype=torch.bool, device=dev)
        resp_len = torch.zeros(b, dtype=torch.long, device=dev)
        for step in range(int(limit.max())):
            logp = torch.log_softmax(logits.float() / sampling.temperature, dim=-1)  # [B, V]
            if sampling.greedy:
                tok = logp.argmax(-1)
            else:
                tok = _sample(logp.exp(), gen)  # [B]
            lp = logp.gather(-1, tok[:, None]).squeeze(-1)
            active = ~done & (step < limit)
            tok = torch.where(active, tok, torch.full_like(tok, self.pad_token_id))
            tokens.append(tok)
            logprobs.append(torch.where(active, lp, torch.zeros_like(lp)))
            resp_len += active.long()
            done |= ~active | torch.isin(tok, stop_ids)
            if bool(done.all()):
                break
            attn = torch.cat([attn, active.long()[:, None]], dim=1)
            out = self.model(input_ids=tok[:, None], attention_mask=attn, position_ids=next_pos,
                             use_cache=True, **{cache_kw: cache})
            cache, logits = _output_cache(out), out.logits[:, -1]
            next_pos = next_pos + 1

        resp = torch.stack(tokens, 1) if tokens else torch.zeros((b, 0), dtype=torch.long, device=dev)  # [B, R]
        resp_lp = torch.stack(logprobs, 1) if logprobs else torch.zeros((b, 0), device=dev)
        last = resp.gather(1, (resp_len - 1).clamp(min=0)[:, None]).squeeze(1)
        truncated = ~((resp_len > 0) & torch.isin(last, stop_ids))
        total = int((plen + resp_len).max())
        token_ids = torch.full((b, total), self.pad_token_id, dtype=torch.long, device=dev)
        gen_lp = torch.zeros((b, total), dtype=torch.float32, device=dev)
        for i, p in enumerate(prompts):
            n, r = len(p), int(resp_len[i])
            token_ids[i, :n] = torch.tensor(p, device=dev)
            token_ids[i, n:n + r] = resp[i, :r]
            gen_lp[i, n:n + r] = resp_lp[i, :r]
        return GenerationOutput(token_ids.cpu(), plen.cpu(), resp_len.cpu(), gen_lp.cpu(), truncated.cpu())


def _cache_kwarg(model: nn.Module) -> str:
    """The name under which ``model.forward`` takes the KV cache: ``cache`` in recent transformers (5.2x), which
    warn on every call given the former ``past_key_values``; ``past_key_values`` before."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def _output_cache(out) -> object:
    """The KV cache a forward returned, under either name (a ``ModelOutput`` holds its set fields as keys)."""
    return out["cache"] if "cache" in out else out["past_key_values"]


def _distinct_rows(prompts: list[list[int]]) -> tuple[list[int], list[int]]:
    """(first, inverse): the index of each distinct prompt's first row, in order, and for every row the position
    in ``first`` of its prompt, so ``first[inverse[i]]`` holds the same tokens as row ``i``."""
    seen: dict[tuple[int, ...], int] = {}
    first, inverse = [], []
    for i, p in enumerate(prompts):
        key = tuple(p)
        if key not in seen:
            seen[key] = len(first)
            first.append(i)
        inverse.append(seen[key])
    return first, inverse


def _sample(probs: Tensor, gen: torch.Generator | list[torch.Generator]) -> Tensor:
    """[B] token ids drawn from ``probs`` [B, V]: with one generator for the batch, or row i with ``gen[i]``."""
    if isinstance(gen, torch.Generator):
        return torch.multinomial(probs, 1, generator=gen).squeeze(-1)
    return torch.cat([torch.multinomial(probs[i], 1, generator=g) for i, g in enumerate(gen)])


def _concat_outputs(chunks: list[GenerationOutput], pad_token_id: int) -> GenerationOutput:
    return GenerationOutput(
        token_ids=concat_padded([c.token_ids for c in chunks], pad_token_id),
        prompt_lengths=torch.cat([c.prompt_lengths for c in chunks]),
        response_lengths=torch.cat([c.response_lengths for c in chunks]),
        generation_logprobs=concat_padded([c.generation_logprobs for c in chunks], 0.0),
        truncated=torch.cat([c.truncated for c in chunks]),
    ).validate()

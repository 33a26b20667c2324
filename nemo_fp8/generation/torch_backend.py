"""Reference generation backend: an HF causal LM with a KV-cache sampling loop, in pure torch.

Precision ``bfloat16`` runs the model in bf16. Precision ``fp8`` additionally replaces every
FP8-eligible Linear (``nemo_fp8.fp8.plan_layer_precision``) by ``Fp8BlockLinear``: W8A8 with
128x128 weight blocks and 1x128 activation groups, the numerics of vLLM's block-scaled FP8
kernels, with weights quantized at every refit (``update_weights``). Runs on CPU, or CUDA when
there is one, with the same code; slow, and meant to pin down numerics, not to serve.
"""

from __future__ import annotations

import logging
from typing import Iterable, Mapping

import torch
from torch import Tensor, nn

from nemo_fp8.batch import GenerationOutput, concat_padded
from nemo_fp8.generation.config import VllmConfig
from nemo_fp8.fp8 import Fp8BlockLinear, LayerPrecisionPlan, plan_layer_precision
from nemo_fp8.generation.interfaces import SamplingParams
from nemo_fp8.models.hf import load_causal_lm

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
    """

    def __init__(self, model_name: str, vllm_cfg: VllmConfig, device: torch.device, pad_token_id: int,
                 eos_token_id: int, max_total_sequence_length: int, batch_size: int = 64):
        self.device = device
        self.pad_token_id, self.eos_token_id = pad_token_id, eos_token_id
        self.max_total_sequence_length = max_total_sequence_length
        self.batch_size = batch_size
        self.precision = vllm_cfg.precision
        self.model = load_causal_lm(model_name, torch.bfloat16, device).eval().requires_grad_(False)
        self.plan = convert_to_fp8_inference(self.model, vllm_cfg) if vllm_cfg.precision == "fp8" else None
        self._targets = self._refit_targets()

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

    @torch.no_grad()
    def update_weights(self, named_tensors: Mapping[str, Tensor] | Iterable[tuple[str, Tensor]]) -> None:
        """Refit: copy each named high-precision tensor in place; FP8 layers re-quantize blockwise.

        Raises:
            KeyError: a name this model does not have (lists a few valid names).
            ValueError: shape mismatch or NaN/Inf in an FP8 layer's weight.
        """
        items = named_tensors.items() if isinstance(named_tensors, Mapping) else named_tensors
        seen = set()
        for name, tensor in items:
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
            seen.add(name)
        missing = [n for n in self._targets if n not in seen and self._targets[n][0] is not self.model.get_output_embeddings()]
        if missing:
            logger.warning("refit left %d weights unchanged, e.g. %s", len(missing), missing[:3])

    @torch.no_grad()
    def generate(self, prompt_token_ids: list[list[int]], sampling: SamplingParams) -> GenerationOutput:
        """Sample one response per prompt; returns a right-padded ``GenerationOutput``.

        Raises:
            ValueError: an empty prompt, or a prompt that leaves no room under
                ``max_total_sequence_length``.
        """
        if not prompt_token_ids:
            raise ValueError("generate: no prompts")
        for i, p in enumerate(prompt_token_ids):
            if not p or len(p) >= self.max_total_sequence_length:
                raise ValueError(f"generate: prompt {i} has {len(p)} tokens; valid: 1 to "
                                 f"{self.max_total_sequence_length - 1} (max_total_sequence_length - 1)")
        gen = torch.Generator(device=self.device).manual_seed(sampling.seed)
        chunks = [self._generate_chunk(prompt_token_ids[i:i + self.batch_size], sampling, gen)
                  for i in range(0, len(prompt_token_ids), self.batch_size)]
        return _concat_outputs(chunks, self.pad_token_id)

    def _generate_chunk(self, prompts: list[list[int]], sampling: SamplingParams, gen: torch.Generator):
        b, dev = len(prompts), self.device
        plen = torch.tensor([len(p) for p in prompts], device=dev)  # [B]
        width = int(plen.max())
        # Left-pad for the decode loop; converted back to right padding at the end.
        ids = torch.full((b, width), self.pad_token_id, dtype=torch.long, device=dev)  # [B, P]
        attn = torch.zeros((b, width), dtype=torch.long, device=dev)
        for i, p in enumerate(prompts):
            ids[i, width - len(p):] = torch.tensor(p, device=dev)
            attn[i, width - len(p):] = 1
        limit = (self.max_total_sequence_length - plen).clamp(max=sampling.max_new_tokens)  # [B]
        stop_ids = torch.tensor((self.eos_token_id, *sampling.stop_token_ids), device=dev)

        pos = (attn.cumsum(-1) - 1).clamp(min=0)  # [B, P]
        out = self.model(input_ids=ids, attention_mask=attn, position_ids=pos, use_cache=True)
        cache, logits = out.past_key_values, out.logits[:, -1]  # [B, V]
        next_pos = pos[:, -1:] + 1  # [B, 1]
        tokens, logprobs = [], []
        done = torch.zeros(b, dtype=torch.bool, device=dev)
        resp_len = torch.zeros(b, dtype=torch.long, device=dev)
        for step in range(int(limit.max())):
            logp = torch.log_softmax(logits.float() / sampling.temperature, dim=-1)  # [B, V]
            if sampling.greedy:
                tok = logp.argmax(-1)
            else:
                tok = torch.multinomial(logp.exp(), 1, generator=gen).squeeze(-1)  # [B]
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
                             past_key_values=cache, use_cache=True)
            cache, logits = out.past_key_values, out.logits[:, -1]
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


def _concat_outputs(chunks: list[GenerationOutput], pad_token_id: int) -> GenerationOutput:
    return GenerationOutput(
        token_ids=concat_padded([c.token_ids for c in chunks], pad_token_id),
        prompt_lengths=torch.cat([c.prompt_lengths for c in chunks]),
        response_lengths=torch.cat([c.response_lengths for c in chunks]),
        generation_logprobs=concat_padded([c.generation_logprobs for c in chunks], 0.0),
        truncated=torch.cat([c.truncated for c in chunks]),
    ).validate()

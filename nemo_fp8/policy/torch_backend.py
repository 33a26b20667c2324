"""Reference policy backend: an HF causal LM trained with AdamW, in pure torch.

When ``policy.megatron_cfg.fp8_cfg.enabled`` is set, every FP8-eligible Linear
(``nemo_fp8.fp8.plan_layer_precision``) becomes an ``Fp8TrainingLinear`` that emulates the
TransformerEngine recipe by quantize-dequantize (``tensorwise`` current scaling or
``blockwise`` 1x128 / 128x128; ``e4m3`` everywhere or ``hybrid`` with e5m2 gradients). Master
weights stay in ``policy.precision``. Correct and testable, not fast; runs on CPU or CUDA.
"""

from __future__ import annotations

import copy
import logging
import math
from pathlib import Path
from typing import Iterator

import torch
from torch import Tensor, nn

from nemo_fp8.batch import TrainBatch
from nemo_fp8.policy.config import Fp8TrainingConfig, PolicyConfig
from nemo_fp8.fp8 import Fp8TrainingRecipe, apply_fp8_training, plan_layer_precision
from nemo_fp8.models.hf import DTYPES, attention_mask_for, load_causal_lm, token_logprobs
from nemo_fp8.policy.interfaces import LossFn

logger = logging.getLogger(__name__)


def enable_fp8_training(model: nn.Module, fp8_cfg: Fp8TrainingConfig) -> list[str]:
    """Replace the FP8-eligible Linears of ``model`` by TE-recipe emulations; return their names."""
    recipe = Fp8TrainingRecipe(fp8=fp8_cfg.fp8, fp8_recipe=fp8_cfg.fp8_recipe)
    names = apply_fp8_training(model, plan_layer_precision(model).fp8_modules, recipe)
    logger.info("fp8 training (%s, %s): %d Linear modules emulated", fp8_cfg.fp8, fp8_cfg.fp8_recipe, len(names))
    return names


class TorchPolicyBackend:
    """``PolicyBackend`` in pure torch (see the module docstring).

    Args:
        cfg: the ``policy`` config section (model, precision, batch sizes, optimizer, fp8_cfg).
        device: torch device.
        temperature: the generation temperature; logits are divided by it before log-softmax,
            so trainer and rollout score the same distribution.
        keep_reference: keep a frozen copy of the initial weights for the KL penalty.
    """

    def __init__(self, cfg: PolicyConfig, device: torch.device, temperature: float = 1.0,
                 keep_reference: bool = False):
        self.cfg, self.device, self.temperature = cfg, device, temperature
        self.model = load_causal_lm(cfg.model_name, DTYPES[cfg.precision], device)
        self.reference = copy.deepcopy(self.model).eval().requires_grad_(False) if keep_reference else None
        self.fp8_modules = enable_fp8_training(self.model, cfg.megatron_cfg.fp8_cfg) \
            if cfg.megatron_cfg.fp8_cfg.enabled else []
        opt = cfg.optimizer
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=opt.lr, weight_decay=opt.weight_decay,
                                           betas=tuple(opt.betas), eps=opt.eps)
        self.num_updates = 0

    # ----------------------------------------------------------------------- log-probs
    def _forward_logprobs(self, model: nn.Module, mb: TrainBatch) -> Tensor:
        ids = mb.token_ids.to(self.device)
        attn = attention_mask_for(mb.prompt_lengths, mb.response_lengths, ids.shape[1]).to(self.device)
        logits = model(input_ids=ids, attention_mask=attn).logits  # [B, T, V]
        lp = token_logprobs(logits, ids, self.temperature)  # [B, T]
        return lp * mb.token_mask.to(self.device)

    @torch.no_grad()
    def get_logprobs(self, batch: TrainBatch, reference: bool = False) -> Tensor:
        """[B, T] float32 (CPU) log-probs of ``batch``'s responses; 0 elsewhere.

        Raises:
            ValueError: ``reference=True`` without a reference model.
        """
        model = self.reference if reference else self.model
        if model is None:
            raise ValueError("get_logprobs(reference=True): no reference model (loss_fn.reference_policy_kl_penalty is 0)")
        was_training = model.training
        model.eval()
        out = torch.zeros(batch.token_ids.shape, dtype=torch.float32)
        step = self.cfg.logprob_batch_size
        for i in range(0, batch.size, step):
            mb = batch.select(slice(i, i + step)).trimmed()
            out[i:i + step, : mb.token_ids.shape[1]] = self._forward_logprobs(model, mb).float().cpu()
        model.train(was_training)
        return out

    # ----------------------------------------------------------------------- training
    def train(self, batch: TrainBatch, loss_fn: LossFn) -> dict[str, float]:
        """One optimizer step per ``train_global_batch_size`` rows of ``batch``.

        The loss of each micro-batch is normalised by the valid token / sequence counts of its
        global batch, so summed micro-batch gradients equal the global-batch gradient.
        Returns metrics averaged over global batches (``loss`` summed within one).

        Raises:
            ValueError: the batch fails ``TrainBatch.validate`` or its size is not a multiple
                of ``train_global_batch_size``.
        """
        batch.validate()
        gbs, mbs = self.cfg.train_global_batch_size, self.cfg.train_micro_batch_size
        if batch.size % gbs != 0:
            raise ValueError(f"train: batch of {batch.size} is not a multiple of policy.train_global_batch_size={gbs}")
        self.model.train()
        history: list[dict[str, float]] = []
        for g in range(0, batch.size, gbs):
            gb = batch.select(slice(g, g + gbs))
            mask = gb.token_mask
            n_tokens = float(mask.sum())
            n_seqs = float((mask.sum(1) > 0).sum())
            self.optimizer.zero_grad(set_to_none=True)
            step_metrics: dict[str, float] = {}
            for m in range(0, gbs, mbs):
                mb = gb.select(slice(m, m + mbs)).trimmed().to(self.device)  # moved once, used twice
                logprobs = self._forward_logprobs(self.model, mb)
                loss, metrics = loss_fn(logprobs, mb, max(n_tokens, 1.0), max(n_seqs, 1.0))
                loss.backward()
                for k, v in metrics.items():  # loss terms and counts add up; the rest: token-weighted mean
                    summed = k in ("loss", "pg_loss", "kl_penalty") or k.startswith("num_")
                    w = 1.0 if summed else float(mb.token_mask.sum()) / max(n_tokens, 1.0)
                    step_metrics[k] = step_metrics.get(k, 0.0) + w * float(v)
            grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.max_grad_norm)
            if not math.isfinite(float(grad_norm)):
                raise FloatingPointError(f"train: non-finite gradient norm {float(grad_norm)} at update {self.num_updates}")
            self.optimizer.step()
            self.num_updates += 1
            step_metrics["grad_norm"] = float(grad_norm)
            history.append(step_metrics)
        return {k: sum(h[k] for h in history) / len(history) for k in history[0]}

    # ----------------------------------------------------------------------- weights
    def named_weights(self) -> Iterator[tuple[str, Tensor]]:
        """(HF name, detached tensor) for every weight, in ``state_dict`` order."""
        for name, t in self.model.state_dict().items():
            if t.is_floating_point() and not name.endswith("inv_freq"):
                yield name, t.detach()

    def save(self, path: str | Path) -> None:
        """Save model (HF ``save_pretrained``, safetensors) and optimizer state under ``path``."""
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        self.model.save_pretrained(path / "model")
        torch.save({"optimizer": self.optimizer.state_dict(), "num_updates": self.num_updates}, path / "optimizer.pt")

    def load(self, path: str | Path) -> None:
        """Load what ``save`` wrote (weights in place, then optimizer state; the learning rate and
        weight decay stay those of ``cfg.optimizer``, so a resumed run applies changed values).

        Raises:
            FileNotFoundError: ``path`` lacks ``model/`` or ``optimizer.pt``.
        """
        from safetensors.torch import load_file

        path = Path(path)
        files = sorted((path / "model").glob("*.safetensors"))
        if not files or not (path / "optimizer.pt").is_file():
            raise FileNotFoundError(f"policy checkpoint {path} needs model/*.safetensors and optimizer.pt")
        state = {}
        for f in files:
            state.update(load_file(str(f), device=str(self.device)))
        missing, unexpected = self.model.load_state_dict(state, strict=False)
        missing = [m for m in missing if not m.endswith("inv_freq") and m != "lm_head.weight"]
        if missing or unexpected:
            raise ValueError(f"policy checkpoint {path}: missing {missing[:5]}, unexpected {unexpected[:5]}")
        extra = torch.load(path / "optimizer.pt", map_location=self.device, weights_only=True)
        self.optimizer.load_state_dict(extra["optimizer"])
        for group in self.optimizer.param_groups:  # the config's values win over the checkpoint's
            group["lr"], group["weight_decay"] = self.cfg.optimizer.lr, self.cfg.optimizer.weight_decay
        self.num_updates = int(extra["num_updates"])

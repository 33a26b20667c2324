"""The refit in the engine's kernel format: tensors named and shaped as the vLLM engine's own parameters.

vLLM 0.22's ``LLM.start_weight_update(is_checkpoint_format=False)`` loads a refit by ``model.get_parameter(name)
.copy_(tensor)`` (``Worker.update_weights``, "weights are already in kernel format, copy directly") instead of its
layerwise reload, which per layer re-creates the layer's tensors, runs the model's weight loaders and the
quantization method's ``process_weights_after_loading`` and copies the result into the kernel's tensors
(``vllm/model_executor/model_loader/reload/layerwise.py``). The tensors must then be what the kernels read:

* fused modules (the model's ``packed_modules_mapping``, e.g. Qwen3's ``qkv_proj`` = q, k, v and ``gate_up_proj``
  = gate, up) as one tensor, the parts stacked along dim 0 in the mapping's order, their ``weight_scale_inv`` too;
* for a block FP8 linear, the e4m3 weight and its fp32 ``weight_scale_inv`` as a checkpoint holds them: on CUDA the
  CUTLASS block-scaled kernel's processing leaves both as loaded (``process_fp8_weight_block_strategy`` pads on ROCm
  only), while DeepGEMM's re-lays them out (``deepgemm_post_process_fp8_weight_block``), so this format is for the
  CUTLASS kernel (``vllm_cfg.use_deep_gemm: false``) and BF16 engines (unquantized linears process nothing on CUDA).

``KernelLayout`` (pure torch) turns the refit's converted stream (``RefitPlan.convert_all``: HF names, FP8 weights
quantized per HF tensor) into that form. Quantizing q, k and v apart and stacking them gives the bits of the fused
weight's blockwise quantization when each part's rows are a multiple of the 128-row block (Qwen3-8B: 4,096, 1,024,
1,024), which ``KernelLayout.check`` requires.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Iterator

import torch
from torch import Tensor

# the tensors of one linear module the refit sends (weight, and for FP8 its block scales)
_SUFFIXES = (".weight", ".weight_scale_inv")
BLOCK = 128


@dataclass
class KernelLayout:
    """The engine's parameters and how HF tensors map onto them (built by the engine, used by the sender).

    Attributes:
        params: engine parameter name -> (dtype name, shape), ``model.named_parameters()`` of the engine's model.
        packed: fused module name -> its HF parts in order (the model's ``packed_modules_mapping``).
    """

    params: dict[str, tuple[str, list[int]]]
    packed: dict[str, list[str]] = field(default_factory=dict)

    def target(self, name: str) -> tuple[str, int, int]:
        """(engine parameter, part index, parts) of HF tensor ``name``: a part of a fused module's tensor, or the
        tensor of the same name (part 0 of 1).

        Raises:
            KeyError: the engine has no such parameter.
        """
        for suffix in _SUFFIXES:
            if not name.endswith(suffix):
                continue
            prefix, _, module = name[: -len(suffix)].rpartition(".")
            for fused, parts in self.packed.items():
                if module in parts:
                    engine = f"{prefix}.{fused}{suffix}" if prefix else f"{fused}{suffix}"
                    if engine not in self.params:
                        raise KeyError(f"kernel-format refit: {name!r} is part {module!r} of {fused!r}, but the "
                                       f"engine has no parameter {engine!r}")
                    return engine, parts.index(module), len(parts)
        if name not in self.params:
            raise KeyError(f"kernel-format refit: the engine has no parameter {name!r} (e.g. "
                           f"{sorted(self.params)[:3]})")
        return name, 0, 1

    def check(self, hf_shapes: dict[str, tuple[int, ...]], skip: Iterable[str] = ()) -> None:
        """That the HF tensors the refit sends (``hf_shapes``: converted name -> shape, ``skip`` left out) cover every
        engine parameter exactly, with each part of a fused FP8 weight a whole number of 128-row blocks.

        Raises:
            ValueError: an engine parameter no tensor reaches, a stacked shape other than the parameter's, or a
                fused part whose rows do not fill whole blocks (its scales would not stack).
        """
        stacked: dict[str, list[tuple[int, tuple[int, ...]]]] = {}
        skip = set(skip)
        for name, shape in hf_shapes.items():
            if name in skip:
                continue
            engine, part, _ = self.target(name)
            stacked.setdefault(engine, []).append((part, tuple(shape)))
        missing = sorted(set(self.params) - set(stacked))
        if missing:
            raise ValueError(f"kernel-format refit: no tensor of the refit reaches the engine's {missing[:3]} "
                             f"({len(missing)} in all); use vllm_cfg.refit_format: checkpoint")
        for engine, parts in stacked.items():
            shapes = [s for _, s in sorted(parts)]
            rows = sum(s[0] for s in shapes) if shapes[0] else 0
            want = self.params[engine][1]
            got = [rows, *shapes[0][1:]] if shapes[0] else []
            if list(got) != list(want):
                raise ValueError(f"kernel-format refit: {engine} stacks to {got}, the engine's is {want}")
            fused_fp8 = len(shapes) > 1 and engine.endswith(".weight") and f"{engine}_scale_inv" in self.params
            if fused_fp8 and any(s[0] % BLOCK for s in shapes):
                raise ValueError(f"kernel-format refit: {engine}'s parts have {[s[0] for s in shapes]} rows, not "
                                 f"multiples of the {BLOCK}-row block; use vllm_cfg.refit_format: checkpoint")

    def fuse(self, items: Iterable[tuple[str, Tensor]]) -> Iterator[tuple[str, Tensor]]:
        """The converted stream in kernel format: a tensor of an unfused parameter as it comes, the parts of a fused
        one held until all have come and then stacked along dim 0 (one new tensor on their device).

        Raises:
            KeyError: a tensor the engine has no parameter for (``target``).
            ValueError: a part sent twice, a stacked tensor whose shape or dtype is not the parameter's, or parts
                still held at the end of the stream (the refit would leave the parameter stale).
        """
        held: dict[str, dict[int, Tensor]] = {}
        for name, t in items:
            engine, part, n = self.target(name)
            if n == 1:
                yield engine, self._checked(engine, t)
                continue
            parts = held.setdefault(engine, {})
            if part in parts:
                raise ValueError(f"kernel-format refit: part {part} of {engine} sent twice ({name})")
            parts[part] = t
            if len(parts) == n:
                del held[engine]
                yield engine, self._checked(engine, torch.cat([parts[i] for i in range(n)], dim=0))
        if held:
            raise ValueError(f"kernel-format refit: the stream ended with parts of {sorted(held)[:3]} missing")

    def _checked(self, engine: str, t: Tensor) -> Tensor:
        dtype, shape = self.params[engine]
        if list(t.shape) != list(shape) or str(t.dtype).removeprefix("torch.") != dtype:
            raise ValueError(f"kernel-format refit: {engine} arrives as {str(t.dtype).removeprefix('torch.')}"
                             f"{list(t.shape)}, the engine holds {dtype}{list(shape)}")
        return t

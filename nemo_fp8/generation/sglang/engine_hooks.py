"""Functions that run inside the SGLang engine's scheduler process, next to the model (imports torch only).

SGLang 0.5.17 has no worker extension (vLLM's ``worker_extension_cls``); what it does have is
``ServerArgs.custom_weight_loader``: import paths that ``update_weights_from_tensor(..., load_format=<path>)`` may
name, whose function ``WeightUpdater.update_weights_from_tensor`` (``srt/model_executor/model_runner_components/
weight_updater.py``) calls as ``fn(model, named_tensors)`` with the request's tensors rebuilt in this process (CUDA
IPC handles of the sender's memory, moved ``.to(device)``: a no-op on the same GPU, so writes into them land in the
sender's memory). ``engine_args`` registers both functions below.

* ``synchronize``: waits for this process's GPU work. The backend sends it after each bucket, so the bucket's copies
  into the parameters have run before the sender frees or reuses the bucket's memory (``load_weights`` only enqueues
  them, and SGLang's update path ends in a CPU barrier, not a device sync).
* ``read_engine_state``: fills the tensors it is handed with what the engine holds (KV scales, parameter addresses,
  memory): the live checks of the GPU tests (``SglangGenerationBackend.engine_state``). SGLang's own
  ``get_weights_by_name`` cannot serve them: ``Qwen3ForCausalLM`` has no such method in 0.5.17.
"""

from __future__ import annotations

import math

import torch

KV_SCALES = "kv_scales"      # [num_layers, 4] float32: k_scale, v_scale (tensors), k_scale_float, v_scale_float
PARAM_PTRS = "param_ptrs"    # [1 + n] int64: the parameter count, then each data_ptr in named_parameters order
MEMORY = "memory"            # [3] int64: torch.cuda.memory_allocated, memory_reserved, free bytes (mem_get_info)


def synchronize(model: torch.nn.Module, named_tensors: list) -> None:
    """``torch.cuda.synchronize()`` in the engine's process (see the module docstring).

    Raises:
        ValueError: tensors were sent with it (it loads nothing).
    """
    if named_tensors:
        raise ValueError(f"synchronize loads no weights; got {len(named_tensors)} tensors")
    torch.cuda.synchronize()


def _float_or_nan(value) -> float:
    return math.nan if value is None else float(value)


def _fill_kv_scales(model: torch.nn.Module, out: torch.Tensor) -> None:
    """Row ``layer_id`` of ``out``: the attention layer's ``k_scale``, ``v_scale`` (the tensors FA3 reads),
    ``k_scale_float``, ``v_scale_float`` (the floats fixed at load, NaN if unset); NaN rows for missing layers."""
    out.fill_(math.nan)
    for module in model.modules():
        k, v = getattr(module, "k_scale", None), getattr(module, "v_scale", None)
        layer = getattr(module, "layer_id", None)
        if not isinstance(k, torch.Tensor) or not isinstance(v, torch.Tensor) or layer is None:
            continue
        if 0 <= layer < out.shape[0]:
            out[layer, 0] = k.detach().reshape(-1)[0].float()
            out[layer, 1] = v.detach().reshape(-1)[0].float()
            out[layer, 2] = _float_or_nan(getattr(module, "k_scale_float", None))
            out[layer, 3] = _float_or_nan(getattr(module, "v_scale_float", None))


def read_engine_state(model: torch.nn.Module, named_tensors: list) -> None:
    """Write the engine's state into the tensors sent (any subset of ``KV_SCALES``, ``PARAM_PTRS``, ``MEMORY``).

    ``PARAM_PTRS`` gets the count in element 0 and as many addresses as fit after it (the reader checks the count).
    Ends with ``torch.cuda.synchronize()``, so the writes are done when the request returns.

    Raises:
        KeyError: a tensor of another name.
    """
    for name, out in named_tensors:
        if name == KV_SCALES:
            _fill_kv_scales(model, out)
        elif name == PARAM_PTRS:
            ptrs = [p.data_ptr() for _, p in model.named_parameters()]
            out.zero_()
            out[0] = len(ptrs)
            fit = min(len(ptrs), out.numel() - 1)
            if fit:
                out[1:1 + fit] = torch.tensor(ptrs[:fit], dtype=torch.int64, device=out.device)
        elif name == MEMORY:
            free, _ = torch.cuda.mem_get_info()
            out.copy_(torch.tensor([torch.cuda.memory_allocated(), torch.cuda.memory_reserved(), free],
                                   dtype=torch.int64, device=out.device))
        else:
            raise KeyError(f"read_engine_state: no state named {name!r} (valid: {KV_SCALES}, {PARAM_PTRS}, {MEMORY})")
    torch.cuda.synchronize()

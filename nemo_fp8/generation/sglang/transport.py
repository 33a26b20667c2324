"""Requests into a running ``sglang.Engine``: weight buckets over CUDA IPC, the engine hooks, the weight version.

Everything here calls SGLang 0.5.17 (imported inside the functions, so the module imports without it):

* payloads: ``MultiprocessingSerializer.serialize`` (``srt/utils/common.py``; torch's ``ForkingPickler``, so a CUDA
  tensor travels as an IPC handle and the engine's scheduler maps the sender's memory), after
  ``monkey_patch_torch_reductions`` (``srt/utils/patch_torch.py``: the handle names its GPU by UUID, which the
  receiver maps to its own index), as ``Engine.update_weights_from_tensor``'s callers do. The receiver unpickles with
  an allow-list (``SafeUnpickler``), which admits torch and ``sglang.srt.weight_sync.tensor_bucket`` classes: a
  flattened bucket's metadata is therefore SGLang's own ``FlattenedTensorMetadata``. One payload per tensor-parallel
  rank (``Engine._serialize_tensors_per_rank``); the engines here have one.
* ``update_from_tensor``: what ``Engine.update_weights_from_tensor`` (``srt/entrypoints/engine.py``) does, plus the
  request's ``weight_version``, a field of ``UpdateWeightsFromTensorReqInput`` that the public method does not pass:
  on success the tokenizer manager records it (``_update_weight_version_if_provided``) and every later output's
  ``meta_info["weight_version"]`` carries it, so each response names the policy version that produced it.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

from torch import Tensor

from nemo_fp8.generation.sglang.refit import FlatBucket


def serialize_flat_bucket(bucket: FlatBucket) -> bytes:
    """One ``load_format="flattened_bucket"`` payload: ``{"flattened_tensor": buffer, "metadata": [...]}``, the dict
    ``WeightUpdater._update_weights_from_flattened_bucket`` reads, serialized for one rank."""
    import torch
    from sglang.srt.utils import MultiprocessingSerializer
    from sglang.srt.utils.patch_torch import monkey_patch_torch_reductions
    from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorMetadata

    monkey_patch_torch_reductions()
    meta = [FlattenedTensorMetadata(name=e.name, shape=torch.Size(e.shape), dtype=e.dtype, start_idx=e.start_idx,
                                    end_idx=e.end_idx, numel=e.numel) for e in bucket.entries]
    return MultiprocessingSerializer.serialize({"flattened_tensor": bucket.buffer, "metadata": meta})


def serialize_named_tensors(items: Sequence[tuple[str, Tensor]]) -> bytes:
    """A payload of ``(name, tensor)`` pairs for one rank (the form a ``custom_weight_loader`` receives)."""
    from sglang.srt.utils import MultiprocessingSerializer
    from sglang.srt.utils.patch_torch import monkey_patch_torch_reductions

    monkey_patch_torch_reductions()
    return MultiprocessingSerializer.serialize(list(items))


def update_from_tensor(engine: Any, payloads: list[bytes], load_format: Optional[str], flush_cache: bool = False,
                       weight_version: Optional[str] = None) -> None:
    """One ``update_weights_from_tensor`` request; returns once the engine has run it.

    Args:
        engine: the ``sglang.srt.entrypoints.engine.Engine``.
        payloads: one serialized payload per tensor-parallel rank.
        load_format: ``"flattened_bucket"``, None (``model.load_weights`` on the pairs) or a ``custom_weight_loader``
            import path (``engine_hooks``).
        flush_cache: flush the prefix cache after it.
        weight_version: on success, the version SGLang tags later outputs with.

    Raises:
        RuntimeError: the engine reports failure (its message included).
    """
    from sglang.srt.managers.io_struct import UpdateWeightsFromTensorReqInput

    obj = UpdateWeightsFromTensorReqInput(serialized_named_tensors=payloads, load_format=load_format,
                                          flush_cache=flush_cache, weight_version=weight_version)
    success, message = engine.loop.run_until_complete(engine.tokenizer_manager.update_weights_from_tensor(obj, None))
    if not success:
        raise RuntimeError(f"SGLang update_weights_from_tensor (load_format={load_format!r}) failed: {message}")

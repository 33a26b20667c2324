"""Checkpoints of the megatron backend: megatron-core's distributed checkpoint (model + optimizer, every rank its
shards) and an HF checkpoint of the weights (safetensors, for evaluation, vLLM and the checkpoint check).

Layout of ``path``: ``megatron/`` (``dist_checkpointing``; one ``model`` entry, or ``model0``, ``model1``, ... per
virtual pipeline chunk as Megatron-LM's ``generate_state_dict`` writes them), ``model/`` (HF), ``optimizer.pt``
(the update count). Imported by ``nemo_fp8.policy.megatron.backend`` on the GPU host only.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
import torch.distributed as dist
from torch import Tensor


def model_keys(num_chunks: int) -> list[str]:
    """The state-dict keys of the model chunks: ``model`` for one, ``model0..`` for several (Megatron-LM's names)."""
    return ["model"] if num_chunks == 1 else [f"model{i}" for i in range(num_chunks)]


def sharded_state_dict(backend, is_loading: bool) -> dict:
    """The backend's model chunks and optimizer as one sharded state dict (the optimizer's fully reshardable
    format, so a checkpoint loads under another data-parallel size)."""
    state = {key: chunk.module.sharded_state_dict() for key, chunk in zip(model_keys(len(backend.chunks)),
                                                                          backend.chunks)}
    model_state = state["model"] if len(backend.chunks) == 1 else dict(state)  # Megatron-LM passes the chunks' dict
    state["optimizer"] = backend.optimizer.sharded_state_dict(
        model_state, is_loading, metadata={"distrib_optim_sharding_type": "fully_reshardable"})
    return state


def save(backend, path: Path) -> None:
    """Every rank: ``megatron/``, ``model/`` and (rank 0) ``optimizer.pt`` under ``path`` (module docstring)."""
    from megatron.core import dist_checkpointing

    path.mkdir(parents=True, exist_ok=True)
    (path / "megatron").mkdir(exist_ok=True)
    dist_checkpointing.save(sharded_state_dict(backend, is_loading=False), str(path / "megatron"))
    save_hf(backend, path / "model")
    if backend.rank == 0:
        torch.save({"num_updates": backend.num_updates}, path / "optimizer.pt")
    dist.barrier()


def save_hf(backend, path: Path, shard_bytes: int = 4 << 30) -> None:
    """The weights as an HF checkpoint (safetensors shards + the source's config and tokenizer files): every rank
    iterates the export (it gathers tensor-parallel shards and pipeline stages), rank 0 writes. Bridge's own
    ``save_hf_pretrained`` imports ModelOpt, which the stack does not carry."""
    from safetensors.torch import save_file

    shards: list[dict[str, Tensor]] = [{}]
    size = 0
    for name, t in backend.named_weights():
        if backend.rank != 0:
            continue
        if size and size + t.numel() * t.element_size() > shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t.detach().to("cpu", copy=True).contiguous()
        size += t.numel() * t.element_size()
    if backend.rank != 0:
        return
    path.mkdir(parents=True, exist_ok=True)
    index = {}
    for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(path / fname), metadata={"format": "pt"})
        index.update({n: fname for n in shard})
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": index}))
    for f in Path(backend.cfg.model_name).glob("*"):
        if f.is_file() and (f.suffix in (".json", ".jinja", ".txt", ".model")) and "safetensors" not in f.name:
            shutil.copy2(f, path / f.name)


def load(backend, path: Path) -> None:
    """Load ``megatron/`` into the backend's chunks and optimizer and its update count from ``optimizer.pt``.

    Raises:
        FileNotFoundError: ``path`` lacks ``megatron/`` or ``optimizer.pt``.
    """
    from megatron.core import dist_checkpointing

    if not (path / "megatron").is_dir() or not (path / "optimizer.pt").is_file():
        raise FileNotFoundError(f"policy checkpoint {path} needs megatron/ (megatron-core distributed checkpoint) "
                                "and optimizer.pt; it was not written by the megatron backend")
    state = dist_checkpointing.load(sharded_state_dict(backend, is_loading=True), str(path / "megatron"))
    for key, chunk in zip(model_keys(len(backend.chunks)), backend.chunks):
        chunk.module.load_state_dict(state[key])
    backend.optimizer.load_state_dict(state["optimizer"])
    backend.num_updates = int(torch.load(path / "optimizer.pt", map_location="cpu", weights_only=True)["num_updates"])

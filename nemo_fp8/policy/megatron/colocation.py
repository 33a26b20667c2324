"""What the Megatron policy backend moves or frees around a colocated refit (``MegatronPolicyBackend``'s mixin).

Colocated with the engine (``policy.generation.colocated``), with ``offload_trainer``: ``offload_before_refit``
frees the gradients and moves the optimizer state to host memory (not with the optimizer CPU offload, whose host
part already fills the host), ``offload_after_refit`` the weights too (mcore's ``offload_to_cpu`` on the DDP
buffers, as NeMo-RL's megatron worker does; the optimizer state into one pinned host arena kept across steps,
``nemo_fp8.policy.offload``). Without it, ``release_cached_memory`` frees only what the next pass rebuilds (the
gradient buffer, TransformerEngine's FP8 weight copies) and the allocator's cache: the weights and optimizer state
stay beside the awake engine. ``prepare_for_training`` brings back whatever left.

The mixin reads the backend's ``chunks`` (the model chunks), ``optimizer``, ``cfg`` (the policy config), ``_host``
(a ``HostBuffers``) and ``_offloaded`` / ``_state_on_host`` (what is out now).
"""

from __future__ import annotations

import gc

import torch

from nemo_fp8.policy.megatron.memory import DTYPE_BYTES
from nemo_fp8.policy.offload import HostBuffers, timed_parts
from nemo_fp8.utils.memory import cuda_memory_gib, set_expandable_segments


class ColocationMixin:
    """The colocated refit's moves of ``MegatronPolicyBackend`` (module docstring)."""

    FROZEN_FULL_COLLECTS = 2  # full collections whose survivors are frozen (``_collect_garbage``)
    _frozen_collects = 0  # how many have been, so far (set on the instance)

    def _ddp_buffers(self) -> list:
        return [buf for chunk in self.chunks for buf in [*chunk.buffers, *chunk.expert_parallel_buffers]]

    def _pin_weight_host_copies(self) -> None:
        """Allocate the page-locked host copies of the DDP parameter buffers now. megatron-core's first
        ``offload_to_cpu`` would otherwise make them inside the first colocated refit, as a pageable copy and then a
        pinned one (``param_data.cpu().pin_memory()``, the rank's whole weights), and reuse them (``copy_``) after."""
        for buf in self._ddp_buffers():
            if buf.param_data is not None and buf.param_data_cpu is None:
                buf.param_data_cpu = torch.empty(buf.param_data.shape, dtype=buf.param_data.dtype, pin_memory=True)

    def _move_ddp_buffers(self, to_cpu: bool, params: bool, grads: bool) -> None:
        for buf in self._ddp_buffers():
            if to_cpu:
                buf.offload_to_cpu(move_params=params, move_grads=grads)
            else:
                buf.reload_from_cpu(move_params=params, move_grads=grads)
        if to_cpu and params:
            # offload_to_cpu copies into the pinned copy without blocking and frees the GPU storage at once: the copy
            # must be done before empty_cache hands that memory to the engine waking on this GPU
            torch.cuda.current_stream().synchronize()

    def _adam_moment_bytes(self) -> int:
        """Host arena bytes for Adam's ``exp_avg`` and ``exp_avg_sq`` of every main parameter this rank's optimizer
        updates (its distributed-optimizer shard), in ``optimizer.exp_avg_dtype`` / ``exp_avg_sq_dtype``: what the
        first colocated refit after a training step moves (the state exists only after the first update)."""
        o = self.cfg.megatron_cfg.optimizer
        sizes = [DTYPE_BYTES[o.exp_avg_dtype], DTYPE_BYTES[o.exp_avg_sq_dtype]]
        numels = [p.numel() for opt in getattr(self.optimizer, "chained_optimizers", [self.optimizer])
                  for group in getattr(getattr(opt, "optimizer", None), "param_groups", []) for p in group["params"]]
        return HostBuffers.arena_bytes([n * b for n in numels for b in sizes])

    def _move_optimizer_state(self, device: str) -> None:
        """Adam moments (and any other per-parameter state) on the GPU to host memory (``device="cpu"``: into
        one pinned arena kept across steps, ``HostBuffers``), or back to the GPU: only what was moved, so the
        optimizer CPU offload's own host state (``HybridDeviceOptimizer``) stays where megatron-core keeps it."""
        if device == "cpu":
            moves = []  # (state dict, key, slot, tensor)
            for i, opt in enumerate(getattr(self.optimizer, "chained_optimizers", [self.optimizer])):
                for j, s in enumerate(opt._get_state().values()):
                    for k, v in s.items():
                        if torch.is_tensor(v) and v.is_cuda:
                            moves.append((s, k, (i, j, k), v))
            for (s, k, _, _), host in zip(moves, self._host.offload([(slot, v) for _, _, slot, v in moves])):
                s[k] = host
            self._host.synchronize()  # the GPU copies must not be freed (empty_cache) while still being read
            self._state_on_host = [(s, k) for s, k, _, _ in moves]
        else:
            for s, k in self._state_on_host:
                s[k] = self._host.reload(s[k], device)
            self._state_on_host = []

    def prepare_for_training(self) -> None:
        """Bring back whatever ``offload_*`` moved to host memory. With ``train_expandable_segments`` the
        allocator switches to expandable segments first: what the pass allocates (the gradient buffer made again,
        activations, TE's FP8 weight copies, at the first step Adam's moments) lands in them."""
        if self.cfg.megatron_cfg.train_expandable_segments:
            set_expandable_segments(True)
        if not self._offloaded:
            return
        self._move_ddp_buffers(False, params="model" in self._offloaded, grads=True)
        if self.reference_chunks is not None and "model" in self._offloaded:
            for chunk in self.reference_chunks:
                chunk.to(self.device)
        self._move_optimizer_state("cuda")
        self._offloaded.clear()

    def offload_before_refit(self) -> None:
        """Gradients freed (megatron-core zeroes them at the next step anyway) and optimizer state to host
        memory (the weights stay for the export). With ``optimizer_cpu_offload`` the optimizer state stays
        where megatron-core put it: its host part already fills the host (``memory.py``)."""
        if "optimizer" in self._offloaded:
            return
        self._free_rebuilt_state()
        if not self.cfg.megatron_cfg.optimizer.optimizer_cpu_offload:
            self._move_optimizer_state("cpu")
        self._offloaded.add("optimizer")
        self.release_cached_memory()

    def _free_rebuilt_state(self) -> None:
        """Free what the next training pass makes anew, nothing copied: the gradient buffer (megatron-core zeroes it
        at the next step anyway; ``prepare_for_training`` allocates it again) and TransformerEngine's cached FP8
        weight copies (made again at the first micro-batch)."""
        if "grads" in self._offloaded:
            return
        self._move_ddp_buffers(True, params=False, grads=True)
        for module in (m for chunk in self.chunks for m in chunk.modules()):  # TE's cached FP8 weight copies
            if hasattr(module, "_fp8_workspaces"):
                module._fp8_workspaces.clear()
        self._offloaded.add("grads")

    @staticmethod
    def _freeze_built_objects() -> None:
        """Move every object alive after the build (the model's modules and parameters, megatron-core's and TE's
        state, the imported libraries: hundreds of thousands of objects that live for the whole run) out of the
        cyclic collector's reach (``gc.freeze``, Python 3.7+; vLLM's engine core freezes its start-up heap the same
        way), so that each ``gc.collect`` of ``release_cached_memory`` scans only what the steps made since."""
        gc.collect()
        gc.freeze()

    def release_cached_memory(self, gc_generation: int = 2) -> dict[str, float]:
        """With ``colocated.offload_trainer=false``, before the engine wakes beside this process: the weights and
        the optimizer state stay on the GPU, what the next pass rebuilds is freed (``_free_rebuilt_state``: the
        gradient buffer, TE's FP8 weight copies) and the allocator's free cached blocks (the step's activation
        peak) go back to the device (several trainers sharing one GPU with their engines ran out of memory
        without it). With ``train_expandable_segments`` the allocator first goes back to ``cudaMalloc`` segments,
        which the refit's CUDA IPC handles need, and ``empty_cache`` unmaps the free pages of the expandable ones.

        Args:
            gc_generation: the oldest generation ``gc.collect`` scans (``_collect_garbage``): 2 (all; the default,
                and ``offload_before_refit``'s), 1 the young ones (the colocated refit's releases, before and after
                the transfer: ``RefitController._release``).

        Returns the seconds of each part (``timed_parts``), and what the collection did (``_collect_garbage``):
        ``gc_collected`` (unreachable objects found) and ``gc_freed_gib`` (GPU memory its garbage held)."""
        if self.cfg.megatron_cfg.train_expandable_segments:
            set_expandable_segments(False)
        found: dict[str, float] = {}
        parts = timed_parts((("free_rebuilt", self._free_rebuilt_state),
                             ("gc", lambda: found.update(self._collect_garbage(gc_generation))),
                             ("empty_cache", torch.cuda.empty_cache)))
        return {**parts, **found}

    def _collect_garbage(self, generation: int) -> dict[str, float]:
        """``gc.collect(generation)``; after each of the first ``FROZEN_FULL_COLLECTS`` full collections (the refit
        before any training: the refit plan, the engine's handles; the one after the first update: Adam's state,
        TE's FP8 metadata) the survivors are frozen too (``gc.freeze``, as ``_freeze_built_objects``), so that later
        full collections scan only what a step makes. What is frozen and later becomes cyclic garbage is never
        collected: at most what those two moments hold, once.

        Returns ``gc_collected`` (the unreachable objects ``gc.collect`` found) and ``gc_freed_gib`` (the GPU
        memory of live tensors before minus after, GiB; 0 without CUDA): whether the collection's time is its garbage
        or its scan, and whether it gives the engine memory at all."""
        allocated = torch.cuda.memory_allocated if torch.cuda.is_available() else (lambda: 0)
        before = allocated()
        collected = gc.collect(generation)
        if generation == 2 and self._frozen_collects < self.FROZEN_FULL_COLLECTS:
            gc.freeze()
            self._frozen_collects += 1
        return {"gc_collected": float(collected), "gc_freed_gib": (before - allocated()) / 2**30}

    def cuda_memory_gib(self) -> dict[str, float]:
        """``nemo_fp8.utils.memory.cuda_memory_gib`` of this rank's GPU."""
        return cuda_memory_gib(self.device)

    def offload_after_refit(self) -> None:
        """The weights to host memory too, so a colocated engine can wake."""
        if "model" in self._offloaded:
            return
        self.offload_before_refit()
        self._move_ddp_buffers(True, params=True, grads=False)
        for chunk in self.reference_chunks or []:
            chunk.to("cpu")
        self._offloaded.add("model")
        self.release_cached_memory(gc_generation=1)

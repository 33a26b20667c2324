"""``worker_extension_cls`` of FP8 engines: :class:`Fp8WorkerExtension`, with the FP8 patches applied at import.

vLLM imports the module its ``worker_extension_cls`` names in each worker process before the model is built.
Importing ``worker_extension`` applies the patches of every engine; this module then applies the ``fp8_only``
ones (``patches.apply_patches(fp8=True)``; a patch already applied is skipped). So the engine argument that
``engine_args.build_engine_spec`` sets by ``vllm_cfg.precision`` decides which patches a worker gets, with no
environment variable.
"""

from __future__ import annotations

from nemo_fp8.generation.vllm.patches import apply_patches
from nemo_fp8.generation.vllm.worker_extension import Fp8WorkerExtension

__all__ = ["Fp8WorkerExtension"]

apply_patches(fp8=True)

"""Every place where nemo_fp8 replaces a vLLM function, in one table, with the versions tested.

vLLM's extension points (``hf_overrides`` quantization config, ``worker_extension_cls``,
``weight_transfer_config``, ``logprobs_mode``, sleep mode) cover the FP8 engine except two
things:

- vLLM picks the activation quantizer's scale format from the GEMM kernel (CUTLASS: fp32;
  DeepGEMM: E8M0 iff ``VLLM_USE_DEEP_GEMM_E8M0``), while our config has its own
  ``pow2_activation_scaling_factors``. Patch ``quantfp8_pow2_act`` wraps ``QuantFP8.__init__`` so
  that dynamic per-token-group quantizers use ``use_ue8m0 = pow2_activation_scales`` of the engine's
  settings (FP8 engines). The settings travel in the engine's own config: ``engine_args`` puts them in
  vLLM's ``additional_config`` under ``ENGINE_SETTINGS_KEY``; vLLM builds the model under
  ``set_current_vllm_config``, where the wrapper reads them (``engine_settings``).
- ``Worker.sleep`` asserts that the whole GPU's free memory (``torch.cuda.mem_get_info``) did not
  fall while the engine slept. Its memory is released before that check, but another process on the
  same GPU (a colocated trainer, or other engines: ``compare_precision.py --parallel``) can allocate
  meanwhile, and the failed assertion then kills a healthy run. Patch ``worker_sleep_shared_gpu``
  turns that one assertion into a warning (every engine, BF16 too).

``check_installed_vllm()`` runs at start-up (``init_fp8``) and in each worker before a patch
is applied: an untested vLLM version or a missing target raises RuntimeError naming the patch,
the version found and the versions tested.
"""

from __future__ import annotations

import functools
import importlib
import logging
import os
from dataclasses import dataclass
from typing import Any, Callable

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Patch:
    """One replaced vLLM function.

    Attributes:
        name: short id (logs and errors).
        module: dotted module of the target.
        attr: ``Class.method`` or ``function`` inside ``module``.
        tested_versions: vLLM versions this patch was tested on (exact ``vllm.__version__``).
        why: what the original does that we must change.
        wrap: ``original -> replacement``.
        fp8_only: applied in FP8 engines only (False: in every engine).
    """

    name: str
    module: str
    attr: str
    tested_versions: tuple[str, ...]
    why: str
    wrap: Callable[[Callable], Callable]
    fp8_only: bool = True


#: The key of nemo_fp8's settings in vLLM's ``additional_config`` (``VllmConfig.additional_config``).
ENGINE_SETTINGS_KEY = "nemo_fp8"


def engine_settings(vllm_config: Any) -> dict[str, Any]:
    """nemo_fp8's settings of an engine: ``vllm_config.additional_config[ENGINE_SETTINGS_KEY]`` as
    ``engine_args.engine_additional_config`` wrote it (``{}`` for an engine built without them).

    Args:
        vllm_config: a ``vllm.config.VllmConfig`` (anything with an ``additional_config`` dict).
    """
    extra = getattr(vllm_config, "additional_config", None)
    settings = extra.get(ENGINE_SETTINGS_KEY) if isinstance(extra, dict) else None
    return dict(settings) if isinstance(settings, dict) else {}


def _wrap_quantfp8_init(original: Callable) -> Callable:
    @functools.wraps(original)
    def __init__(self, *args, **kwargs):
        original(self, *args, **kwargs)
        if getattr(self, "is_group_quant", False) and not getattr(self, "static", True):
            from vllm.config import get_current_vllm_config  # set while vLLM builds the model (initialize_model)

            self.use_ue8m0 = bool(engine_settings(get_current_vllm_config()).get("pow2_activation_scales", False))

    __init__._nemo_fp8_patched = True
    return __init__


SLEEP_CHECK_MESSAGE = "Memory usage increased after sleeping"


def _wrap_worker_sleep(original: Callable) -> Callable:
    @functools.wraps(original)
    def sleep(self, *args, **kwargs):
        try:
            return original(self, *args, **kwargs)
        except AssertionError as e:
            if SLEEP_CHECK_MESSAGE not in str(e):
                raise
            # vllm/v1/worker/gpu_worker.py: the check runs after CuMemAllocator.sleep() released the engine's memory
            logger.warning("vLLM engine asleep; its check of the GPU's free memory failed (%s): another process on "
                           "this GPU allocated while the engine released its memory", e)

    sleep._nemo_fp8_patched = True
    return sleep


PATCHES: tuple[Patch, ...] = (
    Patch(
        name="quantfp8_pow2_act",
        module="vllm.model_executor.layers.quantization.input_quant_fp8",
        attr="QuantFP8.__init__",
        tested_versions=("0.22.0",),
        why="vLLM derives the per-token-group activation scale format (use_ue8m0) from the GEMM kernel; "
            "pow2_activation_scaling_factors must decide it",
        wrap=_wrap_quantfp8_init,
    ),
    Patch(
        name="worker_sleep_shared_gpu",
        module="vllm.v1.worker.gpu_worker",
        attr="Worker.sleep",
        tested_versions=("0.22.0",),
        why="Worker.sleep asserts the whole GPU's free memory did not fall during sleep; another process on the "
            "GPU allocating meanwhile fails it after the engine's memory was already released",
        wrap=_wrap_worker_sleep,
        fp8_only=False,
    ),
)


def _resolve(patch: Patch):
    mod = importlib.import_module(patch.module)
    owner_name, _, leaf = patch.attr.rpartition(".")
    owner = getattr(mod, owner_name) if owner_name else mod
    return owner, leaf


def check_patch_table(vllm_version: str, patches: tuple[Patch, ...] = PATCHES) -> list[str]:
    """Problems of the table for ``vllm_version`` (pure: no import): untested versions."""
    errs = []
    for p in patches:
        if vllm_version not in p.tested_versions:
            errs.append(f"patch {p.name} ({p.module}.{p.attr}) was tested on vLLM {list(p.tested_versions)}, "
                        f"found {vllm_version}")
    return errs


def check_installed_vllm(patches: tuple[Patch, ...] = PATCHES) -> str:
    """Check the installed vLLM against the table; returns its version.

    Raises:
        RuntimeError: untested version or a target that no longer exists (set
            ``NEMO_FP8_ALLOW_UNTESTED_VLLM=1`` to only warn on the version).
    """
    import vllm

    version = getattr(vllm, "__version__", "unknown")
    errs = check_patch_table(version, patches)
    if errs and os.environ.get("NEMO_FP8_ALLOW_UNTESTED_VLLM") == "1":
        for e in errs:
            logger.warning("%s (NEMO_FP8_ALLOW_UNTESTED_VLLM=1)", e)
        errs = []
    for p in patches:
        try:
            owner, leaf = _resolve(p)
            getattr(owner, leaf)
        except (ImportError, AttributeError) as e:
            errs.append(f"patch {p.name}: target {p.module}.{p.attr} not found in vLLM {version} ({e})")
    if errs:
        raise RuntimeError("nemo_fp8 vLLM patch table: " + "; ".join(errs)
                           + ". Install a tested vLLM (pyproject extra 'vllm') or update nemo_fp8/generation/vllm/patches.py")
    return version


def apply_patches(patches: tuple[Patch, ...] = PATCHES, fp8: bool = True) -> list[str]:
    """Check, then apply each patch once in this process (``fp8=False``: those not ``fp8_only``);
    returns the names applied.

    Raises:
        RuntimeError: see :func:`check_installed_vllm`.
    """
    patches = tuple(p for p in patches if fp8 or not p.fp8_only)
    check_installed_vllm(patches)
    applied = []
    for p in patches:
        owner, leaf = _resolve(p)
        current = getattr(owner, leaf)
        if getattr(current, "_nemo_fp8_patched", False):
            continue
        setattr(owner, leaf, p.wrap(current))
        applied.append(p.name)
    if applied:
        logger.info("nemo_fp8: applied vLLM patches %s", applied)
    return applied

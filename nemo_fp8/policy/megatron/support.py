"""Which TransformerEngine FP8 recipes this machine can run: the one source of the rule.

Two questions, one rule (TransformerEngine 2.11's ``check_fp8_support`` / ``check_fp8_block_scaling_support``):

* ``te_fp8_support(...)`` answers from versions alone (compute capability, CUDA, cuBLAS), without importing
  TransformerEngine or creating a CUDA context: the environment report (``nemo_fp8.env_check``) and the preflight
  call it in the driver process before anything starts.
* ``check_recipe_supported(cfg)`` asks TransformerEngine itself when the megatron backend builds its model, on the
  GPU that will run it (the final word: TE's own reason).

Pure Python at import; TransformerEngine is imported only inside ``check_recipe_supported``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

if TYPE_CHECKING:
    from nemo_fp8.policy.config import PolicyConfig

# TransformerEngine's requirements: blockwise FP8 (Float8BlockScaling) needs Hopper or newer with CUDA and cuBLAS
# >= 12.9; FP8 on Ada (sm_89) needs cuBLASLt >= 12.1.3 and CUDA >= 12.1; Hopper and newer run FP8 tensorwise.
TE_BLOCKWISE_MIN_CUDA = (12, 9)
TE_BLOCKWISE_MIN_CUBLAS = (12, 9)
TE_ADA_MIN_CUBLAS = (12, 1, 3)
TE_ADA_MIN_CUDA = (12, 1)


@dataclass(frozen=True)
class Support:
    """Whether a setting can run here (``ok``) and why, in words (``reason``)."""

    ok: bool
    reason: str


def te_fp8_support(compute_capability: Optional[tuple[int, int]], cuda: Optional[tuple[int, ...]],
                   cublas: Optional[tuple[int, ...]], cublas_desc: str, unavailable: Optional[str] = None
                   ) -> dict[str, Support]:
    """TransformerEngine's FP8 recipes on a machine described by versions: ``te_fp8_tensorwise``, ``te_fp8_blockwise``.

    Args:
        compute_capability: the GPU's (major, minor), e.g. (9, 0); None without a GPU.
        cuda: the CUDA torch was built with, e.g. (13, 0); None if unknown.
        cublas: cuBLAS(Lt)'s version, e.g. (13, 0, 0); None if unknown.
        cublas_desc: how ``cublas`` was found, for the reasons (e.g. "cuBLAS 13.0.0").
        unavailable: why TransformerEngine or the GPU is absent; when given, both recipes are "no" with it.
    Returns:
        {"te_fp8_tensorwise": Support, "te_fp8_blockwise": Support}; never raises.
    """
    if unavailable:
        return {"te_fp8_tensorwise": Support(False, unavailable), "te_fp8_blockwise": Support(False, unavailable)}
    cc = compute_capability or (0, 0)
    sm = f"sm_{cc[0]}{cc[1]}"
    if cc >= (9, 0):
        tensorwise = Support(True, f"{sm}: FP8 tensor cores (TE current/delayed scaling)")
    elif cc < (8, 9):
        tensorwise = Support(False, f"TransformerEngine FP8 needs compute capability 8.9+ (this is {sm})")
    elif cublas is None or cublas < TE_ADA_MIN_CUBLAS:
        tensorwise = Support(False, f"FP8 on sm_89 needs cuBLASLt >= 12.1.3 ({cublas_desc})")
    elif cuda is None or cuda < TE_ADA_MIN_CUDA:
        tensorwise = Support(False, "FP8 on sm_89 needs CUDA >= 12.1 (torch: "
                                    f"{'.'.join(map(str, cuda)) if cuda else 'no CUDA'})")
    else:
        tensorwise = Support(True, f"{sm}: FP8 tensor cores, {cublas_desc}")
    if cc < (9, 0):
        blockwise = Support(False, f"TransformerEngine Float8BlockScaling needs compute capability 9.0+ "
                                   f"(Hopper or newer; this is {sm})")
    elif cuda is None or cuda < TE_BLOCKWISE_MIN_CUDA:
        blockwise = Support(False, "blockwise FP8 GEMM needs CUDA >= 12.9 (torch is built with "
                                   f"{'.'.join(map(str, cuda)) if cuda else 'no CUDA'})")
    elif cublas is None or cublas[:2] < TE_BLOCKWISE_MIN_CUBLAS:
        blockwise = Support(False, f"blockwise FP8 GEMM needs cuBLAS >= 12.9 (found {cublas_desc})")
    else:
        blockwise = Support(True, f"{sm}, CUDA {'.'.join(map(str, cuda))}, {cublas_desc}")
    return {"te_fp8_tensorwise": tensorwise, "te_fp8_blockwise": blockwise}


def check_recipe_supported(cfg: PolicyConfig) -> None:
    """Ask TransformerEngine whether this GPU and library can run the configured FP8 recipe.

    Raises:
        RuntimeError: FP8 (or blockwise FP8: Hopper or newer, cuBLAS >= 12.9) is not available,
            with TE's reason and what to use instead.
    """
    f = cfg.megatron_cfg.fp8_cfg
    if not f.enabled:
        return
    from transformer_engine.pytorch.quantization import is_fp8_available, is_fp8_block_scaling_available

    ok, why = is_fp8_available(return_reason=True)
    if not ok:
        raise RuntimeError(f"policy.megatron_cfg.fp8_cfg.enabled: TransformerEngine cannot run FP8 here ({why}); "
                           "set policy.megatron_cfg.fp8_cfg.enabled=false (BF16 training)")
    if f.fp8_recipe == "blockwise":
        ok, why = is_fp8_block_scaling_available(return_reason=True)
        if not ok:
            raise RuntimeError(f"policy.megatron_cfg.fp8_cfg.fp8_recipe=blockwise: TransformerEngine cannot run it "
                               f"here ({why}; it needs Hopper or newer and cuBLAS >= 12.9); use fp8_recipe=tensorwise")

"""FP8 number formats (OCP 8-bit floating point spec).

Two formats are used in FP8 training and inference (Micikevicius et al. 2022,
"FP8 Formats for Deep Learning", arXiv:2209.05433; OCP OFP8 spec v1.0):

  e4m3 (torch.float8_e4m3fn): 4 exponent bits, 3 mantissa bits, no infinities,
        max normal 448, min normal 2^-6, min subnormal 2^-9. Used for weights
        and activations (and for gradients in the pure "e4m3" recipe).
  e5m2 (torch.float8_e5m2):   5 exponent bits, 2 mantissa bits, IEEE-like with
        infinities, max normal 57344, min normal 2^-14. Used for gradients in the
        "hybrid" recipe (wider range, less precision).

Relative rounding error of round-to-nearest for a normal value is at most
2^-(mantissa_bits + 1): 2^-4 for e4m3 and 2^-3 for e5m2.
"""

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Fp8Format:
    """One FP8 format.

    Attributes:
        name: "e4m3" or "e5m2".
        dtype: the torch storage dtype (torch.float8_e4m3fn / torch.float8_e5m2).
        max: largest finite magnitude of the format (448.0 / 57344.0).
    """

    name: str
    dtype: torch.dtype
    max: float


E4M3 = Fp8Format("e4m3", torch.float8_e4m3fn, 448.0)
E5M2 = Fp8Format("e5m2", torch.float8_e5m2, 57344.0)

FORMATS: dict[str, Fp8Format] = {E4M3.name: E4M3, E5M2.name: E5M2}
FP8_DTYPES: tuple[torch.dtype, ...] = (E4M3.dtype, E5M2.dtype)


def get_format(name: str) -> Fp8Format:
    """Look up an FP8 format by name.

    Args:
        name: "e4m3" or "e5m2" (case-insensitive).

    Returns:
        The matching Fp8Format.

    Raises:
        ValueError: if name is not a known format; the message lists the valid names.
    """
    key = str(name).lower()
    if key not in FORMATS:
        raise ValueError(f"unknown FP8 format {name!r}; valid names: {sorted(FORMATS)}")
    return FORMATS[key]


def format_of_dtype(dtype: torch.dtype) -> Fp8Format:
    """Return the Fp8Format whose storage dtype is `dtype`.

    Raises:
        ValueError: if dtype is not torch.float8_e4m3fn or torch.float8_e5m2.
    """
    for fmt in FORMATS.values():
        if fmt.dtype == dtype:
            return fmt
    raise ValueError(f"{dtype} is not an FP8 dtype; expected one of {list(FP8_DTYPES)}")


def cast_to_fp8(x: torch.Tensor, fmt: Fp8Format = E4M3) -> torch.Tensor:
    """Saturating cast to FP8.

    Values are clamped to [-fmt.max, fmt.max] before the cast (round to nearest
    even), so out-of-range values become +-fmt.max instead of NaN/Inf. This is the
    "saturate" behaviour of the OCP spec that vLLM and TransformerEngine use for
    scaled FP8 (vLLM `scaled_fp8_quant`: `(x / scale).clamp(min=-max, max=max)`).
    NaN stays NaN.

    Args:
        x: any float tensor (already divided by its scale), any shape.
        fmt: target format.

    Returns:
        Tensor of dtype fmt.dtype, same shape as x.
    """
    return x.clamp(min=-fmt.max, max=fmt.max).to(fmt.dtype)

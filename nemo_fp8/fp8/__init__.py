"""FP8 numerics for nemo_fp8: formats, scaled quantization, block-scaled W8A8 linear,
emulated FP8 training (TransformerEngine recipes) and the layer-precision policy.

Pure torch (no vLLM / TransformerEngine / transformers); the same code runs on CPU
and CUDA. Convention everywhere: dequant = fp8.float() * scale_inv.
"""

from nemo_fp8.fp8.formats import E4M3, E5M2, FORMATS, Fp8Format, cast_to_fp8, format_of_dtype, get_format
from nemo_fp8.fp8.linear import Fp8BlockLinear, w8a8_block_linear
from nemo_fp8.fp8.policy import (
    VLLM_PACKED_MODULES,
    LayerPrecisionPlan,
    find_decoder_layers,
    plan_layer_precision,
)
from nemo_fp8.fp8.quantize import (
    Granularity,
    dequantize,
    dequantize_activation_per_group,
    dequantize_per_channel,
    dequantize_per_tensor,
    dequantize_weight_blockwise,
    quantize_activation_per_group,
    quantize_dequantize,
    quantize_per_channel,
    quantize_per_tensor,
    quantize_weight_blockwise,
)
from nemo_fp8.fp8.scales import ScaleMode, check_finite, compute_scale_inv
from nemo_fp8.fp8.training import (
    Fp8LinearFunction,
    Fp8TrainingLinear,
    Fp8TrainingRecipe,
    apply_fp8_training,
    fp8_linear,
)

__all__ = [
    "E4M3",
    "E5M2",
    "FORMATS",
    "Fp8Format",
    "cast_to_fp8",
    "format_of_dtype",
    "get_format",
    "Fp8BlockLinear",
    "w8a8_block_linear",
    "VLLM_PACKED_MODULES",
    "LayerPrecisionPlan",
    "find_decoder_layers",
    "plan_layer_precision",
    "Granularity",
    "ScaleMode",
    "check_finite",
    "compute_scale_inv",
    "dequantize",
    "dequantize_activation_per_group",
    "dequantize_per_channel",
    "dequantize_per_tensor",
    "dequantize_weight_blockwise",
    "quantize_activation_per_group",
    "quantize_dequantize",
    "quantize_per_channel",
    "quantize_per_tensor",
    "quantize_weight_blockwise",
    "Fp8LinearFunction",
    "Fp8TrainingLinear",
    "Fp8TrainingRecipe",
    "apply_fp8_training",
    "fp8_linear",
]

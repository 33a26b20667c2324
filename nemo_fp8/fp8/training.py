"""Emulated FP8 training (TransformerEngine recipes) with quantize-dequantize.

The pure-torch policy backend has no TransformerEngine, so FP8 training is
emulated: every GEMM operand is rounded to FP8 exactly as TE would round it, then
dequantized and multiplied in fp32 (TE's FP8 GEMMs also accumulate in fp32). The
values entering each GEMM therefore match TE's up to fp32 accumulation order.

What is emulated, per recipe (y = x @ w.T + b; x [M, K], w [N, K], g = dL/dy [M, N]):

tensorwise -- TE `Float8CurrentScaling` (fp32 scales, scale_inv = amax / fmt.max of
    the current tensor, no amax history):
        fprop: y  = qdq_t(x) @ qdq_t(w).T
        dgrad: dx = qdq_t(g) @ qdq_t(w)
        wgrad: dw = qdq_t(g).T @ qdq_t(x)
    Per-tensor scaling makes a tensor's transpose numerically identical, so the
    same fp8 values serve all three GEMMs, as in TE.

blockwise -- TE `Float8BlockScaling` (DeepSeek-V3 style; power-of-two scales, TE's
    default unless NVTE_FP8_BLOCK_SCALING_FP32_SCALES=1):
        x: 1x128 groups along K for fprop; for wgrad TE makes a separate columnwise
           copy quantized from the high-precision x in 128x1 groups (1x128 along M
           of x.T). Both are emulated.
        w: 128x128 blocks (x_block_scaling_dim=1, w_block_scaling_dim=2); the
           transposed copy for dgrad has identical values.
        g: 1x128 groups along N for dgrad; 128x1 groups (along M) for wgrad
           (grad_block_scaling_dim=1), each quantized from the high-precision g.
        fprop: y  = qdq_1x128(x) @ qdq_128x128(w).T
        dgrad: dx = qdq_1x128(g) @ qdq_128x128(w)
        wgrad: dw = qdq_128x1(g).T @ qdq_128x1(x)

fp8 = "e4m3": every operand in e4m3. fp8 = "hybrid": forward operands in e4m3,
gradients (g) in e5m2 (TE Format.HYBRID). The bias gradient is g summed over rows,
unquantized. Not emulated: TE's delayed scaling, amax reductions across ranks, the
FP8 output of fused kernels, and the tensor-core accumulation precision.
"""

from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn as nn

from nemo_fp8.fp8.formats import E4M3, E5M2, Fp8Format
from nemo_fp8.fp8.quantize import (_quantize_2d_blocks, _quantize_last_dim_groups, _quantize_rows,
                                   dequantize_activation_per_group, dequantize_weight_blockwise)
from nemo_fp8.fp8.scales import ScaleMode, check_finite

FP8_MODES = ("e4m3", "hybrid")
FP8_RECIPES = ("tensorwise", "blockwise")
BLOCK = 128  # TE Float8BlockScaling / DeepSeek-V3 tile size


@dataclass(frozen=True)
class Fp8TrainingRecipe:
    """Which TE FP8 recipe to emulate (NeMo-RL `fp8_cfg.fp8` / `fp8_cfg.fp8_recipe`).

    Attributes:
        fp8: "e4m3" (all GEMM operands e4m3) or "hybrid" (gradients e5m2).
        fp8_recipe: "tensorwise" (TE Float8CurrentScaling) or "blockwise"
            (TE Float8BlockScaling, 1x128 activations/grads, 128x128 weights).

        pow2_block_scales: blockwise only: power-of-two scales (TE's default) or fp32 scales
            (TE with ``NVTE_FP8_BLOCK_SCALING_FP32_SCALES=1``); the project ties it to
            ``pow2_weight_scaling_factors`` so rollout and training share one convention.

    Raises:
        ValueError: on an unknown value; the message lists the valid ones.
    """

    fp8: Literal["e4m3", "hybrid"] = "e4m3"
    fp8_recipe: Literal["tensorwise", "blockwise"] = "blockwise"
    pow2_block_scales: bool = True

    def __post_init__(self):
        if self.fp8 not in FP8_MODES:
            raise ValueError(f"fp8 must be one of {FP8_MODES}, got {self.fp8!r}")
        if self.fp8_recipe not in FP8_RECIPES:
            raise ValueError(f"fp8_recipe must be one of {FP8_RECIPES}, got {self.fp8_recipe!r}")

    @property
    def forward_format(self) -> Fp8Format:
        """Format of x and w: always e4m3."""
        return E4M3

    @property
    def grad_format(self) -> Fp8Format:
        """Format of the output gradient: e5m2 for "hybrid", else e4m3."""
        return E5M2 if self.fp8 == "hybrid" else E4M3

    @property
    def scale_mode(self) -> ScaleMode:
        """fp32 scales for tensorwise (TE current scaling); blockwise: pow2 (TE default) unless
        ``pow2_block_scales`` is false."""
        return "pow2" if self.fp8_recipe == "blockwise" and self.pow2_block_scales else "fp32"


def _qdq_groups(x: torch.Tensor, fmt: Fp8Format, scale_mode: ScaleMode) -> torch.Tensor:
    """fp32 fake-quant of x [..., K] in 1 x 128 groups along its last dim."""
    q, s = _quantize_last_dim_groups(x, BLOCK, fmt, scale_mode)
    return dequantize_activation_per_group(q, s, BLOCK)


def _qdq_tensor(x: torch.Tensor, fmt: Fp8Format, scale_mode: ScaleMode) -> torch.Tensor:
    """fp32 fake-quant of x with one current-scaling scale."""
    q, s = _quantize_rows(x, fmt, scale_mode, per_row=False)
    return q.float() * s


def _output_dtype(x: torch.Tensor) -> torch.dtype:
    device_type = x.device.type
    if torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return x.dtype


class Fp8LinearFunction(torch.autograd.Function):
    """y = qdq(x) @ qdq(w).T + b with FP8-emulated forward and backward GEMMs.

    forward(x [..., K], weight [N, K], bias [N] | None, recipe) -> y [..., N].
    The output dtype is x.dtype (or the autocast dtype when autocast is on);
    GEMMs run in fp32. The fp8 operands needed by backward are saved as fp8 tensors
    plus fp32 scales (1 byte per element, like TE). NaN/Inf in x or weight raise
    ValueError; NaN/Inf in gradients propagate (no check, no device sync).
    """

    @staticmethod
    def forward(ctx, x, weight, bias, recipe: Fp8TrainingRecipe):
        if weight.dim() != 2 or x.shape[-1] != weight.shape[1]:
            raise ValueError(
                f"x shape {tuple(x.shape)} does not match weight shape {tuple(weight.shape)}"
            )
        check_finite(x, "input")
        check_finite(weight, "weight")
        N, K = weight.shape
        fmt, mode = recipe.forward_format, recipe.scale_mode
        x2 = x.reshape(-1, K)  # [M, K]

        if recipe.fp8_recipe == "tensorwise":
            xq, xs = _quantize_rows(x2, fmt, mode, per_row=False)  # [M, K] fp8, []
            wq, ws = _quantize_rows(weight, fmt, mode, per_row=False)  # [N, K] fp8, []
            x_dq = xq.float() * xs  # [M, K]
            w_dq = wq.float() * ws  # [N, K]
            ctx.save_for_backward(xq, xs, wq, ws)
        else:
            x_dq = _qdq_groups(x2, fmt, mode)  # [M, K], 1x128 along K
            wq, ws = _quantize_2d_blocks(weight, BLOCK, BLOCK, fmt, mode)  # [N, K], [Nb, Kb]
            w_dq = dequantize_weight_blockwise(wq, ws, (BLOCK, BLOCK))  # [N, K]
            # columnwise copy for wgrad: x.T [K, M] in 1x128 groups along M
            xq_t, xs_t = _quantize_last_dim_groups(x2.t(), BLOCK, fmt, mode)  # [K, M], [K, Mb]
            ctx.save_for_backward(xq_t, xs_t, wq, ws)

        y = x_dq @ w_dq.t()  # [M, N] fp32
        if bias is not None:
            y = y + bias.float()
        ctx.recipe = recipe
        ctx.has_bias = bias is not None
        ctx.x_shape, ctx.x_dtype = x.shape, x.dtype
        ctx.w_dtype = weight.dtype
        ctx.bias_dtype = bias.dtype if bias is not None else None
        return y.to(_output_dtype(x)).reshape(*x.shape[:-1], N)

    @staticmethod
    def backward(ctx, grad_out):
        recipe: Fp8TrainingRecipe = ctx.recipe
        gfmt, mode = recipe.grad_format, recipe.scale_mode
        N = grad_out.shape[-1]
        g2 = grad_out.reshape(-1, N)  # [M, N]
        grad_x = grad_w = grad_b = None

        if recipe.fp8_recipe == "tensorwise":
            xq, xs, wq, ws = ctx.saved_tensors
            g_dq = _qdq_tensor(g2, gfmt, mode)  # [M, N]
            if ctx.needs_input_grad[0]:
                grad_x = g_dq @ (wq.float() * ws)  # [M, K]
            if ctx.needs_input_grad[1]:
                grad_w = g_dq.t() @ (xq.float() * xs)  # [N, K]
        else:
            xq_t, xs_t, wq, ws = ctx.saved_tensors
            if ctx.needs_input_grad[0]:
                g_row = _qdq_groups(g2, gfmt, mode)  # [M, N], 1x128 along N
                w_dq = dequantize_weight_blockwise(wq, ws, (BLOCK, BLOCK))  # [N, K]
                grad_x = g_row @ w_dq  # [M, K]
            if ctx.needs_input_grad[1]:
                g_col = _qdq_groups(g2.t(), gfmt, mode)  # [N, M], 1x128 along M
                x_col = dequantize_activation_per_group(xq_t, xs_t, BLOCK)  # [K, M]
                grad_w = g_col @ x_col.t()  # [N, K]

        if grad_x is not None:
            grad_x = grad_x.to(ctx.x_dtype).reshape(ctx.x_shape)
        if grad_w is not None:
            grad_w = grad_w.to(ctx.w_dtype)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_b = g2.float().sum(dim=0).to(ctx.bias_dtype)  # [N]
        return grad_x, grad_w, grad_b, None


def fp8_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    recipe: Fp8TrainingRecipe,
) -> torch.Tensor:
    """Functional form of Fp8LinearFunction: x [..., K], weight [N, K], bias [N] -> [..., N].

    Raises:
        ValueError: shape mismatch, NaN/Inf in x or weight.
    """
    return Fp8LinearFunction.apply(x, weight, bias, recipe)


class Fp8TrainingLinear(nn.Linear):
    """nn.Linear whose matmuls emulate a TE FP8 recipe when `recipe` is set.

    `weight` / `bias` stay ordinary high-precision nn.Parameters, so optimizers,
    state_dict keys and checkpoints are exactly those of nn.Linear. With
    recipe=None it behaves exactly like nn.Linear.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        device=None,
        dtype=None,
        recipe: Fp8TrainingRecipe | None = None,
    ):
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        self.recipe = recipe

    @classmethod
    def from_linear(cls, linear: nn.Linear, recipe: Fp8TrainingRecipe | None) -> "Fp8TrainingLinear":
        """Wrap `linear`, sharing (not copying) its weight and bias Parameters."""
        module = cls(linear.in_features, linear.out_features, bias=False, device="meta", recipe=recipe)
        module.weight = linear.weight
        module.bias = linear.bias
        return module

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., in_features] -> [..., out_features]."""
        if self.recipe is None:
            return super().forward(x)
        return Fp8LinearFunction.apply(x, self.weight, self.bias, self.recipe)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, recipe={self.recipe}"


def apply_fp8_training(model: nn.Module, module_names, recipe: Fp8TrainingRecipe) -> list[str]:
    """Replace the named nn.Linear submodules of `model` by Fp8TrainingLinear in place.

    Parameters are shared, so optimizer state and state_dict keys are unchanged.
    Typical use: `apply_fp8_training(model, plan_layer_precision(model).fp8_modules, recipe)`.

    Args:
        model: the module tree.
        module_names: iterable of names as in model.named_modules().
        recipe: the FP8 recipe to emulate.

    Returns:
        The names that were replaced (already-converted modules get the new recipe).

    Raises:
        ValueError: a name is missing or is not an nn.Linear.
    """
    replaced = []
    for name in module_names:
        try:
            module = model.get_submodule(name)
        except AttributeError as err:
            raise ValueError(f"apply_fp8_training: model has no submodule {name!r}") from err
        if isinstance(module, Fp8TrainingLinear):
            module.recipe = recipe
        elif isinstance(module, nn.Linear):
            if not name:
                raise ValueError("apply_fp8_training: cannot replace the root module")
            parent_name, _, child = name.rpartition(".")
            parent = model.get_submodule(parent_name) if parent_name else model
            setattr(parent, child, Fp8TrainingLinear.from_linear(module, recipe))
        else:
            raise ValueError(f"{name} is a {type(module).__name__}, not an nn.Linear")
        replaced.append(name)
    return replaced

"""Same code on CUDA: results match the CPU path (skipped where there is no GPU)."""

import pytest
import torch

from nemo_fp8.fp8 import (
    Fp8BlockLinear,
    Fp8TrainingRecipe,
    compute_scale_inv,
    fp8_linear,
    quantize_activation_per_group,
    quantize_weight_blockwise,
    w8a8_block_linear,
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


@pytest.mark.parametrize("scale_mode", ["fp32", "pow2"])
def test_quantization_bitwise_equal_on_cuda(scale_mode):
    torch.manual_seed(0)
    w = torch.randn(300, 520) * torch.logspace(-8, 2, 300).unsqueeze(1)
    q_cpu, s_cpu = quantize_weight_blockwise(w, scale_mode=scale_mode)
    q_gpu, s_gpu = quantize_weight_blockwise(w.cuda(), scale_mode=scale_mode)
    assert torch.equal(s_gpu.cpu(), s_cpu)
    assert torch.equal(q_gpu.cpu().view(torch.uint8), q_cpu.view(torch.uint8))
    x = torch.randn(3, 7, 300)
    qa, sa = quantize_activation_per_group(x, scale_mode=scale_mode)
    qg, sg = quantize_activation_per_group(x.cuda(), scale_mode=scale_mode)
    assert torch.equal(sg.cpu(), sa) and torch.equal(qg.cpu().view(torch.uint8), qa.view(torch.uint8))
    amax = torch.tensor([0.0, 1e-30, 448.0, 449.0, 3.0e4])
    assert torch.equal(compute_scale_inv(amax.cuda(), scale_mode=scale_mode).cpu(), compute_scale_inv(amax, scale_mode=scale_mode))


def test_w8a8_and_module_on_cuda():
    torch.manual_seed(1)
    lin = torch.nn.Linear(300, 200).bfloat16()
    x = torch.randn(33, 300).bfloat16()
    y_cpu = Fp8BlockLinear.from_linear(lin)(x)
    fl = Fp8BlockLinear.from_linear(lin.cuda())
    assert fl.weight.is_cuda and fl.weight_scale_inv.is_cuda
    ptr = fl.weight.data_ptr()
    fl.load_weight(lin.weight.detach())
    assert fl.weight.data_ptr() == ptr
    y_gpu = fl(x.cuda())
    # identical fp8 operands; only the fp32 summation order differs, which can flip the
    # final bf16 rounding by one ulp (2^-8 relative)
    torch.testing.assert_close(y_gpu.float().cpu(), y_cpu.float(), rtol=2**-7, atol=2**-7 * y_cpu.float().abs().max().item())
    qw, ws = quantize_weight_blockwise(lin.weight.float().cpu())
    y32 = w8a8_block_linear(x.float().cuda(), qw.cuda(), ws.cuda())
    torch.testing.assert_close(y32.cpu(), w8a8_block_linear(x.float(), qw, ws), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("recipe", [Fp8TrainingRecipe("hybrid", "blockwise"), Fp8TrainingRecipe("e4m3", "tensorwise")])
def test_training_on_cuda(recipe):
    torch.manual_seed(2)
    x, w, b, dy = torch.randn(64, 256), torch.randn(96, 256) * 0.05, torch.randn(96), torch.randn(64, 96)
    grads = []
    for device in ("cpu", "cuda"):
        xs, ws, bs = (t.clone().to(device).requires_grad_() for t in (x, w, b))
        y = fp8_linear(xs, ws, bs, recipe)
        y.backward(dy.to(device))
        grads.append([t.detach().cpu() for t in (y, xs.grad, ws.grad, bs.grad)])
    for cpu_t, gpu_t in zip(*grads):
        torch.testing.assert_close(gpu_t, cpu_t, rtol=1e-4, atol=1e-4)

"""CPU tests of ``tools/lab/host_profile.py``: library parts of cProfile entries, a profiled pass's numbers."""

from __future__ import annotations

import pytest
import torch

from lab.host_profile import format_host_profile, host_profile, part_of


@pytest.mark.parametrize("filename,name,part", [
    ("/usr/lib/python3/site-packages/transformer_engine/pytorch/module/linear.py", "forward", "te.module"),
    ("/x/site-packages/transformer_engine/pytorch/tensor/float8_blockwise_tensor.py", "__new__", "te.quant"),
    ("/x/site-packages/transformer_engine/pytorch/quantization.py", "autocast", "te.recipe"),
    ("/x/site-packages/transformer_engine/pytorch/attention/dot_product_attention/backends.py", "forward",
     "te.attention"),
    ("/x/site-packages/transformer_engine/pytorch/utils.py", "cast_if_needed", "te.other"),
    ("/x/site-packages/megatron/core/transformer/transformer_layer.py", "forward", "megatron"),
    ("/x/site-packages/torch/autograd/function.py", "apply", "torch.autograd"),
    ("/x/site-packages/torch/nn/modules/module.py", "_call_impl", "torch.nn"),
    ("/work/main/nemo_fp8/policy/megatron/logprobs.py", "forward", "ours"),
    ("~", "<built-in method generic_gemm of PyCapsule object at 0x1>", "other"),
    ("~", "<built-in method transformer_engine_torch.quantize>", "te.ops"),
    ("~", "<built-in method torch._C._nn.linear>", "torch.ops"),
    ("~", "<method 'add_' of 'torch._C.TensorBase' objects>", "torch.ops"),
    ("~", "<built-in method torch._C._cuda_synchronize>", "gpu.wait"),
    ("/home/u/script.py", "main", "other"),
])
def test_part_of(filename, name, part):
    assert part_of(filename, name) == part


def test_host_profile_counts_a_pass_of_torch_and_python_work():
    w = torch.randn(64, 64, requires_grad=True)

    def step():
        x = torch.randn(8, 64)
        for _ in range(5):
            x = torch.nn.functional.linear(x, w).relu()
        x.sum().backward()

    prof = host_profile(step, rounds=3, top=5)
    assert prof["wall_profiled_ms"] > 0
    assert prof["calls"] >= 5  # at least the five linear calls of each pass
    assert len(prof["top_functions"]) == 5
    assert prof["top_functions"] == sorted(prof["top_functions"], key=lambda r: -r["own_ms"])
    # the parts' own times add up to no more than the profiled wall time
    assert 0 < sum(prof["parts"].values()) <= prof["wall_profiled_ms"] * 1.05
    linear = [r for r in host_profile(step, rounds=2, top=10_000)["top_functions"] if "linear" in r["function"]]
    assert linear and linear[0]["calls"] == 5  # per pass, not summed over rounds
    text = format_host_profile("toy", prof, wall_ms=1.0)
    assert text.startswith("host profile toy:") and "own ms by part" in text


def test_host_profile_refuses_no_rounds():
    with pytest.raises(ValueError, match="rounds must be >= 1"):
        host_profile(lambda: None, rounds=0)

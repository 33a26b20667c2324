"""The micro-batch path of the policy backends never waits for the GPU (``pytest -m gpu tests/gpu/test_host_syncs.py``).

A host sync inside the micro-batch loop (a blocking host -> GPU copy of pageable memory, a ``.tolist()`` of a device
tensor) empties the GPU's queue: the GPU then idles while the host launches the next kernels, which costs most where
the GPU work is shortest, FP8's. CUDA's sync debug mode (``torch.cuda.set_sync_debug_mode("error")``) raises on any
synchronizing call, so this test fails on the first one in what our code does per micro-batch: move the micro-batch
(``TrainBatch.to(non_blocking=True)``), pack it (``pack_rows`` with host lengths), unpack the per-token values,
mask the real tokens, the GRPO loss with its backward, and its metrics into the accumulator. The results must equal
the same steps on the CPU.
"""

from __future__ import annotations

import pytest
import torch

from nemo_fp8.algorithms.config import ClippedPGLossConfig
from nemo_fp8.algorithms.loss import ClippedPGLossFn
from nemo_fp8.utils.metrics import MetricAccumulator
from nemo_fp8.batch import TrainBatch, to_device
from nemo_fp8.policy.packing import pack_rows, real_token_mask, unpack

pytestmark = pytest.mark.gpu


def _batch() -> tuple[TrainBatch, list[int]]:
    g = torch.Generator().manual_seed(0)
    prompt = torch.tensor([8, 5, 12, 3])
    resp = torch.tensor([32, 59, 5, 30])
    width = int((prompt + resp).max())
    ids = torch.randint(2, 1000, (4, width + 16), generator=g)  # 16 padding columns past the longest row
    ids[torch.arange(width + 16)[None] >= (prompt + resp)[:, None]] = 0
    lp = -torch.rand(4, width + 16, generator=g)
    batch = TrainBatch(token_ids=ids, prompt_lengths=prompt, response_lengths=resp,
                       advantages=torch.tensor([1.0, -1.0, 0.5, -0.5]), generation_logprobs=lp, prev_logprobs=lp.clone())
    return batch, (prompt + resp).tolist()


def _micro_batch_step(batch: TrainBatch, lengths: list[int], device: torch.device) -> tuple[torch.Tensor, ...]:
    """What a packed training micro-batch does outside the model: (loss, grad of the packed values, real mask).
    The micro-batch is rows of a wider batch trimmed to their longest row, as ``micro_batches_on`` makes it: its
    per-token tensors are strided views."""
    mb = batch.trimmed(max(lengths)).to(device, non_blocking=True)
    packed = pack_rows(mb.token_ids, lengths, seq_multiple=16, total_multiple=128)
    mask = real_token_mask(packed)
    values = (packed.token_ids[0].float() / 1000.0 - 1.0).requires_grad_(True)  # stands in for the model's log-probs
    logprobs = unpack(values, packed, mb.token_ids.shape[1]) * mb.token_mask
    counts = to_device(torch.tensor([float(mb.token_ids.shape[0] * 10), 4.0]), device, non_blocking=True)
    loss_fn = ClippedPGLossFn(ClippedPGLossConfig())
    loss, metrics = loss_fn(logprobs, mb, counts[0], counts[1])
    loss.backward()
    MetricAccumulator(loss_fn.metric_reductions).add(metrics)  # the train loop's per-micro-batch metrics
    return loss.detach(), values.grad, mask


def test_packed_micro_batch_path_never_syncs_and_matches_the_cpu():
    batch, lengths = _batch()
    cuda = torch.device("cuda")
    _micro_batch_step(batch, lengths, cuda)  # warm-up: the pinned host allocator, kernels loaded
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        loss, grad, mask = _micro_batch_step(batch, lengths, cuda)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    ref = _micro_batch_step(batch, lengths, torch.device("cpu"))
    torch.testing.assert_close(loss.cpu(), ref[0])
    torch.testing.assert_close(grad.cpu(), ref[1])
    assert mask.cpu().equal(ref[2]) and int(mask.sum()) == sum(lengths)

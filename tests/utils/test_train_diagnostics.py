"""The training call's diagnostics: GPU memory figures per call (``CudaMemoryWindow``, reduced over ranks by
``reduce_train_results``) and the opt-in ``torch.profiler`` window (``TrainProfiler``)."""

from __future__ import annotations

import torch

from nemo_fp8.utils.metrics import MetricAccumulator
from nemo_fp8.policy.torch_backend import ShardTrainResult, reduce_train_results
from nemo_fp8.utils.memory import CudaMemoryWindow, cuda_memory_gib
from nemo_fp8.utils.config import ProfileConfig
from nemo_fp8.utils.profiling import TrainProfiler


def _result(loss: float, memory: dict) -> ShardTrainResult:
    acc = MetricAccumulator({"loss": "sum"})
    acc.add({"loss": torch.tensor(loss)})
    return ShardTrainResult([acc], [1.0], [1e-5], memory=memory)


def test_memory_metrics_are_the_fullest_ranks():
    out = reduce_train_results([_result(1.0, {"memory/train_peak_reserved_gib": 70.0, "memory/train_alloc_retries": 0.0}),
                                _result(3.0, {"memory/train_peak_reserved_gib": 78.0, "memory/train_alloc_retries": 5.0})])
    assert out["memory/train_peak_reserved_gib"] == 78.0 and out["memory/train_alloc_retries"] == 5.0
    assert out["loss"] == 4.0  # the loss's metrics are reduced as before (a sum over ranks)
    assert "memory/train_peak_reserved_gib" not in reduce_train_results([_result(1.0, {})])


def test_cuda_memory_window_reports_nothing_without_cuda():
    window = CudaMemoryWindow("cpu")
    window.start()
    assert window.metrics("memory/train_") == {}
    assert cuda_memory_gib("cpu") == {}


def test_the_policy_group_reports_each_figure_of_the_fullest_rank():
    from nemo_fp8.policy.group import max_per_key

    ranks = [{"allocated_gib": 70.0, "reserved_gib": 81.0}, None, {"allocated_gib": 72.5, "reserved_gib": 79.0}]
    assert max_per_key(ranks) == {"allocated_gib": 72.5, "reserved_gib": 81.0}
    assert max_per_key([{"gc": -1.0}]) == {"gc": -1.0} and max_per_key([]) == {}


def _steps(tmp_path, call: int, profiled_call: int, trace: bool = False):
    prof = TrainProfiler(call, rank=1, cfg=ProfileConfig(dir=str(tmp_path), train_call=profiled_call,
                                                         micro_batches=2, trace=trace))
    x = torch.randn(64, 64)
    for _ in range(4):
        x = torch.tanh(x @ x.T / 64)
        prof.step()
    prof.close()


def test_profiler_writes_the_profiled_calls_table_only(tmp_path):
    _steps(tmp_path, call=2, profiled_call=3)
    assert list(tmp_path.iterdir()) == []  # not the profiled call: no profiler at all
    _steps(tmp_path, call=3, profiled_call=3)
    table = (tmp_path / "train_call3_rank1.txt").read_text()
    assert "aten::mm" in table and "aten::tanh" in table
    head, by_device, by_cpu = table.split("\n# by ")
    assert head.startswith("window: 2 micro-batches, wall ") and float(head.split("wall ")[1].split(" s")[0]) >= 0
    assert by_cpu.startswith("self_cpu_time_total") and "aten::mm" in by_cpu
    assert not list(tmp_path.glob("*.json.gz"))  # the trace is opt-in


def test_profiler_writes_the_chrome_trace_on_request(tmp_path):
    import gzip
    import json

    _steps(tmp_path, call=3, profiled_call=3, trace=True)
    trace = json.loads(gzip.open(tmp_path / "train_call3_rank1.json.gz").read())
    assert any(ev.get("name") == "aten::tanh" for ev in trace["traceEvents"])
    assert sorted(f.name for f in tmp_path.iterdir()) == ["train_call3_rank1.json.gz", "train_call3_rank1.txt"]


def test_profiler_is_off_without_its_directory():
    prof = TrainProfiler(3, rank=0, cfg=ProfileConfig())
    prof.step()
    prof.close()
    assert prof._prof is None

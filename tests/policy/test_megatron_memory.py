"""The megatron trainer's memory estimate and the preflight that refuses a layout that cannot fit (CPU)."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file

from nemo_fp8.config import config_diff, load_config
from nemo_fp8.policy.megatron.memory import (NON_TORCH_BYTES, GiB, activation_bytes, activation_memory_warnings,
                                             checkpoint_parameter_counts, estimate_trainer_memory,
                                             trainer_memory_errors)
from nemo_fp8.preflight import check_trainer_memory

QWEN3_8B = 8_190_735_360  # Megatron's count of the Qwen3-8B-shaped checkpoint on the H200 (untied embeddings)
H200 = int(139.80 * GiB)  # torch's total_memory of one H200
HOST = 128 * GiB  # the one-H200 host's memory
CONFIG_8B = "examples/configs/grpo_math_8B_megatron.yaml"
QWEN3_8B_MATRICES = 36 * (2 * 4096 * 4096 + 2 * 1024 * 4096 + 3 * 12288 * 4096)  # q, o, k, v, gate, up, down
H100 = int(79.6 * GiB)  # torch's total_memory of one H100 80GB HBM3
CONFIG_8B_FP8 = "examples/configs/grpo_math_8B_megatron_fp8.yaml"
# The one-GPU layout that runs out of memory in FusedAdam's step on one 141 GiB GPU (docs/multi-gpu.md)
TP1_PRECISION_AWARE = ["cluster.gpus_per_node=1", "policy.data_parallel_size=1",
                       "policy.megatron_cfg.tensor_model_parallel_size=1",
                       "policy.megatron_cfg.sequence_parallel=false",
                       "policy.megatron_cfg.optimizer.use_precision_aware_optimizer=true",
                       "policy.megatron_cfg.distributed_data_parallel_config.grad_reduce_in_fp32=false"]
ONE_GPU = [*TP1_PRECISION_AWARE, "policy.megatron_cfg.optimizer.exp_avg_dtype=bfloat16",
           "policy.megatron_cfg.optimizer.exp_avg_sq_dtype=bfloat16"]


def _policy(*overrides):
    return load_config(CONFIG_8B, list(overrides)).policy


def test_one_gpu_precision_aware_8b_counts_the_fp32_unscaled_moments_and_is_refused():
    est = estimate_trainer_memory(QWEN3_8B, _policy(*ONE_GPU))
    # 2 weights + 2 grads + 2 main-param remainders + 2 + 2 bf16 moments + 4 + 4 fp32 copies during the step
    assert est.bytes_per_param == {"weights": 2, "grads": 2, "main_params": 2, "moments": 4, "unscaled_moments": 8}
    assert est.per_gpu == pytest.approx(QWEN3_8B * 18)
    # the OOM seen on the H200: 125.5 GiB allocated part-way through the unscaling, 7.8 GiB outside PyTorch
    assert est.per_gpu / GiB > 125.5 and est.per_gpu + NON_TORCH_BYTES > H200
    (err,) = trainer_memory_errors(_policy(*ONE_GPU), H200, QWEN3_8B, HOST)
    assert "18 B/param" in err and "8.19B parameters" in err and "139.8 GiB" in err
    assert "tensor_model_parallel_size (now 1)" in err and "FusedAdam" in err
    assert "grad_reduce_in_fp32=false" not in err  # already set


TP2 = "policy.megatron_cfg.tensor_model_parallel_size=2"  # with the configs' sequence parallelism


def test_two_way_tensor_parallel_fits_one_h200_each():
    two_gpus = _policy(TP2, "policy.data_parallel_size=1")  # fp32 gradient buffer, standard Adam
    est = estimate_trainer_memory(QWEN3_8B, two_gpus)
    assert est.bytes_per_param == {"weights": 2, "grads": 4, "main_params": 4, "moments": 8, "grad_copy": 0,
                                    "unscaled_moments": 0}
    assert est.per_gpu == pytest.approx(QWEN3_8B / 2 * 18)  # 2 + 4 + 4 + 8 B/param over 2 ranks
    assert trainer_memory_errors(two_gpus, H200, QWEN3_8B, HOST) == []
    # colocated: each rank's fp32 moments and bf16 weights, out around generation
    assert est.host == pytest.approx(QWEN3_8B / 2 * (8 + 2))


def test_the_8b_configs_own_layout_is_tensor_parallel_1_on_their_8_gpus():
    """Tensor parallel 1 x data parallel 8 (the numbers in grpo_math_8B_megatron.yaml's comment): the distributed
    optimizer shards the fp32 main params and moments over 8 ranks, 57.2 GiB per GPU in BF16 and 70.1 with FP8
    training's TE weight copies, + 7.8 outside PyTorch; 183.1 GiB of the 8 ranks' state in host memory around
    generation. It fits an H200 and passes the estimate on an 80 GB card too, FP8 by only 1.7 GiB, which the
    activations exceed: there the config's comment and docs/multi-gpu.md name tensor parallel 2 (40.8 GiB FP8)."""
    bf16, fp8 = _policy(), load_config(CONFIG_8B_FP8).policy
    for p in (bf16, fp8):
        assert (p.megatron_cfg.tensor_model_parallel_size, p.data_parallel_size) == (1, 8)
    eight = estimate_trainer_memory(QWEN3_8B, bf16)
    assert eight.per_gpu == pytest.approx(QWEN3_8B * (2 + 4 + (4 + 8) / 8))
    assert eight.per_gpu / GiB == pytest.approx(57.2, abs=0.05)
    assert eight.host * bf16.world_size / GiB == pytest.approx(183.1, abs=0.05)  # 8 / 8 moments + 2 weights a rank
    fp8_est = estimate_trainer_memory(QWEN3_8B, fp8, QWEN3_8B_MATRICES)
    assert fp8_est.per_gpu / GiB == pytest.approx(70.1, abs=0.05)
    assert (fp8_est.per_gpu + NON_TORCH_BYTES) / GiB == pytest.approx(77.9, abs=0.05)
    for p in (bf16, fp8):
        assert trainer_memory_errors(p, H200, QWEN3_8B, 0, QWEN3_8B_MATRICES) == []
        assert trainer_memory_errors(p, H100, QWEN3_8B, 0, QWEN3_8B_MATRICES) == []
    assert (H100 - fp8_est.per_gpu - NON_TORCH_BYTES) / GiB == pytest.approx(1.7, abs=0.05)
    tp2 = load_config(CONFIG_8B_FP8, [TP2, "policy.data_parallel_size=4"]).policy
    assert estimate_trainer_memory(QWEN3_8B, tp2, QWEN3_8B_MATRICES).per_gpu / GiB == pytest.approx(40.8, abs=0.05)
    # a host too small for what the 8 colocated ranks move out is refused, naming the state and the 75% share
    (err,) = trainer_memory_errors(bf16, H200, QWEN3_8B, 128 * GiB, QWEN3_8B_MATRICES)
    assert "183.1 GiB in host memory" in err and "75%" in err
    assert trainer_memory_errors(bf16, H200, QWEN3_8B, 245 * GiB, QWEN3_8B_MATRICES) == []


def test_a_16_bit_gradient_buffer_costs_an_fp32_copy_in_the_standard_optimizer():
    est = estimate_trainer_memory(QWEN3_8B, _policy(
        "policy.megatron_cfg.distributed_data_parallel_config.grad_reduce_in_fp32=false"))
    assert est.bytes_per_param["grads"] == 2 and est.bytes_per_param["grad_copy"] == 4
    assert sum(est.bytes_per_param.values()) == 20


def test_data_parallel_shards_only_the_optimizer_state():
    one = estimate_trainer_memory(QWEN3_8B, _policy("policy.megatron_cfg.tensor_model_parallel_size=1",
                                                    "policy.data_parallel_size=1"))
    two = estimate_trainer_memory(QWEN3_8B, _policy("policy.megatron_cfg.tensor_model_parallel_size=1",
                                                    "policy.data_parallel_size=2"))
    assert two.parts["weights"] == one.parts["weights"] and two.parts["grads"] == one.parts["grads"]
    assert two.parts["moments"] == one.parts["moments"] / 2 and two.parts["main_params"] == one.parts["main_params"] / 2


def test_fp8_training_keeps_megatron_cores_fp32_main_params_under_the_precision_aware_optimizer():
    # megatron-core's use_precision_aware_optimizer_no_fp8_or_ds_fp8 is false for the blockwise recipe: on the H200 the
    # e4m3-blockwise optimizer state held bf16 moments and no FusedAdam master_param (the BF16 run: int16 remainders)
    est = estimate_trainer_memory(QWEN3_8B, _policy(*ONE_GPU, "policy.megatron_cfg.fp8_cfg.enabled=true"))
    assert est.bytes_per_param == {"weights": 2, "grads": 2, "main_params": 4, "moments": 4, "grad_copy": 4,
                                   "unscaled_moments": 8}


def test_fp8_params_and_fp16_training_change_weights_and_main_params():
    fp8 = estimate_trainer_memory(1000, _policy("policy.megatron_cfg.fp8_cfg.enabled=true",
                                                "policy.megatron_cfg.fp8_cfg.fp8_param=true"))
    assert fp8.bytes_per_param["weights"] == 1
    fp16 = estimate_trainer_memory(1000, _policy(*ONE_GPU, "policy.megatron_cfg.optimizer.bf16=false",
                                                 "policy.megatron_cfg.optimizer.fp16=true"))
    assert fp16.bytes_per_param["main_params"] == 4  # remainders only complete bf16 weights


def test_checkpoint_parameter_counts_read_headers_of_every_shard(tmp_path):
    save_file({"a": torch.zeros(3, 5), "b": torch.zeros(7, dtype=torch.bfloat16)}, str(tmp_path / "m-1.safetensors"))
    save_file({"c": torch.zeros(2, 2, 2)}, str(tmp_path / "m-2.safetensors"))
    assert checkpoint_parameter_counts(tmp_path)[0] == 15 + 7 + 8
    (tmp_path / "m-3.safetensors").write_bytes(b"\x01")
    with pytest.raises(ValueError, match="m-3.safetensors: not a safetensors file"):
        checkpoint_parameter_counts(tmp_path)
    with pytest.raises(FileNotFoundError, match="no \\*.safetensors"):
        checkpoint_parameter_counts(tmp_path / "nothing")


def test_fp8_weight_copies_count_and_refuse_tensor_parallel_1_of_8b_on_an_h100():
    """TransformerEngine's rowwise + columnwise FP8 weights: 2 B per decoder-matrix parameter over tensor
    parallelism. The mission layout (TP 2 x DP 2) fits an H100; TP 1 x DP 4 passes without the copies and is
    refused with them (it would run out of memory in its first step), naming fp8_param. GPU memory only: the
    4-GPU host's memory is not this test's (host_bytes 0)."""
    four = ["cluster.gpus_per_node=4", "policy.data_parallel_size=2", TP2]
    tp2 = load_config(CONFIG_8B_FP8, four).policy
    est = estimate_trainer_memory(QWEN3_8B, tp2, QWEN3_8B_MATRICES)
    assert est.parts["fp8_weight_copies"] == QWEN3_8B_MATRICES  # 2 B / 2 ranks
    assert (est.per_gpu - est.parts["fp8_weight_copies"]) / GiB == pytest.approx(45.8, abs=0.05)
    assert est.per_gpu / GiB == pytest.approx(52.2, abs=0.05)  # the mission's FP8 trainer allocated 55.7 GiB
    assert trainer_memory_errors(tp2, H100, QWEN3_8B, 0, QWEN3_8B_MATRICES) == []
    tp1 = load_config(CONFIG_8B_FP8, [*four, "policy.megatron_cfg.tensor_model_parallel_size=1",
                                      "policy.data_parallel_size=4"]).policy
    assert trainer_memory_errors(tp1, H100, QWEN3_8B, 0) == []  # the state alone: 68.6 GiB + 7.8
    (err,) = trainer_memory_errors(tp1, H100, QWEN3_8B, 0, QWEN3_8B_MATRICES)
    assert "fp8_weight_copies 1.69" in err and "fp8_param=true" in err and "12.9 GiB per GPU" in err
    assert trainer_memory_errors(tp1, H200, QWEN3_8B, 0, QWEN3_8B_MATRICES) == []
    # no copies: BF16 training, or fp8_param (the weights themselves are FP8)
    assert "fp8_weight_copies" not in estimate_trainer_memory(QWEN3_8B, _policy(), QWEN3_8B_MATRICES).parts
    param = load_config(CONFIG_8B_FP8, [*four, "policy.megatron_cfg.fp8_cfg.fp8_param=true"]).policy
    assert "fp8_weight_copies" not in estimate_trainer_memory(QWEN3_8B, param, QWEN3_8B_MATRICES).parts


def test_checkpoint_counts_the_decoder_matrices_apart(tmp_path):
    """The FP8-trained matrices: decoder layers' 2-D weights, not norms, MoE routers or embeddings."""
    save_file({"model.embed_tokens.weight": torch.zeros(10, 4), "lm_head.weight": torch.zeros(10, 4),
               "model.layers.0.self_attn.q_proj.weight": torch.zeros(4, 4),
               "model.layers.0.self_attn.q_norm.weight": torch.zeros(4),
               "model.layers.0.input_layernorm.weight": torch.zeros(4),
               "model.layers.0.mlp.gate.weight": torch.zeros(2, 4),
               "model.layers.0.mlp.experts.0.down_proj.weight": torch.zeros(4, 8)}, str(tmp_path / "m.safetensors"))
    assert checkpoint_parameter_counts(tmp_path) == (40 + 40 + 16 + 4 + 4 + 8 + 32, 16 + 32)


def test_preflight_refuses_a_trainer_bigger_than_the_gpu(tmp_path):
    save_file({"w": torch.zeros(1024, 1024)}, str(tmp_path / "model.safetensors"))
    cfg = load_config(CONFIG_8B, [f"policy.model_name={tmp_path}", *ONE_GPU])
    need = 1024 * 1024 * 18
    (err,) = check_trainer_memory(cfg, gpu_bytes=NON_TORCH_BYTES + need - 1, host_bytes=HOST)
    assert err.startswith("policy.megatron_cfg:")
    assert check_trainer_memory(cfg, gpu_bytes=NON_TORCH_BYTES + need, host_bytes=HOST) == []
    torch_backend = load_config(CONFIG_8B, [f"policy.model_name={tmp_path}", "policy.megatron_cfg.enabled=false",
                                                "policy.megatron_cfg.tensor_model_parallel_size=1",
                                                "policy.megatron_cfg.logprob_kernel=chunked"])  # fused: Megatron's
    assert check_trainer_memory(torch_backend, gpu_bytes=1) == []  # the megatron backend's estimate only


OFFLOAD = [*TP1_PRECISION_AWARE, "policy.megatron_cfg.optimizer.optimizer_cpu_offload=true"]


def test_optimizer_cpu_offload_moves_the_offloaded_fraction_of_adam_to_the_host():
    # half offloaded: on the GPU 2 weights + 2 grads + (4 main params + 8 moments + 4 fp32 grad copy) / 2;
    # on the host 16 / 2 (main params, moments, pinned grad copy) + the bf16 weights around generation 2 (the GPU
    # half's state stays on the GPU: moved out too, 12 / 2 more, it overflowed the one-H200 host, 2026-11-24)
    half = _policy(*OFFLOAD, "policy.megatron_cfg.optimizer.optimizer_offload_fraction=0.5")
    est = estimate_trainer_memory(QWEN3_8B, half)
    assert est.bytes_per_param == {"weights": 2, "grads": 2, "main_params": 2, "moments": 4, "grad_copy": 2}
    assert est.per_gpu == pytest.approx(QWEN3_8B * 12) and est.host == pytest.approx(QWEN3_8B * 10)
    assert trainer_memory_errors(half, H200, QWEN3_8B, HOST) == []  # 91.5 GiB + 7.8 on the GPU, 76.3 GiB host
    assert "76.3 GiB in host memory" in est.describe()
    # all of it: 4 B/param on the GPU, but 16 + 2 B/param (137.3 GiB) does not leave room on a 128 GiB host
    full = _policy(*OFFLOAD, "policy.megatron_cfg.optimizer.optimizer_offload_fraction=1.0")
    assert estimate_trainer_memory(QWEN3_8B, full).per_gpu == pytest.approx(QWEN3_8B * 4)
    (err,) = trainer_memory_errors(full, H200, QWEN3_8B, HOST)
    assert "optimizer_offload_fraction=1" in err and "137.3 GiB" in err and "lower the fraction" in err
    assert "the weights leave the GPU" in err
    separate = _policy(*OFFLOAD, "policy.megatron_cfg.optimizer.optimizer_offload_fraction=0.5",
                       "policy.generation.colocated.enabled=false")  # no generation on this GPU: nothing else moves
    assert estimate_trainer_memory(QWEN3_8B, separate).host == pytest.approx(QWEN3_8B * 8)
    assert trainer_memory_errors(full, H200, QWEN3_8B, 0) == []  # host size unknown: not checked
    # the refused one-GPU layout's error points at the offload
    (err,) = trainer_memory_errors(_policy(*ONE_GPU), H200, QWEN3_8B, HOST)
    assert "optimizer_cpu_offload=true" in err


def test_optimizer_cpu_offload_config_names_what_it_needs():
    from nemo_fp8.config import ConfigError

    with pytest.raises(ConfigError) as e:
        load_config(CONFIG_8B, ["policy.megatron_cfg.optimizer.optimizer_cpu_offload=true"])
    msg = str(e.value)
    assert "use_precision_aware_optimizer=true" in msg and "optimizer_offload_fraction=0.0 offloads nothing" in msg
    with pytest.raises(ConfigError, match="exp_avg_dtype=float32"):
        load_config(CONFIG_8B, [*OFFLOAD, "policy.megatron_cfg.optimizer.optimizer_offload_fraction=0.5",
                                "policy.megatron_cfg.optimizer.exp_avg_dtype=bfloat16"])
    with pytest.raises(ConfigError, match="optimizer_offload_fraction"):
        load_config(CONFIG_8B, [*OFFLOAD, "policy.megatron_cfg.optimizer.optimizer_offload_fraction=1.5"])


def test_optimizer_cpu_offload_reaches_megatron_cores_optimizer_config():
    from nemo_fp8.policy.megatron.settings import optimizer_config_kwargs

    kw = optimizer_config_kwargs(_policy(*OFFLOAD, "policy.megatron_cfg.optimizer.optimizer_offload_fraction=0.5"))
    assert (kw["optimizer_cpu_offload"], kw["optimizer_offload_fraction"], kw["overlap_cpu_optimizer_d2h_h2d"]) == \
        (True, 0.5, True)
    assert kw["use_precision_aware_optimizer"] and kw["use_distributed_optimizer"]


def test_without_the_colocated_offload_the_awake_engine_is_counted_and_nothing_moves_to_host():
    """colocated.offload_trainer=false: the trainer keeps its state on the GPU while the engine runs beside it."""
    small = 209_753_088  # the parity config's small model
    two_gpus = [TP2, "policy.data_parallel_size=1"]  # tensor parallel 2 on 2 GPUs: 68.7 GiB of state per GPU
    keep = [*two_gpus, "policy.generation.backend=vllm", "policy.generation.colocated.offload_trainer=false"]
    moved = estimate_trainer_memory(QWEN3_8B, _policy(*two_gpus, "policy.generation.backend=vllm"))
    kept = estimate_trainer_memory(QWEN3_8B, _policy(*keep))
    assert kept.per_gpu == moved.per_gpu and moved.host == pytest.approx(QWEN3_8B / 2 * 10) and kept.host == 0
    # tensor parallel 2 fits alone (68.7 GiB of state + 7.8), not beside an engine at 0.6 of the GPU (83.9 GiB)
    assert trainer_memory_errors(_policy(*two_gpus, "policy.generation.backend=vllm"), H200, QWEN3_8B, HOST) == []
    (err,) = trainer_memory_errors(_policy(*keep), H200, QWEN3_8B, HOST)
    assert "the engine's 83.9 GiB" in err and "colocated.offload_trainer=true" in err
    # the small model fits beside it
    assert trainer_memory_errors(_policy(*keep), H200, small, HOST) == []
    # the torch generation backend is not a vLLM engine with a memory share
    torch_gen = _policy("policy.generation.backend=torch", "policy.generation.colocated.offload_trainer=false")
    assert trainer_memory_errors(torch_gen, H200, QWEN3_8B, HOST) == []
    # an SGLang engine's share is its mem_fraction_static (the config's vLLM engine keys back at their defaults)
    sgl = [*two_gpus, "policy.generation.backend=sglang", "policy.generation.colocated.offload_trainer=false",
           "policy.generation.vllm_cfg.max_model_len=null", "policy.generation.vllm_cfg.model_runner=auto"]
    (err,) = trainer_memory_errors(_policy(*sgl), H200, QWEN3_8B, HOST)
    assert "the engine's 83.9 GiB, sglang_cfg.mem_fraction_static=0.6" in err
    # 53.4 GiB between steps + 41.9 + 7.8 fits
    assert trainer_memory_errors(_policy(*sgl, "policy.generation.sglang_cfg.mem_fraction_static=0.3"), H200,
                                 QWEN3_8B, HOST) == []


def test_the_one_gpu_layout_keeps_its_state_beside_the_engine_once_gradients_are_freed():
    """colocated.offload_trainer=false on one GPU (the mission's one-GPU recipe, half of Adam on the host): the
    engine wakes beside the state between steps (the gradient buffer freed, ``release_cached_memory``), not beside
    the state at the optimizer step; both must fit."""
    keep = [*OFFLOAD, "policy.megatron_cfg.optimizer.optimizer_offload_fraction=0.5", "policy.generation.backend=vllm",
            "policy.generation.colocated.offload_trainer=false", "policy.generation.vllm_cfg.gpu_memory_utilization=0.3"]
    est = estimate_trainer_memory(QWEN3_8B, _policy(*keep))
    assert est.per_gpu == pytest.approx(QWEN3_8B * 12) and est.between_steps == pytest.approx(QWEN3_8B * 10)
    assert est.host == pytest.approx(QWEN3_8B * 8)  # only the optimizer offload's half: nothing moves per step
    # 76.3 GiB + the engine's 41.9 + 7.8 = 126.0 GiB <= 139.8; the step's 91.5 + 7.8 with the engine asleep
    assert trainer_memory_errors(_policy(*keep), H200, QWEN3_8B, HOST) == []
    (err,) = trainer_memory_errors(_policy(*keep, "policy.generation.vllm_cfg.gpu_memory_utilization=0.45"), H200,
                                   QWEN3_8B, HOST)
    assert "76.3 GiB between steps" in err and "the engine's 62.9 GiB" in err
    assert "colocated.offload_trainer=true" in err
    # FP8 training: TE's FP8 weight copies are made anew each step too, freed with the gradients
    fp8 = estimate_trainer_memory(QWEN3_8B, _policy(*keep, "policy.megatron_cfg.fp8_cfg.enabled=true"),
                                  fp8_weight_params=6_945_767_424)
    assert fp8.parts["fp8_weight_copies"] > 0 and fp8.between_steps == pytest.approx(QWEN3_8B * 10)


CONFIG_1GPU = "examples/configs/grpo_math_8B_megatron_1gpu.yaml"
CONFIG_1GPU_FP8 = "examples/configs/grpo_math_8B_megatron_fp8_1gpu.yaml"


def _qwen3_8b_headers(folder):
    """A safetensors file holding only the header of Qwen3-8B's tensors (names and shapes, no data): what the
    preflight's estimate reads (``checkpoint_parameter_counts``)."""
    import json
    import struct

    shapes = {"model.embed_tokens.weight": [151936, 4096], "lm_head.weight": [151936, 4096], "model.norm.weight": [4096]}
    for i in range(36):
        layer = f"model.layers.{i}."
        shapes.update({layer + "self_attn.q_proj.weight": [4096, 4096], layer + "self_attn.k_proj.weight": [1024, 4096],
                       layer + "self_attn.v_proj.weight": [1024, 4096], layer + "self_attn.o_proj.weight": [4096, 4096],
                       layer + "self_attn.q_norm.weight": [128], layer + "self_attn.k_norm.weight": [128],
                       layer + "input_layernorm.weight": [4096], layer + "post_attention_layernorm.weight": [4096],
                       layer + "mlp.gate_proj.weight": [12288, 4096], layer + "mlp.up_proj.weight": [12288, 4096],
                       layer + "mlp.down_proj.weight": [4096, 12288]})
    header = json.dumps({k: {"dtype": "BF16", "shape": s, "data_offsets": [0, 0]} for k, s in shapes.items()}).encode()
    (folder / "model.safetensors").write_bytes(struct.pack("<Q", len(header)) + header)
    return folder


def test_the_one_gpu_configs_fit_one_h200_by_the_numbers_in_their_comments():
    """grpo_math_8B_megatron{,_fp8}_1gpu.yaml on a 139.8 GiB GPU and a 128 GiB host: at the optimizer step 91.5 GiB
    (both: FP8 keeps no TE weight copies, disable_parameter_transpose_cache) + 7.8 outside PyTorch; a training pass of
    16,384 tokens 114.4 GiB; between steps 76.3 beside the engine's 41.9; 61.0 GiB of Adam's state in host memory.
    Each pair of the four configs differs by what it should: the layout (1gpu against the 8-GPU config) or the FP8
    keys."""
    for path in (CONFIG_1GPU, CONFIG_1GPU_FP8):
        policy = load_config(path).policy
        est = estimate_trainer_memory(QWEN3_8B, policy, QWEN3_8B_MATRICES)
        assert est.per_gpu / GiB == pytest.approx(91.5, abs=0.05)
        assert policy.sequence_packing.train_mb_tokens == 16384
        assert est.backward_peak(activation_bytes(policy, *QWEN3_8B_SHAPE)) / GiB == pytest.approx(114.4, abs=0.05)
        assert activation_memory_warnings(policy, H200, QWEN3_8B, QWEN3_8B_SHAPE, QWEN3_8B_MATRICES) == []
        assert est.between_steps / GiB == pytest.approx(76.3, abs=0.05)
        assert policy.generation.vllm_cfg.gpu_memory_utilization * H200 / GiB == pytest.approx(41.9, abs=0.05)
        assert (est.between_steps + 0.3 * H200 + NON_TORCH_BYTES) / GiB == pytest.approx(126.0, abs=0.05)
        assert est.host / GiB == pytest.approx(61.0, abs=0.05)
        assert trainer_memory_errors(policy, H200, QWEN3_8B, HOST, QWEN3_8B_MATRICES) == []
    dump = {p: load_config(p).model_dump(mode="json") for p in (CONFIG_8B, CONFIG_8B_FP8, CONFIG_1GPU, CONFIG_1GPU_FP8)}
    dirs = ("logger.log_dir", "checkpointing.checkpoint_dir")

    def diff(a, b):
        return {k: v for k, v in config_diff(dump[a], dump[b]).items() if k not in dirs}

    assert diff(CONFIG_8B, CONFIG_1GPU) == diff(CONFIG_8B_FP8, CONFIG_1GPU_FP8)
    assert diff(CONFIG_1GPU, CONFIG_1GPU_FP8) == diff(CONFIG_8B, CONFIG_8B_FP8)
    # the layout the one-GPU mission ran: what its recipe changes in the 8-GPU layout recipe, the configs change too
    recipes = "examples/configs/recipes/llm/mission-8b/"
    ran = config_diff(load_config(recipes + "configs-layout.yaml").model_dump(mode="json"),
                      load_config(recipes + "one-gpu.yaml").model_dump(mode="json"))
    assert ran == diff(CONFIG_8B, CONFIG_1GPU)


def test_the_preflight_stops_the_one_gpu_configs_on_an_80gb_card_naming_the_keys(tmp_path):
    """Bad input: the one-GPU layout on an 80 GB card (79.6 GiB) is refused before any GPU work, from the
    checkpoint's own parameter counts, with the estimate and the keys that lower it; on an H200 it passes."""
    model = _qwen3_8b_headers(tmp_path)
    assert checkpoint_parameter_counts(model) == (QWEN3_8B, QWEN3_8B_MATRICES)
    for path, need in ((CONFIG_1GPU, "91.5 GiB per GPU"), (CONFIG_1GPU_FP8, "91.5 GiB per GPU")):
        cfg = load_config(path, [f"policy.model_name={model}"])
        (err,) = check_trainer_memory(cfg, gpu_bytes=H100, host_bytes=HOST)
        assert need in err and "~7.8 GiB outside PyTorch's allocator" in err and "the GPU's 79.6 GiB" in err
        assert "76.3 GiB between steps" in err and "the engine's 23.9 GiB" in err
        for key in ("tensor_model_parallel_size (now 1)", "policy.data_parallel_size, now 1",
                    "optimizer_cpu_offload=true with a larger optimizer_offload_fraction"):
            assert key in err
        assert "fp8_cfg.fp8_param=true" not in err  # no FP8 weight copies in either
        assert check_trainer_memory(cfg, gpu_bytes=H200, host_bytes=HOST) == []


QWEN3_8B_SHAPE = (36, 4096, 151936)  # num_hidden_layers, hidden_size, vocab_size


CACHED = "policy.megatron_cfg.override_transformer_config.disable_parameter_transpose_cache=false"  # TE's FP8 cache


@pytest.mark.parametrize("config,tokens,extra,measured_gib", [
    (CONFIG_1GPU, 16384, [], 114.45),         # BF16, its second step (the constants' calibration)
    (CONFIG_1GPU_FP8, 4096, [CACHED], 109.1),  # FP8 with TE's FP8 weight cache, the 8 x 8 mission
    (CONFIG_1GPU_FP8, 16384, [], 114.54),     # FP8 as the config ships, the standard workload's second step
])
def test_the_backward_peak_estimate_meets_the_one_gpu_runs(config, tokens, extra, measured_gib):
    """The trainer's peak allocation in the one-GPU mission runs (memory/train_peak_allocated_gib): state between
    steps + gradients + TE's FP8 copies (when cached) + one micro-batch's activations (docs/results/
    2026-12-02-mission-1gpu-standard-16k-1xh200, 2026-12-02-mission-1gpu-standard-1xh200 and
    2026-12-02-release-and-host-profile-1xh200)."""
    policy = load_config(config, [f"policy.sequence_packing.train_mb_tokens={tokens}", *extra]).policy
    est = estimate_trainer_memory(QWEN3_8B, policy, QWEN3_8B_MATRICES)
    act = activation_bytes(policy, *QWEN3_8B_SHAPE)
    assert act / tokens == 36 * 4096 * 2 + 4 * 151936 + 145 * 4096  # layer inputs, logits + gradient, one layer
    assert est.backward_peak(act) / GiB == pytest.approx(measured_gib, abs=1.2)


def test_the_preflight_warns_of_the_16k_fp8_micro_batch_that_ran_out_of_memory(tmp_path):
    """What ran on one H200 with TE's FP8 weight cache: BF16 at 16,384-token micro-batches, FP8 at 4,096 (no warning);
    FP8 at 16,384 ran out of memory (a warning with the largest micro-batch that fits the estimate and the keys that
    make room); without the cache, as the config ships, FP8 at 16,384 ran and the estimate does not warn."""
    import json

    from nemo_fp8.preflight import activation_warnings

    for path, tokens in ((CONFIG_1GPU, 16384), (CONFIG_1GPU_FP8, 4096)):
        policy = load_config(path, [f"policy.sequence_packing.train_mb_tokens={tokens}", CACHED]).policy
        assert activation_memory_warnings(policy, H200, QWEN3_8B, QWEN3_8B_SHAPE, QWEN3_8B_MATRICES) == []
    ran = [CACHED, "policy.megatron_cfg.train_expandable_segments=false"]  # the run that ran out of memory
    fp8 = load_config(CONFIG_1GPU_FP8, ["policy.sequence_packing.train_mb_tokens=16384", *ran]).policy
    (warning,) = activation_memory_warnings(fp8, H200, QWEN3_8B, QWEN3_8B_SHAPE, QWEN3_8B_MATRICES)
    assert warning.startswith("policy.sequence_packing.train_mb_tokens: a training pass of 16,384 tokens may run out")
    assert "about 127.3 GiB (104.5 of state, gradients and FP8 weight copies, 22.8 of activations)" in warning
    assert "train_mb_tokens <= 11,264 (now 16,384)" in warning and "train_expandable_segments=true" in warning
    assert "disable_parameter_transpose_cache=true (no FP8 weight copies kept: 12.9 GiB)" in warning
    # without TE's FP8 weight cache the pass holds BF16's state and gradients: the 16,384 tokens fit the estimate
    uncached = load_config(CONFIG_1GPU_FP8).policy  # as the config ships
    assert "fp8_weight_copies" not in estimate_trainer_memory(QWEN3_8B, uncached, QWEN3_8B_MATRICES).parts
    assert activation_memory_warnings(uncached, H200, QWEN3_8B, QWEN3_8B_SHAPE, QWEN3_8B_MATRICES) == []
    model = _qwen3_8b_headers(tmp_path)  # the preflight reads the counts and the shape from the checkpoint
    (model / "config.json").write_text(json.dumps({"num_hidden_layers": 36, "hidden_size": 4096, "vocab_size": 151936}))
    cfg = load_config(CONFIG_1GPU_FP8, [f"policy.model_name={model}", "policy.sequence_packing.train_mb_tokens=16384",
                                        *ran])
    assert activation_warnings(cfg, gpu_bytes=H200) == [warning]
    (model / "config.json").unlink()
    assert activation_warnings(cfg, gpu_bytes=H200) == []  # no shape: nothing estimated

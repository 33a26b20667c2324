"""Mixed into every vLLM worker (``worker_extension_cls``); importing it applies the patch table.

vLLM imports this module in each worker process before the model is built, so the patches in
``patches.py`` are in place when the Linear kernels are created: this module applies those of every
engine (not marked ``fp8_only``); FP8 engines name ``worker_extension_fp8.Fp8WorkerExtension``, whose
module imports this one and applies the FP8 ones too (``engine_args``). The methods are called by name
through ``LLM.collective_rpc`` (no insecure serialization needed) by tests and the backend.
"""

from __future__ import annotations

import os

import torch

from nemo_fp8.generation.vllm.engine_args import live_activation_scales
from nemo_fp8.generation.vllm.log_filters import install_log_filters
from nemo_fp8.generation.vllm.patches import apply_patches, engine_settings

apply_patches(fp8=False)
install_log_filters()  # vLLM's per-refit "RotaryEmbedding: Failed to load weights" is a false alarm (log_filters.py)


class Fp8WorkerExtension:
    def _nf_model(self):
        return self.model_runner.model

    def nemo_fp8_params(self, names: list[str]) -> dict:
        """name -> (dtype name, shape, raw bytes) of engine parameters."""
        params = dict(self._nf_model().named_parameters())
        out = {}
        for n in names:
            t = params[n].data
            out[n] = (str(t.dtype).split(".")[-1], list(t.shape), t.contiguous().view(torch.uint8).cpu().numpy().tobytes())
        return out

    def nemo_fp8_linear_forward(self, name: str, x: tuple) -> tuple:
        """Run the engine's linear module ``name`` (e.g. ``model.layers.1.self_attn.o_proj``: its quantization
        method's kernels, CUTLASS / DeepGEMM block FP8) on one input, outside any forward pass.

        Args:
            name: a vLLM ``LinearBase`` module name.
            x: (dtype name, shape [M, K], raw bytes) of the input.

        Returns:
            (dtype name, shape [M, N], raw bytes) of the output (without the bias the module returns apart).

        Raises:
            KeyError: no module ``name``.
        """
        dtype, shape, raw = x
        t = torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(getattr(torch, dtype)).reshape(shape)
        module = dict(self._nf_model().named_modules())[name]
        with torch.no_grad():
            out = module(t.to(next(module.parameters()).device))
        out = (out[0] if isinstance(out, tuple) else out).contiguous()
        return str(out.dtype).split(".")[-1], list(out.shape), out.view(torch.uint8).cpu().numpy().tobytes()

    def nemo_fp8_close_weight_transfer(self) -> bool:
        """Abort this worker's NCCL communicator with the trainer and drop it; True if there was one.

        vLLM 0.22's ``NCCLWeightTransferEngine.shutdown`` only sets ``model_update_group`` to None, leaving the
        NCCL communicator to the garbage collector; ``PyNcclCommunicator.destroy`` aborts it first (in a
        daemon thread with a 5 s limit, vLLM's own way of avoiding a hang at teardown).
        """
        engine = getattr(self, "weight_transfer_engine", None)
        group = getattr(engine, "model_update_group", None)
        if group is None:
            return False
        group.destroy()
        engine.shutdown()
        return True

    def nemo_fp8_param_info(self) -> dict:
        """name -> (dtype name, shape, data_ptr) of every parameter."""
        return {n: (str(p.dtype).split(".")[-1], list(p.shape), p.data_ptr())
                for n, p in self._nf_model().named_parameters()}

    def nemo_fp8_kernel_params(self) -> dict:
        """What a refit in kernel format (``kernel_format.KernelLayout``) copies into: ``params``, name -> (dtype
        name, shape) of every parameter; ``packed``, the model's ``packed_modules_mapping`` (fused module -> its
        parts); ``linear_kernels``, the class names of the FP8 linears' kernels (empty for a BF16 engine)."""
        model = self._nf_model()
        params = {n: (str(p.dtype).removeprefix("torch."), list(p.shape)) for n, p in model.named_parameters()}
        packed = {k: list(v) for k, v in (getattr(model, "packed_modules_mapping", None) or {}).items()}
        kernels = {type(k).__name__ for m in model.modules()
                   if (k := getattr(getattr(m, "quant_method", None), "fp8_linear", None)) is not None}
        return {"params": params, "packed": packed, "linear_kernels": sorted(kernels)}

    def nemo_fp8_freeze_params(self) -> int:
        """Turn off ``requires_grad`` on every parameter; returns how many had it on (norm weights and the other
        plain ``nn.Parameter``s vLLM creates with the default). A kernel-format refit needs it: vLLM 0.22's
        ``load_weights_direct`` (``gpu_worker.update_weights`` with ``is_checkpoint_format=False``) calls
        ``param.copy_(weight)`` outside ``torch.no_grad``, which autograd refuses on a leaf that requires grad.
        The storage is untouched (``data_ptr`` unchanged); the engine never takes gradients."""
        frozen = 0
        for p in self._nf_model().parameters():
            frozen += int(p.requires_grad)
            p.requires_grad_(False)
        return frozen

    def nemo_fp8_memory(self) -> dict:
        torch.cuda.synchronize()
        return {"allocated": torch.cuda.memory_allocated(), "reserved": torch.cuda.memory_reserved(),
                "free": torch.cuda.mem_get_info()[0]}

    def nemo_fp8_attn_scales(self) -> dict:
        """Attention module name (``model.layers.{i}.self_attn.attn``) -> the scales it holds.

        Each value: ``{"q", "k", "v"}``: the fp32 device tensors ``_{q,k,v}_scale`` the kernels
        read (as python floats, exact), ``{"q", "k", "v"}_float``: vLLM's host copies
        (``_{q,k,v}_scale_float``, None where absent), ``kv_cache_dtype``, ``impl`` (the
        attention implementation's class, e.g. ``FlashAttentionImpl``), ``fa_version`` (its
        FlashAttention version, None for other backends) and ``query_quant`` (True: q is
        quantized to FP8 with ``_q_scale`` before attention, as FA3 does with an FP8 KV cache).
        """
        out = {}
        for name, m in self._nf_model().named_modules():
            if hasattr(m, "_k_scale") and hasattr(m, "_v_scale"):
                rec = {k: float(getattr(m, f"_{k}_scale").reshape(-1)[0]) for k in "qkv"}
                for k in "qkv":
                    host = getattr(m, f"_{k}_scale_float", None)
                    rec[f"{k}_float"] = None if host is None else float(host)
                rec["kv_cache_dtype"] = str(getattr(m, "kv_cache_dtype", ""))
                impl = getattr(m, "impl", None)
                rec["impl"] = type(impl).__name__
                rec["fa_version"] = getattr(impl, "vllm_flash_attn_version", None)
                rec["query_quant"] = getattr(m, "query_quant", None) is not None and bool(
                    getattr(impl, "supports_quant_query_input", False))
                out[name] = rec
        return out

    def nemo_fp8_restore_kv_scales(self, scales: dict) -> int:
        """Write ``scales`` (attention module name -> ``{"q", "k", "v"}`` floats, what ``nemo_fp8_attn_scales``
        read after the refit) back into the layers' ``_{q,k,v}_scale`` tensors and their ``_*_scale_float`` host
        copies; returns the layers written. vLLM 0.22's V1 runner resets ``_k_scale`` / ``_v_scale`` to 1.0 each
        time an FP8 KV cache wakes (``GPUModelRunner.post_kv_cache_wake_up`` -> ``init_fp8_kv_scales``, its TODO:
        "restore the specific calibrated scales"), which would drop the step's calibrated scales at every colocated
        rollout."""
        modules = dict(self._nf_model().named_modules())
        for name, rec in scales.items():
            m = modules[name]
            for k in "qkv":
                getattr(m, f"_{k}_scale").fill_(float(rec[k]))
                if hasattr(m, f"_{k}_scale_float"):
                    setattr(m, f"_{k}_scale_float", float(rec[k]))
        return len(scales)

    def nemo_fp8_scale_convention(self) -> dict:
        """Which scale convention is live in this worker (proof for the config's claim), and its vLLM model runner."""
        from vllm.utils.deep_gemm import is_deep_gemm_e8m0_used, is_deep_gemm_supported

        kernels, act_ue8m0 = set(), set()
        for m in self._nf_model().modules():
            qm = getattr(m, "quant_method", None)
            kern = getattr(qm, "fp8_linear", None)
            if kern is not None:
                kernels.add(type(kern).__name__)
                q = getattr(kern, "quant_fp8", None)
                if q is not None:
                    act_ue8m0.add(bool(q.use_ue8m0))
        cc = self.vllm_config.compilation_config
        compiled = getattr(cc.mode, "name", str(cc.mode)) == "VLLM_COMPILE"  # where the fusion passes run
        fuse_act, fuse_norm = bool(cc.pass_config.fuse_act_quant), bool(cc.pass_config.fuse_norm_quant)
        return {"deep_gemm": bool(is_deep_gemm_supported()), "e8m0": bool(is_deep_gemm_e8m0_used()),
                "linear_kernels": sorted(kernels), "act_ue8m0": sorted(act_ue8m0),
                "compiled": compiled, "fuse_act_quant": fuse_act, "fuse_norm_quant": fuse_norm,
                "act_scales": live_activation_scales(sorted(act_ue8m0), compiled, fuse_act, fuse_norm),
                "env_e8m0": os.environ.get("VLLM_USE_DEEP_GEMM_E8M0"),
                "pow2_act_setting": engine_settings(self.vllm_config).get("pow2_activation_scales"),
                # vLLM's GPU model runner of this worker (vllm_cfg.model_runner; auto: V2 for unquantized Qwen3 only)
                "model_runner": "v2" if getattr(self, "use_v2_model_runner", False) else "v1"}

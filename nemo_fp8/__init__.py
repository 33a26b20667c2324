"""nemo-fp8: end-to-end FP8 reinforcement learning (GRPO) for LLMs."""

__version__ = "0.1.0"


def __getattr__(name):
    """``nemo_fp8.init_fp8``: vLLM FP8 engine arguments (lazy: no vLLM import at package import)."""
    if name == "init_fp8":
        from nemo_fp8.generation.vllm.engine_args import init_fp8

        return init_fp8
    raise AttributeError(f"module 'nemo_fp8' has no attribute {name!r}")

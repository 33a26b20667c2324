"""nemo-fp8: end-to-end FP8 reinforcement learning (GRPO) for LLMs."""

__version__ = "0.1.0"

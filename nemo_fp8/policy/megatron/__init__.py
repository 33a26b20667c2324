"""Policy backend ``megatron`` (Megatron-core + TransformerEngine FP8 training, built by Megatron-Bridge).

``settings`` (config mapping) and ``logprobs`` (vocab-parallel log-probs) are pure torch and run
on CPU; ``backend`` imports megatron-core, Megatron-Bridge and TransformerEngine, which need
Python >= 3.12 and a CUDA GPU.
"""

"""Rule-based rewards for math RL."""

from nemo_fp8.rewards.interfaces import RewardScorer
from nemo_fp8.rewards.math_reward import (
    MathRewardScorer,
    extract_answer,
    score_response,
    verify_answer,
)

__all__ = ["MathRewardScorer", "RewardScorer", "extract_answer", "score_response", "verify_answer"]

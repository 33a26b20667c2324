"""Config section ``data``: where problems come from and how prompts are formatted."""

from __future__ import annotations

from typing import Literal, Optional

from pydantic import Field

from nemo_fp8.utils.config import StrictConfig


class DataConfig(StrictConfig):
    """Training/validation problems. ``synthetic`` needs no files (the embedded default)."""

    dataset: Literal["synthetic", "gsm8k", "dapo", "problem_answer", "auto"] = "synthetic"
    train_path: Optional[str] = None
    val_path: Optional[str] = None
    max_train_samples: Optional[int] = Field(None, ge=1)
    num_synthetic_train: int = Field(4096, ge=1)
    num_synthetic_val: int = Field(256, ge=1)
    synthetic_max_operand: int = Field(99, ge=1)
    prompt_template: str = "{problem}"
    # the start of every answer, prefilled at the end of the prompt (after the template or chat template) so the
    # model generates only the rest; the reward scores response_prefix + response. A model trained to answer
    # "Answer: 42" gets "Answer: " here and generates 3-4 tokens instead of 11 (grpo_math_tiny.yaml)
    response_prefix: str = ""
    use_chat_template: bool = False
    system_prompt: Optional[str] = None
    max_input_seq_length: int = Field(512, ge=1)
    shuffle: bool = True
    seed: int = 0

    def config_errors(self) -> list[str]:
        return [f"train_path: required for data.dataset='{self.dataset}' (a local .jsonl/.json/.parquet file), "
                "or use data.dataset='synthetic'"] if self.dataset != "synthetic" and not self.train_path else []

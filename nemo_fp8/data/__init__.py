"""Math datasets, prompt formatting and the prompt dataloader."""

from nemo_fp8.data.dataloader import PromptDataloader
from nemo_fp8.data.datasets import (DatasetFormatError, LoadedDataset, detect_schema, load_math_dataset, load_math_file,
                                    parse_gsm8k_answer)
from nemo_fp8.data.prompts import PromptFormatter, PromptSample, tokenize_prompts
from nemo_fp8.data.schema import MathExample
from nemo_fp8.data.synthetic import make_arithmetic_problems

__all__ = [
    "DatasetFormatError",
    "LoadedDataset",
    "MathExample",
    "PromptDataloader",
    "PromptFormatter",
    "PromptSample",
    "detect_schema",
    "load_math_dataset",
    "load_math_file",
    "make_arithmetic_problems",
    "parse_gsm8k_answer",
    "tokenize_prompts",
]

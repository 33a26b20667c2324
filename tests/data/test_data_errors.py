"""Data errors name the file and line, and the preflight reports them before any model build."""

from pathlib import Path

import pytest

from nemo_fp8.config import load_config
from nemo_fp8.data import DatasetFormatError, load_math_dataset

REPO = Path(__file__).resolve().parents[2]


def test_non_utf8_byte_names_file_and_line(tmp_path):
    f = tmp_path / "d.jsonl"
    f.write_bytes(b'{"problem": "1+1", "answer": "2"}\n{"problem": "caf\xe9", "answer": "2"}\n')
    with pytest.raises(DatasetFormatError, match=r"d\.jsonl, line 2: not UTF-8 text \(byte 0xe9"):
        load_math_dataset(f)
    g = tmp_path / "d.json"
    g.write_bytes(b'[\n{"problem": "1+1", "answer": "2"},\n{"problem": "\xff", "answer": "2"}]')
    with pytest.raises(DatasetFormatError, match=r"d\.json, line 3: not UTF-8"):
        load_math_dataset(g)


def test_file_that_is_not_parquet_names_the_file(tmp_path):
    f = tmp_path / "d.parquet"
    f.write_text("problem,answer\n1+1,2\n")
    with pytest.raises(DatasetFormatError, match=r"d\.parquet: not a readable Parquet file"):
        load_math_dataset(f)


@pytest.mark.parametrize("content, expect", [
    (None, r"data\.train_path: file not found: .*missing\.jsonl"),
    (b"", r"data\.train_path: .*train\.jsonl has no records \(empty file\)"),
    (b'{"problem": "1+1", "answer": "2"}\n{"oops": 1\n', r"data\.train_path: .*train\.jsonl, line 2: invalid JSON"),
])
def test_preflight_reports_data_errors_before_the_model_build(tmp_path, content, expect):
    from nemo_fp8.preflight import PreflightError, preflight

    train = tmp_path / ("missing.jsonl" if content is None else "train.jsonl")
    if content is not None:
        train.write_bytes(content)
    cfg = load_config(REPO / "examples" / "configs" / "grpo_math_tiny_fp8.yaml", [
        "data.dataset=problem_answer", f"data.train_path={train}", f"policy.model_name={tmp_path / 'model'}",
        f"logger.log_dir={tmp_path / 'logs'}", "cluster.num_cpus=2"])
    with pytest.raises(PreflightError, match=expect):
        preflight(cfg)
    assert not (tmp_path / "model").exists()

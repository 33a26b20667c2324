"""Tests for load_math_dataset on GSM8K, DAPO (JSONL and parquet) and problem/answer files."""

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from nemo_fp8.data import DatasetFormatError, MathExample, load_math_dataset, parse_gsm8k_answer

DAPO_INSTRUCTION = (
    "Solve the following math problem step by step. The last line of your response should be of the "
    "form Answer: $Answer (without quotes) where $Answer is the answer to the problem.\n\n{q}\n\n"
    'Remember to put your answer on its own line after "Answer:".'
)

DAPO_RECORDS = [
    {
        "data_source": "math_dapo",
        "prompt": [{"role": "user", "content": DAPO_INSTRUCTION.format(q="What is $1+1$?")}],
        "ability": "MATH",
        "reward_model": {"ground_truth": "2", "style": "rule-lighteval/MATH_v2"},
        "extra_info": {"index": 17},
    },
    {
        "data_source": "aime2024",
        "prompt": [{"role": "user", "content": DAPO_INSTRUCTION.format(q="Find $x$ if $2x=1$.")}],
        "ability": "MATH",
        "reward_model": {"ground_truth": "\\frac{1}{2}", "style": "rule"},
        "extra_info": {"index": 3},
    },
]


def _write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return path


def test_gsm8k_counts_and_answers(gsm8k_dir):
    train = load_math_dataset(gsm8k_dir / "train.jsonl")
    test = load_math_dataset(gsm8k_dir / "test.jsonl", schema="gsm8k")
    assert len(train) == 7473
    assert len(test) == 1319
    first = test[0]
    assert first.problem.startswith("Janet")
    assert first.answer == "18"
    assert first.data_source == "gsm8k" and first.index == 0 and first.messages is None
    assert all(ex.answer and "," not in ex.answer and "####" not in ex.answer for ex in train + test)
    assert [ex.index for ex in test] == list(range(1319))
    assert len(load_math_dataset(gsm8k_dir / "test.jsonl", limit=5)) == 5


def test_parse_gsm8k_answer():
    assert parse_gsm8k_answer("so 1,000 + 200 = <<1000+200=1200>>1,200\n#### 1,200") == "1200"
    assert parse_gsm8k_answer("#### -5") == "-5"
    with pytest.raises(ValueError, match="####"):
        parse_gsm8k_answer("no final line")


def _check_dapo(examples):
    assert len(examples) == 2
    a, b = examples
    assert a.answer == "2" and a.data_source == "math_dapo" and a.index == 17
    assert a.problem == DAPO_RECORDS[0]["prompt"][0]["content"]
    assert a.messages == ({"role": "user", "content": a.problem},)
    assert b.answer == "\\frac{1}{2}" and b.data_source == "aime2024" and b.index == 3


def test_dapo_jsonl(tmp_path):
    path = _write_jsonl(tmp_path / "dapo.jsonl", DAPO_RECORDS)
    _check_dapo(load_math_dataset(path))
    _check_dapo(load_math_dataset(path, schema="dapo"))


def test_dapo_parquet(tmp_path):
    path = tmp_path / "dapo.parquet"
    pq.write_table(pa.Table.from_pylist(DAPO_RECORDS), path)
    _check_dapo(load_math_dataset(path))
    assert len(load_math_dataset(path, limit=1)) == 1


def test_json_array_file(tmp_path):
    path = tmp_path / "dapo.json"
    path.write_text(json.dumps(DAPO_RECORDS), encoding="utf-8")
    _check_dapo(load_math_dataset(path))


def test_problem_answer_schema(tmp_path):
    path = _write_jsonl(
        tmp_path / "pa.jsonl",
        [{"problem": "What is 2 + 2?", "answer": 4}, {"problem": "Half of 1?", "answer": "0.5", "data_source": "mine"}],
    )
    examples = load_math_dataset(path)
    assert examples == [
        MathExample(problem="What is 2 + 2?", answer="4", data_source="problem_answer", index=0),
        MathExample(problem="Half of 1?", answer="0.5", data_source="mine", index=1),
    ]


def test_missing_file(tmp_path):
    missing = tmp_path / "nope.jsonl"
    with pytest.raises(FileNotFoundError, match="nope.jsonl"):
        load_math_dataset(missing)


def test_unknown_extension(tmp_path):
    path = tmp_path / "data.csv"
    path.write_text("problem,answer\n", encoding="utf-8")
    with pytest.raises(ValueError, match=r"\.csv.*\.jsonl.*\.parquet"):
        load_math_dataset(path)


def test_unknown_schema(tmp_path):
    path = _write_jsonl(tmp_path / "x.jsonl", [{"problem": "p", "answer": "a"}])
    with pytest.raises(ValueError, match="unknown dataset schema 'mmlu'.*problem_answer"):
        load_math_dataset(path, schema="mmlu")


def test_missing_key_names_file_line_and_key(tmp_path):
    path = _write_jsonl(
        tmp_path / "broken.jsonl", [{"problem": "p", "answer": "a"}, {"problem": "q"}]
    )
    with pytest.raises(DatasetFormatError) as info:
        load_math_dataset(path)
    message = str(info.value)
    assert "broken.jsonl" in message and "line 2" in message and "'answer'" in message
    assert "required keys: ['problem', 'answer']" in message


def test_missing_nested_key_parquet(tmp_path):
    records = [dict(DAPO_RECORDS[0]), {**DAPO_RECORDS[1], "reward_model": {"style": "rule"}}]
    path = tmp_path / "bad.parquet"
    pq.write_table(pa.Table.from_pylist(records), path)
    with pytest.raises(DatasetFormatError) as info:
        load_math_dataset(path, schema="dapo")
    message = str(info.value)
    assert "bad.parquet" in message and "row 1" in message and "reward_model.ground_truth" in message


def test_wrong_explicit_schema(tmp_path):
    path = _write_jsonl(tmp_path / "pa.jsonl", [{"problem": "p", "answer": "a"}])
    with pytest.raises(DatasetFormatError, match="'question'"):
        load_math_dataset(path, schema="gsm8k")


def test_undetectable_schema(tmp_path):
    path = _write_jsonl(tmp_path / "odd.jsonl", [{"text": "hello"}])
    with pytest.raises(DatasetFormatError, match=r"odd\.jsonl.*line 1.*\['text'\]"):
        load_math_dataset(path)


def test_invalid_json_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"problem": "p", "answer": "a"}\n{not json\n', encoding="utf-8")
    with pytest.raises(DatasetFormatError, match=r"bad\.jsonl, line 2: invalid JSON"):
        load_math_dataset(path)

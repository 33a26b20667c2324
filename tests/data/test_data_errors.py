"""Data errors name the file and line, and the preflight reports them before any model build."""

import json
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
    (b'{"problem": "1+1", "answer": ""}\n' * 3, r"data\.train_path: .*train\.jsonl: 3 of 3 rows have an empty gold "
     r"answer in 'answer' \(line 1, line 2, line 3\)"),
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


def _rows(answers):
    return "".join(json.dumps({"problem": f"{i}+1", "answer": a}) + "\n" for i, a in enumerate(answers))


def _check_data(tmp_path, train, *overrides):
    from nemo_fp8.preflight import check_data

    return check_data(load_config(REPO / "examples" / "configs" / "grpo_math_tiny_fp8.yaml", [
        "data.dataset=auto", f"data.train_path={train}", f"logger.log_dir={tmp_path / 'logs'}", *overrides]))


@pytest.mark.parametrize("schema, line, field", [
    ("problem_answer", {"problem": "1+1", "answer": "  "}, "'answer'"),
    ("gsm8k", {"question": "1+1", "answer": "add them\n#### "}, "'answer' (after its '####')"),
    ("dapo", {"prompt": [{"role": "user", "content": "1+1"}], "reward_model": {"ground_truth": ""}},
     "'reward_model.ground_truth'"),
])
def test_empty_gold_answers_are_refused_naming_the_file_the_count_and_the_rows(tmp_path, schema, line, field):
    """Every gold answer empty (or whitespace): every reward would be 0 and every step skipped; the preflight
    refuses the file, with the count and the first rows, whatever the schema."""
    train = tmp_path / "train.jsonl"
    train.write_text((json.dumps(line) + "\n") * 12)
    errs = _check_data(tmp_path, train, f"data.dataset={schema}")
    assert errs == [f"data.train_path: {train}: 12 of 12 rows have an empty gold answer in {field} (line 1, line 2, "
                    "line 3, line 4, line 5, +7 more): every response to them would score 0 and train nothing. "
                    f"Valid: a non-empty answer in each row (is data.dataset's schema '{schema}' the file's?); at "
                    "most 10% of the rows may lack one, and those are dropped"], errs


def test_a_few_empty_gold_answers_are_dropped_and_named_more_are_refused(tmp_path, caplog):
    """The rule: at most 10% of the rows read may have an empty gold answer; they are dropped with a warning naming
    them. One more is refused."""
    import logging

    from nemo_fp8.data import load_math_file

    train = tmp_path / "train.jsonl"
    answers = [str(i + 1) for i in range(30)]
    answers[3] = answers[17] = answers[25] = " "  # 3 of 30: 10%
    train.write_text(_rows(answers))
    with caplog.at_level(logging.WARNING, logger="nemo_fp8.preflight"):
        assert _check_data(tmp_path, train) == []
    assert (f"preflight: data.train_path: {train}: 3 of 30 rows have an empty gold answer (line 4, line 18, line 26); "
            "dropped") in caplog.messages
    loaded = load_math_file(train)
    assert loaded.rows == 30 and loaded.empty_answer_rows == ["line 4", "line 18", "line 26"]
    assert [e.index for e in loaded.examples] == [i for i in range(30) if i not in (3, 17, 25)]
    answers[0] = ""  # 4 of 30
    train.write_text(_rows(answers))
    errs = _check_data(tmp_path, train)
    assert len(errs) == 1 and "4 of 30 rows have an empty gold answer in 'answer' (line 1, line 4, line 18, line 26)" \
        in errs[0], errs
    # the share counts the rows the run reads (data.max_train_samples), not the whole file
    assert _check_data(tmp_path, train, "data.max_train_samples=10") != []
    assert _check_data(tmp_path, train, "data.max_train_samples=1") != []


def test_a_fifo_a_socket_or_a_directory_as_data_path_is_named_as_such_without_opening_it(tmp_path):
    """They exist: "file not found" was wrong. A FIFO opened for reading would block until a writer came, so the
    check runs in a thread that must finish."""
    import os
    import socket
    import threading

    fifo, sock, folder = tmp_path / "fifo.jsonl", tmp_path / "sock.jsonl", tmp_path / "gsm8k"
    os.mkfifo(fifo)
    server = socket.socket(socket.AF_UNIX)
    server.bind(str(sock))
    folder.mkdir()
    (folder / "train.jsonl").write_text(_rows(["2"]))
    (folder / "test.jsonl").write_text(_rows(["2"]))
    valid = "valid: a regular .jsonl, .json or .parquet file"
    expect = {fifo: f"{fifo} is a FIFO (named pipe), not a data file; {valid}",
              sock: f"{sock} is a socket, not a data file; {valid}",
              folder: f"{folder} is a directory, not a data file (it holds test.jsonl, train.jsonl); {valid}"}
    found = {}
    worker = threading.Thread(target=lambda: found.update({p: _check_data(tmp_path, p) for p in expect}), daemon=True)
    worker.start()
    worker.join(30)
    server.close()
    assert not worker.is_alive(), "the data check blocked (it opened the FIFO)"
    assert found == {p: [f"data.train_path: {msg}"] for p, msg in expect.items()}, found
    with pytest.raises(ValueError, match="is a FIFO"):
        load_math_dataset(fifo)


def test_the_data_line_counts_the_rows_dropped_for_length_and_for_an_empty_answer(tmp_path, caplog):
    """A 10 MB row is dropped without being tokenized and counted with the over-long prompts; the rows dropped for
    an empty gold answer are counted too (the preflight named them)."""
    import logging
    import time

    from nemo_fp8.trainer import prepare_prompts

    from .conftest import make_char_tokenizer

    answers = [str(i + 1) for i in range(40)]
    answers[5] = answers[30] = ""
    rows = _rows(answers).splitlines()
    rows[7] = json.dumps({"problem": "9" * 10 * 2**20, "answer": "9"})
    (tmp_path / "train.jsonl").write_text("\n".join(rows) + "\n")
    (tmp_path / "val.jsonl").write_text(_rows(["2", "3", "4"]))
    cfg = load_config(REPO / "examples" / "configs" / "grpo_math_tiny_fp8.yaml", [
        "data.dataset=problem_answer", f"data.train_path={tmp_path / 'train.jsonl'}",
        f"data.val_path={tmp_path / 'val.jsonl'}", f"logger.log_dir={tmp_path / 'logs'}"])
    t0 = time.monotonic()
    with caplog.at_level(logging.INFO, logger="nemo_fp8.trainer"):
        train, val = prepare_prompts(cfg, make_char_tokenizer())
    assert time.monotonic() - t0 < 10.0
    limit = min(cfg.data.max_input_seq_length, cfg.policy.max_total_sequence_length - 1)
    assert len(train) == 37 and len(val) == 3
    assert (f"data: 37 train prompts (1 dropped > {limit} tokens; over {16 * limit} characters: not tokenized), "
            "3 validation (0 dropped); 2 rows with an empty gold answer dropped") in caplog.messages, caplog.messages

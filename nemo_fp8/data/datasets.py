"""Loading math datasets (DAPO-Math-17k / AIME-2024, GSM8K, plain problem/answer) from disk.

Supported files: JSON Lines (``.jsonl``, or ``.json`` holding one object per line or a single
JSON array of objects) and Parquet (``.parquet``, read with pyarrow). Nothing is downloaded.

Schemas (required keys; dotted keys are nested):

* ``dapo``: ``prompt`` (list of chat messages ``{"role", "content"}``) and
  ``reward_model.ground_truth``; optional ``data_source`` and ``extra_info.index``.
  This is the layout of DAPO-Math-17k and AIME-2024 as used by verl / NeMo-RL.
* ``gsm8k``: ``question`` and ``answer`` (worked solution whose last line is ``#### <final>``;
  Cobbe et al., 2021, github.com/openai/grade-school-math).
* ``problem_answer``: ``problem`` and ``answer``; optional ``data_source`` and ``index``.

``auto`` picks the schema from the keys of the first record.

A row whose gold answer is empty (or only whitespace) cannot teach anything: every response to it scores 0, its
group has no spread and the update skips it. A few such rows are dropped and counted (``LoadedDataset``); more
than ``MAX_EMPTY_ANSWER_FRACTION`` of the rows read refuses the file (``DatasetFormatError``, naming the rows).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from nemo_fp8.data.schema import MathExample
from nemo_fp8.utils.paths import files_in, special_file_kind

SchemaName = Literal["auto", "dapo", "gsm8k", "problem_answer"]

VALID_SCHEMAS: tuple[str, ...] = ("auto", "dapo", "gsm8k", "problem_answer")
VALID_EXTENSIONS: tuple[str, ...] = (".jsonl", ".json", ".parquet")

REQUIRED_KEYS: dict[str, tuple[str, ...]] = {
    "dapo": ("prompt", "reward_model.ground_truth"),
    "gsm8k": ("question", "answer"),
    "problem_answer": ("problem", "answer"),
}


#: Where each schema's gold answer comes from, for the error that finds it empty.
ANSWER_FIELDS: dict[str, str] = {
    "dapo": "'reward_model.ground_truth'",
    "gsm8k": "'answer' (after its '####')",
    "problem_answer": "'answer'",
}

#: The share of the rows read that may have an empty gold answer and still load (they are dropped, counted); more
#: refuses the file. A wrong schema or column empties every row, a scrape leaves a few empty: 10% tolerates the
#: second and stops the first, and also a file that would lose a tenth of its problems without anyone looking.
MAX_EMPTY_ANSWER_FRACTION = 0.1

#: How many of the empty rows an error or warning names (the rest are counted).
ROWS_NAMED = 5


class DatasetFormatError(ValueError):
    """A record does not follow the requested schema (names file, record and key)."""


def _iter_json_records(path: Path) -> Iterator[tuple[str, dict]]:
    """Yield ``(location, record)`` from a JSON Lines file or a JSON array file.

    Args:
        path (Path): File to read.

    Yields:
        tuple[str, dict]: ``"line N"`` (1-based) or ``"item N"`` (0-based) and the record.

    Raises:
        DatasetFormatError: On invalid JSON, a byte that is not UTF-8 (names the line) or a
            record that is not an object.
    """
    with path.open("rb") as f:
        text_start = f.read(4096).lstrip()
    if path.suffix == ".json" and text_start.startswith(b"["):
        raw = path.read_bytes()
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            line_no = raw.count(b"\n", 0, e.start) + 1
            raise DatasetFormatError(f"{path}, line {line_no}: not UTF-8 text "
                                     f"(byte 0x{raw[e.start]:02x} at offset {e.start})") from None
        try:
            items = json.loads(text)
        except json.JSONDecodeError as e:
            raise DatasetFormatError(f"{path}: invalid JSON: {e}") from e
        for i, item in enumerate(items):
            if not isinstance(item, dict):
                raise DatasetFormatError(f"{path}, item {i}: expected a JSON object, got {type(item).__name__}")
            yield f"item {i}", item
        return
    with path.open("rb") as f:
        for line_no, raw_line in enumerate(f, start=1):
            try:
                line = raw_line.decode("utf-8")
            except UnicodeDecodeError as e:
                raise DatasetFormatError(f"{path}, line {line_no}: not UTF-8 text (byte 0x{raw_line[e.start]:02x} "
                                         f"at column {e.start + 1})") from None
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise DatasetFormatError(f"{path}, line {line_no}: invalid JSON: {e}") from e
            if not isinstance(record, dict):
                raise DatasetFormatError(
                    f"{path}, line {line_no}: expected a JSON object, got {type(record).__name__}"
                )
            yield f"line {line_no}", record


def _iter_parquet_records(path: Path) -> Iterator[tuple[str, dict]]:
    """Yield ``("row N", record)`` (0-based rows) from a Parquet file, batch by batch."""
    import pyarrow.parquet as pq

    import pyarrow as pa

    try:
        pfile = pq.ParquetFile(path)
    except (pa.ArrowException, OSError) as e:
        raise DatasetFormatError(f"{path}: not a readable Parquet file ({e})") from None
    row = 0
    for batch in pfile.iter_batches(batch_size=1024):
        for record in batch.to_pylist():
            yield f"row {row}", record
            row += 1


def _get(record: dict, dotted_key: str) -> Any:
    """Return ``record[a][b]`` for ``"a.b"``; raise ``KeyError(dotted_key)`` when absent or None."""
    value: Any = record
    for part in dotted_key.split("."):
        if not isinstance(value, dict) or value.get(part) is None:
            raise KeyError(dotted_key)
        value = value[part]
    return value


def detect_schema(record: dict) -> str:
    """Guess the schema name of a record from its keys.

    Args:
        record (dict): The first record of a file.

    Returns:
        str: ``"dapo"``, ``"gsm8k"`` or ``"problem_answer"``.

    Raises:
        DatasetFormatError: When no schema matches; lists the record keys and the schemas.
    """
    keys = set(record)
    if {"prompt", "reward_model"} <= keys:
        return "dapo"
    if {"question", "answer"} <= keys:
        return "gsm8k"
    if {"problem", "answer"} <= keys:
        return "problem_answer"
    expected = "; ".join(f"{name}: {list(req)}" for name, req in REQUIRED_KEYS.items())
    raise DatasetFormatError(
        f"cannot detect the dataset schema from record keys {sorted(keys)}; expected one of {expected}"
    )


def parse_gsm8k_answer(solution: str) -> str:
    """Return the final answer of a GSM8K worked solution (text after the last ``####``).

    Thousands separators are removed ("1,000" -> "1000").

    Args:
        solution (str): The GSM8K ``answer`` field.

    Returns:
        str: The final answer.

    Raises:
        ValueError: When the solution has no ``####`` line.
    """
    if "####" not in solution:
        raise ValueError(f"GSM8K solution has no '#### <answer>' line: {solution[-200:]!r}")
    return solution.rsplit("####", 1)[1].strip().replace(",", "")


def _to_example(schema: str, record: dict, position: int, where: str) -> MathExample:
    """Convert one record to a :class:`MathExample` (``where`` is used in error messages)."""
    missing = []
    for key in REQUIRED_KEYS[schema]:
        try:
            _get(record, key)
        except KeyError:
            missing.append(key)
    if missing:
        raise DatasetFormatError(
            f"{where}: record is missing required key {missing[0]!r} for schema {schema!r} "
            f"(required keys: {list(REQUIRED_KEYS[schema])}; record keys: {sorted(record)})"
        )

    if schema == "gsm8k":
        try:
            answer = parse_gsm8k_answer(str(record["answer"]))
        except ValueError as e:
            raise DatasetFormatError(f"{where}: {e}") from e
        return MathExample(
            problem=str(record["question"]), answer=answer, data_source="gsm8k", index=position
        )

    if schema == "problem_answer":
        index = record.get("index")
        return MathExample(
            problem=str(record["problem"]),
            answer=str(record["answer"]),
            data_source=str(record.get("data_source") or "problem_answer"),
            index=int(index) if isinstance(index, int) else position,
        )

    # dapo
    prompt = record["prompt"]
    if not isinstance(prompt, (list, tuple)) or not all(
        isinstance(m, dict) and "role" in m and "content" in m for m in prompt
    ):
        raise DatasetFormatError(
            f"{where}: 'prompt' must be a list of chat messages with 'role' and 'content', got {prompt!r:.200}"
        )
    user_messages = [m for m in prompt if m["role"] == "user"]
    if not user_messages:
        raise DatasetFormatError(f"{where}: 'prompt' has no message with role 'user'")
    messages = tuple({"role": str(m["role"]), "content": str(m["content"])} for m in prompt)
    extra_info = record.get("extra_info")
    index = extra_info.get("index") if isinstance(extra_info, dict) else None
    return MathExample(
        problem=str(user_messages[-1]["content"]),
        answer=str(_get(record, "reward_model.ground_truth")),
        data_source=str(record.get("data_source") or "dapo"),
        index=int(index) if index is not None else position,
        messages=messages,
    )


@dataclass
class LoadedDataset:
    """The problems of one data file, and the rows dropped for an empty gold answer.

    Attributes:
        examples: the problems with a gold answer, in file order.
        rows: how many rows were read (up to the limit).
        empty_answer_rows: where each dropped row is (``"line 7"``, ``"item 3"``, ``"row 12"``), in file order.
    """

    examples: list[MathExample]
    rows: int
    empty_answer_rows: list[str] = field(default_factory=list)

    def dropped_note(self) -> str:
        """``"3 of 200 rows have an empty gold answer (line 4, line 9, line 17); dropped"``, or ``""`` for none."""
        if not self.empty_answer_rows:
            return ""
        return (f"{len(self.empty_answer_rows)} of {self.rows} rows have an empty gold answer "
                f"({named_rows(self.empty_answer_rows)}); dropped")


def named_rows(locations: list[str]) -> str:
    """The first ``ROWS_NAMED`` of ``locations``, ``+N more`` after them."""
    more = f", +{len(locations) - ROWS_NAMED} more" if len(locations) > ROWS_NAMED else ""
    return ", ".join(locations[:ROWS_NAMED]) + more


def check_data_file(path: Path) -> None:
    """``path`` is a regular file with a data file's extension; looked at with ``os.stat`` only (a FIFO is never
    opened: reading it would block).

    Raises:
        FileNotFoundError: nothing at ``path``.
        ValueError: a directory (naming the data files in it), a FIFO, a socket or a device; or an extension
            that is not ``VALID_EXTENSIONS``.
    """
    valid = "valid: a regular .jsonl, .json or .parquet file"
    kind = special_file_kind(path)
    if kind == "a directory":
        raise ValueError(f"{path} is a directory, not a data file{files_in(path, VALID_EXTENSIONS)}; {valid}")
    if kind is not None:
        raise ValueError(f"{path} is {kind}, not a data file; {valid}")
    if not path.is_file():
        raise FileNotFoundError(f"dataset file not found: {path}")
    suffix = path.suffix.lower()
    if suffix not in VALID_EXTENSIONS:
        raise ValueError(f"unsupported dataset file extension {suffix!r} for {path}; valid: {list(VALID_EXTENSIONS)}")


def load_math_file(path: str | Path, schema: SchemaName = "auto", limit: int | None = None) -> LoadedDataset:
    """Read a local math dataset file; rows with an empty gold answer are dropped and listed (module docstring).

    Args:
        path (str | Path): A ``.jsonl``, ``.json`` or ``.parquet`` file.
        schema (str): ``"auto"``, ``"dapo"``, ``"gsm8k"`` or ``"problem_answer"`` (see module
            docstring for the keys each needs).
        limit (int | None): Read at most this many records (``None``: all).

    Returns:
        LoadedDataset: the examples in file order, the rows read, the rows dropped.

    Raises:
        FileNotFoundError: The file does not exist (the message names it).
        ValueError: Unknown schema name or file extension (lists the valid ones), a path that is a directory, a
            FIFO, a socket or a device (names what it is), negative limit.
        DatasetFormatError: A record lacks a required key (names file, line/row, key and the
            schema's required keys), the schema cannot be detected, or more than
            ``MAX_EMPTY_ANSWER_FRACTION`` of the rows read have an empty gold answer (names the file, the count
            and the first rows).
    """
    if schema not in VALID_SCHEMAS:
        raise ValueError(f"unknown dataset schema {schema!r}; valid schemas: {list(VALID_SCHEMAS)}")
    if limit is not None and limit < 0:
        raise ValueError(f"limit must be >= 0 or None, got {limit}")
    path = Path(path)
    check_data_file(path)
    records = _iter_parquet_records(path) if path.suffix.lower() == ".parquet" else _iter_json_records(path)
    examples: list[MathExample] = []
    empty: list[str] = []
    resolved = None if schema == "auto" else schema
    rows = 0
    for position, (location, record) in enumerate(records):
        if limit is not None and position >= limit:
            break
        if resolved is None:
            try:
                resolved = detect_schema(record)
            except DatasetFormatError as e:
                raise DatasetFormatError(f"{path}, {location}: {e}") from e
        rows += 1
        example = _to_example(resolved, record, position, f"{path}, {location}")
        if example.answer.strip():
            examples.append(example)
        else:
            empty.append(location)
    if empty and len(empty) > MAX_EMPTY_ANSWER_FRACTION * rows:
        raise DatasetFormatError(
            f"{path}: {len(empty)} of {rows} rows have an empty gold answer in {ANSWER_FIELDS[resolved]} "
            f"({named_rows(empty)}): every response to them would score 0 and train nothing. Valid: a non-empty "
            f"answer in each row (is data.dataset's schema '{resolved}' the file's?); at most "
            f"{MAX_EMPTY_ANSWER_FRACTION:.0%} of the rows may lack one, and those are dropped")
    return LoadedDataset(examples, rows, empty)


def load_math_dataset(
    path: str | Path,
    schema: SchemaName = "auto",
    limit: int | None = None,
) -> list[MathExample]:
    """The examples of :func:`load_math_file` (rows with an empty gold answer dropped).

    Raises:
        FileNotFoundError, ValueError, DatasetFormatError: as :func:`load_math_file`.
    """
    return load_math_file(path, schema, limit).examples

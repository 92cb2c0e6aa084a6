"""Task datasets from Parquet, local Hugging Face datasets and mapped JSONL: the column
mapping (nested keys included), format inference, one-line errors naming file, row and
column, and the content hash a resume compares."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from typing import Any

import orjson
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from rollpoint.app.config import RunConfig
from rollpoint.envs.dataset import load_tasks, write_tasks
from rollpoint.envs.dataset_formats import (
    ColumnMap,
    DatasetSpec,
    content_sha256,
    infer_format,
    load_dataset_tasks,
    lookup,
)
from rollpoint.protocol.episode import TaskRow
from rollpoint.protocol.errors import ConfigError

VERL_COLUMNS = ColumnMap(
    task_id="extra_info.index",
    prompt="prompt",
    params={"answer": "reward_model.ground_truth", "source": "data_source"},
)


def verl_rows(n: int = 3) -> list[dict[str, Any]]:
    return [
        {
            "data_source": "openai/gsm8k",
            "prompt": [{"role": "user", "content": f"What is {i} + 1?"}],
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": str(i + 1)},
            "extra_info": {"split": "train", "index": i},
        }
        for i in range(n)
    ]


def write_parquet(path: Path, rows: list[dict[str, Any]]) -> Path:
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def load(path: Path, columns: ColumnMap | None = None, **spec: Any) -> list[TaskRow]:
    return load_dataset_tasks(DatasetSpec(path=str(path), columns=columns, **spec), "math")


def test_lookup_reads_nested_keys_and_a_dotted_column_name_wins() -> None:
    row = {"reward_model": {"ground_truth": "7"}, "a.b": 1, "a": {"b": 2}}
    assert lookup(row, "reward_model.ground_truth") == "7"
    assert lookup(row, "a.b") == 1


def test_verl_parquet_rows_map_to_task_rows(tmp_path: Path) -> None:
    path = write_parquet(tmp_path / "train.parquet", verl_rows())
    tasks = load(path, VERL_COLUMNS)
    assert tasks[2] == TaskRow(
        task_id="2",
        environment="math",
        prompt="What is 2 + 1?",
        params={"answer": "3", "source": "openai/gsm8k"},
    )


def test_task_row_shaped_parquet_needs_no_mapping(tmp_path: Path) -> None:
    rows = [
        TaskRow(task_id=f"t{i}", environment="math", prompt=f"p{i}", params={"answer": i})
        for i in range(3)
    ]
    path = write_parquet(tmp_path / "t.parquet", [r.model_dump(mode="json") for r in rows])
    assert load(path) == rows


def test_fields_left_out_default_to_row_number_run_environment_and_no_params(
    tmp_path: Path,
) -> None:
    path = write_parquet(tmp_path / "q.parquet", [{"question": "a"}, {"question": "b"}])
    tasks = load(path, ColumnMap(prompt="question"))
    assert [(t.task_id, t.environment, t.params) for t in tasks] == [
        ("row-0", "math", {}),
        ("row-1", "math", {}),
    ]


def test_a_whole_object_column_maps_to_params(tmp_path: Path) -> None:
    path = write_parquet(tmp_path / "v.parquet", verl_rows(1))
    (task,) = load(path, ColumnMap(params="reward_model"))
    assert task.params == {"style": "rule", "ground_truth": "1"}


@pytest.mark.parametrize(
    ("columns", "rows", "message"),
    [
        (
            ColumnMap(params={"answer": "reward_model.truth"}),
            verl_rows(2),
            "row 0: no column 'reward_model.truth'",
        ),
        (ColumnMap(prompt="question"), verl_rows(1), "row 0: no column 'question'"),
        (
            ColumnMap(task_id="extra_info.split"),
            verl_rows(2),
            "row 1: column 'extra_info.split': duplicate task_id 'train' (first in row 0)",
        ),
        (
            ColumnMap(prompt="ability", task_id="reward_model"),
            verl_rows(1),
            "row 0: column 'reward_model': want a string, got dict",
        ),
        (
            ColumnMap(prompt="extra_info.index"),
            verl_rows(1),
            "row 0: column 'extra_info.index': want a string or a list of chat messages, got int",
        ),
        (
            ColumnMap(task_id="data_source"),
            verl_rows(1),
            "row 0: column 'data_source': String should match pattern",
        ),
        (
            ColumnMap(params="ability"),
            verl_rows(1),
            "row 0: column 'ability': want an object, got str",
        ),
    ],
)
def test_bad_rows_are_refused_naming_file_row_and_column(
    tmp_path: Path, columns: ColumnMap, rows: list[dict[str, Any]], message: str
) -> None:
    path = write_parquet(tmp_path / "bad.parquet", rows)
    with pytest.raises(ConfigError) as caught:
        load(path, columns)
    assert str(caught.value).startswith(f"{path}: {message}")
    assert "\n" not in str(caught.value)


def test_a_chat_prompt_must_hold_one_user_message(tmp_path: Path) -> None:
    rows = verl_rows(1)
    rows[0]["prompt"] = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "hi"},
    ]
    path = write_parquet(tmp_path / "chat.parquet", rows)
    with pytest.raises(ConfigError, match=r"row 0: column 'prompt': want one user message"):
        load(path, VERL_COLUMNS)


def test_a_param_that_is_not_json_is_refused(tmp_path: Path) -> None:
    path = write_parquet(tmp_path / "b.parquet", [{"prompt": "p", "blob": b"\x00\x01"}])
    with pytest.raises(ConfigError, match=r"row 0: column 'blob': a bytes is not a JSON value"):
        load(path, ColumnMap(params={"blob": "blob"}))


@pytest.mark.parametrize(
    ("name", "expected"),
    [("a.parquet", "parquet"), ("a.PQ", "parquet"), ("a.jsonl", "jsonl"), ("a.ndjson", "jsonl")],
)
def test_format_is_inferred_from_the_name(name: str, expected: str) -> None:
    assert infer_format(name) == expected


def test_a_directory_is_a_datasets_dataset_and_an_unknown_suffix_is_refused(
    tmp_path: Path,
) -> None:
    assert infer_format(str(tmp_path)) == "hf"
    for name in ("a.csv", "a.json"):
        with pytest.raises(ConfigError, match=rf"{name}: cannot tell the dataset's format"):
            infer_format(str(tmp_path / name))


def test_the_plain_jsonl_form_reads_as_before(tmp_path: Path) -> None:
    rows = [TaskRow(task_id="a", environment="math", prompt="p", params={"x": 1})]
    write_tasks(tmp_path / "t.jsonl", rows)
    assert load_dataset_tasks(tmp_path / "t.jsonl", "math") == load_tasks(tmp_path / "t.jsonl")
    config = RunConfig.model_validate({"dataset": str(tmp_path / "t.jsonl")})
    assert config.dataset == tmp_path / "t.jsonl"
    assert config.fingerprint()["dataset"] == str(tmp_path / "t.jsonl")


def test_jsonl_with_a_mapping_reads_verl_shaped_lines(tmp_path: Path) -> None:
    path = tmp_path / "v.jsonl"
    path.write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in verl_rows(2)))
    tasks = load(path, VERL_COLUMNS)
    assert [t.params["answer"] for t in tasks] == ["1", "2"]


def test_config_takes_the_mapping_form_and_refuses_unknown_column_fields(
    tmp_path: Path,
) -> None:
    path = write_parquet(tmp_path / "v.parquet", verl_rows(1))
    config = RunConfig.model_validate(
        {"dataset": {"path": str(path), "columns": {"task_id": "extra_info.index"}}}
    )
    assert isinstance(config.dataset, DatasetSpec)
    assert config.dataset.resolved_format() == "parquet"
    with pytest.raises(ValueError, match="answer"):
        RunConfig.model_validate({"dataset": {"path": str(path), "columns": {"answer": "x"}}})


def test_content_hash_changes_when_a_file_is_edited_in_place(tmp_path: Path) -> None:
    path = write_parquet(tmp_path / "v.parquet", verl_rows())
    spec = DatasetSpec(path=str(path))
    before = content_sha256(spec)
    assert content_sha256(spec) == before
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF  # same size, same name: only the bytes differ
    path.write_bytes(bytes(data))
    assert content_sha256(spec) != before


def test_content_hash_covers_every_file_of_a_directory(tmp_path: Path) -> None:
    (tmp_path / "d" / "train").mkdir(parents=True)
    (tmp_path / "d" / "train" / "data.arrow").write_bytes(b"one")
    spec = DatasetSpec(path=str(tmp_path / "d"))
    before = content_sha256(spec)
    (tmp_path / "d" / "train" / "data.arrow").write_bytes(b"two")
    assert content_sha256(spec) != before


def test_a_jsonl_dataset_is_fingerprinted_by_content(tmp_path: Path) -> None:
    rows = [TaskRow(task_id="a", environment="math", prompt="p", params={"x": 1})]
    write_tasks(tmp_path / "t.jsonl", rows)
    config = RunConfig.model_validate({"dataset": str(tmp_path / "t.jsonl")})
    before = config.fingerprint()["dataset_content_sha256"]
    write_tasks(tmp_path / "t.jsonl", [rows[0].model_copy(update={"prompt": "q"})])
    assert config.fingerprint()["dataset_content_sha256"] != before


def test_parquet_without_its_extra_is_refused_naming_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = write_parquet(tmp_path / "v.parquet", verl_rows(1))
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "pyarrow" else real(name, *a)
    )
    with pytest.raises(ConfigError, match=r"needs the 'parquet' extra: pip install"):
        load(path)


# --- Hugging Face datasets, from local paths only --------------------------------------------


def test_a_saved_dataset_loads_from_disk_with_the_hub_off(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import datasets
    import datasets.config
    import huggingface_hub.constants

    datasets.Dataset.from_list(verl_rows()).save_to_disk(str(tmp_path / "saved"))
    # Imported already (as in a trainer's process), with the hub on: loading turns it off.
    for module, name in [
        (datasets.config, "HF_HUB_OFFLINE"),
        (datasets.config, "HF_DATASETS_OFFLINE"),
        (huggingface_hub.constants, "HF_HUB_OFFLINE"),
    ]:
        monkeypatch.setattr(module, name, False)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("HF_DATASETS_OFFLINE", raising=False)
    tasks = load(tmp_path / "saved", VERL_COLUMNS)
    assert [t.task_id for t in tasks] == ["0", "1", "2"]
    assert tasks[0].prompt == "What is 0 + 1?"
    assert datasets.config.HF_HUB_OFFLINE and huggingface_hub.constants.HF_HUB_OFFLINE
    assert datasets.config.HF_DATASETS_OFFLINE
    assert os.environ["HF_HUB_OFFLINE"] == os.environ["HF_DATASETS_OFFLINE"] == "1"


def test_a_saved_dataset_dict_takes_the_split(tmp_path: Path) -> None:
    import datasets

    datasets.DatasetDict(
        {
            "train": datasets.Dataset.from_list(verl_rows(3)),
            "test": datasets.Dataset.from_list(verl_rows(1)),
        }
    ).save_to_disk(str(tmp_path / "dd"))
    assert len(load(tmp_path / "dd", VERL_COLUMNS)) == 3
    assert len(load(tmp_path / "dd", VERL_COLUMNS, split="test")) == 1
    with pytest.raises(ConfigError, match=r"no split 'dev' \(it has test, train\)"):
        load(tmp_path / "dd", VERL_COLUMNS, split="dev")


def test_load_dataset_reads_local_data_files(tmp_path: Path) -> None:
    path = tmp_path / "rows.jsonl"
    path.write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in verl_rows(2)))
    tasks = load_dataset_tasks(
        DatasetSpec(path="json", data_files=[str(path)], columns=VERL_COLUMNS), "math"
    )
    assert [t.task_id for t in tasks] == ["0", "1"]


@pytest.mark.parametrize("reference", ["openai/gsm8k", "gsm8k"])
def test_a_reference_that_is_not_a_local_path_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, reference: str
) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError, match=rf"dataset '{reference}' is not a local path"):
        load_dataset_tasks(DatasetSpec(path=reference, format="hf"), "math")


def test_load_dataset_reads_a_local_directory_of_data_files(tmp_path: Path) -> None:
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "train.jsonl").write_bytes(
        b"".join(orjson.dumps(r) + b"\n" for r in verl_rows(2))
    )
    tasks = load(tmp_path / "data", VERL_COLUMNS)
    assert [t.params["answer"] for t in tasks] == ["1", "2"]


def test_a_missing_data_file_is_named(tmp_path: Path) -> None:
    spec = DatasetSpec(path="json", data_files=[str(tmp_path / "nope.jsonl")])
    with pytest.raises(ConfigError, match=r"json: data file .*nope\.jsonl does not exist"):
        load_dataset_tasks(spec, "math")


@pytest.mark.parametrize("content", [None, b"not parquet at all"])
def test_an_unreadable_parquet_file_is_one_line(tmp_path: Path, content: bytes | None) -> None:
    path = tmp_path / "t.parquet"
    if content is not None:
        path.write_bytes(content)
    with pytest.raises(ConfigError) as caught:
        load(path)
    assert str(caught.value).startswith(f"{path}: cannot read Parquet dataset: ")
    assert "\n" not in str(caught.value)

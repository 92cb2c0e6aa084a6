"""Task datasets the way RL teams keep them: JSONL, Parquet files and local Hugging Face datasets.

Owns :class:`DatasetSpec` (the config's ``dataset: {path, format, split, columns}``), the
column mapping from a dataset's rows to :class:`TaskRow` fields (:class:`ColumnMap`, nested
keys such as ``reward_model.ground_truth`` included), reading each format, and
:func:`content_sha256`, the hash of a dataset's bytes that a resume compares so a dataset
edited in place between a kill and the rerun is refused. The plain JSONL reader stays in
:mod:`rollpoint.envs.dataset`; the old ``dataset: tasks.jsonl`` form goes through it unchanged.

Rows are counted from 0 in errors (``row 3`` is ``dataset[3]``, as pyarrow and ``datasets``
index them); JSONL lines keep their 1-based line numbers. Nothing here reaches the Hugging
Face hub: a reference that is not a local path is refused, and the ``datasets`` path runs
with ``HF_DATASETS_OFFLINE``/``HF_HUB_OFFLINE`` set.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, Literal

import orjson
from pydantic import BaseModel, ConfigDict, JsonValue, TypeAdapter, ValidationError

from rollpoint.protocol.episode import TaskRow
from rollpoint.protocol.errors import ConfigError

Format = Literal["jsonl", "parquet", "hf"]

PACKAGED_BUILDERS = frozenset({"json", "csv", "parquet", "arrow", "text"})
"""``datasets`` builders that read local ``data_files`` (no code from the hub)."""

_HASH_CHUNK = 1 << 20
_JSON = TypeAdapter(JsonValue)


class ColumnMap(BaseModel):
    """Which column (or nested key, dotted) fills each :class:`TaskRow` field.

    A column named here must exist in every row. A field left out reads the column of its
    own name when the dataset has it, and otherwise: ``task_id`` is the row's number,
    ``environment`` the run's, ``params`` empty. ``prompt`` is a string, or a list of chat
    messages (verl's shape) holding exactly one ``user`` message, whose content it takes.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    task_id: str | None = None
    environment: str | None = None
    prompt: str = "prompt"
    params: str | dict[str, str] | None = None
    """A column holding a whole object, or ``{param name: column}``."""


class DatasetSpec(BaseModel):
    """``dataset:`` as a mapping: where the rows are, in which format, and how they map."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    path: str
    """A file or directory (Parquet file, JSONL file, a directory saved by
    ``Dataset.save_to_disk``, or one ``load_dataset`` reads), or a packaged builder name
    (``json``, ``csv``, ``parquet``, ...) with local ``data_files``."""
    format: Format | None = None
    """Inferred from the path when omitted: ``.parquet``/``.pq`` and ``.jsonl``/``.ndjson``
    files; a directory, or ``data_files``, is ``hf``."""
    split: str = "train"
    """The split of a ``datasets`` dataset dict (ignored for a single file)."""
    data_files: list[str] | None = None
    """Local files for ``load_dataset`` (``format: hf``)."""
    columns: ColumnMap | None = None

    def resolved_format(self) -> Format:
        return self.format or infer_format(self.path, self.data_files)


def infer_format(path: str, data_files: list[str] | None = None) -> Format:
    """The format a path's name or kind says, or one line saying it cannot tell."""
    p = Path(path)
    if data_files is not None or p.is_dir():
        return "hf"
    suffix = p.suffix.lower()
    if suffix in (".parquet", ".pq"):
        return "parquet"
    # Not ``.json``: that is as often one JSON array (``format: hf`` with ``data_files``).
    if suffix in (".jsonl", ".ndjson"):
        return "jsonl"
    raise ConfigError(
        f"{path}: cannot tell the dataset's format from its name; set dataset.format "
        "to jsonl, parquet or hf"
    )


# --- the column mapping ---------------------------------------------------------------------

_MISSING = object()


def lookup(row: Mapping[str, Any], column: str) -> Any:
    """``row[column]``, or a nested key ``a.b.c`` (a column whose own name holds dots wins)."""
    if column in row:
        return row[column]
    value: Any = row
    for part in column.split("."):
        if not isinstance(value, Mapping) or part not in value:
            return _MISSING
        value = value[part]
    return value


def _prompt_text(value: Any, where: str) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, list) and all(isinstance(m, Mapping) for m in value):
        users = [m for m in value if m.get("role") == "user"]
        others = sorted({str(m.get("role")) for m in value} - {"user"})
        if len(users) != 1 or others:
            raise ConfigError(
                f"{where}: want one user message (an episode opens with one), got "
                f"{len(users)} user and roles {others}"
            )
        content = users[0].get("content")
        if isinstance(content, str):
            return content
        raise ConfigError(f"{where}: the user message's content is not a string")
    raise ConfigError(
        f"{where}: want a string or a list of chat messages, got {type(value).__name__}"
    )


class RowMapper:
    """Turns one dataset row (a mapping) into a :class:`TaskRow`, one-line errors naming
    the file, the row and the column."""

    def __init__(self, source: str, columns: ColumnMap, environment: str | None) -> None:
        self.source = source
        self.columns = columns
        self.environment = environment
        self.first_row: dict[str, int] = {}

    def _get(self, row: Mapping[str, Any], column: str, number: int) -> Any:
        value = lookup(row, column)
        if value is _MISSING:
            raise ConfigError(f"{self.source}: row {number}: no column '{column}'")
        return value

    def _optional(self, row: Mapping[str, Any], named: str | None, own: str, number: int) -> Any:
        if named is not None:
            return self._get(row, named, number)
        return row.get(own, _MISSING)

    def map(self, row: Mapping[str, Any], number: int) -> TaskRow:
        cols = self.columns
        at = f"{self.source}: row {number}"
        task_id: Any = self._optional(row, cols.task_id, "task_id", number)
        if task_id is _MISSING:
            task_id = f"row-{number}"
        elif isinstance(task_id, int) and not isinstance(task_id, bool):
            task_id = str(task_id)
        environment: Any = self._optional(row, cols.environment, "environment", number)
        if environment is _MISSING:
            if self.environment is None:
                raise ConfigError(f"{at}: no column 'environment' and no run environment")
            environment = self.environment
        prompt = _prompt_text(self._get(row, cols.prompt, number), f"{at}: column '{cols.prompt}'")
        params = self._params(row, number)
        fields = {"task_id": task_id, "environment": environment}
        for name, value in fields.items():
            column = getattr(cols, name) or name
            if not isinstance(value, str):
                raise ConfigError(
                    f"{at}: column '{column}': want a string, got {type(value).__name__}"
                )
        try:
            task = TaskRow(task_id=task_id, environment=environment, prompt=prompt, params=params)
        except ValidationError as exc:
            err = exc.errors()[0]
            field = str(err["loc"][0]) if err["loc"] else "row"
            column = getattr(cols, field, None) or field
            raise ConfigError(f"{at}: column '{column}': {err['msg']}") from None
        if task.task_id in self.first_row:
            raise ConfigError(
                f"{at}: column '{cols.task_id or 'task_id'}': duplicate task_id "
                f"{task.task_id!r} (first in row {self.first_row[task.task_id]})"
            )
        self.first_row[task.task_id] = number
        return task

    def _params(self, row: Mapping[str, Any], number: int) -> dict[str, JsonValue]:
        at = f"{self.source}: row {number}"
        named = self.columns.params
        if isinstance(named, dict):
            out: dict[str, JsonValue] = {}
            for key, column in named.items():
                out[key] = self._json(self._get(row, column, number), at, column)
            return out
        value = self._optional(row, named, "params", number)
        if value is _MISSING or (value is None and named is None):
            return {}
        column = named or "params"
        if not isinstance(value, Mapping):
            raise ConfigError(
                f"{at}: column '{column}': want an object, got {type(value).__name__}"
            )
        checked = self._json(dict(value), at, column)
        assert isinstance(checked, dict)
        return checked

    @staticmethod
    def _json(value: Any, at: str, column: str) -> JsonValue:
        try:
            return _JSON.validate_python(value)
        except ValidationError:
            raise ConfigError(
                f"{at}: column '{column}': a {type(value).__name__} is not a JSON value"
            ) from None


# --- reading each format --------------------------------------------------------------------


def load_dataset_tasks(dataset: Path | DatasetSpec, environment: str | None) -> list[TaskRow]:
    """Every task of the config's ``dataset``; ``environment`` fills rows that name none.

    The plain path form (``dataset: tasks.jsonl``) reads JSONL task rows exactly as before.
    """
    from rollpoint.envs.dataset import load_tasks

    if isinstance(dataset, Path):
        return load_tasks(dataset)
    fmt = dataset.resolved_format()
    if fmt == "jsonl" and dataset.columns is None:
        return load_tasks(Path(dataset.path))
    mapper = RowMapper(dataset.path, dataset.columns or ColumnMap(), environment)
    rows = {"jsonl": _jsonl_rows, "parquet": _parquet_rows, "hf": _hf_rows}[fmt](dataset)
    tasks = [mapper.map(row, number) for number, row in enumerate(rows)]
    if not tasks:
        raise ConfigError(f"{dataset.path}: the task dataset has no rows")
    return tasks


def _jsonl_rows(spec: DatasetSpec) -> Iterator[Mapping[str, Any]]:
    path = Path(spec.path)
    try:
        lines = path.read_bytes().splitlines()
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read task dataset: {exc.strerror}") from None
    for number, line in enumerate((ln for ln in lines if ln.strip()), start=0):
        try:
            data = orjson.loads(line)
        except orjson.JSONDecodeError as exc:
            raise ConfigError(f"{path}: row {number}: not valid JSON ({exc})") from None
        if not isinstance(data, dict):
            raise ConfigError(f"{path}: row {number}: want a JSON object")
        yield data


def _parquet_rows(spec: DatasetSpec) -> Iterator[Mapping[str, Any]]:
    from rollpoint.common.extras import need

    need("parquet", "a Parquet dataset")
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        reader = pq.ParquetFile(spec.path)
    except (OSError, pa.ArrowException) as exc:
        first = (str(exc).splitlines() or [type(exc).__name__])[0]
        raise ConfigError(f"{spec.path}: cannot read Parquet dataset: {first}") from None
    for batch in reader.iter_batches(batch_size=1024):
        yield from batch.to_pylist()


def _hf_rows(spec: DatasetSpec) -> Iterator[Mapping[str, Any]]:
    from rollpoint.common.extras import need

    need("datasets", "a Hugging Face dataset")
    datasets = _offline_datasets()

    path = Path(spec.path)
    try:
        if spec.data_files is not None:
            missing = [f for f in spec.data_files if not Path(f).is_file()]
            if missing:
                raise ConfigError(f"{spec.path}: data file {missing[0]} does not exist")
            if spec.path not in PACKAGED_BUILDERS and not path.is_dir():
                raise _not_local(spec.path)
            loaded: Any = datasets.load_dataset(
                spec.path, data_files=spec.data_files, split=spec.split
            )
        elif not path.exists():
            raise _not_local(spec.path)
        elif (path / "dataset_info.json").is_file() or (path / "dataset_dict.json").is_file():
            loaded = datasets.load_from_disk(str(path))
        else:
            loaded = datasets.load_dataset(str(path), split=spec.split)
    except ConfigError:
        raise
    except Exception as exc:  # datasets raises many kinds; the user's data is at fault
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise ConfigError(f"{spec.path}: cannot load the dataset: {first}") from None
    if isinstance(loaded, datasets.DatasetDict):
        if spec.split not in loaded:
            raise ConfigError(
                f"{spec.path}: no split '{spec.split}' (it has {', '.join(sorted(loaded))})"
            )
        loaded = loaded[spec.split]
    yield from loaded


def _offline_datasets() -> Any:
    """The ``datasets`` module, with the hub off for this process: the variables are read
    when ``datasets`` and ``huggingface_hub`` are first imported, and a trainer process may
    have imported them before (then their constants are set too)."""
    os.environ["HF_DATASETS_OFFLINE"] = "1"
    os.environ["HF_HUB_OFFLINE"] = "1"
    import datasets
    import datasets.config
    import huggingface_hub.constants

    datasets.config.HF_HUB_OFFLINE = True
    datasets.config.HF_DATASETS_OFFLINE = True
    huggingface_hub.constants.HF_HUB_OFFLINE = True
    return datasets


def _not_local(reference: str) -> ConfigError:
    return ConfigError(
        f"dataset '{reference}' is not a local path: rollpoint never loads from the hub "
        "(save it with Dataset.save_to_disk, or give local data_files)"
    )


# --- the content fingerprint ----------------------------------------------------------------


def dataset_files(dataset: Path | DatasetSpec) -> list[tuple[str, Path]]:
    """The files a dataset's rows come from, each with its name within its root, in a
    fixed order."""
    if isinstance(dataset, Path):
        roots = [dataset]
    elif dataset.data_files is not None:
        roots = [Path(f) for f in dataset.data_files]
    else:
        roots = [Path(dataset.path)]
    files: list[tuple[str, Path]] = []
    for root in roots:
        if root.is_dir():
            inside = sorted(p for p in root.rglob("*") if p.is_file())
            files.extend((p.relative_to(root).as_posix(), p) for p in inside)
        else:
            files.append((root.name, root))
    return files


def content_sha256(dataset: Path | DatasetSpec) -> str:
    """SHA-256 over the dataset's files (each one's name within its root, size and bytes),
    read in 1 MiB chunks so a large Parquet file is never held in memory."""
    digest = hashlib.sha256()
    for name, file in dataset_files(dataset):
        try:
            with file.open("rb") as f:
                size = os.fstat(f.fileno()).st_size
                digest.update(f"{name}\0{size}\0".encode())
                while chunk := f.read(_HASH_CHUNK):
                    digest.update(chunk)
        except OSError as exc:
            raise ConfigError(f"{file}: cannot read task dataset: {exc.strerror}") from None
    return digest.hexdigest()


def dataset_name(dataset: Path | DatasetSpec) -> str:
    return str(dataset) if isinstance(dataset, Path) else dataset.path


def fingerprint_value(dataset: Path | DatasetSpec) -> JsonValue:
    """What the config fingerprint keeps of ``dataset`` (the plain form as before)."""
    if isinstance(dataset, Path):
        return str(dataset)
    return dataset.model_dump(mode="json", exclude_none=True)

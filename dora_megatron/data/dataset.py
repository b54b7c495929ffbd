"""Prompt datasets as verl and DAPO publish them, read with the ``datasets`` library and checked whole at load.

Why checked at load: a row the run cannot use (a missing field, a prompt longer than the trainer
takes) would otherwise stop the job when its turn comes, hours in, engines and trainer up. Every
row is read and rendered once before anything starts; a bad one is refused naming the file and
the row, or, with ``data.skip_bad_rows``, skipped and counted.

Why a pure function of the prompt number: the controller's data position is one integer, the next
prompt number ``n`` (checkpointed as ``next_prompt``, DESIGN section 13). Prompt ``n`` is row
``order(n // rows)[n % rows]``, where ``order(epoch)`` is a permutation drawn from ``data.seed`` and
the epoch alone, so a resumed run continues with the next prompt and sees every row once per
epoch, whatever happened before the checkpoint. Python's ``random`` draws it (its shuffle is
stable across Python and numpy versions, so a resume after an upgrade visits the same rows).

Row numbers in messages count from 0 within their file, as ``dataset[i]`` and pandas do.
"""

from __future__ import annotations

import glob
import logging
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence

from dora_megatron.data.codec import check_messages
from dora_megatron.data.tasks import Prompt

log = logging.getLogger(__name__)

FILE_FORMATS = {".parquet": "parquet", ".jsonl": "json", ".json": "json"}
#: Rows rendered per tokenizer call when a dataset is checked at load.
RENDER_BATCH = 512


class PromptsExhausted(IndexError):
    """Prompt ``n`` lies past the last epoch (``data.epochs``)."""


@dataclass(frozen=True)
class RowFields:
    """Where a row keeps what the run needs (``data.prompt_key``, ``data.answer_key``; dotted paths)."""

    prompt_key: str = "prompt"
    answer_key: str = "reward_model.ground_truth"
    data_source_key: str = "data_source"
    extra_info_key: str = "extra_info"


@dataclass(frozen=True)
class Row:
    """A usable row: its prompt (a string or a message list) and what the reward gets."""

    content: str | tuple[Mapping[str, Any], ...]
    answer: str
    data_source: str = ""
    extra_info: Mapping[str, Any] = field(default_factory=dict)

    def prompt(self, index: int) -> Prompt:
        if isinstance(self.content, str):
            return Prompt(index, self.content, self.answer, self.data_source, self.extra_info)
        return Prompt(index, "", self.answer, self.data_source, self.extra_info, messages=self.content)


class BadRow(ValueError):
    """A row the run cannot use; the message says which field and why."""


_MISSING = object()


def get_path(record: Mapping[str, Any], dotted: str) -> Any:
    """``record[a][b]`` for ``"a.b"`` (a key that itself contains the dots wins); ``_MISSING`` if absent."""
    if dotted in record:
        return record[dotted]
    node: Any = record
    for part in dotted.split("."):
        if not isinstance(node, Mapping) or part not in node:
            return _MISSING
        node = node[part]
    return node


def parse_row(record: Mapping[str, Any], fields: RowFields) -> Row:
    """The :class:`Row` of one dataset record, or :class:`BadRow` naming the field at fault."""
    prompt = get_path(record, fields.prompt_key)
    if prompt is _MISSING or prompt is None:
        raise BadRow(f"missing field '{fields.prompt_key}' (data.prompt_key)")
    if isinstance(prompt, str):
        if not prompt.strip():
            raise BadRow(f"'{fields.prompt_key}' is an empty string")
        content: str | tuple = prompt
    else:
        problem = check_messages(prompt)
        if problem:
            raise BadRow(f"'{fields.prompt_key}' is neither a string nor a chat message list: {problem}")
        content = tuple({k: v for k, v in m.items() if v is not None} for m in prompt)
    answer = get_path(record, fields.answer_key)
    if answer is _MISSING or answer is None:
        raise BadRow(f"missing field '{fields.answer_key}' (data.answer_key)")
    if isinstance(answer, bool) or not isinstance(answer, (str, int, float)):
        raise BadRow(f"'{fields.answer_key}' is a {type(answer).__name__}; the ground truth must be a string or a number")
    source = get_path(record, fields.data_source_key)
    source = "" if source is _MISSING or source is None else source
    if not isinstance(source, str):
        raise BadRow(f"'{fields.data_source_key}' is a {type(source).__name__}, not a string")
    extra = get_path(record, fields.extra_info_key)
    extra = {} if extra is _MISSING or extra is None else extra
    if not isinstance(extra, Mapping):
        raise BadRow(f"'{fields.extra_info_key}' is a {type(extra).__name__}, not a mapping")
    return Row(content, str(answer), source, dict(extra))


def dataset_files(path: str, key: str = "data.path") -> list[Path]:
    """The files ``data.path`` (or ``key``) names (one file, or the sorted matches of a glob); a directory is
    returned as itself (``save_to_disk``). Raises FileNotFoundError / ValueError naming ``key``."""
    p = Path(path)
    if p.is_dir():
        return [p]
    files = [Path(f) for f in sorted(glob.glob(path))] if glob.has_magic(path) else [p]
    if not files:
        raise FileNotFoundError(f"{key}: no file matches {path}")
    for f in files:
        if not f.is_file():
            raise FileNotFoundError(f"{key}: no such file {f}")
        if f.suffix not in FILE_FORMATS:
            raise ValueError(f"{key}: {f}: unknown format {f.suffix or '(no suffix)'} (valid: "
                             f"{', '.join(FILE_FORMATS)} files, a glob of them, or a datasets.save_to_disk directory)")
    kinds = {FILE_FORMATS[f.suffix] for f in files}
    if len(kinds) > 1:
        raise ValueError(f"{key}: {path} mixes {' and '.join(sorted(kinds))} files")
    return files


def read_dataset(path: str, key: str = "data.path") -> tuple[Any, list[tuple[str, int]]]:
    """The ``datasets.Dataset`` of ``data.path`` and, for naming rows, each file with its row count
    (in the dataset's order)."""
    import datasets

    files = dataset_files(path, key)
    if files[0].is_dir():
        try:
            ds = datasets.load_from_disk(str(files[0]))
        except (FileNotFoundError, ValueError) as err:
            raise ValueError(f"{key}: {files[0]} is not a directory written by datasets' save_to_disk ({err})") from err
        if isinstance(ds, datasets.DatasetDict):
            splits = list(ds)
            if len(splits) != 1:
                raise ValueError(f"{key}: {files[0]} holds the splits {', '.join(splits)}: point {key} at "
                                 "one split's directory")
            ds = ds[splits[0]]
        return ds, [(str(files[0]), len(ds))]
    kind = FILE_FORMATS[files[0].suffix]
    try:
        ds = datasets.load_dataset(kind, data_files=[str(f) for f in files], split="train")
    except Exception as err:  # noqa: BLE001 - datasets wraps the reader's error; its cause names the row
        cause = err.__cause__ or err
        raise ValueError(f"{key}: {path}: not readable as {kind} ({type(cause).__name__}: {cause})") from err
    if len(files) == 1:
        return ds, [(str(files[0]), len(ds))]
    import pyarrow.parquet as pq

    return ds, [(str(f), pq.ParquetFile(str(f)).metadata.num_rows) for f in files]


def _where(spans: Sequence[tuple[str, int]], i: int) -> str:
    for name, count in spans:
        if i < count:
            return f"{name} row {i}"
        i -= count
    return f"row {i}"


def epoch_order(rows: int, epoch: int, seed: int, shuffle: bool) -> list[int]:
    """The row order of ``epoch``: a permutation drawn from ``(seed, epoch)`` alone, or 0..rows-1."""
    order = list(range(rows))
    if shuffle:
        random.Random(f"dora-data/{seed}/{epoch}").shuffle(order)
    return order


class DatasetPromptSource:
    """Prompts from a dataset's usable rows; prompt ``n`` is row ``order(n // rows)[n % rows]``.

    ``skipped``: ``(where, why)`` of each row refused at load with ``data.skip_bad_rows``."""

    def __init__(self, dataset: Any, rows: Sequence[int], fields: RowFields, *, name: str, seed: int = 0,
                 shuffle: bool = True, epochs: int = 0, skipped: Sequence[tuple[str, str]] = (),
                 key: str = "data.path") -> None:
        if not rows:
            raise ValueError(f"{key}: {name}: no usable rows")
        self.dataset = dataset
        self.rows = list(rows)
        self.fields = fields
        self.name = name
        self.seed = seed
        self.shuffle = shuffle
        self.epochs = epochs
        self.skipped = list(skipped)
        self._order: tuple[int, list[int]] | None = None  # memo of the last epoch's order

    def __len__(self) -> int:
        return len(self.rows)

    @property
    def total(self) -> int | None:
        """Prompts the stream holds (None: endless)."""
        return len(self.rows) * self.epochs if self.epochs else None

    def identity(self) -> dict[str, Any]:
        """What prompt ``n`` depends on besides ``n``: the usable rows and the order's settings. A
        checkpoint that stores it can tell, on resume, whether ``next_prompt`` still means the same
        prompts (the same file, rows and seed)."""
        import hashlib

        digest = hashlib.sha256(",".join(map(str, self.rows)).encode()).hexdigest()[:16]
        return {"path": self.name, "rows": len(self.rows), "row_ids": digest, "seed": self.seed,
                "shuffle": self.shuffle, "epochs": self.epochs}

    def position(self, index: int) -> tuple[int, int]:
        """``(epoch, row)``: where prompt ``index`` comes from (the row numbers the dataset's)."""
        if index < 0:
            raise IndexError(f"prompt {index}: negative")
        epoch, k = divmod(index, len(self.rows))
        if self.epochs and epoch >= self.epochs:
            raise PromptsExhausted(f"prompt {index}: past the last of data.epochs={self.epochs} epochs of "
                                   f"{len(self.rows)} rows ({self.name})")
        if self._order is None or self._order[0] != epoch:
            self._order = (epoch, epoch_order(len(self.rows), epoch, self.seed, self.shuffle))
        return epoch, self.rows[self._order[1][k]]

    def get(self, index: int) -> Prompt:
        _, row = self.position(index)
        return parse_row(self.dataset[row], self.fields).prompt(index)

    @classmethod
    def load(cls, path: str, codec: Any, *, fields: RowFields = RowFields(), max_prompt_tokens: int | None = None,
             skip_bad_rows: bool = False, seed: int = 0, shuffle: bool = True, epochs: int = 0,
             key: str = "data.path") -> "DatasetPromptSource":
        """Read ``path`` and check every row: its fields (:func:`parse_row`) and its prompt rendered by
        ``codec`` (the one renderer) within ``max_prompt_tokens``. A bad row raises ValueError naming
        the file, the row and the field, unless ``skip_bad_rows`` (then it is counted in ``skipped``).
        ``key``: the config key that named ``path``, in every message (``data.path``, ``data.eval_path``)."""
        dataset, spans = read_dataset(path, key)
        good: list[tuple[int, Row]] = []
        bad: list[tuple[int, str]] = []  # (row of the dataset, why)
        for i, record in enumerate(_records(dataset)):
            try:
                good.append((i, parse_row(record, fields)))
            except BadRow as err:
                bad.append((i, str(err)))
        kept: list[int] = []
        for start in range(0, len(good), RENDER_BATCH):
            chunk = good[start:start + RENDER_BATCH]
            for (i, _), problem in zip(chunk, _render_problems(codec, [r for _, r in chunk], max_prompt_tokens)):
                if problem:
                    bad.append((i, problem))
                else:
                    kept.append(i)
        bad.sort()
        named = [(_where(spans, i), why) for i, why in bad]
        if named and not skip_bad_rows:
            more = f" (and {len(named) - 1} more)" if len(named) > 1 else ""
            raise ValueError(f"{key}: {named[0][0]}: {named[0][1]}{more}; fix the rows or set "
                             "data.skip_bad_rows: true to skip them")
        for where, why in named[:5]:
            log.warning("%s: skipped %s: %s", key, where, why)
        if named:
            log.warning("%s: skipped %d of %d rows of %s (data.skip_bad_rows)", key, len(named), len(dataset), path)
        return cls(dataset, kept, fields, name=path, seed=seed, shuffle=shuffle, epochs=epochs, skipped=named, key=key)


def _records(dataset: Any, batch: int = 1024):
    """The rows of ``dataset`` as dicts, read a batch at a time (datasets formats a batch of columns
    several times faster than as many single rows)."""
    for columns in dataset.iter(batch_size=batch):
        names = list(columns)
        for values in zip(*(columns[n] for n in names)):
            yield dict(zip(names, values))


def _render_problems(codec: Any, rows: Sequence[Row], max_tokens: int | None) -> list[str | None]:
    """Why each row's prompt cannot be sent (it does not render, or is empty or too long), or None."""
    prompts = [r.prompt(0) for r in rows]
    batch = getattr(codec, "encode_prompts", None)
    try:
        ids = batch(prompts) if batch is not None else [codec.encode_prompt(p) for p in prompts]
    except Exception:  # noqa: BLE001 - one row's failure fails the batch: find it, one prompt at a time
        ids = []
        for p in prompts:
            try:
                ids.append(codec.encode_prompt(p))
            except Exception as err:  # noqa: BLE001 - the template or the tokenizer refused this prompt
                ids.append(err)
    out: list[str | None] = []
    for got in ids:
        if isinstance(got, Exception):
            out.append(f"the prompt cannot be rendered for the model ({type(got).__name__}: {got})")
        elif not got:
            out.append("the prompt renders to no tokens")
        elif max_tokens is not None and len(got) > max_tokens:
            out.append(f"the rendered prompt is {len(got)} tokens, longer than trainer.max_seq_len - "
                       f"rollout.max_new_tokens = {max_tokens}")
        else:
            out.append(None)
    return out

"""Prompt datasets in the layouts verl and DAPO publish (Parquet, JSONL, JSON, shards, save_to_disk),
read with ``datasets``: fields by dotted path, the per-epoch shuffle as a pure function of the prompt
number (what a resume continues from), and bad rows refused at load naming the file and the row,
or skipped and counted."""

from __future__ import annotations

import json
from collections import Counter

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from dora_megatron.config.schema import load_config
from dora_megatron.data.codec import CharCodec, load_codec
from dora_megatron.data.dataset import DatasetPromptSource, PromptsExhausted, RowFields
from dora_megatron.data.sources import prompt_source


@pytest.fixture(scope="module")
def rows(own_model):
    return pq.read_table(own_model.data).to_pylist()


@pytest.fixture(scope="module")
def codec(own_model):
    return load_codec(own_model.model_dir)


def _all(source):
    return [source.get(i) for i in range(len(source))]


def test_a_dapo_parquet_row_reaches_the_prompt_whole(own_model, rows, codec):
    source = DatasetPromptSource.load(str(own_model.data), codec, shuffle=False)
    assert len(source) == len(rows) == 64
    p, row = source.get(3), rows[3]
    assert p.index == 3 and p.text == ""
    assert [dict(m) for m in p.messages] == row["prompt"] and [m["role"] for m in p.messages] == ["system", "user"]
    assert p.answer == row["reward_model"]["ground_truth"] and p.data_source == "example/arithmetic"
    assert p.extra_info == row["extra_info"] and p.extra_info["index"] == 3


def test_every_file_layout_gives_the_same_prompts(own_model, rows, codec, tmp_path):
    import datasets

    jsonl = tmp_path / "train.jsonl"
    jsonl.write_text("".join(json.dumps(r) + "\n" for r in rows))
    array = tmp_path / "train.json"
    array.write_text(json.dumps(rows))
    shards = tmp_path / "shards"
    shards.mkdir()
    pq.write_table(pa.Table.from_pylist(rows[:40]), str(shards / "train-00000-of-00002.parquet"))
    pq.write_table(pa.Table.from_pylist(rows[40:]), str(shards / "train-00001-of-00002.parquet"))
    saved = tmp_path / "saved"
    datasets.Dataset.from_list(rows).save_to_disk(str(saved))
    want = _all(DatasetPromptSource.load(str(own_model.data), codec, shuffle=False))
    for path in (jsonl, array, shards / "train-*.parquet", saved):
        got = _all(DatasetPromptSource.load(str(path), codec, shuffle=False))
        assert got == want, path


def test_fields_by_dotted_path(tmp_path):
    f = tmp_path / "d.jsonl"
    f.write_text(json.dumps({"q": {"text": "1+1?"}, "meta": {"sol": {"value": 2}}, "data_source": "s"}) + "\n")
    source = DatasetPromptSource.load(str(f), CharCodec(), fields=RowFields("q.text", "meta.sol.value"))
    p = source.get(0)
    assert (p.text, p.answer, p.data_source, p.extra_info) == ("1+1?", "2", "s", {})


def test_each_epoch_visits_every_row_once_in_its_own_order(own_model, codec):
    source = DatasetPromptSource.load(str(own_model.data), codec, seed=7)
    n = len(source)
    epochs = [[source.position(e * n + k)[1] for k in range(n)] for e in range(3)]
    assert all(sorted(e) == list(range(n)) for e in epochs)  # a permutation of all rows each epoch
    assert epochs[0] != epochs[1] != epochs[2] and epochs[0] != list(range(n))
    other = DatasetPromptSource.load(str(own_model.data), codec, seed=8)
    assert [other.position(k)[1] for k in range(n)] != epochs[0]  # data.seed draws the order


def test_prompt_n_depends_on_n_alone_so_a_resume_continues_the_epoch(own_model, codec):
    """A fresh source asked for prompt 100 first (a resumed run's next_prompt) gives what a source
    that served 0..99 gives, and the rest of the epoch holds exactly the rows not seen yet."""
    served = DatasetPromptSource.load(str(own_model.data), codec, seed=3)
    before = [served.get(i) for i in range(100)]
    resumed = DatasetPromptSource.load(str(own_model.data), codec, seed=3)
    after = [resumed.get(i) for i in range(100, 128)]
    assert after == [served.get(i) for i in range(100, 128)]
    assert resumed.identity() == served.identity()  # what a checkpoint may store to check the resume
    n = len(served)
    seen = Counter(p.extra_info["index"] for p in before[n:] + after)  # epoch 1: prompts 64..127
    assert sorted(seen) == list(range(n)) and set(seen.values()) == {1}


def test_a_finite_number_of_epochs_ends_the_stream(own_model, codec):
    source = DatasetPromptSource.load(str(own_model.data), codec, epochs=2, shuffle=False)
    assert source.total == 128 and source.get(127).extra_info["index"] == 63
    with pytest.raises(PromptsExhausted, match="past the last of data.epochs=2 epochs of 64 rows"):
        source.get(128)
    cfg = load_config(None, ["data.task=dataset", f"data.path={own_model.data}", "data.epochs=1", "run.steps=20",
                             "orchestrator.tbs=8", f"model.path={own_model.model_dir}"])
    with pytest.raises(ValueError, match=r"data.epochs: 1 epoch\(s\) of 64 usable rows are 64 prompts; "
                                         r"run.steps=20 x orchestrator.tbs=8 needs at least 160"):
        prompt_source(cfg, codec)


def _bad_rows(tmp_path):
    good = {"prompt": [{"role": "user", "content": "What is 1 + 1?"}], "reward_model": {"ground_truth": "2"}}
    rows = [good,
            {"reward_model": {"ground_truth": "2"}},                                        # 1: no prompt
            {"prompt": [{"role": "user"}], "reward_model": {"ground_truth": "2"}},          # 2: message without content
            {"prompt": "x", "reward_model": {"ground_truth": ["2", "two"]}},                # 3: a list as ground truth
            {"prompt": "y" * 400, "reward_model": {"ground_truth": "2"}},                   # 4: too long
            {"prompt": "z", "reward_model": {"ground_truth": "1"}, "extra_info": "oops"},   # 5: extra_info not a mapping
            good]
    f = tmp_path / "rows.jsonl"
    f.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return f


def test_a_bad_row_is_refused_at_load_naming_the_file_row_and_field(tmp_path, codec):
    f = _bad_rows(tmp_path)
    with pytest.raises(ValueError) as err:
        DatasetPromptSource.load(str(f), codec, max_prompt_tokens=100)
    assert str(err.value) == (f"data.path: {f} row 1: missing field 'prompt' (data.prompt_key) (and 4 more); fix the "
                              "rows or set data.skip_bad_rows: true to skip them")


def test_skip_bad_rows_skips_and_counts_each_with_its_reason(tmp_path, codec):
    f = _bad_rows(tmp_path)
    source = DatasetPromptSource.load(str(f), codec, max_prompt_tokens=100, skip_bad_rows=True)
    assert len(source) == 2 and source.rows == [0, 6]
    reasons = dict(source.skipped)
    assert list(reasons) == [f"{f} row {i}" for i in (1, 2, 3, 4, 5)]
    assert reasons[f"{f} row 2"] == "'prompt' is neither a string nor a chat message list: message 0: 'content' is missing, not a string"
    assert "the ground truth must be a string or a number" in reasons[f"{f} row 3"]
    assert reasons[f"{f} row 4"].startswith("the rendered prompt is ") and reasons[f"{f} row 4"].endswith(
        "tokens, longer than trainer.max_seq_len - rollout.max_new_tokens = 100")
    assert reasons[f"{f} row 5"] == "'extra_info' is a str, not a mapping"
    assert {source.get(i).answer for i in range(10)} == {"2"}  # only the good rows are ever served


def test_a_bad_shard_row_is_named_in_its_own_file(tmp_path, rows, codec):
    a, b = tmp_path / "part-0.parquet", tmp_path / "part-1.parquet"
    pq.write_table(pa.Table.from_pylist(rows[:10]), str(a))
    broken = [dict(r) for r in rows[10:20]]
    broken[4] = {**broken[4], "reward_model": {"style": "rule", "ground_truth": None}}
    pq.write_table(pa.Table.from_pylist(broken), str(b))
    with pytest.raises(ValueError, match=rf"data.path: {b} row 4: missing field 'reward_model.ground_truth'"):
        DatasetPromptSource.load(str(tmp_path / "part-*.parquet"), codec)


def test_unreadable_or_missing_data_is_named(tmp_path, codec):
    broken = tmp_path / "broken.jsonl"
    broken.write_text(json.dumps({"prompt": "a", "answer": "1"}) + "\n{oops\n")
    with pytest.raises(ValueError, match=rf"data.path: {broken}: not readable as json \(ArrowInvalid: JSON parse error"):
        DatasetPromptSource.load(str(broken), codec)
    with pytest.raises(FileNotFoundError, match="data.path: no file matches"):
        DatasetPromptSource.load(str(tmp_path / "none-*.parquet"), codec)
    with pytest.raises(FileNotFoundError, match="data.path: no such file"):
        DatasetPromptSource.load(str(tmp_path / "none.parquet"), codec)
    csv = tmp_path / "d.csv"
    csv.write_text("prompt,answer\n")
    with pytest.raises(ValueError, match=r"unknown format \.csv"):
        DatasetPromptSource.load(str(csv), codec)


def test_a_saved_dataset_dict_must_name_its_split(tmp_path, rows, codec):
    import datasets

    d = datasets.DatasetDict({"train": datasets.Dataset.from_list(rows[:4]), "test": datasets.Dataset.from_list(rows[4:8])})
    d.save_to_disk(str(tmp_path / "dd"))
    with pytest.raises(ValueError, match="holds the splits train, test: point data.path at one split's directory"):
        DatasetPromptSource.load(str(tmp_path / "dd"), codec)
    assert len(DatasetPromptSource.load(str(tmp_path / "dd" / "test"), codec)) == 4


def test_the_eval_set_is_every_usable_row_once_named_by_its_own_key(tmp_path, rows, codec, own_model):
    """``data.eval_path``: the training loader on another file, every row once in file order (no
    shuffle, no epochs); its errors name ``data.eval_path``, and ``data.skip_bad_rows`` applies."""
    from dora_megatron.data.sources import eval_prompts

    ev = tmp_path / "eval.parquet"
    pq.write_table(pa.Table.from_pylist(rows[:5]), str(ev))
    base = ["data.task=dataset", f"data.path={tmp_path / 'eval.parquet'}", "model.warm_start="]
    assert eval_prompts(load_config(None, base), codec) is None
    prompts = eval_prompts(load_config(None, [*base, f"data.eval_path={ev}"]), codec)
    assert [p.extra_info["index"] for p in prompts] == [r["extra_info"]["index"] for r in rows[:5]]
    assert [p.messages for p in prompts] == [tuple(r["prompt"]) for r in rows[:5]]
    bad = _bad_rows(tmp_path)
    with pytest.raises(ValueError, match=rf"^data.eval_path: {bad} row 1: missing field 'prompt'"):
        eval_prompts(load_config(None, [*base, f"data.eval_path={bad}"]), codec)
    kept = eval_prompts(load_config(None, [*base, f"data.eval_path={bad}", "data.skip_bad_rows=true"]), codec)
    assert [p.answer for p in kept] == ["2", "2", "2"]  # rows 0, 4 (the default limit takes it) and 6
    with pytest.raises(FileNotFoundError, match="data.eval_path: no such file"):
        eval_prompts(load_config(None, [*base, f"data.eval_path={tmp_path / 'none.parquet'}"]), codec)
    # refused before any process starts, as a bad data.path row is
    from dora_megatron.launch.inputs import input_problem

    cfg = load_config(None, [*base, f"model.path={own_model.model_dir}", f"data.eval_path={bad}"])
    assert input_problem(cfg).startswith(f"data.eval_path: {bad} row 1: missing field 'prompt'")

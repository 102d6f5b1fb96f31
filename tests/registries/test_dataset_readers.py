"""Readers: every file type, folders, sampling, and the source file/row kept on every row."""

import json

import pyarrow as pa
import pyarrow.feather as feather
import pyarrow.parquet as pq
import pytest

from registries.datasets import DataConfigError, align_rows, get_dataset_attrs, read_rows, read_table

ROWS = [{"instruction": f"q{i}", "output": f"a{i}"} for i in range(1, 6)]


@pytest.fixture
def data_dir(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "data").mkdir()
    return tmp_path / "data"


def attr_for(data_dir, file_name, **entry):
    (data_dir / "dataset_info.json").write_text(json.dumps({"my": {"file_name": file_name, **entry}}))
    return get_dataset_attrs(["my"], "data")[0]


def records(rows):
    return [json.loads(r["_raw"]) for r in rows]


def sources(rows):
    return [(r["_source_file"], r["_source_row"]) for r in rows]


def test_json_list(data_dir):
    (data_dir / "my.json").write_text(json.dumps(ROWS, indent=2))
    rows = read_rows(attr_for(data_dir, "my.json"))
    assert records(rows) == ROWS
    assert sources(rows) == [("data/my.json", i) for i in range(1, 6)]


def test_json_lines_inside_a_json_file(data_dir):
    (data_dir / "my.json").write_text("".join(json.dumps(r) + "\n" for r in ROWS[:2]))
    assert records(read_rows(attr_for(data_dir, "my.json"))) == ROWS[:2]


def test_jsonl_rows_are_numbered_by_line(data_dir):
    (data_dir / "my.jsonl").write_text(json.dumps(ROWS[0]) + "\n\n" + json.dumps(ROWS[1]) + "\n")
    rows = read_rows(attr_for(data_dir, "my.jsonl"))
    assert records(rows) == ROWS[:2]
    assert sources(rows) == [("data/my.jsonl", 1), ("data/my.jsonl", 3)]


def test_csv_cells_stay_strings(data_dir):
    (data_dir / "my.csv").write_text('instruction,output\n"What is 1+2?",3\n"a, quoted ""cell""",x\n')
    rows = read_rows(attr_for(data_dir, "my.csv"))
    assert records(rows) == [{"instruction": "What is 1+2?", "output": "3"}, {"instruction": 'a, quoted "cell"', "output": "x"}]
    assert sources(rows) == [("data/my.csv", 1), ("data/my.csv", 2)]


def test_parquet(data_dir):
    pq.write_table(pa.Table.from_pylist(ROWS), data_dir / "my.parquet")
    rows = read_rows(attr_for(data_dir, "my.parquet"))
    assert records(rows) == ROWS and sources(rows)[-1] == ("data/my.parquet", 5)


def test_arrow_file_format(data_dir):
    feather.write_feather(pa.Table.from_pylist(ROWS), data_dir / "my.arrow")
    assert records(read_rows(attr_for(data_dir, "my.arrow"))) == ROWS


def test_arrow_stream_format_as_written_by_datasets(data_dir):
    table = pa.Table.from_pylist(ROWS)
    with pa.OSFile(str(data_dir / "my.arrow"), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    assert records(read_rows(attr_for(data_dir, "my.arrow"))) == ROWS


def test_txt_one_text_per_line_fills_the_prompt_column(data_dir):
    (data_dir / "my.txt").write_text("first line\n\n  \nsecond line\n")
    attr = attr_for(data_dir, "my.txt", columns={"prompt": "text"})
    rows = read_rows(attr)
    assert records(rows) == [{"text": "first line"}, {"text": "second line"}]
    assert sources(rows) == [("data/my.txt", 1), ("data/my.txt", 4)]
    assert [e["_prompt"] for e in align_rows(rows, attr).examples] == [
        [{"role": "user", "content": "first line"}],
        [{"role": "user", "content": "second line"}],
    ]


def test_folder_of_files_read_in_name_order(data_dir):
    (data_dir / "shards").mkdir()
    (data_dir / "shards" / "b.jsonl").write_text(json.dumps(ROWS[1]) + "\n")
    (data_dir / "shards" / "a.jsonl").write_text(json.dumps(ROWS[0]) + "\n")
    (data_dir / "shards" / ".hidden.txt").write_text("ignored")
    rows = read_rows(attr_for(data_dir, "shards"))
    assert sources(rows) == [("data/shards/a.jsonl", 1), ("data/shards/b.jsonl", 1)]


def test_max_samples_keeps_the_first_rows(data_dir):
    (data_dir / "my.json").write_text(json.dumps(ROWS))
    assert [r["_source_row"] for r in read_rows(attr_for(data_dir, "my.json"), max_samples=2)] == [1, 2]


def test_num_samples_is_a_seeded_subset(data_dir):
    (data_dir / "my.json").write_text(json.dumps(ROWS))
    attr = attr_for(data_dir, "my.json", num_samples=3)
    picked = [r["_source_row"] for r in read_rows(attr, seed=7)]
    assert picked == [r["_source_row"] for r in read_rows(attr, seed=7)]
    assert len(picked) == len(set(picked)) == 3
    assert picked != [r["_source_row"] for r in read_rows(attr, seed=8)]


def test_num_samples_above_size_takes_every_row_then_repeats(data_dir):
    (data_dir / "my.json").write_text(json.dumps(ROWS))
    picked = [r["_source_row"] for r in read_rows(attr_for(data_dir, "my.json", num_samples=12), seed=1)]
    assert len(picked) == 12 and set(picked[:5]) == {1, 2, 3, 4, 5}


def test_num_samples_then_max_samples(data_dir):
    (data_dir / "my.json").write_text(json.dumps(ROWS))
    attr = attr_for(data_dir, "my.json", num_samples=4)
    assert read_rows(attr, max_samples=2, seed=3) == read_rows(attr, seed=3)[:2]


def test_read_table_has_fixed_columns_even_for_mixed_types(data_dir):
    # "output" is a string in one row and a list in another: the table still builds.
    (data_dir / "my.json").write_text(json.dumps([ROWS[0], {"instruction": "q", "output": ["a"]}]))
    table = read_table(attr_for(data_dir, "my.json"))
    assert table.column_names == ["_raw", "_source_file", "_source_row"]
    assert str(table.schema) == "_raw: string\n_source_file: string\n_source_row: int64"
    assert table.column("_source_row").to_pylist() == [1, 2]


# ---------------------------------------------------------------- errors
def test_error_file_not_found(data_dir):
    with pytest.raises(DataConfigError) as err:
        read_rows(attr_for(data_dir, "nope.json"))
    assert str(err.value).startswith(
        "Dataset 'my': file data/nope.json not found (file_name in data/dataset_info.json is relative to dataset_dir)."
    )


def test_error_unsupported_file_type(data_dir):
    (data_dir / "my.xlsx").write_text("x")
    with pytest.raises(DataConfigError, match=r"^Dataset 'my': cannot read data/my.xlsx: unsupported file type .xlsx. Supported: .json, .jsonl"):
        read_rows(attr_for(data_dir, "my.xlsx"))


def test_error_folder_mixes_types(data_dir):
    (data_dir / "mixed").mkdir()
    (data_dir / "mixed" / "a.json").write_text("[]")
    (data_dir / "mixed" / "b.csv").write_text("x\n")
    with pytest.raises(DataConfigError, match=r"^Dataset 'my': folder data/mixed mixes file types \(csv, json\)"):
        read_rows(attr_for(data_dir, "mixed"))


def test_error_empty_folder(data_dir):
    (data_dir / "empty").mkdir()
    with pytest.raises(DataConfigError, match=r"folder data/empty \(file_name in data/dataset_info.json\) has no files"):
        read_rows(attr_for(data_dir, "empty"))


def test_error_json_object_instead_of_list(data_dir):
    (data_dir / "my.json").write_text('{"data": []}')
    with pytest.raises(DataConfigError, match=r"^Dataset 'my': data/my.json holds a JSON object; expected a JSON list of rows"):
        read_rows(attr_for(data_dir, "my.json"))


def test_error_broken_json_file(data_dir):
    (data_dir / "my.json").write_text('[{"instruction": "q",\n "output": }]')
    with pytest.raises(DataConfigError, match=r"^Dataset 'my': data/my.json is not valid JSON: Expecting value at line 2, column 12\.$"):
        read_rows(attr_for(data_dir, "my.json"))

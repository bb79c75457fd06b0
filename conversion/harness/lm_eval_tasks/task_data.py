"""Data loader of the offline lm-evaluation-harness tasks in this folder.

The YAML files next to this one name it as `custom_dataset: !function task_data.load_jsonl` with
`dataset_kwargs: {data_file: <file>.jsonl}`; the harness calls it with the task's metadata and dataset_kwargs.
A relative `data_file` is read from this folder (not from the current directory), so the folder works wherever it
lies, through `expertize eval` and through the harness's own CLI (`lm_eval --include_path THIS_FOLDER`) alike.

Imports only the standard library and `datasets`: the folder must work without expertize installed.
"""

import json
from pathlib import Path

import datasets


def load_jsonl(data_file: str, split: str = "test", **_metadata) -> datasets.DatasetDict:
    """One split holding the rows of a JSON-lines file (one JSON object per non-empty line)."""
    path = Path(data_file)
    if not path.is_absolute():
        path = Path(__file__).parent / path
    if not path.is_file():
        raise FileNotFoundError(f"task data file {path} does not exist; regenerate the task folder")
    with path.open(encoding="utf-8") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    if not rows:
        raise ValueError(f"task data file {path} holds no rows")
    return datasets.DatasetDict({split: datasets.Dataset.from_list(rows)})

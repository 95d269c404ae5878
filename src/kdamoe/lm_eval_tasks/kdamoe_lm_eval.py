"""Dataset loader of the local lm-evaluation-harness task `kdamoe_pycloze` (referenced by its yaml)."""

import json
from pathlib import Path

import datasets

ITEMS = Path(__file__).with_name("kdamoe_pycloze.jsonl")


def load_pycloze(**kwargs) -> datasets.DatasetDict:
    """The task's items as a `test` split (`context`, `choices`, `answer`); lm_eval's metadata kwargs are unused."""
    rows = [json.loads(line) for line in ITEMS.read_text(encoding="utf-8").splitlines() if line.strip()]
    return datasets.DatasetDict({"test": datasets.Dataset.from_list(rows)})

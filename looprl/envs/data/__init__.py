"""A data file as an environment (`dataset.py`): its rows read by `data_files.py` and checked
by `dataset_rows.py`, scored by the scorers of `scorers.py` (their types `score_types.py`) and
the LLM judge (`judge.py`)."""

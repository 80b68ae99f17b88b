"""The built-in environments: tic-tac-toe (`tictactoe.py`, its board `tictactoe_board.py`),
extraction (`extraction.py`, its documents `extraction_docs.py`), workflow (`workflow.py`, its
shop `workflow_db.py`) and instructions (`instructions.py`, its rules `instruction_checks.py`)."""

"""`python -m looprl.cli ...` runs the command line, as `python -m looprl` does."""

from looprl.cli import main

main()

"""`python -m looprl ...` runs the command line (as `torchrun -m looprl` will)."""

from looprl.cli import app

if __name__ == "__main__":
    app()

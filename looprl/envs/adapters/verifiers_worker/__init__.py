"""The worker process of the `verifiers:` environment (envs/adapters/verifiers_env.py): run
with the Python of verifiers' own environment (`make setup-verifiers`), never imported by looprl.
Its modules import nothing from looprl."""

"""The operator↔pod contract: data both sides read and write, importing only pydantic.

`pd_operator` (the operator) and `pd_transfer` (the in-pod transfer module and agent) both
import this package and never each other; it imports neither (import-linter contracts in
`pyproject.toml`). See README.md for each module's job.
"""

from .cli_helpers import tiny_job  # noqa: F401  (fixture)

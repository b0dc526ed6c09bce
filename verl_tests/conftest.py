"""verl tier (``make test-verl``, its own venv .venv-verl): python_tests' Megatron harness on sys.path."""

import verl_util  # noqa: F401  (puts python_tests on sys.path)

"""Unit tests: one process and no peers. A unit test starts no process (tests/conftest.py)."""

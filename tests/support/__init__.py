"""What the tests share and that is no test: the rank functions child processes import by module
path (``tests.support.zero_ranks``), process helpers, the rank-device wrapper, and the helpers
that the tier modules split from one topic share (``tests/support/export.py``, ...)."""

"""The runner: the ``gradsync`` command (``cli``), what it starts on every rank (``worker``,
which runs the user's script or the built-in workloads' ``train``), ``compare``, the run's
settings (``config``) and its directory (``rundir``). Nothing in the library imports it: it is
the top of the house (docs/architecture.md)."""

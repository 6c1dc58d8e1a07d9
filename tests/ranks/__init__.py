"""Multi-rank tests: gloo ranks as processes or threads (gradsync.testing.run_ranks)."""

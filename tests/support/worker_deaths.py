"""What tests/*/test_worker_deaths*.py share: torch's wording of a failed worker."""

from __future__ import annotations

# torch's wording (MultiprocessContext._poll), as the agent logs it
TORCH_FORMAT = "failed (exitcode: %s) local_rank: %s (pid: %s) of fn: %s (start_method: %s)"

"""Imported last by the workers' forkserver (``gradsync.forkserver.PRELOAD``): moves every object
imported so far out of the garbage collector's reach (``gc.freeze``) before anything is forked.

Why: a forked worker shares the server's memory page by page until it writes to a page. The
collector writes to every object it examines, so without this each worker's collections copied
the pages of torch's objects one by one and scanned them again and again. On ``charlm`` under
``async`` (2 workers and a server on 2 cores), forked workers computed 1.5-2.5 ms slower a step
than spawned ones without the freeze, and alike with it (3 and 7 alternating pairs of runs).
Python's documentation of ``gc.freeze`` recommends exactly this before a fork.
"""

from __future__ import annotations

import gc

gc.freeze()

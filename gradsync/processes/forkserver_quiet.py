"""Imported first by the workers' forkserver (``gradsync.processes.forkserver.PRELOAD``): a
Ctrl-C while the server imports torch is ignored there, not printed as a traceback.

Why: a Ctrl-C reaches every process of the terminal's process group, the forkserver among them.
Python's forkserver ignores SIGINT ("protect the process from ^C") only once its imports are
done, and they take a second or two (torch, torch._dynamo): a Ctrl-C in that window printed a
``KeyboardInterrupt`` traceback from deep inside an import (3 of 4 tries of a user tester's at
2-3 s into a run) beside the launcher's one-line stop. The launcher stops the run either way,
and the server ends with it. ``gradsync.processes.forkserver_ready``, imported last, puts
Python's own handler back, so that the server records it as the handler its workers get.
"""

from __future__ import annotations

import signal

signal.signal(signal.SIGINT, signal.SIG_IGN)

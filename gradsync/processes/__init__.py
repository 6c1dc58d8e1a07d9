"""Process plumbing: torch's elastic agent as gradsync starts it (``launch``), the loopback
stores (``stores``), the forkserver workers are forked from (``forkserver``,
``forkserver_ready``), the reaper of stopped workers (``reaper``) and how a worker's death is
told (``worker_deaths``). It imports only top-level modules (``compat``, ``errors``)."""

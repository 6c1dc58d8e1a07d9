"""The checks around a step: the hang diagnosis that names who a wait is stuck on
(``diagnose``), the gate that waits for every rank to be back from its own code before a
collective (``gate``), and the non-finite and replica-divergence checks (``guards``)."""

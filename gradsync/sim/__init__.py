"""The simulator: strategies' cost predicted instead of run (pure Python and numpy).

``model`` holds the alpha-beta collective costs and the fit (and the two-level all-reduce);
``simulate`` the per-strategy simulation; ``streaming`` streaming DiLoCo's fragments and
timeline; ``calibrate`` the prediction of a real run from its telemetry; ``failures`` the
goodput of restart-from-checkpoint against live membership under failures. Nothing here
starts a process or touches torch.distributed, except ``bench`` (imported on demand).
"""

from __future__ import annotations

from gradsync.sim.calibrate import (
    Prediction,
    RunProfile,
    WhatIf,
    load_calibration,
    load_profile,
    predict,
    save_calibration,
)
from gradsync.sim.config import CommModel, ComputeModel, Hosts, SimStrategy, parse_sim_strategy
from gradsync.sim.model import (
    ALGORITHMS,
    OPS,
    AlphaBeta,
    Fit,
    algbw,
    busbw,
    collective_time,
    cost_terms,
    fit_alpha_beta,
)
from gradsync.sim.simulate import Overlap, SimResult, overlap_summary, simulate

__all__ = [
    "ALGORITHMS",
    "OPS",
    "AlphaBeta",
    "CommModel",
    "ComputeModel",
    "Fit",
    "Hosts",
    "Overlap",
    "Prediction",
    "RunProfile",
    "SimResult",
    "SimStrategy",
    "Strategy",
    "WhatIf",
    "algbw",
    "busbw",
    "collective_time",
    "cost_terms",
    "fit_alpha_beta",
    "load_calibration",
    "load_profile",
    "overlap_summary",
    "parse_sim_strategy",
    "parse_strategy",
    "predict",
    "save_calibration",
    "simulate",
]

#: The names these had before ``SimStrategy`` / ``parse_sim_strategy`` (they collided with
#: ``gradsync.Strategy`` / ``gradsync.parse_strategy``, the live strategies): kept so that
#: scripts written against them go on working.
Strategy = SimStrategy
parse_strategy = parse_sim_strategy

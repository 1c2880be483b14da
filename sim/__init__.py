"""A discrete-event fleet simulator that runs warmloop's own pure policies.

Engines with a block-level prefix cache (LRU), a KV pool and continuous batching whose
step time follows an ``EngineCalibration``; a Temporal-like layer that runs each job's
step sequence (model step, tool pause, approval wait) and asks the very policy modules
the workers run: ``workflows/routing.py`` (``choose_engine``), ``workflows/holding.py``
(``decide_hold``), ``workflows/lanes.py`` (batch admission) and ``workflows/budgets.py``.
Nothing in ``sim/`` re-implements a policy (``tests/unit/test_sim_policies.py`` checks).
"""

import os as _os
from pathlib import Path as _Path

COMPILED = False
"""Whether ``sim/core.py``, ``engine.py`` and ``fleet.py`` run compiled in this process
(``WARMLOOP_SIM_COMPILED``: see ``warmloop.sim.compiled``)."""
if _build := _os.environ.get("WARMLOOP_SIM_COMPILED"):
    from warmloop.sim import compiled as _compiled

    COMPILED = _compiled.activate(_Path(_build), __path__)

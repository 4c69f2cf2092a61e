"""Putting the parts together on one box: a prepared run driven by its coordinator.

The coordinator built from a prepared folder and its manifest (``factory``, ``manifest``), the
local run with in-process peers (``local.LocalRun``: the one place where the coordinator and the
peer meet outside the protocols), evaluation and early stopping (``evaluate``), the dense and
DiLoCo baselines (``baseline``), the metrics log, and using a finished run: export and
generation (``export``, ``generate``). This is what ``dipaco demo`` and ``dipaco-coordinator
start`` drive; everything it keeps lives in the run folder, so stopping at any point and starting
again continues the run.
"""

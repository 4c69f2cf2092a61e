"""Capacity planning by simulation: the real coordinator code (one scheduler and K module owners)
under a virtual clock, with thousands of simulated peers over simulated links.

``events`` is the discrete-event loop and its queues (a CPU, a NIC direction); ``costs`` the
virtual sizes and speeds (a 150 M-parameter path, int8 deltas, GPUs, links, churn); ``cluster``
builds the real coordinators and times every real request; ``peers`` the peers' protocol as a
state machine; ``simulate`` runs one configuration and says where its first bottleneck is.
It lives with its command, ``bench/simulate.py``, and its tests (``tests/integration/
test_simulator.py``, ``tests/unit/test_sim_events.py``), which put ``bench/`` on the path.
"""

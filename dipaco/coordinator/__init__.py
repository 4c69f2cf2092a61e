"""The live service (floor 2): the coordinator's operations over its state (core.py, base.py), the
bytes layer (service.py), admission of deltas, rounds and quorum, ownership, saved state, routing
phases and status; the module store and the outer step; the scheduler; validation; access;
tickets; module owners and gathering a run. It imports no peer, preparation or transport."""

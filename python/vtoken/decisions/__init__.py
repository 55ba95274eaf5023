"""Eviction decisions on the device, applied on the host one step late.

``loop`` (DecisionLoop) runs the eviction policy for the whole batch with a
fixed number of torch launches and no host sync, using the policies' device
state (``vtoken.policies.device``); it kills the victims in the device mirror
and ships them in a ``victim_ring`` record, which the host reads only after
its event completed and applies to the token table. It builds on
bookkeeping, device and policies; the engine and the integrations drive it.
"""

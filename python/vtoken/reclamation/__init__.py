"""Reclamation: lazy request-local compaction of partly dead KV blocks.

``manager`` (ReclamationManager) runs it once per step: ``trigger`` decides
when and for which requests (pool pressure, ``config``'s thresholds),
``planner`` and ``hole_planner`` plan the moves of live tokens into fresh
blocks or into holes of the request's own blocks, ``checks`` gates the plans
(I4) and their content (I1) in debug runs, and ``executor`` carries each plan
from reservation through the device copy to the commit in the token table.
It builds on bookkeeping and device; the engine and the integrations drive it.
"""

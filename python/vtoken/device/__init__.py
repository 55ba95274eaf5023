"""Device side: the kernels' entry points and the device state that feeds them.

``ops`` is the one door to the kernels (CUDA extension, Triton, or the torch
reference, chosen per call); ``buffers`` holds the persistent slot-list
buffers and the device mirror of the token table, fed by the bookkeeping's
journal deltas; ``copy_engine`` runs relocation copies on their own stream,
ordered against the forward by events, never by a host wait; ``step_graphs``
captures decode steps as CUDA graphs; ``kv_fingerprint`` reads K/V rows back
for the content invariant (I1) in debug checks. It imports vtoken's top level and
``vtoken.reference`` (the kernels' CPU oracles), never reclamation, decisions,
the engine or the integrations.
"""

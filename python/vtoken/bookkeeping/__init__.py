"""Host bookkeeping: which KV slot holds which token, in numpy on the host, no torch.

The token table (``table``) maps each request's live tokens to slots of paged
KV blocks. It is built from the block pool (``pool``), the block ledger of
states and reference counts (``ledger``), the segment arena of per-request
block rows (``arena``, ``request_rows``), the block-list store the table
reads and writes (``block_lists``), prefix blocks shared between
requests (``shared_blocks``), the state transitions of a relocation
(``relocation``) and the delta journal that tells the device mirror what
changed (``journal``). ``invariants`` checks the mapping (I2) and relocation
plans (I4). This package imports only vtoken's top-level modules; every other
package builds on it.
"""

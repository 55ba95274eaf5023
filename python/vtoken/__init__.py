"""vtoken: token-level KV virtualization for paged LLM serving.

One subpackage per component, importing one way (docs/architecture.md §8):
``vtoken.bookkeeping`` (the host's token table, numpy only, importable
without torch) <- ``vtoken.device`` (the kernels' door ``vtoken.device.ops``,
device buffers and mirror, copy engine) <- ``vtoken.reclamation`` (lazy
compaction) and ``vtoken.decisions`` (eviction on the device, with
``vtoken.policies``) <- the applications: ``vtoken.engine``,
``vtoken.integrations.vllm``, ``vtoken.experiments``, ``vtoken.cli``.
"""

__version__ = "0.1.0"

PAD_SLOT = -1
"""Slot sentinel meaning "no slot". Every kernel skips it."""


def cdiv(a, b):
    """Ceiling division for ints and integer numpy arrays (``-(-a // b)``)."""
    return -(-a // b)

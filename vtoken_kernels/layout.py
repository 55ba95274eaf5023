"""KVLayout: where a token's K/V rows live inside a paged KV cache tensor.

A slot ``s`` is ``block * block_size + offset``. For a cache tensor of layer l,
the element ``(kv, head, d)`` of slot s lives at::

    block * stride_block + offset * stride_offset + kv * stride_kv
          + head * stride_head + d * stride_dim

with ``stride_dim == 1`` (a head's row of ``head_dim`` elements is contiguous;
every supported layout has this). ``num_kv`` is 2 when K and V share the tensor
(split along a dim or fused into the last dim), 1 for MLA's single latent, or 1
for a K-only / V-only tensor when K and V are separate tensors.

Supported named layouts (``KVLayout.from_tensor(t, name)``):

=================  ======================================================
``vllm_flash``     ``[2, num_blocks, block_size, H, D]`` (the classic vLLM
                   FlashAttention split layout, K and V stacked first)
``vllm_fused``     ``[num_blocks, H, block_size, 2*D]``: K in the first D of
                   the last dim, V in the second. This is what the installed
                   vLLM 0.32 FlashAttention backend allocates (see
                   ``vllm/v1/attention/backends/flash_attn.py``: "[num_blocks,
                   num_kv_heads, block_size, 2 * head_size]", split with
                   ``kv_cache.transpose(1, 2).split(head_size, -1)``).
``nhd``            ``[num_blocks, 2, block_size, H, D]`` (FlashInfer NHD)
``hnd``            ``[num_blocks, 2, H, block_size, D]`` (FlashInfer HND)
``mla``            ``[num_blocks, block_size, D]`` (one latent row per token)
=================  ======================================================
"""
from __future__ import annotations

from dataclasses import dataclass

from vtoken_kernels.errors import InvalidArgumentError, InvalidTypeError

LAYOUT_NAMES = ("vllm_flash", "vllm_fused", "nhd", "hnd", "mla")


@dataclass(frozen=True)
class KVLayout:
    """Strides (in elements) that locate a token's rows in one layer's cache."""

    name: str
    num_blocks: int
    block_size: int
    num_kv: int  # 2 = K and V in this tensor, 1 = MLA latent (or K-only / V-only)
    num_heads: int
    head_dim: int
    stride_block: int
    stride_offset: int
    stride_kv: int
    stride_head: int

    def __post_init__(self):
        if self.name not in LAYOUT_NAMES:
            raise InvalidArgumentError(f"name: expected one of {LAYOUT_NAMES}, got {self.name!r}")
        for field in ("num_blocks", "block_size", "num_kv", "num_heads", "head_dim"):
            if getattr(self, field) <= 0:
                raise InvalidArgumentError(f"{field}: expected > 0, got {getattr(self, field)}")

    @property
    def rows_per_token(self) -> int:
        """Contiguous rows of ``head_dim`` elements that make up one token."""
        return self.num_kv * self.num_heads

    @property
    def num_slots(self) -> int:
        return self.num_blocks * self.block_size

    def row_offset(self, kv: int, head: int) -> int:
        return kv * self.stride_kv + head * self.stride_head

    def slot_offset(self, slot: int) -> int:
        block, offset = divmod(slot, self.block_size)
        return block * self.stride_block + offset * self.stride_offset

    def canonical_view(self, kv_cache):
        """``kv_cache`` seen as ``[num_blocks, block_size, num_kv, num_heads, head_dim]`` through these strides.

        A view (``as_strided``): writes go through to ``kv_cache``.
        """
        return kv_cache.as_strided(
            (self.num_blocks, self.block_size, self.num_kv, self.num_heads, self.head_dim),
            (self.stride_block, self.stride_offset, self.stride_kv, self.stride_head, 1),
            kv_cache.storage_offset(),
        )

    @classmethod
    def from_tensor(cls, t, name: str) -> "KVLayout":
        """Describe tensor ``t`` (one layer's cache) in the named layout."""
        shape, st = tuple(t.shape), tuple(t.stride())
        expected_dims = {"vllm_flash": 5, "vllm_fused": 4, "nhd": 5, "hnd": 5, "mla": 3}
        if name not in expected_dims:
            raise InvalidArgumentError(f"name: expected one of {LAYOUT_NAMES}, got {name!r}")
        if t.dim() != expected_dims[name]:
            raise InvalidTypeError(
                f"kv_cache: expected {expected_dims[name]} dims for layout {name!r}, got shape {shape}"
            )
        if st[-1] != 1:
            raise InvalidArgumentError(f"kv_cache: expected a contiguous last dim (stride 1), got strides {st}")
        if name == "vllm_flash":
            two, nb, bs, h, d = shape
            return cls(name, nb, bs, two, h, d, st[1], st[2], st[0], st[3])
        if name == "vllm_fused":
            nb, h, bs, d2 = shape
            if d2 % 2:
                raise InvalidArgumentError(f"kv_cache: expected an even last dim (2*head_dim), got {d2}")
            return cls(name, nb, bs, 2, h, d2 // 2, st[0], st[2], d2 // 2, st[1])
        if name == "nhd":
            nb, two, bs, h, d = shape
            return cls(name, nb, bs, two, h, d, st[0], st[2], st[1], st[3])
        if name == "hnd":
            nb, two, h, bs, d = shape
            return cls(name, nb, bs, two, h, d, st[0], st[3], st[1], st[2])
        nb, bs, d = shape  # mla
        return cls(name, nb, bs, 1, 1, d, st[0], st[1], 0, 0)


def kv_cache_shape(name: str, num_blocks: int, block_size: int, num_heads: int, head_dim: int) -> tuple:
    """The tensor shape of one layer's cache in the named layout."""
    shapes = {
        "vllm_flash": (2, num_blocks, block_size, num_heads, head_dim),
        "vllm_fused": (num_blocks, num_heads, block_size, 2 * head_dim),
        "nhd": (num_blocks, 2, block_size, num_heads, head_dim),
        "hnd": (num_blocks, 2, num_heads, block_size, head_dim),
        "mla": (num_blocks, block_size, head_dim),
    }
    if name not in shapes:
        raise InvalidArgumentError(f"name: expected one of {LAYOUT_NAMES}, got {name!r}")
    return shapes[name]

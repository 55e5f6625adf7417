"""Attention masks under sequence parallelism, and the text/image layout of a joint sequence.

Masks (boolean True = attend, or additive float, exactly as SDPA applies them). Two kinds are told
apart by their key length, which differs at every world size above 1 (``T + S_r < T + S``):

* a *local mask* over this call's ``T + S_r`` keys. A key padding mask (one value per batch element
  and key token, the same for every query; broadcastable to ``[B, H, 1, T + S_r]``): its text part is
  replicated, its image part is all-gathered with the same uneven sizes as the keys. A *padding mask
  over queries and keys*, ``M[q, k] = m[q] and m[k]`` for one padding vector ``m`` (boolean, or float
  ``m[q] * m[k]`` with ``m`` in {0, 1}: CogView4's ``attention_mask``): each row is then either ``m``
  (a key padding mask) or, for a padding query, constant, so the call runs as up to two
  key-padding-mask calls whose rows are merged (:func:`symmetric_padding_vector`). The *image identity
  mask* of perturbed-attention guidance (:func:`is_image_identity_mask`): every image query sees only
  its own image key and the text, which are all on its rank, and every text query sees every key.
* a *full-sequence mask* that the model built before its tokens were split, over all ``T + S`` keys:
  ``[B or 1, H or 1, 1 or T + S, T + S]`` (a key padding mask, or a query-dependent one such as
  SkyReels-V2's block-causal frame mask or Chroma's outer product of its text mask). Nothing is
  exchanged: K/V-gather, whose queries stay local, takes the rows of this rank's queries (the text
  rows and this rank's image rows, in the call's order), Ulysses, which attends every query of its
  heads, takes it whole (:func:`full_sequence_mask`, :func:`query_rows`).

The strategies then receive the mask over the full key sequence in the model's order. Any other mask
that varies along the query dimension but covers only this call's tokens would need the entries
between this rank's queries and the other ranks' keys, which no rank has: it raises
:class:`SequenceParallelConfigError`.
"""

from __future__ import annotations

import torch

from ..comm import all_gather_along
from ..errors import SequenceParallelConfigError


#: Values of ``SequenceState.extra["joint_text"]``: where the text tokens sit in the joint sequence.
TEXT_LAYOUTS = (None, "prefix", "suffix")


def split_text_image(x: torch.Tensor, text_len: int, text_layout: str | None, dim: int = 2):
    """Splits a joint sequence into its text and image parts along ``dim``.

    Args:
        x: Tensor whose ``dim`` holds ``text_len`` text tokens and the image tokens.
        text_len: Number of text tokens T (0: no text).
        text_layout: ``"prefix"`` (text first), ``"suffix"`` (text last) or ``None`` (``text_len`` must be 0).

    Returns:
        ``(text, image)`` views; ``text`` has ``text_len`` entries along ``dim``.
    """
    n = x.shape[dim]
    if text_len == 0:
        return x.narrow(dim, 0, 0), x
    if text_layout == "prefix":
        return x.narrow(dim, 0, text_len), x.narrow(dim, text_len, n - text_len)
    if text_layout == "suffix":
        return x.narrow(dim, n - text_len, text_len), x.narrow(dim, 0, n - text_len)
    raise ValueError(f"text_layout must be 'prefix' or 'suffix' with text tokens, got {text_layout!r}")


def join_text_image(text: torch.Tensor, image: torch.Tensor, text_layout: str | None, dim: int = 2) -> torch.Tensor:
    """Inverse of :func:`split_text_image`: concatenates text and image parts in the family's order."""
    if text.shape[dim] == 0:
        return image
    parts = [text, image] if text_layout == "prefix" else [image, text]
    return torch.cat(parts, dim=dim)


def normalize_key_padding_mask(attn_mask: torch.Tensor | None, batch: int, heads: int, length: int,
                               where: str) -> torch.Tensor | None:
    """Checks that ``attn_mask`` is a key padding mask and returns it as a 4-D tensor.

    Args:
        attn_mask: ``None`` or the ``attn_mask`` of an SDPA call over ``length`` local keys: boolean
            (True = attend) or additive float, broadcastable to ``[batch, heads, Lq, length]``.
        batch, heads, length: Shape of the call (``length`` = local query = local key length).
        where: Processor name for error messages.

    Returns:
        ``None`` or ``[B or 1, H or 1, 1, length]`` (same dtype).

    Raises:
        SequenceParallelConfigError: the mask varies along the query dimension (a query-dependent
            mask cannot be completed from the local shard) or does not broadcast to the call's shape.
    """
    if attn_mask is None:
        return None
    m = attn_mask
    while m.dim() < 4:
        m = m.unsqueeze(0)
    if m.dim() != 4 or m.shape[-1] != length or m.shape[0] not in (1, batch) or m.shape[1] not in (1, heads):
        raise SequenceParallelConfigError(
            f"{where}: attention mask of shape {tuple(attn_mask.shape)} is not a key padding mask over the "
            f"{length} local tokens (expected [B, 1 or H, 1, {length}]).")
    if m.shape[2] != 1:
        raise SequenceParallelConfigError(
            f"{where}: the attention mask depends on the query position (shape [B, H, Lq, Lk] with Lq > 1) "
            f"and covers only this rank's shard of the tokens. Under sequence parallelism such a mask lacks the "
            f"entries between this rank's queries and the other ranks' keys, so it cannot be applied exactly; "
            f"supported are key padding masks ([B, 1, 1, L], one value per key token), padding masks over "
            f"queries and keys (M[q, k] = m[q] and m[k]) and masks the model builds over the full sequence "
            f"before it is split ([B, H, L_full, L_full]) (modes 'ulysses' and 'kv_gather' alike).")
    return m


def symmetric_padding_vector(attn_mask: torch.Tensor | None, batch: int, heads: int,
                             length: int) -> torch.Tensor | None:
    """The padding vector ``m`` of a mask over queries and keys ``M[q, k] = m[q] and m[k]``, or ``None``.

    Padding applied to both sides of the attention (the padding queries' rows masked too) makes such
    a mask; CogView4's processor (Diffusers 0.42) builds its float form ``(m mᵀ > 0).to(dtype)`` from
    the transformer's ``attention_mask``: an additive bias of 1.0 on valid query-key pairs and 0.0
    elsewhere. Each row is ``m`` (a valid query) or constant (a padding query), and ``M[q, q] = m[q]``
    gives ``m`` back.

    Args:
        attn_mask: ``None`` or the ``attn_mask`` of an SDPA call over ``length`` local queries and keys.
        batch, heads, length: Shape of the call.

    Returns:
        ``m`` as a key padding mask ``[B or 1, H or 1, 1, length]`` (the mask's diagonal, same dtype)
        when ``attn_mask`` is ``[B or 1, H or 1, length, length]`` with ``length > 1`` and equals
        ``m[q] & m[k]`` (boolean) or ``m[q] * m[k]`` with every ``m`` in {0, 1} (float); else ``None``.
    """
    if attn_mask is None or attn_mask.dim() > 4:
        return None
    m = attn_mask
    while m.dim() < 4:
        m = m.unsqueeze(0)
    if (length < 2 or m.shape[-2:] != (length, length) or m.shape[0] not in (1, batch)
            or m.shape[1] not in (1, heads)):
        return None
    pad = m.diagonal(dim1=-2, dim2=-1)  # [B or 1, H or 1, L]: M[q, q] = m[q] and m[q] = m[q]
    if m.dtype == torch.bool:
        outer = pad[..., :, None] & pad[..., None, :]
    elif bool(((pad == 0) | (pad == 1)).all()):
        outer = pad[..., :, None] * pad[..., None, :]
    else:
        return None
    return pad.unsqueeze(-2) if torch.equal(m, outer) else None


def full_sequence_mask(attn_mask: torch.Tensor, batch: int, heads: int, full_length: int,
                       where: str) -> torch.Tensor:
    """Checks a mask over the full joint sequence and returns it as a 4-D tensor.

    Args:
        attn_mask: The ``attn_mask`` of an SDPA call whose last dim is ``full_length = T + S`` (every
            text and image token, in the model's order): a mask the model made before the split
            hooks cut its tokens. Boolean (True = attend) or additive float, broadcastable to
            ``[batch, heads, full_length, full_length]``.
        batch, heads: Shape of the call.
        full_length: ``T + S``.
        where: Processor name for error messages.

    Returns:
        ``[B or 1, H or 1, 1 or full_length, full_length]`` (a view, same dtype).

    Raises:
        SequenceParallelConfigError: a query dimension that is neither 1 nor ``full_length``, or a
            batch or head dimension that does not broadcast to the call's.
    """
    m = attn_mask
    while m.dim() < 4:
        m = m.unsqueeze(0)
    if (m.dim() != 4 or m.shape[-1] != full_length or m.shape[2] not in (1, full_length)
            or m.shape[0] not in (1, batch) or m.shape[1] not in (1, heads)):
        raise SequenceParallelConfigError(
            f"{where}: attention mask of shape {tuple(attn_mask.shape)} covers the {full_length} keys of the full "
            f"sequence but not as [B or 1, H or 1, 1 or {full_length}, {full_length}], so the rows of this rank's "
            f"queries cannot be found in it.")
    return m


def query_rows(mask: torch.Tensor, text_len: int, text_layout: str | None, sizes: list[int], rank: int) -> torch.Tensor:
    """The rows of a full-sequence mask for the queries of one rank's attention call.

    Args:
        mask: ``[B or 1, H or 1, 1 or T + S, T + S]`` (:func:`full_sequence_mask`), rows and columns
            in the model's order (text first for ``"prefix"``, last for ``"suffix"``, then the image
            tokens in rank order).
        text_len, text_layout: The joint layout (T text tokens, replicated on every rank).
        sizes: Image tokens per rank.
        rank: The rank whose queries are wanted.

    Returns:
        ``mask`` itself when it has one row (a key padding mask); else ``[B or 1, H or 1, T + S_r, T + S]``:
        the T text rows and the rows of ``rank``'s image shard, in the order of the call's queries (a
        view without text, one copy with it).
    """
    if mask.shape[2] == 1:
        return mask
    text, image = split_text_image(mask, text_len, text_layout, dim=2)
    mine = image.narrow(2, sum(sizes[:rank]), sizes[rank])
    return join_text_image(text, mine, text_layout, dim=2)


def gather_key_padding_mask(mask: torch.Tensor | None, text_len: int, text_layout: str | None, sizes: list[int],
                            group) -> torch.Tensor | None:
    """Completes a local key padding mask to the full key sequence.

    Args:
        mask: ``None`` or ``[B or 1, H or 1, 1, text_len + sizes[rank]]``: replicated text part and
            this rank's image part, in the family's order (see :func:`split_text_image`). Dim 2 may
            also hold every query row (whole queries over split keys,
            :class:`~diffusers_sp.processors.kv_gather.SplitKVAttnProcessor`): only dim 3 is gathered.
        text_len, text_layout: The joint layout.
        sizes: Image tokens per rank.
        group: The sequence-parallel group.

    Returns:
        ``None`` or ``[B or 1, H or 1, 1, text_len + sum(sizes)]`` (dim 2 as given) with the image
        part of every rank in rank order (one small all-gather; booleans travel as uint8), same dtype
        as ``mask``.
    """
    if mask is None or group.world_size == 1:
        return mask
    text, image = split_text_image(mask, text_len, text_layout, dim=3)
    is_bool = image.dtype == torch.bool
    payload = image.to(torch.uint8) if is_bool else image
    full = all_gather_along(payload.contiguous(), 3, sizes, group)
    if is_bool:
        full = full.bool()
    return join_text_image(text, full, text_layout, dim=3)


def is_image_identity_mask(attn_mask: torch.Tensor, text_len: int, text_layout: str | None) -> bool:
    """Whether ``attn_mask`` is the mask of perturbed-attention guidance (PAG) over a joint sequence.

    Diffusers' ``PAGJointAttnProcessor2_0`` and ``PAGCFGJointAttnProcessor2_0`` (SD3 PAG pipelines) run a
    perturbed pass whose image-image attention is the identity: an additive ``[1, 1, L, L]`` mask, 0 on
    the diagonal of the image block and -inf elsewhere in it, 0 in the image-text and text rows. Built
    by the processor from the sequence it is given, under sequence parallelism it is this rank's part:
    ``L = text_len + S_r``. Its image rows need only keys this rank holds (its own token, the text), and
    its text rows are unmasked; so the pass is exact (:meth:`SequenceParallelAttnProcessor._attend`).

    Args:
        attn_mask: An SDPA ``attn_mask``, ``[L, L]`` or ``[1 or B, 1 or H, L, L]``: boolean (True =
            attend) or additive float.
        text_len, text_layout: The joint layout (see :func:`split_text_image`); ``text_layout`` is where
            the text sits, the image tokens are the rest.

    Returns:
        True when the mask is exactly that pattern (and ``L`` > 1); False otherwise. With one image token
        the pattern cannot be told from an open mask: the caller asks only when every rank has two or more.
    """
    if attn_mask.dim() not in (2, 4) or attn_mask.shape[-1] != attn_mask.shape[-2] or attn_mask.shape[-1] < 2:
        return False
    length = attn_mask.shape[-1]
    if attn_mask.dtype == torch.bool:
        open_, closed = attn_mask, ~attn_mask
    else:
        open_, closed = attn_mask == 0, attn_mask == float("-inf")
    expected = torch.ones(length, length, dtype=torch.bool, device=attn_mask.device)
    _, image_rows = split_text_image(expected, text_len, text_layout, dim=0)
    _, image_block = split_text_image(image_rows, text_len, text_layout, dim=1)
    image_block.copy_(torch.eye(image_block.shape[0], dtype=torch.bool, device=attn_mask.device))
    return bool(torch.equal(open_ | closed, torch.ones_like(open_)) and (open_ == expected).all())

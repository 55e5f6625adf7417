"""Parallel VAE decode: the VAE's own spatial tiles shared out over the ranks of a replica.

Source: the patch-parallel VAE of xDiT (DistVAE, PipeFusion arXiv 2405.14430 / xDiT arXiv 2411.01738)
and sglang's parallel VAE decode, which split the decode of one video over several GPUs; here the
split follows the tiles of the VAE's own ``tiled_decode``, so the result is exactly the single-process
tiled decode (same tiles, same decoder calls, same blending, in the same order).

Algorithm (``T`` tiles in raster order, ``C`` tile columns, ``P`` ranks):

1. Rank ``r`` decodes the contiguous range of tiles ``[a_r, b_r)`` (balanced: the first ``T mod P``
   ranks one tile more), each with the VAE's own per-tile code (``post_quant_conv`` then the decoder,
   with its causal frame cache), exactly as the VAE's ``tiled_decode`` loop does.
2. Blending. ``tiled_decode`` blends tile ``(i, j)`` in place with the already-blended tiles above
   ``(i-1, j)`` and to the left ``(i, j-1)``, i.e. with the ``C`` tiles before it in raster order. Rank
   ``r`` receives those ``C`` blended tiles (``[a_r - C, a_r)``) from rank ``r - 1`` (point-to-point),
   blends its own tiles in order, and sends the ``C`` blended tiles before ``b_r`` on to rank ``r + 1``.
   The blending (cheap next to decoding) thus runs as a chain, decoding in parallel.
3. Each rank crops its blended tiles to the stride, as ``tiled_decode`` does, into its slice of one
   flat buffer; one broadcast per rank fills every rank's buffer, and the tiles are copied into place
   exactly as ``tiled_decode`` concatenates them.

Memory per rank: its own ``T/P`` decoded tiles and one row of neighbour tiles instead of all ``T``
tiles, plus the output; :func:`track_peak_memory` measures it (docs/usage.md has numbers).

Supported VAEs: :data:`SUPPORTED_VAES`. Decode goes through ``tiled_decode`` only when tiling is on
and the latent is larger than one tile (the VAE's own rule); smaller latents are decoded whole on
every rank. HunyuanVideo's and LTX's temporal tiling call ``tiled_decode`` per temporal chunk, so
each chunk is shared out the same way.
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from .groups import SPGroup
from .shards import balanced_sizes
from .errors import SequenceParallelConfigError

#: VAE classes whose tiled decode can be shared out.
SUPPORTED_VAES = ("AutoencoderKLWan", "AutoencoderKLHunyuanVideo", "AutoencoderKLCogVideoX", "AutoencoderKLLTXVideo")


def parallel_tiles(vae, row_starts, col_starts, decode_tile, blend_height: int, blend_width: int,
                   crop_height: int, crop_width: int, group: SPGroup) -> torch.Tensor:
    """Decodes and blends a grid of tiles over ``group``; returns ``torch.cat(result_rows, dim=3)``.

    Args:
        vae: The VAE (its ``blend_v`` / ``blend_h`` are used, unchanged).
        row_starts, col_starts: Latent offsets of the tile rows / columns (the ``range(...)`` of the
            VAE's ``tiled_decode`` loops).
        decode_tile: ``(i, j) -> tensor [B, C, F, h, w]``: the VAE's decode of the tile at latent
            offset ``(i, j)``.
        blend_height, blend_width: The blend extents ``tiled_decode`` passes to ``blend_v`` / ``blend_h``.
        crop_height, crop_width: How much of each blended tile ``tiled_decode`` keeps.
        group: The ranks sharing the decode (all must call with the same ``z``).

    Returns:
        ``[B, C, F, H, W]``: the concatenation of the cropped tiles, identical on every rank and bit for
        bit what the VAE's ``tiled_decode`` concatenates (before its final crop / unpatchify / clamp).
    """
    n_cols = len(col_starts)
    n = len(row_starts) * n_cols
    sizes = balanced_sizes(n, group.world_size)
    start = sum(sizes[:group.rank])
    stop = start + sizes[group.rank]
    state = {t: decode_tile(row_starts[t // n_cols], col_starts[t % n_cols]) for t in range(start, stop)}
    shapes, dtype, device = _tile_shapes(state, start, stop, group)
    _blend_chain(vae, state, shapes, dtype, device, n_cols, sizes, start, stop, blend_height, blend_width, group)

    def cropped_shape(shape):
        return shape[:3] + (min(shape[3], crop_height), min(shape[4], crop_width))

    flat = _share_cropped(state, [cropped_shape(shapes[t]) for t in range(n)], dtype, device, sizes, start, stop,
                          group)
    return _assemble(flat, [cropped_shape(shapes[t]) for t in range(n)], len(row_starts), n_cols, dtype, device)


def _numel(shape) -> int:
    out = 1
    for s in shape:
        out *= s
    return out


def _tile_shapes(state: dict, start: int, stop: int, group: SPGroup):
    """Every tile's shape (all ranks' tiles, by index), the tiles' dtype and the device the exchange
    uses: ``(shapes, dtype, device)``. One ``all_gather_object`` over ``group`` when it has several ranks."""
    P = group.world_size
    if P > 1:
        info = [None] * P
        dist.all_gather_object(info, [(t, tuple(state[t].shape), str(state[t].dtype)) for t in range(start, stop)],
                               group=group.group)
        shapes = {t: s for per in info for t, s, _ in per}
        dtype = getattr(torch, info[0][0][2].split(".")[-1])
    else:
        shapes = {t: tuple(x.shape) for t, x in state.items()}
        dtype = state[0].dtype
    device = next(iter(state.values())).device if state else torch.device("cpu")
    if group.backend and "nccl" in group.backend and torch.cuda.is_available():
        device = torch.device("cuda", torch.cuda.current_device())
    return shapes, dtype, device


def _blend_chain(vae, state: dict, shapes: dict, dtype, device, n_cols: int, sizes: list, start: int, stop: int,
                 blend_height: int, blend_width: int, group: SPGroup) -> None:
    """Blends this rank's tiles in place, in ``tiled_decode``'s order.

    A tile blends with the already blended tiles above and to its left, so the chain runs rank by
    rank: this rank first receives the last ``n_cols`` blended tiles before its own from the previous
    rank, blends its range, and sends its last ``n_cols`` blended tiles to the next rank. Afterwards
    ``state`` holds this rank's tiles only.
    """
    P, r = group.world_size, group.rank

    def window(end: int) -> range:
        return range(max(0, end - n_cols), end)

    if r > 0 and sizes[r] > 0:
        win = window(start)
        buf = torch.empty(sum(_numel(shapes[t]) for t in win), dtype=dtype, device=device)
        dist.recv(buf, src=dist.get_global_rank(group.group, r - 1), group=group.group)
        offset = 0
        for t in win:
            k = _numel(shapes[t])
            state[t] = buf[offset:offset + k].view(shapes[t])
            offset += k
    for t in range(start, stop):
        i, j = divmod(t, n_cols)
        tile = state[t]
        if i > 0:
            tile = vae.blend_v(state[t - n_cols], tile, blend_height)
        if j > 0:
            tile = vae.blend_h(state[t - 1], tile, blend_width)
        state[t] = tile
    if r + 1 < P and sizes[r + 1] > 0:
        send = torch.cat([state[t].reshape(-1) for t in window(stop)])
        dist.send(send, dst=dist.get_global_rank(group.group, r + 1), group=group.group)
        del send
    for t in list(state):
        if not start <= t < stop:
            del state[t]


def _share_cropped(state: dict, cropped: list, dtype, device, sizes: list, start: int, stop: int,
                   group: SPGroup) -> torch.Tensor:
    """Every cropped tile, in tile order, in one flat buffer of the exact total size, the same on every
    rank: this rank copies its tiles in at its offset, then one broadcast per rank fills the rest (no
    padding, no extra copy). Empties ``state``."""
    P = group.world_size
    counts, owner_start = [], 0
    for k in range(P):
        counts.append(sum(_numel(cropped[t]) for t in range(owner_start, owner_start + sizes[k])))
        owner_start += sizes[k]
    offsets = [sum(counts[:k]) for k in range(P)]
    flat = torch.empty(sum(counts), dtype=dtype, device=device)
    offset = offsets[group.rank]
    for t in range(start, stop):
        shape = cropped[t]
        flat[offset:offset + _numel(shape)].view(shape).copy_(state[t][:, :, :, :shape[3], :shape[4]])
        offset += _numel(shape)
    state.clear()  # the decoded tiles are not needed any more
    for k in range(P):
        if P > 1 and counts[k]:
            dist.broadcast(flat[offsets[k]:offsets[k] + counts[k]], src=dist.get_global_rank(group.group, k),
                           group=group.group)
    return flat


def _assemble(flat: torch.Tensor, cropped: list, n_rows: int, n_cols: int, dtype, device) -> torch.Tensor:
    """``torch.cat(result_rows, dim=3)`` of ``torch.cat(row, dim=-1)``, as one copy of each tile of
    ``flat`` (tile order) into place: ``[B, C, F, H, W]``."""
    height = sum(cropped[i * n_cols][3] for i in range(n_rows))
    width = sum(cropped[j][4] for j in range(n_cols))
    out = torch.empty(cropped[0][:3] + (height, width), dtype=dtype, device=device)
    offset, y = 0, 0
    for i in range(n_rows):
        x = 0
        for j in range(n_cols):
            shape = cropped[i * n_cols + j]
            out[:, :, :, y:y + shape[3], x:x + shape[4]].copy_(flat[offset:offset + _numel(shape)].view(shape))
            offset += _numel(shape)
            x += shape[4]
        y += cropped[i * n_cols][3]
    return out


def _output(dec, return_dict):
    from diffusers.models.autoencoders.vae import DecoderOutput

    return DecoderOutput(sample=dec) if return_dict else (dec,)


def wan_tiled_decode(vae, z: torch.Tensor, return_dict: bool = True, *, group: SPGroup):
    """``AutoencoderKLWan.tiled_decode`` with the tiles shared over ``group`` (same arguments and result)."""
    from diffusers.models.autoencoders.autoencoder_kl_wan import unpatchify

    _, _, num_frames, height, width = z.shape
    ratio = vae.spatial_compression_ratio
    sample_height, sample_width = height * ratio, width * ratio
    lmin_h, lmin_w = vae.tile_sample_min_height // ratio, vae.tile_sample_min_width // ratio
    lstride_h, lstride_w = vae.tile_sample_stride_height // ratio, vae.tile_sample_stride_width // ratio
    sstride_h, sstride_w = vae.tile_sample_stride_height, vae.tile_sample_stride_width
    patch = vae.config.patch_size
    if patch is not None:
        sample_height, sample_width = sample_height // patch, sample_width // patch
        sstride_h, sstride_w = sstride_h // patch, sstride_w // patch
        blend_h = vae.tile_sample_min_height // patch - sstride_h
        blend_w = vae.tile_sample_min_width // patch - sstride_w
    else:
        blend_h = vae.tile_sample_min_height - sstride_h
        blend_w = vae.tile_sample_min_width - sstride_w

    def decode_tile(i, j):
        vae.clear_cache()
        time = []
        for k in range(num_frames):
            vae._conv_idx = [0]
            tile = z[:, :, k:k + 1, i:i + lmin_h, j:j + lmin_w]
            tile = vae.post_quant_conv(tile)
            time.append(vae.decoder(tile, feat_cache=vae._feat_map, feat_idx=vae._conv_idx, first_chunk=(k == 0)))
        return torch.cat(time, dim=2)

    try:
        dec = parallel_tiles(vae, list(range(0, height, lstride_h)), list(range(0, width, lstride_w)), decode_tile,
                             blend_h, blend_w, sstride_h, sstride_w, group)
    finally:
        vae.clear_cache()
    dec = dec[:, :, :, :sample_height, :sample_width]
    if patch is not None:
        dec = unpatchify(dec, patch_size=patch)
    return _output(torch.clamp(dec, min=-1.0, max=1.0), return_dict)


def hunyuan_video_tiled_decode(vae, z: torch.Tensor, return_dict: bool = True, *, group: SPGroup):
    """``AutoencoderKLHunyuanVideo.tiled_decode`` with the tiles shared over ``group``."""
    _, _, _, height, width = z.shape
    ratio = vae.spatial_compression_ratio
    lmin_h, lmin_w = vae.tile_sample_min_height // ratio, vae.tile_sample_min_width // ratio
    lstride_h, lstride_w = vae.tile_sample_stride_height // ratio, vae.tile_sample_stride_width // ratio

    def decode_tile(i, j):
        return vae.decoder(vae.post_quant_conv(z[:, :, :, i:i + lmin_h, j:j + lmin_w]))

    dec = parallel_tiles(vae, list(range(0, height, lstride_h)), list(range(0, width, lstride_w)), decode_tile,
                         vae.tile_sample_min_height - vae.tile_sample_stride_height,
                         vae.tile_sample_min_width - vae.tile_sample_stride_width,
                         vae.tile_sample_stride_height, vae.tile_sample_stride_width, group)
    return _output(dec[:, :, :, :height * ratio, :width * ratio], return_dict)


def ltx_tiled_decode(vae, z: torch.Tensor, temb=None, return_dict: bool = True, *, group: SPGroup):
    """``AutoencoderKLLTXVideo.tiled_decode`` with the tiles shared over ``group``."""
    _, _, _, height, width = z.shape
    ratio = vae.spatial_compression_ratio
    lmin_h, lmin_w = vae.tile_sample_min_height // ratio, vae.tile_sample_min_width // ratio
    lstride_h, lstride_w = vae.tile_sample_stride_height // ratio, vae.tile_sample_stride_width // ratio

    def decode_tile(i, j):
        return vae.decoder(z[:, :, :, i:i + lmin_h, j:j + lmin_w], temb)

    dec = parallel_tiles(vae, list(range(0, height, lstride_h)), list(range(0, width, lstride_w)), decode_tile,
                         vae.tile_sample_min_height - vae.tile_sample_stride_height,
                         vae.tile_sample_min_width - vae.tile_sample_stride_width,
                         vae.tile_sample_stride_height, vae.tile_sample_stride_width, group)
    return _output(dec[:, :, :, :height * ratio, :width * ratio], return_dict)


def cogvideox_tiled_decode(vae, z: torch.Tensor, return_dict: bool = True, *, group: SPGroup):
    """``AutoencoderKLCogVideoX.tiled_decode`` with the tiles shared over ``group``."""
    _, _, num_frames, height, width = z.shape
    overlap_h = int(vae.tile_latent_min_height * (1 - vae.tile_overlap_factor_height))
    overlap_w = int(vae.tile_latent_min_width * (1 - vae.tile_overlap_factor_width))
    blend_h = int(vae.tile_sample_min_height * vae.tile_overlap_factor_height)
    blend_w = int(vae.tile_sample_min_width * vae.tile_overlap_factor_width)
    frame_batch_size = vae.num_latent_frames_batch_size

    def decode_tile(i, j):
        num_batches = max(num_frames // frame_batch_size, 1)
        conv_cache = None
        time = []
        for k in range(num_batches):
            remaining = num_frames % frame_batch_size
            start = frame_batch_size * k + (0 if k == 0 else remaining)
            end = frame_batch_size * (k + 1) + remaining
            tile = z[:, :, start:end, i:i + vae.tile_latent_min_height, j:j + vae.tile_latent_min_width]
            if vae.post_quant_conv is not None:
                tile = vae.post_quant_conv(tile)
            tile, conv_cache = vae.decoder(tile, conv_cache=conv_cache)
            time.append(tile)
        return torch.cat(time, dim=2)

    dec = parallel_tiles(vae, list(range(0, height, overlap_h)), list(range(0, width, overlap_w)), decode_tile,
                         blend_h, blend_w, vae.tile_sample_min_height - blend_h, vae.tile_sample_min_width - blend_w,
                         group)
    return _output(dec, return_dict)


_TILED_DECODE = {
    "AutoencoderKLWan": wan_tiled_decode,
    "AutoencoderKLHunyuanVideo": hunyuan_video_tiled_decode,
    "AutoencoderKLCogVideoX": cogvideox_tiled_decode,
    "AutoencoderKLLTXVideo": ltx_tiled_decode,
}


def check_parallel_vae(target, models) -> None:
    """Raises SequenceParallelConfigError unless ``target`` is a pipeline with a supported VAE."""
    vae = getattr(target, "vae", None)
    if target is models[0][1] or vae is None:
        raise SequenceParallelConfigError(
            f"{type(target).__name__}: parallel_vae=True needs a pipeline with a VAE (pass the pipeline, "
            f"not its transformer), or use parallel_vae=False.")
    if type(vae).__name__ not in _TILED_DECODE:
        raise SequenceParallelConfigError(
            f"{type(target).__name__}: parallel_vae=True supports the VAEs {', '.join(SUPPORTED_VAES)}, not "
            f"{type(vae).__name__}; use parallel_vae=False.")


def make_parallel_tiled_decode(vae, group: SPGroup):
    """The VAE's ``tiled_decode`` with its tiles shared over ``group`` (a bound-method replacement)."""
    fn = _TILED_DECODE.get(type(vae).__name__)
    if fn is None:
        raise SequenceParallelConfigError(
            f"parallel VAE decode supports {', '.join(SUPPORTED_VAES)}, not {type(vae).__name__}.")
    return functools.partial(fn, vae, group=group)


def install_parallel_vae(target, group: SPGroup, handle) -> None:
    """Turns on the VAE's tiling and replaces its ``tiled_decode`` by the shared one; ``handle.disable()`` undoes it."""
    vae = target.vae
    use_tiling = getattr(vae, "use_tiling", False)
    if not use_tiling:
        vae.enable_tiling()
    handle._undo.append(lambda: setattr(vae, "use_tiling", use_tiling))
    handle.patch_attribute(vae, "tiled_decode", make_parallel_tiled_decode(vae, group))


class track_peak_memory(TorchDispatchMode):
    """Measures the peak bytes of tensor storage allocated inside the block (CPU or GPU, any op).

    Every op's output storages are counted while alive (tracked with weak references, deduplicated
    by storage, views and in-place results counted once); storages that existed before the block
    (weights, inputs) are not counted. Kernel-internal workspaces are not tensors and are not seen.
    ``peak`` is the maximum of the live total over the block, in bytes. On CUDA,
    ``torch.cuda.max_memory_allocated`` gives the allocator's view instead.

    Example::

        with track_peak_memory() as mem:
            vae.decode(latents)
        print(mem.peak)
    """

    def __init__(self):
        super().__init__()
        self.live: dict = {}
        self.current = 0
        self.peak = 0

    def _add(self, t):
        if not torch.is_tensor(t):
            return
        try:
            storage = t.untyped_storage()
            key = (storage.data_ptr(), storage.device)
        except (RuntimeError, NotImplementedError):  # e.g. wrapper subclasses of the functional collectives
            return
        if key in self.live or storage.nbytes() == 0:
            return
        from torch.multiprocessing.reductions import StorageWeakRef

        self.live[key] = (StorageWeakRef(storage), storage.nbytes())
        self.current += storage.nbytes()

    def _purge(self):
        dead = [k for k, (ref, _) in self.live.items() if ref.expired()]
        for k in dead:
            self.current -= self.live.pop(k)[1]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self._purge()
        for t in (out if isinstance(out, (tuple, list)) else [out]):
            self._add(t)
        self.peak = max(self.peak, self.current)
        return out

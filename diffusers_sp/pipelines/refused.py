"""Diffusion transformers of Diffusers that diffusers-sp does not run, each with why: ``{class name: reason}``.

``enable_sequence_parallel`` refuses a pipeline or model holding one with its reason (on every rank alike,
before any collective), and ``python -m diffusers_sp.coverage`` lists it. A reason says what in the model
keeps a split sequence from equalling one process, or what a family for it would still need.
"""

from __future__ import annotations

REFUSED_MODELS: dict[str, str] = {
    "AnyFlowFARTransformer3DModel": (
        "frame-autoregressive attention: a causal flex-attention block mask over the frames and a K/V cache of "
        "the frames already made, written and read across calls; neither is split by sequence parallelism"),
    "BriaFibo2Transformer2DModel": (
        "its forward places a variable number of gist tokens first or last depending on the batch, and builds "
        "per-token noise masks from the global image token count of [image; reference images]; no family "
        "module describes that layout yet"),
    "Cosmos3OmniTransformer": (
        "a packed understanding-and-generation sequence whose understanding tokens attend causally "
        "(is_causal=True) in a pathway of their own; causal attention depends on the query position, which "
        "the split strategies do not take"),
    "GlmImageTransformer2DModel": (
        "a K/V cache of the condition images written in one call and read in the next, per sample, inside the "
        "attention processor; cached keys from outside the split sequence are not gathered"),
    "Kandinsky6SRTransformer3DModel": (
        "NABLA sparse attention: the block pattern is computed inside the processor from the pooled queries "
        "and keys of the whole fractal-ordered grid and run as a flex-attention BlockMask; a rank holds "
        "neither the whole grid nor a mask over its shard"),
    "LTX2VideoDiffusionDecoderModel": (
        "LTX-2's pixel-space diffusion decoder attends in 3-D neighbourhoods (each token to a kernel_size window "
        "of the frame grid: a flex-attention BlockMask or NATTEN's na3d), not over the whole sequence; a split "
        "of it is a halo exchange between neighbouring grid blocks, which neither Ulysses nor K/V-gather is"),
    "OmniGenTransformer2DModel": (
        "no family module yet: its [condition; time; image] sequence under the pipeline's causal-and-"
        "bidirectional mask could be split whole, but the pipeline's multimodal processor needs torchvision, "
        "so it has no tiny-pipeline test to hold it to one process"),
    "RFD4ProteinaTransformer": (
        "a protein-structure model over residues with a pair representation [B, N, N, C] (pair-biased "
        "attention, triangular updates); splitting it is 2-D over residue pairs, not a token sequence"),
    "SanaWMLTX2RefinerTransformer3DModel": (
        "a streaming refiner: sink and history K/V caches captured before and after RoPE in one call and read "
        "in the next; cached keys from outside the split sequence are not gathered"),
    "SanaWMTransformer3DModel": (
        "bidirectional gated delta-net attention: a recurrent state scan over the frames (forwards and "
        "backwards), not softmax attention; an exact split would pass the scan state between ranks"),
    "WanAnimate2Transformer3DModel": (
        "an in-context reference K/V cache (kv_cache_mode 'extract' then 'cached') and a flex-attention "
        "BlockMask built for the full video; neither is split by sequence parallelism"),
}

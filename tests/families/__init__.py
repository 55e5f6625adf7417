"""Tiny configs of the model families: the shared tests pick every module of this package up.

A family's module (named after its family in :mod:`diffusers_sp.pipelines`) defines

* ``FORWARDS``: ``{case: () -> (model, kwargs)}``: a tiny transformer built from its real config class
  with random weights, and forward arguments that make :data:`TOKENS` image/video tokens (a batch of
  two prompts of different lengths where the family takes a text mask). Every case is compared with
  one process in every dense mode at world sizes 2 and 3 (``tests/test_families.py``). An entry may
  be a :class:`Forward` instead, to name its modes (``"vsa"`` for a video family that runs VSA).
* ``PIPELINES``: ``{pipeline class name: Pipe(...)}``: a tiny pipeline and the call that makes it run a
  few steps; compared with one process the same way. Every pipeline class of the installed Diffusers
  built on a transformer that diffusers-sp runs must be here or refused with a reason
  (``tests/test_coverage.py``).
* ``MODULAR``: ``{modular pipeline class name: Modular(...)}``: a Diffusers modular pipeline run with the
  components and call of one of the ``PIPELINES``; compared with one process the same way.

Adding a family is its module in ``diffusers_sp/pipelines`` and one module here: no test code.
"""

from __future__ import annotations

import importlib
import pkgutil
from dataclasses import dataclass
from typing import Callable

#: Image/video tokens of every forward case: 5 x 7, which divides neither 2 nor 3.
TOKENS = 35
#: Tokens of the ``few_tokens`` forward cases: fewer than the 3 ranks of the largest world size tested, so
#: that there the forward runs whole on every rank (:func:`diffusers_sp.plan_entries.run_whole`).
FEW_TOKENS = 2
#: A batch of two prompts of different lengths (10 and 2 words): ragged text masks where the family
#: takes one, and CFG folded into the batch where the pipeline does so.
PROMPTS = ["a cat runs on the grass under the blue sky", "a dog"]


#: The dense modes, in which every forward and pipeline case is compared with one process.
DENSE_MODES = ("ulysses", "kv_gather")


@dataclass(frozen=True)
class Forward:
    """A forward case with the modes it is compared in.

    Attributes:
        build: ``() -> (model, kwargs)``, as a plain ``FORWARDS`` entry.
        modes: Dense modes (compared with one process) and ``"vsa"``: video sparse attention under
            each of its communication modes (``vsa_sp_mode``), compared with VSA on a one-rank group
            (VSA is not dense attention, so one process's dense output is not its reference).
        tokens: Tokens of the split sequence, for a case whose layout cannot make :data:`TOKENS` (frames
            in causal blocks; a model that pads its tokens to a multiple of 32 or to the longest
            resolution of its config); it too must divide neither 2 nor 3 where the model allows.
    """

    build: Callable
    modes: tuple[str, ...] = DENSE_MODES
    tokens: int = TOKENS


def result_keys(modes) -> list[str]:
    """The keys under which a case reports each of ``modes``: a dense mode as itself, ``"vsa"`` as
    ``"vsa/ulysses"`` and ``"vsa/kv_gather"`` (its two communication modes)."""
    return [k for m in modes for k in ((f"vsa/{s}" for s in DENSE_MODES) if m == "vsa" else (m,))]


@dataclass(frozen=True)
class Pipe:
    """A tiny pipeline and its call.

    Attributes:
        build: ``() -> pipeline`` (tiny components, random weights).
        call: ``() -> kwargs`` of the pipeline call (images built here); ``prompt``,
            ``num_inference_steps``, ``output_type="latent"`` and the generator are added unless given
            (each where the pipeline's ``__call__`` takes it).
        tokens: Image/video tokens of the transformer's split sequence in this call.
        modes: The dense modes compared with one process.
    """

    build: Callable
    call: Callable[[], dict] = dict
    tokens: int = TOKENS
    modes: tuple[str, ...] = ("ulysses", "kv_gather")


def family_modules() -> list:
    """Every family config module of this package, by name."""
    return [importlib.import_module(f"{__name__}.{m.name}") for m in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name)]


def forward_cases() -> dict[str, Callable]:
    """``{"<family>_<case>": () -> (model, kwargs)}`` over every family module."""
    return {name: f.build for name, f in forward_specs().items()}


def forward_specs() -> dict[str, Forward]:
    """``{"<family>_<case>": Forward}`` over every family module: the build, modes and token count of
    each case (plain ``FORWARDS`` entries in the dense modes)."""
    return {f"{mod.__name__.rsplit('.', 1)[-1]}_{name}" if name else mod.__name__.rsplit('.', 1)[-1]:
            fn if isinstance(fn, Forward) else Forward(fn)
            for mod in family_modules() for name, fn in getattr(mod, "FORWARDS", {}).items()}


def pipeline_cases() -> dict[str, Pipe]:
    """``{pipeline class name: Pipe}`` over every family module."""
    out = {}
    for mod in family_modules():
        for name, pipe in getattr(mod, "PIPELINES", {}).items():
            assert name not in out, f"{name} is configured twice"
            out[name] = pipe
    return out


@dataclass(frozen=True)
class Modular:
    """A Diffusers modular pipeline (``diffusers.modular_pipelines``) run with the tiny components of one of
    the family's classic pipelines: the modular class's default blocks without their decode step (the cases
    compare latents, as the classic ones do), the classic pipeline's components that the blocks expect, and
    the classic call's arguments that the blocks take as inputs.

    Attributes:
        classic: The key of the family's ``PIPELINES`` entry whose components and call it takes.
        call: ``() -> kwargs`` added to (or replacing) the classic call's, for inputs a modular pipeline
            takes differently.
        tokens: Image/video tokens of the split sequence, where they differ from the classic call's.
        components: ``() -> {name: component}`` added to (or replacing) the classic pipeline's, for a
            modular pipeline that expects another component (a distilled model's scheduler).
    """

    classic: str
    call: Callable[[], dict] = dict
    tokens: int | None = None
    components: Callable[[], dict] = dict


def modular_blocks(name: str):
    """The default blocks of modular pipeline class ``name``, without the ``decode`` step."""
    import diffusers.modular_pipelines as modular

    blocks = getattr(modular, getattr(modular, name).default_blocks_name)()
    blocks.sub_blocks.pop("decode", None)
    return blocks


def modular_pipeline(name: str, source, components: dict | None = None):
    """Modular pipeline class ``name`` on :func:`modular_blocks`, holding what its blocks expect from the
    classic pipeline ``source``: its components, and the processors it makes for itself (image_processor,
    video_processor: sized for the tiny VAE, where the modular defaults assume Diffusers' 8 x VAE), with
    ``components`` added or replacing them."""
    import diffusers.modular_pipelines as modular

    blocks = modular_blocks(name)
    pipe = getattr(modular, name)(blocks=blocks)  # init_pipeline() may pick a sibling class
    given = {s.name: getattr(source, s.name, None) for s in blocks.expected_components} | (components or {})
    pipe.update_components(**{k: v for k, v in given.items() if v is not None})
    return pipe


def _modular_pipe(name: str, spec: Modular, classic: Pipe) -> Pipe:
    """The :class:`Pipe` of modular pipeline ``name`` configured by ``spec`` over the ``classic`` case."""
    def build():
        return modular_pipeline(name, classic.build(), spec.components())

    def call():
        takes = {i.name for i in modular_blocks(name).inputs}
        kwargs = {"prompt": list(PROMPTS), "num_inference_steps": 2, **classic.call()}
        return {**{k: v for k, v in kwargs.items() if k in takes}, **spec.call(), "output": "latents"}

    return Pipe(build, call, spec.tokens or classic.tokens, classic.modes)


def modular_cases() -> dict[str, Pipe]:
    """``{modular pipeline class name: Pipe}`` over every family module (``MODULAR``: ``{name: Modular}``)."""
    out = {}
    for mod in family_modules():
        for name, spec in getattr(mod, "MODULAR", {}).items():
            assert name not in out, f"{name} is configured twice"
            out[name] = _modular_pipe(name, spec, mod.PIPELINES[spec.classic])
    return out


def ragged_mask(lengths, total):
    """``[B, total]`` int64 text mask with the first ``lengths[b]`` tokens valid."""
    import torch

    return (torch.arange(total)[None, :] < torch.tensor(lengths)[:, None]).long()


def randomize_norms(model):
    """``model`` with its RMSNorm/LayerNorm weights drawn around one: they start at ones, which makes e.g.
    norm_q and norm_k the same function; trained checkpoints differ, and so must the tests' models."""
    import torch

    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name and name.endswith("weight"):
                param.normal_(1.0, 0.5)
    return model


def draw_zero_weights(model, std: float = 0.2):
    """``model`` with every parameter that is all zeros (zero-initialised output layers and modulations,
    which trained checkpoints fill) drawn from ``N(0, std)``: else the output is zero and a test of it
    could not fail."""
    import torch

    with torch.no_grad():
        for param in model.parameters():
            if not param.any():
                param.normal_(0.0, std)
    return model


def qwen3_vl_config(width: int = 16, layers: int = 2, head_dim: int = 8, mrope_section=(2, 1, 1)):
    """A ``Qwen3VLConfig`` of ``layers`` text layers of ``width`` (2 heads, vocabulary of 64) and a one-block
    vision tower of the same width, for pipelines whose text encoder is Qwen3-VL (they never call the tower
    on text-only prompts)."""
    from transformers import Qwen3VLConfig

    return Qwen3VLConfig(
        text_config=dict(hidden_size=width, intermediate_size=width, num_hidden_layers=layers, num_attention_heads=2,
                         num_key_value_heads=2, head_dim=head_dim, vocab_size=64,
                         rope_scaling={"rope_type": "default", "mrope_section": list(mrope_section)}),
        vision_config=dict(depth=1, hidden_size=16, intermediate_size=16, num_heads=2, out_hidden_size=width,
                           deepstack_visual_indexes=[0]))


def kl_vae(blocks: int, latent_channels: int, **config):
    """A tiny ``AutoencoderKL`` of ``blocks`` one-layer blocks of 4 channels (``2 ** (blocks - 1)`` x down) and
    ``latent_channels`` channels, for pipelines whose size arithmetic assumes a downsampling VAE; ``config``
    adds to its config (``shift_factor``, ``scaling_factor``)."""
    import torch
    from diffusers import AutoencoderKL

    torch.manual_seed(0)
    return AutoencoderKL(in_channels=3, out_channels=3, block_out_channels=(4,) * blocks, layers_per_block=1,
                         down_block_types=("DownEncoderBlock2D",) * blocks, up_block_types=("UpDecoderBlock2D",) * blocks,
                         latent_channels=latent_channels, norm_num_groups=1, **config).eval()


def flux_ids(height: int = 5, width: int = 7):
    """``[height * width, 3]`` image position ids ``(0, row, column)`` as Flux-style pipelines make them (the
    ``img_ids`` of a ``height`` x ``width`` token grid)."""
    import torch

    ids = torch.stack(torch.meshgrid(torch.zeros(1), torch.arange(float(height)), torch.arange(float(width)),
                                     indexing="ij"), -1)
    return ids.reshape(-1, 3)


def gen(seed: int = 1):
    """A CPU generator for the inputs of a case."""
    import torch

    return torch.Generator().manual_seed(seed)


def image(width: int, height: int, seed: int = 0):
    """A random RGB ``PIL.Image`` of ``width`` x ``height`` pixels (an input image of a pipeline)."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))


def mask_image(width: int, height: int):
    """A ``PIL.Image`` inpainting mask: the left half white (repaint), the right half black (keep)."""
    import numpy as np
    from PIL import Image

    m = np.zeros((height, width), dtype=np.uint8)
    m[:, : width // 2] = 255
    return Image.fromarray(m).convert("RGB")




@dataclass(frozen=True)
class Refusal:
    """A pipeline (or input) that diffusers-sp refuses, and how the refusal shows.

    Attributes:
        build: ``() -> pipeline`` (``REFUSALS``), or ``() -> (model, kwargs)`` (``REFUSED_FORWARDS``).
        call: ``() -> kwargs`` of the call that is refused, or ``None`` when enabling itself refuses.
        match: A piece of the SequenceParallelConfigError's message.
    """

    build: Callable
    call: Callable[[], dict] | None = None
    match: str = ""


def refusal_cases() -> dict[str, Refusal]:
    """``{pipeline class name: Refusal}`` over every family module (``REFUSALS``)."""
    out = {}
    for mod in family_modules():
        out.update(getattr(mod, "REFUSALS", {}))
    return out


def refused_forwards() -> dict[str, Refusal]:
    """``{"<family>_<case>": Refusal}`` over every family module (``REFUSED_FORWARDS``): forward arguments a
    family refuses; ``build`` returns ``(model, kwargs)``, and the forward is refused alike on every rank."""
    return {f"{mod.__name__.rsplit('.', 1)[-1]}_{name}": spec
            for mod in family_modules() for name, spec in getattr(mod, "REFUSED_FORWARDS", {}).items()}


def covered_elsewhere() -> dict[str, str]:
    """``{pipeline class name: test file}``: pipelines compared with one process by their own tests
    (``COVERED_ELSEWHERE`` of a family module, e.g. Wan's in tests/test_wan_parallel.py)."""
    out = {}
    for mod in family_modules():
        out.update(getattr(mod, "COVERED_ELSEWHERE", {}))
    return out

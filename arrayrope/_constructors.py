"""RoPE's other constructors, bound as its class methods in rope.py: the multi-axis layouts
(axial, sectioned) and Hugging Face configs."""

from __future__ import annotations

from typing import Any, TypeVar

from ._spec import axial_pairs, base_arg, dims_arg, sectioned_pairs, style_arg
from .scaling import ScalingRule

RoPE = TypeVar("RoPE")  # the class these are bound to (rope.RoPE), which imports this module


def axial(
    cls: type[RoPE],
    dims: tuple[int, ...],
    *,
    base: float = 10000.0,
    style: str = "interleaved",
    max_positions: int | None = None,
    scaling: ScalingRule | None = None,
    angles: str = "exact",
) -> RoPE:
    """Multi-axis RoPE with per-axis frequencies (FLUX ``axes_dim``, 2-D ViT RoPE).

    ``pos`` for rotate then has a trailing axis of size len(dims) (for one axis, plain
    positions: that is plain RoPE, bit for bit). Real-valued coordinates are exact.

    Parameters
    ----------
    dims : sequence of even ints
        Features per axis, e.g. (16, 56, 56) for (time, row, column) with head_dim 128; head_dim
        is their sum. Axis a's pairs turn at ``base ** (-2 i / dims[a])``.
    {base}
    style : {"interleaved", "half"}
        "interleaved": axis a owns the contiguous features of its block (FLUX). "half": axis
        a owns pairs p..p+dims[a]/2 of the global half split, features j and j + head_dim/2.
    {max_positions}
    {scaling}
    {angles}

    Returns
    -------
    RoPE

    Raises
    ------
    {raises of a constructor}
    """
    dims, pair_axis = axial_pairs(dims)
    base = base_arg(base)
    head_dim = sum(dims)
    rope = cls.__new__(cls)
    rope._setup(
        head_dim,
        head_dim,
        style_arg(style),
        base,
        max_positions,
        scaling,
        blocks=[(n, base) for n in dims],
        pair_axis=pair_axis,
        angles=angles,
    )
    return rope


def sectioned(
    cls: type[RoPE],
    head_dim: int,
    sections: tuple[int, ...],
    *,
    base: float = 10000.0,
    style: str = "half",
    assign: str = "contiguous",
    rotary_dim: int | None = None,
    max_positions: int | None = None,
    scaling: ScalingRule | None = None,
    angles: str = "exact",
) -> RoPE:
    """Multi-axis RoPE with shared frequencies (Qwen2-VL M-RoPE, Qwen3-VL).

    ``pos`` for rotate then has a trailing axis of size len(sections).

    Parameters
    ----------
    head_dim : int
        Features per head, d (even).
    sections : sequence of ints
        Pairs per axis, e.g. (16, 24, 24) for (time, height, width) with head_dim 128;
        they sum to rotary_dim / 2. Frequencies run over the whole rotary_dim as in 1-D RoPE.
    assign : {"contiguous", "interleaved"}
        "contiguous" (Qwen2-VL): consecutive runs of pairs take time, height, width.
        "interleaved" (Qwen3-VL): pair j takes axis a = j mod n_axes (a >= 1) while
        j < n_axes * sections[a]; axis 0 takes every other pair.
    {base}
    style : {"interleaved", "half"}
        The pair layout, as in :class:`RoPE`; "half" (Qwen's) by default.
    {rotary_dim}
    {max_positions}
    {scaling}
    {angles}

    Returns
    -------
    RoPE

    Raises
    ------
    {raises of a constructor}
    """
    head_dim, rotary_dim = dims_arg(head_dim, rotary_dim)
    pair_axis = sectioned_pairs(sections, assign, rotary_dim)
    base = base_arg(base)
    rope = cls.__new__(cls)
    rope._setup(
        head_dim,
        rotary_dim,
        style_arg(style),
        base,
        max_positions,
        scaling,
        blocks=[(rotary_dim, base)],
        pair_axis=pair_axis,
        angles=angles,
    )
    return rope


def from_hf_config(
    cls: type[RoPE],
    config: Any,
    *,
    layer_type: str | None = None,
    layer: int | None = None,
    part: str | None = None,
    style: str | None = None,
    max_positions: int | None = None,
    angles: str = "exact",
) -> RoPE:
    """The RoPE a Hugging Face model config describes, as transformers rotates it.

    Parameters
    ----------
    config : dict, path to config.json or to a model folder, or a config object
        A transformers config object is read through its attributes (its aliases apply:
        GPT-J's n_embd is hidden_size). Reads rope_theta (rotary_emb_base), rope_parameters or
        rope_scaling (rope_type: default, linear, dynamic, yarn, longrope, llama3, proportional,
        axial; mrope_section and mrope_interleaved), head_dim or hidden_size /
        num_attention_heads (qk_rope_head_dim for multi-head latent attention),
        partial_rotary_factor (rotary_pct) or GPT-J's and CodeGen's rotary_dim,
        rope_interleave, max_position_embeddings, original_max_position_embeddings, and a
        heterogeneous config's per_layer_config. A composite config (vision-language,
        speech) is read at its ``text_config`` unless it has RoPE fields of its own.
    layer_type : str, optional
        For a config with one set of rope parameters per layer type (Gemma 3 and 4,
        ModernBERT, OLMo 3: ``"full_attention"``, ``"sliding_attention"``), the layer type
        whose RoPE to build; required there. A family that keys its parameters by labels
        (DeepSeek-V4: ``"main"``, ``"compress"``) takes a label or a layer type that maps to
        one. :meth:`from_hf_layers` builds them all. Where layers of one type differ (a
        family that leaves some layers unrotated by index, or rotates some by their own base
        or without the scaling rule: SmolLM3, Llama 4, Granite SWA, Molmo2), ``layer=``
        names the one.
    layer : int, optional
        The index of the layer whose RoPE to build, for families whose layers choose it by
        their index or by config fields besides their type (``no_rope_layers``,
        ``layer_rope_theta``, ``rope_scaling_layers``, a sliding window that decides which
        layers rotate: Cohere 2, EXAONE 4). Without it, the RoPE that every rotated layer
        of the type asked (or of the config) shares.
    part : str, optional
        The part of a composite config to read: its ``{part}_config`` ("text", "vision",
        "audio", "talker", ...), at the shallowest depth that has one (Qwen-Omni keeps its
        parts under ``thinker_config``), or a dotted path where several do ("thinker.text",
        "talker.text"); a part without RoPE fields of its own is read at its text part. A
        vision tower's
        ``rope_type: "axial"`` gives a two-axis RoPE whose positions are (row, column), in the
        order of the family's position ids; so does the default rope of a vision family whose
        module makes its grid positions itself (DINOv3, Llama 4's vision tower, EfficientLoFTR).
    style : {"half", "interleaved"}, optional
        Overrides the pair style of the model family: "half" (rotate_half) unless the family's
        code pairs adjacent features (GPT-J, CodeGen, Cohere, DeepSeek-V2 and V4, GLM,
        RoFormer, SAM's trackers, and any config with ``rope_interleave: true``).
    max_positions : int, optional
        As in :class:`RoPE`.
    angles : {"exact", "transformers"}
        As in :class:`RoPE`: "transformers" makes the family's tables as its rotary module
        makes them, for logits that match the model's bit for bit.

    Returns
    -------
    RoPE
        For multi-head latent attention (DeepSeek-V2/V3), the RoPE of the rotary part of each
        head (its last qk_rope_head_dim features). A multi-axis (M-RoPE) text model gives a
        RoPE whose positions end in an axis of size 3 (time, height, width).

    Raises
    ------
    RopeValueError, RopeTypeError
        Unknown fields, fields of the wrong type, fields that disagree (rope_theta and
        rotary_emb_base, hidden_size and n_embd, rotary_dim and a partial rotary factor), a
        layer type, layer or part the config does not have or that takes no RoPE, layers asked
        together that differ in their RoPE, a file in an older
        form its family converts by its own rules, or a RoPE the family's code builds in a way
        arrayrope cannot express (the message names the family and why).
    """
    from ._hf_config import rope_from_hf_config

    return rope_from_hf_config(cls, config, style, max_positions, layer_type, part, angles, layer)


def from_hf_layers(
    cls: type[RoPE],
    config: Any,
    *,
    part: str | None = None,
    style: str | None = None,
    max_positions: int | None = None,
    angles: str = "exact",
    per_layer: bool = False,
) -> dict[str, RoPE | None] | list[RoPE | None]:
    """Every layer type's RoPE of a Hugging Face config with ``layer_types``, or every
    layer's.

    Parameters
    ----------
    config, part, style, max_positions, angles
        As in :meth:`from_hf_config`.
    per_layer : bool
        Return a list with each layer's RoPE, by layer index: for families whose layers of one
        type differ (see ``layer`` in :meth:`from_hf_config`). Layers that rotate alike share
        one RoPE object.

    Returns
    -------
    dict or list
        {layer type: RoPE}: every type of the config's layer_types, in their order; for a
        config with rope parameters per layer type, every type (or label) those are given
        for, the config's layer_types first. None for a layer type whose layers take no RoPE
        (a family's global NoPE layers, linear attention, convolutions). Layer types that share
        one set of parameters get RoPEs built alike.
        With ``per_layer``, [RoPE or None] with an entry per layer.

    Raises
    ------
    RopeValueError
        As :meth:`from_hf_config`: for a config without layer_types (without layer_types or
        num_hidden_layers with ``per_layer``), and where the layers of one type differ.
    """
    from ._hf_config import hf_layer_ropes

    return hf_layer_ropes(cls, config, style, max_positions, part, angles, per_layer)

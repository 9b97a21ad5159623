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
    )
    return rope


def from_hf_config(
    cls: type[RoPE], config: Any, *, style: str | None = None, max_positions: int | None = None
) -> RoPE:
    """The RoPE a Hugging Face model config describes.

    Parameters
    ----------
    config : dict, path to config.json or to a model folder, or a config object
        A transformers config object is read through its attributes (its aliases apply:
        GPT-J's n_embd is hidden_size). Reads rope_theta (rotary_emb_base), rope_scaling or
        rope_parameters (rope_type/type: default, linear, dynamic, yarn, longrope, llama3;
        mrope_section for Qwen-VL), head_dim or hidden_size / num_attention_heads
        (qk_rope_head_dim for DeepSeek), partial_rotary_factor (rotary_pct) or rotary_dim
        (GPT-J, CodeGen), max_position_embeddings and original_max_position_embeddings.
    style : {"half", "interleaved"}, optional
        Overrides the pair style of the model family ("half" for Llama-lineage checkpoints,
        "interleaved" for DeepSeek-V2/V3, GPT-J, CodeGen, Cohere).
    max_positions : int, optional
        As in :class:`RoPE`.

    Returns
    -------
    RoPE

    Raises
    ------
    RopeValueError
        Unknown fields, fields that disagree (rope_theta and rotary_emb_base, hidden_size
        and n_embd, rotary_dim and a partial rotary factor), or an unknown family without
        ``style=``.
    """
    from ._hf_config import rope_from_hf_config

    return rope_from_hf_config(cls, config, style, max_positions)

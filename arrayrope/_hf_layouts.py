"""The pair and axis layouts of transformers' model families, which live in their modeling code
rather than their configs: the families whose code departs from transformers' convention
(rotate_half pairs, one position axis, frequencies base ** (-2 i / d) in pair order), and how.
tests/test_hf_families.py checks every table here against the installed transformers.
"""

import numpy as np

from ._errors import RopeValueError

# Families whose modeling code rotates adjacent pairs (x[2i], x[2i+1]): GPT-J's
# rotate_every_two, rotate_half over [..., ::2] with repeat-interleaved cos/sin (Cohere, GLM,
# ERNIE), complex multiplication (DeepSeek-V2, Llama 4). Configs with a rope_interleave field
# (DeepSeek-V3 and its MLA kin) say it themselves.
INTERLEAVED_FAMILIES = frozenset(
    {
        "gptj",
        "codegen",
        "cohere",
        "cohere2",
        "deepseek_v2",
        "blt_patcher",
        "cohere2_moe",
        "ernie4_5",
        "ernie4_5_moe",
        "glm",
        "glm4",
        "glm4v_text",
        "glm4v_moe_text",
        "glm_ocr_text",
        "helium",
        "llama4_text",
        "moonshine",
        "moonshine_streaming",
        "ernie4_5_vl_moe_text",
        "inkling2_vision",
        "hy_v4_vl_text",
        "openai_privacy_filter",
        "pe_audio_encoder",
        "pe_audio_video_encoder",
        "pe_video_encoder",
    }
)
# Families whose code reads the rotated features from a rotary_dim field (other families'
# configs may carry one that their code ignores).
ABSOLUTE_ROTARY_DIM_FAMILIES = frozenset({"gptj", "codegen"})
# Families that rotate by minus the angle (rotate_half with its signs flipped).
CLOCKWISE_FAMILIES = frozenset({"nanochat"})
# Multi-axis (M-RoPE) text models: the sections their modeling code uses when the config
# gives none, and how it hands pairs to axes (see _spec.sectioned_pairs).
MROPE_FAMILIES = {
    "qwen2_vl_text": ((16, 24, 24), "contiguous"),
    "qwen2_5_vl_text": ((16, 24, 24), "contiguous"),
    "qwen2_5_omni_text": ((16, 24, 24), "contiguous"),
    "paddleocr_vl_text": ((16, 24, 24), "contiguous"),
    "qwen3_vl_text": ((24, 20, 20), "interleaved"),
    "qwen3_vl_moe_text": ((24, 20, 20), "interleaved"),
    "cosmos3_edge_text": ((24, 20, 20), "interleaved"),
    "qwen3_5_text": ((11, 11, 10), "interleaved"),
    "qwen3_5_moe_text": ((11, 11, 10), "interleaved"),
    "qwen4_exp_text": ((11, 11, 10), "interleaved"),
    "glm4v_text": ((8, 12, 12), "contiguous"),
    "glm4v_moe_text": ((8, 12, 12), "contiguous"),
    "glm_ocr_text": ((8, 12, 12), "contiguous"),
    "glm_image_text": ((8, 12, 12), "contiguous"),
    "ernie4_5_vl_moe_text": ((22, 22, 20), "height-width alternating"),
    "hy_v4_vl_text": ((24, 20, 20), "interleaved"),
}
# Vision towers (rope_type "axial") whose pairs depart from Qwen2-VL's (rows, then columns,
# each axis a run of pairs on its own frequencies over half the head): the position axis each
# run of pairs reads, in head order, and how frequencies go to pairs: "runs" (each axis its own
# frequencies), "alternating" (the axes take turns pair by pair), or "split" (one set over the
# whole head, its even frequencies to the first run and its odd ones to the second: Pixtral).
AXIAL_LAYOUTS = {
    "inkling2_vision": ((1, 0), "runs"),
    "kimi_k25_vision": ((1, 0), "alternating"),
    "step3p5_vision": ((1, 0), "runs"),
    "minimax_m3_vl_vision": ((0, 1, 2), "runs"),
    "pixtral": ((0, 1), "split"),
}


def style(model_type, interleave, asked):
    """The pair style: ``asked`` (style=), else the config's rope_interleave, else the
    family's."""
    if asked is not None:
        return asked
    if interleave is not None:
        return "interleaved" if interleave else "half"
    return "interleaved" if model_type in INTERLEAVED_FAMILIES else "half"


def sign(model_type):
    return -1 if model_type in CLOCKWISE_FAMILIES else 1


def pick(sign, order, pairs):
    """RoPE._setup's pick: None for frequencies in pair order, turned the usual way."""
    if sign == 1 and order is None:
        return None
    return sign, tuple(range(pairs) if order is None else (int(j) for j in order))


def sections(model_type, params, rotary_dim):
    """Each rotated pair's position axis: M-RoPE's sections (the config's, else the family's
    defaults) in the family's layout, or one axis."""
    from ._spec import sectioned_pairs

    found = params.get("mrope_section")
    assign = "interleaved" if params.get("mrope_interleaved") else None
    if model_type in MROPE_FAMILIES:
        default_sections, default_assign = MROPE_FAMILIES[model_type]
        found = default_sections if found is None else found
        assign = assign or default_assign
    if found is None:
        return np.zeros(rotary_dim // 2, np.int64)
    if assign == "height-width alternating":
        return _alternating_sections(tuple(found), rotary_dim // 2)
    return sectioned_pairs(tuple(found), assign or "contiguous", rotary_dim)


def _alternating_sections(sections, pairs):
    """ERNIE-4.5-VL's M-RoPE: the pairs of the first two sections alternate between height and
    width, pair by pair, and the third section's pairs take time."""
    height, width, time = sections
    if height != width or sum(sections) != pairs:
        raise RopeValueError(
            f"mrope_section {list(sections)} must have equal height and width sections summing "
            f"with time to the {pairs} rotated pairs"
        )
    return np.r_[np.tile([1, 2], height), np.zeros(time, np.int64)].astype(np.int64)


def axial(model_type, head_dim, theta):
    """(rotary_dim, blocks, pair_axis, order) of a vision tower's RoPE (rope_type "axial"),
    whose positions are (..., n_axes) in the order of the family's position ids."""
    axes, frequencies = AXIAL_LAYOUTS.get(model_type, ((0, 1), "runs"))
    n = len(axes)
    # the features of one axis, as the families' code computes them
    spatial = head_dim // 2 if n == 2 else 2 * ((head_dim // n) // 2)
    per_axis = (spatial + 1) // 2
    if per_axis < 1:
        raise RopeValueError(f"head_dim {head_dim} is too small for {n} axes")
    pair_axis = np.repeat(np.array(axes, np.int64), per_axis)
    blocks, order = [(spatial, theta)] * n, None
    if frequencies == "alternating":
        order = [k * per_axis + i for i in range(per_axis) for k in range(n)]
        pair_axis = np.tile(np.array(axes, np.int64), per_axis)
    elif frequencies == "split":
        blocks = [(head_dim, theta)]
        order = list(range(0, 2 * per_axis, 2)) + list(range(1, 2 * per_axis, 2))
    return 2 * n * per_axis, blocks, pair_axis, order

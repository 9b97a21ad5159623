"""The pair and axis layouts of transformers' model families, which live in their modeling code
rather than their configs: the families whose code departs from transformers' convention
(rotate_half pairs, one position axis, frequencies base ** (-2 i / d) in pair order), and how.
tests/test_hf_families.py checks the tables against the installed transformers wherever it can
run a family's own module.
"""

import numpy as np

from ._errors import RopeValueError

# Families whose modeling code rotates adjacent pairs (x[2i], x[2i+1]): GPT-J's
# rotate_every_two, rotate_half over [..., ::2] with repeat-interleaved cos/sin (Cohere, GLM,
# ERNIE, EfficientLoFTR, RoFormer), complex multiplication (DeepSeek-V2, Llama 4 and its vision
# tower), rotate_pairwise (SAM 3's ViT, the SAM 2 / SAM 3 tracker / EdgeTAM memory attention).
# Configs with a rope_interleave field (DeepSeek-V3 and its MLA kin) say it themselves.
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
        "deepseek_v4",
        "sam3_vit_model",
        "sam2_video",
        "sam3_tracker_video",
        "edgetam_video",
        "llama4_vision_model",
        "efficientloftr",
        "roformer",
    }
)
# Families whose config keeps one set of rope parameters per layer type. transformers converts an
# older file's flat fields (Gemma 3's rope_local_base_freq, ModernBERT's local_rope_theta, a
# rope_scaling meant for the full-attention layers alone) by each family's own rules; a file read
# here as a dict or a path must already be in the nested form.
LAYER_TYPE_FAMILIES = frozenset(
    {
        "beam", "cohere_compass_text", "deepseek_v4", "diffusion_gemma_text", "dory",
        "dots3_note_text", "embedding_gemma2_text", "gemma3_text", "gemma3n_text", "gemma4_text",
        "gemma4_unified_text", "laguna", "lfm3", "mellum", "mimo_v2_flash", "modernbert",
        "modernbert-decoder", "neomme", "olmo3", "step3p5", "t5gemma2_decoder", "t5gemma2_text",
        "ultrabert", "zaya",
    }
)  # fmt: skip
# Families whose per-type rope parameters are keyed by labels that their code maps layer types
# to (DeepSeek-V4: "main" for its sliding-window layers, "compress" for its compressed ones):
# {layer type: label}, and the label of every other layer type.
ROPE_LABELS = {"deepseek_v4": ({"sliding_attention": "main"}, "compress")}


def rope_label(cfg, layer_type):
    """The key of the rope parameters that layers of ``layer_type`` read: the layer type
    itself, or its family's label for it (ROPE_LABELS)."""
    labels = ROPE_LABELS.get(cfg.get("model_type"))
    if labels is None:
        return layer_type
    named, other = labels
    if layer_type in named:
        return named[layer_type]
    return other if layer_type in (cfg.get("layer_types") or []) else layer_type


def derived_rotary_dim(cfg):
    """The rotated features of families whose code derives them from other fields (None for
    the rest): CLVP's encoders rotate max(projection_dim // (2 * heads), 32) features of each
    head, and rotate v by the same RoPE as q and k."""
    if cfg.get("model_type") != "clvp_encoder":
        return None
    projection, heads = cfg.get("projection_dim"), cfg.get("num_attention_heads")
    if not (type(projection) is int and type(heads) is int and projection > 0 and heads > 0):
        raise RopeValueError(
            "config of model_type 'clvp_encoder' needs positive int projection_dim and "
            f"num_attention_heads, got {projection!r} and {heads!r}"
        )
    return max(projection // (2 * heads), 32)


# Families whose rotary module reads a partial rotary factor with the default rope type (the
# other families' default ignores one; every other rope type reads it).
PARTIAL_DEFAULT_FAMILIES = frozenset(
    {
        "bamba", "deepseek_v4", "diffusion_gemma_text", "dots3_note_audio_encoder",
        "dots3_note_text", "glm", "glm4", "glm4_moe", "glm4_moe_lite", "glm4v_moe_text",
        "glm4v_text", "glm_image_text", "glm_ocr_text", "glmasr_encoder", "gpt_neox",
        "gpt_neox_japanese", "laguna", "mellum", "mimo_v2_flash", "minimax_m2",
        "minimax_m3_vl_text", "moonshine", "moonshine_streaming", "musicflamingo", "nemotron",
        "nemotron3_5_transcribe_asr_audio", "nemotron3_diarization_audio", "neomme",
        "persimmon", "phi", "phi3", "phi4_multimodal", "qwen3_5_moe_text", "qwen3_5_text",
        "qwen3_next", "qwen4_exp_text", "recurrent_gemma", "solar_open", "stablelm", "step3p5",
        "zaya",
    }
)  # fmt: skip
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
    "qwen3_omni_moe_text": ((24, 20, 20), "interleaved"),
    "qwen3_omni_moe_talker_text": ((24, 20, 20), "interleaved"),
    "cohere_compass_text": ((24, 20, 20), "interleaved"),
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
# M-RoPE layouts that no RoPE of pairs expresses, with the reason.
UNEXPRESSED_MROPE = {
    "hunyuan_vl_text": "its code cuts the duplicated cos/sin table into sections of 2 * "
    "mrope_section features, so that the two members of a pair can read different position "
    "axes: no rotation of pairs",
}
# Vision towers whose axial layout no RoPE of pairs expresses, with the reason.
UNEXPRESSED_AXIAL = {
    "gemma4_vision": "its code cuts the head into one block per position axis and rotates "
    "each block by its own halves (feature j with feature j + block/2 inside the block): no "
    "RoPE of pairs (j, j + rotary_dim/2) or of adjacent pairs",
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
    "efficientloftr": ((0, 1), "alternating"),
}
# Vision families whose config names no axial rope (rope_type "default", or rope_theta alone)
# while their rotary module turns pairs by 2-D grid coordinates it makes itself: their default
# rope is read as the axial one of AXIAL_LAYOUTS (rope_type "axial"), whose positions are these
# (negative ones by shift: rotate at p + c, then shift by -c).
GRID_FAMILIES = {
    "dinov3_vit": "2 pi times its patch centres (row, column) in [-1, 1]",
    "eomt_dinov3": "2 pi times its patch centres (row, column) in [-1, 1]",
    "sapiens2": "2 pi times its patch centres (row, column) in [-1, 1]",
    "llama4_vision_model": "(column + 1, row + 1) of its patches, its class token at 0",
    "efficientloftr": "(row + 1, column + 1) of its feature grid",
}
# Families that rotate the whole hidden vector before splitting it into heads (EfficientLoFTR,
# whose partial_rotary_factor of 4 is that ratio): the RoPE's head_dim is hidden_size.
WHOLE_VECTOR_FAMILIES = frozenset({"efficientloftr"})
# Families whose rotation no RoPE of pairs expresses, with the reason.
UNEXPRESSED = {
    "esmfold2": "its rotary module turns atom coordinates (x, y, z) and a per-atom space id, "
    "not token positions, with a base per kind of axis and pairs left unrotated: its own cos "
    "and sin go to ar.apply_cos_sin",
    "musicflamingo": "its rotary module turns the audio encoder's output, not heads: its first "
    "2 * n features (n = head_dim * partial_rotary_factor) in adjacent pairs, the first n by a "
    "window axis and the next n by a time axis, both scaled by -2 pi times each token's "
    "timestamp; RoPE.axial((n, n), base=rope_theta) on those features at the positions its "
    "module computes expresses it (part='text' reads the language model's RoPE)",
    "qwen2_5_omni_dit": "its attention rotates its first head alone (adjacent pairs, written "
    "de-interleaved) and leaves the others unrotated, which no RoPE of every head expresses: "
    "rotate q[:, :1] and k[:, :1] with RoPE(head_dim, style='interleaved')",
    "vjepa2": "its code pairs adjacent features but takes cos and sin tiled as for rotate_half "
    "pairs, so the two features of a pair turn by different angles: no rotation (it does not "
    "keep the norm), so no RoPE of pairs",
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
    if model_type in UNEXPRESSED_MROPE:
        raise RopeValueError(f"model_type {model_type!r}: {UNEXPRESSED_MROPE[model_type]}")
    if model_type in GRID_FAMILIES:
        raise RopeValueError(
            f"model_type {model_type!r}: its rotary module turns pairs by grid coordinates it "
            f"makes itself ({GRID_FAMILIES[model_type]}), which a config without rope_type "
            "'axial' does not say: give rope_parameters rope_type 'axial' to read its rotation"
        )
    assign = "interleaved" if params.get("mrope_interleaved") else None
    if model_type in MROPE_FAMILIES:
        default_sections, default_assign = MROPE_FAMILIES[model_type]
        found = default_sections if found is None else found
        assign = assign or default_assign
    if found is None:
        return np.zeros(rotary_dim // 2, np.int64)
    try:
        found = tuple(int(n) for n in found)
    except (TypeError, ValueError):
        raise RopeValueError(f"mrope_section must be a list of ints, got {found!r}") from None
    if assign == "height-width alternating":
        return _alternating_sections(found, rotary_dim // 2)
    if assign == "interleaved":
        return _interleaved_sections(found, rotary_dim // 2)
    return sectioned_pairs(found, assign or "contiguous", rotary_dim)


def _interleaved_sections(sections, pairs):
    """Qwen3-VL's M-RoPE as its code builds it: pair j takes axis a >= 1 where j % n_axes == a
    and j < n_axes * sections[a], and time (axis 0) every other pair, however many that is."""
    n_axes = len(sections)
    j = np.arange(pairs)
    pair_axis = np.zeros(pairs, np.int64)
    for a in range(1, n_axes):
        pair_axis[(j % n_axes == a) & (j < n_axes * sections[a])] = a
    return pair_axis


def _alternating_sections(sections, pairs):
    """ERNIE-4.5-VL's M-RoPE: the pairs of the first two sections alternate between height and
    width, pair by pair, and the third section's pairs take time."""
    if len(sections) != 3 or sections[0] != sections[1] or sum(sections) != pairs:
        raise RopeValueError(
            f"mrope_section {list(sections)} must be three sections (height, width, time), "
            f"height and width equal, summing to the {pairs} rotated pairs"
        )
    height, _, time = sections
    return np.r_[np.tile([1, 2], height), np.zeros(time, np.int64)].astype(np.int64)


def axial(model_type, head_dim, theta):
    """(rotary_dim, blocks, pair_axis, order) of a vision tower's RoPE (rope_type "axial"),
    whose positions are (..., n_axes) in the order of the family's position ids."""
    if model_type in UNEXPRESSED_AXIAL:
        raise RopeValueError(f"model_type {model_type!r}: {UNEXPRESSED_AXIAL[model_type]}")
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

"""The rotary families of the installed transformers whose modules make their positions
themselves, from a pixel, patch or feature grid, driven by their own code against
RoPE.from_hf_config.

hf_families.py hands a rotary module position ids; these modules take none (a feature map, pixel
values, or nothing at all). Each is run here as its model runs it: the rotary module builds its
cos and sin (or complex exponentials) from a small grid, with the positions the family's own code
makes (its precompute_positions, get_patches_center_coordinates or compute_embeddings where it
has one), and the family's attention class applies them through its own apply function, whose
input (q0, k0) and output (q1, k1) are recorded. arrayrope's RoPE from the same config must take
q0 to q1 (and k0 to k1) at those positions, given as (token, axis) coordinates in the order of the
family's position ids; a token the family leaves unrotated (a class or register token, an object
pointer, a temporal memory token) has position 0, which turns nothing.

Where from_hf_config refuses a config, or gives the wrong RoPE, the detail says whether the config
rewritten as the rotation reads (rope_type "axial", or the head size the module computes) would
match: what from_hf_config still needs to read that family.

    python tests/hf_grid_families.py     # the table: family, rotary class, outcome, detail
"""

import dataclasses
import importlib
import inspect
import math
import sys
import warnings

import hf_families
import numpy as np
from hf_families import MATCH, REFUSED, UNDRIVEN, WRONG, Outcome

import arrayrope as ar


@dataclasses.dataclass
class _Run:
    """One application of a family's rotation: the rows before (q0, k0) and after (q1, k1), and
    arrayrope's positions for them (broadcasting against their leading axes)."""

    where: str
    q0: np.ndarray
    k0: np.ndarray
    q1: np.ndarray
    k1: np.ndarray
    pos_q: np.ndarray
    pos_k: np.ndarray


class _Recorded(Exception):
    def __init__(self, before, after):
        self.before, self.after = before, after


def _numpy(t):
    return t.detach().float().numpy().copy()


def _recording(owner, name, q_at=0, k_at=1):
    """``owner``'s function ``name`` (a module's function or a class's static method) made to
    record its q and k before and after, and stop the forward there."""
    original = inspect.getattr_static(owner, name)
    function = original.__func__ if isinstance(original, staticmethod) else original

    def recorder(*args, **kwargs):
        before = (_numpy(args[q_at]), _numpy(args[k_at]))
        q, k = function(*args, **kwargs)[:2]
        raise _Recorded(before, (_numpy(q), _numpy(k)))

    class Swap:
        def __enter__(self):
            setattr(owner, name, staticmethod(recorder) if isinstance(owner, type) else recorder)

        def __exit__(self, *exc):
            setattr(owner, name, original)

    return Swap()


def _through(owner, name, call, **where):
    """(q0, k0, q1, k1) that ``call`` hands ``owner.name`` and gets back."""
    with _recording(owner, name, **where):
        try:
            call()
        except _Recorded as r:
            return (*r.before, *r.after)
    raise RuntimeError(f"the forward did not reach {name}")


def _built(cls, config, **kwargs):
    """The family's attention class, on hf_families' fixed random layers, with ``kwargs``."""

    def __init__(self, c):
        cls.__init__(self, c, **kwargs)

    bound = type(cls.__name__, (cls,), {"__init__": __init__})
    attention = hf_families._attention(bound, [config], 0)
    try:
        config._attn_implementation = "eager"
    except Exception:  # noqa: BLE001 - a config that fixes its implementation
        pass
    return attention


def _hidden(rng, *shape):
    import torch

    return torch.from_numpy(rng.standard_normal(shape).astype(np.float32))


def _along(pos, x, axis):
    """Positions (N, n_axes) shaped to broadcast against ``x`` with the N tokens on ``axis``."""
    shape = [1] * (x.ndim - 1) + [pos.shape[-1]]
    shape[axis] = pos.shape[0]
    return pos.reshape(shape)


# Each family: (its config, its runs) from a seeded generator, and the config rewritten as the
# rotation reads, where from_hf_config cannot read the family's own.


def _sam3(module, rng):
    """SAM 3's ViT: (column, row) of its patch grid, scaled by window_size / grid width (a real
    factor in the global layers), interleaved pairs, rows' pairs then columns'."""
    config = module.Sam3ViTConfig(image_size=9 * 14, patch_size=14, window_size=3)
    config.hidden_size, config.num_attention_heads = 256, 4
    rotary = module.Sam3ViTRotaryEmbedding(config)
    attention = _built(module.Sam3ViTRoPEAttention, config)
    runs = []
    for window in (0, config.window_size):  # a global layer, a windowed one
        positions = module.Sam3ViTLayer.precompute_positions(config, window)
        side = int(math.isqrt(positions.shape[0]))
        hidden = _hidden(rng, 1, side, side, config.hidden_size)
        embeddings = rotary(hidden, positions)
        got = _through(
            module,
            "apply_rotary_pos_emb_2d",
            lambda: attention(hidden, embeddings),  # noqa: B023
        )
        pos = positions.double().numpy()
        runs.append(
            _Run(f"Sam3ViTRoPEAttention[window {window}]", *got,
                 _along(pos, got[0], 2), _along(pos, got[1], 2))
        )  # fmt: skip
    return config, runs, None


def _memory_head(config):
    return config.memory_attention_hidden_size // (
        config.memory_attention_downsample_rate * config.memory_attention_num_attention_heads
    )


def _sam2_like(prefix):
    """SAM 2 video and SAM 3 tracker's memory attention: (column, row) of the feature grid,
    interleaved pairs; its cross-attention repeats the grid's positions over the memory's frames
    and leaves the object pointer tokens at the end unrotated."""

    def drive(module, rng):
        config = getattr(module, f"{prefix}Config")()
        config.memory_attention_rope_feat_sizes = [4, 3]  # width, height: not square
        rotary = getattr(module, f"{prefix}VisionRotaryEmbedding")(config)
        memory = getattr(module, f"{prefix}MemoryAttention")
        positions = memory.precompute_positions(config)
        n, hidden_size = positions.shape[0], config.memory_attention_hidden_size
        pos = positions.double().numpy()
        attention_cls = getattr(module, f"{prefix}RoPEAttention")
        runs = []
        query = _hidden(rng, 1, 1, n, hidden_size)
        embeddings = rotary(query, positions)
        self_attention = _built(attention_cls, config)
        got = _through(
            module, "apply_rotary_pos_emb_2d",
            lambda: self_attention(query, query, query, position_embeddings=embeddings),
        )  # fmt: skip
        runs.append(_Run("self-attention", *got, _along(pos, got[0], 2), _along(pos, got[1], 2)))
        frames, pointers = 2, 3
        cross = _built(attention_cls, config, kv_in_dim=64, rope_k_repeat=True)
        keys = _hidden(rng, 1, 1, frames * n + pointers, 64)
        got = _through(
            module, "apply_rotary_pos_emb_2d",
            lambda: cross(query, keys, keys, position_embeddings=embeddings,
                          num_k_exclude_rope=pointers),
        )  # fmt: skip
        pos_k = np.concatenate([np.tile(pos, (frames, 1)), np.zeros((pointers, 2))])
        runs.append(_Run("cross-attention", *got, _along(pos, got[0], 2), _along(pos_k, got[1], 2)))
        return config, runs, {**config.to_dict(), "head_dim": _memory_head(config)}

    return drive


def _edgetam(module, rng):
    """EdgeTAM video's memory attention: SAM 2's, with the keys' own grid (rope_k_sizes), and in
    each memory frame temporal tokens before the spatial ones, which it leaves unrotated."""
    config = module.EdgeTamVideoConfig()
    config.memory_attention_rope_feat_sizes = [4, 3]
    config.memory_attention_rope_k_sizes = [3, 2]
    rotary = module.EdgeTamVideoVisionRotaryEmbedding(config)
    memory = module.EdgeTamVideoMemoryAttention
    positions = memory.precompute_positions(config)
    positions_k = memory.precompute_positions(config, is_key=True)
    pos, pos_k = positions.double().numpy(), positions_k.double().numpy()
    hidden_size = config.memory_attention_hidden_size
    query = _hidden(rng, 1, 1, pos.shape[0], hidden_size)
    embeddings = rotary(query, positions)
    embeddings_k = rotary(query, positions_k)
    runs = []
    attention = _built(module.EdgeTamVideoRoPESelfAttention, config)
    got = _through(
        module, "apply_rotary_pos_emb_2d_self_attn",
        lambda: attention(query, query, query, position_embeddings=embeddings),
    )  # fmt: skip
    runs.append(_Run("self-attention", *got, _along(pos, got[0], 2), _along(pos, got[1], 2)))
    frames, temporal, pointers = 2, 2, 3
    cross = _built(module.EdgeTamVideoRoPECrossAttention, config, kv_in_dim=64)
    keys = _hidden(rng, 1, 1, frames * (temporal + pos_k.shape[0]) + pointers, 64)
    got = _through(
        module, "apply_rotary_pos_emb_2d_cross_attn",
        lambda: cross(query, keys, keys, position_embeddings=embeddings,
                      position_embeddings_k=embeddings_k, num_k_exclude_rope=pointers,
                      rope_k_repeat=frames),
    )  # fmt: skip
    frame = np.concatenate([np.zeros((temporal, 2)), pos_k])
    keys_pos = np.concatenate([np.tile(frame, (frames, 1)), np.zeros((pointers, 2))])
    runs.append(_Run("cross-attention", *got, _along(pos, got[0], 2), _along(keys_pos, got[1], 2)))
    return config, runs, {**config.to_dict(), "head_dim": _memory_head(config)}


def _llama4_vision(module, rng):
    """Llama 4's vision tower: (column + 1, row + 1) of the patch grid, the class token (last)
    at 0, complex multiplication (adjacent pairs), columns' pairs then rows'."""
    config = module.Llama4VisionConfig(image_size=4 * 14, patch_size=14)
    side = config.image_size // config.patch_size
    rotary = module.Llama4VisionRotaryEmbedding(config)
    attention = _built(module.Llama4VisionAttention, config)
    hidden = _hidden(rng, 1, side * side + 1, config.hidden_size)
    freqs = rotary(hidden)
    got = _through(module, "vision_apply_rotary_emb", lambda: attention(hidden, freqs))
    index = np.arange(side * side)
    pos = np.stack([index % side + 1, index // side + 1], -1).astype(np.float64)
    pos = np.concatenate([pos, np.zeros((1, 2))])  # the class token
    # q and k as the apply function takes them: (batch, tokens, heads, head_dim)
    rewritten = {**config.to_dict(), "rope_parameters": {**config.rope_parameters,
                                                          "rope_type": "axial"}}  # fmt: skip
    return config, [_Run("Llama4VisionAttention", *got, _along(pos, got[0], 1),
                         _along(pos, got[1], 1))], rewritten  # fmt: skip


def _dinov3_like(config_name, rotary_name, attention_name, **attention_kwargs):
    """DINOv3 and its kin: 2 pi times the patch centres' (row, column) in [-1, 1], rotate_half
    pairs, rows' pairs then columns', the prefix tokens (class, registers) unrotated."""

    def drive(module, rng):
        config = getattr(module, config_name)(image_size=4 * 16, patch_size=16)
        config.hidden_size, config.num_attention_heads = 256, 4
        rows, columns = 3, 4  # not square
        rotary = getattr(module, rotary_name)(config).eval()
        pixels = _hidden(rng, 1, 3, rows * config.patch_size, columns * config.patch_size)
        embeddings = rotary(pixels)
        prefix = 1 + getattr(config, "num_register_tokens", 0)
        attention = _built(getattr(module, attention_name), config, **attention_kwargs)
        hidden = _hidden(rng, 1, prefix + rows * columns, config.hidden_size)
        got = _through(
            module, "apply_rotary_pos_emb",
            lambda: attention(hidden, position_embeddings=embeddings),
        )  # fmt: skip
        import torch

        centres = module.get_patches_center_coordinates(rows, columns, torch.float32, "cpu")
        pos = np.concatenate([np.zeros((prefix, 2)), 2 * np.pi * centres.double().numpy()])
        params = getattr(config, "rope_parameters", None) or {"rope_theta": config.rope_theta}
        rewritten = {**config.to_dict(), "rope_parameters": {**params, "rope_type": "axial"}}
        return config, [_Run(attention_name, *got, _along(pos, got[0], 2),
                             _along(pos, got[1], 2))], rewritten  # fmt: skip

    return drive


def _efficientloftr(module, rng):
    """EfficientLoFTR's coarse transformer: (row + 1, column + 1) of the aggregated feature grid,
    rotated across the whole hidden vector before its split into heads, in adjacent pairs whose
    axes alternate (row, column) on one set of frequencies over half the hidden size."""
    import torch

    config = module.EfficientLoFTRConfig()
    rows, columns = 3, 4
    k, s = config.q_aggregation_kernel_size, config.q_aggregation_stride
    features = _hidden(rng, 1, config.hidden_size, (rows - 1) * s + k, (columns - 1) * s + k)
    rotary = module.EfficientLoFTRRotaryEmbedding(config)
    cos, sin = rotary(features)
    n = rows * columns
    embeddings = (cos.reshape(1, n, -1), sin.reshape(1, n, -1))
    attention = _built(module.EfficientLoFTRAttention, config, layer_idx=0)
    hidden = _hidden(rng, 1, n, config.hidden_size)
    got = _through(
        module, "apply_rotary_pos_emb", lambda: attention(hidden, position_embeddings=embeddings)
    )
    # the family's coordinates, by its own compute_embeddings at one frequency of 1
    grid = module.compute_embeddings(torch.ones(1), rows, columns, 4)
    pos = grid.reshape(n, 2).double().numpy()
    rewritten = {
        **config.to_dict(),
        "rope_parameters": {
            "rope_type": "axial",
            "rope_theta": config.rope_parameters["rope_theta"],
        },
        "head_dim": config.hidden_size,
    }
    # q and k as its apply function takes them: (batch, tokens, 1, hidden_size)
    return config, [_Run("EfficientLoFTRAttention", *got, _along(pos, got[0], 1),
                         _along(pos, got[1], 1))], rewritten  # fmt: skip


def _roformer(module, rng):
    """RoFormer: token positions (from a cache length on), adjacent pairs, base 10000 fixed in
    its code (its config has no rope_theta)."""
    config = module.RoFormerConfig(hidden_size=256, num_attention_heads=4)
    head = config.hidden_size // config.num_attention_heads
    table = module.RoFormerSinusoidalPositionalEmbedding(config.max_position_embeddings, head)
    with np.errstate(all="ignore"):
        table.weight.data.copy_(table.create_weight())
    T, start = 5, 40
    hidden = _hidden(rng, 2, T, config.hidden_size)
    sinusoidal = table(hidden.shape[:-1], start)[None, None]
    attention = _built(module.RoFormerSelfAttention, config)
    got = _through(
        module.RoFormerSelfAttention, "apply_rotary_position_embeddings",
        lambda: attention(hidden, sinusoidal_pos=sinusoidal), q_at=1, k_at=2,
    )  # fmt: skip
    pos = np.arange(start, start + T, dtype=np.float64)[:, None]
    return config, [_Run("RoFormerSelfAttention", *got, _along(pos, got[0], 2)[..., 0],
                         _along(pos, got[1], 2)[..., 0])], {**config.to_dict(),
                                                            "rope_theta": 10000.0}  # fmt: skip


def _vjepa2(module, rng):
    """V-JEPA 2: its own rotation function on one axis' block. Its code pairs adjacent features
    but takes cos and sin tiled as for rotate_half pairs, so the two features of a pair turn by
    different angles: no rotation (the norm is not kept), so no RoPE of pairs."""
    import torch

    x = _hidden(rng, 1, 1, 6, 20)
    pos = torch.arange(6, dtype=torch.float32) + 3
    y = module.rotate_queries_or_keys(x, pos)
    kept = torch.allclose(x.norm(dim=-1), y.norm(dim=-1), rtol=1e-5)
    return module.VJEPA2Config(), kept, None


# the driver of each class: its rotary class, or where it has none, the class holding its rotation
_DRIVERS = {
    "Sam3ViTRotaryEmbedding": _sam3,
    "Sam2VideoVisionRotaryEmbedding": _sam2_like("Sam2Video"),
    "Sam3TrackerVideoVisionRotaryEmbedding": _sam2_like("Sam3TrackerVideo"),
    "EdgeTamVideoVisionRotaryEmbedding": _edgetam,
    "Llama4VisionRotaryEmbedding": _llama4_vision,
    "DINOv3ViTRopePositionEmbedding": _dinov3_like(
        "DINOv3ViTConfig", "DINOv3ViTRopePositionEmbedding", "DINOv3ViTAttention"
    ),
    "EomtDinov3RotaryEmbedding": _dinov3_like(
        "EomtDinov3Config", "EomtDinov3RotaryEmbedding", "EomtDinov3Attention"
    ),
    "Sapiens2RopePositionEmbedding": _dinov3_like(
        "Sapiens2Config", "Sapiens2RopePositionEmbedding", "Sapiens2Attention", layer_idx=0
    ),
    "EfficientLoFTRRotaryEmbedding": _efficientloftr,
    "RoFormerSinusoidalPositionalEmbedding": _roformer,
    "VJEPA2RopeAttention": _vjepa2,
}

# (modeling module, class) of every class drive_grid knows, for the table
COMPONENTS = [
    ("transformers.models.sam3.modeling_sam3", "Sam3ViTRotaryEmbedding"),
    ("transformers.models.sam2_video.modeling_sam2_video", "Sam2VideoVisionRotaryEmbedding"),
    (
        "transformers.models.sam3_tracker_video.modeling_sam3_tracker_video",
        "Sam3TrackerVideoVisionRotaryEmbedding",
    ),
    (
        "transformers.models.edgetam_video.modeling_edgetam_video",
        "EdgeTamVideoVisionRotaryEmbedding",
    ),
    ("transformers.models.llama4.modeling_llama4", "Llama4VisionRotaryEmbedding"),
    ("transformers.models.dinov3_vit.modeling_dinov3_vit", "DINOv3ViTRopePositionEmbedding"),
    ("transformers.models.eomt_dinov3.modeling_eomt_dinov3", "EomtDinov3RotaryEmbedding"),
    ("transformers.models.sapiens2.modeling_sapiens2", "Sapiens2RopePositionEmbedding"),
    ("transformers.models.efficientloftr.modeling_efficientloftr", "EfficientLoFTRRotaryEmbedding"),
    ("transformers.models.roformer.modeling_roformer", "RoFormerSinusoidalPositionalEmbedding"),
    ("transformers.models.vjepa2.modeling_vjepa2", "VJEPA2RopeAttention"),
]


def _rotated(rope, x, pos):
    """``rope``'s rotation of ``x`` at ``pos``; arrayrope's positions are non-negative, so that
    negative ones (patch centres in [-1, 1]) are rotated at pos + c, then shifted by -c."""
    x = np.ascontiguousarray(x)
    low = pos.min(axis=tuple(range(pos.ndim - 1))) if rope.n_axes > 1 else pos.min()
    c = np.ceil(np.maximum(0.0, -np.asarray(low, np.float64)))
    if not c.any():
        return rope.rotate(x, pos)
    return rope.shift(rope.rotate(x, pos + c), -c.reshape((1,) * (pos.ndim - 1) + c.shape))


def _compare(rope, run):
    """(whether ``rope`` takes the run's q0 to q1 and k0 to k1, the worse relative error)."""
    ok, worst = True, 0.0
    for x0, x1, pos in ((run.q0, run.q1, run.pos_q), (run.k0, run.k1, run.pos_k)):
        got = _rotated(rope, x0, pos)
        close, err = hf_families._close(got, x1, x0, np.abs(pos))
        ok, worst = ok and close, max(worst, err)
    return ok, worst


def _judge(config, runs):
    """(status, detail) of from_hf_config(config) against every run."""
    try:
        rope = ar.RoPE.from_hf_config(config)
    except ar.RopeError as e:
        return REFUSED, str(e)
    try:
        again = ar.RoPE.from_hf_config(config.to_dict() if hasattr(config, "to_dict") else config)
    except ar.RopeError as e:
        return WRONG, f"its config as a dict is refused: {e}"
    if not hf_families._same_rope(rope, again):
        return WRONG, f"its config as a dict gives {again!r}, the object {rope!r}"
    n_axes = runs[0].pos_q.shape[-1] if runs[0].pos_q.ndim == runs[0].q0.ndim else 1
    if rope.n_axes != n_axes or rope.head_dim != runs[0].q0.shape[-1]:
        return WRONG, (
            f"{rope!r}, where the family turns rows of {runs[0].q0.shape[-1]} features by "
            f"{n_axes} position axes"
        )
    for run in runs:
        try:
            ok, err = _compare(rope, run)
        except ar.RopeError as e:
            return WRONG, f"{run.where}: arrayrope refused the family's arrays: {e}"
        if not ok:
            return WRONG, f"{run.where}: {rope!r} off by {err:.2g}"
    return MATCH, f"{', '.join(r.where for r in runs)}: {rope!r}"


def drive_grid(module_name, rotary_name, variant=None):
    """The Outcome of one rotary class that makes its own positions, or None for a class this
    driver does not know. Only the config class's defaults are driven: a ``variant`` gives
    UNDRIVEN (these modules build their axial or default tables alone and take no scaling)."""
    drive = _DRIVERS.get(rotary_name)
    if drive is None:
        return None
    family = module_name.split(".")[2]

    def outcome(status, detail, model_type=None):
        return Outcome(family, rotary_name, model_type, status, detail[:600])

    if variant is not None:
        return outcome(
            UNDRIVEN, f"grid families are driven with their defaults alone, not {variant}"
        )
    module = importlib.import_module(module_name)
    rng = np.random.default_rng(7)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            config, runs, rewritten = drive(module, rng)
        except Exception as e:  # noqa: BLE001
            return outcome(UNDRIVEN, f"its own code did not run here: {e!r}")
    model_type = getattr(config, "model_type", None)
    if runs is True or runs is False:  # a family whose code is no rotation
        try:
            rope = ar.RoPE.from_hf_config(config)
        except ar.RopeError as e:
            status = REFUSED if not runs else UNDRIVEN
            return outcome(status, str(e), model_type)  # its own reason, checked by the test
        if not runs:
            return outcome(WRONG, f"{rope!r}, where its code is no rotation", model_type)
        return outcome(UNDRIVEN, "its rotation is not driven here", model_type)
    status, detail = _judge(config, runs)
    if status != MATCH and rewritten is not None:
        again, said = _judge(rewritten, runs)
        changed = sorted(k for k in rewritten if rewritten[k] != config.to_dict().get(k))
        fields = ", ".join(f"{k}={rewritten[k]!r}" for k in changed)
        detail += f" | read with {fields}: {again}: {said}"
    return outcome(status, detail, model_type)


def main():
    import transformers

    warnings.filterwarnings("ignore")
    transformers.logging.set_verbosity_error()
    for module_name, rotary_name in COMPONENTS:
        result = drive_grid(module_name, rotary_name)
        print(
            f"{result.status:9} {result.family:20} {result.rotary:38} {result.detail}", flush=True
        )


if __name__ == "__main__":
    sys.exit(main())

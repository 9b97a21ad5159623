"""Every rotary family of the installed transformers, found in its modeling modules and driven by
its own code, against RoPE.from_hf_config.

A family's rotary module (a class whose name holds "Rotary") is built from its config class's
defaults (the sub-config it accepts, for a composite model), and each attention class of the
module that takes the rotary module's output runs with it: its projections replaced by fixed
random outputs, and its attention function by one that records the query and key it is given.
Run once with the identity rotation (cos 1, sin 0) and once with the module's cos and sin, the
attention gives q0 and q1; arrayrope's RoPE from the same config must take q0 to q1 (and k0 to
k1). Nothing is listed by hand: a family added by a later transformers is checked the day it is
installed.

    python tests/hf_families.py          # the table: family, rotary class, outcome, detail
"""

import contextlib
import dataclasses
import glob
import importlib
import inspect
import itertools
import os
import re
import sys
import typing
import warnings
import zlib

import numpy as np

import arrayrope as ar

MATCH, REFUSED, UNDRIVEN, WRONG = "match", "refused", "undriven", "wrong"
_RANK = {WRONG: 0, REFUSED: 1, MATCH: 2, UNDRIVEN: 3}  # the outcome of one run: its worst
_BEST = {MATCH: 0, REFUSED: 1, WRONG: 2, UNDRIVEN: 3}  # of a vision tower's two input shapes


@dataclasses.dataclass
class Outcome:
    family: str  # the modeling package
    rotary: str  # the rotary class
    model_type: str | None
    status: str
    detail: str


class _Captured(Exception):
    def __init__(self, query, key):
        self.query, self.key = query, key


def _capture(module, query, key, *args, **kwargs):
    raise _Captured(query.detach().clone(), key.detach().clone())


def modules(applying=False):
    """The modeling modules of the installed transformers that hold rotary code; with
    ``applying``, only those that call an apply function (others keep a copied one unused)."""
    import transformers.models

    root = transformers.models.__path__[0]
    for path in sorted(glob.glob(os.path.join(root, "*", "modeling_*.py"))):
        with open(path) as f:
            source = f.read()
        if not re.search(r"Rotary\w*Embedding|def apply_rotary|rotate_half", source):
            continue
        if applying and not re.search(r"(?<!def )\bapply_rotary\w*\(", source):
            continue
        package = os.path.basename(os.path.dirname(path))
        yield package, f"transformers.models.{package}.{os.path.basename(path)[:-3]}"


def components():
    """(family, module name, rotary class name) of every rotary class: the classes named for
    it (Rotary, Rope), and those that hf_grid_families drives under other names (RoFormer's
    sinusoidal embedding)."""
    import hf_grid_families
    import torch

    found = []
    for family, name in modules():
        module = importlib.import_module(name)
        for cls_name, cls in vars(module).items():
            if (
                isinstance(cls, type)
                and cls.__module__ == name
                and re.search("Rotary|Rope[A-Z]", cls_name)
                and issubclass(cls, torch.nn.Module)
            ):
                found.append((family, name, cls_name))
    known = {(name, cls_name) for _, name, cls_name in found}
    found += [
        (name.split(".")[2], name, cls_name)
        for name, cls_name in hf_grid_families.COMPONENTS
        if (name, cls_name) not in known
    ]
    return found


def _config_class(cls):
    """The config class a module's constructor annotates, or None."""
    from transformers import PreTrainedConfig

    params = list(inspect.signature(cls.__init__).parameters)
    try:
        hints = typing.get_type_hints(cls.__init__)
    except Exception:  # noqa: BLE001 - annotations that do not resolve
        hints = {}
    kind = hints.get(params[1]) if len(params) > 1 else None
    if isinstance(kind, type) and issubclass(kind, PreTrainedConfig):
        return kind
    return None


def _sub_configs(config):
    from transformers import PreTrainedConfig

    found = [config]
    for value in vars(config).values():
        if isinstance(value, PreTrainedConfig):
            found += _sub_configs(value)
    return found


class _Fixed:
    """A Linear layer's stand-in: a fixed random output of the right width for each input
    shape, the same in both runs."""

    def __new__(cls, name, out_features):
        import torch

        class Fixed(torch.nn.Module):
            def forward(self, x, *args, **kwargs):
                seed = zlib.crc32(f"{name}{tuple(x.shape)}".encode())
                g = torch.Generator().manual_seed(seed)
                return torch.randn(*x.shape[:-1], out_features, generator=g)

        return Fixed()


def _attention(cls, configs, layer_idx):
    """The attention class built from the first of ``configs`` it takes, on fixed layers."""
    import torch

    params = list(inspect.signature(cls.__init__).parameters.items())[2:]
    error = None
    for config in configs:
        # the other arguments by their names: a layer index, or the config's field of the name
        kwargs = {}
        for name, p in params:
            if name.endswith("_idx"):
                kwargs[name] = layer_idx
            elif p.default is inspect.Parameter.empty and p.kind == p.POSITIONAL_OR_KEYWORD:
                kwargs[name] = True if name == "is_causal" else getattr(config, name, None)
        try:
            with torch.device("meta"):
                attention = cls(config, **kwargs)
            break
        except Exception as e:  # noqa: BLE001 - a config of another part
            error = e
    else:
        raise error
    for name, child in list(attention.named_modules()):
        for child_name, grandchild in list(child.named_children()):
            if isinstance(grandchild, torch.nn.Linear) and grandchild.weight.numel() > 1 << 20:
                setattr(child, child_name, _Fixed(f"{name}.{child_name}", grandchild.out_features))
    size = sum(t.numel() for t in attention.parameters()) + sum(
        t.numel() for t in attention.buffers()
    )
    if size > 1 << 26:
        raise MemoryError(f"{cls.__name__} holds {size} elements besides its Linear layers")
    attention = attention.to_empty(device="cpu").eval()
    # Linear layers random; every other weight (norms, scales after the rotation) one constant,
    # which commutes with a rotation
    g = torch.Generator().manual_seed(zlib.crc32(cls.__name__.encode()))
    linear = {id(p) for m in attention.modules() if isinstance(m, torch.nn.Linear)
              for p in m.parameters()}  # fmt: skip
    with torch.no_grad():
        for tensor in list(attention.parameters()) + list(attention.buffers()):
            if id(tensor) in linear:
                tensor.copy_(torch.randn(tensor.shape, generator=g) / tensor.shape[-1] ** 0.5)
            elif tensor.is_floating_point():
                tensor.fill_(0.5)
    return attention


@contextlib.contextmanager
def _at_apply(module):
    """The module's apply functions made to record what they return (q and k rotated), for
    attention classes that compute their scores themselves."""
    saved = {}
    for name, function in vars(module).items():
        if name.startswith("apply_rotary") and callable(function):
            saved[name] = function

            def recorder(*args, _function=function, **kwargs):
                q, k = _function(*args, **kwargs)[:2]
                raise _Captured(q.detach().clone(), k.detach().clone())

            setattr(module, name, recorder)
    try:
        yield
    finally:
        for name, function in saved.items():
            setattr(module, name, function)


@contextlib.contextmanager
def _recording(module, config):
    """The module's attention function, and torch's scaled_dot_product_attention for classes
    that call it themselves, replaced by _capture."""
    import torch

    old = getattr(module, "eager_attention_forward", None)
    sdpa = torch.nn.functional.scaled_dot_product_attention
    module.eager_attention_forward = _capture
    torch.nn.functional.scaled_dot_product_attention = lambda q, k, *a, **kw: _capture(None, q, k)
    try:
        config._attn_implementation = "eager"
    except Exception:  # noqa: BLE001 - a config that fixes its implementation
        pass
    try:
        yield
    finally:
        torch.nn.functional.scaled_dot_product_attention = sdpa
        if old is not None:
            module.eager_attention_forward = old


def _taker(attention):
    """The argument of the attention's forward that takes the rotary module's output, or None:
    its cos and sin (position_embeddings), or its angles (CLVP's rotary_pos_emb)."""
    params = inspect.signature(attention.forward).parameters
    return next((n for n in ("position_embeddings", "rotary_pos_emb") if n in params), None)


def _run(attention, module, config, hidden, embeddings, extra):
    """(query, key) the attention hands its attention function, given these cos and sin."""
    params = inspect.signature(attention.forward).parameters
    taker = _taker(attention)
    kwargs = {taker: embeddings} if embeddings is not None else {}
    for name, p in params.items():
        if name in ("hidden_states", taker) or p.kind in (
            p.VAR_KEYWORD,
            p.VAR_POSITIONAL,
        ):
            continue
        if p.default is not inspect.Parameter.empty and name != "position_ids":
            continue
        # a hybrid layer's input before its other blocks (Zamba2): the same states; a draft
        # model's context from its main model (MuseGlimmer's assistant): none, so that its keys
        # are its own window's
        if name == "original_hidden_states":
            kwargs[name] = hidden
        elif name == "context_hidden_states":
            kwargs[name] = hidden[..., :0, :]
        else:
            kwargs[name] = extra.get(name)
    for recording in (_recording(module, config), _at_apply(module)):
        with recording:
            try:
                attention(hidden, **kwargs)
            except _Captured as captured:
                return captured.query, captured.key
            except KeyError as e:
                if e.args != ("eager",):
                    raise
                # an attention that looks its function up among transformers' registered ones
                # alone, where "eager" is not (Qwen2.5-Omni's DiT): torch's, replaced too
                config._attn_implementation = "sdpa"
                try:
                    attention(hidden, **kwargs)
                except _Captured as captured:
                    return captured.query, captured.key
    raise RuntimeError("the attention reached neither its attention nor its apply function")


def _identity(at_zero):
    """The rotary output that turns nothing, from the output at position 0 (cos there is the
    attention scaling and sin 0, in whichever order and form the family returns them)."""
    import torch

    if isinstance(at_zero, torch.Tensor):  # complex exponentials (DeepSeek-V2, Llama 4)
        return (at_zero != 0).to(at_zero.dtype)
    return tuple(_identity(t) for t in at_zero)


class _Switch:
    """The family's rotary module where an attention class builds its own: its output as it
    is, or turned into the identity's."""

    def __new__(cls, rotary, identity):
        import torch

        class Switch(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.rotary = rotary
                self.identity = identity

            def forward(self, *args, **kwargs):
                out = self.rotary(*args, **kwargs)
                if self.identity:
                    zero = [
                        torch.zeros_like(a)
                        if isinstance(a, torch.Tensor) and not a.is_floating_point()
                        else a
                        for a in args
                    ]
                    return _identity(self.rotary(*zero, **kwargs))
                return out

        return Switch()


def _close(got, want, x, positions):
    scale = float(np.abs(x).max()) or 1.0
    bound = scale * (1e-5 + 4e-7 * float(np.max(positions)))  # float32 angles: ~eps * m
    err = float(np.abs(np.asarray(got, np.float64) - np.asarray(want, np.float64)).max())
    return err <= bound, err / scale


def _rotate(rope, x, pos, head_axis, deinterleaved):
    """arrayrope's rotation of the family's identity output ``x``: the RoPE covers the last
    rope.head_dim features (all of them, or MLA's rotary part); a family that writes its
    interleaved pairs de-interleaved gives P x at the identity and P R x after."""
    x = np.ascontiguousarray(x)
    if x.shape[-1] == rope.rotary_dim < rope.head_dim:  # an apply function given the rotated
        pad = np.zeros(x.shape[:-1] + (rope.head_dim - rope.rotary_dim,), x.dtype)  # part alone
        return _rotate(rope, np.concatenate([x, pad], -1), pos, head_axis, deinterleaved)[
            ..., : rope.rotary_dim
        ]
    n = rope.head_dim
    part = x[..., x.shape[-1] - n :]
    if deinterleaved:
        perm = np.r_[np.arange(0, n, 2), np.arange(1, n, 2)]
        part = np.ascontiguousarray(part[..., np.argsort(perm)])
    kw = {"head_axis": head_axis} if head_axis is not None else {}
    out = x.copy()
    rotated = rope.rotate(part, pos, **kw)
    out[..., x.shape[-1] - n :] = rotated[..., perm] if deinterleaved else rotated
    return out


BIT_EXACT = "apply_cos_sin of its own tables gives its q and k bit for bit"
HF_ANGLES = "angles='transformers' gives them too"
# Families that normalize q and k after the rotation (so that a scaling rule's attention factor
# cancels there): their results are compared up to that factor.
NORMALIZED_AFTER = frozenset(
    {"hunyuan_v1_dense", "hunyuan_v1_moe", "llama4", "nanochat", "timesfm2_5"}
)


def _same_rope(a, b):
    """Whether two RoPEs rotate alike: configuration, frequencies and pair layout."""
    return (
        (a.head_dim, a.rotary_dim, a.style, a.n_axes, a.scaling)
        == (b.head_dim, b.rotary_dim, b.style, b.n_axes, b.scaling)
        and np.array_equal(a.inv_freq, b.inv_freq)
        and np.array_equal(a._spec.pair_axis, b._spec.pair_axis)
        and a.attention_scaling == b.attention_scaling
    )


def _same_bits(rope, embeddings, q0, q1, k0, k1, pos, head_axis):
    """Whether apply_cos_sin with the family's own cos and sin (float32 q and k) gives the
    family's results bit for bit."""
    import torch

    if not (isinstance(embeddings, tuple) and len(embeddings) == 2) or q0.dtype != np.float32:
        return False
    if not all(isinstance(t, torch.Tensor) and t.is_floating_point() for t in embeddings):
        return False
    cos, sin = (t.detach().numpy() for t in embeddings)
    n = rope.head_dim
    if cos.shape[-1] not in (rope.rotary_dim, rope.rotary_dim // 2):
        return False
    kw = {"style": rope.style, "rotary_dim": rope.rotary_dim}
    if head_axis is not None:
        kw["head_axis"] = head_axis
    else:  # the patches' axis of q, as the positions were shaped
        found = [i for i, size in enumerate(q0.shape[:-1]) if size == cos.shape[0]]
        if not found or cos.ndim != 2:
            return False
        shape = [1] * (q0.ndim - 1) + [cos.shape[-1]]
        shape[found[-1]] = cos.shape[0]
        cos, sin = cos.reshape(shape), sin.reshape(shape)
    try:
        for x0, x1 in ((q0, q1), (k0, k1)):
            got = x0.copy()
            part = np.ascontiguousarray(x0[..., x0.shape[-1] - n :])
            got[..., x0.shape[-1] - n :] = ar.apply_cos_sin(part, cos, sin, **kw)
            if not np.array_equal(got.view(np.uint32), x1.view(np.uint32)):
                return False
    except ar.RopeError:
        return False
    return True


def _repaired(config):
    """Fields the attention classes read that a config class may leave None by default,
    derived as transformers derives them elsewhere."""
    for name in ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts"):
        try:
            value = getattr(config, name, None)
            if isinstance(value, int) and value > 4:  # experts hold no RoPE: four build faster
                setattr(config, name, 4)
        except Exception:  # noqa: BLE001 - a per-layer field of a heterogeneous config
            pass
    # a sparse-attention indexer's sizes, which Qwen4-Exp's config class leaves None (its
    # indexer selects tokens; the attention's own q and k are what is compared)
    for name, value in (
        ("indexer_n_heads", 4), ("indexer_kv_heads", 1), ("indexer_head_dim", 64),
        ("indexer_budget", 16), ("indexer_compress_ratio", 4),
    ):  # fmt: skip
        if getattr(config, name, 0) is None:
            setattr(config, name, value)
    for name, value in (
        ("head_dim", lambda: config.hidden_size // config.num_attention_heads),
        ("num_key_value_heads", lambda: config.num_attention_heads),
    ):
        try:
            if getattr(config, name, None) is None and (
                hasattr(config, name) or name == "num_key_value_heads"
            ):  # None, or no field at all (Moonshine Streaming's layers read one it lacks)
                setattr(config, name, value())
        except Exception:  # noqa: BLE001 - a config without the fields it derives from
            pass
    return config


def _fitted_sections(rotary_cls, rotary, config):
    """The rotary module, rebuilt to rotate the pairs its M-RoPE sections cover where its config
    class's defaults rotate another number: with the fraction of the head they need (GLM-4V's
    checkpoints give partial_rotary_factor 0.5; its config class gives none), or where the
    default head is too small for them, with the head they need at the rotated fraction the
    config gives (GLM-4.5V and Qwen3-Omni-MoE: 128; their config classes give no head_dim)."""
    import torch

    sections = getattr(rotary, "mrope_section", None)
    inv_freq = getattr(rotary, "inv_freq", None)
    parameters = getattr(config, "rope_parameters", None)
    if not (sections and isinstance(inv_freq, torch.Tensor) and isinstance(parameters, dict)):
        return rotary
    pairs = sum(sections)
    if inv_freq.numel() == pairs:
        return rotary
    factor = parameters.get("partial_rotary_factor")
    head_dim = getattr(config, "head_dim", None)
    default_head = head_dim or config.hidden_size // config.num_attention_heads
    if factor is None and 2 * pairs <= default_head:
        config.rope_parameters = {**parameters, "partial_rotary_factor": 2 * pairs / default_head}
    else:
        config.head_dim = round(2 * pairs / (factor or 1.0))
    try:
        return rotary_cls(config)
    except Exception:  # noqa: BLE001 - the family's own defaults stay undriven
        config.rope_parameters = parameters
        config.head_dim = head_dim
        return rotary


def _swap_rotary(attention, rotary_cls, rotary, identity):
    """Put the family's rotary module, switched, wherever the attention holds one; False where
    it holds none."""
    found = False
    for child in list(attention.modules()):
        for child_name, grandchild in list(child.named_children()):
            if isinstance(grandchild, rotary_cls) or type(grandchild).__name__ == "Switch":
                setattr(child, child_name, _Switch(rotary, identity))
                found = True
    return found


def _attention_classes(module, module_name, rotary_cls):
    """Classes of the module that may apply a rotary embedding: attention classes and layers
    (those that neither take its output nor hold the rotary module are passed over when
    built)."""
    import torch

    found = []
    for cls in vars(module).values():
        if not (
            isinstance(cls, type)
            and cls.__module__ == module_name
            and issubclass(cls, torch.nn.Module)
            and cls is not rotary_cls
            and re.search("Attention|MLA|Layer|Block", cls.__name__)
        ):
            continue
        found.append(cls)
    # attention classes first: a layer holds one, and more besides
    return sorted(found, key=lambda c: not re.search("Attention|MLA", c.__name__))


# The variants each family is also driven with: YaRN at a quarter of the family's length, half
# the head rotated (which the default rope of most families ignores, as arrayrope must too), and
# one more scaling rule, each family its own (by its rotary class's name), so that every rule is
# driven through some four dozen families' code. Each applies to a config's default parameters,
# flat or per layer type: f(parameters, length, rotated width, rotary class name).
SCALING_RULES = ("linear", "dynamic", "llama3", "longrope")


def _scaling_rule(name):
    return SCALING_RULES[zlib.crc32(name.encode()) % len(SCALING_RULES)]


def _scaled(parameters, length, dim, name):
    kind, orig = _scaling_rule(name), max(16, length // 4)
    if kind in ("linear", "dynamic"):
        return {**parameters, "rope_type": kind, "factor": 2.0}
    if kind == "llama3":
        return {
            **parameters, "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": orig,
        }  # fmt: skip
    pairs = max(1, dim // 2)
    return {
        **parameters, "rope_type": "longrope", "original_max_position_embeddings": orig,
        "short_factor": [1.0 + 0.05 * i for i in range(pairs)],
        "long_factor": [1.0 + 0.5 * i for i in range(pairs)],
    }  # fmt: skip


VARIANTS = {
    "yarn": lambda parameters, length, dim, name: {
        **parameters, "rope_type": "yarn", "factor": 4.0,
        "original_max_position_embeddings": max(16, length // 4),
    },
    "partial": lambda parameters, length, dim, name: {
        **parameters, "rope_type": "default", "partial_rotary_factor": 0.5
    },
    "scaled": _scaled,
}  # fmt: skip


def _took(variant, parameters, name):
    """Whether rope parameters (one layer type's) are a variant's."""
    if variant == "yarn":
        return parameters.get("rope_type") == "yarn"
    if variant == "partial":
        return parameters.get("partial_rotary_factor") == 0.5
    return parameters.get("rope_type") == _scaling_rule(name)


def drive(module_name, rotary_name, seed=0, variant=None):
    """The Outcome of one rotary class, with the config class's defaults or, with a
    ``variant`` of VARIANTS, their rope parameters changed so: from the first part of a
    composite config that builds it and drives it (Qwen3-Omni-MoE's rotary class serves its code
    predictor and its vocoder, and its text part's defaults give an odd head). Modules that make
    their positions from a grid are driven by hf_grid_families."""
    import hf_grid_families

    found = hf_grid_families.drive_grid(module_name, rotary_name, variant)
    if found is None:
        found = _drive_hidden_states(module_name, rotary_name, seed, variant)
    if found is not None:
        return found
    first = None
    for part in itertools.count():
        result = _drive(module_name, rotary_name, seed, variant, part)
        if result is None:  # no further part builds it
            return first
        if result.status != UNDRIVEN:
            return result
        first = first or result


def _drive_hidden_states(module_name, rotary_name, seed, variant):
    """The Outcome of a rotary class whose attention rotates its input hidden states, viewed as
    heads, before its q and k projections (the conformer speech encoders: an attention class
    with its own _apply_rotary_embedding), or None for other classes. Driven with the config
    class's defaults and the rotary position embedding its config chooses."""
    import torch

    module = importlib.import_module(module_name)
    family = module_name.split(".")[2]
    attentions = [c for c in vars(module).values() if hasattr(c, "_apply_rotary_embedding")]
    if not attentions:
        return None
    rotary_cls = getattr(module, rotary_name)
    config = next(
        c.config_class() for name, c in vars(module).items()
        if name.endswith("PreTrainedModel") and c.__module__ == module_name
    )  # fmt: skip
    if variant is not None:  # no rope parameters to vary
        return Outcome(family, rotary_name, config.model_type, UNDRIVEN, "no rope parameters")
    config.position_embeddings_type = "rotary"
    rng = np.random.default_rng(zlib.crc32(rotary_name.encode()) + seed)
    B, T = 2, 7
    hidden = torch.from_numpy(rng.standard_normal((B, T, config.hidden_size)).astype(np.float32))
    embeddings = rotary_cls(config)(hidden)
    theirs = attentions[0](config)._apply_rotary_embedding(hidden, embeddings).numpy()
    try:
        rope = ar.RoPE.from_hf_config(config)
    except ar.RopeError as e:
        return Outcome(family, rotary_name, config.model_type, REFUSED, str(e))
    x = hidden.numpy().reshape(B, T, -1, rope.head_dim)
    pos = np.arange(T)[:, None]  # along the sequence, each head alike
    ours = rope.rotate(x, pos).reshape(B, T, -1)
    ok, err = _close(ours, theirs, x, pos)
    status, note = (MATCH, "hidden states rotated") if ok else (WRONG, f"off by {err:.2g}")
    return Outcome(family, rotary_name, config.model_type, status, f"{note}: {rope!r}")


def _drive(module_name, rotary_name, seed, variant, part):
    """drive() with the ``part``-th config that builds the rotary class; None where there is
    none."""
    import torch

    module = importlib.import_module(module_name)
    rotary_cls = getattr(module, rotary_name)
    family = module_name.split(".")[2]

    def outcome(status, detail, model_type=None):
        return Outcome(family, rotary_name, model_type, status, detail[:300])

    config_cls = _config_class(rotary_cls)
    if config_cls is None and "config" in inspect.signature(rotary_cls.__init__).parameters:
        # a constructor that takes a config without saying which (CLVP's): the family's own
        config_cls = next(
            (c.config_class for name, c in vars(module).items()
             if name.endswith("PreTrainedModel") and c.__module__ == module_name),
            None,
        )  # fmt: skip
    if config_cls is None:
        return outcome(UNDRIVEN, "its constructor takes no transformers config")
    try:
        top = config_cls()
    except Exception as error:  # noqa: BLE001
        return outcome(UNDRIVEN, f"its config class has no defaults: {error!r}")
    config, rotary, error = None, None, None
    for candidate in _sub_configs(top):
        # per-layer-type parameters that a config class leaves empty (Cohere Compass's): the
        # default rope for each of its layer types
        types = getattr(candidate, "layer_types", None)
        if getattr(candidate, "rope_parameters", None) == {} and types:
            theta = getattr(candidate, "default_theta", None) or 10000.0
            candidate.rope_parameters = {
                t: {"rope_type": "default", "rope_theta": theta} for t in dict.fromkeys(types)
            }
    # a family whose config chooses its position embedding (ESM: absolute by default,
    # GraniteMoeHybrid: none) is driven with its rotary one, by the name its code compares
    source = inspect.getsource(module)
    rotary_value = "rope" if re.search(r'position_embedding_type == "rope"', source) else "rotary"
    for candidate in _sub_configs(top):
        if getattr(candidate, "position_embedding_type", rotary_value) != rotary_value:
            candidate.position_embedding_type = rotary_value
    if variant is not None:
        for candidate in _sub_configs(top):
            parameters = getattr(candidate, "rope_parameters", None)
            if not isinstance(parameters, dict):
                continue
            keys = getattr(candidate, "nested_rope_parameter_keys", lambda p: [])(parameters)
            length = getattr(candidate, "max_position_embeddings", None) or 4096
            try:
                head = getattr(candidate, "head_dim", None) or (
                    (getattr(candidate, "hidden_size", None) or 0)
                    // (getattr(candidate, "num_attention_heads", None) or 1)
                )
            except Exception:  # noqa: BLE001 - a per-layer head size (Gemma 4's)
                head = 0

            mla = getattr(candidate, "qk_rope_head_dim", None) is not None

            def varied(params, head=head, length=length, mla=mla):
                # a partial factor of an MLA config's head_dim would reach past its rotary part
                if params.get("rope_type") != "default" or (mla and variant == "partial"):
                    return params
                partial = params.get("partial_rotary_factor")
                dim = int(head * partial) if partial else head
                return VARIANTS[variant](params, length, dim, rotary_name)

            if not keys:
                candidate.rope_parameters = varied(parameters)
            else:
                candidate.rope_parameters = {
                    k: varied(v) if k in keys and isinstance(v, dict) else v
                    for k, v in parameters.items()
                }
    for candidate in _sub_configs(top):
        _repaired(candidate)  # before the rotary module reads it: a variant's fields too
        # a family whose config switches its rotary embedding off by default (Zamba2's
        # use_mem_rope) is driven with it on
        for name, value in vars(candidate).items():
            if name.startswith("use_") and "rope" in name and value is False:
                setattr(candidate, name, True)
    built = 0
    for candidate in _sub_configs(top):
        try:
            rotary = rotary_cls(candidate)
        except Exception as e:  # noqa: BLE001 - the sub-config it does not take
            error = e
            continue
        if built == part:
            config = candidate
            break
        built += 1
    if config is None and part > 0:
        return None
    if config is None:
        return outcome(UNDRIVEN, f"no config of {config_cls.__name__} builds it: {error!r}")
    model_type = getattr(config, "model_type", None)
    parameters = getattr(config, "rope_parameters", None) or {}
    keys = getattr(config, "nested_rope_parameter_keys", lambda p: [])(parameters)
    layers = [parameters[k] for k in keys if isinstance(parameters.get(k), dict)] or [parameters]
    if variant is not None and not any(_took(variant, p, rotary_name) for p in layers):
        return outcome(UNDRIVEN, "its config has no default rope parameters to vary", model_type)
    for c in _sub_configs(top):
        # DBRX's attention reads rope_theta from its attention sub-config, which transformers
        # 5 moved into the top config's rope parameters, and clamps by clip_qkv, which its
        # config class leaves None (its checkpoints give 8)
        if c is not config and not hasattr(c, "rope_theta") and hasattr(c, "kv_n_heads"):
            c.rope_theta = (getattr(config, "rope_parameters", None) or {}).get("rope_theta")
            if getattr(c, "clip_qkv", 0) is None:
                c.clip_qkv = 8.0
    rotary = _fitted_sections(rotary_cls, rotary, config)

    rng = np.random.default_rng(zlib.crc32(rotary_name.encode()) + seed)
    rope_parameters = getattr(config, "rope_parameters", None) or {}
    keys = getattr(config, "nested_rope_parameter_keys", lambda p: [])(rope_parameters)
    nested = {k: rope_parameters[k] for k in keys}
    flat = rope_parameters if not nested else {}
    axial = flat.get("rope_type") == "axial"
    sections = getattr(rotary, "mrope_section", None) or flat.get("mrope_section")
    B, T = 2, 5
    top_position = min(3000, (getattr(config, "max_position_embeddings", None) or 4096) - T)
    if axial:
        # (patch, axis) coordinates, with the fewest axes that give the widest rotation that
        # fits a head
        head = getattr(config, "head_dim", None) or (
            (getattr(config, "embed_dim", None) or getattr(config, "hidden_size", 0))
            // (getattr(config, "num_attention_heads", None) or 1)
        )
        widths = {}
        # (patches, axes), or with a batch axis first (Gemma 4's vision tower)
        for lead in ((), (1,)):
            for n_axes in (2, 3):
                try:
                    found = rotary(torch.zeros(1), torch.zeros(*lead, 4, n_axes))[0]
                    if found.shape[-2] == 4:  # a row per patch
                        widths[lead, n_axes] = found.shape[-1]
                except Exception:  # noqa: BLE001 - not this many axes
                    pass
        fitting = {k: w for k, w in widths.items() if w <= head} or widths
        lead, n_axes = max(fitting, key=lambda k: (fitting[k], -len(k[0]), -k[1]), default=((), 2))
        positions, head_axis = rng.integers(0, 64, size=(B * T, n_axes)), None
        position_ids = torch.from_numpy(positions.reshape(*lead, B * T, n_axes))
    elif sections:
        position_ids = torch.from_numpy(rng.integers(0, top_position, size=(3, B, T)))
        positions, head_axis = np.moveaxis(position_ids.numpy(), 0, -1), 1
    else:
        start = rng.integers(0, top_position, size=(B, 1))
        position_ids = torch.from_numpy(start + np.arange(T)[None])
        positions, head_axis = position_ids.numpy(), 1

    forward = inspect.signature(rotary.forward).parameters
    positionless = list(forward) == ["hidden_states"]
    if positionless and not (axial or sections):  # positions into the module's T angles
        position_ids = torch.from_numpy(rng.integers(0, T, size=(B, T)))
        positions = position_ids.numpy()
    layer_types = list(dict.fromkeys(getattr(config, "layer_types", None) or [None]))
    if nested:  # the layer types that have parameters, else the labels that key them
        layer_types = [t for t in layer_types if nested.get(t) is not None] or [
            t for t in nested if nested[t] is not None
        ]
    attentions = _attention_classes(module, module_name, rotary_cls)
    hidden_size = getattr(config, "hidden_size", None) or 8
    extra = {"position_ids": position_ids, "cache_position": torch.arange(T)}
    if not axial:  # where an attention class needs a mask: one that hides nothing
        extra["attention_mask"] = torch.zeros(B, 1, T, T)
    else:
        extra["cu_seqlens"] = torch.tensor([0, B * T], dtype=torch.int32)
    configs = [config] + [c for c in _sub_configs(top) if c is not config]

    def _nope(attention_cls, layer_type, layer_idx, hidden, embeddings, at_zero):
        """A layer that ignores its rotary embedding: where every layer of its type does (its
        next one too), from_hf_layers must give that type None."""
        all_types = getattr(config, "layer_types", None) or []
        later = [i for i, t in enumerate(all_types) if t == layer_type and i > layer_idx]
        if layer_type is None:
            return UNDRIVEN, f"{attention_cls.__name__} ignores its rotary embedding"
        if later:
            again = compare(attention_cls, layer_type, later[0], hidden, embeddings, at_zero, True)
            if again is not None:
                return None  # NoPE by layer index (SmolLM3's no_rope_layers), not by type
        try:
            got = ar.RoPE.from_hf_layers(config).get(layer_type)
        except ar.RopeError as e:
            return REFUSED, str(e)
        if got is not None:
            return (
                WRONG,
                f"layers of type {layer_type!r} take no RoPE, and from_hf_layers gives one",
            )
        return MATCH, f"{attention_cls.__name__}[{layer_type}]: no RoPE, and none given"

    def attempt(hidden):
        results = []
        for layer_type in layer_types:
            all_types = getattr(config, "layer_types", None) or []
            layer_idx = all_types.index(layer_type) if layer_type in all_types else 0
            args = (layer_type,) if "layer_type" in forward and layer_type is not None else ()
            try:
                if positionless:  # the angles of positions 0, 1, ..., T-1, which the
                    embeddings = rotary(hidden)  # attention picks by position ids
                    at_zero = torch.zeros_like(embeddings)
                else:
                    embeddings = rotary(hidden, position_ids, *args)
                    at_zero = rotary(hidden, torch.zeros_like(position_ids), *args)
            except Exception as e:  # noqa: BLE001
                results.append((UNDRIVEN, f"its forward: {e!r}"))
                continue
            for attention_cls in attentions:
                if not re.search("Attention|MLA", attention_cls.__name__) and any(
                    r[0] != UNDRIVEN for r in results
                ):
                    break
                result = compare(attention_cls, layer_type, layer_idx, hidden, embeddings, at_zero)
                if result is not None:
                    results.append(result)
        return results

    def compare(attention_cls, layer_type, layer_idx, hidden, embeddings, at_zero, once=False):
        try:
            attention = _attention(attention_cls, configs, layer_idx)
            if _taker(attention) is not None:
                runs = [_identity(at_zero), embeddings]
            elif _swap_rotary(attention, rotary_cls, rotary, True):
                runs = [True, False]
            else:
                return None
            captured = []
            for run in runs:
                if isinstance(run, bool):
                    _swap_rotary(attention, rotary_cls, rotary, run)
                    run = None
                captured.append(_run(attention, module, config, hidden, run, extra))
        except Exception as e:  # noqa: BLE001 - an attention class of another part
            return UNDRIVEN, f"{attention_cls.__name__}: {e!r}"
        (q0, k0), (q1, k1) = captured
        if torch.equal(q0, q1) and torch.equal(k0, k1):  # a layer without RoPE (NoPE)
            if once:
                return None
            return _nope(attention_cls, layer_type, layer_idx, hidden, embeddings, at_zero)
        where = f"{attention_cls.__name__}[{layer_type}]"
        return judge(where, layer_type, q0, k0, q1, k1, embeddings)

    def judge(where, layer_type, q0, k0, q1, k1, embeddings):
        """(status, detail) of from_hf_config's RoPE against the family's q and k before
        (q0, k0) and after (q1, k1) its rotation."""
        kw = {"layer_type": layer_type} if nested else {}
        try:
            rope = ar.RoPE.from_hf_config(config, **kw)
        except ar.RopeError as e:
            return REFUSED, str(e)
        try:  # the same config as transformers writes it, read as a dict
            again = ar.RoPE.from_hf_config(config.to_dict(), **kw)
        except ar.RopeError as e:
            return WRONG, f"its config as a dict is refused: {e}"
        if not _same_rope(rope, again):
            return WRONG, f"its config as a dict gives {again!r}, the object {rope!r}"
        q0, k0, q1, k1 = (t.numpy() for t in (q0, k0, q1, k1))
        pos, axis = positions, head_axis
        if axial:  # the patches run along one axis of the family's q: positions follow it
            found = [i for i, n in enumerate(q0.shape[:-1]) if n == B * T]
            if not found:
                return UNDRIVEN, f"{where}: no axis of q {q0.shape} holds the patches"
            shape = [1] * (q0.ndim - 1) + [positions.shape[-1]]
            shape[found[-1]] = B * T
            pos = positions.reshape(shape)
        # a family whose config says rope_interleave may write its interleaved pairs
        # de-interleaved, and one that normalizes q and k after the rotation divides the
        # attention scaling out again
        scales = {1.0, rope.attention_scaling} if family in NORMALIZED_AFTER else {1.0}
        layouts = (False, True) if getattr(config, "rope_interleave", None) else (False,)
        try:
            for deinterleaved in layouts:
                for scale in scales:
                    got_q = _rotate(rope, q0, pos, axis, deinterleaved) / scale
                    got_k = _rotate(rope, k0, pos, axis, deinterleaved) / scale
                    ok_q, err_q = _close(got_q, q1, q0, pos)
                    ok_k, err_k = _close(got_k, k1, k0, pos)
                    if ok_q and ok_k:
                        break
                if ok_q and ok_k:
                    break
        except ar.RopeError as e:
            return WRONG, f"{where}: arrayrope refused the family's arrays: {e}"
        if ok_q and ok_k:
            note = ", written de-interleaved" if deinterleaved else ""
            if scale != 1.0:
                note += ", attention scaling normalized away after the rotation"
            elif not deinterleaved and _same_bits(rope, embeddings, q0, q1, k0, k1, pos, axis):
                note += ", " + BIT_EXACT
                hf = ar.RoPE.from_hf_config(config, angles="transformers", **kw)
                same = (_rotate(hf, a, pos, axis, False) for a in (q0, k0))
                if all(np.array_equal(a.view(np.uint32), b.view(np.uint32))
                       for a, b in zip(same, (q1, k1))):  # fmt: skip
                    note += ", " + HF_ANGLES
            return MATCH, f"{where}{note}: {rope!r}"  # the notes first: details are cut at 300
        return WRONG, f"{where}: {rope!r} off by {err_q:.2g} (q), {err_k:.2g} (k)"

    # a vision tower's attention takes its patches with or without a batch axis
    shapes = [(B, T, hidden_size)]
    if axial:
        shapes = (
            [(1, B * T, hidden_size)] if lead else [(B * T, hidden_size), (1, B * T, hidden_size)]
        )
    best = None
    for shape in shapes:
        hidden = torch.from_numpy(rng.standard_normal(shape).astype(np.float32))
        results = attempt(hidden)
        if not results:
            results = [(UNDRIVEN, "no attention class of its module runs it")]
        status = min((r[0] for r in results), key=_RANK.get)
        found = (status, next(r[1] for r in results if r[0] == status))
        if best is None or _BEST[found[0]] < _BEST[best[0]]:
            best = found
        if best[0] == MATCH:
            break
    apply = getattr(module, "apply_rotary_pos_emb", None)
    if best[0] == UNDRIVEN and apply and list(inspect.signature(apply).parameters)[0] == "x":
        # an apply function that rotates one tensor, which the attention calls on q and on its
        # key-value rows (DeepSeek-V4, whose attention takes a cos and sin per label of its rope
        # parameters): that function alone, on random rows of the config's head size
        results = []
        g = torch.Generator().manual_seed(zlib.crc32(rotary_name.encode()) + seed)
        for layer_type in layer_types:
            args = (layer_type,) if "layer_type" in forward and layer_type is not None else ()
            embeddings = rotary(hidden, position_ids, *args)
            identity = _identity(rotary(hidden, torch.zeros_like(position_ids), *args))
            q, k = (torch.randn(B, n, T, config.head_dim, generator=g) for n in (4, 1))
            before, after = (
                [apply(x, *identity) for x in (q, k)],
                [apply(x, *embeddings) for x in (q, k)],
            )
            where = f"{module_name.split('.')[-1]}.apply_rotary_pos_emb[{layer_type}]"
            results.append(judge(where, layer_type, *before, *after, embeddings))
        status = min((r[0] for r in results), key=_RANK.get)
        best = (status, next(r[1] for r in results if r[0] == status))
    try:
        heads = config.num_attention_heads
    except Exception:  # noqa: BLE001 - none, or one per layer (a heterogeneous config)
        heads = None
    if best[0] == UNDRIVEN and not (axial or sections) and isinstance(heads, int):
        # attention that reads one position per head, the same for every token (NeuCodec and
        # Xcodec2, whose position ids run over heads): arrayrope's positions (1, heads, 1)
        position_ids = torch.from_numpy(rng.integers(0, top_position, size=(1, heads)))
        positions, head_axis = position_ids.numpy()[..., None], None
        extra["position_ids"] = position_ids
        results = attempt(hidden)
        if results and min((r[0] for r in results), key=_RANK.get) != UNDRIVEN:
            status = min((r[0] for r in results), key=_RANK.get)
            best = (status, next(r[1] for r in results if r[0] == status) + ", a position per head")
    return outcome(best[0], best[1], model_type)


def main():
    import transformers

    warnings.filterwarnings("ignore")
    transformers.logging.set_verbosity_error()
    counts = {}
    for family, module_name, rotary_name in components():
        for variant in (None, *VARIANTS):
            result = drive(module_name, rotary_name, variant=variant)
            counts[result.status, variant] = counts.get((result.status, variant), 0) + 1
            if BIT_EXACT in result.detail:
                counts["bit for bit", variant] = counts.get(("bit for bit", variant), 0) + 1
            if HF_ANGLES in result.detail:
                counts["angles", variant] = counts.get(("angles", variant), 0) + 1
            print(f"{result.status:9} {family:24} {result.rotary:40} {variant or '':5} "
                  f"{result.detail}", flush=True)  # fmt: skip
    print(counts, file=sys.stderr)


if __name__ == "__main__":
    main()

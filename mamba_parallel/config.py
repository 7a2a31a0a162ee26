"""MambaConfig: the model description, with the field names people know from mamba_ssm, plus named presets.

Glossary (code name -> paper symbol): ``d_model`` = D (residual width), ``d_inner`` = expand * D (mixer width),
``d_state`` = N (SSM state size), ``headdim`` = P (Mamba-2 head size), ``nheads`` = H = d_inner / P,
``ngroups`` = G (B/C groups), ``dt`` = Δ, ``A``/``B``/``C``/``D`` as in the papers, ``z`` = the gate.
"""

from __future__ import annotations

import copy
import json
import math
from dataclasses import MISSING, asdict, dataclass, field, fields
from typing import Any

# Defaults of each mixer's ssm_cfg, as in mamba_ssm (Mamba / Mamba2 constructors).
MAMBA1_DEFAULTS: dict[str, Any] = dict(
    d_state=16, d_conv=4, expand=2, dt_rank="auto", dt_min=0.001, dt_max=0.1, dt_init="random",
    dt_scale=1.0, dt_init_floor=1e-4, conv_bias=True, bias=False,
    # Falcon-Mamba: weightless RMS norms on dt_low, B and C after x_proj (eps in fp32)
    bcdt_rms_norm=False, bcdt_rms_eps=1e-6,
)
MAMBA2_DEFAULTS: dict[str, Any] = dict(
    d_state=128, d_conv=4, expand=2, headdim=64, ngroups=1, chunk_size=256, A_init_range=(1, 16),
    dt_min=0.001, dt_max=0.1, dt_init_floor=1e-4, dt_limit=(0.0, float("inf")), conv_bias=True, bias=False,
    rmsnorm=True, norm_before_gate=False, D_has_hdim=False,
)
# Mamba3 constructor (mamba_ssm.modules.mamba3): no conv; A per token, floored at A_floor; rotary on a fraction of
# the state; is_mimo with mimo_rank R (chunk_size 64 / R recommended there).
MAMBA3_DEFAULTS: dict[str, Any] = dict(
    d_state=128, expand=2, headdim=64, ngroups=1, rope_fraction=0.5, dt_min=0.001, dt_max=0.1, dt_init_floor=1e-4,
    A_floor=1e-4, is_outproj_norm=False, is_mimo=False, mimo_rank=4, chunk_size=64,
)
ATTN_DEFAULTS: dict[str, Any] = dict(
    num_heads=None, num_heads_kv=None, head_dim=None, rotary_emb_dim=None, rotary_emb_base=10000.0,
    qkv_proj_bias=True, out_proj_bias=True, causal=True,
)
# The feed-forward of d_intermediate > 0: "swiglu" (mamba_ssm's GatedMLP: fc1 -> [value | gate]) or "relu2"
# (Nemotron-H's fc2(relu(fc1(x))^2)); the width is rounded up to a multiple of multiple_of, as mamba_ssm does.
MLP_DEFAULTS: dict[str, Any] = dict(activation="swiglu", bias=False, multiple_of=128)
MLP_ACTIVATIONS = ("swiglu", "relu2")
LAYER_KINDS = ("Mamba1", "Mamba2", "Mamba3")
_MIXER_DEFAULTS = {"Mamba1": MAMBA1_DEFAULTS, "Mamba2": MAMBA2_DEFAULTS, "Mamba3": MAMBA3_DEFAULTS}


class ConfigError(ValueError):
    """An inconsistent or unknown configuration; the message names the field."""


def _type_problem(value: Any, example: Any) -> str | None:
    """Why ``value`` cannot stand where the default is ``example`` (None when it can)."""
    kind = type(example)
    if kind is bool:
        ok, want = isinstance(value, bool), "true or false"
    elif kind is int:
        ok, want = isinstance(value, int) and not isinstance(value, bool), "an integer"
    elif kind is float:
        ok, want = isinstance(value, (int, float)) and not isinstance(value, bool), "a number"
    elif kind is tuple:
        ok = isinstance(value, (list, tuple)) and len(value) == len(example) and all(
            isinstance(x, (int, float)) and not isinstance(x, bool) for x in value)
        want = f"a list of {len(example)} numbers"
    elif example is None:  # an optional integer (attention heads, rotary dims)
        ok, want = value is None or isinstance(value, int) and not isinstance(value, bool), "an integer"
    elif kind is list:  # layer indices
        ok, want = value is None or isinstance(value, (list, tuple)), "a list"
    elif kind is dict:
        ok, want = value is None or isinstance(value, dict), "a table"
    elif example == "auto":  # dt_rank
        ok, want = value == "auto" or isinstance(value, int) and not isinstance(value, bool), '"auto" or an integer'
    else:
        ok, want = isinstance(value, kind), f"a {kind.__name__}"
    return None if ok else f"must be {want}, got {value!r} ({type(value).__name__})"


def check_types(config: "MambaConfig") -> None:
    """ConfigError naming the first field (nested ones as ``ssm_cfg.headdim``) whose value has the wrong type
    (a TOML string where a number belongs, true where an integer belongs ...)."""
    for f in fields(config):
        example = f.default_factory() if f.default_factory is not MISSING else f.default
        problem = _type_problem(getattr(config, f.name), example)
        if problem:
            raise ConfigError(f"MambaConfig.{f.name}: {problem}")
    for name in ("attn_layer_idx", "mlp_layer_idx"):
        for i in getattr(config, name) or ():
            if problem := _type_problem(i, 0):
                raise ConfigError(f"MambaConfig.{name}: every entry {problem}")
    layer = (config.ssm_cfg or {}).get("layer", "Mamba1")
    defaults = MAMBA2_DEFAULTS if layer == "Mamba2" else MAMBA1_DEFAULTS
    for table, known in (("ssm_cfg", defaults), ("attn_cfg", ATTN_DEFAULTS), ("mlp_cfg", MLP_DEFAULTS)):
        for key, value in (getattr(config, table) or {}).items():
            example = 1.0 if key == "expand" else known.get(key)  # expand may be fractional (d_inner is checked)
            problem = _type_problem(value, example) if key in known else None
            if problem:
                raise ConfigError(f"MambaConfig.{table}.{key}: {problem}")


@dataclass
class MambaConfig:
    """A Mamba-1 / Mamba-2 / Mamba-3 / hybrid language model.

    ``ssm_cfg["layer"]`` picks the mixer ("Mamba1", "Mamba2" or "Mamba3"); other ``ssm_cfg`` keys override the mixer
    defaults above. ``attn_layer_idx`` lists the layers that are attention instead (hybrid stacks), configured by
    ``attn_cfg``. ``d_intermediate > 0`` adds an MLP (``mlp_cfg``) after every mixer, as mamba_ssm does; or, when
    ``mlp_layer_idx`` lists layers, those layers ARE MLP blocks (norm -> MLP -> residual, Nemotron-H's "-") and
    the mixer layers carry none.
    """

    d_model: int = 2560
    d_intermediate: int = 0
    n_layer: int = 64
    vocab_size: int = 50277
    ssm_cfg: dict = field(default_factory=dict)
    attn_layer_idx: list = field(default_factory=list)
    attn_cfg: dict = field(default_factory=dict)
    rms_norm: bool = True
    residual_in_fp32: bool = True
    fused_add_norm: bool = True
    pad_vocab_size_multiple: int = 8
    tie_embeddings: bool = True
    norm_epsilon: float = 1e-5
    initializer_range: float = 0.02
    rescale_prenorm_residual: bool = True
    mlp_layer_idx: list = field(default_factory=list)
    mlp_cfg: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        check_types(self)
        self.ssm_cfg = dict(self.ssm_cfg or {})
        self.attn_cfg = dict(self.attn_cfg or {})
        self.attn_layer_idx = list(self.attn_layer_idx or [])
        self.mlp_layer_idx = list(self.mlp_layer_idx or [])
        self.mlp_cfg = dict(self.mlp_cfg or {})
        self.validate()

    # ---- derived values -------------------------------------------------------------------------------------
    @property
    def layer(self) -> str:
        return self.ssm_cfg.get("layer", "Mamba1")

    @property
    def mixer_cfg(self) -> dict:
        """ssm_cfg merged over the defaults of the chosen mixer (without the "layer" key)."""
        out = dict(_MIXER_DEFAULTS.get(self.layer, MAMBA1_DEFAULTS))
        out.update({k: v for k, v in self.ssm_cfg.items() if k != "layer"})
        return out

    @property
    def d_inner(self) -> int:
        return int(self.mixer_cfg["expand"] * self.d_model)

    @property
    def nheads(self) -> int:
        return self.d_inner // self.mixer_cfg["headdim"] if self.layer in ("Mamba2", "Mamba3") else 0

    @property
    def dt_rank(self) -> int:
        r = self.mixer_cfg.get("dt_rank", "auto")
        return math.ceil(self.d_model / 16) if r == "auto" else int(r)

    @property
    def padded_vocab_size(self) -> int:
        m = self.pad_vocab_size_multiple
        return self.vocab_size if m <= 1 else (self.vocab_size + m - 1) // m * m

    @property
    def attn_params(self) -> dict:
        """attn_cfg over the defaults, heads filled in (num_heads_kv defaults to num_heads)."""
        out = dict(ATTN_DEFAULTS)
        out.update(self.attn_cfg)
        if out["num_heads"] is None:
            out["num_heads"] = max(1, self.d_model // 64)
        if out["num_heads_kv"] is None:
            out["num_heads_kv"] = out["num_heads"]
        if out["head_dim"] is None:
            out["head_dim"] = self.d_model // out["num_heads"]
        return out

    @property
    def mlp_params(self) -> dict:
        """mlp_cfg over MLP_DEFAULTS."""
        return {**MLP_DEFAULTS, **self.mlp_cfg}

    def layer_kind(self, i: int) -> str:
        """What layer ``i`` is: "attention", "mlp" (an MLP block, mlp_layer_idx) or the SSM mixer (self.layer)."""
        if i in self.attn_layer_idx:
            return "attention"
        if i in self.mlp_layer_idx:
            return "mlp"
        return self.layer

    @property
    def mlp_after_mixer(self) -> bool:
        """True when every mixer is followed by an MLP (mamba_ssm's d_intermediate > 0 layout)."""
        return self.d_intermediate > 0 and not self.mlp_layer_idx

    # ---- checks ---------------------------------------------------------------------------------------------
    def validate(self) -> None:
        def need(ok: bool, name: str, why: str) -> None:
            if not ok:
                raise ConfigError(f"MambaConfig.{name}: {why}")

        for name in ("d_model", "n_layer", "vocab_size"):
            v = getattr(self, name)
            need(isinstance(v, int) and v > 0, name, f"must be a positive integer, got {v!r}")
        need(isinstance(self.d_intermediate, int) and self.d_intermediate >= 0, "d_intermediate",
             f"must be an integer >= 0, got {self.d_intermediate!r}")
        need(self.layer in LAYER_KINDS, "ssm_cfg.layer", f"must be one of {LAYER_KINDS}, got {self.layer!r}")
        allowed = set(_MIXER_DEFAULTS.get(self.layer, MAMBA1_DEFAULTS)) | {"layer"}
        unknown = sorted(set(self.ssm_cfg) - allowed)
        need(not unknown, "ssm_cfg", f"unknown key(s) {unknown} for layer {self.layer}; known: {sorted(allowed)}")
        unknown = sorted(set(self.attn_cfg) - set(ATTN_DEFAULTS))
        need(not unknown, "attn_cfg", f"unknown key(s) {unknown}; known: {sorted(ATTN_DEFAULTS)}")
        c = self.mixer_cfg
        for k in ("d_state", "expand") + (("d_conv",) if "d_conv" in c else ()):
            need(c[k] > 0, f"ssm_cfg.{k}", f"must be > 0, got {c[k]!r}")
        need(float(self.d_inner) == c["expand"] * self.d_model, "ssm_cfg.expand",
             f"expand * d_model = {c['expand'] * self.d_model} must be an integer")
        if self.layer == "Mamba1":
            need(c["bcdt_rms_eps"] > 0, "ssm_cfg.bcdt_rms_eps", f"must be > 0, got {c['bcdt_rms_eps']!r}")
        if self.layer == "Mamba2":
            need(self.d_inner % c["headdim"] == 0, "ssm_cfg.headdim",
                 f"d_inner = {self.d_inner} (expand {c['expand']} x d_model {self.d_model}) is not divisible by "
                 f"headdim = {c['headdim']}")
            need(self.nheads % c["ngroups"] == 0, "ssm_cfg.ngroups",
                 f"nheads = {self.nheads} is not divisible by ngroups = {c['ngroups']}")
            need(c["chunk_size"] > 0, "ssm_cfg.chunk_size", f"must be > 0, got {c['chunk_size']}")
            lo, hi = c["dt_limit"]
            need(0 <= lo < hi, "ssm_cfg.dt_limit", f"must satisfy 0 <= low < high, got {c['dt_limit']}")
        if self.layer == "Mamba3":
            self._validate_mamba3(need)
        need(0 < c["dt_min"] <= c["dt_max"], "ssm_cfg.dt_min", f"need 0 < dt_min <= dt_max, got "
             f"{c['dt_min']}, {c['dt_max']}")
        bad = [i for i in self.attn_layer_idx if not (isinstance(i, int) and 0 <= i < self.n_layer)]
        need(not bad, "attn_layer_idx", f"indices {bad} are outside [0, n_layer={self.n_layer})")
        bad = [i for i in self.mlp_layer_idx if not (isinstance(i, int) and 0 <= i < self.n_layer)]
        need(not bad, "mlp_layer_idx", f"indices {bad} are outside [0, n_layer={self.n_layer})")
        both = sorted(set(self.mlp_layer_idx) & set(self.attn_layer_idx))
        need(not both, "mlp_layer_idx", f"layers {both} are also in attn_layer_idx (a layer is one kind)")
        need(not self.mlp_layer_idx or self.d_intermediate > 0, "mlp_layer_idx",
             "MLP blocks need their width: set d_intermediate > 0")
        unknown = sorted(set(self.mlp_cfg) - set(MLP_DEFAULTS))
        need(not unknown, "mlp_cfg", f"unknown key(s) {unknown}; known: {sorted(MLP_DEFAULTS)}")
        mlp = self.mlp_params
        need(mlp["activation"] in MLP_ACTIVATIONS, "mlp_cfg.activation",
             f"must be one of {MLP_ACTIVATIONS}, got {mlp['activation']!r}")
        need(isinstance(mlp["multiple_of"], int) and mlp["multiple_of"] >= 1, "mlp_cfg.multiple_of",
             f"must be an integer >= 1, got {mlp['multiple_of']!r}")
        if self.attn_layer_idx:
            a = self.attn_params
            need(a["num_heads"] % a["num_heads_kv"] == 0, "attn_cfg.num_heads_kv",
                 f"num_heads = {a['num_heads']} is not divisible by num_heads_kv = {a['num_heads_kv']}")
            rot = a["rotary_emb_dim"]
            need(rot is None or (rot % 2 == 0 and 0 <= rot <= a["head_dim"]), "attn_cfg.rotary_emb_dim",
                 f"must be even and <= head_dim = {a['head_dim']}, got {rot}")
        need(self.pad_vocab_size_multiple >= 1, "pad_vocab_size_multiple", "must be >= 1")

    def _validate_mamba3(self, need) -> None:
        c = self.mixer_cfg
        need(self.d_inner % c["headdim"] == 0, "ssm_cfg.headdim",
             f"d_inner = {self.d_inner} (expand {c['expand']} x d_model {self.d_model}) is not divisible by "
             f"headdim = {c['headdim']}")
        need(self.nheads % c["ngroups"] == 0, "ssm_cfg.ngroups",
             f"nheads = {self.nheads} is not divisible by ngroups = {c['ngroups']}")
        need(c["rope_fraction"] in (0.5, 1.0), "ssm_cfg.rope_fraction", f"must be 0.5 or 1.0, got "
             f"{c['rope_fraction']!r}")
        need(c["d_state"] % 2 == 0 and int(c["d_state"] * c["rope_fraction"]) >= 2, "ssm_cfg.d_state",
             f"must be even and rotate at least one pair (d_state * rope_fraction >= 2), got {c['d_state']}")
        need(c["chunk_size"] > 0, "ssm_cfg.chunk_size", f"must be > 0, got {c['chunk_size']}")
        need(isinstance(c["mimo_rank"], int) and c["mimo_rank"] >= 1, "ssm_cfg.mimo_rank",
             f"must be an integer >= 1, got {c['mimo_rank']!r}")
        need(c["A_floor"] >= 0, "ssm_cfg.A_floor", f"must be >= 0, got {c['A_floor']}")

    def with_layers(self, n_layer: int) -> "MambaConfig":
        """The same stack cut to its first ``n_layer`` layers (every layer kind and width kept): smoke runs, and the
        benchmarks' compile warm-up, which needs each kernel shape once, not each layer."""
        if not (isinstance(n_layer, int) and 1 <= n_layer):
            raise ConfigError(f"MambaConfig.with_layers: n_layer must be an integer >= 1, got {n_layer!r}")
        d = self.to_dict()
        d["n_layer"] = min(n_layer, self.n_layer)
        for name in ("attn_layer_idx", "mlp_layer_idx"):
            d[name] = [i for i in d[name] if i < d["n_layer"]]
        return type(self).from_dict(d)

    # ---- (de)serialisation ------------------------------------------------------------------------------------
    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "MambaConfig":
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ConfigError(f"MambaConfig: unknown field(s) {unknown}; known: {sorted(known)}")
        d = copy.deepcopy(d)
        for k in ("dt_limit", "A_init_range"):
            v = d.get("ssm_cfg", {}).get(k) if isinstance(d.get("ssm_cfg"), dict) else None
            if isinstance(v, (list, tuple)) and not any(_type_problem(x, 0.0) for x in v):  # else: check_types
                # 1e30: how to_json writes inf (mamba_ssm's encoding), read back as inf
                d["ssm_cfg"][k] = tuple(math.inf if float(x) >= 1e30 else float(x) for x in v)
        return cls(**d)

    def to_json(self) -> str:
        d = self.to_dict()
        if "dt_limit" in d["ssm_cfg"]:  # JSON has no inf: keep mamba_ssm's encoding
            d["ssm_cfg"]["dt_limit"] = [x if math.isfinite(x) else 1e30 for x in d["ssm_cfg"]["dt_limit"]]
        return json.dumps(d, indent=2)


# ---- presets ----------------------------------------------------------------------------------------------------
def _m1(d_model: int, n_layer: int) -> dict:
    return dict(d_model=d_model, n_layer=n_layer, vocab_size=50277, ssm_cfg={"layer": "Mamba1"},
                pad_vocab_size_multiple=8)


def _m2(d_model: int, n_layer: int) -> dict:
    return dict(d_model=d_model, n_layer=n_layer, vocab_size=50277, ssm_cfg={"layer": "Mamba2"},
                pad_vocab_size_multiple=16)


def _pattern_layers(pattern: str, kind: str) -> list[int]:
    """Indices of ``kind`` in a Nemotron-H block pattern ("M" Mamba-2, "*" attention, "-" MLP)."""
    return [i for i, c in enumerate(pattern) if c == kind]


def _nemotron_h(d_model: int, pattern: str, d_intermediate: int, vocab_size: int, ssm: dict, attn: dict) -> dict:
    """A Nemotron-H-shaped hybrid: one kind per layer, relu² MLP blocks, attention without rotary or bias."""
    return dict(d_model=d_model, n_layer=len(pattern), d_intermediate=d_intermediate, vocab_size=vocab_size,
                ssm_cfg={"layer": "Mamba2", **ssm}, attn_layer_idx=_pattern_layers(pattern, "*"),
                attn_cfg={"qkv_proj_bias": False, "out_proj_bias": False, **attn},
                mlp_layer_idx=_pattern_layers(pattern, "-"), mlp_cfg={"activation": "relu2"},
                residual_in_fp32=False, pad_vocab_size_multiple=1, tie_embeddings=False)


# Nemotron-H 8B's layer pattern: 24 Mamba-2, 24 MLP, 4 attention layers.
NEMOTRON_H_8B_PATTERN = "M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M-"


def _m3(d_model: int, n_layer: int) -> dict:
    # The Mamba-3 paper's sizes (180M / 440M / 880M / 1.5B): Mamba-2's shapes with the Llama-3 vocabulary.
    return dict(d_model=d_model, n_layer=n_layer, vocab_size=128256, ssm_cfg={"layer": "Mamba3"},
                pad_vocab_size_multiple=16)


PRESETS: dict[str, dict] = {
    "mamba-130m": _m1(768, 24),
    "mamba-370m": _m1(1024, 48),
    "mamba-790m": _m1(1536, 48),
    "mamba-1.4b": _m1(2048, 48),
    "mamba-2.8b": _m1(2560, 64),
    "mamba2-130m": _m2(768, 24),
    "mamba2-370m": _m2(1024, 48),
    "mamba2-780m": _m2(1536, 48),
    "mamba2-1.3b": _m2(2048, 48),
    "mamba2-2.7b": _m2(2560, 64),
    # The 7B-8B class people fine-tune (shapes of the published checkpoints; buildable on the meta device).
    # Mistral's Mamba-Codestral-7B: Mamba-2, 8 B/C groups, untied 32768-token vocabulary (7,285,403,648 params).
    "mamba-codestral-7b": dict(d_model=4096, n_layer=64, vocab_size=32768, ssm_cfg={"layer": "Mamba2", "ngroups": 8},
                               pad_vocab_size_multiple=1, tie_embeddings=False),
    # TII's Falcon-Mamba-7B: Mamba-1 with weightless RMS norms on dt, B and C; untied (7,272,665,088 params).
    "falcon-mamba-7b": dict(d_model=4096, n_layer=64, vocab_size=65024,
                            ssm_cfg={"layer": "Mamba1", "bcdt_rms_norm": True}, pad_vocab_size_multiple=1,
                            tie_embeddings=False),
    # NVIDIA's Nemotron-H 8B shape (8,100,852,736 params); dt is clamped below at dt_min, as transformers does.
    "nemotron-h-8b": _nemotron_h(4096, NEMOTRON_H_8B_PATTERN, 21504, 131072,
                                 ssm={"d_state": 128, "headdim": 64, "ngroups": 8, "chunk_size": 128,
                                      "dt_limit": (0.001, float("inf"))},
                                 attn={"num_heads": 32, "num_heads_kv": 8, "head_dim": 128}),
    "mamba3-180m": _m3(768, 24),
    "mamba3-440m": _m3(1024, 48),
    "mamba3-880m": _m3(1536, 48),
    "mamba3-1.5b": _m3(2048, 48),
    # Tiny sizes for tests and the CPU demo.
    "tiny-mamba": dict(d_model=64, n_layer=2, vocab_size=256, ssm_cfg={"layer": "Mamba1", "d_state": 8},
                       pad_vocab_size_multiple=8),
    "tiny-mamba2": dict(d_model=64, n_layer=2, vocab_size=256,
                        ssm_cfg={"layer": "Mamba2", "d_state": 16, "headdim": 16, "chunk_size": 16},
                        pad_vocab_size_multiple=8),
    "tiny-hybrid": dict(d_model=64, n_layer=4, d_intermediate=128, vocab_size=256,
                        ssm_cfg={"layer": "Mamba2", "d_state": 16, "headdim": 16, "chunk_size": 16},
                        attn_layer_idx=[1], attn_cfg={"num_heads": 4, "num_heads_kv": 2, "rotary_emb_dim": 16},
                        pad_vocab_size_multiple=8),
    "tiny-falcon-mamba": dict(d_model=64, n_layer=2, vocab_size=256, pad_vocab_size_multiple=8,
                              ssm_cfg={"layer": "Mamba1", "d_state": 8, "bcdt_rms_norm": True}),
    "tiny-nemotron-h": _nemotron_h(64, "M*-M-", 128, 256,
                                   ssm={"d_state": 16, "headdim": 16, "ngroups": 2, "chunk_size": 16,
                                        "dt_limit": (0.001, float("inf"))},
                                   attn={"num_heads": 4, "num_heads_kv": 2, "head_dim": 16}),
    "tiny-mamba3": dict(d_model=64, n_layer=2, vocab_size=256,
                        ssm_cfg={"layer": "Mamba3", "d_state": 16, "headdim": 16, "chunk_size": 16},
                        pad_vocab_size_multiple=8),
    "tiny-mamba3-mimo": dict(d_model=64, n_layer=2, vocab_size=256,
                             ssm_cfg={"layer": "Mamba3", "d_state": 16, "headdim": 16, "chunk_size": 8,
                                      "is_mimo": True, "mimo_rank": 2},
                             pad_vocab_size_multiple=8),
    # The embedded default of `mamba-parallel train`: a small byte-level Mamba-2 that learns on 2 CPU cores.
    "small-byte-mamba2": dict(d_model=128, n_layer=4, vocab_size=256,
                              ssm_cfg={"layer": "Mamba2", "d_state": 32, "headdim": 32, "chunk_size": 64},
                              pad_vocab_size_multiple=8),
}


def get_preset(name: str, **overrides: Any) -> MambaConfig:
    """A named preset, e.g. ``get_preset("mamba2-130m")``; keyword overrides replace fields."""
    if name not in PRESETS:
        raise ConfigError(f"unknown preset {name!r}; known presets: {', '.join(PRESETS)}")
    d = copy.deepcopy(PRESETS[name])
    d.update(overrides)
    return MambaConfig.from_dict(d)

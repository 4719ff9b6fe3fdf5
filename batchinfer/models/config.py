"""Model configuration parsed from a Hugging Face `config.json`.

One flat dataclass covers both supported families. `qwen3_5_moe` checkpoints are vision-language
wrappers whose language-model fields sit under `text_config`; older exports put `rope_theta` and
`partial_rotary_factor` flat instead of under `rope_parameters`, and give `full_attention_interval`
instead of an explicit `layer_types` list. All of those spellings end up in the same fields here.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from batchinfer.errors import ConfigError

SUPPORTED_MODEL_TYPES = ("qwen3_moe", "qwen3_5_moe", "qwen3_5_moe_text")
LAYER_TYPES = ("full_attention", "linear_attention")


@dataclass(slots=True)
class ModelConfig:
    model_type: str  # "qwen3_moe" or "qwen3_5_moe" (the text-only "qwen3_5_moe_text" maps here)
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    partial_rotary_factor: float  # 1.0 = full rotary
    max_position_embeddings: int
    tie_word_embeddings: bool
    layer_types: list[str]  # per layer: "full_attention" or "linear_attention"
    attn_output_gate: bool  # q_proj emits a sigmoid gate per head (Qwen3.5)
    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    shared_expert_intermediate_size: int  # 0 = no shared expert
    norm_topk_prob: bool
    # Gated DeltaNet (linear attention) shapes; unused when no layer is linear_attention.
    linear_num_key_heads: int = 0
    linear_num_value_heads: int = 0
    linear_key_head_dim: int = 0
    linear_value_head_dim: int = 0
    linear_conv_kernel_dim: int = 0
    eos_token_ids: list[int] = field(default_factory=list)
    bos_token_id: int | None = None
    pad_token_id: int | None = None

    def __post_init__(self) -> None:
        if len(self.layer_types) != self.num_hidden_layers:
            raise ConfigError(
                f"layer_types has {len(self.layer_types)} entries, expected num_hidden_layers="
                f"{self.num_hidden_layers}"
            )
        bad = sorted(set(self.layer_types) - set(LAYER_TYPES))
        if bad:
            raise ConfigError(f"unsupported layer_types {bad}; supported: {list(LAYER_TYPES)}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(
                f"num_attention_heads={self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads={self.num_key_value_heads}"
            )
        if not 0 < self.num_experts_per_tok <= self.num_experts:
            raise ConfigError(
                f"num_experts_per_tok={self.num_experts_per_tok} must be in 1..num_experts={self.num_experts}"
            )

    @property
    def one_plus_norm(self) -> bool:
        """Qwen3.5 RMSNorms scale by (1 + w); Qwen3-MoE by w."""
        return self.model_type == "qwen3_5_moe"

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def has_linear_attention(self) -> bool:
        return "linear_attention" in self.layer_types

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def config_hash(self) -> str:
        """Stable short hash of the architecture, recorded in job plans."""
        blob = json.dumps(self.to_dict(), sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:16]

    @classmethod
    def from_hf(cls, raw: dict[str, Any], source: str = "config.json") -> ModelConfig:
        """Parse a Hugging Face config dict; `source` names the file in error messages. Each field is
        checked by name as it is read, so a bad value is reported as that field, not as a later crash."""
        if not isinstance(raw, dict):
            raise ConfigError(f"{source}: expected a JSON object, found {type(raw).__name__}")
        model_type = raw.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ConfigError(
                f"{source}: model_type {model_type!r} is not supported; supported: "
                f"{', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        text = raw.get("text_config") or raw
        if not isinstance(text, dict):
            raise ConfigError(f"{source}: text_config is {text!r}, expected an object")
        if model_type == "qwen3_5_moe_text" or text.get("model_type") == "qwen3_5_moe_text":
            model_type = "qwen3_5_moe"

        def need(key: str) -> Any:
            if key not in text:
                raise ConfigError(f"{source}: missing required field {key!r} for model_type {model_type}")
            return text[key]

        def integer(key: str, value: Any, low: int = 1) -> int:
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ConfigError(f"{source}: {key} is {value!r}, expected an integer >= {low}")
            return value

        def number(key: str, value: Any) -> float:
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ConfigError(f"{source}: {key} is {value!r}, expected a positive number")
            return float(value)

        def flag(key: str, value: Any) -> bool:
            if not isinstance(value, bool):
                raise ConfigError(f"{source}: {key} is {value!r}, expected true or false")
            return value

        def token_id(key: str) -> int | None:
            value = text.get(key, raw.get(key))
            return None if value is None else integer(key, value, 0)

        rope_key = "rope_parameters" if text.get("rope_parameters") else "rope_scaling"
        rope = text.get(rope_key) or {}
        if not isinstance(rope, dict):
            raise ConfigError(f"{source}: {rope_key} is {rope!r}, expected an object")
        if rope.get("rope_type", "default") not in ("default", None):
            raise ConfigError(
                f"{source}: rope_type {rope.get('rope_type')!r} is not supported; supported: default"
            )
        rope_theta = number("rope_theta", rope.get("rope_theta", text.get("rope_theta", 10000.0)))
        num_layers = integer("num_hidden_layers", need("num_hidden_layers"))
        hidden = integer("hidden_size", need("hidden_size"))
        heads = integer("num_attention_heads", need("num_attention_heads"))
        head_dim = integer("head_dim", text.get("head_dim") or hidden // heads)
        eos = raw.get("eos_token_id", text.get("eos_token_id"))
        eos_ids = [
            integer("eos_token_id", e, 0)
            for e in ([] if eos is None else eos if isinstance(eos, list) else [eos])
        ]

        if model_type == "qwen3_moe":
            sparse_step = integer("decoder_sparse_step", text.get("decoder_sparse_step", 1))
            if text.get("mlp_only_layers") or sparse_step != 1:
                raise ConfigError(
                    f"{source}: dense MLP layers (mlp_only_layers/decoder_sparse_step) are not supported; "
                    "every layer must be MoE as in Qwen3-30B-A3B"
                )
            layer_types = ["full_attention"] * num_layers
            partial_default = 1.0
            extra: dict[str, Any] = dict(
                attn_output_gate=False,
                shared_expert_intermediate_size=0,
                norm_topk_prob=flag("norm_topk_prob", text.get("norm_topk_prob", False)),
            )
        else:
            layer_types = text.get("layer_types")
            if layer_types is None:
                interval = integer("full_attention_interval", text.get("full_attention_interval", 4))
                layer_types = [
                    "full_attention" if (i + 1) % interval == 0 else "linear_attention"
                    for i in range(num_layers)
                ]
            elif not isinstance(layer_types, list) or not all(isinstance(t, str) for t in layer_types):
                raise ConfigError(f"{source}: layer_types is {layer_types!r}, expected a list of strings")
            partial_default = 0.25
            linear = (
                "linear_num_key_heads",
                "linear_num_value_heads",
                "linear_key_head_dim",
                "linear_value_head_dim",
                "linear_conv_kernel_dim",
            )
            extra = dict(
                attn_output_gate=flag("attn_output_gate", text.get("attn_output_gate", True)),
                shared_expert_intermediate_size=integer(
                    "shared_expert_intermediate_size", text.get("shared_expert_intermediate_size", 0), 0
                ),
                norm_topk_prob=True,  # the Qwen3.5 router always renormalises its top-k weights
                **{key: integer(key, need(key)) for key in linear},
            )
        partial = number(
            "partial_rotary_factor",
            rope.get("partial_rotary_factor", text.get("partial_rotary_factor", partial_default)),
        )
        if partial > 1:
            raise ConfigError(f"{source}: partial_rotary_factor is {partial}, expected at most 1")
        # transformers >= 5 writes Qwen3-MoE's expert count as num_local_experts
        experts_key = "num_local_experts" if "num_local_experts" in text else "num_experts"
        tie = raw.get("tie_word_embeddings", text.get("tie_word_embeddings", False))
        fields = dict(
            model_type=model_type,
            vocab_size=integer("vocab_size", need("vocab_size")),
            hidden_size=hidden,
            num_hidden_layers=num_layers,
            num_attention_heads=heads,
            num_key_value_heads=integer("num_key_value_heads", need("num_key_value_heads")),
            head_dim=head_dim,
            rms_norm_eps=number("rms_norm_eps", text.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            partial_rotary_factor=partial,
            max_position_embeddings=integer(
                "max_position_embeddings", text.get("max_position_embeddings", 32768)
            ),
            tie_word_embeddings=flag("tie_word_embeddings", tie),
            layer_types=list(layer_types),
            num_experts=integer(experts_key, need(experts_key)),
            num_experts_per_tok=integer("num_experts_per_tok", need("num_experts_per_tok")),
            moe_intermediate_size=integer("moe_intermediate_size", need("moe_intermediate_size")),
            eos_token_ids=eos_ids,
            bos_token_id=token_id("bos_token_id"),
            pad_token_id=token_id("pad_token_id"),
            **extra,
        )
        try:
            return cls(**fields)
        except ConfigError as e:  # __post_init__'s cross-field checks do not know the file
            raise ConfigError(f"{source}: {e}") from None

    @classmethod
    def from_pretrained(cls, path: str | Path) -> ModelConfig:
        """Read `config.json` from a checkpoint folder (or the file itself)."""
        path = Path(path)
        if not path.exists():
            raise ConfigError(f"{path}: no such checkpoint folder or config file")
        file = path / "config.json" if path.is_dir() else path
        return cls.from_hf(read_config_json(file), source=str(file))


def read_config_json(file: Path) -> dict[str, Any]:
    """A checkpoint's `config.json` as a dict, or a ConfigError naming the file and what is wrong."""
    try:
        raw = json.loads(file.read_text())
    except FileNotFoundError:
        raise ConfigError(
            f"{file}: no config.json found (is {file.parent} a Hugging Face checkpoint folder?)"
        ) from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"{file}: not valid JSON ({e})") from None
    except OSError as e:  # a folder named config.json, an unreadable file
        raise ConfigError(f"{file}: cannot be read ({e.strerror or e}); expected a JSON file") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{file}: expected a JSON object, found {type(raw).__name__}")
    return raw

"""Frozen configuration dataclasses.

``ModelConfig.from_gguf`` is the only reader of ``qwen35.*`` metadata keys (reference/qwen35-format.md §2).
``SamplingParams`` is shared by the CPU and GPU backends, the CLI and the server.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

import numpy as np

from ninfer_numba.kernels.kvq.ref import KV_TYPES

ARCH = "qwen35"


class ModelFormatError(ValueError):
    """A model file that cannot be used, with a message that says why (shown to users without a traceback)."""


class BackendUnavailableError(RuntimeError):
    """The cuda backend cannot run here (no GPU or driver, or the wrong numba CUDA target)."""


def _scalar_or_first(value: Any, key: str, n_blocks: int) -> Any:
    """Per-layer arrays (one entry per block, as llama.cpp requires) are allowed for some keys; this engine
    needs them uniform."""
    if isinstance(value, (list, tuple)):
        if len(value) != n_blocks:
            raise ModelFormatError(f"metadata key {key} has {len(value)} entries, expected one per block ({n_blocks})")
        if len(set(value)) != 1:
            raise ModelFormatError(f"metadata key {key} varies per layer ({sorted(set(value))}); not supported")
        return value[0]
    return value


def _int_in(key: str, value: Any, lo: int, hi: int) -> int:
    """A metadata count or size as an int within [lo, hi]: checked before anything is sized by it (a
    corrupted block_count of 2^31 would otherwise loop for hours, a head count of 0 divide by zero)."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or not lo <= int(value) <= hi:
        raise ModelFormatError(f"metadata key {key} = {value!r} must be an integer in [{lo}, {hi}]")
    return int(value)


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """Shapes and constants of one qwen35 model (symbols as in reference/qwen35-format.md §3)."""
    n_vocab: int
    n_embd: int
    n_layer: int
    n_ff: int
    n_head: int               # H: query heads of the full-attention layers
    n_head_kv: int            # Hkv
    head_dim: int             # d: key_length == value_length
    n_rot: int                # rotary dims (first n_rot of each head)
    rope_base: float
    rope_sections: tuple[int, ...]
    rms_eps: float
    conv_kernel: int          # K
    ssm_state: int            # S: GDN head dim of keys and values
    ssm_groups: int           # Hk: GDN key heads
    ssm_heads: int            # Hv: GDN value heads
    full_attn_interval: int
    context_length: int
    tied_embeddings: bool
    name: str = ""
    mtp_layers: int = 0       # multi-token-prediction blocks in the file after the n_layer used ones (skipped)

    @property
    def conv_dim(self) -> int:
        """C = 2·Hk·S + Hv·S: channels of the GDN causal conv (q | k | v)."""
        return 2 * self.ssm_groups * self.ssm_state + self.ssm_heads * self.ssm_state

    @property
    def ssm_inner(self) -> int:
        return self.ssm_heads * self.ssm_state

    def is_attention_layer(self, i: int) -> bool:
        return (i + 1) % self.full_attn_interval == 0

    @property
    def attention_layers(self) -> list[int]:
        return [i for i in range(self.n_layer) if self.is_attention_layer(i)]

    @property
    def gdn_layers(self) -> list[int]:
        return [i for i in range(self.n_layer) if not self.is_attention_layer(i)]

    @classmethod
    def from_gguf(cls, kv: Mapping[str, Any], tensor_names: set[str] | None = None) -> "ModelConfig":
        arch = kv.get("general.architecture")
        if arch != ARCH:
            raise ModelFormatError(
                f"unsupported architecture {arch!r}: ninfer_numba runs only {ARCH!r} "
                "(Qwen3.5/3.6 dense hybrid) models")
        p = ARCH + "."

        def req(key: str) -> Any:
            if p + key not in kv:
                raise ModelFormatError(f"required metadata key {p + key} is missing")
            return kv[p + key]

        # every layer has tensors, so a file with T tensors has fewer than T blocks
        n_blocks = _int_in(p + "block_count", req("block_count"), 1,
                           min(4096, len(tensor_names)) if tensor_names is not None else 4096)

        def size(key: str, lo: int, hi: int, default: Any = None) -> int:
            value = req(key) if default is None else kv.get(p + key, default)
            return _int_in(p + key, _scalar_or_first(value, p + key, n_blocks), lo, hi)

        # multi-token-prediction blocks (converters that keep them count them in block_count and append them
        # last): loaded by no one here, since this engine does not decode speculatively
        mtp_layers = size("nextn_predict_layers", 0, n_blocks - 1, 0)
        _check_rope_scaling(kv, p)
        n_embd = size("embedding_length", 1, 1 << 18)
        n_head = size("attention.head_count", 1, 4096)
        n_head_kv = size("attention.head_count_kv", 1, n_head, n_head)
        head_dim = size("attention.key_length", 1, 4096, max(n_embd // n_head, 1))
        value_dim = size("attention.value_length", 1, 4096, head_dim)
        if value_dim != head_dim:
            raise ModelFormatError(f"attention.value_length {value_dim} != key_length {head_dim}")
        raw = req("rope.dimension_sections")
        raw = raw if isinstance(raw, (list, tuple)) else [raw] * 4       # a scalar is broadcast, as llama.cpp does
        sections = tuple(_int_in(p + "rope.dimension_sections", s, 0, 4096) for s in raw)
        if len(sections) != 4:
            raise ModelFormatError(f"rope.dimension_sections must have 4 entries, got {len(sections)}")
        n_rot = size("rope.dimension_count", 0, head_dim, head_dim)
        if n_rot % 2:
            raise ModelFormatError(f"rope.dimension_count {n_rot} must be even and <= head_dim {head_dim}")
        if sum(sections[:3]) < n_rot // 2:
            raise ModelFormatError(f"rope sections {sections} cover fewer than {n_rot // 2} rotary pairs")
        ssm_state = size("ssm.state_size", 1, 4096)
        ssm_heads = size("ssm.time_step_rank", 1, 4096)
        ssm_groups = size("ssm.group_count", 1, ssm_heads)
        if size("ssm.inner_size", 1, 1 << 24) != ssm_state * ssm_heads:
            raise ModelFormatError("ssm.inner_size must equal ssm.state_size × ssm.time_step_rank")
        if ssm_heads % ssm_groups:
            raise ModelFormatError(f"ssm.time_step_rank {ssm_heads} is not a multiple of group_count {ssm_groups}")
        if n_head % n_head_kv:
            raise ModelFormatError(f"head_count {n_head} is not a multiple of head_count_kv {n_head_kv}")
        n_vocab = kv.get(p + "vocab_size")
        tokens = kv.get("tokenizer.ggml.tokens")
        if tokens is not None:
            n_vocab = len(tokens)
        if n_vocab is None:
            raise ModelFormatError("no vocabulary: neither tokenizer.ggml.tokens nor qwen35.vocab_size is present")
        n_vocab = _int_in(p + "vocab_size", n_vocab, 1, 1 << 24)
        n_layer = n_blocks - mtp_layers
        eps = req("attention.layer_norm_rms_epsilon")
        if not isinstance(eps, (int, float)) or not 0 < float(eps) < 1:
            raise ModelFormatError(f"metadata key {p}attention.layer_norm_rms_epsilon = {eps!r} must be in (0, 1)")
        tied = tensor_names is not None and "output.weight" not in tensor_names
        return cls(
            n_vocab=n_vocab, n_embd=n_embd, n_layer=n_layer, n_ff=size("feed_forward_length", 1, 1 << 20),
            n_head=n_head, n_head_kv=n_head_kv, head_dim=head_dim, n_rot=n_rot,
            rope_base=float(kv.get(p + "rope.freq_base", 10000.0)), rope_sections=sections,
            rms_eps=float(eps), conv_kernel=size("ssm.conv_kernel", 1, 64), ssm_state=ssm_state,
            ssm_groups=ssm_groups, ssm_heads=ssm_heads,
            full_attn_interval=size("full_attention_interval", 1, 4096, 4),
            context_length=size("context_length", 1, 1 << 24), tied_embeddings=tied,
            name=str(kv.get("general.name", "")), mtp_layers=mtp_layers,
        )


def _check_rope_scaling(kv: Mapping[str, Any], p: str) -> None:
    """RoPE runs unscaled here: refuse a file that asks for scaled positions (YaRN, linear) rather than
    produce wrong logits without a word. The converter writes rope.scaling.* only for such files."""
    kind = kv.get(p + "rope.scaling.type", "none")
    factor = kv.get(p + "rope.scaling.factor", 1.0)
    if not isinstance(factor, (int, float)) or isinstance(factor, bool):
        raise ModelFormatError(f"metadata key {p}rope.scaling.factor = {factor!r} must be a number")
    if kind == "none" or float(factor) in (0.0, 1.0):
        return
    raise ModelFormatError(f"RoPE scaling {kind!r} with factor {factor} ({p}rope.scaling.*) is not supported: "
                           "this engine runs RoPE unscaled, within the model's original context length")


KV_CACHE_TYPES = ("f16", *KV_TYPES)     # f16 and the coded caches of kernels/kvq (k3v3, k4v3, k4v4, q8)
KVQ_PARTIALS = ("lanes", "tokens", "mma", "auto")   # a coded cache's decode partials (kvq/decode.py pick_partial)
MAX_TOP_LOGPROBS = 20                # alternatives per token (OpenAI's top_logprobs limit)


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """Sampling settings; temperature 0 means greedy. Validated on construction."""
    max_tokens: int = 128
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0                   # 0: off
    min_p: float = 0.0
    repetition_penalty: float = 1.0  # 1: off (llama.cpp semantics: divide positive logits, multiply negative)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)  # added to the model's end-of-turn tokens
    ignore_eos: bool = False
    logprobs: int | None = None      # None: off; n >= 0: each token's log-probability and its n most likely

    def __post_init__(self) -> None:
        checks = [
            (self.max_tokens >= 0, "max_tokens must be >= 0"),
            (self.logprobs is None or 0 <= self.logprobs <= MAX_TOP_LOGPROBS,
             f"logprobs must be in [0, {MAX_TOP_LOGPROBS}]"),
            (0.0 <= self.temperature <= 2.0, "temperature must be in [0, 2] (as the OpenAI API)"),
            (0.0 < self.top_p <= 1.0, "top_p must be in (0, 1]"),
            (self.top_k >= 0, "top_k must be >= 0"),
            (0.0 <= self.min_p <= 1.0, "min_p must be in [0, 1]"),
            (self.repetition_penalty > 0.0, "repetition_penalty must be > 0"),
            (-2.0 <= self.presence_penalty <= 2.0, "presence_penalty must be in [-2, 2]"),
            (-2.0 <= self.frequency_penalty <= 2.0, "frequency_penalty must be in [-2, 2]"),
        ]
        for ok, msg in checks:
            if not ok:
                raise ValueError(msg)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def is_plain_greedy(self) -> bool:
        """Greedy with no penalty: every choice is the argmax of the raw logits."""
        return self.greedy and self.repetition_penalty == 1.0 and not (self.presence_penalty or self.frequency_penalty)

    def stop_ids(self, eos_ids) -> frozenset[int]:
        """The ids that end generation: the model's end-of-turn ids (unless ignore_eos) and stop_token_ids."""
        return frozenset(() if self.ignore_eos else eos_ids) | frozenset(self.stop_token_ids)


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """Engine knobs; CLI flags map 1:1 to fields."""
    backend: str = "auto"          # auto | cpu | cuda
    max_seq: int = 4096            # KV cache capacity in tokens (prompt + generation)
    prefill_chunk: int = 2048      # tokens per prefill forward on the GPU
    kv_type: str = "f16"           # f16, or k3v3 / k4v3 / k4v4 / q8 (kernels/kvq)
    kvq_partial: str = "auto"      # a coded cache's decode partial: lanes | tokens | mma | auto (kvq/decode.py)
    gemm: str = "auto"             # prefill GEMM: auto | w8a16 (sm_90) | mma | dp4a (model/qwen35.py)
    prefill_graphs: bool = True    # replay a prefill chunk length seen before from a CUDA graph (cuda_runner)
    pdl: bool = True               # decode-step kernels launched programmatically on sm_90+ (kernels/pdl.py)
    prefix_reuse: bool = True      # a prompt that extends the previous sequence runs only its new tokens (llm.py)
    prefix_cache_mb: int = 1024    # snapshots of states at prompt prefixes, reused across requests; 0: off
    pack_prompts: bool = True      # batched serving: 3+ waiting prompts prefilled in one forward (scheduler.py)
    admit_chunk: int = 512         # batched serving: a longer prompt is prefilled this many tokens a step,
    #                                between the others' decode steps (scheduler.py); 0: all in one step
    snapshot_every: int = 2048     # a snapshot at every multiple of this many prompt tokens (prefix_cache.py)
    cpu_weight_cache_mb: int = 1024  # cpu backend: dequantized float32 matrices kept across forwards (0: none)
    device: int = 0
    gpus: str = ""                 # split by layers over these GPUs: a count or a list of ids (shard_plan.py)

    def __post_init__(self) -> None:
        if self.backend not in ("auto", "cpu", "cuda"):
            raise ValueError(f"backend must be auto, cpu or cuda, not {self.backend!r}")
        if self.max_seq < 1:
            raise ValueError("max_seq must be >= 1")
        if self.prefill_chunk < 1:
            raise ValueError("prefill_chunk must be >= 1")
        if self.prefix_cache_mb < 0 or self.snapshot_every < 1:
            raise ValueError("prefix_cache_mb must be >= 0 and snapshot_every >= 1")
        if self.cpu_weight_cache_mb < 0 or self.admit_chunk < 0:
            raise ValueError("cpu_weight_cache_mb and admit_chunk must be >= 0")
        if self.gemm not in ("auto", "w8a16", "mma", "dp4a"):
            raise ValueError(f"gemm must be auto, w8a16, mma or dp4a, not {self.gemm!r}")
        if self.gpus:
            from ninfer_numba.engine.shard_plan import parse_gpus
            parse_gpus(self.gpus)                # a bad list fails here, before any weight is read
        if self.kv_type not in KV_CACHE_TYPES:
            raise ValueError(f"kv_type must be one of {', '.join(KV_CACHE_TYPES)}, not {self.kv_type!r}")
        if self.kvq_partial not in KVQ_PARTIALS:
            raise ValueError(f"kvq_partial must be one of {', '.join(KVQ_PARTIALS)}, not {self.kvq_partial!r}")
        if self.kvq_partial in ("tokens", "mma") and self.kv_type == "q8":
            raise ValueError(f"the {self.kvq_partial} decode partial decodes 3- and 4-bit codes: q8 takes lanes "
                             "or auto")

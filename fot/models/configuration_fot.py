"""Configuration of the Forgetting Transformer (FoT) family and its Transformer baselines.

One config class covers FoT (LLaMA), FoT (Pro), the forget-gate ablations and the Transformer
baselines: a Transformer is the same block with ``fgate_type="none"`` and ``use_rope=True``.
The Pro components (QK-norm, KV-shift, output norm, output gate) are independent switches.
"""

from __future__ import annotations

import difflib
import inspect
import json
import math
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, ClassVar

from transformers import PretrainedConfig
from transformers.utils import CONFIG_NAME, logging

logger = logging.get_logger(__name__)

FGATE_TYPES = ("full", "bias_only", "fixed", "none")
ATTN_BACKENDS = ("auto", "triton", "reference", "sdpa")
LOSS_IMPLS = ("auto", "fused", "chunked", "fla")
# Fields that choose how the same model is computed (kernels, loss, memory/speed trade-offs),
# not what it is: a run may resume with other values (``fot.training.trainer.check_resume``).
IMPLEMENTATION_FIELDS = (
    "attn_backend",
    "recompute_pro",
    "loss_impl",
    "loss_chunk_size",
    "decode_cuda_graphs",
)


class _Unset:
    """Default of a field that also has a LLaMA name: tells "not passed" from "passed the
    default value", so that a conflict with the LLaMA name is caught whatever the value."""

    def __repr__(self) -> str:
        return "<default>"


_UNSET: Any = _Unset()


class FoTConfig(PretrainedConfig):
    r"""Configuration for :class:`fot.FoTForCausalLM`.

    Args:
        vocab_size: number of real tokens (GPT-2: 50257). Logits have exactly this last dim.
        pad_vocab_multiple: the embedding and LM head are padded to a multiple of this (for
            fast matmuls); padded rows are never predicted.
        hidden_size: model width.
        num_hidden_layers: number of blocks.
        num_heads: query heads (default 12); ``hidden_size % num_heads == 0``, head dim
            ``hidden_size // num_heads``.
        num_kv_heads: key/value heads (grouped-query attention); ``None`` (the default) =
            ``num_heads``.
        hidden_ratio: SwiGLU width factor; the MLP width is ``2/3 * hidden_ratio * hidden_size``
            rounded up to a multiple of 256 (LLaMA 4, Pro 3.5 so that parameters match).
        intermediate_size: explicit MLP width (overrides ``hidden_ratio``).
        fgate_type: ``"full"`` (data-dependent ``sigmoid(w.x + b)``), ``"bias_only"``
            (learned per-head constant), ``"fixed"`` (untrained per-head constant: ALiBi-like
            linear decay) or ``"none"`` (no forget gate).
        fgate_bias_init: initial bias ``b`` of the data-dependent gate (``"full"``): 0 starts
            every head at ``f = sigmoid(w.x)`` around 0.5 (short memory);
            e.g. 5 starts at ``f`` ~ 0.993 (long memory, next to no exact pruning at 16k).
        decay_time_min, decay_time_max: "long-init" of data-independent gates: per-head decay
            times ``T(b) = 1 / (-log sigmoid(b))`` spaced log-uniformly in ``[min, max]``.
        use_rope: rotary position embedding on q and k (Transformer baselines).
        rope_theta: RoPE base (default 500000).
        qk_norm: per-head RMSNorm (per-head weights) on q and k.
        qk_norm_eps: epsilon of the QK-norm: 1e-5, as in the paper's code (its q/k norms take
            their class's default, while its other norms take ``norm_eps``).
        use_k_shift, use_v_shift: data-dependent token shift of k / v (KV-shift).
        use_output_norm: per-head RMSNorm of the attention output.
        use_output_gate: sigmoid output gate ``o * sigmoid(W_g x)``.
        window_size: sliding-window attention (keys ``i - window_size < j <= i``); ``None`` = full.
        attn_backend: ``"auto"`` (Triton on CUDA tensors, else reference; on CUDA, PyTorch SDPA
            for gate ``none`` on whole sequences), ``"triton"``, ``"reference"`` (pure PyTorch,
            any device) or ``"sdpa"`` (PyTorch SDPA for gate ``none`` on whole sequences on any
            device, else as ``"auto"``).
        recompute_pro: on the PyTorch path of the Pro components (``attn_backend=
            "reference"``, or the cached decode path), recompute KV-shift, QK-norm and output
            norm/gate in backward instead of keeping their intermediates (~8 GiB less at 760m,
            T=16k). The fused kernels used on the kernel backends always keep only inputs.
        loss_impl: ``"auto"`` (``"fused"`` on CUDA, else ``"chunked"``), ``"fused"`` (our
            fused linear cross-entropy, ``fot.kernels.loss_ops``: gradients computed chunk by
            chunk in the forward, Triton on CUDA), ``"chunked"`` (pure PyTorch, each chunk
            recomputed in backward) or ``"fla"`` (FLA's fused linear cross-entropy, to compare).
        loss_chunk_size: rows of the ``[T, V]`` logits materialised at once by the fused and
            chunked losses.
        decode_cuda_graphs: ``generate()`` on CUDA uses a fixed-capacity cache and replays its
            one-token decode steps as CUDA graphs (``fot.models.cache.FoTCache``); False: eager
            steps with a growing cache.
        norm_eps: RMSNorm epsilon (default 1e-6).
        initializer_range: std of the N(0, std) init of linear and embedding weights.

    LLaMA-named fields are read as their FoT equivalents, as constructor arguments and as
    attributes: ``num_attention_heads`` (``num_heads``), ``num_key_value_heads``
    (``num_kv_heads``; reads give the resolved count :attr:`kv_heads`), ``rms_norm_eps``
    (``norm_eps``), ``rope_parameters={"rope_type": "default", "rope_theta": x}``
    (``rope_theta``). A setting given under two of its names is refused with a ``ValueError``
    unless the values agree (a saved ``config.json`` may carry both). Fields of features FoT
    models do not have are refused with a ``ValueError`` rather than stored and ignored:
    non-zero dropout (``dropout``, ``attention_dropout``, ``hidden_dropout``, ``resid_pdrop``,
    ...), ``rope_scaling`` or a non-default ``rope_parameters`` type, ``attention_bias`` /
    ``mlp_bias``, and a ``hidden_act`` other than ``"silu"``. So is a keyword a letter or two
    from one of FoT's fields (``hidden_sise``); other unknown keywords are stored, as
    transformers stores them.

    Keyword overrides given to :meth:`from_pretrained` / :meth:`from_dict` (and so to
    ``AutoConfig`` / ``AutoModelForCausalLM.from_pretrained``) go through the same constructor,
    LLaMA-name mapping and checks; an error of a loaded ``config.json``'s own settings begins
    with the file's path. :meth:`save_pretrained` re-writes the remote-code modules
    that an exported config's ``auto_map`` names (see :mod:`fot.export`), so a model loaded
    with ``trust_remote_code=True`` and saved again loads the same way.
    """

    model_type = "fot"
    attribute_map: ClassVar[dict[str, str]] = {
        "num_attention_heads": "num_heads",
        "num_key_value_heads": "kv_heads",
        "rms_norm_eps": "norm_eps",
    }
    keys_to_ignore_at_inference: ClassVar[list[str]] = ["past_key_values", "cache"]

    def __init__(
        self,
        vocab_size: int = 50257,
        pad_vocab_multiple: int = 64,
        hidden_size: int = 768,
        num_hidden_layers: int = 12,
        num_heads: int = _UNSET,
        num_kv_heads: int | None = _UNSET,
        hidden_ratio: float = 4.0,
        intermediate_size: int | None = None,
        fgate_type: str = "full",
        fgate_bias_init: float = 0.0,
        decay_time_min: float = 2.0,
        decay_time_max: float = 16384.0,
        use_rope: bool = False,
        rope_theta: float = _UNSET,
        qk_norm: bool = False,
        qk_norm_eps: float = 1e-5,
        use_k_shift: bool = False,
        use_v_shift: bool = False,
        use_output_norm: bool = False,
        use_output_gate: bool = False,
        window_size: int | None = None,
        attn_backend: str = "auto",
        recompute_pro: bool = True,
        loss_impl: str = "auto",
        loss_chunk_size: int = 2048,
        decode_cuda_graphs: bool = True,
        norm_eps: float = _UNSET,
        initializer_range: float = 0.02,
        max_position_embeddings: int = 65536,
        use_cache: bool = True,
        bos_token_id: int | None = 50256,
        eos_token_id: int | None = 50256,
        pad_token_id: int | None = None,
        tie_word_embeddings: bool = False,
        **kwargs,
    ) -> None:
        num_heads = _take_alias(kwargs, "num_heads", num_heads, ("num_attention_heads",), 12)
        num_kv_heads = _take_alias(
            kwargs,
            "num_kv_heads",
            num_kv_heads,
            ("kv_heads", "num_key_value_heads"),
            None,
            resolve=lambda n: num_heads if n is None else n,  # None: as many as num_heads
        )
        norm_eps = _take_alias(kwargs, "norm_eps", norm_eps, ("rms_norm_eps",), 1e-6)
        rope_theta = _take_rope_parameters(kwargs, rope_theta)
        _refuse_unsupported_fields(kwargs)
        _refuse_misspelt_fields(kwargs)
        _check_dtype_name(kwargs)
        head_dim = kwargs.pop("head_dim", None)
        if head_dim is not None and head_dim * num_heads != hidden_size:
            raise ValueError(
                f"head_dim is derived as hidden_size // num_heads = {hidden_size} // {num_heads}; "
                f"got head_dim={head_dim}: set num_heads = hidden_size // head_dim instead"
            )
        self.vocab_size = vocab_size
        self.pad_vocab_multiple = pad_vocab_multiple
        self.hidden_size = hidden_size
        self.num_hidden_layers = num_hidden_layers
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.hidden_ratio = hidden_ratio
        self.intermediate_size = intermediate_size
        self.fgate_type = fgate_type
        self.fgate_bias_init = fgate_bias_init
        self.decay_time_min = decay_time_min
        self.decay_time_max = decay_time_max
        self.use_rope = use_rope
        self.rope_theta = rope_theta
        self.qk_norm = qk_norm
        self.qk_norm_eps = qk_norm_eps
        self.use_k_shift = use_k_shift
        self.use_v_shift = use_v_shift
        self.use_output_norm = use_output_norm
        self.use_output_gate = use_output_gate
        self.window_size = window_size
        self.attn_backend = attn_backend
        self.recompute_pro = recompute_pro
        self.loss_impl = loss_impl
        self.loss_chunk_size = loss_chunk_size
        self.decode_cuda_graphs = decode_cuda_graphs
        self.norm_eps = norm_eps
        self.initializer_range = initializer_range
        self.max_position_embeddings = max_position_embeddings
        self.use_cache = use_cache
        if tie_word_embeddings:
            raise ValueError(
                "tie_word_embeddings=True is not supported: FoT models use untied input and "
                "output embeddings (paper App. E); set tie_word_embeddings=False"
            )
        # before transformers' own validators, which would trip over a bad type with a
        # traceback (num_heads="four": "unsupported operand type(s) for //")
        self.validate_fot()
        super().__init__(
            bos_token_id=bos_token_id,
            eos_token_id=eos_token_id,
            pad_token_id=pad_token_id,
            tie_word_embeddings=False,
            **kwargs,
        )

    # -- loading and saving ----------------------------------------------------------------
    @classmethod
    def constructor_keys(cls) -> frozenset[str]:
        """Keywords that :class:`FoTConfig`'s own constructor reads and checks.

        Its parameters, the LLaMA-named aliases, ``kv_heads`` and the fields of other
        architectures it refuses or checks (dropouts, ``rope_scaling``, ``head_dim``, ...).
        Keys of :class:`~transformers.PretrainedConfig` itself (``dtype``, ``architectures``,
        ...) are not included.
        """
        params = inspect.signature(FoTConfig.__init__).parameters.values()
        own = {p.name for p in params if p.kind is p.POSITIONAL_OR_KEYWORD and p.name != "self"}
        return frozenset(own | {"kv_heads"} | set(LLAMA_ALIASES) | set(FOREIGN_FIELDS))

    @classmethod
    def from_dict(
        cls, config_dict: dict[str, Any], **kwargs: Any
    ) -> FoTConfig | tuple[FoTConfig, dict[str, Any]]:
        """Build a config from ``config_dict`` with keyword overrides, checked as in ``__init__``.

        transformers' :meth:`~transformers.PretrainedConfig.from_dict` constructs the config
        from ``config_dict`` and then *sets* keyword overrides as attributes, so an override
        would skip the constructor's checks and LLaMA-name mapping (``attention_dropout=0.1``
        was dropped silently, ``num_heads=3`` stored unchecked). Here overrides of FoT fields
        (:meth:`constructor_keys`) are merged into ``config_dict`` first: an override replaces
        the saved value of the same setting under any of its names (``num_attention_heads=8``
        replaces a saved ``num_heads``). Other keywords (``dtype``, ``return_unused_kwargs``,
        ...) are handled by transformers as before.

        Where ``config_dict`` was read from a file (by :meth:`from_pretrained`, or
        ``AutoConfig.from_pretrained``, which passes ``name_or_path``), an error of its own
        settings begins with the file's path (``<folder>/config.json: ...``), the one to fix.

        Returns:
            The config, or ``(config, unused_kwargs)`` with ``return_unused_kwargs=True``.

        Raises:
            ValueError: an override the constructor refuses, with the field and the fix; or a
                setting of the file, with its path.
        """
        file = kwargs.pop("_fot_config_file", None)
        name_or_path = kwargs.get("name_or_path")
        own = cls.constructor_keys()
        overrides = {key: kwargs.pop(key) for key in list(kwargs) if key in own}
        config_dict = dict(config_dict)  # as read: transformers' from_dict pops keys of `merged`
        foreign = _foreign_model_problem(config_dict.get("model_type"))
        if foreign:
            file = file or _config_file(name_or_path, config_dict=config_dict)
            raise ValueError(f"{file or 'the config'}: {foreign}")
        merged = merge_overrides(config_dict, overrides) if overrides else dict(config_dict)
        merged = _without_unread_saved(merged, overrides)
        try:
            config = super().from_dict(merged, **kwargs)
        except ValueError as err:
            file = file or _config_file(name_or_path, config_dict=config_dict)
            if file is None:
                raise
            if overrides:  # the file's settings alone: an override's error names no file
                try:
                    cls(**_without_unread_saved(config_dict, {}))
                except ValueError as own_err:
                    raise ValueError(f"{file}: {own_err}") from own_err
                raise
            raise ValueError(f"{file}: {err}") from err
        unknown = unknown_saved_keys(config_dict) if config_dict.get("model_type") == "fot" else {}
        file = file or (unknown and _config_file(name_or_path, config_dict=config_dict))
        if file and unknown:  # a file's keys (in code they are stored as transformers does)
            shown = ", ".join(f"{key}={value!r}"[:80] for key, value in unknown.items())
            logger.warning(
                "%s: %s %s no setting of this fot's FoTConfig, stored but not used: the model "
                "may compute other outputs than the one saved. A folder written by a newer fot "
                "or transformers (with settings these lack): update them (fot: git pull in its "
                "clone) to load it as it was saved",
                file,
                shown,
                "is" if len(unknown) == 1 else "are",
            )
        return config

    @classmethod
    def from_pretrained(
        cls, pretrained_model_name_or_path: str | os.PathLike, **kwargs: Any
    ) -> FoTConfig | tuple[FoTConfig, dict[str, Any]]:
        """Load ``config.json`` of a folder, a file or a Hub repository, as transformers does;
        an error of the file's own settings begins with its path (see :meth:`from_dict`).

        Raises:
            FileNotFoundError: a local folder without ``config.json`` (transformers would
                return the default config, a 12-layer model, for it); the message says which
                folder to pass (a run's ``hf/``, a training checkpoint to export first, ...).
        """
        subfolder = kwargs.get("subfolder") or ""
        folder = os.path.join(os.fspath(pretrained_model_name_or_path), subfolder)
        if (
            os.path.isdir(folder)
            and not kwargs.get("gguf_file")
            and not os.path.isfile(os.path.join(folder, CONFIG_NAME))
        ):
            from fot.export import not_exported_message

            raise FileNotFoundError(not_exported_message(Path(folder)))
        file = _config_file(pretrained_model_name_or_path, subfolder)
        return super().from_pretrained(
            pretrained_model_name_or_path, **kwargs, _fot_config_file=file
        )

    @classmethod
    def from_json_file(cls, json_file: str | os.PathLike) -> FoTConfig:
        """Load a config JSON file, as transformers does; an error begins with its path. A
        ``rope_theta`` or ``qk_norm_eps`` that an older fot stored unread goes, as in
        :meth:`from_dict`."""
        try:
            return cls(**_without_unread_saved(cls._dict_from_json_file(json_file), {}))
        except ValueError as err:
            raise ValueError(f"{os.fspath(json_file)}: {err}") from err

    def save_pretrained(
        self, save_directory: str | os.PathLike, push_to_hub: bool = False, **kwargs: Any
    ) -> None:
        """Save ``config.json`` (as transformers does) and, when ``auto_map`` names the
        remote-code modules of :func:`fot.export.export_hf`, write those modules too.

        A config loaded from an exported folder keeps its ``auto_map``; without the modules
        next to it, the saved folder could not be loaded with ``trust_remote_code=True``.
        transformers may also have copied this package's own ``configuration_fot.py`` there
        (after a ``trust_remote_code`` load it registers the class for saving); the shim
        replaces it, so that the folder always loads the installed ``fot`` classes.
        """
        super().save_pretrained(save_directory, push_to_hub=push_to_hub, **kwargs)
        from fot.export import write_remote_code_for_config

        write_remote_code_for_config(self, save_directory)

    # -- derived sizes -------------------------------------------------------------------
    @property
    def head_dim(self) -> int:
        """Per-head width ``hidden_size // num_heads``."""
        return self.hidden_size // self.num_heads

    @property
    def kv_heads(self) -> int:
        """Number of key/value heads (``num_kv_heads`` or ``num_heads``).

        Also read as ``num_key_value_heads`` (LLaMA's name); assigning either sets
        ``num_kv_heads``.
        """
        return self.num_kv_heads if self.num_kv_heads is not None else self.num_heads

    @kv_heads.setter
    def kv_heads(self, value: int | None) -> None:
        self.num_kv_heads = value

    @property
    def padded_vocab_size(self) -> int:
        """Rows of the embedding / LM head: ``vocab_size`` rounded up to ``pad_vocab_multiple``."""
        m = self.pad_vocab_multiple
        return ((self.vocab_size + m - 1) // m) * m

    @property
    def mlp_size(self) -> int:
        """SwiGLU width: ``intermediate_size`` or ``2/3 * hidden_ratio * hidden`` rounded up to 256."""
        if self.intermediate_size is not None:
            return int(self.intermediate_size)
        width = int(self.hidden_size * self.hidden_ratio * 2 / 3)
        return 256 * ((width + 255) // 256)

    # -- validation ----------------------------------------------------------------------
    def validate_fot(self) -> None:
        """Raise ``ValueError`` naming the bad field and what to change.

        Types are checked as well as ranges: a switch given as a word (``qk_norm="no"``, e.g.
        from a YAML or command-line override) would otherwise count as true.
        """

        def _is_number(value: object) -> bool:
            return (
                isinstance(value, (int, float))
                and not isinstance(value, bool)
                and math.isfinite(value)
            )

        for name in BOOL_FIELDS:
            value = getattr(self, name)
            if not isinstance(value, bool):
                raise ValueError(f"{name} must be true or false, got {value!r}")
        for name in (
            "vocab_size",
            "pad_vocab_multiple",
            "hidden_size",
            "num_hidden_layers",
            "num_heads",
            "loss_chunk_size",
            "max_position_embeddings",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        for name in ("num_kv_heads", "intermediate_size", "window_size"):
            value = getattr(self, name)
            if value is not None and (
                not isinstance(value, int) or isinstance(value, bool) or value < 1
            ):
                raise ValueError(f"{name} must be a positive int or None, got {value!r}")
        for name in (
            "rope_theta",
            "norm_eps",
            "qk_norm_eps",
            "hidden_ratio",
            "decay_time_min",
            "decay_time_max",
        ):
            value = getattr(self, name)
            if not (_is_number(value) and value > 0):
                raise ValueError(f"{name} must be a finite number > 0, got {value!r}")
        if not (_is_number(self.initializer_range) and self.initializer_range >= 0):
            raise ValueError(
                "initializer_range (the std of the weights' normal init) must be a finite "
                f"number >= 0, got {self.initializer_range!r}"
            )
        if not _is_number(self.fgate_bias_init):
            raise ValueError(
                f"fgate_bias_init must be a finite number, got {self.fgate_bias_init!r}"
            )
        if self.hidden_size % self.num_heads != 0:
            raise ValueError(
                f"hidden_size ({self.hidden_size}) must be divisible by num_heads "
                f"({self.num_heads}); pick num_heads in "
                f"{[h for h in range(1, 65) if self.hidden_size % h == 0]}"
            )
        if self.head_dim % 2 != 0 and self.use_rope:
            raise ValueError(f"RoPE needs an even head dim, got {self.head_dim}; change num_heads")
        if self.attn_backend == "triton" and (problem := triton_head_dim_problem(self)):
            raise ValueError(problem)
        if self.num_kv_heads is not None and self.num_heads % self.num_kv_heads != 0:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads "
                f"({self.num_kv_heads}) for grouped-query attention"
            )
        if self.fgate_type not in FGATE_TYPES:
            raise ValueError(f"unknown fgate_type {self.fgate_type!r}; valid: {list(FGATE_TYPES)}")
        if self.attn_backend not in ATTN_BACKENDS:
            raise ValueError(
                f"unknown attn_backend {self.attn_backend!r}; valid: {list(ATTN_BACKENDS)}"
            )
        if self.loss_impl not in LOSS_IMPLS:
            raise ValueError(f"unknown loss_impl {self.loss_impl!r}; valid: {list(LOSS_IMPLS)}")
        if self.decay_time_min > self.decay_time_max:
            raise ValueError(
                f"need decay_time_min <= decay_time_max, got {self.decay_time_min} and "
                f"{self.decay_time_max}"
            )
        fields = {name: getattr(self, name) for name in ("fgate_type", *GATE_INIT_FIELDS)}
        if problem := gate_init_problem(fields, subject="FoTConfig"):
            raise ValueError(problem)
        if problem := unread_switch_field(self):
            raise ValueError(problem)


GATE_INIT_FIELDS: dict[str, tuple[str, ...]] = {
    "fgate_bias_init": ("full",),
    "decay_time_min": ("bias_only", "fixed"),
    "decay_time_max": ("bias_only", "fixed"),
}
"""Initialisation fields of the forget gate, and the ``fgate_type`` values whose gates read them."""


def gate_init_problem(fields: Mapping[str, Any], *, subject: str) -> str | None:
    """Why ``fields`` set a gate initialisation that the gate does not read, with the fix;
    ``None`` where they do not.

    Such a field would be stored in the config and ignored (``fgate_bias_init`` on a fixed
    gate, in an ablation sweep over the gate types, say). One at its default changes nothing
    and passes: every saved ``config.json`` carries all three fields.

    Args:
        fields: config fields (a subset will do); ``fgate_type`` is taken as the default
            (``"full"``) where absent. An unknown ``fgate_type`` is left to
            :meth:`FoTConfig.validate_fot`.
        subject: what ``fields`` belong to, to begin the message (``"FoTConfig"``,
            ``"model 'fot_pro_fixed'"``).
    """
    params = inspect.signature(FoTConfig.__init__).parameters
    fgate_type = fields.get("fgate_type", params["fgate_type"].default)
    if fgate_type not in FGATE_TYPES:
        return None
    unused = [
        name
        for name, gates in GATE_INIT_FIELDS.items()
        if name in fields and fgate_type not in gates and fields[name] != params[name].default
    ]
    if not unused:
        return None
    gate = (
        "has no forget gate (fgate_type='none') to initialise with"
        if fgate_type == "none"
        else f"has fgate_type={fgate_type!r}, whose forget gate does not read"
    )
    given = ", ".join(f"{name}={fields[name]!r}" for name in unused)
    defaults = ", ".join(f"{name}={params[name].default!r}" for name in unused)
    return (
        f"{subject} {gate} {given}: fgate_bias_init initialises the data-dependent gate "
        "(fgate_type 'full': fot_pro, fot_llama), decay_time_min/max the per-head decay of "
        "'bias_only' and 'fixed' gates (fot_*_bias_only, fot_*_fixed); leave "
        f"{'it' if len(unused) == 1 else 'them'} out for this model (or at the default: "
        f"{defaults})"
    )


# Fields read only under a switch: (field, its default, the switch, what the switch adds)
SWITCHED_FIELDS: tuple[tuple[str, float, str, str], ...] = (
    ("rope_theta", 500000.0, "use_rope", "RoPE"),
    ("qk_norm_eps", 1e-5, "qk_norm", "QK-norm"),
)


def unread_switch_field(config: FoTConfig) -> str | None:
    """Why ``config`` holds a ``rope_theta`` without RoPE or a ``qk_norm_eps`` without QK-norm
    (a value other than the default, which the model would store and ignore), with the fix;
    ``None`` where it does not. Every saved ``config.json`` carries both at their defaults
    (:meth:`FoTConfig.from_dict` drops such a value that a file of an older fot holds)."""
    for name, default, switch, what in SWITCHED_FIELDS:
        value = getattr(config, name)
        if getattr(config, switch) is False and value != default:
            return (
                f"FoTConfig has no {what} ({switch}=False), so it does not read {name}="
                f"{value!r}: leave it out (or at the default, {name}={default!r}), or set "
                f"{switch}=True as well"
            )
    return None


def _without_unread_saved(
    config_dict: dict[str, Any], overrides: Mapping[str, Any]
) -> dict[str, Any]:
    """``config_dict`` (a file's settings merged with ``overrides``) without a saved
    ``rope_theta`` / ``rope_parameters`` where ``use_rope`` is off and a saved ``qk_norm_eps``
    where ``qk_norm`` is off: an older fot stored such values unread, so the model is the same
    without them. One given in ``overrides`` stays (and is refused where it is not read)."""
    out = dict(config_dict)
    for name, _, switch, _ in SWITCHED_FIELDS:
        names = {"rope_theta", "rope_parameters"} if name == "rope_theta" else {name}
        if out.get(switch, False) is False and not names & set(overrides):
            for key in names:
                out.pop(key, None)
    return out


# Switches stored as booleans (checked as such by FoTConfig.validate_fot).
BOOL_FIELDS = (
    "use_rope",
    "qk_norm",
    "use_k_shift",
    "use_v_shift",
    "use_output_norm",
    "use_output_gate",
    "recompute_pro",
    "decode_cuda_graphs",
    "use_cache",
)


# Dropout fields of other architectures' configs: FoT models have no dropout layers.
DROPOUT_FIELDS = (
    "dropout",
    "attention_dropout",
    "hidden_dropout",
    "hidden_dropout_prob",
    "attention_probs_dropout_prob",
    "activation_dropout",
    "resid_pdrop",
    "embd_pdrop",
    "attn_pdrop",
)


# LLaMA-named fields read as FoT fields (constructor arguments).
LLAMA_ALIASES: dict[str, str] = {
    "num_attention_heads": "num_heads",
    "num_key_value_heads": "num_kv_heads",
    "rms_norm_eps": "norm_eps",
    "rope_parameters": "rope_theta",
}
# Fields of other architectures that the constructor refuses or checks instead of storing.
FOREIGN_FIELDS = (
    *DROPOUT_FIELDS,
    "rope_scaling",
    "attention_bias",
    "mlp_bias",
    "hidden_act",
    "head_dim",
)
# Names of one setting: an override under one name replaces a saved value under the others.
_SYNONYMS: tuple[frozenset[str], ...] = (
    frozenset({"num_heads", "num_attention_heads"}),
    frozenset({"num_kv_heads", "num_key_value_heads", "kv_heads"}),
    frozenset({"norm_eps", "rms_norm_eps"}),
    frozenset({"rope_theta", "rope_parameters"}),
)


def _config_file(
    name_or_path: str | os.PathLike | None,
    subfolder: str = "",
    config_dict: dict[str, Any] | None = None,
) -> str | None:
    """The config file that loading ``name_or_path`` reads, as messages name it: the file
    itself, ``<folder>/config.json``, or ``config.json of <repository>``; None where not given.

    ``AutoConfig``/``AutoModelForCausalLM.from_pretrained(folder, subfolder=...)`` tell
    :meth:`FoTConfig.from_dict` the folder but not the subfolder: where ``<folder>/config.json``
    does not exist, the file is the ``<folder>/<sub>/config.json`` that holds ``config_dict``
    (``<run>/hf/config.json`` of a training run's folder).
    """
    if not name_or_path:
        return None
    path = os.fspath(name_or_path)
    if os.path.isfile(path):
        return path
    if not os.path.isdir(path):
        return f"{CONFIG_NAME} of {path}"
    file = os.path.join(path, subfolder, CONFIG_NAME)
    if os.path.isfile(file) or config_dict is None:
        return file
    for candidate in sorted(Path(path).glob(f"*/{CONFIG_NAME}")):
        try:
            if json.loads(candidate.read_text()) == config_dict:
                return str(candidate)
        except (OSError, ValueError):
            continue
    return f"{CONFIG_NAME} in a subfolder of {path}"


# Keys of a saved config.json that no constructor argument reads and that set nothing the
# model computes: transformers' bookkeeping (and a quantised model's settings, which
# from_pretrained reads), the training length fot's trainer records for fot.eval, and the
# fields transformers 4.x wrote for every model (encoder-decoder, TensorFlow and task
# settings; config files copied from such a folder carry them).
_SAVED_ONLY_KEYS = frozenset(
    {"model_type", "auto_map", "quantization_config", "train_length"}
    | {"torchscript", "use_bfloat16", "tf_legacy_loss", "pruned_heads", "is_decoder"}
    | {"cross_attention_hidden_size", "add_cross_attention", "tie_encoder_decoder"}
    | {"finetuning_task", "tokenizer_class", "prefix", "sep_token_id", "task_specific_params"}
    | {"decoder_start_token_id"}
)


def unknown_saved_keys(config_dict: Mapping[str, Any]) -> dict[str, Any]:
    """The entries of a saved FoT ``config.json`` that this fot neither reads nor knows to be
    no setting: not a constructor keyword (:func:`fot.presets.config_keys`), not in
    :data:`_SAVED_ONLY_KEYS`, not private (``_name_or_path``). transformers would store them on
    the config, where no model code reads them: a setting of a newer fot. Generation settings
    (``max_length``, ``num_beams``, ...: the keys of a default ``GenerationConfig``) are known:
    transformers 4.x saved them in ``config.json``, and ``generate`` reads them from there.
    """
    from transformers import GenerationConfig

    from fot.presets import config_keys

    known = config_keys(FoTConfig) | _SAVED_ONLY_KEYS | GenerationConfig().to_dict().keys()
    return {k: v for k, v in config_dict.items() if k not in known and not k.startswith("_")}


def _foreign_model_problem(model_type: object) -> str | None:
    """Why a config of ``model_type`` is no FoT config, and how to load its folder instead,
    for the model types of checkpoints fot loads otherwise (its FLA baselines; the paper's and
    FLA's checkpoints, which convert); None for others (a LLaMA config maps to FoT fields)."""
    from fot.convert import FLA_MODEL_TYPE, PAPER_MODEL_TYPES
    from fot.models.fla_baselines import FLA_MODEL_TYPES

    if model_type in FLA_MODEL_TYPES:
        return (
            f"model_type {model_type!r} is one of fot's FLA baselines, not a FoT model: load its "
            "folder with AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True), "
            "or after fot.models.fla_baselines.register_auto_classes()"
        )
    if model_type in (*PAPER_MODEL_TYPES, FLA_MODEL_TYPE):
        return (
            f"model_type {model_type!r} is a checkpoint of "
            f"{'FLA' if model_type == FLA_MODEL_TYPE else 'the paper'}, not a FoT model: convert "
            "its folder with `python -m fot.convert FOLDER OUT` (or fot.convert.from_"
            f"{'fla' if model_type == FLA_MODEL_TYPE else 'paper'}(folder)) and load OUT"
        )
    return None


def merge_overrides(config_dict: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    """``config_dict`` updated with ``overrides`` (neither is modified).

    A value in ``config_dict`` of a setting that an override names differently is dropped
    rather than kept to conflict: ``num_attention_heads=8`` replaces ``num_heads``,
    ``rope_parameters`` replaces ``rope_theta``, and so on (LLaMA names and FoT names).
    """
    merged = dict(config_dict)
    for names in _SYNONYMS:
        if names & overrides.keys():
            for name in names - overrides.keys():
                merged.pop(name, None)
    merged.update(overrides)
    return merged


def _take_alias(
    kwargs: dict,
    name: str,
    value: Any,
    aliases: tuple[str, ...],
    default: Any,
    *,
    resolve: Callable[[Any], Any] = lambda v: v,
) -> Any:
    """Pop the other names (``aliases``) of the FoT field ``name`` from ``kwargs``; return its
    value: the one given under any of its names, else ``default``.

    Args:
        kwargs: the constructor's other keywords.
        name: the FoT field; ``value`` is its argument, ``_UNSET`` where it was not passed.
        value: see ``name``.
        aliases: the field's other names.
        default: the value where no name was passed.
        resolve: maps a value to what it means, for comparing (``num_kv_heads=None`` means
            ``num_heads``).

    Raises:
        ValueError: two names were given with values that differ.
    """
    given = {} if value is _UNSET else {name: value}
    given.update({alias: kwargs.pop(alias) for alias in aliases if alias in kwargs})
    if not given:
        return default
    first, *others = given.values()
    if any(resolve(other) != resolve(first) for other in others):
        both = " and ".join(f"{key}={v!r}" for key, v in given.items())
        raise ValueError(f"{both} name the same setting with different values; pass only {name}")
    return first


def _take_rope_parameters(kwargs: dict, rope_theta: float) -> float:
    """Read ``rope_scaling`` / ``rope_parameters`` (transformers' RoPE fields) from ``kwargs``.

    Args:
        kwargs: the constructor's other keywords.
        rope_theta: the ``rope_theta`` argument, ``_UNSET`` where it was not passed.

    Returns:
        The RoPE base to use: ``rope_parameters["rope_theta"]`` or ``rope_theta``, whichever
        was given (both: they must agree), else the default 500000.

    Raises:
        ValueError: for any RoPE scaling (FoT's RoPE is the default, unscaled one).
    """
    scaling = kwargs.pop("rope_scaling", None)
    if scaling is not None:
        raise ValueError(
            f"rope_scaling={scaling!r} is not supported: FoT models apply plain (unscaled) RoPE "
            "with base rope_theta; remove rope_scaling (or set it to null) and set rope_theta"
        )
    default = 500000.0 if rope_theta is _UNSET else rope_theta
    params = kwargs.pop("rope_parameters", None)
    if params is None:
        return default
    if not isinstance(params, dict):
        raise ValueError(f"rope_parameters must be a dict or None, got {params!r}")
    rope_type = params.get("rope_type", params.get("type", "default"))
    extra = set(params) - {"rope_type", "type", "rope_theta"}
    if rope_type != "default" or extra:
        raise ValueError(
            f"rope_parameters={params!r} is not supported: FoT models apply plain RoPE (rope_type "
            "'default') with base rope_theta; drop the scaling entries and set rope_theta"
        )
    theta = params.get("rope_theta", default)
    if rope_theta is not _UNSET and rope_theta != theta:  # both given, and they disagree
        raise ValueError(
            f"rope_parameters['rope_theta']={theta!r} and rope_theta={rope_theta!r} differ; "
            "pass only rope_theta"
        )
    return float(theta)


def _check_dtype_name(kwargs: dict) -> None:
    """Raise ``ValueError`` for a ``dtype`` (or ``torch_dtype``) string that names no torch
    dtype (``"bf16"``), which transformers looks up as ``torch.<name>`` (an AttributeError from
    inside torch)."""
    import torch

    for key in ("dtype", "torch_dtype"):
        value = kwargs.get(key)
        named = isinstance(value, str) and value != "auto"
        if named and not isinstance(getattr(torch, value, None), torch.dtype):
            raise ValueError(
                f"{key}={value!r} is no torch dtype: name one as torch does, e.g. "
                "'bfloat16', 'float16' or 'float32' (or pass torch.bfloat16)"
            )


def _refuse_unsupported_fields(kwargs: dict) -> None:
    """Raise ``ValueError`` for fields of other architectures that FoT models cannot honour
    (instead of storing and ignoring them); zero dropouts are dropped from ``kwargs``."""
    for name in DROPOUT_FIELDS:
        if name not in kwargs:
            continue
        value = kwargs.pop(name)
        if value not in (None, 0, 0.0):
            raise ValueError(
                f"{name}={value!r}: FoT models have no dropout; set {name} to 0 (or leave it out) "
                "and regularise otherwise (e.g. weight decay in the optimizer)"
            )
    for name in ("attention_bias", "mlp_bias"):
        if kwargs.get(name):
            raise ValueError(
                f"{name}=True is not supported: FoT's projections have no bias; set {name}=False"
            )
        kwargs.pop(name, None)
    act = kwargs.pop("hidden_act", None)
    if act not in (None, "silu", "swish"):
        raise ValueError(
            f"hidden_act={act!r} is not supported: FoT's MLP is SwiGLU (silu); set "
            "hidden_act='silu' or leave it out"
        )


def _refuse_misspelt_fields(kwargs: dict) -> None:
    """Raise ``ValueError`` for a keyword a letter or two from one of FoT's fields
    (``hidden_sise=1024``): PretrainedConfig would store it as a new attribute and the field
    would keep its default. Other unknown keywords are stored, as transformers does."""
    own = sorted(FoTConfig.constructor_keys())
    known = set(own) | set(PretrainedConfig().to_dict())
    for key in kwargs:
        if key in known:
            continue
        close = difflib.get_close_matches(key, own, n=1, cutoff=0.85)
        if close:
            raise ValueError(
                f"FoTConfig got {key}={kwargs[key]!r}, which is not one of its fields; did you "
                f"mean {close[0]}={kwargs[key]!r}? (an unknown keyword would be stored and "
                f"{close[0]} left at its default)"
            )


TRITON_HEAD_DIMS = (16, 32, 64, 128, 256)
"""Head widths the Triton attention kernels run (``fot.kernels.forgetting_attention``)."""


def triton_head_dim_problem(config: FoTConfig, head_dim: int | None = None) -> str | None:
    """Why the Triton kernels cannot run ``config``'s attention (a head width they lack), with
    the fix; ``None`` where they can.

    Args:
        config: the model's config.
        head_dim: the width of the heads met (default ``config.head_dim``).
    """
    d = config.head_dim if head_dim is None else int(head_dim)
    if d in TRITON_HEAD_DIMS:
        return None
    h = config.hidden_size
    fits = [h // w for w in TRITON_HEAD_DIMS if h % w == 0]
    fix = f"set num_heads to one of {fits}" if fits else "choose a hidden_size with such heads"
    return (
        f"head_dim {d} (hidden_size {h} / num_heads {config.num_heads}) is not one the Triton "
        f"attention kernels run {TRITON_HEAD_DIMS}: {fix}, or use attn_backend='reference' "
        "(PyTorch, whose memory grows with the square of the sequence length)"
    )


__all__ = [
    "ATTN_BACKENDS",
    "FGATE_TYPES",
    "GATE_INIT_FIELDS",
    "LOSS_IMPLS",
    "TRITON_HEAD_DIMS",
    "FoTConfig",
    "gate_init_problem",
    "merge_overrides",
    "triton_head_dim_problem",
]

"""Recurrent baselines (Mamba-2, DeltaNet, HGRN2, Samba) from flash-linear-attention.

The models are FLA's own config and model classes, looked up by name and configured with the
FoX paper's sizes; nothing of FLA is copied. Each model class is wrapped in a thin subclass that
speaks the fot model contract (``shift_labels``, ``cu_seqlens``, ``per_token_loss``), so the
trainer and the evaluation code treat every model alike. Two things of the paper's code that
FLA's classes lack are added there: its weight initialisation (:func:`paper_init_`), and
Samba's narrower MLPs in the Mamba layers (``mamba_hidden_ratio``).

FLA kernels need Triton (a CUDA GPU, or ``TRITON_INTERPRET=1`` on CPU, which is slow).
``import fla`` is deferred until a baseline is actually configured or built.
"""

from __future__ import annotations

import contextlib
import copy
import importlib
import importlib.util
import itertools
import json
import logging
import math
import numbers
import os
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PretrainedConfig
from transformers import initialization as init
from transformers.modeling_outputs import CausalLMOutputWithPast

from fot.errors import MissingPackageError

IGNORE_INDEX = -100

# name -> (FLA config class, FLA model class, varlen support through cu_seqlens)
_FLA_CLASSES: dict[str, tuple[str, str, bool]] = {
    "mamba2": ("Mamba2Config", "Mamba2ForCausalLM", False),
    "deltanet": ("DeltaNetConfig", "DeltaNetForCausalLM", True),
    "hgrn2": ("HGRN2Config", "HGRN2ForCausalLM", True),
    "samba": ("SambaConfig", "SambaForCausalLM", False),
}
FLA_MODELS: tuple[str, ...] = tuple(_FLA_CLASSES)
FLA_MODEL_TYPES: frozenset[str] = frozenset(
    t for base in ("mamba2", "delta_net", "hgrn2", "samba") for t in (base, f"fot_{base}")
)
"""``model_type`` of the baselines' exported folders: fot's (``fot_mamba2``, ...) and, for
folders exported before those, FLA's own. Known without importing FLA."""

# Sizes of the paper's baselines (its configs/experiment/longcrawl64/*): hidden, layers and the
# per-model head settings. Samba alternates Mamba and sliding-window attention layers.
_HIDDEN = {"tiny": (128, 2), "125m": (768, 12), "360m": (1024, 24), "760m": (1536, 24)}


def _size_fields(model: str, size: str) -> dict[str, Any]:
    hidden, layers = _HIDDEN[size]
    if model == "mamba2":
        # Mamba-2 blocks have no MLP: twice the layers, heads of dim 64 over the 2x expansion
        # (FLA derives the head count, expand x hidden_size / head_dim, so that an overridden
        # hidden_size or head_dim keeps them consistent)
        return {
            "hidden_size": hidden,
            "num_hidden_layers": 2 * layers,
            "head_dim": 64 if size != "tiny" else 32,
            "state_size": 128 if size != "tiny" else 16,
        }
    if model == "deltanet":
        return {
            "hidden_size": hidden,
            "num_hidden_layers": layers,
            "num_heads": max(hidden // 128, 1),
        }
    if model == "hgrn2":
        return {
            "hidden_size": hidden,
            "num_hidden_layers": layers,
            "expand_ratio": 128 if size != "tiny" else 32,
        }
    # samba
    heads = {"tiny": 4, "125m": 12, "360m": 16, "760m": 12}[size]
    return {
        "hidden_size": hidden,
        "num_hidden_layers": layers,
        # the paper's MLP widths: hidden_ratio 4 after attention, 3 after Mamba (its
        # attn_hidden_ratio and mamba_hidden_ratio); FLA's Samba has 4 everywhere
        "mamba_hidden_ratio": 3,
        "attn": {
            "layers": list(range(1, layers, 2)),
            "num_heads": heads,
            "num_kv_heads": heads,
            "window_size": 2048 if size != "tiny" else 64,
            "rope_theta": 500000.0,
        },
    }


class _OnceEach(logging.Filter):
    """Lets each message of a logger through once per process: FLA's Mamba2 layers log their
    note on the conv1d backend once per layer (24 identical lines for a 760M model)."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: set[str] = set()

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if message in self.seen:
            return False
        self.seen.add(message)
        return True


def _fla_models_module():
    try:
        with warnings.catch_warnings():
            # FLA's note on a machine without a GPU ("Triton is not supported on current
            # platform, roll back to CPU"): the CPU is what fot runs the baselines on there
            warnings.filterwarnings("ignore", message="Triton is not supported on current platform")
            module = importlib.import_module("fla.models")
    except ImportError as err:  # pragma: no cover - fla is a hard dependency
        raise ImportError(
            f"the recurrent baselines need flash-linear-attention (pip install "
            f"flash-linear-attention): {err}"
        ) from err
    mamba2 = logging.getLogger("fla.layers.mamba2")
    if not any(isinstance(f, _OnceEach) for f in mamba2.filters):
        mamba2.addFilter(_OnceEach())
    return module


def fla_config(model: str, size: str, **overrides: Any) -> PretrainedConfig:
    """FLA config of a baseline at a paper size (GPT-2 vocab, untied embeddings).

    Args:
        model: one of :data:`FLA_MODELS`.
        size: ``"tiny"``, ``"125m"``, ``"360m"`` or ``"760m"``.
        **overrides: FLA config fields.

    Returns:
        An instance of :func:`fla_config_class` (a subclass of FLA's config class).
    """
    if model not in _FLA_CLASSES:
        raise ValueError(f"unknown FLA baseline {model!r}; valid: {list(FLA_MODELS)}")
    if size not in _HIDDEN:
        raise ValueError(f"unknown size {size!r}; valid sizes: {list(_HIDDEN)}")
    config_cls = fla_config_class(model)
    fields: dict[str, Any] = {
        "vocab_size": 50257,
        "bos_token_id": 50256,
        "eos_token_id": 50256,
        "pad_token_id": None,
        "tie_word_embeddings": False,
        "initializer_range": 0.02,
        # FLA's fused cross-entropy asserts CUDA; the loss is computed by fot (see below).
        "fuse_cross_entropy": False,
        **_size_fields(model, size),
    }
    fields.update(overrides)
    return config_cls(**fields)


_CONFIGS: dict[str, type] = {}


def _samba_mlp_width(hidden_size: int, ratio: float) -> int:
    """The width FLA's ``GatedMLP`` gives an MLP of ``hidden_ratio`` ``ratio``: 2/3 x ratio x
    hidden_size, truncated, rounded up to a multiple of 256 (0 when the product is below 1).

    Raises:
        OverflowError: the product is infinite.
    """
    width = int(hidden_size * ratio * 2 / 3)
    return 256 * ((width + 256 - 1) // 256)


def _check_mlp_ratio(
    field: str, value: Any, hidden_size: int, *, mlps: str, null: str, fix: str
) -> None:
    """Refuse an MLP width factor (``hidden_ratio``, Samba's ``mamba_hidden_ratio``) that
    builds no MLP (0, negative, not a number, or so small that the width rounds to 0 at
    ``hidden_size``) or one wider than a tensor holds: it would fail deep inside the model's
    construction or initialisation otherwise. ``None`` passes (the default width).

    Args:
        field: the config field, as the error names it.
        value: its value.
        hidden_size: the model's width.
        mlps: which MLPs it sizes, for the error ("the MLPs after Mamba layers").
        null: what ``None`` gives, for the error.
        fix: a value that works and the override that sets it, ending the error.
    """
    if value is None:
        return
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if not (number and math.isfinite(value) and value > 0):
        raise ValueError(
            f"{field}={value!r}: it must be a positive number (the width factor of {mlps}) or "
            f"null ({null}); {fix}"
        )
    try:
        width: int | float = _samba_mlp_width(hidden_size, value)
    except OverflowError:  # hidden_size x value is infinite
        width = math.inf
    shown = f"{width:.3g}" if width > 2**63 - 1 else str(width)
    gives = (
        f"{field}={value!r} gives {mlps} a width of {shown} at hidden_size={hidden_size} "
        "(FLA's GatedMLP: 2/3 x ratio x hidden_size, truncated, rounded up to a multiple of 256)"
    )
    if width < 1:
        least = 1.5 / hidden_size
        while _samba_mlp_width(hidden_size, least) < 1:  # float rounding of the product
            least = math.nextafter(least, math.inf)
        raise ValueError(
            f"{gives}: no MLP; it must be at least {least!r} at this hidden_size (width 256); "
            + fix
        )
    if width > 2**63 - 1:
        raise ValueError(f"{gives}: more than a tensor dimension holds (2**63 - 1); {fix}")


def _check_mlp_widths(config: PretrainedConfig, name: str) -> None:
    """Check the MLP width settings of FLA baseline ``name``'s ``config`` (after FLA's own
    ``__init__``): ``hidden_ratio`` where it sizes an MLP (DeltaNet and HGRN2 without an
    ``intermediate_size``, which then sizes it; Samba's ``intermediate_size`` is Mamba's) and
    Samba's ``mamba_hidden_ratio``. Mamba-2 has no MLP."""
    if name == "mamba2":
        return
    override = "++model.overrides.{}={}"
    mlp_size = getattr(config, "intermediate_size", None)
    if name != "samba" and mlp_size is not None:
        if not (
            isinstance(mlp_size, numbers.Integral)
            and not isinstance(mlp_size, bool)
            and mlp_size > 0
        ):
            raise ValueError(
                f"intermediate_size={mlp_size!r}: it must be a positive int (the MLPs' width) "
                f"or null (hidden_ratio's width), e.g. {override.format('intermediate_size', 'null')}"
            )
        return
    # a Samba without attention layers whose Mamba layers' MLPs have their own ratio: unused
    unused = name == "samba" and config.attn is None and config.mamba_hidden_ratio is not None
    if not unused:
        _check_mlp_ratio(
            "hidden_ratio",
            config.hidden_ratio,
            config.hidden_size,
            mlps="the MLPs after attention layers" if name == "samba" else "the MLPs",
            null="FLA's default, 4",
            fix=f"e.g. {override.format('hidden_ratio', 4)}",
        )
    if name == "samba":
        _check_mlp_ratio(
            "mamba_hidden_ratio",
            config.mamba_hidden_ratio,
            config.hidden_size,
            mlps="the MLPs after Mamba layers",
            null="hidden_ratio's width, FLA's Samba",
            fix=f"the paper's Samba: 3, e.g. {override.format('mamba_hidden_ratio', 3)}",
        )


def fla_config_class(name: str) -> type:
    """fot's subclass of FLA's config class for baseline ``name`` (cached).

    It only renames the model type to ``fot_<FLA's model type>`` (``fot_mamba2``, ...), the
    ``model_type`` that exported folders carry. Under FLA's own type name transformers would
    load a folder as its own model of that name where it has one: for ``mamba2`` its
    ``Mamba2ForCausalLM``, which computes different logits from the same weights, silently.
    Under fot's name a folder loads through fot's wrapper (``trust_remote_code=True`` or
    :func:`register_auto_classes`), or not at all.
    """
    if name not in _CONFIGS:
        config_cls_name = _FLA_CLASSES[name][0]
        base = getattr(_fla_models_module(), config_cls_name)

        if name == "samba":

            def __init__(
                self: Any,
                *args: Any,
                mamba_hidden_ratio: float | None = None,
                __base: type = base,
                **kwargs: Any,
            ) -> None:
                # mamba_hidden_ratio: the width factor of the MLPs after Mamba layers (None:
                # hidden_ratio, FLA's Samba, as in folders exported before the field);
                # hidden_ratio stays that of the MLPs after attention layers (_SambaMLPs)
                __base.__init__(self, *args, **kwargs)
                self.mamba_hidden_ratio = mamba_hidden_ratio
                _check_mlp_widths(self, name)

        else:

            def __init__(
                self: Any, *args: Any, __base: type = base, __name: str = name, **kwargs: Any
            ) -> None:
                # FLA's own __init__: without one here, transformers' dataclass processing of
                # the subclass would replace it with a generated one that skips FLA's fields
                __base.__init__(self, *args, **kwargs)
                _check_mlp_widths(self, __name)

        _CONFIGS[name] = type(
            f"FoT{config_cls_name}",
            (base,),
            {
                "__init__": __init__,
                "model_type": f"fot_{base.model_type}",
                "__module__": __name__,
                "__doc__": f"FLA's {config_cls_name} under fot's model type for {name}.",
            },
        )
    return _CONFIGS[name]


def _fla_name(config: PretrainedConfig) -> str:
    for name, (config_cls, _, _) in _FLA_CLASSES.items():
        if type(config).__name__ in (config_cls, f"FoT{config_cls}"):
            return name
    raise ValueError(
        f"no FLA baseline for config class {type(config).__name__}; valid: "
        f"{[c for c, _, _ in _FLA_CLASSES.values()]}"
    )


def _uniform_fan_in_(weight: torch.Tensor, scale: float = 1.0) -> None:
    """Draw ``weight`` from U(-b, b), b = ``scale`` / sqrt(fan_in): PyTorch's own init of
    ``nn.Linear`` and ``nn.Conv1d`` (``kaiming_uniform_`` with a = sqrt(5)) for ``scale`` 1."""
    bound = scale / math.sqrt(weight[0].numel())  # fan_in: in_features (x kernel / groups)
    init.uniform_(weight, -bound, bound)


def _default_conv_(conv: nn.Conv1d) -> None:
    """PyTorch's own init of ``conv``: weight and bias from U(+-1/sqrt(fan_in))."""
    _uniform_fan_in_(conv.weight)
    if conv.bias is not None:
        bound = 1 / math.sqrt(conv.weight[0].numel())
        init.uniform_(conv.bias, -bound, bound)


def paper_init_(model: nn.Module) -> None:
    """Initialise an FLA baseline built with FLA's init as the paper's code does.

    The paper's models (transformers 4.44, FLA at commit 1c5937e) draw some weights
    differently from FLA's ``_init_weights``; only those are drawn again here:

    - DeltaNet, HGRN2: every linear layer of the token mixer (``attn``: q/k/v/b/f/i and
      ``o_proj``) from Xavier-uniform with gain 2^-2.5 (the mixer's own init; transformers then
      skips the mixer, so its ``o_proj`` is not rescaled), short convolutions with PyTorch's
      default, and each MLP's ``down_proj`` from N(0, initializer_range / sqrt(2 x layers)).
    - Mamba-2: ``in_proj``, ``conv1d`` (weight and bias) and the LM head with PyTorch's default
      U(+-1/sqrt(fan_in)); ``A_log`` = log(1, 2, ..., heads) per layer (FLA: A from U[1, 16]).
    - Samba: every linear weight but ``dt_proj`` (the LM head included) with PyTorch's
      default, and ``o_proj``, ``down_proj`` and ``out_proj`` with it divided by
      sqrt(2 x layers) (the paper's ``rescale_prenorm_residual``).

    Everything else (embeddings N(0, initializer_range), norms, Mamba's dt, D, Mamba-2's
    ``out_proj``, zero linear biases) is FLA's init already. The draws use transformers'
    guarded init functions: a weight loaded by ``from_pretrained`` is left as it is.
    """
    name = _fla_name(model.config)
    cfg = model.config
    layers = model._decoder.layers
    if name in ("deltanet", "hgrn2"):
        residual_std = cfg.initializer_range / math.sqrt(2 * cfg.num_hidden_layers)
        for layer in layers:
            for module in layer.attn.modules():
                if isinstance(module, nn.Linear):
                    init.xavier_uniform_(module.weight, gain=2**-2.5)
                elif isinstance(module, nn.Conv1d):
                    _default_conv_(module)
            init.normal_(layer.mlp.down_proj.weight, mean=0.0, std=residual_std)
    elif name == "mamba2":
        for layer in layers:
            mixer = layer.mixer
            _uniform_fan_in_(mixer.in_proj.weight)
            _default_conv_(mixer.conv1d)
            heads = torch.arange(1, mixer.num_heads + 1, dtype=torch.float32)
            init.copy_(mixer.A_log, torch.log(heads).to(mixer.A_log.device))
        _uniform_fan_in_(model.lm_head.weight)
    else:  # samba
        residual_scale = 1 / math.sqrt(2 * cfg.num_hidden_layers)
        for layer in layers:
            for path, module in layer.named_modules():
                leaf = path.rsplit(".", 1)[-1]
                if isinstance(module, nn.Linear) and leaf != "dt_proj":
                    residual = leaf in ("o_proj", "down_proj", "out_proj")
                    _uniform_fan_in_(module.weight, residual_scale if residual else 1.0)
        _uniform_fan_in_(model.lm_head.weight)


def _chunked_ce(
    hidden: torch.Tensor, head: torch.nn.Module, labels: torch.Tensor, fp32_logits: bool
) -> torch.Tensor:
    """``[N]`` float32 losses of ``head(hidden)`` (``hidden`` ``[N, H]``, ``labels`` ``[N]``),
    2048 rows of logits at a time; a wrapped or hooked head is called as a module."""
    from fot.models.modeling_fot import _chunked_cross_entropy, _fusable

    weight = head.weight if _fusable(head, hidden.device) else head
    return _chunked_cross_entropy(hidden, weight, labels, 2048, fp32_logits=fp32_logits)


class _FoTContractMixin:
    """``shift_labels`` / ``cu_seqlens`` / ``per_token_loss`` on top of an FLA causal LM."""

    _supports_varlen = False

    compute_dtype: torch.dtype | None = None
    """If set (``torch.bfloat16``, ``torch.float16``), every forward runs under autocast to it
    over the model's float32 weights, as fot trains these models. ``fot.eval`` sets it instead
    of casting the weights to 16 bits: FLA's layers compute some gates in the weights' dtype,
    where the paper's code (and autocast) use float32. In 16-bit weights HGRN2's input gate
    ``1 - exp(log_sigmoid(f))`` rounds to a 2^-8 grid near 1 (the long-memory channels lose
    their input), and Mamba-2's residual stream and A/dt parameters drop to bf16."""

    @torch.no_grad()
    def initialize_weights(self) -> None:
        """FLA's initialisation (transformers' ``initialize_weights``), then the paper's
        (:func:`paper_init_`). transformers calls it when it builds the model on a real device
        (not on ``meta``, not for the weights that ``from_pretrained`` loads)."""
        super().initialize_weights()
        paper_init_(self)

    def _autocast(self) -> contextlib.AbstractContextManager:
        if self.compute_dtype is None:
            return contextlib.nullcontext()
        device = self.get_input_embeddings().weight.device.type
        return torch.autocast(device, dtype=self.compute_dtype)

    def save_pretrained(self, save_directory: str | os.PathLike, *args: Any, **kwargs: Any) -> None:
        """``PreTrainedModel.save_pretrained``, keeping a folder exported by
        :func:`fot.export.export_hf` loadable with ``trust_remote_code=True``.

        A model loaded from such a folder keeps its ``auto_map`` (fot's remote-code shims);
        transformers' save would copy FLA's config module instead and point ``auto_map`` at it,
        without the model shim. The shims and ``auto_map`` are written again after the save.
        The weight files get the mode the umask allows (``fot.export.make_weights_readable``).
        """
        super().save_pretrained(save_directory, *args, **kwargs)
        from fot.export import make_weights_readable, remote_code_auto_map, write_remote_code

        make_weights_readable(save_directory)
        ref = (getattr(self.config, "auto_map", None) or {}).get("AutoModelForCausalLM")
        if not (isinstance(ref, str) and ref.startswith("modeling_fot.")):
            return  # not a folder of fot's remote code: transformers' save as it is

        write_remote_code(save_directory, type(self.config), type(self))
        path = Path(save_directory) / "config.json"
        saved = json.loads(path.read_text())
        saved["auto_map"] = remote_code_auto_map(type(self.config), type(self))
        path.write_text(json.dumps(saved, indent=2, sort_keys=True) + "\n")

    def _validate_model_kwargs(self, model_kwargs: dict) -> None:
        """``generate()`` hook: refuse a right-padded ``attention_mask``, as FoT models do
        (``fot.models.modeling_fot.refuse_right_padding``)."""
        from fot.models.modeling_fot import refuse_right_padding

        refuse_right_padding(model_kwargs.get("attention_mask"))
        super()._validate_model_kwargs(model_kwargs)

    def init_continuous_batching(self, *args: Any, **kwargs: Any) -> None:
        """Refused as for FoT models (``fot.models.modeling_fot.refuse_continuous_batching``):
        a paged K/V cache cannot hold these layers' recurrent state."""
        from fot.models.modeling_fot import refuse_continuous_batching

        refuse_continuous_batching(self, "a recurrent state (or convolution state)")

    def _prepare_model_inputs(self, *args: Any, **kwargs: Any) -> tuple:
        """``generate()`` hook, once per call: refuse prompt token ids outside the vocabulary,
        as FoT models do (``fot.models.modeling_fot.refuse_out_of_vocab``)."""
        from fot.models.modeling_fot import refuse_out_of_vocab

        inputs, input_name, model_kwargs = super()._prepare_model_inputs(*args, **kwargs)
        if input_name == "input_ids":
            refuse_out_of_vocab(inputs, self.config.vocab_size)
        return inputs, input_name, model_kwargs

    def _choose_kernels(self) -> None:
        """Run DeltaNet's and HGRN2's layers on FLA's recurrent kernel where its chunked one
        cannot run: DeltaNet's refuses float32 inputs ("does not support float32"), and Triton's
        interpreter (the CPU) fails in both beyond 64 tokens. The two kernels compute the same
        recurrence; elsewhere the layers keep ``config.attn_mode``. A mode other than
        ``chunk`` in the config is left alone."""
        if getattr(self.config, "attn_mode", None) != "chunk":
            return
        weight = self.get_input_embeddings().weight
        on_cpu = weight.device.type != "cuda"
        float32 = weight.dtype == torch.float32 and not torch.is_autocast_enabled(
            weight.device.type
        )
        for layer in getattr(self._decoder, "layers", []):
            kind = type(layer.attn).__name__
            recurrent = on_cpu or (kind == "DeltaNet" and float32)
            if kind in ("DeltaNet", "HGRN2Attention"):
                layer.attn.mode = "fused_recurrent" if recurrent else "chunk"

    @property
    def _decoder(self) -> torch.nn.Module:
        # FLA names the decoder `model` (DeltaNet, HGRN2) or `backbone` (Mamba-2, Samba).
        return self.model if hasattr(self, "model") else self.backbone

    def _hidden(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None,
        cu_seqlens: torch.Tensor | None,
    ) -> torch.Tensor:
        if cu_seqlens is None:
            return self._decoder(
                input_ids=input_ids, attention_mask=attention_mask, use_cache=False
            )[0]
        if input_ids.shape[0] != 1:
            raise ValueError(f"cu_seqlens needs batch size 1, got {input_ids.shape[0]}")
        if self._supports_varlen:
            return self._decoder(input_ids=input_ids, use_cache=False, cu_seqlens=cu_seqlens)[0]
        # No varlen kernels for this model: run the documents one by one (exact, slower).
        bounds = cu_seqlens.tolist()
        parts = [
            self._decoder(input_ids=input_ids[:, s:e], use_cache=False)[0]
            for s, e in itertools.pairwise(bounds)
            if e > s
        ]
        return torch.cat(parts, dim=1)

    def _token_losses(
        self, hidden: torch.Tensor, shift_labels: torch.Tensor, fp32_logits: bool = False
    ) -> torch.Tensor:
        B, T, H = hidden.shape
        if shift_labels.shape != (B, T):
            raise ValueError(
                f"shift_labels must be [B, T] = {(B, T)}, got {tuple(shift_labels.shape)}"
            )
        labels = shift_labels.to(hidden.device).reshape(-1).long()
        return _chunked_ce(hidden.reshape(B * T, H), self.lm_head, labels, fp32_logits).view(B, T)

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask=None,
        labels: torch.LongTensor | None = None,
        cu_seqlens: torch.Tensor | None = None,
        **kwargs: Any,
    ):
        """FLA's forward, or fot's loss / packed path when ``shift_labels``, ``labels`` or
        document boundaries are given (under autocast to :attr:`compute_dtype` if set).

        ``shift_labels`` ``[B, T]`` and ``num_items_in_batch`` (HF ``Trainer`` under gradient
        accumulation: the loss is then the sum of token losses over it) come as keyword
        arguments, as in HF models. HF's packing keys (``cu_seq_lens_q`` / ``cu_seq_lens_k``,
        restarting ``position_ids``; ``fot.models.modeling_fot.hf_packing_kwargs``) are read
        as ``cu_seqlens``. On fot's path, keys other than these, ``use_cache``,
        ``return_dict`` and ``cache_position`` raise ``TypeError`` unless None. With
        ``labels`` in eval mode the float32 logits come with the loss (HF ``Trainer``'s
        ``evaluate`` / ``predict`` hand them to ``compute_metrics``); in training mode, and
        with ``shift_labels``, ``logits`` is None (the loss never forms them whole on CUDA).
        """
        with self._autocast():
            return self._forward(input_ids, attention_mask, labels, cu_seqlens, **kwargs)

    def _forward(
        self,
        input_ids: torch.LongTensor | None,
        attention_mask: torch.Tensor | None,
        labels: torch.LongTensor | None,
        cu_seqlens: torch.Tensor | None,
        **kwargs: Any,
    ):
        from fot.models.modeling_fot import _fusable, hf_packing_kwargs, refuse_out_of_vocab

        self._choose_kernels()
        # no host sync: on the CPU outside training only (as FoTModel.forward)
        if torch.is_tensor(input_ids) and input_ids.device.type == "cpu" and not self.training:
            refuse_out_of_vocab(input_ids, self.config.vocab_size)
        shift_labels = kwargs.pop("shift_labels", None)
        num_items = kwargs.pop("num_items_in_batch", None)
        packing = {
            k: kwargs.pop(k)
            for k in ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")
            if k in kwargs
        }
        if kwargs.get("position_ids") is not None:  # restarts mark documents, else unused
            packing["position_ids"] = kwargs.pop("position_ids")
        if packing and input_ids is None:
            raise ValueError(
                f"the packing keys {sorted(packing)} need input_ids (not inputs_embeds) here"
            )
        if packing:
            cu_seqlens = hf_packing_kwargs(
                packing, cu_seqlens, tuple(input_ids.shape), attention_mask, 0, input_ids.device
            )
        if kwargs.get("cache") is not None:
            # transformers >= 5.24 (generate() among them) passes the cache as `cache`; FLA's
            # models read `past_key_values` only, and would run each decoding step without state
            if kwargs.get("past_key_values") is not None:
                raise ValueError(
                    "the cache was passed twice, as past_key_values and as cache: pass it once"
                )
            kwargs["past_key_values"] = kwargs.pop("cache")
        if shift_labels is None and labels is None and cu_seqlens is None:
            return super().forward(input_ids=input_ids, attention_mask=attention_mask, **kwargs)
        unknown = sorted(
            k
            for k, v in kwargs.items()
            if v is not None and k not in ("use_cache", "return_dict", "cache_position")
        )
        if unknown:
            raise TypeError(
                f"with labels or packed documents the fot wrapper computes the loss itself and "
                f"does not support the keyword arguments {unknown}; leave them out"
            )
        # HF-style `labels` outside training (HF Trainer's evaluate / predict, which hand the
        # logits to compute_metrics) return the logits with the loss, as FoT models do
        want_logits = shift_labels is None and (labels is None or not self.training)
        if shift_labels is None and labels is not None:
            shift_labels = F.pad(labels[:, 1:], (0, 1), value=IGNORE_INDEX)
        hidden = self._hidden(input_ids, attention_mask, cu_seqlens)
        # return_dict=False gives the tuple, as FLA's own forward does (a ModelOutput unpacked
        # as `loss, logits = ...` would give its key names)
        return_dict = kwargs.get("return_dict")
        if return_dict is None:
            return_dict = getattr(self.config, "return_dict", True)

        def result(**fields: Any) -> CausalLMOutputWithPast | tuple:
            out = CausalLMOutputWithPast(**fields)
            return out if return_dict else out.to_tuple()

        if shift_labels is None:
            return result(logits=self.lm_head(hidden).float())
        # Sum, then divide on device (no host sync); an all-ignored batch gives 0.
        if num_items is None:
            count = (shift_labels.to(hidden.device) != IGNORE_INDEX).sum().clamp(min=1)
        elif isinstance(num_items, torch.Tensor):
            count = num_items.to(hidden.device, non_blocking=True).clamp(min=1)
        else:
            count = max(int(num_items), 1)
        if hidden.is_cuda and _fusable(self.lm_head, hidden.device):  # reads the weight
            from fla.modules import FusedLinearCrossEntropyLoss

            B, T, H = hidden.shape
            fn = FusedLinearCrossEntropyLoss(ignore_index=IGNORE_INDEX, reduction="sum")
            total = fn(
                hidden.reshape(B * T, H), shift_labels.reshape(-1).long(), self.lm_head.weight
            )
        else:
            total = self._token_losses(hidden, shift_labels).sum()
        logits = self.lm_head(hidden).float() if want_logits else None
        return result(loss=total / count, logits=logits)

    def final_hidden_states(
        self, input_ids: torch.LongTensor, cu_seqlens: torch.Tensor | None = None
    ) -> torch.Tensor:
        """The decoder's final (normed) hidden states ``[B, T, H]`` of ``input_ids`` ``[B, T]``
        (int64; packed documents with ``cu_seqlens``), as :meth:`forward` computes them: same
        kernels (:meth:`_choose_kernels`), under autocast to :attr:`compute_dtype` if set.
        :meth:`head_logits` of them are the model's logits, for callers that need only some
        positions' logits (``fot.eval``)."""
        with self._autocast():
            self._choose_kernels()
            return self._hidden(input_ids, None, cu_seqlens)

    def head_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits ``[..., V]`` of final hidden states ``[..., H]`` (from
        :meth:`final_hidden_states`), under autocast to :attr:`compute_dtype` if set."""
        with self._autocast():
            return self.lm_head(hidden)

    @torch.no_grad()
    def per_token_loss(
        self,
        input_ids: torch.LongTensor,
        shift_labels: torch.LongTensor,
        cu_seqlens: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``[B, T]`` float32 next-token losses, 0 where ``shift_labels == -100``."""
        hidden = self.final_hidden_states(input_ids, cu_seqlens)
        with self._autocast():
            return self._token_losses(hidden, shift_labels, fp32_logits=True)


class _SambaMLPs:
    """Samba with the paper's MLP widths: those after Mamba layers get
    ``config.mamba_hidden_ratio`` (the paper's 3), those after attention keep FLA's
    ``hidden_ratio`` (4). FLA builds every MLP with ``hidden_ratio``; the Mamba layers' MLPs
    are replaced before the model is initialised (``post_init``), so that a fresh model, a
    ``from_config`` one and a ``from_pretrained`` one all have the widths their config says."""

    def post_init(self) -> None:
        from fla.layers.mamba import Mamba
        from fla.modules import GatedMLP

        cfg = self.config
        ratio = getattr(cfg, "mamba_hidden_ratio", None)
        if ratio is not None and ratio != cfg.hidden_ratio:
            for layer in self.backbone.layers:
                if isinstance(layer.mixer, Mamba):
                    old = layer.mlp.down_proj.weight
                    layer.mlp = GatedMLP(
                        hidden_size=cfg.hidden_size,
                        hidden_ratio=ratio,
                        hidden_act=cfg.hidden_act,
                        fuse_swiglu=cfg.fuse_swiglu,
                    ).to(device=old.device, dtype=old.dtype)
        super().post_init()


_WRAPPED: dict[str, type] = {}


def untimed_autotune_in_interpreter() -> None:
    """Under ``TRITON_INTERPRET=1`` without a CUDA GPU, make Triton's autotuner skip timing.

    The autotuner times every config on the GPU driver, and there is none ("0 active drivers
    ... There should only be one"): FLA's autotuned kernels could not run on the CPU at all.
    With every config scored alike, the first one runs; the interpreter's results do not
    depend on the config. Does nothing when a GPU is present or the interpreter is off.
    """
    if os.environ.get("TRITON_INTERPRET", "0") != "1" or torch.cuda.is_available():
        return
    from triton.runtime import autotuner

    def untimed(self: Any, *args: Any, config: Any, **meta: Any) -> list[float]:
        return [0.0, 0.0, 0.0]

    autotuner.Autotuner._bench = untimed


def fla_model_class(name: str) -> type:
    """The fot-contract subclass of FLA's model class for baseline ``name`` (cached)."""
    untimed_autotune_in_interpreter()
    if name not in _WRAPPED:
        _, model_cls_name, varlen = _FLA_CLASSES[name]
        base = getattr(_fla_models_module(), model_cls_name)
        from fot.models.modeling_fot import BosPadGenerationMixin

        contract = (_FoTContractMixin, BosPadGenerationMixin)
        mixins = (_SambaMLPs, *contract) if name == "samba" else contract
        _WRAPPED[name] = type(
            f"FoT{model_cls_name}",
            (*mixins, base),
            {
                "_supports_varlen": varlen,
                "config_class": fla_config_class(name),
                "__module__": __name__,
                "__doc__": f"FLA's {model_cls_name} with the fot model contract.",
            },
        )
    return _WRAPPED[name]


def register_auto_classes() -> None:
    """Make ``AutoConfig`` / ``AutoModelForCausalLM`` load the baselines' folders through the
    fot-contract wrappers: fot's model types (``fot_mamba2``, ...) and, for folders exported
    before those types, FLA's config classes (instead of FLA's own model classes, which
    ``import fla`` registers)."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    for name, (config_cls_name, _, _) in _FLA_CLASSES.items():
        config_cls, model_cls = fla_config_class(name), fla_model_class(name)
        AutoConfig.register(config_cls.model_type, config_cls, exist_ok=True)
        AutoModelForCausalLM.register(config_cls, model_cls, exist_ok=True)
        # register() insists on the model's own config class; FLA's is its base
        base = getattr(_fla_models_module(), config_cls_name)
        AutoModelForCausalLM._model_mapping.register(base, model_cls, exist_ok=True)
        # The class names transformers knows as causal LMs (HF Trainer's label smoothing
        # shifts the labels only for those); FLA's own are not there either.
        MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[config_cls.model_type] = model_cls.__name__


def _has_attention(config: PretrainedConfig) -> bool:
    from fla.models.configuration_utils import get_attention_spec

    return any(
        get_attention_spec(config.attn, layer_idx=i) is not None
        for i in range(config.num_hidden_layers)
    )


def missing_package(config: PretrainedConfig) -> str | None:
    """Why the FLA baseline of ``config`` cannot be built here, where a package it needs is not
    installed (Samba's attention layers need ``flash-attn``: FLA's choice); ``None`` where it
    can."""
    if (
        _fla_name(config) == "samba"
        and _has_attention(config)
        and importlib.util.find_spec("flash_attn") is None
    ):
        return (
            "FLA's Samba uses flash-attn for its sliding-window attention layers: install it "
            "on the GPU machine (pip install flash-attn --no-build-isolation) to build 'samba'"
        )
    return None


def build_fla_model(config: PretrainedConfig) -> torch.nn.Module:
    """Instantiate the (wrapped) FLA model for an FLA config from :func:`fla_config`.

    The weights are drawn as in the paper's code (:func:`paper_init_`, through transformers'
    ``post_init``), from torch's global random state: seed it for a reproducible model.

    Raises:
        ImportError: Samba's attention layers need the ``flash-attn`` package (FLA's choice);
            a Samba without attention layers (``attn=None``) builds without it.
    """
    name = _fla_name(config)
    register_auto_classes()
    missing = missing_package(config)
    if missing is not None:
        raise MissingPackageError(missing)
    model = fla_model_class(name)(config)
    # HGRN2's per-layer lower bounds (logits of its forget gates' floors) take no weight
    # decay, which would pull them to equal floors: the paper's code marks them so, FLA does not
    bounds = getattr(model._decoder, "lower_bounds", None)
    if bounds is not None:
        bounds._no_weight_decay = True
    return model


def samba_mlp_widths(config: PretrainedConfig) -> tuple[int | None, int | None]:
    """The widths of the MLPs a Samba ``config`` builds, after its attention layers and after
    its Mamba layers (None where it has no layers of that kind).

    ``hidden_ratio`` and ``mamba_hidden_ratio`` matter only as these widths: ratios that round
    to the same multiple of 256 (``mamba_hidden_ratio`` None and the value of ``hidden_ratio``,
    3 and 3.5 at hidden_size 128) build the same model.
    """
    from fla.models.configuration_utils import get_attention_spec

    kinds = {
        get_attention_spec(config.attn, layer_idx=i) is not None
        for i in range(config.num_hidden_layers)
    }
    ratio = config.hidden_ratio if config.hidden_ratio is not None else 4  # GatedMLP's default
    mamba_ratio = getattr(config, "mamba_hidden_ratio", None)
    if mamba_ratio is None:
        mamba_ratio = ratio
    return (
        _samba_mlp_width(config.hidden_size, ratio) if True in kinds else None,
        _samba_mlp_width(config.hidden_size, mamba_ratio) if False in kinds else None,
    )


def older_samba_widths(config: PretrainedConfig, shapes: Mapping[str, Sequence[int]]) -> bool:
    """Whether weights of these shapes are the Samba of ``config`` as fot built it before
    ``mamba_hidden_ratio``: FLA's MLP width (``hidden_ratio``) after the Mamba layers too.

    Such weights (a training checkpoint of an older fot, whose trainer.json has no
    ``mamba_hidden_ratio``) do not fit the model ``config`` builds now; callers name the cause
    instead of calling the folder a mix of two runs' files.

    Args:
        config: the model config the weights were read for.
        shapes: weight name -> shape of the weights that did not load.

    Returns:
        True if ``config`` is a Samba whose ``mamba_hidden_ratio`` gives other widths than
        ``hidden_ratio`` and ``shapes`` are exactly those of the same Samba with FLA's widths.
    """
    ratio = getattr(config, "mamba_hidden_ratio", None)
    if type(config).__name__ != "FoTSambaConfig" or ratio in (None, config.hidden_ratio):
        return False
    older = copy.deepcopy(config)
    older.mamba_hidden_ratio = None
    try:
        with torch.device("meta"):
            model = build_fla_model(older)
    except ImportError:  # flash-attn missing: the caller could not build the model either
        return False
    want = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    return want == {k: tuple(v) for k, v in shapes.items()}


def __getattr__(name: str) -> type:
    # Lazy module attributes FoTMamba2ForCausalLM, FoTMamba2Config etc., so that exported
    # auto_map shims can import them.
    for key, (config_cls_name, model_cls_name, _) in _FLA_CLASSES.items():
        if name == f"FoT{model_cls_name}":
            return fla_model_class(key)
        if name == f"FoT{config_cls_name}":
            return fla_config_class(key)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "FLA_MODELS",
    "FLA_MODEL_TYPES",
    "build_fla_model",
    "fla_config",
    "fla_config_class",
    "fla_model_class",
    "older_samba_widths",
    "paper_init_",
    "register_auto_classes",
    "samba_mlp_widths",
]

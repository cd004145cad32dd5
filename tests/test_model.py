"""FoT model family on CPU (reference attention backend).

Oracles: a hand-written float64 forgetting-attention layer (loops over i, j; no cumsum trick),
HF ``LlamaForCausalLM`` with copied weights (gate ``none`` + RoPE), separate sequences (packed
batches), the full forward (cached decode, left padding, generate), and ``F.cross_entropy`` on
full logits (chunked loss).
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import fot
from fot import presets
from fot.models import FoTCache
from fot.models import cache as cache_module
from fot.models.modeling_fot import FoTAttention, long_init_bias

VOCAB = 300  # small vocab keeps tests fast; padded to 320 in the embedding
SMALL = {"bos_token_id": None, "eos_token_id": None}  # GPT-2 EOT (50256) is outside VOCAB
TOL = 2e-5  # fp32 absolute tolerance on logits

FOT_MODELS = [m for m in presets.MODELS if m not in ("mamba2", "deltanet", "hgrn2", "samba")]
PRO_FIELDS = ("qk_norm", "use_k_shift", "use_v_shift", "use_output_norm", "use_output_gate")
PRO_PARAMS = {
    "qk_norm": {"q_norm.weight", "k_norm.weight"},
    "use_k_shift": {"k_shift_proj.weight"},
    "use_v_shift": {"v_shift_proj.weight"},
    "use_output_norm": {"o_norm.weight"},
    "use_output_gate": {"g_proj.weight"},
}
"""The attention parameters each Pro switch of :data:`PRO_FIELDS` adds."""


def tiny(model: str = "fot_pro", **overrides) -> fot.FoTForCausalLM:
    torch.manual_seed(0)
    kwargs = {"vocab_size": VOCAB, "attn_backend": "reference", **SMALL, **overrides}
    cfg = presets.config(model, "tiny", **kwargs)
    m = presets.build_model(cfg).eval()
    _randomize_norms(m)
    return m


def count_fused_add_norm(monkeypatch: pytest.MonkeyPatch) -> list[torch.device]:
    """Count the calls of the fused residual add + RMSNorm (``norm_ops.add_rms_norm``) from
    here on: the returned list gets each call's input device."""
    import fot.kernels.norm_ops as norm_ops

    calls: list[torch.device] = []
    fused_add_norm = norm_ops.add_rms_norm

    def counted(*args, **kwargs):
        calls.append(args[0].device)
        return fused_add_norm(*args, **kwargs)

    monkeypatch.setattr(norm_ops, "add_rms_norm", counted)
    return calls


def _randomize_norms(model: torch.nn.Module) -> None:
    """Norm weights start at 1: perturb them so that tests see their per-head layout."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.3 * torch.randn_like(p))


def ids(B: int, T: int, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (B, T), generator=g)


def left_padded(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The batch of prompts ``a`` ``[1, La]`` and ``b`` ``[1, Lb]`` (``Lb < La``), ``b``
    left-padded with zeros, and its attention mask (0 on the padding)."""
    pad = a.shape[1] - b.shape[1]
    x = torch.cat([a, torch.cat([torch.zeros(1, pad, dtype=torch.long), b], dim=1)])
    return x, torch.tensor([[1] * a.shape[1], [0] * pad + [1] * b.shape[1]])


def greedy_with_logits(max_new_tokens: int) -> dict[str, object]:
    """``generate`` arguments of a greedy decode that returns each step's logits."""
    return {
        "max_new_tokens": max_new_tokens,
        "do_sample": False,
        "pad_token_id": 0,
        "output_logits": True,
        "return_dict_in_generate": True,
    }


def max_err(a: torch.Tensor, b: torch.Tensor) -> float:
    assert not torch.isnan(a).any() and not torch.isnan(b).any()
    return (a - b).abs().max().item()


# ---------------------------------------------------------------------------------------
# Shapes, gradients, loss
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("model", FOT_MODELS)
def test_every_variant_shapes_and_gradients(model: str) -> None:
    m = tiny(model).train()
    x = ids(2, 33)
    out = m(x)
    assert out.logits.shape == (2, 33, VOCAB)  # padding columns never returned
    loss = m(x, shift_labels=ids(2, 33, seed=2)).loss
    assert torch.isfinite(loss) and 4.0 < loss.item() < 8.0  # ~log(300) = 5.7 at init
    loss.backward()
    for name, p in m.named_parameters():
        assert p.grad is not None, f"no gradient for {name}"
        assert torch.isfinite(p.grad).all(), name
        if name != "lm_head.weight":
            assert p.grad.abs().sum() > 0, f"zero gradient for {name}"
    # padded LM-head rows get no gradient: they are never predicted
    assert m.lm_head.weight.grad[VOCAB:].abs().sum() == 0
    assert m.lm_head.weight.grad[:VOCAB].abs().sum() > 0


@pytest.mark.parametrize("bits", range(32))
def test_every_combination_of_switches_trains_every_parameter(bits: int) -> None:
    """Each of the 32 combinations of the Pro switches (with the four gate types, RoPE,
    a window and GQA spread over them) builds exactly the parameters its switches name and
    trains: the loss is finite and every parameter gets a non-zero gradient (a parameter built
    but never read would waste memory and stop DDP with find_unused_parameters=False)."""
    switches = {field: bool(bits >> i & 1) for i, field in enumerate(PRO_FIELDS)}
    gate = ("full", "bias_only", "fixed", "none")[bits % 4]
    m = tiny(
        "fot_llama",
        **switches,
        fgate_type=gate,
        use_rope=gate == "none" or bits % 3 == 0,
        window_size=8 if bits % 5 == 0 else None,
        num_kv_heads=2 if bits % 2 else None,
    ).train()
    want = {"q_proj.weight", "k_proj.weight", "v_proj.weight", "o_proj.weight"}
    want |= {"full": {"fgate_proj.weight", "fgate_proj.bias"}, "bias_only": {"fgate_bias"}}.get(
        gate, set()
    )
    for field, on in switches.items():
        want |= PRO_PARAMS[field] if on else set()
    attn = {n for n, _ in m.model.layers[0].self_attn.named_parameters()}
    assert attn == want
    loss = m(ids(1, 24), shift_labels=ids(1, 24, seed=2)).loss
    assert torch.isfinite(loss)
    loss.backward()
    for name, p in m.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, f"no gradient for {name}"


def test_vocab_padded_to_multiple_of_64() -> None:
    m = tiny("fot_llama", vocab_size=50257)
    assert m.model.embed_tokens.weight.shape[0] == 50304
    assert m.lm_head.weight.shape[0] == 50304
    assert m(ids(1, 5)).logits.shape[-1] == 50257
    # rounded up to the next multiple, never past one: a multiple is kept as it is
    for vocab, multiple, rows in ((256, 64, 256), (257, 64, 320), (50304, 64, 50304), (7, 1, 7)):
        cfg = fot.FoTConfig(vocab_size=vocab, pad_vocab_multiple=multiple)
        assert cfg.padded_vocab_size == rows, (vocab, multiple)


def test_init_is_normal_002_and_untied() -> None:
    m = presets.build_model(presets.config("fot_pro", "tiny"))
    emb, head = m.model.embed_tokens.weight, m.lm_head.weight
    assert emb.data_ptr() != head.data_ptr()
    for w in (
        emb,
        head,
        m.model.layers[0].self_attn.q_proj.weight,
        m.model.layers[0].mlp.up_proj.weight,
    ):
        assert abs(w.std().item() - 0.02) < 0.002 and abs(w.mean().item()) < 0.002
    assert torch.all(m.model.layers[0].self_attn.fgate_proj.bias == 0)
    # every projection, the output ones (o_proj, down_proj) too: no depth-scaled std
    for name, mod in m.named_modules():
        if isinstance(mod, (torch.nn.Linear, torch.nn.Embedding)):
            w = mod.weight
            assert abs(w.std().item() - 0.02) < 0.003 and abs(w.mean().item()) < 0.003, name


def test_init_weights_of_a_meta_built_model_gives_the_long_init_gate_bias() -> None:
    """A model built on the meta device (no data), moved with ``to_empty`` and initialised by
    HF's ``init_weights`` (as ``from_pretrained`` initialises missing weights) gets the same
    init as one built directly: the bias-only / fixed gates' long-init bias (decay times
    log-uniform in [2, decay_time_max]), not whatever memory ``to_empty`` left."""
    for name in ("fot_llama_bias_only", "fot_llama_fixed"):
        cfg = presets.config(name, "tiny")
        with torch.device("meta"):
            m = presets.build_model(cfg)
        m.to_empty(device="cpu")
        m.init_weights()
        want = torch.logspace(math.log10(2.0), math.log10(cfg.decay_time_max), 4).double()
        for layer in m.model.layers:
            times = 1.0 / (-F.logsigmoid(layer.self_attn.fgate_bias.double()))
            assert torch.allclose(times, want, rtol=1e-4), name
            assert torch.all(layer.input_layernorm.weight == 1), name
        assert abs(m.model.layers[0].self_attn.q_proj.weight.std().item() - 0.02) < 0.003


def test_loss_matches_full_cross_entropy_and_labels_convention() -> None:
    m = tiny("fot_pro", loss_chunk_size=7)  # chunks that do not divide B*T
    x, y = ids(2, 19), ids(2, 19, seed=3)
    y[0, :4] = -100
    logits = m(x).logits
    want = F.cross_entropy(logits.reshape(-1, VOCAB), y.reshape(-1), ignore_index=-100)
    out = m(x, shift_labels=y)
    assert out.logits is None  # loss path never builds the full logits
    assert abs(out.loss.item() - want.item()) < 1e-5
    # HF-style labels are shifted inside: labels[t + 1] is the target of position t
    labels = torch.cat([torch.zeros(2, 1, dtype=torch.long), y[:, :-1]], dim=1)
    y_hf = y.clone()
    y_hf[:, -1] = -100
    want_hf = F.cross_entropy(logits.reshape(-1, VOCAB), y_hf.reshape(-1), ignore_index=-100)
    assert abs(m(x, labels=labels).loss.item() - want_hf.item()) < 1e-5
    # per-token loss: same numbers, 0 where ignored
    ptl = m.per_token_loss(x, y)
    assert ptl.dtype == torch.float32 and ptl.shape == (2, 19)
    manual = F.cross_entropy(
        logits.reshape(-1, VOCAB), y.reshape(-1), ignore_index=-100, reduction="none"
    ).view(2, 19)
    assert max_err(ptl, manual) < 1e-5
    assert torch.all(ptl[0, :4] == 0)


def test_chunked_loss_gradient_matches_full() -> None:
    m1, m2 = tiny("fot_llama", loss_chunk_size=5), tiny("fot_llama", loss_chunk_size=4096)
    x, y = ids(1, 13), ids(1, 13, seed=4)
    m1(x, shift_labels=y).loss.backward()
    m2(x, shift_labels=y).loss.backward()
    for (n, p1), p2 in zip(m1.named_parameters(), m2.parameters()):
        assert torch.allclose(p1.grad, p2.grad, atol=1e-6), n


def _gradient_penalty(m: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """Squared norm of the loss's parameter gradient, differentiable (create_graph=True)."""
    params = list(m.parameters())
    grads = torch.autograd.grad(m(x, labels=x).loss, params, create_graph=True, allow_unused=True)
    return sum(g.square().sum() for g in grads if g is not None)


@pytest.mark.parametrize("model", ["fot_pro", "transformer_llama"])
def test_a_gradient_penalty_through_the_model_is_exact_or_raises(model: str) -> None:
    """A second-order gradient through the model: the default CPU path (PyTorch ops) gives
    the one central differences of the penalty give; the fused kernels (attn_backend=
    "triton", loss_impl="fused"), whose backwards build no graph, gave one 40-110% off without
    a word and now raise."""
    x = ids(1, 12)
    m = tiny(model, attn_backend="auto").double()
    params = list(m.parameters())
    analytic = torch.autograd.grad(_gradient_penalty(m, x), params, allow_unused=True)
    d = [torch.randn(p.shape, dtype=p.dtype, generator=torch.Generator().manual_seed(i))
         for i, p in enumerate(params)]  # fmt: skip
    eps, sides = 1e-5, []
    for sign in (1, -2):  # to +eps, then to -eps
        with torch.no_grad():
            for p, v in zip(params, d, strict=True):
                p.add_(sign * eps * v)
        sides.append(_gradient_penalty(m, x).item())
    numeric = (sides[0] - sides[1]) / (2 * eps)
    directional = sum((g * v).sum() for g, v in zip(analytic, d, strict=True) if g is not None)
    assert directional.item() == pytest.approx(numeric, rel=1e-5)
    for fused in ({"attn_backend": "triton"}, {"loss_impl": "fused"}):
        with pytest.raises(RuntimeError, match="is differentiable once"):
            _gradient_penalty(tiny(model, **fused), x)


# ---------------------------------------------------------------------------------------
# Oracles for the block
# ---------------------------------------------------------------------------------------


def _oracle_attention(attn: FoTAttention, x: torch.Tensor) -> torch.Tensor:
    """Forgetting attention written from the paper's equations, float64, explicit loops."""
    cfg = attn.config
    B, T, _ = x.shape
    HQ, H, D = cfg.num_heads, cfg.kv_heads, cfg.head_dim
    p = {n: t.double() for n, t in attn.state_dict().items()}
    x = x.double()

    def rms(y, w, eps=cfg.norm_eps):  # y (..., D), w (D,)
        return y / torch.sqrt((y * y).mean(-1, keepdim=True) + eps) * w

    q = (x @ p["q_proj.weight"].T).view(B, T, HQ, D)
    k = (x @ p["k_proj.weight"].T).view(B, T, H, D)
    v = (x @ p["v_proj.weight"].T).view(B, T, H, D)
    for name, flag in (("k", cfg.use_k_shift), ("v", cfg.use_v_shift)):
        if not flag:
            continue
        raw = k if name == "k" else v
        a = torch.sigmoid(x @ p[f"{name}_shift_proj.weight"].T)  # (B, T, H)
        shifted = torch.zeros_like(raw)
        for t in range(T):
            prev = raw[:, t - 1] if t > 0 else torch.zeros_like(raw[:, 0])
            shifted[:, t] = a[:, t, :, None] * prev + (1 - a[:, t, :, None]) * raw[:, t]
        if name == "k":
            k = shifted
        else:
            v = shifted
    if cfg.qk_norm:  # eps 1e-5: the paper's code builds its q/k norms with their default
        q = torch.stack([rms(q[:, :, h], p["q_norm.weight"][h], 1e-5) for h in range(HQ)], dim=2)
        k = torch.stack([rms(k[:, :, h], p["k_norm.weight"][h], 1e-5) for h in range(H)], dim=2)
    if cfg.fgate_type == "full":
        log_f = F.logsigmoid(x @ p["fgate_proj.weight"].T + p["fgate_proj.bias"])
    elif cfg.fgate_type in ("bias_only", "fixed"):
        log_f = F.logsigmoid(p["fgate_bias"]).expand(B, T, HQ)
    else:
        log_f = torch.zeros(B, T, HQ, dtype=torch.float64)
    o = torch.zeros(B, T, HQ, D, dtype=torch.float64)
    for b in range(B):
        for h in range(HQ):
            kv = h // (HQ // H)
            for i in range(T):
                logits = torch.stack(
                    [
                        q[b, i, h] @ k[b, j, kv] / math.sqrt(D) + log_f[b, j + 1 : i + 1, h].sum()
                        for j in range(i + 1)
                    ]
                )
                w = torch.softmax(logits, dim=0)
                o[b, i, h] = (w[:, None] * v[b, : i + 1, kv]).sum(0)
    if cfg.use_output_norm:
        o = torch.stack([rms(o[:, :, h], p["o_norm.weight"][h]) for h in range(HQ)], dim=2)
    if cfg.use_output_gate:
        o = o * torch.sigmoid(x @ p["g_proj.weight"].T).view(B, T, HQ, D)
    return o.reshape(B, T, HQ * D) @ p["o_proj.weight"].T


@pytest.mark.parametrize(
    "model,extra",
    [
        ("fot_pro", {}),
        ("fot_llama", {}),
        ("fot_pro", {"num_kv_heads": 2}),
        ("fot_pro_bias_only", {}),
        ("fot_llama_fixed", {}),
    ],
)
def test_attention_layer_matches_handwritten_oracle(model: str, extra: dict) -> None:
    m = tiny(model, **extra)
    attn = m.model.layers[0].self_attn
    with torch.no_grad():  # non-trivial gate biases so that decay actually matters
        if hasattr(attn, "fgate_proj"):
            attn.fgate_proj.bias.normal_(1.0, 1.0)
            attn.fgate_proj.weight.mul_(20)
    x = torch.randn(2, 9, m.config.hidden_size)
    from fot.models.modeling_fot import _Context

    ctx = _Context(None, None, None, None, None)
    got = attn(x, ctx).double()
    want = _oracle_attention(attn, x)
    assert max_err(got, want) < 1e-5


@pytest.mark.parametrize("model", ["fot_pro", "fot_llama_fixed", "fot_pro_bias_only"])
def test_a_float64_model_computes_in_float64(model: str) -> None:
    """``model.double()`` keeps float64 throughout: the attention layer matches the float64
    oracle to 1e-12 (the forget gate and the token shift's mix ran in float32: 2e-8 off), and
    the logits, loss and per-token losses are float64 and equal ``hidden @ W.T`` and its
    log-softmax computed here (they came back float32)."""
    from fot.models.modeling_fot import _Context

    m = tiny(model).double()
    attn = m.model.layers[0].self_attn
    with torch.no_grad():
        if hasattr(attn, "fgate_proj"):
            attn.fgate_proj.bias.normal_(1.0, 1.0)
            attn.fgate_proj.weight.mul_(20)
    x = torch.randn(2, 9, m.config.hidden_size, dtype=torch.float64)
    got = attn(x, _Context(None, None, None, None, None))
    assert got.dtype == torch.float64 and max_err(got, _oracle_attention(attn, x)) < 1e-12
    ids = torch.randint(0, VOCAB, (2, 12))
    with torch.no_grad():
        logits = m(input_ids=ids).logits
        loss = m(input_ids=ids, labels=ids).loss
        per_token = m.per_token_loss(ids, ids.roll(-1, 1))
        hidden = m.model(input_ids=ids).last_hidden_state
    want = hidden @ m.lm_head.weight[: m.config.vocab_size].T
    log_p = torch.log_softmax(want, -1)
    nll = -log_p.gather(-1, ids.roll(-1, 1)[..., None])[..., 0]  # (B, T)
    assert logits.dtype == loss.dtype == per_token.dtype == torch.float64
    assert max_err(logits, want) < 1e-12
    assert abs(loss.item() - nll[:, :-1].mean().item()) < 1e-12
    assert max_err(per_token, nll) < 1e-12


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_qk_norm_eps_is_the_papers(backend: str) -> None:
    """The paper's q/k norms use eps 1e-5 (their class's default), not ``norm_eps`` (1e-6):
    with q and k so small that eps dominates their norm, the layer matches the oracle only
    with the paper's eps."""
    m = tiny("fot_pro", attn_backend=backend)
    attn = m.model.layers[0].self_attn
    assert m.config.qk_norm_eps == 1e-5 and attn.q_norm.eps == attn.k_norm.eps == 1e-5
    with torch.no_grad():
        attn.q_proj.weight.mul_(1e-3)
        attn.k_proj.weight.mul_(1e-3)
        attn.q_norm.weight.normal_(1.0, 0.5)
        attn.k_norm.weight.normal_(1.0, 0.5)
    x = torch.randn(2, 9, m.config.hidden_size)
    from fot.models.modeling_fot import _Context

    got = attn(x, _Context(None, None, None, None, None)).double()
    assert max_err(got, _oracle_attention(attn, x)) < 1e-5


def llama_config_like(c):
    """The HF ``LlamaConfig`` of the same shapes as FoT config ``c`` (a Transformer (LLaMA))."""
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=c.padded_vocab_size,
        hidden_size=c.hidden_size,
        intermediate_size=c.mlp_size,
        num_hidden_layers=c.num_hidden_layers,
        num_attention_heads=c.num_heads,
        num_key_value_heads=c.kv_heads,
        rms_norm_eps=c.norm_eps,
        tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": c.rope_theta},
        attention_bias=False,
        mlp_bias=False,
    )


def test_gate_none_with_rope_equals_hf_llama() -> None:
    from transformers import LlamaForCausalLM

    m = tiny("transformer_llama")
    llama = LlamaForCausalLM(llama_config_like(m.config)).eval()
    missing, unexpected = llama.load_state_dict(m.state_dict(), strict=False)
    assert not unexpected and all("rotary" in k for k in missing)
    x = ids(2, 40)
    want = llama(x).logits[..., :VOCAB]
    assert max_err(m(x).logits, want) < 1e-4


@pytest.mark.parametrize("component", PRO_FIELDS)
def test_each_pro_component_toggles_independently(component: str) -> None:
    base = tiny("fot_llama")
    one = tiny("fot_llama", **{component: True})
    assert all(getattr(one.config, f) == (f == component) for f in PRO_FIELDS)
    extra = set(one.state_dict()) - set(base.state_dict())
    expected = PRO_PARAMS[component]
    assert {k.split("self_attn.")[-1] for k in extra} == expected
    assert len(extra) == len(expected) * base.config.num_hidden_layers
    # with the shared weights equal, switching the component on changes the output
    one.load_state_dict(base.state_dict(), strict=False)
    x = ids(1, 12)
    assert max_err(one(x).logits, base(x).logits) > 1e-4


def test_fixed_gate_has_no_trainable_gate_and_bias_only_ignores_input() -> None:
    fixed = tiny("fot_llama_fixed")
    attn = fixed.model.layers[0].self_attn
    assert not any("fgate" in n for n, _ in fixed.named_parameters())
    assert "model.layers.0.self_attn.fgate_bias" in fixed.state_dict()  # saved buffer
    # long-init: decay times 1/(-log sigmoid(b)) log-uniform in [2, decay_time_max]
    times = 1.0 / (-F.logsigmoid(attn.fgate_bias.double()))
    want = torch.logspace(
        math.log10(2.0), math.log10(fixed.config.decay_time_max), 4, dtype=torch.float64
    )
    assert torch.allclose(times, want, rtol=1e-4)

    bias_only = tiny("fot_llama_bias_only")
    attn = bias_only.model.layers[0].self_attn
    gate_params = [n for n, _ in bias_only.named_parameters() if "fgate" in n]
    assert gate_params == [f"model.layers.{i}.self_attn.fgate_bias" for i in range(2)]
    x1, x2 = torch.randn(1, 7, 128), torch.randn(1, 7, 128)
    lf1, lf2 = attn.log_fgate(x1), attn.log_fgate(x2)
    assert lf1.dtype == torch.float32 and torch.equal(lf1, lf2)
    full = tiny("fot_llama").model.layers[0].self_attn
    assert not torch.equal(full.log_fgate(x1), full.log_fgate(x2))
    assert full.log_fgate(x1.bfloat16()).dtype == torch.float32


def test_nope_has_no_position_and_a_window_hides_older_keys() -> None:
    """Oracles from the definitions. No position encoding and no gate (NoPE): one layer's
    output at the last position is a function of the *set* of earlier tokens, so permuting
    them changes nothing; RoPE or a forget gate make it order-dependent. A window of w keys
    (``i - w < j <= i``): the output at i has zero gradient in every input before i - w + 1;
    with KV-shift the key at i - w + 1 mixes in the input at i - w, and nothing older."""
    from fot.models.modeling_fot import _Context

    x = ids(1, 20)
    perm = torch.cat([torch.randperm(19, generator=torch.Generator().manual_seed(3)), x.new([19])])
    for model, moved in (
        ("transformer_llama_nope", False),
        ("transformer_llama", True),
        ("fot_llama", True),
        ("fot_llama_fixed", True),
    ):
        m = tiny(model, num_hidden_layers=1)
        with torch.no_grad():
            change = max_err(m(x).logits[0, -1], m(x[:, perm]).logits[0, -1])
        assert (change > 1e-3) if moved else (change < 1e-5), (model, change)

    w, T = 5, 14
    for model, shifted in (("transformer_swa", False), ("fot_llama", False), ("fot_pro", True)):
        m = tiny(model, num_hidden_layers=1, window_size=w)
        attn = m.model.layers[0].self_attn
        h = torch.randn(1, T, m.config.hidden_size, requires_grad=True)
        rope = m.model._context(1, T, h.device, None, None, 0).rope
        attn(h, _Context(rope, None, None, None, None))[0, T - 1].sum().backward()
        reach = h.grad[0].abs().sum(-1)  # (T,)
        first = T - w - (1 if shifted else 0)  # the oldest input the output may read
        assert reach[:first].abs().max() == 0, (model, reach)
        assert (reach[first:] > 0).all(), (model, reach)


# ---------------------------------------------------------------------------------------
# Packed documents
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("model", ["fot_pro", "transformer_pro", "transformer_swa"])
def test_packed_batch_equals_separate_sequences(model: str) -> None:
    m = tiny(model)
    lengths = [5, 17, 0, 1, 10, 0]  # empty documents too (also at the end)
    docs = [ids(1, n, seed=10 + i) for i, n in enumerate(lengths)]
    packed = torch.cat(docs, dim=1)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    got = m(packed, cu_seqlens=cu).logits
    want = torch.cat([m(d).logits for d in docs if d.numel()], dim=1)
    assert max_err(got, want) < TOL
    # and the loss path agrees with the separate per-document losses
    y = torch.cat([ids(1, n, seed=20 + i) for i, n in enumerate(lengths)], dim=1)
    ptl = m.per_token_loss(packed, y, cu_seqlens=cu)
    bounds = zip(docs, cu[:-1].tolist(), cu[1:].tolist())
    sep = torch.cat([m.per_token_loss(d, y[:, s:e]) for d, s, e in bounds if e > s], dim=1)
    assert max_err(ptl, sep) < 1e-4


# ---------------------------------------------------------------------------------------
# HF round trip
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("model", ["fot_pro", "fot_llama_fixed"])
def test_hf_save_from_pretrained_round_trip(model: str, tmp_path) -> None:
    from transformers import AutoConfig, AutoModelForCausalLM

    m = tiny(model)
    m.save_pretrained(tmp_path)
    cfg = AutoConfig.from_pretrained(tmp_path)
    assert isinstance(cfg, fot.FoTConfig) and cfg.fgate_type == m.config.fgate_type
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert isinstance(loaded, fot.FoTForCausalLM)
    x = ids(2, 21)
    assert torch.equal(loaded(x).logits, m(x).logits)


# ---------------------------------------------------------------------------------------
# Generation cache
# ---------------------------------------------------------------------------------------


def _decode_logits(
    m, x: torch.Tensor, chunks: list[int], mask: torch.Tensor | None = None, cache=None
):
    """Feed ``x`` through the cache (``cache``, else the model's) in chunks of the given sizes;
    return all logits."""
    outs, start = [], 0
    for n in chunks:
        am = None if mask is None else mask[:, : start + n]
        out = m(x[:, start : start + n], attention_mask=am, past_key_values=cache, use_cache=True)
        cache = out.past_key_values
        outs.append(out.logits)
        start += n
    assert start == x.shape[1]
    return torch.cat(outs, dim=1), cache


@pytest.mark.parametrize(
    "model,extra",
    [
        ("fot_pro", {}),
        ("fot_llama", {}),
        ("transformer_pro", {}),
        ("fot_pro_fixed", {}),
        ("transformer_swa", {"window_size": 5}),
        ("fot_pro", {"num_kv_heads": 2}),
    ],
)
def test_cached_decode_equals_full_forward(model: str, extra: dict) -> None:
    m = tiny(model, **extra)
    x = ids(2, 14, seed=5)
    full = m(x).logits
    token_by_token, cache = _decode_logits(m, x, [1] * 14)
    assert max_err(token_by_token, full) < TOL
    chunked, cache = _decode_logits(m, x, [6, 3, 1, 4])  # prefill, chunked prefill, decode
    assert max_err(chunked, full) < TOL
    layer = cache[0]
    assert layer.keys.shape[1] == 14 and layer.cumsum.dtype == torch.float64
    if m.config.use_k_shift:
        assert layer.k_shift.shape == (2, m.config.kv_heads, m.config.head_dim)


def test_the_cache_keeps_the_gate_cumsum_in_float64() -> None:
    """After 32k tokens of strong decay |c| is ~4e4: float32 (as the cache kept it) rounds
    c_i - c_j by ~4e-3, and cached decode drifted from the forward (helper-178). The cache's
    cumsum, over a prefill, chunked appends and static (CUDA-graph) steps, is the float64
    cumsum of the log gates, bit for bit."""
    from fot.models.cache import FoTLayerCache, StaticStep

    g = torch.Generator().manual_seed(0)
    B, H, D, T = 1, 2, 8, 32768
    log_f = F.logsigmoid(torch.randn(B, T, H, generator=g) - 1.0)  # float32, as the model's
    want = torch.cumsum(log_f.double(), 1)
    assert want[0, -1].abs().min() > 4e4

    def kv(n):
        return torch.zeros(B, n, H, D), torch.zeros(B, n, H, D)

    for capacity in (None, T):
        cache = FoTLayerCache(capacity=capacity)
        got = [cache.append(*kv(T - 10), log_f[:, : T - 10], None, None)]
        got.append(cache.append(*kv(6), log_f[:, T - 10 : T - 4], None, None))
        if capacity is not None:  # static steps: one token at a device position
            for t in range(T - 4, T):
                cache.step = StaticStep(
                    torch.tensor([t]), T, torch.ones(B, T, dtype=torch.bool), torch.arange(T)
                )
                got.append(cache.append(*kv(1), log_f[:, t : t + 1], None, None))
                cache.step, cache._len = None, t + 1
        else:
            got.append(cache.append(*kv(4), log_f[:, T - 4 :], None, None))
        assert torch.equal(torch.cat(got, 1), want)
        assert torch.equal(cache.cumsum[:, :T], want)


@pytest.mark.parametrize("model", ["fot_pro", "transformer_pro"])
def test_left_padding_equals_unpadded(model: str) -> None:
    m = tiny(model)
    a, b = ids(1, 9, seed=6), ids(1, 4, seed=7)
    pad = 5
    x = torch.cat([a, torch.cat([torch.zeros(1, pad, dtype=torch.long), b], dim=1)])
    mask = torch.ones(2, 9, dtype=torch.long)
    mask[1, :pad] = 0
    want_a, want_b = m(a).logits, m(b).logits
    full = m(x, attention_mask=mask).logits  # no cache, padded
    assert max_err(full[0], want_a[0]) < TOL and max_err(full[1, pad:], want_b[0]) < TOL
    # prefill the padded prompt, then decode 3 more tokens per row
    nxt = ids(2, 3, seed=8)
    x2 = torch.cat([x, nxt], dim=1)
    mask2 = torch.cat([mask, torch.ones(2, 3, dtype=torch.long)], dim=1)
    got, _ = _decode_logits(m, x2, [9, 1, 1, 1], mask2)
    want_a = m(torch.cat([a, nxt[:1]], dim=1)).logits
    want_b = m(torch.cat([b, nxt[1:]], dim=1)).logits
    assert max_err(got[0], want_a[0]) < TOL and max_err(got[1, pad:], want_b[0]) < TOL


def test_a_padded_forward_keeps_the_gate_cumsum_in_float64() -> None:
    """A forward with padding (no cache) attends through the decode function with the
    queries' running gate cumsum c. After very negative gates |c| is ~4.5e4, where a float32
    c rounds each bias c_i - c_j by up to ~4e-3 (helper-178: the padded forward rounded its
    float64 cumsum to float32); the weak decay after them spreads the weights over many keys,
    so that shows in the output. Oracle: the same layer without padding (the reference
    kernel, whose cumsum is float64)."""
    m = tiny("fot_llama")
    attn = m.model.layers[0].self_attn
    T, hidden = 160, m.config.hidden_size
    x = torch.randn(1, T, hidden, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():  # feature 0 drives the forget gate only: log f ~ -700 on 64 tokens
        for proj in (attn.q_proj, attn.k_proj, attn.v_proj):
            proj.weight[:, 0] = 0.0
        attn.fgate_proj.weight.zero_()
        attn.fgate_proj.weight[:, 0] = 1.0
        attn.fgate_proj.bias.fill_(4.0)  # f ~ 0.98 elsewhere
    x[:, :64, 0] = -700.0
    x[:, 64:, 0] = 0.0
    from fot.models.modeling_fot import _Context

    assert attn.log_fgate(x).double().sum(1).min() < -4e4
    want = attn(x, _Context(None, None, None, None, None))
    padded = torch.cat([torch.zeros(1, 1, hidden), x], dim=1)  # one padding position in front
    mask = torch.ones(1, T + 1, dtype=torch.bool)
    mask[0, 0] = False
    got = attn(padded, _Context(None, None, None, mask, mask))[:, 1:]
    assert max_err(got, want) < 1e-5 * want.abs().max().item()


@pytest.mark.parametrize("model", ["fot_pro", "fot_llama"])
def test_padding_gaps_equal_removed_tokens(model: str) -> None:
    """Zeros inside attention_mask remove those tokens: the KV-shift of the next real token
    mixes in the last real token before the gap, also across a cached prefix."""
    m = tiny(model)
    a = ids(1, 8, seed=21)
    want = m(a).logits  # the sequence without the gaps
    x = torch.cat([a[:, :3], ids(1, 2, seed=22), a[:, 3:6], ids(1, 1, seed=23), a[:, 6:]], 1)
    mask = torch.tensor([[1, 1, 1, 0, 0, 1, 1, 1, 0, 1, 1]])
    got = m(x, attention_mask=mask).logits[:, mask[0].bool()]
    assert max_err(got, want) < TOL
    # The same tokens in chunks through the cache; a chunk that starts with a gap.
    chunked, _ = _decode_logits(m, x, [4, 4, 3], mask)
    assert max_err(chunked[:, mask[0].bool()], want) < TOL


@pytest.mark.parametrize("model", ["fot_pro", "transformer_swa"])
def test_a_gap_in_attention_mask_under_a_sliding_window_is_refused(model: str) -> None:
    """Under a sliding window a gap (a 0 between 1s) was accepted and gave other logits than
    the row without its tokens (the window counts masked positions: a query after the gap sees
    one real key less); refused now, naming left padding. Left and right padding still equal
    the unpadded rows, through the cache too."""
    m = tiny(model, window_size=3)
    a = ids(1, 8, seed=31)
    want = m(a).logits  # the oracle: the row without padding
    left = torch.cat([ids(1, 2, seed=32), a], 1)
    got = m(left, attention_mask=torch.tensor([[0, 0] + [1] * 8])).logits[:, 2:]
    assert max_err(got, want) < TOL
    right = torch.cat([a, ids(1, 3, seed=33)], 1)
    got = m(right, attention_mask=torch.tensor([[1] * 8 + [0] * 3])).logits[:, :8]
    assert max_err(got, want) < TOL
    chunked, _ = _decode_logits(m, left, [4, 1, 5], torch.tensor([[0, 0] + [1] * 8]))
    assert max_err(chunked[:, 2:], want) < TOL
    gap = torch.cat([a[:, :4], ids(1, 1, seed=34), a[:, 4:]], 1)
    mask = torch.tensor([[1, 1, 1, 1, 0, 1, 1, 1, 1]])
    with pytest.raises(ValueError, match=r"0 between tokens .* row\(s\) \[0\]: with "
                       r"window_size=3 .* Pad on the left"):  # fmt: skip
        m(gap, attention_mask=mask)
    with pytest.raises(ValueError, match="window_size=3"):  # the gap in the cached part
        _decode_logits(m, gap, [4, 5], mask)


@pytest.mark.parametrize("model", ["fot_pro", "transformer_llama"])
def test_generate_greedy_equals_argmax_of_full_forward(model: str) -> None:
    m = tiny(model)
    prompt = ids(2, 6, seed=9)
    out = m.generate(prompt, max_new_tokens=8, do_sample=False, pad_token_id=0)
    assert out.shape == (2, 14) and torch.equal(out[:, :6], prompt)
    seq = prompt
    for _ in range(8):
        nxt = m(seq).logits[:, -1].argmax(-1, keepdim=True)
        seq = torch.cat([seq, nxt], dim=1)
    assert torch.equal(out, seq)


def test_generate_left_padded_batch_and_sampling() -> None:
    m = tiny("fot_pro")
    a, b = ids(1, 7, seed=11), ids(1, 3, seed=12)
    x, mask = left_padded(a, b)
    kw = greedy_with_logits(5)
    out = m.generate(x, attention_mask=mask, **kw)
    solo_a, solo_b = m.generate(a, **kw), m.generate(b, **kw)
    assert torch.equal(out.sequences[1, 4:], solo_b.sequences[0])
    assert torch.equal(out.sequences[0], solo_a.sequences[0])
    for step, (lp, la, lb) in enumerate(zip(out.logits, solo_a.logits, solo_b.logits)):
        assert max_err(lp[0], la[0]) < TOL and max_err(lp[1], lb[0]) < TOL, step
    torch.manual_seed(0)
    s1 = m.generate(
        x, attention_mask=mask, max_new_tokens=5, do_sample=True, top_k=50, pad_token_id=0
    )
    torch.manual_seed(0)
    s2 = m.generate(
        x, attention_mask=mask, max_new_tokens=5, do_sample=True, top_k=50, pad_token_id=0
    )
    assert s1.shape == (2, 12) and torch.equal(s1, s2) and (s1 < VOCAB).all()


def test_generate_beam_search_and_chunked_prefill_match_uncached() -> None:
    m = tiny("fot_pro")
    x = ids(2, 9, seed=13)
    kw = {"max_new_tokens": 4, "pad_token_id": 0, "do_sample": False}
    beams = m.generate(x, num_beams=3, **kw)
    assert torch.equal(beams, m.generate(x, num_beams=3, use_cache=False, **kw))
    greedy = m.generate(x, **kw)
    assert torch.equal(greedy, m.generate(x, prefill_chunk_size=4, **kw))


# ---------------------------------------------------------------------------------------
# Fixed-capacity cache: the device-indexed decode steps that CUDA graphs capture (run eagerly
# here; tests/test_model_gpu.py replays them as graphs)
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "model,extra",
    [
        ("fot_pro", {}),
        ("fot_llama", {}),
        ("transformer_llama", {}),
        ("transformer_swa", {"window_size": 5}),
        ("fot_pro", {"window_size": 5, "num_kv_heads": 2}),
        # the kernel path (interpreter): split-K decode, few-row projections, fused append,
        # the Pro kernels continuing the KV-shift from the cache (with a GPU:
        # tests/test_model_gpu.py, CUDA graphs of the same steps)
        pytest.param(
            "fot_pro",
            {"attn_backend": "triton", "num_kv_heads": 2},
            marks=pytest.mark.skipif(torch.cuda.is_available(), reason="test_model_gpu.py"),
        ),
    ],
)
def test_static_cache_steps_match_full_forward(model: str, extra: dict, monkeypatch) -> None:
    monkeypatch.setattr(cache_module, "GRAPH_BUCKET", 4)  # 12 steps cross several buckets
    m = tiny(model, **extra)
    a, b = ids(1, 9, seed=21), ids(1, 5, seed=22)
    pad = 4
    x = torch.cat([a, torch.cat([torch.zeros(1, pad, dtype=torch.long), b], dim=1)])
    mask = torch.ones(2, 9 + 12, dtype=torch.long)
    mask[1, :pad] = 0
    nxt = ids(2, 12, seed=23)
    cache = FoTCache(m.config.num_hidden_layers, capacity=9 + 12)
    calls = []
    real_step = FoTCache.static_step

    def spy(self, *args, **kwargs):
        calls.append(self.get_seq_length())
        return real_step(self, *args, **kwargs)

    monkeypatch.setattr(FoTCache, "static_step", spy)
    from fot.kernels import decode as decode_module

    folded = []  # per layer and step: which parts the one-launch shift + norms + append took
    real_fold = decode_module.decode_shift_norm_append

    def fold_spy(*args, **kwargs):
        parts = ("k_logits", "k_weight", "v_logits", "q_weight")
        folded.append(tuple(kwargs[p] is not None for p in parts))
        return real_fold(*args, **kwargs)

    monkeypatch.setattr(decode_module, "decode_shift_norm_append", fold_spy)
    import fot.kernels

    merged = []  # per layer and step: whether the output norm and gate went into the decode
    real_decode = fot.kernels.forgetting_attention_decode

    def decode_spy(*args, **kwargs):
        merged.append((kwargs.get("gate") is not None, kwargs.get("norm_weight") is not None))
        return real_decode(*args, **kwargs)

    monkeypatch.setattr(fot.kernels, "forgetting_attention_decode", decode_spy)
    from fot.kernels import linear_ops

    gates = []
    real_gate = linear_ops.few_rows_logsigmoid_linear

    def gate_spy(x, weight, bias):
        gates.append(x.shape)
        return real_gate(x, weight, bias)

    monkeypatch.setattr(linear_ops, "few_rows_logsigmoid_linear", gate_spy)
    with torch.no_grad():  # as generate(): the few-row projections need it
        got, _ = _decode_logits(m, torch.cat([x, nxt], 1), [9] + [1] * 12, mask, cache=cache)
    assert calls == list(range(9, 21))  # every one-token step was a static step
    if extra.get("attn_backend") == "triton":
        # 2 layers in 12 steps: KV-shift from the cache, k and q norms, cache write in one launch
        assert folded == [(True, True, True, True)] * 2 * 12
        # the prefill (left padding: the decode function) without, the steps with
        assert merged == [(False, False)] * 2 + [(True, True)] * 2 * 12
        # the forget gate of each step's 2 layers in one launch (the 18-row prefill: PyTorch)
        assert gates == [(2, 1, m.config.hidden_size)] * 2 * 12
    assert cache.get_seq_length() == 21 and cache[0]._k.shape[2] == 21  # buffers never grew
    want_a = m(torch.cat([a, nxt[:1]], dim=1)).logits
    want_b = m(torch.cat([b, nxt[1:]], dim=1)).logits
    assert max_err(got[0], want_a[0]) < TOL and max_err(got[1, pad:], want_b[0]) < TOL


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shift", [True, False])
def test_fused_static_append_writes_what_the_pytorch_ops_write(dtype, shift) -> None:
    """A static step's cache write in one launch (``fot.kernels.decode.decode_append``; CPU:
    interpreter) leaves every buffer and returns the cumsum bit for bit as the PyTorch ops:
    keys, values (head-major, written at the device position), the float64-summed cumsum
    (large |c|), and the KV-shift state. GQA, a head count and head size that are not powers
    of two, a non-contiguous new key."""
    from fot.models.cache import FoTLayerCache, StaticStep

    g = torch.Generator().manual_seed(3)
    B, T, H, HQ, D, cap = 2, 5, 3, 6, 40, 9

    def r(*shape, dt=dtype):
        return torch.randn(*shape, generator=g).to(dt)

    caches = []
    for _ in range(2):
        cache = FoTLayerCache(
            r(B, T, H, D), r(B, T, H, D), torch.zeros(B, T, HQ) - 1e4,
            r(B, H, D) if shift else None, r(B, H, D) if shift else None, capacity=cap,
        )  # fmt: skip
        caches.append(cache)
    caches[1]._k.copy_(caches[0]._k), caches[1]._v.copy_(caches[0]._v)
    if shift:
        caches[1].k_shift.copy_(caches[0].k_shift), caches[1].v_shift.copy_(caches[0].v_shift)
    k = r(B, H, 1, D).transpose(1, 2)  # (B, 1, H, D), not contiguous
    v, kp, vp = r(B, 1, H, D), r(B, 1, H, D), r(B, 1, H, D)
    log_f = -torch.rand(B, 1, HQ, generator=g)
    step = StaticStep(
        torch.tensor([T]), 16, torch.ones(B, cap, dtype=torch.bool), torch.arange(cap)
    )
    outs = []
    for cache, fused in zip(caches, (False, True), strict=True):
        cache.step = step
        pre = (kp, vp) if shift else (None, None)
        outs.append(cache.append(k, v, log_f, *pre, fused=fused))
    assert torch.equal(outs[0], outs[1])
    names = ["_k", "_v", "_c"] + (["k_shift", "v_shift"] if shift else [])
    for name in names:
        assert torch.equal(getattr(caches[0], name), getattr(caches[1], name)), name
    assert torch.equal(caches[1]._k[:, :, T], k[:, 0])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "parts", [("k_shift", "v_shift", "k_norm", "q_norm"), ("k_norm", "q_norm"), ("v_shift",)]
)
def test_static_step_shift_norms_and_append_in_one_launch(dtype, parts, device) -> None:
    """``FoTLayerCache.append_step`` (``fot.kernels.decode.decode_shift_norm_append``; CPU:
    interpreter) writes what ``shift_norm`` of k, v and q followed by the fused
    ``append`` write: the same cumsum and KV-shift state bit for bit, keys, values and query
    within one bfloat16 rounding or 8 float32 ulps (the norm's sum may be reduced in another
    order), and both within one rounding of a float64 oracle. GQA, head count and size not
    powers of two, strided projections (column views of one output). (In float32 the oracle's bound is 1e-6:
    the shift's ``x + a (p - x)`` loses relative accuracy where it cancels.)"""
    from fot.kernels.pro_ops import shift_norm
    from fot.models.cache import FoTLayerCache, StaticStep

    g = torch.Generator().manual_seed(5)
    B, T, H, HQ, D, cap = 2, 5, 3, 6, 40, 9

    def r(*shape, dt=dtype):
        return torch.randn(*shape, generator=g).to(dt).to(device)

    caches = [
        FoTLayerCache(
            r(B, T, H, D),
            r(B, T, H, D),
            torch.zeros(B, T, HQ, device=device) - 1e4,
            r(B, H, D) if "k_shift" in parts else None,
            r(B, H, D) if "v_shift" in parts else None,
            capacity=cap,
        )
        for _ in range(2)
    ]
    for name in ("_k", "_v", "_c", "k_shift", "v_shift"):
        if getattr(caches[0], name) is not None:
            getattr(caches[1], name).copy_(getattr(caches[0], name))
    proj = r(B, 1, (HQ + 2 * H) * D + 2 * H)  # q, k, v and the two shift logits side by side
    q, k, v = (
        t.view(B, 1, -1, D) for t in proj[..., : (HQ + 2 * H) * D].split([HQ * D, H * D, H * D], -1)
    )
    k_logits, v_logits = proj[..., (HQ + 2 * H) * D :].split([H, H], -1)
    k_w, q_w = 1 + 0.3 * r(H, D), 1 + 0.3 * r(HQ, D)
    log_f = -torch.rand(B, 1, HQ, generator=g).to(device)
    step = StaticStep(
        torch.tensor([T], device=device), 16, torch.ones(B, cap, dtype=torch.bool, device=device),
        torch.arange(cap, device=device),
    )  # fmt: skip
    kl = k_logits if "k_shift" in parts else None
    vl = v_logits if "v_shift" in parts else None
    k_norm = (k_w, 1e-5) if "k_norm" in parts else None
    q_norm = (q_w, 1e-3) if "q_norm" in parts else None
    # the kernels it replaces: shift_norm (from the cached shift state), then the fused append
    caches[0].step = step
    want_k = want_v = None
    if kl is not None or k_norm is not None:
        want_k = shift_norm(k, kl, k_w if k_norm else None, eps=1e-5, prev=caches[0].k_shift)
    if vl is not None:
        want_v = shift_norm(v, vl, prev=caches[0].v_shift)
    want_q = shift_norm(q, None, q_w, eps=1e-3) if q_norm else q
    pre = (k if kl is not None else None, v if vl is not None else None)
    oracle = {  # float64, from the state before the step
        "k": _shift_norm64(k, kl, k_norm, caches[0].k_shift),
        "v": _shift_norm64(v, vl, None, caches[0].v_shift),
        "q": _shift_norm64(q, None, q_norm, None),
    }
    want_c = caches[0].append(
        k if want_k is None else want_k, v if want_v is None else want_v, log_f, *pre, fused=True
    )
    caches[1].step = step
    got_q, got_c = caches[1].append_step(
        q, k, v, log_f, k_logits=kl, v_logits=vl, k_norm=k_norm, q_norm=q_norm
    )
    assert torch.equal(got_c, want_c) and torch.equal(caches[1]._c, caches[0]._c)
    for name in ("k_shift", "v_shift"):
        if getattr(caches[0], name) is not None:
            assert torch.equal(getattr(caches[1], name), getattr(caches[0], name)), name
    # one bf16 rounding; in float32 a few ulps (a GPU reduces the norm's sum in another order)
    eps = torch.finfo(dtype).eps * (1 if dtype == torch.bfloat16 else 8)
    got = {"k": caches[1]._k[:, :, T], "v": caches[1]._v[:, :, T], "q": got_q[:, 0]}
    want = {"k": caches[0]._k[:, :, T], "v": caches[0]._v[:, :, T], "q": want_q[:, 0]}
    for name in ("k", "v", "q"):
        torch.testing.assert_close(got[name], want[name], rtol=eps, atol=eps, msg=name)
        torch.testing.assert_close(
            got[name].double(), oracle[name][:, 0], rtol=eps, atol=max(eps, 1e-6)
        )
    # the rest of each buffer is untouched (the old keys, the zero padding after the step)
    assert torch.equal(caches[1]._k[:, :, :T], caches[0]._k[:, :, :T])
    assert torch.equal(caches[1]._k[:, :, T + 1 :], caches[0]._k[:, :, T + 1 :])
    # outside a static step nothing is written and the caller is told to do it itself
    caches[1].step = None
    before = caches[1]._k.clone()
    assert caches[1].append_step(q, k, v, log_f, k_logits=kl, v_logits=vl) is None
    assert torch.equal(caches[1]._k, before)


def _shift_norm64(x, logits, norm, prev) -> torch.Tensor:
    """Float64 KV-shift from ``prev`` then per-head RMSNorm ``(weight, eps)``: the oracle of
    a one-token static step."""
    z = x.double()
    if logits is not None:
        a = torch.sigmoid(logits.double())[..., None]
        z = z + a * (prev.double()[:, None] - z)
    if norm is not None:
        w, eps = norm
        z = z * torch.rsqrt(z.pow(2).mean(-1, keepdim=True) + eps) * w.double()
    return z


def test_generate_with_static_cache_matches_default() -> None:
    m = tiny("fot_pro")
    x = ids(2, 9, seed=24)
    kw = {"max_new_tokens": 6, "pad_token_id": 0, "do_sample": False}
    L = m.config.num_hidden_layers
    want = m.generate(x, **kw)
    got = m.generate(x, past_key_values=FoTCache(L, capacity=15), **kw)
    assert torch.equal(got, want)
    # beam search reorders the fixed buffers in place
    want = m.generate(x, num_beams=3, use_cache=False, **kw)
    cache = FoTCache(L, capacity=15)
    got = m.generate(x, num_beams=3, past_key_values=cache, **kw)
    # generate expands the 2 prompts to 3 beams each before the prefill
    assert torch.equal(got, want) and cache[0]._k.shape[0] == 2 * 3


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_generate_continues_from_the_fixed_capacity_cache_it_returned(device, monkeypatch):
    """On CUDA generate() makes a cache of fixed capacity, its max_length; continuing with
    generate(out.sequences, past_key_values=out.past_key_values) overflowed it ("the cache
    holds at most 12 positions"). It is enlarged now, and the CUDA graphs captured for its old
    buffers are dropped: with capacity 12 a multiple of the bucket, the first step of the
    second call has the key of the first call's last graph. On CPU a FoTCache(capacity=12)
    stands in for the cache generate() makes on CUDA. Oracle: one uninterrupted generate."""
    monkeypatch.setattr(cache_module, "GRAPH_BUCKET", 4)
    m = tiny("fot_pro").to(device)
    x = ids(2, 9, seed=25).to(device)
    mask = torch.ones_like(x)
    mask[1, :3] = 0  # left padding in row 1
    kw = {"do_sample": False, "pad_token_id": 0}
    want = m.generate(x, attention_mask=mask, max_new_tokens=8, **kw)
    first = (
        {} if device == "cuda" else {"past_key_values": FoTCache(len(m.model.layers), capacity=12)}
    )
    out = m.generate(
        x, attention_mask=mask, max_new_tokens=3, return_dict_in_generate=True, **first, **kw
    )
    cache = out.past_key_values
    assert cache.capacity == 12 and cache.get_seq_length() == 11
    assert cache.cuda_graphs == (device == "cuda")
    mask = torch.cat([mask, torch.ones_like(mask[:, :3])], dim=1)
    got = m.generate(
        out.sequences, attention_mask=mask, past_key_values=cache, max_new_tokens=5, **kw
    )
    assert cache.capacity == 17 and cache.get_seq_length() == 16
    assert torch.equal(got, want)


def test_static_cache_errors() -> None:
    m = tiny("fot_pro")
    L = m.config.num_hidden_layers
    cache = FoTCache(L, capacity=10)
    out = m(ids(1, 9), past_key_values=cache, use_cache=True)
    m(out.logits[:, -1:].argmax(-1), past_key_values=cache, use_cache=True)  # position 10: fits
    with torch.no_grad(), pytest.raises(ValueError, match=r"at most 10 positions.*grow\(11\)"):
        m(ids(1, 1), past_key_values=cache, use_cache=True)
    cache.grow(11)  # the fix the message names
    m(ids(1, 1), past_key_values=cache, use_cache=True)
    with pytest.raises(ValueError, match="this one grows by itself"):
        FoTCache(L).grow(20)
    with pytest.raises(ValueError, match="at most 10 positions"):
        m(ids(1, 11), past_key_values=FoTCache(L, capacity=10), use_cache=True)
    with pytest.raises(ValueError, match="capacity must be a positive int"):
        FoTCache(L, capacity=0)
    with pytest.raises(ValueError, match="needs a fixed capacity"):
        FoTCache(L, cuda_graphs=True)
    with pytest.raises(ValueError, match="decode_cuda_graphs must be true or false"):
        presets.config("fot_pro", "tiny", decode_cuda_graphs="yes")


# ---------------------------------------------------------------------------------------
# Presets and errors
# ---------------------------------------------------------------------------------------

PAPER_760M = {
    "fot_pro": 758e6,
    "transformer_pro": 757e6,
    "fot_llama": 757e6,
    "transformer_llama": 756e6,
}


@pytest.mark.parametrize("model", list(PAPER_760M))
def test_preset_parameter_counts_match_paper(model: str) -> None:
    with torch.device("meta"):
        m = presets.build_model(presets.config(model, "760m"))
    n = presets.count_params(m)  # without the input embedding, as the paper counts
    assert abs(n - PAPER_760M[model]) / PAPER_760M[model] < 0.02, n
    cfg = m.config
    assert (cfg.hidden_size, cfg.num_hidden_layers) == (1536, 24)
    assert cfg.head_dim == (128 if model.startswith("transformer") else 64)


def _hand_count(cfg: fot.FoTConfig) -> int:
    """Parameters without the input embedding, counted from the config's dimensions as
    DESIGN.md describes the blocks (not from the modules): q/k/v/o, the forget gate (full:
    ``hidden -> HQ`` with bias; bias_only: one bias per head; fixed and none: nothing
    trained), KV-shift ``hidden -> H`` each, per-head q/k norms and output norm, the output
    gate ``hidden -> HQ*D``, two RMSNorms, a SwiGLU MLP, the final norm and the padded head."""
    h, hq, hkv, d = cfg.hidden_size, cfg.num_heads, cfg.kv_heads, cfg.hidden_size // cfg.num_heads
    width = math.ceil(int(h * cfg.hidden_ratio * 2 / 3) / 256) * 256
    attn = 2 * h * hq * d + 2 * h * hkv * d
    attn += {"full": h * hq + hq, "bias_only": hq, "fixed": 0, "none": 0}[cfg.fgate_type]
    attn += (cfg.use_k_shift + cfg.use_v_shift) * h * hkv
    attn += cfg.qk_norm * (hq + hkv) * d + cfg.use_output_norm * hq * d
    attn += cfg.use_output_gate * h * hq * d
    block = attn + 2 * h + 3 * h * width
    vocab = math.ceil(cfg.vocab_size / 64) * 64
    return cfg.num_hidden_layers * block + h + vocab * h


@pytest.mark.parametrize("size", ["125m", "360m", "760m"])
def test_preset_parameter_counts_equal_a_hand_count(size: str) -> None:
    """Every FoT/Transformer preset at every paper size has exactly the hand count of its
    dimensions; at 760m these are the counts docs/models.md quotes (759.6M, 757.7M, 757.8M,
    756.8M for FoT Pro, FoT LLaMA, Transformer Pro, Transformer LLaMA)."""
    quoted = {"fot_pro": 759.6, "fot_llama": 757.7, "transformer_pro": 757.8}
    quoted["transformer_llama"] = 756.8
    for model in FOT_MODELS:
        cfg = presets.config(model, size)
        with torch.device("meta"):
            n = presets.count_params(presets.build_model(cfg))
        assert n == _hand_count(cfg), (model, n, _hand_count(cfg))
        if size == "760m" and model in quoted:
            assert round(n / 1e6, 1) == quoted[model], (model, n)


@pytest.mark.parametrize("size,nominal", [("125m", 125e6), ("360m", 360e6)])
def test_smaller_presets_pro_matches_llama(size: str, nominal: float) -> None:
    counts = {}
    for model in PAPER_760M:
        with torch.device("meta"):
            counts[model] = presets.count_params(presets.build_model(presets.config(model, size)))
    for n in counts.values():
        assert abs(n - nominal) / nominal < 0.03
    assert abs(counts["fot_pro"] - counts["fot_llama"]) / counts["fot_llama"] < 0.025


def test_the_tiny_sliding_window_preset_windows_tiny_sequences() -> None:
    """transformer_swa's window (2048) is cut at size tiny so that tiny runs (T=256) use it.
    Oracle: transformer_llama with the same weights (full attention): equal logits while the
    window holds every key, others once it does not."""
    m = tiny("transformer_swa")
    full = tiny("transformer_llama")
    full.load_state_dict(m.state_dict())
    x = ids(1, 256)
    with torch.no_grad():
        a, b = m(x).logits, full(x).logits
    w = m.config.window_size
    assert w < 256
    torch.testing.assert_close(a[:, :w], b[:, :w], atol=TOL, rtol=0)
    assert not torch.allclose(a[:, w + 1 :], b[:, w + 1 :], atol=1e-3)


def test_presets_names_and_overrides() -> None:
    assert set(FOT_MODELS) <= set(presets.MODELS)
    assert presets.SIZES == ("tiny", "125m", "360m", "760m")
    c = presets.config("transformer_llama_nope", "125m", attn_backend="reference")
    assert c.fgate_type == "none" and not c.use_rope and c.attn_backend == "reference"
    assert presets.config("transformer_swa", "760m").window_size == 2048
    # the paper's head counts at 760m: 24 heads of 64 for FoT, 12 of 128 for every Transformer
    for model in FOT_MODELS:
        cfg = presets.config(model, "760m")
        want = (12, 128) if model.startswith("transformer") else (24, 64)
        assert (cfg.num_heads, cfg.head_dim) == want, model
    assert presets.config("fot_pro_fixed").fgate_type == "fixed"
    with pytest.raises(ValueError, match=r"valid models: .*fot_pro"):
        presets.config("fot_large")
    with pytest.raises(ValueError, match=r"valid sizes: .*'125m'"):
        presets.config("fot_pro", "1b")


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"hidden_size": 100, "num_heads": 3}, "divisible by num_heads"),
        ({"hidden_size": 60, "num_heads": 4, "use_rope": True}, "RoPE needs an even head dim"),
        ({"num_heads": 12, "num_kv_heads": 5}, "multiple of num_kv_heads"),
        ({"fgate_type": "sometimes"}, "valid: .*'bias_only'"),
        ({"attn_backend": "cuda"}, "valid: .*'triton'"),
        ({"tie_word_embeddings": True}, "untied"),
        ({"decay_time_min": 0.0}, "decay_time_min"),
        ({"fgate_bias_init": float("inf")}, "fgate_bias_init must be a finite number"),
        # a switch given as a word would count as true
        ({"qk_norm": "no"}, "qk_norm must be true or false, got 'no'"),
        ({"use_rope": "false"}, "use_rope must be true or false"),
        ({"use_k_shift": 0}, "use_k_shift must be true or false"),
        ({"num_heads": "four"}, "num_heads must be a positive int, got 'four'"),
        ({"intermediate_size": 0}, "intermediate_size must be a positive int or None"),
        ({"intermediate_size": -5}, "intermediate_size must be a positive int or None"),
        ({"initializer_range": -0.02}, "initializer_range .* >= 0"),
        ({"rope_theta": 0}, "rope_theta must be a finite number > 0"),
        ({"norm_eps": -1e-6}, "norm_eps must be a finite number > 0"),
        ({"hidden_ratio": "x"}, "hidden_ratio must be a finite number > 0"),
        ({"max_position_embeddings": 0}, "max_position_embeddings must be a positive int"),
        ({"decay_time_min": 100.0, "decay_time_max": 10.0}, "decay_time_min <= decay_time_max"),
        (
            {"hidden_size": 768, "num_heads": 12, "head_dim": 32},
            "num_heads = hidden_size // head_dim",
        ),
    ],
)
def test_impossible_configs_raise_clear_errors(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        fot.FoTConfig(**kwargs)


def test_bad_inputs_raise_clear_errors() -> None:
    m = tiny("fot_llama")
    with pytest.raises(ValueError, match="attention_mask must be"):
        m(ids(2, 5), attention_mask=torch.ones(2, 4))
    with pytest.raises(ValueError, match="batch size 1"):
        m(ids(2, 5), cu_seqlens=torch.tensor([0, 5]))
    with pytest.raises(ValueError, match="end at T=5"):
        m(ids(1, 5), cu_seqlens=torch.tensor([0, 4]))
    with pytest.raises(ValueError, match="shift_labels must be"):
        m(ids(1, 5), shift_labels=ids(1, 4))
    # HF-style labels are named as such (they were called shift_labels, a 1-D tensor ended in an
    # IndexError and float labels were cast to token 0)
    with pytest.raises(ValueError, match=r"^labels must be \[B, T\] = \(2, 5\) .* got \(2, 3\)"):
        m(ids(2, 5), labels=ids(2, 3))
    with pytest.raises(ValueError, match=r"^labels must be .* got \(5,\)"):
        m(ids(1, 5), labels=ids(1, 5)[0])
    with pytest.raises(TypeError, match="labels must hold integer token ids"):
        m(ids(1, 5), labels=torch.full((1, 5), 0.9))


def test_registered_with_auto_classes() -> None:
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model(
        "fot", hidden_size=64, num_heads=4, num_hidden_layers=1, vocab_size=VOCAB
    )
    assert isinstance(cfg, fot.FoTConfig)
    assert isinstance(AutoModelForCausalLM.from_config(cfg), fot.FoTForCausalLM)


def test_long_init_bias_decay_times() -> None:
    b = long_init_bias(5, 2.0, 32.0)
    times = 1.0 / (-F.logsigmoid(b.double()))
    assert torch.allclose(
        times, torch.tensor([2.0, 4.0, 8.0, 16.0, 32.0], dtype=torch.float64), rtol=1e-5
    )
    # a decay time below 1.41e-3 gave b = -inf (expm1(1/T) overflowed), and the loss NaN
    b = long_init_bias(4, 1e-4, 16384.0)
    times = 1.0 / (-F.logsigmoid(b.double()))
    want = torch.logspace(-4, math.log10(16384.0), 4, dtype=torch.float64)
    assert torch.isfinite(b).all() and torch.allclose(times, want, rtol=1e-5)
    model = tiny("fot_llama", fgate_type="fixed", decay_time_min=1e-3, decay_time_max=64.0)
    x = torch.randint(0, 100, (1, 12))
    assert torch.isfinite(model(x, labels=x).loss)


def test_a_head_width_the_kernels_lack_is_named_with_the_model_fix(monkeypatch) -> None:
    """hidden 1536 with 16 heads (head_dim 96) passed the config and failed at the first CUDA
    forward with the kernel's "use forgetting_attention_reference", a function the model's
    user never calls. Oracle: the kernel module's own list of head widths."""
    import importlib

    from fot.models.configuration_fot import TRITON_HEAD_DIMS

    kernel_module = importlib.import_module("fot.kernels.forgetting_attention")
    assert TRITON_HEAD_DIMS == kernel_module._SUPPORTED_HEAD_DIMS
    with pytest.raises(ValueError) as info:
        presets.config("fot_pro", "760m", num_heads=16, attn_backend="triton")
    assert str(info.value).startswith(
        "head_dim 96 (hidden_size 1536 / num_heads 16) is not one the Triton attention kernels "
        "run (16, 32, 64, 128, 256): set num_heads to one of [96, 48, 24, 12, 6], or use "
        "attn_backend='reference'"
    )
    presets.config("fot_pro", "760m", num_heads=16)  # auto: the reference path off a GPU
    # the forward that would run the kernels (the interpreter here, CUDA on a GPU) says the same
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    model = tiny("fot_llama", num_heads=8)  # head_dim 16: runs
    model.config.attn_backend = "triton"
    x = torch.randint(0, VOCAB, (1, 8))
    torch.testing.assert_close(model(x).logits, tiny("fot_llama", num_heads=8)(x).logits)
    model = tiny("fot_llama", num_heads=16)  # head_dim 8
    model.config.attn_backend = "triton"
    with pytest.raises(ValueError, match=r"^head_dim 8 \(hidden_size 128 / num_heads 16\)"):
        model(x)
    # as on a GPU: an ungated model's whole sequences go to SDPA, which takes any width
    import fot.models.modeling_fot as modeling

    monkeypatch.setattr(modeling, "_runs_triton", lambda backend, device: backend != "reference")
    plain = tiny("transformer_llama", num_heads=16, attn_backend="sdpa")
    want = tiny("transformer_llama", num_heads=16)(x).logits
    torch.testing.assert_close(plain(x).logits, want)


@pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter path; tests/test_model_gpu.py")
def test_triton_backend_under_interpreter_matches_reference() -> None:
    """The model drives fot.kernels' Triton functions (fp32 under TRITON_INTERPRET=1)."""
    ref = tiny("fot_pro")
    tri = tiny("fot_pro", attn_backend="triton")
    tri.load_state_dict(ref.state_dict())
    x, y = ids(2, 24), ids(2, 24, seed=2)
    assert max_err(tri(x).logits, ref(x).logits) < TOL
    got, _ = _decode_logits(tri, x, [22, 1, 1])
    assert max_err(got, ref(x).logits) < TOL
    ref.train()(x, shift_labels=y).loss.backward()
    tri.train()(x, shift_labels=y).loss.backward()
    for (name, p), q in zip(ref.named_parameters(), tri.parameters()):
        assert torch.allclose(p.grad, q.grad, atol=1e-5, rtol=1e-4), name
    # A padded training batch attends through the decode function: its gradients too (the
    # Triton decode kernels have none; every attention gradient was zero through them).
    xp, mask = left_padded(ids(1, 9, seed=31), ids(1, 5, seed=32))
    for m in (ref, tri):
        m.zero_grad()
        m(xp, attention_mask=mask, shift_labels=ids(2, 9, seed=3)).loss.backward()
    for (name, p), q in zip(ref.named_parameters(), tri.parameters()):
        assert torch.allclose(p.grad, q.grad, atol=1e-5, rtol=1e-4), name


@pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter path; tests/test_model_gpu.py")
@pytest.mark.parametrize("model", ["fot_pro", "fot_llama"])
def test_triton_backend_under_interpreter_decodes_left_padded_rows_as_the_reference(
    model: str,
) -> None:
    """CPU counterpart of test_model_gpu's Triton cached decode and left-padded generate:
    a left-padded row decoded by the Triton kernels equals the reference backend's row."""
    ref = tiny(model)
    tri = tiny(model, attn_backend="triton")
    tri.load_state_dict(ref.state_dict())
    a, b = ids(1, 9, seed=31), ids(1, 5, seed=32)
    x, mask = left_padded(a, b)
    kw = greedy_with_logits(4)
    out = tri.generate(x, attention_mask=mask, **kw)
    solo = ref.generate(b, **kw)
    assert torch.equal(out.sequences[1, 4:], solo.sequences[0])
    for step, (lp, lb) in enumerate(zip(out.logits, solo.logits)):
        assert max_err(lp[1], lb[0]) < TOL, step
    got, _ = _decode_logits(tri, x[:1], [5, 2, 1, 1])
    assert max_err(got, ref(x[:1]).logits) < TOL


def test_log_gate_stays_fp32_under_autocast_and_gradient_checkpointing_works() -> None:
    m = tiny("fot_pro")
    attn = m.model.layers[0].self_attn
    x = torch.randn(1, 6, 128)
    want = attn.log_fgate(x)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = attn.log_fgate(x)
    assert got.dtype == torch.float32 and torch.equal(got, want)
    # activation checkpointing (HF API) gives the same gradients
    x, y = ids(1, 20), ids(1, 20, seed=3)
    m.train()(x, shift_labels=y).loss.backward()
    want = [p.grad.clone() for p in m.parameters()]
    m.zero_grad()
    # activation_checkpointing_enable from transformers 5.23 on; before, its (now deprecated)
    # alias gradient_checkpointing_enable, the only name in 5.20.2 (Python 3.10's newest)
    enable = getattr(m, "activation_checkpointing_enable", None) or m.gradient_checkpointing_enable
    enable({"use_reentrant": False})
    assert all(layer.gradient_checkpointing for layer in m.model.layers)
    m(x, shift_labels=y).loss.backward()
    for w, p in zip(want, m.parameters()):
        assert torch.allclose(w, p.grad, atol=1e-6)


@pytest.mark.parametrize("reentrant", [False, True])
def test_gradient_checkpointing_in_training_returns_no_cache(reentrant: bool, monkeypatch) -> None:
    """Recomputing a block in the backward pass wrote its tokens into the cache again (20 cached
    tokens for 10; or a CheckpointError in backward): as HF's Llama, no cache is made then, and
    a cache passed in is refused. Without gradients the cache is kept, whatever transformers'
    checkpointing layer does (before 5.24 it dropped the cache there too: emulated below)."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    def drop_cache_in_training(self, *args, **kwargs):  # transformers 5.10 to 5.23
        if self.gradient_checkpointing and self.training:
            kwargs["past_key_values"] = None
        return real_call(self, *args, **kwargs)

    real_call = GradientCheckpointingLayer.__call__
    monkeypatch.setattr(GradientCheckpointingLayer, "__call__", drop_cache_in_training)
    m = tiny("fot_pro").train()
    x, y = ids(1, 10), ids(1, 10, seed=3)
    m.zero_grad()
    m(x, shift_labels=y).loss.backward()
    want = [p.grad.clone() for p in m.parameters()]
    m.zero_grad()
    enable = getattr(m, "activation_checkpointing_enable", None) or m.gradient_checkpointing_enable
    enable({"use_reentrant": reentrant})
    out = m(x, shift_labels=y, use_cache=True)
    assert out.past_key_values is None
    out.loss.backward()
    for w, p in zip(want, m.parameters()):
        assert torch.allclose(w, p.grad, atol=1e-6)
    with pytest.raises(ValueError, match=r"gradient checkpointing.*gradient_checkpointing_disable"):
        m(x, past_key_values=FoTCache(m.config.num_hidden_layers))
    with torch.no_grad():  # generation from a model in training mode keeps its cache
        cache = m(x, use_cache=True).past_key_values
    assert cache.get_seq_length() == 10


@pytest.mark.parametrize("model", ["fot_pro", "fot_llama", "transformer_pro"])
def test_bf16_autocast_forward_backward_close_to_fp32(model: str) -> None:
    """The trainer runs under bf16 autocast: every variant must run there (q, k, v of one
    dtype after QK-norm/KV-shift) and stay close to the fp32 loss."""
    m = tiny(model).train()
    x, y = ids(2, 24), ids(2, 24, seed=4)
    want = m(x, shift_labels=y).loss
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = m(x, shift_labels=y).loss
    got.backward()
    assert got.dtype == torch.float32
    assert abs(got.item() - want.item()) < 2e-2 * want.item()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in m.parameters())


# ---------------------------------------------------------------------------------------
# Adapters and hooks: the fused paths read weights, wrapped or hooked layers must still run
# ---------------------------------------------------------------------------------------


class LowRankAdapted(torch.nn.Module):
    """A LoRA wrapper shaped like PEFT's: ``base(x) + x A^T B^T``, with ``weight``/``bias``/
    ``out_features`` still answering from the base layer (so reading the weight misses ``B A``)."""

    def __init__(self, base: torch.nn.Linear, rank: int = 2, scale: float = 0.2) -> None:
        super().__init__()
        self.base_layer = base
        self.lora_A = torch.nn.Parameter(scale * torch.randn(rank, base.in_features))
        self.lora_B = torch.nn.Parameter(scale * torch.randn(base.out_features, rank))

    weight = property(lambda self: self.base_layer.weight)
    bias = property(lambda self: self.base_layer.bias)
    out_features = property(lambda self: self.base_layer.out_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base_layer(x) + x @ self.lora_A.T @ self.lora_B.T


def _linears(model: torch.nn.Module) -> list[tuple[torch.nn.Module, str, torch.nn.Linear]]:
    """(parent, attribute, layer) for every nn.Linear (the forget gate's subclass included)."""
    return [
        (parent, name, child)
        for parent in model.modules()
        for name, child in parent.named_children()
        if isinstance(child, torch.nn.Linear)
    ]


# The Triton backend here runs under the interpreter; with a GPU, tests/test_model_gpu.py.
INTERPRETED_BACKENDS = [
    "reference",
    pytest.param(
        "triton", marks=pytest.mark.skipif(torch.cuda.is_available(), reason="test_model_gpu.py")
    ),
]


def attach_adapters(
    wrapped: torch.nn.Module, merged: torch.nn.Module, scale: float = 0.2
) -> list[tuple[LowRankAdapted, torch.nn.Linear]]:
    """Wrap every linear layer of ``wrapped`` in a :class:`LowRankAdapted` and add its ``B A``
    to the same layer of ``merged`` (same architecture and weights). Returns (adapter, merged
    layer) pairs."""
    pairs = []
    with torch.no_grad():
        for (parent, name, layer), (_, _, plain) in zip(_linears(wrapped), _linears(merged)):
            adapter = LowRankAdapted(layer, scale=scale).to(layer.weight.device)
            setattr(parent, name, adapter)
            plain.weight += adapter.lora_B @ adapter.lora_A
            pairs.append((adapter, plain))
    return pairs


@pytest.mark.parametrize("backend", INTERPRETED_BACKENDS)
def test_adapters_on_every_linear_equal_merged_weights(backend: str) -> None:
    """LoRA-style wrappers on every projection, the forget gate's and the LM head included,
    give the logits, loss and weight gradients of a plain model with ``W + B A`` merged in."""
    wrapped = tiny("fot_pro", attn_backend=backend)
    merged = tiny("fot_pro", attn_backend=backend)
    torch.manual_seed(5)
    pairs = attach_adapters(wrapped, merged)
    x, y = ids(2, 21), ids(2, 21, seed=4)
    logits = wrapped(x).logits
    # W x + B (A x) and (W + B A) x round differently: float32 error relative to the logits'
    # scale (|logits| reaches ~4 here), as TOL is for logits of order 1
    assert max_err(logits, merged(x).logits) < TOL * max(1.0, logits.abs().max().item())
    loss = wrapped.train()(x, shift_labels=y).loss
    want = merged.train()(x, shift_labels=y).loss
    assert abs(loss.item() - want.item()) < 1e-5
    loss.backward()
    want.backward()
    # dL/dW is the same for the base weight and the merged one; every adapter is trained.
    assert len(pairs) == 11 * len(wrapped.model.layers) + 1  # 11 per layer + the LM head
    for adapter, plain in pairs:
        assert torch.allclose(adapter.weight.grad, plain.weight.grad, atol=1e-5)
        assert adapter.lora_B.grad is not None and adapter.lora_B.grad.abs().sum() > 0


def double_projections_by_hooks(hooked: torch.nn.Module, scaled: torch.nn.Module) -> list:
    """Doubling forward hooks on layer 0's q, forget-gate and MLP-up projections, its input
    norm and q-norm, and on the LM head of ``hooked``; the same layers' weights doubled in
    ``scaled``. Returns the list the hooks append their module to (6 calls per forward)."""
    calls = []

    def double(module: torch.nn.Module, args: tuple, out: torch.Tensor) -> torch.Tensor:
        calls.append(module)
        return 2 * out

    with torch.no_grad():
        for name in (
            "self_attn.q_proj",
            "self_attn.fgate_proj",
            "mlp.up_proj",
            "input_layernorm",
            "self_attn.q_norm",
        ):
            hooked.model.layers[0].get_submodule(name).register_forward_hook(double)
            layer = scaled.model.layers[0].get_submodule(name)
            layer.weight *= 2
            if getattr(layer, "bias", None) is not None:
                layer.bias *= 2
        hooked.lm_head.register_forward_hook(double)
        scaled.lm_head.weight *= 2
    return calls


def test_chunked_loss_of_a_head_module_keeps_fp32_logits_under_autocast() -> None:
    """Evaluation's float32 logits hold for a wrapped LM head too (autocast off around it)."""
    from fot.models.modeling_fot import _chunked_cross_entropy

    torch.manual_seed(0)
    head = LowRankAdapted(torch.nn.Linear(16, VOCAB, bias=False))
    hidden, labels = torch.randn(40, 16), torch.randint(0, VOCAB, (40,))
    with torch.no_grad():
        want = F.cross_entropy(head(hidden), labels, reduction="none")  # float32, no autocast
        with torch.autocast("cpu", dtype=torch.bfloat16):
            got = _chunked_cross_entropy(hidden, head, labels, 16, fp32_logits=True)
            rounded = _chunked_cross_entropy(hidden, head, labels, 16)
    assert max_err(got, want) < 1e-5
    assert max_err(rounded, want) > 1e-3  # without it the head runs in bf16


@pytest.mark.parametrize("backend", INTERPRETED_BACKENDS)
def test_forward_hooks_on_projections_fire(backend: str) -> None:
    """A hook that doubles a projection's or a norm's output acts like doubling its weight
    (the projections, norms and LM head that the kernel paths otherwise run fused)."""
    hooked = tiny("fot_pro", attn_backend=backend)
    scaled = tiny("fot_pro", attn_backend=backend)
    calls = double_projections_by_hooks(hooked, scaled)
    x, y = ids(1, 19), ids(1, 19, seed=6)
    assert max_err(hooked(x).logits, scaled(x).logits) < 2 * TOL
    assert len(calls) == 6
    got = hooked(x, shift_labels=y).loss.item()
    assert abs(got - scaled(x, shift_labels=y).loss.item()) < 1e-5


# ---------------------------------------------------------------------------------------
# Performance paths (issue 7): SDPA for ungated attention, lean Pro components
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("T,hq,hkv", [(1, 2, 2), (37, 4, 4), (29, 4, 2)])
def test_sdpa_attention_equals_reference_without_gate(T: int, hq: int, hkv: int) -> None:
    """SDPA (no gate) against the reference kernel with log f = 0: output and gradients."""
    from fot.kernels import forgetting_attention_reference
    from fot.models.modeling_fot import _sdpa_priority, sdpa_attention

    g = torch.Generator().manual_seed(T)
    q = torch.randn(2, T, hq, 16, generator=g, requires_grad=True)
    k = torch.randn(2, T, hkv, 16, generator=g, requires_grad=True)
    v = torch.randn(2, T, hkv, 16, generator=g, requires_grad=True)
    zero = torch.zeros(2, T, hq)
    do = torch.randn(2, T, hq, 16, generator=g)
    got = sdpa_attention(q, k, v, zero, scale=0.3)
    want = forgetting_attention_reference(q, k, v, zero, scale=0.3)
    assert got.shape == want.shape and max_err(got, want) < 1e-5
    with _sdpa_priority():  # the CUDA backend order (cuDNN first) is a valid context anywhere
        assert max_err(sdpa_attention(q, k, v, zero, scale=0.3), want) < 1e-5
    grads = torch.autograd.grad((got * do).sum(), (q, k, v))
    wants = torch.autograd.grad((want * do).sum(), (q, k, v))
    for a, b in zip(grads, wants):
        assert max_err(a, b) < 1e-5
    with pytest.raises(ValueError, match="cu_seqlens"):
        sdpa_attention(q, k, v, zero, cu_seqlens=torch.tensor([0, T]))
    with pytest.raises(ValueError, match="window_size"):
        sdpa_attention(q, k, v, zero, window_size=4)


@pytest.mark.parametrize(
    "model,extra",
    [("transformer_pro", {}), ("transformer_llama", {"num_kv_heads": 2}), ("fot_pro", {})],
)
def test_sdpa_backend_matches_reference_and_is_chosen_only_without_gate(
    model: str, extra: dict, monkeypatch
) -> None:
    """``attn_backend="sdpa"`` on CPU: equal logits and gradients to the reference backend;
    SDPA runs exactly for gate ``none`` on whole sequences (not packed, not cached decode)."""
    import fot.models.modeling_fot as mf

    ref = tiny(model, **extra).train()
    sdp = tiny(model, attn_backend="sdpa", **extra).train()
    sdp.load_state_dict(ref.state_dict())
    calls = []
    real = mf.sdpa_attention
    monkeypatch.setattr(mf, "sdpa_attention", lambda *a, **k: calls.append(1) or real(*a, **k))
    x, y = ids(2, 23), ids(2, 23, seed=5)
    assert max_err(sdp(x).logits, ref(x).logits) < TOL
    ungated = ref.config.fgate_type == "none"
    assert len(calls) == (ref.config.num_hidden_layers if ungated else 0)
    ref(x, shift_labels=y).loss.backward()
    sdp(x, shift_labels=y).loss.backward()
    for (name, p), q in zip(ref.named_parameters(), sdp.parameters()):
        assert torch.allclose(p.grad, q.grad, atol=1e-5, rtol=1e-4), name
    calls.clear()
    cu = torch.tensor([0, 9, 23], dtype=torch.int32)  # packed documents: the kernel path
    assert max_err(sdp.eval()(x[:1], cu_seqlens=cu).logits, ref(x[:1], cu_seqlens=cu).logits) < TOL
    assert not calls
    got, _ = _decode_logits(sdp, x, [20, 2, 1])  # prefill may use SDPA, decode steps may not
    assert max_err(got, ref(x).logits) < TOL


def _saved_tensors(fn, *args) -> list[torch.Tensor]:
    saved: list[torch.Tensor] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn(*args)
    out.float().sum().backward()
    return saved


def _pro_inputs(device: str = "cpu"):
    g = torch.Generator().manual_seed(0)
    B, T, H, D = 2, 33, 3, 16
    x = torch.randn(B, T, H, D, generator=g)
    gate = torch.sigmoid(torch.randn(B, T, H, D, generator=g))
    logits = torch.randn(B, T, H, generator=g)
    w = 1 + 0.3 * torch.randn(H, D, generator=g)
    return [t.to(device) for t in (x, gate, logits, w)]


def test_pro_components_bf16_close_to_fp32_and_shift_saves_no_fp32_copies() -> None:
    """QK/output norm (with the gate folded in) and KV-shift: equal to the fp32 formulas in fp32,
    within bf16 rounding in bf16; KV-shift keeps no fp32 [B, T, H, D] tensor for backward (the
    norm's fused kernel is CUDA-only: see the GPU test below)."""
    from fot.models.modeling_fot import FoTHeadRMSNorm, token_shift

    x, gate, logits, w = _pro_inputs()
    norm = FoTHeadRMSNorm(*w.shape, eps=1e-6)
    with torch.no_grad():
        norm.weight.copy_(w)
    want_norm = x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w * gate
    a = torch.sigmoid(logits)[..., None]
    prev = torch.cat([torch.zeros_like(x[:, :1]), x[:, :-1]], dim=1)
    want_shift = a * prev + (1 - a) * x
    assert max_err(norm(x, gate), want_norm) < 1e-5
    assert max_err(norm(x), want_norm / gate) < 1e-5
    assert max_err(token_shift(x, logits, None, None), want_shift) < 1e-6
    xb = x.bfloat16().requires_grad_()
    for fn, args, want in (
        (norm, (xb, gate.bfloat16()), want_norm),
        (token_shift, (xb, logits.bfloat16(), None, None), want_shift),
    ):
        saved = _saved_tensors(fn, *args)
        got = fn(*args)
        assert got.dtype == torch.bfloat16
        assert ((got.float() - want).norm() / want.norm()).item() < 1e-2
        assert torch.isfinite(xb.grad).all()
        xb.grad = None
        if fn is token_shift:
            big = [t for t in saved if t.dtype == torch.float32 and t.numel() >= x.numel()]
            assert not big, [tuple(t.shape) for t in big]


@pytest.mark.gpu
def test_head_norm_saves_no_fp32_copies_on_cuda() -> None:
    """On CUDA ``F.rms_norm`` is one fused kernel: bf16 in, bf16 saved, fp32 math inside."""
    from fot.models.modeling_fot import FoTHeadRMSNorm

    x, gate, _, w = _pro_inputs("cuda")
    norm = FoTHeadRMSNorm(*w.shape, eps=1e-6).cuda()
    with torch.no_grad():
        norm.weight.copy_(w)
    xb = x.bfloat16().requires_grad_()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        saved = _saved_tensors(norm, xb, gate.bfloat16())
    big = [t for t in saved if t.dtype == torch.float32 and t.numel() >= x.numel()]
    assert not big, [tuple(t.shape) for t in big]


def test_fgate_bias_init_sets_gate_bias_and_survives_reload(tmp_path) -> None:
    """``FoTConfig.fgate_bias_init`` is the initial bias of every data-dependent gate (weights
    keep their N(0, std) init); a saved model loads its trained bias, not the init value."""
    config = fot.presets.config("fot_pro", "tiny", fgate_bias_init=3.0)
    model = fot.presets.build_model(config)
    gates = [layer.self_attn.fgate_proj for layer in model.model.layers]
    assert all(torch.equal(g.bias, torch.full_like(g.bias, 3.0)) for g in gates)
    assert all(0.01 < float(g.weight.std()) < 0.03 for g in gates)  # std 0.02, not constant
    q_std = float(model.model.layers[0].self_attn.q_proj.weight.std())
    assert 0.015 < q_std < 0.025
    with torch.no_grad():
        gates[0].bias.fill_(1.5)
    model.save_pretrained(tmp_path)
    loaded = type(model).from_pretrained(tmp_path)
    assert loaded.config.fgate_bias_init == 3.0
    assert torch.equal(loaded.model.layers[0].self_attn.fgate_proj.bias, gates[0].bias)
    assert torch.equal(loaded.model.layers[1].self_attn.fgate_proj.bias, gates[1].bias)


def test_train_throughput_gate_init_flag_and_sdpa_backend() -> None:
    """``benchmarks/train_throughput.py --fgate-bias-init`` sets every gate bias (weak decay at
    init) and ``--fot-backend sdpa`` runs the Transformer baseline through SDPA."""
    import importlib
    import sys
    from pathlib import Path

    bench = Path(__file__).resolve().parents[1] / "benchmarks"
    sys.path.insert(0, str(bench))
    try:
        tt = importlib.import_module("train_throughput")
        cpu = torch.device("cpu")
        model, _, _ = tt.build("fot_llama", "tiny", device=cpu, seq_len=32, fgate_bias_init=5.0)
        biases = [layer.self_attn.fgate_proj.bias for layer in model.model.layers]
        assert biases and all(torch.equal(b, torch.full_like(b, 5.0)) for b in biases)
        model, _, _ = tt.build("fot_llama", "tiny", device=cpu, seq_len=32)
        assert all(
            torch.equal(layer.self_attn.fgate_proj.bias, torch.zeros_like(biases[0]))
            for layer in model.model.layers
        )
        args = ["--device", "cpu", "--size", "tiny", "--seq-len", "32", "--steps", "1"]
        args += ["--warmup", "0", "--fot-backend", "sdpa", "--fgate-bias-init", "5"]
        payload = tt.main([*args, "--models", "transformer_llama,fot_llama"])
        rows = {r["model"]: r for r in payload["results"]}
        assert rows["transformer_llama"]["status"] == "ok"
        assert rows["transformer_llama"]["attn_impl"] == "sdpa"
        assert rows["fot_llama"]["attn_impl"] == "reference"
        assert rows["fot_llama"]["fgate_bias_init"] == 5.0
    finally:
        sys.path.remove(str(bench))
        for name in ("train_throughput", "flops"):
            sys.modules.pop(name, None)


def test_rope_function_gradient_and_values() -> None:
    """RoPE's hand-written backward (a rotation's transpose) against autograd of the formula."""
    from fot.models.modeling_fot import apply_rope, rope_cos_sin, rotate_half

    g = torch.Generator().manual_seed(3)
    pos = torch.arange(7)[None].expand(2, 7)
    cos, sin = (t.double() for t in rope_cos_sin(pos, 8, 10000.0))
    q = torch.randn(2, 7, 3, 8, dtype=torch.float64, generator=g, requires_grad=True)
    k = torch.randn(2, 7, 1, 8, dtype=torch.float64, generator=g, requires_grad=True)
    assert torch.autograd.gradcheck(lambda a, b: apply_rope(a, b, cos, sin), (q, k))
    got_q, _ = apply_rope(q, k, cos, sin)
    assert max_err(got_q, q * cos + rotate_half(q) * sin) < 1e-12
    qb = q.detach().bfloat16().requires_grad_()
    out, _ = apply_rope(qb, k.detach().bfloat16(), cos.float(), sin.float())
    assert out.dtype == torch.bfloat16
    out.float().sum().backward()
    assert qb.grad.dtype == torch.bfloat16 and torch.isfinite(qb.grad).all()


def test_pro_recompute_same_gradients_and_keeps_less_for_backward(monkeypatch) -> None:
    """Recomputing KV-shift / QK-norm / output norm+gate in backward: equal gradients to keeping
    their intermediates, and fewer bytes saved for backward."""

    m = tiny("fot_pro").train()
    x, y = ids(2, 19), ids(2, 19, seed=7)

    def run(recompute: bool) -> tuple[list[torch.Tensor], int]:
        for module in m.modules():
            if hasattr(module, "config"):
                module.config.recompute_pro = recompute
        m.zero_grad()
        storages: dict[int, int] = {}

        def pack(t: torch.Tensor) -> torch.Tensor:
            storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = m(x, shift_labels=y).loss
        loss.backward()
        return [p.grad.clone() for p in m.parameters()], sum(storages.values())

    kept_grads, kept_bytes = run(False)
    re_grads, re_bytes = run(True)
    for a, b in zip(kept_grads, re_grads):
        assert torch.allclose(a, b, atol=1e-6, rtol=1e-5)
    assert re_bytes < kept_bytes


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_padded_head_with_bias_equals_cut_head(dtype) -> None:
    """The fused loss's aligned head (all padded rows, padding logits biased by -1e4) gives the
    cut head's cross-entropy and gradients; padding rows get exactly zero gradient."""
    m = tiny("fot_llama")
    weight, bias = m._padded_head()
    assert weight.shape[0] == 320 and bias is not None and (bias[VOCAB:] == -1e4).all()
    g = torch.Generator().manual_seed(3)
    h = torch.randn(64, m.config.hidden_size, generator=g)
    y = torch.randint(0, VOCAB, (64,), generator=g)
    w = m.lm_head.weight.detach().to(dtype).requires_grad_(True)
    full = F.cross_entropy(F.linear(h.to(dtype), w, bias.to(dtype)).float(), y)
    (g_full,) = torch.autograd.grad(full, w)
    w2 = m.lm_head.weight.detach().to(dtype).requires_grad_(True)
    cut = F.cross_entropy(F.linear(h.to(dtype), w2[:VOCAB]).float(), y)
    (g_cut,) = torch.autograd.grad(cut, w2)
    assert torch.equal(full, cut)
    assert torch.equal(g_full[VOCAB:], torch.zeros_like(g_full[VOCAB:]))
    assert torch.equal(g_full, g_cut)
    unpadded = tiny("fot_llama", vocab_size=320)
    assert unpadded._padded_head()[1] is None


def test_fused_projections_equal_separate_layers() -> None:
    """One GEMM over concatenated weights gives each layer's output and the same input and
    weight gradients (fp32); under bf16 autocast the outputs are bf16 like the layers'."""
    from fot.models.modeling_fot import fused_projections

    torch.manual_seed(0)
    layers = [torch.nn.Linear(16, n, bias=False) for n in (8, 4, 3)]
    x = torch.randn(2, 5, 16, requires_grad=True)
    outs = fused_projections(x, layers)
    want = [layer(x) for layer in layers]
    for got, ref in zip(outs, want):
        assert got.shape == ref.shape and torch.allclose(got, ref, atol=1e-6)
    weights = [layer.weight for layer in layers]
    up = [torch.randn_like(r) for r in want]
    g_fused = torch.autograd.grad(outs, [x, *weights], up)
    g_sep = torch.autograd.grad(want, [x, *weights], up)
    for a, b in zip(g_fused, g_sep):
        assert torch.allclose(a, b, atol=1e-5)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        outs = fused_projections(x, layers)
        want = [layer(x) for layer in layers]
    for got, ref in zip(outs, want):
        assert got.dtype == ref.dtype == torch.bfloat16
        assert torch.allclose(got.float(), ref.float(), atol=2e-2, rtol=1e-2)

"""Tiny checkpoints and fake models shared by the fot.eval tests."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import torch

VOCAB = 50257

# A two-question multiple-choice toy task for the lm-eval adapter tests.
QUESTIONS = [
    {"question": "The capital of France is", "choices": ["Paris", "a banana"], "label": 0},
    {"question": "Two plus two equals", "choices": ["four", "seven", "a cloud"], "label": 0},
]


def make_llama_checkpoint(path: Path, *, max_len: int = 512, seed: int = 0) -> Path:
    """A tiny randomly initialised LlamaForCausalLM (GPT-2 vocab) + GPT-2 tokenizer."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from fot.tokenizer import save_hf_tokenizer

    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=max_len,
        bos_token_id=50256,
        eos_token_id=50256,
        tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(cfg)
    model.save_pretrained(path)
    save_hf_tokenizer(path)
    return path


def make_gpt2_checkpoint(path: Path, *, n_positions: int = 128) -> Path:
    """A tiny randomly initialised GPT2LMHeadModel: a learned table of ``n_positions``."""
    from transformers import GPT2Config, GPT2LMHeadModel

    from fot.tokenizer import save_hf_tokenizer

    torch.manual_seed(0)
    cfg = GPT2Config(vocab_size=VOCAB, n_positions=n_positions, n_embd=16, n_layer=1, n_head=2)
    GPT2LMHeadModel(cfg).save_pretrained(path)
    save_hf_tokenizer(path)
    return path


def make_fot_checkpoint(path: Path, *, seed: int = 0, **overrides) -> Path:
    """A tiny randomly initialised FoT (Pro) checkpoint exported for AutoModelForCausalLM."""
    import fot.presets as presets
    from fot.tokenizer import save_hf_tokenizer

    torch.manual_seed(seed)
    cfg = presets.config("fot_pro", "tiny", **overrides)
    model = presets.build_model(cfg)
    try:
        from fot.export import export_hf
    except ImportError:
        export_hf = None
    if export_hf is not None:
        export_hf(model, path)
    else:
        model.save_pretrained(path)
        save_hf_tokenizer(path)
    return path


class CopyOracle(torch.nn.Module):
    """Predicts the token one period back: exact on ``[bos] S [bos] S`` after the 2nd bos.

    The period is the distance between the last two ``bos`` tokens of each row.
    """

    def __init__(self, bos: int, vocab: int) -> None:
        super().__init__()
        self.bos, self.vocab = bos, vocab
        self.dummy = torch.nn.Parameter(torch.zeros(1))

    def forward(self, input_ids: torch.Tensor, **_) -> SimpleNamespace:
        B, T = input_ids.shape
        logits = torch.zeros(B, T, self.vocab)
        for b in range(B):
            pos = (input_ids[b] == self.bos).nonzero().flatten().tolist()
            period = pos[-1] - pos[-2] if len(pos) >= 2 else 1
            for t in range(T):
                src = t - period + 1
                nxt = input_ids[b, src] if 0 <= src < T else 0
                logits[b, t, nxt] = 1.0
        return SimpleNamespace(logits=logits)


class RandomLogits(torch.nn.Module):
    """Logits drawn at random (seeded): a model with chance-level accuracy."""

    def __init__(self, vocab: int, seed: int = 0) -> None:
        super().__init__()
        self.vocab = vocab
        self.gen = torch.Generator().manual_seed(seed)
        self.dummy = torch.nn.Parameter(torch.zeros(1))

    def forward(self, input_ids: torch.Tensor, **_) -> SimpleNamespace:
        B, T = input_ids.shape
        return SimpleNamespace(logits=torch.randn(B, T, self.vocab, generator=self.gen))


def make_trained_fot_checkpoint(path: Path) -> Path:
    """A tiny FoT (Pro) trained for a few steps by the trainer; returns its HF export folder.

    This is the checkpoint users evaluate: the trainer's own ``hf/`` export.
    """
    from hydra import compose, initialize_config_dir

    from fot.training import register_configs, train

    register_configs()
    configs = Path(__file__).resolve().parents[1] / "configs"
    with initialize_config_dir(config_dir=str(configs), version_base="1.3"):
        cfg = compose(
            "train",
            overrides=[
                f"out_dir={path}",
                "data.seq_len=128",
                "data.val_tokens=256",
                "global_batch_tokens=512",
                "micro_batch_size=4",
                "total_tokens=1024",
                "log_every_tokens=512",
                "val_every_tokens=0",
                "ckpt_every_tokens=0",
                "export_hf=true",
                "progress=false",
                "wandb.mode=disabled",
                "device=cpu",
            ],
        )
    return Path(train(cfg)["hf_dir"])

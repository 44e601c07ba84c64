"""Training a translator with DyPRAG's recipe from what the study makes on its training questions: per passage its
augmentation row (``augment.jsonl``) and its PRAG adapter (``adapters/<pid>/``).

The recipe (DyPRAG's ``train_dyprag.py``, read 2026-12; written here from its description):

- the passage's embedding: :mod:`.embed`, by the frozen base model;
- the passage's training text: its first question-answer pair asked with the passage in the prompt (the study's
  ``combine`` prompt with that one passage), followed by the answer, the loss on every token (DyPRAG's labels
  are its input ids); a passage without a usable pair trains on its own text;
- per passage, with the generated update applied differentiably (``x @ (B A)^T`` added to each projection's
  output, no ``alpha / r``, computed as ``(x A^T) B^T``): the LM loss of the text, plus ``0.01 x`` the KL
  divergence from the output distribution under the passage's PRAG adapter (``s B A``) summed over the text's
  positions, plus ``100 x`` the sum over projections of the MSE between the generated and the PRAG adapter's
  ``A`` and ``B``. DyPRAG pads every text to 3,000 tokens and its KL also sums over the padding positions; here
  only the text's own positions count, so a passage's loss does not depend on its padding;
- AdamW (torch's defaults, weight decay 0.01) at lr 1e-5, a batch of 1 passage, a shuffled order per epoch
  (seeded), hypernet width 32. A batch of ``b`` passages averages their losses.

Resumable: every ``checkpoint_every`` steps and at each epoch's end the translator, the optimizer and the step are
saved (``train_state.pt``, atomically); a run started again on the same folder, passages and options resumes there
and ends bit for bit where an uninterrupted run ends (on the CPU). The end: ``translator.pt`` in DyPRAG's format
(:mod:`.checkpoint`) and ``train.json`` (the options, the losses, the seconds); a finished folder is loaded, not
trained again.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, Sequence

import torch
from torch.nn import functional as F

from fcprag_plugin.adapter import LoraAdapter
from fcprag_plugin.errors import FcpragError
from fcprag_plugin.fileio import read_json_object, write_json
from ..lm.metrics import model_device
from ..lm.prompts import PromptTemplate, answer_ids, render_prompt
from .checkpoint import cpu_state_dict, load_translator, save_torch, save_translator
from .embed import MAX_TOKENS, passage_embeddings
from .network import Translator, TranslatorError, TranslatorShape

KL_WEIGHT, MSE_WEIGHT = 0.01, 100.0
STATE, EXPORT, SUMMARY = "train_state.pt", "translator.pt", "train.json"
Factors = Mapping[str, tuple[torch.Tensor, torch.Tensor]]  # {projection path: (A [b, r, in], B [b, out, r])}


@dataclass(frozen=True)
class TranslatorOptions:
    """DyPRAG's defaults: 1 epoch (its README's run), lr 1e-5, width 32 (``projector_p``), 1 passage a step.
    ``embed_batch``: passages per embedding forward; ``checkpoint_every``: steps between resume points."""

    epochs: int = 1
    learning_rate: float = 1e-5
    width: int = 32
    batch_size: int = 1
    seed: int = 0
    max_tokens: int = MAX_TOKENS
    embed_batch: int = 16
    checkpoint_every: int = 50

    def check(self) -> None:
        for name in ("epochs", "width", "batch_size", "max_tokens", "embed_batch", "checkpoint_every"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise TranslatorError(f"translator option '{name}' must be an integer >= 1, got {v!r}")
        lr = self.learning_rate
        if not isinstance(lr, (int, float)) or isinstance(lr, bool) or not math.isfinite(lr) or lr <= 0:
            raise TranslatorError(f"translator option 'learning_rate' must be a finite number > 0, got {lr!r}")


def training_text(tok: Any, aug: Mapping[str, Any], max_tokens: int = MAX_TOKENS, pid: str = "?"
                  ) -> tuple[list[int], list[int]]:
    """``(input ids, labels)`` of a passage's training text (module docstring), cut to ``max_tokens``."""
    for pair in (aug.get("qa_pairs") or [])[:1]:
        prompt = render_prompt(tok, PromptTemplate(), pair["question"], [aug["passage"]], "combine")
        try:
            ids = prompt.ids + answer_ids(tok, prompt, pair["answer"])
        except FcpragError:  # an answer that tokenizes to nothing: the passage's own text
            break
        return ids[:max_tokens], ids[:max_tokens]
    ids = list(tok(aug["passage"])["input_ids"])[:max_tokens]
    if len(ids) < 2:
        raise TranslatorError(f"passage '{pid}': its text has {len(ids)} token(s) and no usable question-answer pair; "
                              "the translator's LM loss needs at least 2 tokens")
    return ids, list(ids)


@contextlib.contextmanager
def applied(model: Any, factors: Factors) -> Iterator[None]:
    """Inside the block, sample ``b`` of each forward gets ``x_b @ (B_b @ A_b).T`` added to the output of each
    projection named in ``factors`` (computed as ``(x_b A_b^T) B_b^T``, differentiable, factors cast to the
    activations' dtype). DyPRAG's MLP adds the same with a dense ``delta``."""
    def hook(A: torch.Tensor, B: torch.Tensor) -> Callable[..., torch.Tensor]:
        def add(module: Any, inputs: tuple, out: torch.Tensor) -> torch.Tensor:
            x = inputs[0]
            return out + (x @ A.transpose(1, 2).to(x.dtype)) @ B.transpose(1, 2).to(x.dtype)
        return add

    handles = []
    try:
        for path, (A, B) in factors.items():
            try:
                module = model.get_submodule(path)
            except AttributeError:
                raise TranslatorError(f"the model has no module '{path}'; DyPRAG's translator updates the gated MLP's "
                                      "gate_proj, up_proj and down_proj of every layer (Llama, Qwen2, ...)") from None
            handles.append(module.register_forward_hook(hook(A, B)))
        yield
    finally:
        for h in handles:
            h.remove()


@contextlib.contextmanager
def frozen(model: Any) -> Iterator[None]:
    """The model's parameters without gradients inside the block (the translator learns, the model does not)."""
    on = [p for p in model.parameters() if p.requires_grad]
    for p in on:
        p.requires_grad_(False)
    try:
        yield
    finally:
        for p in on:
            p.requires_grad_(True)


def stacked(targets: Sequence[tuple[str, LoraAdapter]], paths: Sequence[str], device: torch.device, scaled: bool
            ) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """The PRAG adapters of a batch as ``{path: (A [b, r, in], B [b, out, r])}`` (``scaled``: ``B`` times the
    adapter's ``alpha / r``); an adapter without a projection is a one-line error naming its passage."""
    out = {}
    for path in paths:
        for pid, a in targets:
            if path not in a.modules:
                raise TranslatorError(f"the PRAG adapter of passage '{pid}' ({a.source}) has no module '{path}'; the "
                                      "translator learns gate_proj, up_proj and down_proj of every layer")
        mods = [a.modules[path] for _, a in targets]
        out[path] = (torch.stack([m.A.float() for m in mods]).to(device),
                     torch.stack([m.B.float() * (m.scaling if scaled else 1.0) for m in mods]).to(device))
    return out


def _logits(model: Any, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``[M, V]`` float32 logits at the batch's real positions (row-major over sample and position)."""
    hidden = model.get_decoder()(input_ids=ids, attention_mask=mask, use_cache=False).last_hidden_state
    return model.get_output_embeddings()(hidden[mask.bool()]).float()


def sample_losses(student: torch.Tensor, teacher: torch.Tensor, mask: torch.Tensor, labels: torch.Tensor,
                  gen: Factors, prag: Factors) -> dict[str, torch.Tensor]:
    """Per sample ``[b]``: ``lm`` (mean next-token loss over the labelled tokens), ``kl`` (``KL(teacher ||
    student)`` summed over the real positions) and ``mse`` (sum over projections of the mean squared error of
    ``A`` and of ``B``); ``student`` / ``teacher``: :func:`_logits`."""
    b, sel = mask.shape[0], mask.bool()
    rows = torch.arange(b, device=mask.device)[:, None].expand_as(mask)[sel]  # [M]: the sample of each position
    nxt = torch.cat([labels[:, 1:], labels.new_full((b, 1), -100)], 1)[sel]  # position t predicts token t + 1
    ce = F.cross_entropy(student, nxt, ignore_index=-100, reduction="none")
    zeros = student.new_zeros(b)
    lm = zeros.index_add(0, rows, ce) / zeros.index_add(0, rows, (nxt != -100).float()).clamp_min(1)
    logp_s, logp_t = F.log_softmax(student, -1), F.log_softmax(teacher, -1)
    kl = zeros.index_add(0, rows, (logp_t.exp() * (logp_t - logp_s)).sum(-1))
    mse = sum(((g - t) ** 2).mean((1, 2)) for path in gen for g, t in zip(gen[path], prag[path]))
    return {"lm": lm, "kl": kl, "mse": mse}


def train_step(model: Any, tok: Any, translator: Translator, optimizer: Any, emb: torch.Tensor,
               texts: Sequence[tuple[list[int], list[int]]], targets: Sequence[tuple[str, LoraAdapter]]
               ) -> dict[str, float]:
    """One AdamW step on a batch (``emb [b, H]``, the texts, ``(pid, PRAG adapter)`` each); the batch's mean
    losses."""
    from ..study.adapters import _pad as right_pad  # here: the study's options import this module's options

    device = model_device(model)
    pad = tok.pad_token_id if tok.pad_token_id is not None else 0
    ids, mask, labels = right_pad(list(texts), pad, device)
    paths = translator.paths()
    with torch.no_grad(), applied(model, stacked(targets, paths, device, scaled=True)):
        teacher = _logits(model, ids, mask)
    gen = translator(emb)
    with applied(model, gen):
        student = _logits(model, ids, mask)
    parts = sample_losses(student, teacher, mask, labels, gen, stacked(targets, paths, device, scaled=False))
    total = parts["lm"] + KL_WEIGHT * parts["kl"] + MSE_WEIGHT * parts["mse"]
    optimizer.zero_grad(set_to_none=True)
    total.mean().backward()
    optimizer.step()
    return {"loss": float(total.detach().mean()), **{k: float(v.detach().mean()) for k, v in parts.items()}}


def _adapter(adapters: Callable[[str], Any], pid: str) -> LoraAdapter:
    a = adapters(pid)
    return a if isinstance(a, LoraAdapter) else LoraAdapter.from_pretrained(a)


def _fingerprint(pids: Sequence[str], opts: TranslatorOptions, shape: TranslatorShape) -> str:
    what = {"pids": list(pids), "options": {k: v for k, v in asdict(opts).items() if k != "checkpoint_every"},
            "shape": shape.as_dict()}
    return hashlib.sha256(json.dumps(what, sort_keys=True).encode()).hexdigest()[:16]


def _finished(folder: Path, fp: str, config: Any, device: torch.device) -> tuple[Translator, dict[str, Any]] | None:
    """A finished run's translator and stats, or None; a finished run for other passages or options is an error."""
    if not ((folder / SUMMARY).is_file() and (folder / EXPORT).is_file()):
        return None
    summary = read_json_object(folder / SUMMARY, TranslatorError, "not found")
    if summary.get("fingerprint") != fp:
        raise TranslatorError(f"{folder / SUMMARY}: this folder holds a translator trained on other passages or with "
                              f"other options ({summary.get('options')}); use another folder")
    return load_translator(folder / EXPORT, config, device=device), summary["stats"]


def _resume(folder: Path, fp: str, translator: Translator, optimizer: Any) -> dict[str, Any]:
    """The saved resume point (loaded into ``translator`` and ``optimizer``), or a fresh start."""
    path = folder / STATE
    if not path.is_file():
        return {"epoch": 0, "step": 0, "history": [], "seconds": 0.0}
    try:
        state = torch.load(str(path), map_location="cpu", weights_only=True)
    except Exception as e:
        raise TranslatorError(f"{path}: cannot be read to resume ({(str(e).splitlines() or ['?'])[0]}); remove it to "
                              "start the translator's training again") from None
    if state.get("fingerprint") != fp:
        raise TranslatorError(f"{path}: saved by a run on other passages or with other options; remove it (or use "
                              "another folder) to train with these")
    translator.load_state_dict(state["model_state_dict"], strict=True)
    optimizer.load_state_dict(state["optimizer"])
    return {k: state[k] for k in ("epoch", "step", "history", "seconds")}


def _save_state(folder: Path, fp: str, translator: Translator, optimizer: Any, epoch: int, step: int,
                history: list[dict[str, float]], seconds: float) -> None:
    save_torch({"model_state_dict": cpu_state_dict(translator), "optimizer": optimizer.state_dict(), "epoch": epoch,
                "step": step, "history": history, "seconds": seconds, "fingerprint": fp}, folder / STATE)


def _epoch_means(history: list[dict[str, float]], steps: int) -> list[dict[str, float]]:
    out = []
    for e in range(0, len(history), steps):
        part = history[e:e + steps]
        out.append({k: sum(h[k] for h in part) / len(part) for k in part[0]})
    return out


def train_translator(model: Any, tok: Any, passages: Mapping[str, Mapping[str, Any]],
                     adapters: Callable[[str], Any], options: TranslatorOptions | None = None,
                     folder: str | Path = "translator", progress: Callable[[int, int], None] | None = None
                     ) -> tuple[Translator, dict[str, Any]]:
    """Train (or resume, or load the finished) translator for ``model`` in ``folder`` (module docstring).

    ``passages``: ``{pid: augmentation row}`` (``{"passage", "qa_pairs", ...}``, the study's ``augment.jsonl``);
    ``adapters(pid)``: the passage's PRAG adapter (a :class:`LoraAdapter` or its directory), read once per step;
    its rank is the translator's. ``progress(done, total)``: after every step (and once at the start, with the
    steps a resumed run kept). Returns the translator (on the model's device, eval mode) and its stats:
    ``seconds`` (the training's wall time over all runs up to the last resume point, plus this run), ``steps``,
    ``epochs``, ``passages``, ``resumed_at`` (steps kept), ``epoch_losses`` (means of ``loss``, ``lm``, ``kl``,
    ``mse`` per epoch), ``history`` (per step), ``shape``, ``options``. ``model`` is not changed."""
    t0 = time.perf_counter()
    opts = options or TranslatorOptions()
    opts.check()
    pids = sorted(passages)
    if not pids:
        raise TranslatorError("no passages to train the translator on")
    ranks = set(_adapter(adapters, pids[0]).ranks.values())
    if len(ranks) != 1:
        raise TranslatorError(f"the PRAG adapter of passage '{pids[0]}' has ranks {sorted(ranks)}; the translator "
                              "makes one rank for every projection")
    shape = TranslatorShape.from_config(model.config, rank=ranks.pop(), width=opts.width)
    folder, device, fp = Path(folder), model_device(model), _fingerprint(pids, opts, shape)
    done = _finished(folder, fp, model.config, device)
    if done is not None:
        return done
    translator = Translator(shape, seed=opts.seed).to(device).train()
    optimizer = torch.optim.AdamW(translator.parameters(), lr=opts.learning_rate)
    state = _resume(folder, fp, translator, optimizer)
    history: list[dict[str, float]] = list(state["history"])
    steps = math.ceil(len(pids) / opts.batch_size)
    total, kept = steps * opts.epochs, len(history)
    if progress is not None:
        progress(kept, total)
    with frozen(model):
        emb = passage_embeddings(model, tok, [passages[p]["passage"] for p in pids], batch_size=opts.embed_batch,
                                 max_tokens=opts.max_tokens)
        texts = [training_text(tok, passages[p], opts.max_tokens, p) for p in pids]
        for epoch in range(state["epoch"], opts.epochs):
            order = torch.randperm(len(pids), generator=torch.Generator().manual_seed(opts.seed * 100_003 + epoch))
            batches = [order[i:i + opts.batch_size].tolist() for i in range(0, len(pids), opts.batch_size)]
            for step in range(state["step"] if epoch == state["epoch"] else 0, steps):
                b = batches[step]
                history.append(train_step(model, tok, translator, optimizer, emb[b], [texts[i] for i in b],
                                          [(pids[i], _adapter(adapters, pids[i])) for i in b]))
                if len(history) % opts.checkpoint_every == 0 or step == steps - 1:
                    nxt = (epoch, step + 1) if step + 1 < steps else (epoch + 1, 0)
                    _save_state(folder, fp, translator, optimizer, *nxt, history,
                                state["seconds"] + time.perf_counter() - t0)
                if progress is not None:
                    progress(len(history), total)
    translator.eval()
    stats = {"seconds": round(state["seconds"] + time.perf_counter() - t0, 3), "steps": total, "epochs": opts.epochs,
             "passages": len(pids), "resumed_at": kept, "epoch_losses": _epoch_means(history, steps),
             "history": history, "shape": shape.as_dict(), "options": asdict(opts)}
    save_translator(translator, folder / EXPORT)
    write_json(folder / SUMMARY, {"fingerprint": fp, "options": asdict(opts), "stats": stats})
    (folder / STATE).unlink(missing_ok=True)
    return translator, stats

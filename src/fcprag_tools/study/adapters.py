"""Passage adapters by PRAG's recipe, trained stacked: many independent LoRA adapters in one forward/backward.

Recipe (:data:`LORA`): PEFT LoRA r 2, alpha 32 on gate/up/down_proj, AdamW lr 3e-4 without weight decay, 1 epoch,
batch size 1 per adapter. Samples per passage, in this order: the passage (loss on every token, cut to
``max_tokens``), its rewrite (when kept), its QA pairs as the ``param`` prompt followed by the answer (loss on the
answer tokens only). The frozen model computes in its dtype on its device; the LoRA factors are float32 master
copies, saved float32.

Stacking (:class:`MultiLora`): each target ``nn.Linear`` gets a forward hook adding ``scaling * B_b A_b x_b`` for
sample ``b`` (``A [n, r, in]``, ``B [n, out, r]``). The loss is the sum of the per-sample mean token losses, so
adapter ``b``'s gradient is exactly its own, and :class:`StackedAdamW` updates only the adapters that took part in
a step, each with its own step count: training ``n`` together equals training each alone (tested against PEFT).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Sequence

import torch
from torch import nn

from fcprag_plugin.adapter import LoraAdapter, LoraModule

from ..options import write_dir_atomically

LORA = {"r": 2, "lora_alpha": 32, "target_modules": ["gate_proj", "up_proj", "down_proj"], "lora_dropout": 0.0}
LEARNING_RATE = 3e-4
EPOCHS = 1  # passes over a passage's samples (the adapters stage trains with the default)
KINDS = ("passage", "rewrite", "qa0", "qa1", "qa2")


def target_linears(model: nn.Module, targets: Sequence[str]) -> dict[str, nn.Linear]:
    """``{module path: Linear}`` for every Linear whose last name component is in ``targets``."""
    return {n: m for n, m in model.named_modules() if isinstance(m, nn.Linear) and n.split(".")[-1] in targets}


class MultiLora:
    """``n`` LoRA adapters on ``model``'s target Linears; ``select(idx)``: sample ``j`` of the next batch uses
    adapter ``idx[j]``. ``seeds[b]`` draws adapter ``b``'s ``A`` as PEFT does (kaiming-uniform, a = sqrt(5));
    ``B`` starts at 0."""

    def __init__(self, model: nn.Module, n: int, *, r: int, alpha: float, targets: Sequence[str],
                 seeds: Sequence[int]) -> None:
        if len(seeds) != n:
            raise ValueError(f"{n} adapters but {len(seeds)} seeds")
        self.model, self.n, self.r, self.scaling = model, n, r, alpha / r
        self.modules = target_linears(model, targets)
        if not self.modules:
            raise ValueError(f"no nn.Linear named {list(targets)} in the model")
        self.device = next(model.parameters()).device
        self.A: dict[str, torch.Tensor] = {}
        self.B: dict[str, torch.Tensor] = {}
        gens = [torch.Generator().manual_seed(int(s)) for s in seeds]  # drawn on the CPU: same on every device
        for name, lin in self.modules.items():
            bound = 1.0 / math.sqrt(lin.in_features)
            A = torch.stack([torch.empty(r, lin.in_features).uniform_(-bound, bound, generator=g) for g in gens])
            self.A[name] = A.to(self.device).requires_grad_(True)
            self.B[name] = torch.zeros(n, lin.out_features, r, device=self.device, requires_grad=True)
        self.idx: torch.Tensor | None = None
        self.handles = [lin.register_forward_hook(self._hook(name)) for name, lin in self.modules.items()]

    def parameters(self) -> list[torch.Tensor]:
        return [t for name in self.modules for t in (self.A[name], self.B[name])]

    def select(self, idx: Sequence[int]) -> None:
        self.idx = torch.as_tensor(list(idx), dtype=torch.long, device=self.device)

    def _hook(self, name: str) -> Any:
        def hook(module: nn.Module, inputs: tuple, out: torch.Tensor) -> torch.Tensor:
            x = inputs[0]
            if self.idx is None or x.shape[0] != len(self.idx):
                raise RuntimeError(f"{name}: a batch of {x.shape[0]} samples but "
                                   f"{None if self.idx is None else len(self.idx)} adapters selected")
            A = self.A[name][self.idx].to(x.dtype)  # [b, r, in]
            B = self.B[name][self.idx].to(x.dtype)  # [b, out, r]
            h = torch.bmm(x.reshape(x.shape[0], -1, x.shape[-1]), A.transpose(1, 2))  # [b, T, r]
            return out + (self.scaling * torch.bmm(h, B.transpose(1, 2))).reshape(out.shape)
        return hook

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles = []

    @classmethod
    def joined(cls, parts: Sequence["MultiLora"]) -> "MultiLora":
        """The trained adapters of ``parts`` (removed, same model) as one set, in order (no hooks)."""
        out = cls.__new__(cls)
        first = parts[0]
        out.model, out.r, out.scaling, out.modules, out.device = first.model, first.r, first.scaling, first.modules, \
            first.device
        out.n, out.idx, out.handles = sum(p.n for p in parts), None, []
        out.A = {n: torch.cat([p.A[n].detach() for p in parts]) for n in first.modules}
        out.B = {n: torch.cat([p.B[n].detach() for p in parts]) for n in first.modules}
        return out

    def adapter(self, b: int, config: dict[str, Any]) -> LoraAdapter:
        """Adapter ``b`` as a :class:`LoraAdapter` (float32 copies on the CPU)."""
        mods = {name: LoraModule(self.A[name][b].detach().float().cpu().clone(),
                                 self.B[name][b].detach().float().cpu().clone(), self.scaling)
                for name in self.modules}
        return LoraAdapter(mods, dict(config), source=f"<stacked adapter {b}>")


class StackedAdamW:
    """AdamW over stacked per-adapter tensors ``[n, ...]``; ``step(active)`` updates only the active adapters,
    each with its own step count (an adapter that sits out a step is untouched)."""

    def __init__(self, params: Sequence[torch.Tensor], n: int, lr: float, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0.0) -> None:
        self.params, self.lr, self.betas, self.eps, self.wd = list(params), lr, betas, eps, weight_decay
        self.m = [torch.zeros_like(p) for p in self.params]
        self.v = [torch.zeros_like(p) for p in self.params]
        self.t = torch.zeros(n, dtype=torch.long)

    @torch.no_grad()
    def step(self, active: Sequence[int]) -> None:
        idx = torch.as_tensor(list(active), dtype=torch.long)
        self.t[idx] += 1
        b1, b2 = self.betas
        t = self.t[idx].to(torch.float64)
        for p, m, v in zip(self.params, self.m, self.v):
            if p.grad is None:
                continue
            shape = (-1,) + (1,) * (p.dim() - 1)
            bc1 = (1 - b1 ** t).to(device=p.device, dtype=p.dtype).view(shape)
            bc2 = (1 - b2 ** t).to(device=p.device, dtype=p.dtype).view(shape)
            i = idx.to(p.device)
            g = p.grad[i]
            mi = m[i].mul_(b1).add_(g, alpha=1 - b1)
            vi = v[i].mul_(b2).addcmul_(g, g, value=1 - b2)
            m[i], v[i] = mi, vi
            pi = p[i]
            if self.wd:
                pi.mul_(1 - self.lr * self.wd)
            pi.addcdiv_(mi / bc1, (vi / bc2).sqrt_().add_(self.eps), value=-self.lr)
            p[i] = pi

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None


def lm_losses(model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor,
              labels: torch.Tensor) -> torch.Tensor:
    """Per-sample mean next-token loss ``[b]`` (float32; labels ``-100`` ignored); the output projection runs only
    at labelled positions."""
    hidden = model.get_decoder()(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
    tgt = labels[:, 1:]
    sel = tgt != -100
    logits = model.get_output_embeddings()(hidden[:, :-1][sel]).float()  # [M, V]
    ce = nn.functional.cross_entropy(logits, tgt[sel], reduction="none")
    rows = torch.arange(tgt.shape[0], device=tgt.device).unsqueeze(1).expand_as(tgt)[sel]
    total = torch.zeros(tgt.shape[0], dtype=ce.dtype, device=ce.device).index_add(0, rows, ce)
    return total / sel.sum(1).clamp_min(1)


def samples_for(tok: Any, aug: dict[str, Any], max_tokens: int) -> dict[str, tuple[list[int], list[int]]]:
    """``{kind: (input ids, labels)}`` of one passage's training samples (absent kinds left out)."""
    from ..lm.prompts import PromptTemplate, answer_ids, render_prompt

    out: dict[str, tuple[list[int], list[int]]] = {}
    for kind, text in (("passage", aug["passage"]), ("rewrite", aug.get("rewrite"))):
        if text:
            ids = list(tok(text, add_special_tokens=False)["input_ids"])[:max_tokens]
            if len(ids) >= 2:
                out[kind] = (ids, list(ids))
    for j, pair in enumerate(aug.get("qa_pairs", [])[:3]):
        prompt = render_prompt(tok, PromptTemplate(), pair["question"], None, "param")
        try:
            ans = answer_ids(tok, prompt, pair["answer"])[:48]
        except Exception:  # an answer that tokenises to nothing: no sample
            continue
        out[f"qa{j}"] = (prompt.ids + ans, [-100] * len(prompt.ids) + ans)
    return out


def _pad(seqs: list[tuple[list[int], list[int]]], pad_id: int, device: torch.device) -> tuple[torch.Tensor, ...]:
    width = max(len(s) for s, _ in seqs)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    labels = torch.full((len(seqs), width), -100, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for i, (s, lb) in enumerate(seqs):
        ids[i, :len(s)], labels[i, :len(lb)], mask[i, :len(s)] = torch.tensor(s), torch.tensor(lb), 1
    return ids.to(device), mask.to(device), labels.to(device)


def train_stacked(model: Any, tok: Any, data: list[dict[str, tuple[list[int], list[int]]]], seeds: list[int],
                  epochs: int = EPOCHS) -> tuple[MultiLora, list[dict[str, Any]]]:
    """Train one adapter per entry of ``data`` (its samples by kind) together; returns the adapters and per
    adapter ``{"steps", "loss"}`` (the loss of each sample before its first update). On a device out-of-memory
    error the group is trained again in halves (:func:`fcprag_tools.lm.oom.halving`, one log line): each adapter
    trains exactly as alone either way, so the result is the same."""
    from ..lm.oom import halving

    def train(idx: list[int]) -> tuple[MultiLora, list[dict[str, Any]]]:
        return _train_group(model, tok, [data[i] for i in idx], [seeds[i] for i in idx], epochs)

    parts = [out for _, out in halving(list(range(len(data))), max(1, len(data)), train, what="adapter training")]
    if len(parts) == 1:
        return parts[0]
    return MultiLora.joined([ml for ml, _ in parts]), [st for _, stats in parts for st in stats]


def _train_group(model: Any, tok: Any, data: list[dict[str, tuple[list[int], list[int]]]], seeds: list[int],
                 epochs: int) -> tuple[MultiLora, list[dict[str, Any]]]:
    ml = MultiLora(model, len(data), r=LORA["r"], alpha=LORA["lora_alpha"], targets=LORA["target_modules"],
                   seeds=seeds)
    opt = StackedAdamW(ml.parameters(), len(data), lr=LEARNING_RATE)
    pad = tok.pad_token_id if tok.pad_token_id is not None else 0
    stats: list[dict[str, Any]] = [{"steps": 0, "loss": {}} for _ in data]
    try:
        for epoch in range(epochs):
            for kind in KINDS:
                active = [b for b, d in enumerate(data) if kind in d]
                if not active:
                    continue
                ml.select(active)
                losses = lm_losses(model, *_pad([data[b][kind] for b in active], pad, ml.device))
                losses.sum().backward()
                opt.step(active)
                opt.zero_grad()
                for j, b in enumerate(active):
                    stats[b]["steps"] += 1
                    if epoch == 0:
                        stats[b]["loss"][kind] = round(float(losses[j].detach()), 4)
    finally:
        ml.remove()
    return ml, stats


def seed_of(pid: str) -> int:
    """The adapter's seed follows its passage, not its group (hex passage ids; others hashed)."""
    try:
        return int(pid[:8], 16)
    except ValueError:
        import hashlib

        return int(hashlib.sha1(pid.encode()).hexdigest()[:8], 16)


def save_adapter(adapter: LoraAdapter, folder: Path) -> None:
    """Save through the folder swap (``options.write_dir_atomically``): a killed process leaves no half-written
    adapter."""
    write_dir_atomically(folder, lambda tmp: adapter.save_pretrained(tmp, dtype=torch.float32))

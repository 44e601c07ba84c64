"""Test harness for the DyPRAG double: copy it to a temp dir, write questions, run it with or without the shim,
and compute the independent references (plain float64 loops over the double's recorded translator outputs)."""

from __future__ import annotations

import importlib
import json
import shutil
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, Sequence

import torch

DOUBLE_SRC = Path(__file__).parent / "src"
HOST_MODULES = ("utils", "projector")
A, B = ".lora_A.weight", ".lora_B.weight"

TOPICS = ["novel", "bridge", "river", "painting", "opera"]
# the launch tests' questions (the ``double`` fixture of tests/hosts/conftest.py): one per count, a count repeated
COUNTS = (1, 2, 3, 4, 5, 3)


def copy_double(dst: Path) -> Path:
    """Copy the double's ``src/`` under ``dst``; returns the script path."""
    src = Path(dst) / "src"
    shutil.copytree(DOUBLE_SRC, src, ignore=shutil.ignore_patterns("__pycache__"))
    return src / "inference_dyprag.py"


def make_questions(counts: Sequence[int] = (1, 2, 3, 4, 5)) -> list[dict]:
    """One question per count; passage 0 shares the question's words, the others are about other things."""
    out = []
    for qi, n in enumerate(counts):
        topic = TOPICS[qi % len(TOPICS)]
        q = f"who built the famous {topic} number {qi} in the old town"
        ps = [f"the famous {topic} number {qi} in the old town was built by person {qi}"]
        ps += [f"unrelated text {j} about weather cooking and sports scores {qi * 10 + j}" for j in range(1, n)]
        out.append({"question": q, "passages": ps, "answer": f"person {qi}"})
    return out


def write_data(path: Path, questions: list[dict]) -> Path:
    path.write_text("".join(json.dumps(q) + "\n" for q in questions), encoding="utf-8")
    return path


@contextmanager
def host_modules(src_dir: Path) -> Iterator[tuple]:
    """Import the double's ``utils`` / ``projector`` fresh from ``src_dir``; restore sys.modules/sys.path after."""
    saved = {n: sys.modules.pop(n) for n in HOST_MODULES if n in sys.modules}
    old_path = sys.path[:]
    sys.path.insert(0, str(src_dir))
    try:
        yield tuple(importlib.import_module(n) for n in HOST_MODULES)
    finally:
        sys.path[:] = old_path
        for n in HOST_MODULES:
            sys.modules.pop(n, None)
        sys.modules.update(saved)


def run_plain(script: Path, args: Sequence[str]) -> None:
    """Run the double without any shim (DyPRAG's own behaviour)."""
    from fcprag_tools.launch import run_script

    with host_modules(script.parent):
        run_script(script, list(args))


def load_record(path: Path) -> dict:
    return torch.load(path, weights_only=False)


def group_outputs(record: dict) -> list[list[dict]]:
    """Translator outputs per question (the double records every call in order)."""
    outs, i = [], 0
    for n in record["passage_counts"]:
        outs.append(record["translator"][i:i + n])
        i += n
    assert i == len(record["translator"]), "the double made translator calls outside the per-passage loop"
    return outs


def modules_of(output: dict) -> list[str]:
    return sorted({k[: -len(A)] for k in output if k.endswith(A)})


def controller_u(controller, encoder, question: str, passages: list[str]) -> list[float]:
    """``u = w~/N`` straight from the controller (or uniform for None)."""
    n = len(passages)
    if controller is None:
        return [1.0 / n] * n
    w_tilde = controller.predict(question, passages, encoder).merge_weights[0]
    return [float(w) / n for w in w_tilde]


def reference_separate(outs: list[dict], u: Sequence[float]) -> dict[str, torch.Tensor]:
    """``(sum u_i B_i) @ (sum u_i A_i)`` per module, float64."""
    ref = {}
    for m in modules_of(outs[0]):
        a = sum(float(w) * o[m + A].double() for w, o in zip(u, outs))
        b = sum(float(w) * o[m + B].double() for w, o in zip(u, outs))
        ref[m] = b @ a
    return ref


def reference_delta(outs: list[dict], u: Sequence[float]) -> dict[str, torch.Tensor]:
    """``sum_i u_i B_i @ A_i`` per module, float64."""
    return {m: sum(float(w) * (o[m + B].double() @ o[m + A].double()) for w, o in zip(u, outs))
            for m in modules_of(outs[0])}


def dyprag_original(outs: list[dict]) -> dict[str, torch.Tensor]:
    """DyPRAG's own result in its own ops: mean of A, mean of B (float32 stack/mean), ``B @ A`` in float32."""
    out = {}
    for m in modules_of(outs[0]):
        a = torch.stack([o[m + A] for o in outs]).mean(dim=0)
        b = torch.stack([o[m + B] for o in outs]).mean(dim=0)
        out[m] = (b @ a).to(torch.float32)
    return out


def reference_logits(src_dir: Path, question: str, deltas: dict[str, torch.Tensor], seed: int = 0) -> torch.Tensor:
    """First-step logits of the double's model for ``question`` with each module's dense ``delta`` set to
    ``deltas[module]`` (cast to float32), through the double's own MLP code: no shim, no slot, no PEFT."""
    prefix = "base_model.model."
    with host_modules(src_dir) as (utils, _):
        model, tokenizer = utils.get_model(seed)
        for name, d in deltas.items():
            while name.startswith(prefix):
                name = name[len(prefix):]
            utils.get_attributes(model, name).delta = d.to(torch.float32)
        with torch.no_grad():
            return model(input_ids=tokenizer(question).input_ids).logits[0, -1].clone()

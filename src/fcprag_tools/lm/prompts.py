"""The prompt the labels are measured with: modes ``param`` (question only) and ``combine`` (passages in context);
texts, chat template and ``--prompt-template``: ``docs/labels-builder.md``, "The prompt"."""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any, Sequence

from fcprag_plugin.errors import FcpragError
from fcprag_plugin.fileio import read_json_object

PROMPT_MODES = ("param", "combine")


@dataclass(frozen=True)
class PromptTemplate:
    """Prompt texts. Placeholders: ``{question}`` and ``{passages}`` in ``param``/``combine``;
    ``{index}`` (1-based) and ``{text}`` in ``passage``. ``system`` is an optional system message."""

    param: str = "Answer the question with a short answer.\nQuestion: {question}"
    combine: str = ("Answer the question with a short answer, using the passages below and your own knowledge.\n"
                    "{passages}\nQuestion: {question}")
    passage: str = "Passage {index}: {text}"
    cot: str = "\nThink step by step, then finish with \"the answer is\" followed by the short answer."
    answer_prefix: str = "The answer is"
    system: str | None = None

    @classmethod
    def from_file(cls, path: str | Path) -> "PromptTemplate":
        """Load a JSON object with any subset of the fields; unknown keys and missing placeholders are errors."""
        obj = read_json_object(Path(path), FcpragError, "prompt template file not found")
        return cls.from_dict(obj, str(path))

    @classmethod
    def from_dict(cls, obj: Any, where: str = "<template>") -> "PromptTemplate":
        names = {f.name for f in fields(cls)}
        if not isinstance(obj, dict):
            raise FcpragError(f"{where}: expected a JSON object with keys among {sorted(names)}")
        for k, v in obj.items():
            if k not in names:
                raise FcpragError(f"{where}: unknown key '{k}'; expected keys among {sorted(names)}")
            if not (isinstance(v, str) or (k == "system" and v is None)):
                raise FcpragError(f"{where}: key '{k}' must be a string, got {type(v).__name__}")
        tpl = replace(cls(), **obj)
        tpl.validate(where)
        return tpl

    def validate(self, where: str = "<template>") -> None:
        need = {"param": ["{question}"], "combine": ["{question}", "{passages}"], "passage": ["{text}"]}
        for key, placeholders in need.items():
            for ph in placeholders:
                if ph not in getattr(self, key):
                    raise FcpragError(f"{where}: key '{key}' must contain the placeholder {ph}")

    def user_message(self, question: str, passages: Sequence[str] | None, prompt_mode: str, cot: bool) -> str:
        if prompt_mode not in PROMPT_MODES:
            raise FcpragError(f"unknown prompt mode '{prompt_mode}'; expected one of {list(PROMPT_MODES)}")
        q = question.strip()
        if prompt_mode == "param":
            text = self.param.format(question=q)
        else:
            block = "\n".join(self.passage.format(index=i + 1, text=p.strip()) for i, p in enumerate(passages or []))
            text = self.combine.format(question=q, passages=block)
        return text + (self.cot if cot else "")


@dataclass
class EncodedPrompt:
    """Token ids ``[P]`` of a prompt ending where the model should continue, and its text."""

    text: str
    ids: list[int]


def has_chat_template(tokenizer: Any) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def render_prompt(tokenizer: Any, template: PromptTemplate, question: str, passages: Sequence[str] | None,
                  prompt_mode: str, *, cot: bool = False, use_chat_template: bool | None = None) -> EncodedPrompt:
    """The prompt text and ids: the user message, through the chat template when the tokenizer has one
    (``use_chat_template=None``: automatic), followed by the assistant prefix (``answer_prefix``, unless ``cot``)."""
    user = template.user_message(question, passages, prompt_mode, cot)
    prefix = "" if cot else template.answer_prefix
    chat = has_chat_template(tokenizer) if use_chat_template is None else use_chat_template
    if chat:
        if not has_chat_template(tokenizer):
            raise FcpragError("the chat template was requested but the tokenizer has none")
        messages = ([{"role": "system", "content": template.system}] if template.system else []) + \
            [{"role": "user", "content": user}]
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) + prefix
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]  # the template already has its special tokens
    else:
        head = f"{template.system}\n\n" if template.system else ""
        text = f"{head}{user}\n{prefix}"
        ids = tokenizer(text, add_special_tokens=True)["input_ids"]
    return EncodedPrompt(text, list(ids))


def answer_ids(tokenizer: Any, prompt: EncodedPrompt, answer: str) -> list[int]:
    """Token ids of ``" " + answer`` as they follow the prompt.

    Tokenises prompt + answer jointly and keeps the tail when the prompt's ids are an exact prefix (so merges
    across the boundary match what the model would see); otherwise the answer is tokenised on its own.
    """
    cont = " " + answer.strip()
    joint = tokenizer(prompt.text + cont, add_special_tokens=False)["input_ids"]
    own = tokenizer(prompt.text, add_special_tokens=False)["input_ids"]
    if joint[: len(own)] == own and len(joint) > len(own):
        tail = list(joint[len(own):])
    else:
        tail = list(tokenizer(cont, add_special_tokens=False)["input_ids"])
    if not tail:
        raise FcpragError(f"the answer {answer!r} tokenises to no tokens")
    return tail

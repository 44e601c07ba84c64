"""Test double of DyPRAG's ``src/inference_dyprag.py`` (the per-question loop from the issue's description).

Per question: embed every passage (last layer, last token, ``[1, hidden]``), run the translator on it, average
each key over the passages, ``delta_inject``, predict, ``delta_remove``. ``question`` and ``passages`` are locals
of ``main``. ``--record`` saves the double's instrumentation; ``--extra_translator_call`` adds a stray translator
call per question (a capture that is out of step).
"""

import argparse
import json

import torch
from peft import LoraConfig, TaskType, get_peft_model

from projector import ParameterTranslator
from utils import delta_inject, delta_remove, get_model, load_data, predict
import projector as projector_module
import utils as utils_module


def main(args):
    data = load_data(args.data)
    model, tokenizer = get_model(args.seed)
    model = get_peft_model(model, LoraConfig(task_type=TaskType.CAUSAL_LM, target_modules=["down_proj", "gate_proj", "up_proj"],
                                             r=args.lora_rank, lora_alpha=32, lora_dropout=0.0))
    torch.manual_seed(args.seed + 1)
    projector = ParameterTranslator(["down_proj", "up_proj", "gate_proj"], list(range(model.config.num_hidden_layers)),
                                    model.config.hidden_size, model.config.intermediate_size, args.lora_rank).eval()
    preds = []
    for data_item in data:
        question = data_item["question"]
        passages = data_item["passages"]
        all_deltas = []
        if args.extra_translator_call:
            with torch.no_grad():
                projector(torch.zeros(1, model.config.hidden_size))
        for passage in passages:
            tokens = tokenizer(passage, return_tensors="pt")
            with torch.no_grad():
                output = model(tokens.input_ids, output_hidden_states=True)
                embedding = output.hidden_states[-1][:, -1, :]
                all_deltas.append(projector(embedding))
        merged_deltas = {}
        for key in all_deltas[0].keys():
            merged_deltas[key] = torch.stack([d[key] for d in all_deltas]).mean(dim=0)
        delta_inject(model, merged_deltas)
        preds.append({"question": question, "text": predict(model, tokenizer, question)})
        delta_remove(model, merged_deltas)
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            json.dump(preds, f, indent=1)
    if args.record:
        torch.save({"translator": projector_module.RECORD, "predict": utils_module.RECORD,
                    "passage_counts": [len(d["passages"]) for d in data]}, args.record)


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--data", required=True)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--lora_rank", type=int, default=2)
    parser.add_argument("--out")
    parser.add_argument("--record")
    parser.add_argument("--extra_translator_call", action="store_true")
    main(parser.parse_args())

"""PRAG-shaped inference loop (test double, see ../README.md). Run as: python src/inference.py ARGS."""

import argparse
import gc
import os

import torch
from peft import PeftModel

from prag_utils import generate, get_model, load_data, predict, save_capture


def main(args):
    filename, data_list = load_data(args.data_file)
    model = get_model(args.model_name)
    base_before = predict(model, "probe text")
    probes = {}
    if args.sample > 0:
        data_list = data_list[: args.sample]
    for test_id, data in enumerate(data_list):
        if args.context == "locals":
            # PRAG's own shape: the question and passages are local variables of the merging function.
            question = data["question"]
            passages = data["passages"]
            n_passages = len(passages)
            text = question
        else:
            q_text, psgs = data["question"], data["passages"]
            n_passages = len(psgs)
            text = q_text
            if args.context == "set_context":
                from fcprag_plugin.hosts import prag

                prag.set_context(q_text, psgs)
        for pid in range(n_passages):
            adapter_path = os.path.join(args.adapter_root, filename, f"data_{test_id}", f"passage_{pid}")
            if pid == 0:
                model = PeftModel.from_pretrained(model, adapter_path, adapter_name="0", is_trainable=False)
            else:
                model.load_adapter(adapter_path, adapter_name=str(pid))
        model.add_weighted_adapter(
            adapters=[str(i) for i in range(n_passages)],
            weights=[1] * n_passages,
            adapter_name="merge",
            combination_type="cat",
        )
        model.set_adapter("merge")
        logits = predict(model, text)
        generated = generate(model, text, args.generate) if args.generate > 0 else None
        if args.capture_dir:
            names = [str(i) for i in range(n_passages)]
            save_capture(model, "merge", names, logits, os.path.join(args.capture_dir, f"q{test_id}"), generated)
        model.delete_adapter("merge")
        model = model.unload()
        if args.capture_dir:
            probes[f"after_q{test_id}"] = predict(model, "probe text")  # the bare base model between questions
        gc.collect()
    if args.capture_dir:
        from safetensors.torch import save_file

        save_file({"before": base_before, "after": predict(model, "probe text"), **probes},
                  os.path.join(args.capture_dir, "base.safetensors"))
    print(f"done: {len(data_list)} questions")


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--model_name", required=True, help="local model directory")
    parser.add_argument("--data_file", required=True, help="{group}.json: a list of {question, passages}")
    parser.add_argument("--adapter_root", required=True)
    parser.add_argument("--sample", type=int, default=-1)
    parser.add_argument("--capture_dir")
    parser.add_argument("--context", choices=["locals", "set_context", "none"], default="locals")
    parser.add_argument("--generate", type=int, default=0, help="also greedy-generate this many tokens per question")
    args = parser.parse_args()
    torch.manual_seed(0)
    main(args)

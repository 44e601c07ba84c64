# examples/readme_example.py; run it from the repository root: python examples/readme_example.py [CONTROLLER_DIR]
import json
import sys
from pathlib import Path

from fcprag_plugin import FcpragError, FusionController, fuse

# One demo question, its 3 retrieved passages and their PEFT adapter directories (one LoRA per passage).
demo = Path("adapters/demo")
question = json.loads((demo / "manifest.json").read_text(encoding="utf-8"))["questions"][0]
query = question["question"]
passages = [p["text"] for p in question["passages"]]
adapter_dirs = [demo / p["adapter"] for p in question["passages"]]
ranks = [p["rank"] for p in question["passages"]]  # retrieval ranks: a side input of the recommended recipe

try:  # a missing directory or embedding model ends in one line naming it, not a traceback
    # A directory written by `fcprag train` (`make demo` trains runs/demo-controller), or None: PRAG's plain sum.
    controller = FusionController.from_pretrained(sys.argv[1]) if len(sys.argv) > 1 else None
    # The controller encodes query and passages with the embedding model it records and weights the passages.
    result = fuse(adapter_dirs, query, passages, controller=controller, retrieval_ranks=ranks)
except FcpragError as e:
    sys.exit(f"readme_example.py: {e}")
print("w~", [round(w, 4) for w in result.merge_weights], "g", result.g, "tau", result.tau)  # uniform: w~ = [1, 1, 1]
result.adapter.save_pretrained("runs/fused")  # a PEFT adapter directory: PeftModel.from_pretrained(base, "runs/fused")

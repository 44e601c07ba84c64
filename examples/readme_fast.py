# examples/readme_fast.py; run it from the repository root: python examples/readme_fast.py [CONTROLLER_DIR]
from readme_model import inputs, model, output  # first: it keeps transformers' progress bars off
from readme_example import adapter_dirs, controller, passages, query, ranks, result  # noqa: I001

from fcprag_plugin import fuse_into
from fcprag_plugin.slot import AdapterStore, FusedSlot

store = AdapterStore(budget_bytes=2**30)  # memory-mapped adapter directories, LRU bounded by bytes
slot = FusedSlot(model, store.get(adapter_dirs[0]), max_adapters=10, store=store)  # hooks the model once
with slot.fused(adapter_dirs, result.merge_weights):  # mode="cat" (exact) or "separate" (DyPRAG)
    fast = model.generate(**inputs, max_new_tokens=16, do_sample=False)
slot.remove()  # the model is exactly as before

# Or in one call: the weights from the controller, the merge written into the model's slot.
with fuse_into(model, adapter_dirs, query, passages, controller=controller, retrieval_ranks=ranks):
    fast_too = model.generate(**inputs, max_new_tokens=16, do_sample=False)
print("same tokens as the merged adapter:", fast.tolist() == output.tolist() == fast_too.tolist())

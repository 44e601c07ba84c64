import pytest

from helpers import hash_encoder, make_adapter_dir


@pytest.fixture
def adapter_dirs(tmp_path):
    """Three real PEFT adapters (r=2, alpha=32, gate/up/down_proj) for the tiny Llama."""
    return [make_adapter_dir(tmp_path / f"passage_{i}", seed=i) for i in range(3)]


@pytest.fixture
def encoder16():
    return hash_encoder(16)


@pytest.fixture
def labelled(tmp_path):
    """A label file, a validation file, and an embedding cache that already holds every text under the model
    name 'syn8' (so the CLI, given --encoder syn8, never has to load a model)."""
    from fcprag_plugin.training.embed_cache import EmbeddingCache, embed_texts
    from fcprag_tools.synthetic import synthetic_records, table_encoder, write_labels

    recs, table = synthetic_records(120, (2, 4), 8, seed=11)
    vrecs, vtable = synthetic_records(30, 3, 8, seed=12, prefix="v")
    table.update(vtable)
    write_labels(recs, tmp_path / "train.jsonl")
    write_labels(vrecs, tmp_path / "val.jsonl")
    cache = tmp_path / "cache"
    embed_texts(list(table), table_encoder(table, "syn8"), EmbeddingCache(cache, "syn8"))
    return tmp_path, cache

"""The language-model runtime the tooling stands on (the label builder and ``fcprag study``): loading a causal LM
(:mod:`.model_io`), prompts (:mod:`.prompts`), batched scoring and greedy answers under per-row adapter mixtures
(:mod:`.batched`, :mod:`.mixed`) or per-row Arrow routing (:mod:`.arrow`), answer metrics (:mod:`.metrics`),
batches that halve on a device out-of-memory error (:mod:`.oom`), batch sizes by device (:mod:`.sizing`), sharding
over processes (:mod:`.shard`) and resumable JSON Lines stores (:mod:`.store`, :mod:`.units`)."""

"""The language-model runtime the tooling stands on (the label builder and ``fcprag study``): loading a causal LM
(:mod:`.model_io`), prompts (:mod:`.prompts`), batched scoring and greedy answers under per-row adapter mixtures
(:mod:`.batched`, :mod:`.mixed`), answer metrics (:mod:`.metrics`), sharding over processes (:mod:`.shard`) and
resumable JSON Lines stores (:mod:`.store`, :mod:`.units`)."""

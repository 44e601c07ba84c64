"""Tooling beside the fusion library :mod:`fcprag_plugin`: the ``fcprag`` command (:mod:`.cli`), the language-model
runtime it stands on (:mod:`.lm`: loading, prompts, batched scoring, metrics, sharding, stores), the leave-one-out
label builder (:mod:`.label_builder`), ``fcprag study`` (:mod:`.study`), training plots (:mod:`.plots`) and
synthetic label sets (:mod:`.synthetic`). The library never needs it to fuse; it ships in the same distribution."""

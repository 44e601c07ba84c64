"""Tooling beside the fusion library :mod:`fcprag_plugin`: the ``fcprag`` command (:mod:`.cli`), the leave-one-out
label builder (:mod:`.labels`), mixed-batch scoring (:mod:`.mixed`), training plots (:mod:`.plots`) and synthetic
label sets (:mod:`.synthetic`). The library never needs it to fuse; it ships in the same distribution."""

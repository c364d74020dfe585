"""The automatic pipeline cut: where the layers are cut into stages (:mod:`.partition`), from the layers' measured
times (:mod:`.timing`), and a layer split between two stages by rows (:mod:`.split`); :mod:`.automatic` runs
them for a model."""

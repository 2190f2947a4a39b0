"""The model and its device state: loading, presets, a sequence's footprint, the model runner's graph-
safe step, the persistent batch's tensors, KV and state slots and their sizing, the sampler, freed
memory given back."""

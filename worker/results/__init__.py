"""A finished job's results in the artifact store: the activations file and manifest, each attempt's
own folder, and the store writes kept off the engine's way."""

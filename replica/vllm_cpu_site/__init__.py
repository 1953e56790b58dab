"""A directory the launcher puts first on a CPU replica's PYTHONPATH: its ``sitecustomize`` runs at
the start of every vLLM process (the API server and the engine core it spawns).  See there."""

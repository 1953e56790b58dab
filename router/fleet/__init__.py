"""The fleet: which replicas there are (discovery), whether they are up (health, breakers), what
they serve (the model catalogue, cache geometry), how loaded they are (scrapes), and their KV events."""

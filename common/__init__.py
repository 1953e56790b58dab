"""What the router and the replicas both speak, below both of them: the OpenAI request schema and
its errors (requests.py, responses.py, errors.py), a model's tokenizer and chat template (tokens/),
token ids -> KV block hashes (blocks.py), a replica's registration in Redis (registry.py), vLLM's
/metrics (scrape.py) and the log lines (logs.py).  It imports nothing else of kvroute."""

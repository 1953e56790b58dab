"""Forwarding a routed request to its replica: the pooled upstream client, the first byte, the
SSE relay, the replicas' errors in OpenAI's shape.  It answers with values; it calls nothing above it."""

"""The edge: the HTTP server the clients talk to (timeouts, bodies, the drain cutoff), admission
(API keys, the in-flight limit), the handlers, and the access log.  It calls the request layer;
nothing below calls it."""

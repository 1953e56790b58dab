"""Where a request goes: the routing sequence (lookup -> choose -> record -> load) that the router
and the simulator share, the router-side load, and the policies."""

"""Where a request goes: the routing sequence (lookup -> choose -> commit, then first_token and
finished) that the router and the simulator share, the router-side load, and the policies."""

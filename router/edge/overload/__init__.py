"""Overload: the admission queue (``queue.py``), its fair order across tenants and priority classes
(``fair_queue.py``, ``tenants.py``), and the router's own saturation that decides when requests
queue (``saturation.py``).  design.md §7.6."""

"""Adaptive placement: the profiler (profile/), a layout and its mapping to the config
(layout.py), the pipeline simulator (sim.py) charging a profile's service times (costs.py), and
the layout planner (planner.py). The runtime controllers they plan for (band weights, the VAE
cut) are the supervisor's (supervisor/bands.py, supervisor/cut.py)."""

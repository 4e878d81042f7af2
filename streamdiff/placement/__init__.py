"""Adaptive placement: the profiler (profile.py), the pipeline simulator (sim.py) and the layout
planner (planner.py). The runtime controllers they plan for (band weights, the VAE cut) are the
supervisor's (supervisor/bands.py, supervisor/cut.py)."""

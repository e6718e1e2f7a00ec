"""The control plane: the pure planner (estimates, hierarchy sizing, placement, reuse) and its loop."""

"""A lifl worker node: its supervisor, node agent and their parts, and `--nodes N` emulation."""

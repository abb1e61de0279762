"""Control-plane logic shared by the real control plane and the simulator. Pure Python:
importing it imports no ray, torch or engine."""

"""StaleFlow's stand-in for torchvision, CI's SGLang environment only (see ``_stand_in.py``).

The version is that of the torchvision release built for torch 2.13 (the project's pin),
with a local label that says what this is: transformers compares it for its video and
image utilities, which a text model never calls.
"""

__version__ = "0.28.0+staleflow.standin"

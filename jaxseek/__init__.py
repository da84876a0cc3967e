"""jaxseek: train the DeepSeek Transformer family in JAX/Flax on one named device mesh.

`from jaxseek import load_pretrained` imports the conversion code on first use, so `import jaxseek` stays cheap.
"""

from __future__ import annotations

from typing import Any


def __getattr__(name: str) -> Any:
  if name == "load_pretrained":
    from jaxseek.convert.pretrained import load_pretrained
    return load_pretrained
  raise AttributeError(f"module 'jaxseek' has no attribute {name!r}")

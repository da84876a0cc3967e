"""The sharding layout explorer: does a model fit a mesh, what does each device hold, what moves between them.

`python -m jaxseek.explore` is the command (`__main__`); `core` holds `describe`, `plan`, `hardware` and
`mesh_sizes`. Modules: layout (placement), memory, comm, compile (--compile), gpu (--compile --target, device
descriptions in targets/), suggest (--suggest, out-of-memory advice), report (console tables, --plot).
"""

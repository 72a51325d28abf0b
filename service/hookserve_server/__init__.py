"""hookserve_server: the torch side of hookserve (engine, servicer, server).

Importing this package does not import torch; `hookserve_server.app.serve` does.
"""

__all__ = ["__version__"]
__version__ = "0.1.0"

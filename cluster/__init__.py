"""Front doors of RayFactory: the ``rayfactory`` CLI, the run config, the driver."""

__version__ = "0.1.0"

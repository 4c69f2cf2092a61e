"""dipaco: Distributed Path Composition (DiPaCo) for volunteer and lab GPUs."""

__version__ = "0.1.0"

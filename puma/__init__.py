"""PUMA: Parameter-efficient Unified Metric leArning (Kim, Kim and Kwak, WACV 2025) on Ray.

The library is importable without Ray side effects; Ray is imported only by
``puma.data.pipeline``, ``puma.train`` and the batch-inference code.
"""

__version__ = "0.1.0"

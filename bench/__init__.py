"""Benchmarks and fault runs. Not shipped: run from a checkout (``make bench``)."""

from __future__ import annotations

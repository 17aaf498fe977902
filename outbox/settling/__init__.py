"""Settling: the one settle step that lookups, provider webhooks and operators share (compare-and-set, evidence stored, never a send)."""

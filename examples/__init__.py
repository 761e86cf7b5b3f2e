"""Worked adapters: how to plug your own kernel into ``dsv4-oracle check``."""

"""Tests of reference."""

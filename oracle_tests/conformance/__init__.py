"""Tests of conformance."""

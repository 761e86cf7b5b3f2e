"""Tests of cp."""

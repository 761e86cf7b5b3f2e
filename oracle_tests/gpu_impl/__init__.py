"""Tests of gpu_impl."""

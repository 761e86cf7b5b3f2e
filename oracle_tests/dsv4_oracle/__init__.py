"""Tests of dsv4_oracle."""

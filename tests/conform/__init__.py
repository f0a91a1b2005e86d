"""Tests of conform."""

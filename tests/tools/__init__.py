"""Tests of tools."""

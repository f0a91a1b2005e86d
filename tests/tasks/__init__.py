"""Tests of tasks."""

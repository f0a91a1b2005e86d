"""Tests of queue."""

"""The test suite: one package for each package it tests, and what they share in tests.support.
Tests run against real PostgreSQL and Redis (gpuportal.testing) and may import anything."""
